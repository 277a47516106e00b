"""Capture and compare the inputs of every linear site of a learner and a rollout graph (SPEC §4).

The one capture-and-compare of qpass: ``qpass apply`` (per-site activation mismatch, the residual
heatmap's input), the GRPO layer-wise probe and the QUADS study all call it.

**Capture.** :class:`LinearInputRecorder` runs a qpass graph (``torch.fx.Interpreter``) and records,
at the first call of each site (a node stamped ``qpass_linear_site``: ``aten.linear``, the learner's
QDQ linears, the rollout ops ``qpass::nvfp4_linear`` / ``fp8_linear`` / ...), two inputs:

* ``pre``: the activation ``X`` handed to the projection before any activation quantization (an
  ``nvfp4_act_qdq`` in front is looked through, its input kept when it runs, since the interpreter
  may free it before the linear does): learner and rollout inputs of a site compare like for like,
  ``X_roll - X_learn`` is the drift accumulated upstream (``eta``, SPEC §2);
* ``eff`` (``effective=True``): the operand the GEMM multiplies: the ``act_qdq`` output, for a
  rollout ``qpass::nvfp4_linear`` with quantized activations ``DQ(Q_A(X))`` (+ the RAC compensation
  scattered to its channels, float32) by the op's reference semantics over that call's rows
  (:func:`effective_nvfp4_input`), else ``X`` itself.

:func:`capture_learner` runs the learner's scoring graph over ``[B, T]`` tokens, :func:`capture_prefill`
the rollout's step graph over the same tokens as one prefill; :class:`DecodeRecorder` records a
rollout replayed one decode step at a time.

**Compare.** :func:`compare_captures` gives per site :func:`qpass.diagnostics.layerwise_mismatch` of
``pre`` (and ``eff``) on the valid tokens; sites whose input is not one row per token (MoE expert
linears: the tokens routed to that expert, a set that differs between the sides) have no row-aligned
comparison and are listed as skipped. :func:`compare_graph_inputs` is capture + compare of a
learner and a rollout graph on one token batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from qpass.diagnostics.layerwise import SiteMismatch, layerwise_mismatch

__all__ = ["Acts", "DecodeRecorder", "InputComparison", "LinearInputRecorder", "capture_learner", "capture_linear_inputs",
           "capture_prefill", "compare_captures", "compare_graph_inputs", "effective_nvfp4_input"]

Acts = dict[str, tuple[torch.Tensor, torch.Tensor]]  # site -> (pre [..., K], eff [..., K])


def _act_qdq() -> Any:
    from qpass.quant import qdq  # noqa: F401 - registers qpass::nvfp4_act_qdq

    return torch.ops.qpass.nvfp4_act_qdq.default


def _nvfp4_linear() -> Any:
    from qpass import ops  # noqa: F401 - registers qpass::nvfp4_linear

    return torch.ops.qpass.nvfp4_linear.default


def effective_nvfp4_input(x: torch.Tensor, args: Mapping[str, Any]) -> torch.Tensor:
    """The GEMM operand of one ``qpass::nvfp4_linear`` call (reference semantics).

    Args:
        x: the op's input ``[..., K]`` (all rows of the call).
        args: the node's named arguments (:func:`qpass.graph.opargs.op_args`: ``site``, ``act``,
            ``rac_ratio``, ``rac_mode``, ``rac_selection``, ``rac_channels`` as a tensor or None).
    Returns:
        ``x`` itself for ``act='none'``; else ``DQ(Q_A(x))`` (bf16) or, with RAC,
        ``float32(DQ(Q_A(x))) + R_hat`` (dense float32); shape of ``x``.
    """
    from qpass.ops.calls import NVFP4LinearCall
    from qpass.quant.nvfp4 import nvfp4_dequantize, nvfp4_quantize
    from qpass.quant.rac import rac_reference, scatter_gathered

    spec, rac = NVFP4LinearCall.decode(args)
    channels, site = args["rac_channels"], args["site"]
    if spec is None:
        return x
    x2 = x.reshape(-1, x.shape[-1])
    k = rac.num_channels(x2.shape[-1]) if rac is not None else 0
    if k > 0:
        res = rac_reference(x2, rac, spec, static_channels=channels, site=site, k=k)
        comp = res.comp.float() if res.gather_index is None else scatter_gathered(res.comp, res.gather_index, x2.shape[-1])
        eff = res.x_hat.float() + comp
    else:
        eff = nvfp4_dequantize(nvfp4_quantize(x2, spec=spec, name="activation", site=site), torch.bfloat16)
    return eff.reshape(x.shape)


class LinearInputRecorder(torch.fx.Interpreter):
    """Run a qpass graph and record ``(pre, eff)`` of every linear site (first call per run; module docstring).

    Args:
        gm: the graph module.
        sites: record only these sites (None: all).
        effective: also compute ``eff`` (False: ``eff`` is ``pre``, nothing extra is computed).
    Attributes:
        acts: :data:`Acts`, detached clones on the graph's device: ``pre`` in the activation dtype,
            ``eff`` bf16 or float32 (RAC).
    """

    def __init__(self, gm: torch.fx.GraphModule, sites: Iterable[str] | None = None, *, effective: bool = False) -> None:
        super().__init__(gm)
        self.sites = set(sites) if sites is not None else None
        self.effective = effective
        self.acts: Acts = {}
        self._act_qdq, self._nvfp4 = _act_qdq(), _nvfp4_linear()
        self._qdq_in: dict[torch.fx.Node, torch.Tensor] = {}

    def _named(self, n: torch.fx.Node) -> dict[str, Any]:
        from qpass.graph.opargs import op_args

        a = op_args(n)
        if isinstance(a["rac_channels"], torch.fx.Node):
            a["rac_channels"] = self.env[a["rac_channels"]]
        return a

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        if n.target == self._act_qdq:
            x = self.env[n.args[0]]
            out = super().run_node(n)
            self._qdq_in[n] = x  # the input may be freed before the linear runs
            return out
        sid = n.meta.get("qpass_linear_site")
        if sid is None or sid in self.acts or (self.sites is not None and sid not in self.sites):
            return super().run_node(n)
        xn = n.args[0]
        if isinstance(xn, torch.fx.Node) and xn.target == self._act_qdq:
            pre, eff = self._qdq_in.pop(xn), self.env[xn]
        else:
            pre = self.env[xn] if isinstance(xn, torch.fx.Node) else xn
            eff = effective_nvfp4_input(pre, self._named(n)) if self.effective and n.target == self._nvfp4 else pre
        pre_c = pre.detach().clone()
        self.acts[sid] = (pre_c, pre_c if (eff is pre or not self.effective) else eff.detach().clone())
        return super().run_node(n)


@torch.no_grad()
def capture_linear_inputs(gm: torch.fx.GraphModule, args: tuple, sites: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Run ``gm(*args)`` and return ``{site: pre input [M, K]}`` (first call of each site; rows are the
    flattened leading dims, batch x sequence)."""
    rec = LinearInputRecorder(gm, sites)
    rec.run(*args)
    return {s: pre.reshape(-1, pre.shape[-1]) for s, (pre, _) in rec.acts.items()}


@torch.no_grad()
def capture_learner(learner: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, effective: bool = False) -> Acts:
    """``(pre, eff)`` per site of the learner's full-sequence forward (a ``scoring`` :class:`QGraph`), each ``[B, T, K]``."""
    from qpass.sampling import positions_from_mask

    rec = LinearInputRecorder(learner.gm, effective=effective)
    rec.run(input_ids, attention_mask.long(), positions_from_mask(attention_mask))
    return rec.acts


@torch.no_grad()
def capture_prefill(rollout: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, effective: bool = False) -> Acts:
    """``(pre, eff)`` per site of one step-graph call over the whole sequence (prefill mode; the KV cache is overwritten).

    Args:
        rollout: ``step`` :class:`QGraph` with static batch ``B`` and cache ``L >= T``.
        input_ids, attention_mask: int64 ``[B, T]``.
    Raises:
        ValueError: the batch differs from the graph's static batch or ``T > L``.
    """
    from qpass.runtime.prefill import step_prefill_args

    b, t = input_ids.shape
    bs, ml = int(rollout.captured.batch_size), int(rollout.captured.max_len)
    if b != bs or t > ml:
        raise ValueError(f"prefill capture needs batch {bs} and T <= {ml}, got [{b}, {t}]")
    rec = LinearInputRecorder(rollout.gm, effective=effective)
    rec.run(*step_prefill_args(input_ids, attention_mask, batch_size=bs, max_len=ml))
    return rec.acts


class DecodeRecorder:
    """A ``step_fn`` for a rollout replay that records ``(pre, eff)`` of every call (``effective=True``).

    After the replay, :meth:`assemble` concatenates the calls along the sequence axis: the prefill
    rows ``[B, P, K]`` then one ``[B, 1, K]`` per decode call -> ``[B, P + R - 1, K]``, aligned
    with the learner's positions ``0 .. P + R - 2`` (the last response token is never fed).
    """

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.calls: list[Acts] = []

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        rec = LinearInputRecorder(self.gm, effective=True)
        out = rec.run(*args)
        self.calls.append(rec.acts)
        return out  # Interpreter.run applies the graph's pytree output processing itself

    def assemble(self) -> Acts:
        """Raises ValueError: no call was recorded."""
        if not self.calls:
            raise ValueError("DecodeRecorder.assemble: no call was recorded")
        return {s: (torch.cat([c[s][0] for c in self.calls], 1), torch.cat([c[s][1] for c in self.calls], 1))
                for s in self.calls[0]}


@dataclasses.dataclass(frozen=True)
class InputComparison:
    """Per-site comparison of learner and rollout linear inputs on the valid tokens.

    Attributes:
        per_site: ``{site: {"pre": SiteMismatch[, "eff": SiteMismatch]}}`` (in the order asked for).
        skipped: sites both sides have whose input is not one row per token (MoE expert linears).
        learner_rows, rollout_rows: ``{site: pre input of the valid tokens, float32 [n_valid, K] on CPU}``
            of the compared sites (the apply's residual map reads the rollout's).
    """

    per_site: dict[str, dict[str, SiteMismatch]]
    skipped: list[str]
    learner_rows: dict[str, torch.Tensor]
    rollout_rows: dict[str, torch.Tensor]

    def rel(self, which: str = "pre") -> dict[str, float]:
        """``{site: ||X_roll - X_learn||_F / ||X_learn||_F}`` of ``which``."""
        return {s: m[which].rel for s, m in self.per_site.items()}


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def compare_captures(learner: Acts, rollout: Acts, mask: torch.Tensor, *, which: tuple[str, ...] = ("pre",),
                     order: Iterable[str] | None = None, strict: bool = False, nonfinite: str = "raise") -> InputComparison:
    """:func:`layerwise_mismatch` per site of two captures on the tokens of ``mask`` (module docstring).

    Args:
        learner, rollout: :data:`Acts` over the same ``[B, T]`` tokens (or cut to ``mask``'s ``T'``
            positions: each side's first ``mask.shape[1]`` positions are compared when ``[B, T, K]``).
        mask: bool ``[B, T']`` valid tokens.
        which: ``"pre"`` and/or ``"eff"``.
        order: site order of the result (default: the learner capture's); only sites both sides have.
        strict: the two captures must hold the same sites.
        nonfinite: ``"raise"`` (a NaN/inf activation is a ValueError naming the site) or ``"nan"``
            (that site's ``fro``/``max_abs``/``rms`` are NaN and ``rel`` is the plain float64 norm ratio).
    Raises:
        ValueError: non-finite activations under ``"raise"``; the site sets differ under ``strict``
            (both differences listed); ``nonfinite`` or ``which`` unknown.
    """
    if nonfinite not in ("raise", "nan") or not set(which) <= {"pre", "eff"}:
        raise ValueError(f"compare_captures: nonfinite must be 'raise' or 'nan' and which a subset of ('pre', 'eff'), "
                         f"got {nonfinite!r}, {which!r}")
    if strict and set(learner) != set(rollout):
        raise ValueError(f"compare_captures: sites differ; only in learner: {sorted(set(learner) - set(rollout))}, "
                         f"only in rollout: {sorted(set(rollout) - set(learner))}")
    rows = mask.reshape(-1).bool().cpu()
    width = mask.shape[1] if mask.dim() == 2 else None
    per: dict[str, dict[str, SiteMismatch]] = {}
    skipped: list[str] = []
    lrows, rrows = {}, {}
    for sid in (order if order is not None else learner):
        if sid not in learner or sid not in rollout:
            continue
        sides = [_cut(learner[sid], width), _cut(rollout[sid], width)]
        if any(_rows(t[0]).shape[0] != rows.numel() for t in sides):
            skipped.append(sid)
            continue
        for w in which:
            xl, xr = (_rows(t[0 if w == "pre" else 1]).cpu()[rows] for t in sides)
            per.setdefault(sid, {})[w] = _mismatch(sid, xl, xr, nonfinite)
        lrows[sid], rrows[sid] = (_rows(t[0]).float().cpu()[rows] for t in sides)
    return InputComparison(per, skipped, lrows, rrows)


def _cut(t: tuple[torch.Tensor, torch.Tensor], width: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    if width is None or t[0].dim() != 3:
        return t
    return t[0][:, :width], t[1][:, :width]


def _mismatch(site: str, xl: torch.Tensor, xr: torch.Tensor, nonfinite: str) -> SiteMismatch:
    from qpass.diagnostics.robust import norm_ratio

    if nonfinite == "nan" and not (bool(torch.isfinite(xl).all()) and bool(torch.isfinite(xr).all())):
        nan = float("nan")
        rel = norm_ratio(xr.double() - xl.double(), xl)
        return SiteMismatch(site=site, fro=nan, rel=rel, max_abs=nan, rms=nan, n_tokens=xl.shape[0], numel=xl.numel())
    return layerwise_mismatch({site: xl}, {site: xr})[site]


@torch.no_grad()
def compare_graph_inputs(learner: Any, rollout: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                         order: Iterable[str] | None = None, nonfinite: str = "raise") -> InputComparison:
    """Capture the linear inputs of ``learner`` (scoring graph) and ``rollout`` (step graph, one prefill) on the
    same ``[B, T]`` tokens and compare ``pre`` per site over the real tokens (:func:`compare_captures`;
    ``order`` default: the learner capture's).

    Raises:
        ValueError: see :func:`capture_prefill` and :func:`compare_captures`.
    """
    am = attention_mask.long()
    la = capture_learner(learner, input_ids, am)
    ra = capture_prefill(rollout, input_ids, am)
    return compare_captures(la, ra, am.bool(), order=order, nonfinite=nonfinite)
