"""Learner optimizer over FP32 master weights, and the per-step weight-sync verification.

**Master weights.** The learner graph's parameters are BF16. An AdamW step of size ``lr ~ 1e-6``
applied to BF16 directly is rounded away for almost every element (a BF16 weight of 0.05 has an
ulp of 2.4e-4), so :class:`MasterOptimizer` keeps FP32 master copies, steps those, and writes
``bf16(master)`` back into the graph parameters after each step (mixed-precision training as in
Megatron / DeepSpeed). The graph parameters stay the single source the learner forward, weight
sync and the parity checker read.

**Sync verification** (:func:`verify_sync`), cheap enough for every step: after
:func:`qpass.runtime.sync_weights`, each rollout weight group is fingerprinted three ways and
the three must agree bit for bit:

1. the fingerprint the sync reported;
2. the bytes the rollout graph now holds (read back from its constant buffers);
3. an independent quantization of the learner's current weights: for groups the learner
   fake-quantizes (``weight_qdq``: w4a16_qat, quads_nvfp4, w4a4_qat) with the *learner's* group
   membership and ``qpass::group_amax``, exactly what the learner graph computes (so 3 == 2 is the
   bit-level parity claim); for groups with a BF16 learner (naive_nvfp4, fp8_block) with the
   rollout's membership (a freshness check: the rollout holds the quantization of the current
   weights, SPEC §3 rule 2).

The full :func:`qpass.parity.checker.check_weights_bitexact` (canonical parity objects plus the
learner op's dequantized output versus the decode of the rollout bytes) runs every N steps.

**Update visibility** (SPEC §4) compares the rollout's quantized constants before and after a sync:
:func:`snapshot_rollout_constants` clones them, :func:`byte_visibility` counts changed canonical
codes / scale bytes / global scales on device without decoding (the canonical form of SPEC §3 rule
4, as :mod:`qpass.parity.object`), and :func:`qpass.diagnostics.update_visibility_groups` adds the
decoded-value fraction when a full report is wanted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from qpass.graph.qgraph import QGraph
from qpass.formats.spec import FP8Spec, NVFP4_WEIGHT, NVFP4Spec
from qpass.quant.nvfp4 import BLOCK, NVFP4Tensor
from qpass.quant.weights import cached_reference_quantize

__all__ = [
    "MasterOptimizer",
    "RolloutConstants",
    "SyncVerification",
    "byte_visibility",
    "has_learner_qdq",
    "nvfp4_groups",
    "snapshot_rollout_constants",
    "verify_sync",
]


# --------------------------------------------------------------------------- optimizer


class MasterOptimizer:
    """AdamW over master copies of a list of parameters (see module docstring).

    Args:
        params: the learner's trainable parameters (any float dtype).
        lr, betas, eps, weight_decay: :class:`torch.optim.AdamW` options.
        master_dtype: dtype of the master copies; parameters already in this dtype are stepped in
            place (no copy). ``None`` steps every parameter in its own dtype.
        grad_norm_fn: ``fn(params, master_grads) -> 0-dim tensor``, the global gradient L2 norm when
            the parameters are shards of a larger model (a tensor-parallel learner reduces it over
            its ranks); None: the norm of these gradients (``clip_grad_norm_``).
    Raises:
        ValueError: no parameters, or a non-positive/non-finite ``lr``.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        master_dtype: torch.dtype | None = torch.float32,
        grad_norm_fn: Callable[[list[torch.nn.Parameter], list[torch.Tensor]], torch.Tensor] | None = None,
    ) -> None:
        self.grad_norm_fn = grad_norm_fn
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("MasterOptimizer: no trainable parameters")
        if not (lr > 0 and math.isfinite(lr)):
            raise ValueError(f"lr must be finite and > 0, got {lr}")
        self.master = []
        for p in self.params:
            if master_dtype is None or p.dtype == master_dtype:
                self.master.append(p)
            else:
                self.master.append(p.detach().to(master_dtype).clone().requires_grad_(True))
        self.opt = torch.optim.AdamW(self.master, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.n_elements = sum(p.numel() for p in self.params)

    def zero_grad(self) -> None:
        """Drop the gradients of the parameters and the masters."""
        for p, m in zip(self.params, self.master):
            p.grad = None
            m.grad = None

    @torch.no_grad()
    def step(self, grad_clip: float | None) -> dict[str, float]:
        """Move gradients to the masters, clip, step, write the masters back.

        A non-finite gradient norm skips the step (the masters and parameters stay as they were).

        Args:
            grad_clip: max global L2 norm of the gradient (None or inf: no clipping).
        Returns:
            ``grad_norm`` (before clipping), ``skipped`` (1.0 if not stepped), ``n_changed``
            (parameter elements whose stored value changed), ``changed_frac``.
        """
        grads, owners = [], []
        for p, m in zip(self.params, self.master):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.to(m.dtype)
            if m.grad is not None:
                grads.append(m.grad)
                owners.append(p)
        if self.grad_norm_fn is None and not grads:
            return {"grad_norm": 0.0, "skipped": 1.0, "n_changed": 0.0, "changed_frac": 0.0}
        max_norm = math.inf if grad_clip is None else float(grad_clip)
        with_grad = [m for m in self.master if m.grad is not None]
        if self.grad_norm_fn is None:
            norm = float(torch.nn.utils.clip_grad_norm_(with_grad, max_norm))
        else:  # every shard of a sharded model calls this (a collective), with or without gradients
            total = self.grad_norm_fn(owners, grads)
            norm = float(total)
            if not grads:
                return {"grad_norm": norm, "skipped": 1.0, "n_changed": 0.0, "changed_frac": 0.0}
            if math.isfinite(norm):
                torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total)
        if not math.isfinite(norm):
            return {"grad_norm": norm, "skipped": 1.0, "n_changed": 0.0, "changed_frac": 0.0}
        olds = [p.detach().clone() for p, m in zip(self.params, self.master) if m is p]
        self.opt.step()
        changed = 0
        k = 0
        for p, m in zip(self.params, self.master):
            if m is p:
                changed += int((p != olds[k]).sum())
                k += 1
            else:
                new = m.detach().to(p.dtype)
                changed += int((new != p).sum())
                p.copy_(new)
        return {"grad_norm": norm, "skipped": 0.0, "n_changed": float(changed), "changed_frac": changed / self.n_elements}


# --------------------------------------------------------------------------- rollout constants


def nvfp4_groups(rollout: QGraph) -> dict[str, list[str]]:
    """``{group id: [site, ...]}`` of the rollout's NVFP4 linears, in the order weight sync uses."""
    groups: dict[str, list[str]] = {}
    for sid, rec in rollout.quant.items():
        if rec.lowered_as(NVFP4Spec):
            groups.setdefault(rec.group, []).append(sid)
    return groups


def _fp8_sites(rollout: QGraph) -> list[str]:
    return [sid for sid, rec in rollout.quant.items() if rec.lowered_as(FP8Spec)]


def has_learner_qdq(learner: QGraph) -> bool:
    """True if the learner graph fake-quantizes any weight (``weight_qdq`` sites)."""
    return any(rec.weight_fake_quant for rec in learner.quant.values())


@dataclasses.dataclass
class RolloutConstants:
    """Clones of the rollout's quantized weight constants.

    Attributes:
        nvfp4: ``{site: (codes uint8 [.., K/2], scales e4m3 [.., K/16], s_dec f32)}``.
        fp8: ``{site: (data e4m3 [R, K], scale f32)}``.
    """

    nvfp4: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    fp8: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def nvfp4_tensors(self) -> dict[str, NVFP4Tensor]:
        """``{site: NVFP4Tensor}`` views (for :func:`qpass.diagnostics.update_visibility_groups`)."""
        return {s: NVFP4Tensor.from_parts(c, sc, d) for s, (c, sc, d) in self.nvfp4.items()}


@torch.no_grad()
def snapshot_rollout_constants(rollout: QGraph) -> RolloutConstants:
    """Clone every quantized weight constant the rollout graph holds (NVFP4 and FP8 sites)."""
    nv, f8 = {}, {}
    for sid, rec in rollout.quant.items():
        c = rec.constants
        if rec.lowered_as(NVFP4Spec):
            nv[sid] = tuple(rollout.gm.get_buffer(c[k]).detach().clone() for k in ("codes", "scales", "s_dec"))
        elif rec.lowered_as(FP8Spec):
            f8[sid] = tuple(rollout.gm.get_buffer(c[k]).detach().clone() for k in ("data", "scale"))
    return RolloutConstants(nv, f8)


def _canonical_blocks(cb: torch.Tensor, sb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical form (SPEC §3 rule 4, as :func:`qpass.parity.object.parity_object_from_parts`) of blocks.

    Args:
        cb: uint8 ``[..., 8]``: the packed codes of one 16-element block per row (low nibble first).
        sb: uint8 ``[...]``: the block's E4M3 scale byte.
    Returns:
        ``(codes uint8 [..., 16], scale bytes uint8 [...])``: ``-0`` codes as ``+0``, E4M3 ``-0``
        scales as 0, and every block that decodes to all zeros as zero codes with a zero scale.
    """
    codes = torch.stack([cb & 0xF, cb >> 4], dim=-1).reshape(*cb.shape[:-1], BLOCK)
    codes = torch.where(codes == 0x8, torch.zeros_like(codes), codes)
    sb = torch.where(sb == 0x80, torch.zeros_like(sb), sb)
    nan_scale = (sb & 0x7F) == 0x7F
    zero = (sb == 0) | ((codes == 0).all(dim=-1) & ~nan_scale)
    codes = torch.where(zero.unsqueeze(-1), torch.zeros_like(codes), codes)
    return codes, torch.where(zero, torch.zeros_like(sb), sb)


@torch.no_grad()
def byte_visibility(before: RolloutConstants, after: RolloutConstants) -> dict[str, float]:
    """Fraction of canonical weight codes / scale bytes / global scales that a sync changed.

    NVFP4 sites are compared in canonical form (``-0`` codes equal ``+0``; a block decoding to all
    zeros equals any other such block), FP8 sites byte for byte (element bytes and float32 scale
    bits). Counts agree with :func:`qpass.diagnostics.update_visibility` (codes, scales, globals).

    Returns:
        ``code_frac``, ``scale_frac``, ``global_frac`` (NVFP4, element-/block-/tensor-weighted),
        ``fp8_data_frac``, ``fp8_scale_frac`` and the totals ``n_codes``, ``n_scales``,
        ``n_fp8`` (NaN fractions where there is nothing of that kind).
    Raises:
        ValueError: the two snapshots hold different sites or shapes.
    """
    if set(before.nvfp4) != set(after.nvfp4) or set(before.fp8) != set(after.fp8):
        raise ValueError("byte_visibility: the snapshots hold different sites")
    # counts stay on the device; the host reads them once at the end (one sync, not several per site)
    nc = ns = ng = nf = nfs = 0
    counts: list[torch.Tensor] = []  # [global changes, code changes, scale changes, fp8 data, fp8 scale] per site
    blocks: list[tuple[torch.Tensor, ...]] = []  # per site: raw (block) bytes of both snapshots, flattened to [n, 8] / [n]
    half = BLOCK // 2
    for sid, (c0, s0, d0) in before.nvfp4.items():
        c1, s1, d1 = after.nvfp4[sid]
        if c0.shape != c1.shape or s0.shape != s1.shape:
            raise ValueError(f"byte_visibility: shapes differ at site {sid}")
        nc += c0.numel() * 2
        ns += s0.numel()
        ng += d0.numel()
        counts.append((d0.float().view(torch.int32) != d1.float().view(torch.int32)).sum())
        sb0 = s0.view(torch.uint8) if s0.dtype != torch.uint8 else s0
        sb1 = s1.view(torch.uint8) if s1.dtype != torch.uint8 else s1
        blocks.append((c0.reshape(-1, half), c1.reshape(-1, half), sb0.reshape(-1), sb1.reshape(-1)))
    if blocks:
        # canonical bytes can only differ in blocks whose raw bytes differ: canonicalize just those
        cb0, cb1, sb0, sb1 = (torch.cat([b[i] for b in blocks]) for i in range(4))
        raw = (sb0 != sb1) | (cb0 != cb1).any(dim=-1)
        a_codes, a_sb = _canonical_blocks(cb0[raw], sb0[raw])
        b_codes, b_sb = _canonical_blocks(cb1[raw], sb1[raw])
        counts_nv = torch.stack([(a_codes != b_codes).sum(), (a_sb != b_sb).sum()])
    for sid, (x0, sc0) in before.fp8.items():
        x1, sc1 = after.fp8[sid]
        nf += x0.numel()
        nfs += sc0.numel()
        counts.append((x0.view(torch.uint8) != x1.view(torch.uint8)).sum())
        counts.append((sc0.float().view(torch.int32) != sc1.float().view(torch.int32)).sum())
    host = [int(v) for v in torch.stack([c.to(counts[0].device) for c in counts]).tolist()] if counts else []
    n_nv = len(before.nvfp4)
    ngc = sum(host[:n_nv])
    nfc = sum(host[n_nv::2])
    nfsc = sum(host[n_nv + 1::2])
    ncc, nsc = (int(v) for v in counts_nv.tolist()) if blocks else (0, 0)
    nan = float("nan")
    return {
        "code_frac": ncc / nc if nc else nan,
        "scale_frac": nsc / ns if ns else nan,
        "global_frac": ngc / ng if ng else nan,
        "fp8_data_frac": nfc / nf if nf else nan,
        "fp8_scale_frac": nfsc / nfs if nfs else nan,
        "n_codes": float(nc),
        "n_scales": float(ns),
        "n_fp8": float(nf),
    }


# --------------------------------------------------------------------------- verification


@dataclasses.dataclass
class SyncVerification:
    """Result of :func:`verify_sync`.

    Attributes:
        ok: every checked group agreed three ways (True when there was nothing to check).
        n_checked: groups (NVFP4) plus sites (FP8) checked.
        n_aligned: of those, NVFP4 groups the learner fake-quantizes (bit-level parity claim).
        mismatches: ``"group: which fingerprints differ"`` for each failing group.
    """

    ok: bool
    n_checked: int
    n_aligned: int
    mismatches: list[str]

    def to_dict(self, prefix: str = "") -> dict[str, Any]:
        return {f"{prefix}fp_ok": self.ok, f"{prefix}fp_checked": self.n_checked, f"{prefix}fp_aligned": self.n_aligned,
                f"{prefix}fp_mismatches": self.mismatches[:5]}


def _fingerprint(*tensors: torch.Tensor) -> str:
    from qpass.runtime.sync import fingerprint as fp  # the hash sync reports; one definition

    return fp(*tensors)


def _learner_group_amax(learner: QGraph, lparams: Mapping[str, torch.Tensor], sid: str) -> torch.Tensor:
    members = learner.quant[sid].members
    ws = [lparams[learner.quant[m].weight].detach() for m in members]
    return torch.ops.qpass.group_amax(ws)


@torch.no_grad()
def verify_sync(learner: QGraph, rollout: QGraph, fingerprints: Mapping[str, str]) -> SyncVerification:
    """Three-way fingerprint check of a weight sync (see module docstring).

    Args:
        learner, rollout: the two graphs right after :func:`qpass.runtime.sync_weights`.
        fingerprints: ``SyncReport.fingerprints`` of that sync (group id or FP8 site -> hash).
    Returns:
        :class:`SyncVerification`.

    Inside :func:`qpass.quant.reuse.reuse_weight_quantization` (the GRPO step) the learner-side
    quantization of a weight at the same version, amax bits and spec as the sync's is the sync's
    own result (not recomputed): the check then covers membership, amax, the rollout buffers and
    the reported fingerprint, while quantizer determinism is left to the full bit-exact check
    (which runs without reuse).
    """
    from qpass import ops  # noqa: F401 - registers qpass::group_amax

    lparams = dict(learner.gm.named_parameters(remove_duplicate=False))
    mismatches: list[str] = []
    n_checked = n_aligned = 0
    for gid, sids in nvfp4_groups(rollout).items():
        aligned = all(s in learner.quant and learner.quant[s].weight_fake_quant for s in sids)
        parts_l: list[torch.Tensor] = []
        parts_r: list[torch.Tensor] = []
        if aligned:
            amax = _learner_group_amax(learner, lparams, sids[0])
        else:
            amax = torch.ops.qpass.group_amax([lparams[rollout.quant[s].weight].detach() for s in sids])
        for sid in sids:
            w = lparams[(learner.quant[sid] if aligned else rollout.quant[sid]).weight].detach()
            q = cached_reference_quantize(NVFP4_WEIGHT, w, amax, site=sid)
            parts_l += [q.codes, q.scales, q.s_dec]
            c = rollout.quant[sid].constants
            parts_r += [rollout.gm.get_buffer(c[k]) for k in ("codes", "scales", "s_dec")]
        fl, fr, fs = _fingerprint(*parts_l), _fingerprint(*parts_r), fingerprints.get(gid)
        n_checked += 1
        n_aligned += int(aligned)
        if not (fl == fr == fs):
            mismatches.append(f"{gid}: learner-side {fl}, rollout bytes {fr}, sync report {fs}")
    for sid in _fp8_sites(rollout):
        rec = rollout.quant[sid]
        q = cached_reference_quantize(rec.spec, lparams[rec.weight].detach(), None, site=sid)
        c = rec.constants
        fl = _fingerprint(q.data, q.scale)
        fr = _fingerprint(rollout.gm.get_buffer(c["data"]), rollout.gm.get_buffer(c["scale"]))
        fs = fingerprints.get(sid)
        n_checked += 1
        if not (fl == fr == fs):
            mismatches.append(f"{sid}: learner-side {fl}, rollout bytes {fr}, sync report {fs}")
    return SyncVerification(not mismatches, n_checked, n_aligned, mismatches)
