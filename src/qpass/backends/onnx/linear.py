"""ONNX lowering of the rollout linear ops, one :class:`OnnxLinear` per weight spec type.

The ``onnx`` spec table (:mod:`.table`) carries these next to the per-spec emitters, so the export
(:mod:`.export`, :mod:`.graph_export`) finds everything a quantized site needs by its weight
spec's *type*, like the other tables: no kind strings. Each entry knows

* ``from_op_args(site, spec, args, buf)``: the :class:`SiteLinear` of a rollout op node (its
  named arguments, ``qpass.graph.opargs``; ``buf`` resolves a constant node to its tensor);
* ``from_checkpoint(site, spec, constants, bias, rollout_pass)``: the :class:`SiteLinear` of a saved
  site (``constants``: rollout constant name -> tensor, read under the ``export`` table's names;
  ``rollout_pass(names)`` is the last recipe pass among ``names`` that targets the site, or None);
* ``operands(b, s, xf)``: the float32 GEMM operands of the site and their epilogue scales (NVFP4:
  ``B_W``, ``B_X``, RAC's ``B_R``, ``alpha``s; SPEC §3.1) emitted into a
  :class:`~.builder.GraphBuilder`, with the arithmetic of :mod:`qpass.quant.linear` (see :mod:`.emit`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from onnx import TensorProto

from qpass.errors import QpassError
from qpass.formats.spec import FP8Spec, Granularity, NVFP4Spec, QuantSpec, nvfp4_act_mode, nvfp4_act_spec_of
from qpass.quant.fp8 import FP8Tensor
from qpass.quant.mxfp4 import MXFP4Tensor
from qpass.quant.nvfp4 import NVFP4Tensor, act_operand_limit
from qpass.quant.rac import RACConfig

from qpass.backends.onnx import emit
from qpass.backends.onnx.builder import GraphBuilder
from qpass.backends.onnx.rac import emit_rac

F = TensorProto.FLOAT
BF16 = TensorProto.BFLOAT16


@dataclasses.dataclass
class SiteLinear:
    """One quantized rollout linear, everything its ONNX subgraph needs.

    Attributes:
        site: site id (``model.layers.0.mlp.down_proj``).
        spec: the weight spec (its type selects the ``onnx`` table entry).
        weight: the quantized weight (``NVFP4Tensor`` / ``FP8Tensor`` / ``MXFP4Tensor``), ``[N, K]``.
        bias: ``[N]`` in the model dtype, or None.
        act: the activation spec: NVFP4 (``NVFP4_ACT`` / ``NVFP4_ACT_PER_TOKEN``) or None (W4A16);
            FP8: the :class:`FP8Spec`; MXFP4: None.
        rac: residual compensation options (NVFP4 W4A4 only), or None.
        rac_channels: int64 calibrated channels for ``selection='static'``.
    """

    site: str
    spec: QuantSpec
    weight: Any
    bias: torch.Tensor | None
    act: QuantSpec | None
    rac: RACConfig | None = None
    rac_channels: torch.Tensor | None = None

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[-1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def act_label(self) -> str:
        """The activation option as the rollout op spells it: the NVFP4 activation mode
        (``nvfp4``, ``nvfp4_per_token``, ``none``) or the FP8 activation granularity."""
        if isinstance(self.act, FP8Spec):
            return self.act.granularity.value
        return nvfp4_act_mode(self.act)

    @property
    def kind(self) -> str:
        """The rollout op's name without namespace (``nvfp4_linear`` ...), for labels."""
        from qpass.tables import entry

        return entry("rollout_lower", self.spec).op.split("::")[-1]


@dataclasses.dataclass(frozen=True)
class Operands:
    """Float32 GEMM operands of one site: ``y = fl(xq @ w^T * alpha) (+ fl(comp @ w2^T * alpha2))``
    with ``w2 = cols`` when set (gathered RAC: the gathered, zero-padded weight columns), else ``w``;
    ``alpha`` / ``alpha2`` None means no scale (the operands are dense values: FP8, MXFP4)."""

    w: str
    xq: str
    comp: str | None = None
    cols: str | None = None
    alpha: str | None = None
    alpha2: str | None = None


@dataclasses.dataclass(frozen=True)
class OnnxLinear:
    """The ONNX lowering of one weight spec type's rollout linear (see module docstring)."""

    from_op_args: Callable[[str, QuantSpec, Mapping[str, Any], Callable[[Any], Any]], SiteLinear]
    from_checkpoint: Callable[..., SiteLinear]
    operands: Callable[[GraphBuilder, SiteLinear, str, int], Operands]


# ------------------------------------------------------------------------------------ NVFP4
def _nvfp4_from_op_args(site: str, spec: QuantSpec, a: Mapping[str, Any], buf: Callable[[Any], Any]) -> SiteLinear:
    from qpass.ops.calls import NVFP4LinearCall

    w = NVFP4Tensor.from_parts(buf(a["w_codes"]).detach(), buf(a["w_scales"]).detach(), buf(a["w_s_dec"]).detach())
    act, rac = NVFP4LinearCall.decode(a, site)
    ch = buf(a["rac_channels"])
    return SiteLinear(site, spec, w, _detach(buf(a["bias"])), act, rac, None if ch is None else ch.detach())


def _nvfp4_from_checkpoint(site: str, spec: QuantSpec, c: Mapping[str, torch.Tensor], bias: torch.Tensor | None,
                           rollout_pass: Callable[[tuple[str, ...]], Any], source: str) -> SiteLinear:
    w = NVFP4Tensor.from_parts(c["codes"], c["scales"], c["s_dec"])
    p = rollout_pass(("w4a4_lower", "w4a16_lower"))
    if p is None:
        raise QpassError(f"ONNX export: no w4a4_lower/w4a16_lower pass of {source} targets NVFP4 site {site}")
    if getattr(p.options, "act_scale", "dynamic") == "static":
        raise QpassError(f"ONNX export: site {site} uses a static (calibrated) activation scale ({source}); the ONNX "
                         "emitter quantizes activations dynamically")
    act = nvfp4_act_spec_of(p.options.act, site)
    rp = rollout_pass(("residual_compensation",)) if act is not None else None
    rac = None if rp is None else RACConfig(rp.options.ratio, rp.options.mode, rp.options.selection)
    if rac is not None and rac.num_channels(w.shape[-1]) > 0:
        if rac.selection == "static":
            raise QpassError(f"ONNX export: site {site} uses static RAC ({source}); its calibrated channels are not "
                             "read from the artifacts (export from the rollout graph instead)")
    else:
        rac = None
    return SiteLinear(site, spec, w, bias, act, rac)


def _nvfp4_operands(b: GraphBuilder, s: SiteLinear, xf: str, elem_type: int) -> Operands:
    """W4A16 / W4A4 (+RAC), factored (SPEC §3.1): ``B_W`` (a ``DequantizeLinear`` of the FP4 codes
    with the block scales) times ``X`` or ``B_X``, and ``alpha = S_dec_W`` or ``fl(S_dec_X * S_dec_W)``
    as a ``Mul`` on the output; RAC adds the second accumulation with ``alpha_R``. The residual is
    formed from the dense bf16 activation (``qpass.quant.rac.rac_reference``)."""
    k = s.in_features
    wf, s_w = emit.nvfp4_weight_operand(b, s.weight, s.site)
    if s.act is None:
        return Operands(wf, xf, alpha=s_w)
    if not isinstance(s.act, NVFP4Spec) or s.act.role != "activation":
        raise QpassError(f"ONNX export: site {s.site} has unknown NVFP4 activation mode {s.act!r}")
    if s.act.global_source != "dynamic":
        raise QpassError(f"ONNX export: site {s.site} has NVFP4 activation mode {s.act_label!r}, which the ONNX emitter does not "
                         "implement (dynamic per-tensor or per-token scales only)")
    per_token = s.act.global_scope == "per_token"
    lim = act_operand_limit(torch.bfloat16)  # RAC's residual: X - bf16(DQ(Q_A(X))), as rac_reference
    if s.rac is not None and (s.rac.selection == "static" or s.rac.num_channels(k) > 0):
        rv = emit_rac(b, xf, k, s.rac, per_token=per_token, static_channels=s.rac_channels, site=s.site, operand_limit=lim)
        alpha = b.op("Mul", [rv.s_dec_x, s_w], f"{s.site}.alpha")
        alpha_r = b.op("Mul", [rv.s_dec_r, s_w], f"{s.site}.alpha_r")
        cols = None
        if rv.columns is not None:  # gathered columns of W_hat, zero for the K' - k padding columns
            wg = b.op("Gather", [wf, rv.columns], f"{s.site}.w_cols", axis=1)
            ncols = b.op("Shape", [rv.columns], f"{s.site}.n_cols")
            pad = b.op("Sub", [b.i64([rv.k_pad]), ncols], f"{s.site}.n_pad")
            pads = b.op("Concat", [b.i64([0, 0, 0]), pad], f"{s.site}.pads", axis=0)
            cols = b.op("Pad", [wg, pads], f"{s.site}.w_cols_pad", mode="constant")
        return Operands(wf, rv.b_x, rv.comp, cols, alpha, alpha_r)
    b_x, s_x = emit.nvfp4_activation_operand(b, xf, k, elem_type=F, per_token=per_token)
    return Operands(wf, b_x, alpha=b.op("Mul", [s_x, s_w], f"{s.site}.alpha"))


# ------------------------------------------------------------------------------------ FP8
def _fp8_from_op_args(site: str, spec: QuantSpec, a: Mapping[str, Any], buf: Callable[[Any], Any]) -> SiteLinear:
    data, scale = buf(a["w_data"]).detach(), buf(a["w_scale"]).detach()
    return SiteLinear(site, spec, FP8Tensor(data, scale, data.shape, torch.bfloat16, spec), _detach(buf(a["bias"])),
                      FP8Spec(role="activation", granularity=Granularity(a["act_granularity"])))


def _fp8_from_checkpoint(site: str, spec: QuantSpec, c: Mapping[str, torch.Tensor], bias: torch.Tensor | None,
                         rollout_pass: Callable[[tuple[str, ...]], Any], source: str) -> SiteLinear:
    p = rollout_pass(("fp8_lower",))
    if p is None:
        raise QpassError(f"ONNX export: no fp8_lower pass of {source} targets FP8 site {site}")
    spec = FP8Spec(role="weight", granularity=Granularity(p.options.weight_granularity))
    data = c["data"]
    return SiteLinear(site, spec, FP8Tensor(data, c["scale"], data.shape, torch.bfloat16, spec), bias,
                      FP8Spec(role="activation", granularity=Granularity(p.options.act_granularity)))


def _fp8_operands(b: GraphBuilder, s: SiteLinear, xf: str, elem_type: int) -> Operands:
    wf = emit.fp8_weight(b, s.weight, s.site, dtype=F)
    return Operands(wf, emit.fp8_activation(b, xf, s.in_features, elem_type=F, dtype=F, spec=s.act))


# ------------------------------------------------------------------------------------ MXFP4
def _mxfp4_weight(codes: torch.Tensor, scales: torch.Tensor) -> MXFP4Tensor:
    return MXFP4Tensor(codes, scales, torch.Size((codes.shape[0], codes.shape[1] * 2)), torch.bfloat16)


def _mxfp4_from_op_args(site: str, spec: QuantSpec, a: Mapping[str, Any], buf: Callable[[Any], Any]) -> SiteLinear:
    return SiteLinear(site, spec, _mxfp4_weight(buf(a["w_codes"]).detach(), buf(a["w_scales"]).detach()),
                      _detach(buf(a["bias"])), None)


def _mxfp4_from_checkpoint(site: str, spec: QuantSpec, c: Mapping[str, torch.Tensor], bias: torch.Tensor | None,
                           rollout_pass: Callable[[tuple[str, ...]], Any], source: str) -> SiteLinear:
    return SiteLinear(site, spec, _mxfp4_weight(c["codes"], c["scales"]), bias, None)


def _mxfp4_operands(b: GraphBuilder, s: SiteLinear, xf: str, elem_type: int) -> Operands:
    return Operands(b.op("Cast", [emit.mxfp4_weight(b, s.weight, s.site, dtype=BF16)], f"{s.site}.w_hat", to=F), xf)


def _detach(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


NVFP4_LINEAR = OnnxLinear(_nvfp4_from_op_args, _nvfp4_from_checkpoint, _nvfp4_operands)
FP8_LINEAR = OnnxLinear(_fp8_from_op_args, _fp8_from_checkpoint, _fp8_operands)
MXFP4_LINEAR = OnnxLinear(_mxfp4_from_op_args, _mxfp4_from_checkpoint, _mxfp4_operands)

__all__ = ["FP8_LINEAR", "MXFP4_LINEAR", "NVFP4_LINEAR", "OnnxLinear", "Operands", "SiteLinear"]
