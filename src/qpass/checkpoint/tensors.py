"""Checkpoint-format tensors for engines: initial load and RL weight updates (pure python).

The same tensors serve SGLang and vLLM (both load ``modelopt_fp4`` names through their fused-shard
loaders). SGLang's RL update path (``begin_weight_update`` -> ``update_weights_from_tensor(named_tensors)`` ...
-> ``end_weight_update``, prior-art/backends.md §1.4) feeds ``(name, tensor)`` pairs to the model's
``load_weights``, i.e. the **checkpoint** names and layouts; the model maps ``q/k/v_proj`` onto its
fused ``qkv_proj`` (and ``gate/up_proj`` onto ``gate_up_proj``) with a shard id, and each shard's
``weight_scale_2`` lands in its own slot. qpass therefore sends, per quantized site::

    <site>.weight          uint8 [N, K/2]          E2M1 codes, low nibble = even k
    <site>.weight_scale    float8_e4m3fn [N, K/16] block scales
    <site>.weight_scale_2  float32 []              S_dec (identical bits across a fused group)

and the unquantized parameters (norms, embeddings, lm_head) in their own dtype. The rollout never
re-quantizes bf16 weights itself (SPEC §3 rule 3): :func:`quantize_state_dict` is the trainer-side
call that produces these tensors with qpass's quantizer and one shared amax per fused group
(SPEC §3 rule 1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from qpass.checkpoint.params import check_site_tensors
from qpass.errors import QpassError
from qpass.graph.sites import DEFAULT_EXCLUDE, _group_of, _matches
from qpass.formats.spec import nvfp4_weight_spec
from qpass.quant.nvfp4 import NVFP4Tensor
from qpass.quant.weights import quantize_site_weights
from qpass.tables import entry

SGLANG_SUFFIXES = ("weight", "weight_scale", "weight_scale_2")


def named_tensors_from_rollout(source: Any, *, extra: Mapping[str, torch.Tensor] | None = None) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs for ``update_weights_from_tensor`` from a qpass rollout.

    Args:
        source: rollout ``QGraph`` or a ``qpass apply`` output directory (``DIR`` or
            ``DIR/rollout`` with ``weights.safetensors``).
        extra: unquantized parameters to send too (e.g. the learner's norms/embeddings/lm_head
            under HF names); names that collide with a quantized site's tensors are an error.
    Returns:
        Sorted pairs; NVFP4 sites only (SGLang's ``qpass_nvfp4`` method serves NVFP4 linears).
    Raises:
        QpassError: non-NVFP4 quantized sites, a fused group whose global scales differ, or a
            name collision with ``extra``.
    """
    tensors = _rollout_tensor_dict(source)
    out: dict[str, torch.Tensor] = {}
    sites = sorted({k[: -len(".weight_scale_2")] for k in tensors if k.endswith(".weight_scale_2")})
    other = sorted(k for k in tensors if k.endswith(".weight") and k[: -len(".weight")] not in sites)
    if other:
        raise QpassError(f"SGLang qpass_nvfp4 serves NVFP4 sites only; the rollout also has {other[:3]} (FP8/MXFP4)")
    origin = _origin(source)
    for s in sites:
        missing = [x for x in SGLANG_SUFFIXES if f"{s}.{x}" not in tensors]
        if missing:
            raise QpassError(f"{origin}: site {s} has no {', '.join(f'{s}.{x}' for x in missing)}")
        check_site_tensors(s, *(tensors[f"{s}.{x}"] for x in SGLANG_SUFFIXES), source=origin)
        for suffix in SGLANG_SUFFIXES:
            out[f"{s}.{suffix}"] = tensors[f"{s}.{suffix}"].contiguous()
    check_fused_global_scales(out)
    for name, t in (extra or {}).items():
        if name in out:
            raise QpassError(f"extra tensor {name} collides with a quantized site's checkpoint tensor")
        out[name] = t
    return sorted(out.items())


def _rollout_file(d: Path) -> Path:
    return d / "rollout" / "weights.safetensors" if (d / "rollout").is_dir() else d / "weights.safetensors"


def _origin(source: Any) -> str:
    """How errors name the source: the file read, or the rollout graph."""
    return str(_rollout_file(Path(source))) if isinstance(source, str | Path) else "rollout graph"


def _rollout_tensor_dict(source: Any) -> dict[str, torch.Tensor]:
    if isinstance(source, str | Path):
        from safetensors.torch import load_file

        f = _rollout_file(Path(source))
        if not f.exists():
            raise QpassError(f"{f} not found (expected a qpass apply output directory)")
        try:
            return load_file(str(f))
        except Exception as e:  # noqa: BLE001 - safetensors raises bare errors (truncated, bad header) without the path
            raise QpassError(f"{f}: not a readable safetensors file (truncated or corrupt?): {e}") from e
    out: dict[str, torch.Tensor] = {}
    for sid, rec in source.quant.items():  # a rollout QGraph: its constants under checkpoint names
        if rec.lowered:
            consts = {k: source.gm.get_buffer(attr).detach().cpu() for k, attr in rec.constants.items()}
            out.update(entry("export", rec.spec).tensors(sid, consts))
    return out


def check_fused_global_scales(named: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Every fused group (q/k/v, gate/up) carries one ``weight_scale_2`` bit pattern.

    SGLang keeps one global per shard but its modelopt path uses ``max`` without rescaling the
    block scales (prior-art/backends.md §1.3), so unequal shard globals would silently change
    the numbers. Returns ``{group id: number of members}``.

    Raises:
        QpassError: names the group and the differing members.
    """
    groups: dict[str, dict[str, int]] = {}
    for name, t in named.items():
        if name.endswith(".weight_scale_2"):
            site = name[: -len(".weight_scale_2")]
            bits = int(t.detach().float().reshape(-1)[:1].view(torch.int32).item())
            groups.setdefault(_group_of(site), {})[site] = bits
    for gid, members in groups.items():
        if len(set(members.values())) > 1:
            raise QpassError(
                f"fused group {gid}: weight_scale_2 differs between members "
                f"{ {k: hex(v & 0xFFFFFFFF) for k, v in members.items()} }; qpass shares one global scale per group (SPEC §3 rule 1)"
            )
    return {g: len(m) for g, m in groups.items()}


def quantize_state_dict(
    state: Mapping[str, torch.Tensor], *, targets: Sequence[str] = ("*",), exclude: Sequence[str] = DEFAULT_EXCLUDE,
    process_group: object | None = None, arithmetic: str = "te_reference",
) -> list[tuple[str, torch.Tensor]]:
    """Trainer side: HF-named learner weights -> checkpoint-format named tensors for an engine.

    Every 2-D ``<site>.weight`` whose site matches ``targets`` and not ``exclude`` and whose K is a
    multiple of 16 is quantized with :func:`qpass.quant.weights.quantize_site_weights` (fresh amax,
    SPEC §3 rule 2); fused groups (q/k/v, gate/up) share one amax; other tensors pass through unchanged.

    Args:
        state: ``{HF name: tensor}`` (full, unsharded weights).
        targets, exclude: site selectors as in recipes (globs or ``re:``).
        process_group: if the weights are sharded over ranks along K or N (each rank passes its
            shards), the group amax is all-reduced with MAX over it.
        arithmetic: the weight quantizer arithmetic (``te_reference`` | ``modelopt``, the
            checkpoint's ``weight_arithmetic``; ``NVFP4Spec.arithmetic``).
    Returns:
        Sorted ``(name, tensor)`` pairs.
    """
    groups: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        site = name[: -len(".weight")] if name.endswith(".weight") else None
        if (
            site is not None and t.dim() == 2 and t.shape[-1] % 16 == 0 and t.is_floating_point()
            and any(_matches(site, p) for p in targets) and not any(_matches(site, p) for p in exclude)
        ):
            groups.setdefault(_group_of(site), {})[site] = t.detach()
        else:
            out[name] = t
    spec = nvfp4_weight_spec(arithmetic)
    for members in groups.values():
        quantized = quantize_site_weights(spec, members, names={s: f"{s}.weight" for s in members},
                                          process_group=process_group)
        for site, sw in quantized.items():
            out.update(checkpoint_tensors(site, sw.tensor))
    return sorted(out.items())


def checkpoint_tensors(site: str, q: NVFP4Tensor) -> dict[str, torch.Tensor]:
    """The ``modelopt_fp4`` tensors SGLang loads for one quantized weight (``export`` table entry)."""
    consts = {"codes": q.codes, "scales": q.scales, "s_dec": q.s_dec.reshape(()).float()}
    return entry("export", q.spec).tensors(site, consts)


def tp_shard(name: str, tensor: torch.Tensor, *, tp_rank: int, tp_size: int, parallel: str) -> torch.Tensor:
    """The slice of a checkpoint tensor that SGLang's loader gives TP rank ``tp_rank``.

    ``parallel='column'`` splits the output dim (rows of ``weight``/``weight_scale``);
    ``'row'`` splits the input dim, which is **packed** (``K/2`` bytes, ``K/16`` scales): a shard
    holds whole 1x16 blocks only if ``K / tp_size`` is a multiple of 16. Global scales are replicated.

    Raises:
        QpassError: a split that does not divide evenly or would cut a 1x16 block (names ``name``).
    """
    if parallel not in ("column", "row"):
        raise ValueError(f"parallel must be 'column' or 'row', got {parallel!r}")
    if tensor.dim() == 0 or name.endswith((".weight_scale_2", ".input_scale")):
        return tensor
    dim = 0 if parallel == "column" else 1
    size = tensor.shape[dim]
    if size % tp_size:
        raise QpassError(f"{name}: dim {dim} of size {size} does not split into {tp_size} equal TP shards")
    part = size // tp_size
    if parallel == "row":
        per_block = 8 if name.endswith(".weight") else 1  # bytes (or scales) per 1x16 block
        if part % per_block:
            raise QpassError(f"{name}: a row-parallel shard of {part} along K would cut a 1x16 NVFP4 block (K/tp must be a multiple of 16)")
    return tensor.narrow(dim, tp_rank * part, part)
