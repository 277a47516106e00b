"""Export the quantized linears of a rollout to one ONNX model (per-site subgraphs).

For every quantized site the model has an input ``<site>.x`` ``[tokens, K]`` and an output
``<site>.y`` ``[tokens, N]`` computing exactly what the rollout op computes
(:mod:`qpass.quant.linear`): weight decode from the stored bytes (``onnx_lower`` of the weight
spec), the activation's dynamic fake-quant (``onnx_lower`` of the activation spec, plus RAC where
the site has it), a float32 ``MatMul``, ``+ bias`` in float32 and one rounding to the model dtype.
The only difference to the reference is the order of the float32 summation inside ``MatMul``.

Sources: a rollout :class:`~qpass.graph.qgraph.QGraph` (after ``w4a4_lower`` / ``w4a16_lower`` /
``fp8_lower`` / ``mxfp4_lower`` / ``residual_compensation``) or a ``qpass apply`` output directory
(``DIR`` or ``DIR/rollout``: ``weights.safetensors`` + ``recipe.yaml``; biases, if any, from
``DIR/learner/model.safetensors``). The artifact files do not record each site's activation mode,
so it is re-derived from the recipe's rollout passes (same target/exclude matching as the passes).

Why not the whole graph: the rollout step graph carries a static KV cache updated in place, which
``torch.onnx.export`` would have to turn into explicit cache inputs/outputs, and a full-model export
would need onnxscript translations of all three custom ops; the per-site export covers every
quantized computation (the only place ONNX numerics can disagree with qpass) at a fraction of the
cost and runs in onnxruntime for the portable flavour.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import onnx
import torch
from onnx import TensorProto

from qpass.atomic import write_atomic
from qpass.errors import QpassError
from qpass.formats.spec import FP8Spec, Granularity
from qpass.quant.fp8 import FP8Tensor
from qpass.quant.mxfp4 import MXFP4Tensor
from qpass.quant.nvfp4 import NVFP4Tensor
from qpass.quant.rac import RACConfig, rac_num_channels

from qpass.backends.onnx import emit
from qpass.backends.onnx.builder import TORCH_TO_ONNX, GraphBuilder, check_flavour
from qpass.backends.onnx.rac import emit_rac

F = TensorProto.FLOAT
BF16 = TensorProto.BFLOAT16
KINDS = ("nvfp4_linear", "fp8_linear", "mxfp4_linear")


@dataclasses.dataclass
class SiteLinear:
    """One quantized rollout linear, everything its ONNX subgraph needs.

    Attributes:
        site: site id (``model.layers.0.mlp.down_proj``).
        kind: ``nvfp4_linear`` | ``fp8_linear`` | ``mxfp4_linear``.
        weight: the quantized weight (``NVFP4Tensor`` / ``FP8Tensor`` / ``MXFP4Tensor``), ``[N, K]``.
        bias: ``[N]`` in the model dtype, or None.
        act: NVFP4: ``none`` | ``nvfp4`` | ``nvfp4_per_token``; FP8: the activation granularity;
            MXFP4: ``none``.
        rac: residual compensation options (NVFP4 W4A4 only), or None.
        rac_channels: int64 calibrated channels for ``selection='static'``.
    """

    site: str
    kind: str
    weight: Any
    bias: torch.Tensor | None
    act: str
    rac: RACConfig | None = None
    rac_channels: torch.Tensor | None = None

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[-1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])


@dataclasses.dataclass(frozen=True)
class ExportReport:
    """What :func:`export_rollout_onnx` wrote."""

    path: Path
    flavour: str
    opset: int
    sites: tuple[str, ...]
    bytes: int


# ------------------------------------------------------------------------------------ site sources
def sites_from_qgraph(rollout: Any) -> list[SiteLinear]:
    """Quantized sites of a rollout QGraph, read from its ``qpass::*_linear`` nodes and buffers."""
    from qpass.graph.opargs import op_args
    from qpass.tables import entry

    out: list[SiteLinear] = []
    for sid, rec in rollout.quant.items():
        kind = rec.kind
        if kind not in KINDS or not rec.lowered:
            continue
        target = entry("rollout_lower", rec.spec).op_overload()
        nodes = [n for n in rollout.nodes_of_site(sid) if n.target == target]
        if not nodes:
            raise QpassError(f"ONNX export: site {sid} is recorded as {kind} but the graph has no such node")
        a = op_args(nodes[0])
        buf = lambda node: None if node is None else (rollout.attr(str(node.target)) if isinstance(node, torch.fx.Node) else node)  # noqa: E731
        bias = _detach(buf(a["bias"]))
        if kind == "nvfp4_linear":
            w = NVFP4Tensor.from_parts(buf(a["w_codes"]).detach(), buf(a["w_scales"]).detach(), buf(a["w_s_dec"]).detach())
            rac = RACConfig(float(a["rac_ratio"]), a["rac_mode"], a["rac_selection"]) if float(a["rac_ratio"]) > 0 else None
            ch = buf(a["rac_channels"])
            out.append(SiteLinear(sid, kind, w, bias, a["act"], rac, None if ch is None else ch.detach()))
        elif kind == "fp8_linear":
            data, scale = buf(a["w_data"]).detach(), buf(a["w_scale"]).detach()
            w = FP8Tensor(data, scale, data.shape, torch.bfloat16, rec.spec)
            out.append(SiteLinear(sid, kind, w, bias, a["act_granularity"]))
        else:
            codes, scales = buf(a["w_codes"]).detach(), buf(a["w_scales"]).detach()
            w = MXFP4Tensor(codes, scales, torch.Size((codes.shape[0], codes.shape[1] * 2)), torch.bfloat16)
            out.append(SiteLinear(sid, kind, w, bias, "none"))
    return out


def _detach(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def sites_from_artifacts(directory: str | Path) -> list[SiteLinear]:
    """Quantized sites of a ``qpass apply`` output (``DIR`` or ``DIR/rollout``).

    Raises:
        QpassError: missing files, a site the recipe does not explain, or a static-RAC site
            (its calibrated channels are not part of the artifacts).
    """
    from safetensors.torch import load_file

    from qpass.graph.sites import _matches
    from qpass.recipe import parse_recipe

    d = Path(directory)
    if (d / "rollout").is_dir():
        d = d / "rollout"
    wfile, rfile = d / "weights.safetensors", d / "recipe.yaml"
    for f in (wfile, rfile):
        if not f.exists():
            raise QpassError(f"ONNX export: {f} not found (expected a qpass apply output directory)")
    tensors = load_file(str(wfile))
    biases: dict[str, torch.Tensor] = {}
    lfile = d.parent / "learner" / "model.safetensors"
    if lfile.exists():
        biases = {k: v for k, v in load_file(str(lfile)).items() if k.endswith(".bias")}
    recipe = parse_recipe(rfile.read_text(), str(rfile))

    def option_for(site: str, names: tuple[str, ...]) -> Any:
        found = None
        for p in recipe.rollout:
            if p.name in names:
                o = p.options
                if any(_matches(site, t) for t in o.targets) and not any(_matches(site, e) for e in o.exclude):
                    found = p
        return found

    out: list[SiteLinear] = []
    sites = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight")})
    for sid in sites:
        bias = biases.get(f"{sid}.bias")
        if f"{sid}.weight_scale_2" in tensors:
            w = NVFP4Tensor.from_parts(tensors[f"{sid}.weight"], tensors[f"{sid}.weight_scale"], tensors[f"{sid}.weight_scale_2"])
            p = option_for(sid, ("w4a4_lower", "w4a16_lower"))
            if p is None:
                raise QpassError(f"ONNX export: no w4a4_lower/w4a16_lower pass of {rfile} targets NVFP4 site {sid}")
            rp = option_for(sid, ("residual_compensation",)) if p.options.act != "none" else None
            rac = None
            if rp is not None and rac_num_channels(w.shape[-1], rp.options.ratio) > 0:
                if rp.options.selection == "static":
                    raise QpassError(f"ONNX export: site {sid} uses static RAC; its calibrated channels are not in {wfile} (export from the rollout graph instead)")
                rac = RACConfig(rp.options.ratio, rp.options.mode, rp.options.selection)
            out.append(SiteLinear(sid, "nvfp4_linear", w, bias, p.options.act, rac))
        elif f"{sid}.weight_scale_inv" in tensors:
            data, scale = tensors[f"{sid}.weight"], tensors[f"{sid}.weight_scale_inv"]
            p = option_for(sid, ("fp8_lower",))
            if p is None:
                raise QpassError(f"ONNX export: no fp8_lower pass of {rfile} targets FP8 site {sid}")
            g = Granularity(p.options.weight_granularity)
            out.append(SiteLinear(sid, "fp8_linear", FP8Tensor(data, scale, data.shape, torch.bfloat16, FP8Spec(role="weight", granularity=g)), bias, p.options.act_granularity))
        elif f"{sid}.weight_scale" in tensors:
            codes, scales = tensors[f"{sid}.weight"], tensors[f"{sid}.weight_scale"]
            w = MXFP4Tensor(codes, scales, torch.Size((codes.shape[0], codes.shape[1] * 2)), torch.bfloat16)
            out.append(SiteLinear(sid, "mxfp4_linear", w, bias, "none"))
    if not out:
        raise QpassError(f"ONNX export: {wfile} holds no quantized site")
    return out


# ------------------------------------------------------------------------------------ graph
def emit_site_linear(b: GraphBuilder, s: SiteLinear, x: str, *, elem_type: int, out_type: int) -> str:
    """Emit ``y = qpass.<kind>(x, ...)`` for one site; ``x`` is ``[tokens, K]`` of ``elem_type``.

    Returns the output value (``out_type``: the model dtype rounding of the float32 accumulator).
    """
    k = s.in_features
    xf = emit.to_float(b, x, elem_type)
    comp = cols = None
    if s.kind == "nvfp4_linear":
        wf = b.op("Cast", [emit.nvfp4_weight(b, s.weight, s.site, dtype=BF16)], f"{s.site}.w_hat", to=F)
        if s.act == "none":
            xq = xf
        elif s.rac is not None and (s.rac.selection == "static" or rac_num_channels(k, s.rac.ratio) > 0):
            rv = emit_rac(b, xf, k, s.rac, per_token=s.act == "nvfp4_per_token", static_channels=s.rac_channels, site=s.site)
            xq, comp, cols = rv.x_hat, rv.comp, rv.columns
            if cols is not None:  # gathered columns of W_hat, zero for the K' - k padding columns
                wg = b.op("Gather", [wf, cols], f"{s.site}.w_cols", axis=1)
                ncols = b.op("Shape", [cols], f"{s.site}.n_cols")
                pad = b.op("Sub", [b.i64([rv.k_pad]), ncols], f"{s.site}.n_pad")
                pads = b.op("Concat", [b.i64([0, 0, 0]), pad], f"{s.site}.pads", axis=0)
                cols = b.op("Pad", [wg, pads], f"{s.site}.w_cols_pad", mode="constant")
        elif s.act in ("nvfp4", "nvfp4_per_token"):
            xq = b.op("Cast", [emit.nvfp4_activation(b, xf, k, elem_type=F, dtype=BF16, per_token=s.act == "nvfp4_per_token")], f"{s.site}.x_hat", to=F)
        else:
            raise QpassError(f"ONNX export: site {s.site} has unknown NVFP4 activation mode {s.act!r}")
    elif s.kind == "fp8_linear":
        wf = emit.fp8_weight(b, s.weight, s.site, dtype=F)
        xq = emit.fp8_activation(b, xf, k, elem_type=F, dtype=F, spec=FP8Spec(role="activation", granularity=Granularity(s.act)))
    else:
        wf = b.op("Cast", [emit.mxfp4_weight(b, s.weight, s.site, dtype=BF16)], f"{s.site}.w_hat", to=F)
        xq = xf
    acc = b.op("MatMul", [xq, b.op("Transpose", [wf], f"{s.site}.w_t", perm=[1, 0])], f"{s.site}.acc")
    if comp is not None:
        w2 = wf if cols is None else cols
        acc = b.op("Add", [acc, b.op("MatMul", [comp, b.op("Transpose", [w2], f"{s.site}.w2_t", perm=[1, 0])], f"{s.site}.acc_comp")], f"{s.site}.acc_total")
    if s.bias is not None:
        bias = b.op("Cast", [b.torch_initializer(s.bias, f"{s.site}.bias")], f"{s.site}.bias_f", to=F)
        acc = b.op("Add", [acc, bias], f"{s.site}.acc_bias")
    return emit.round_to(b, acc, out_type)


def rollout_sites_model(
    source: Any, *, flavour: str = "portable", sites: list[str] | None = None, dtype: torch.dtype = torch.bfloat16,
    io_dtype: torch.dtype | None = None,
) -> tuple[onnx.ModelProto, list[SiteLinear]]:
    """Build the per-site ONNX model (see module docstring) without writing it.

    Args:
        source: rollout ``QGraph``, artifact directory, or a list of :class:`SiteLinear`.
        flavour: ``portable`` (opset 21, onnxruntime) or ``spec`` (opset 23/24 FP4 types).
        sites: restrict to these site ids (default: every quantized site).
        dtype: the model's activation dtype (inputs are rounded to it, outputs rounded from
            float32 to it), bf16 for qpass rollouts.
        io_dtype: element type of graph inputs/outputs (default: ``dtype`` for spec, float32 for
            portable, since onnxruntime's Python API has no bf16).
    Returns:
        ``(model, site records)``.
    Raises:
        QpassError: no quantized site (or an unknown one in ``sites``).
    """
    check_flavour(flavour)
    recs = source if isinstance(source, list) else (sites_from_artifacts(source) if isinstance(source, str | Path) else sites_from_qgraph(source))
    if sites is not None:
        known = {s.site for s in recs}
        missing = [s for s in sites if s not in known]
        if missing:
            raise QpassError(f"ONNX export: unknown or unquantized site(s) {missing}; quantized: {sorted(known)}")
        recs = [s for s in recs if s.site in set(sites)]
    if not recs:
        raise QpassError("ONNX export: the rollout has no quantized linear site")
    io_dtype = io_dtype or (dtype if flavour == "spec" else torch.float32)
    et, io = TORCH_TO_ONNX[dtype], TORCH_TO_ONNX[io_dtype]
    b = GraphBuilder(flavour, name="qpass_rollout_sites")
    if flavour == "spec":
        b.need_opset(emit.OPSET_FP4)  # spec graphs are opset >= 23 whatever formats they hold (24 with MXFP4)
    for s in recs:
        x = b.add_input(f"{s.site}.x", io, ["tokens", s.in_features])
        if io != et:
            x = b.op("Cast", [x], f"{s.site}.x_in", to=et)
        y = emit_site_linear(b, s, x, elem_type=et, out_type=et)
        if io != et:
            y = b.op("Cast", [y], f"{s.site}.y_io", to=io)
        b.add_output(y, f"{s.site}.y", io, ["tokens", s.out_features])
    doc = f"qpass rollout linears ({flavour}): " + ", ".join(f"{s.site}={s.kind}/{s.act}" + (f"/rac{s.rac.ratio}-{s.rac.mode}-{s.rac.selection}" if s.rac else "") for s in recs)
    return b.model(doc=doc), recs


def export_rollout_onnx(
    source: Any, path: str | Path, *, flavour: str = "portable", sites: list[str] | None = None,
    dtype: torch.dtype = torch.bfloat16, io_dtype: torch.dtype | None = None, check: bool = True,
) -> ExportReport:
    """Write the per-site ONNX model of a rollout to ``path`` atomically (temp file + rename).

    Args: as :func:`rollout_sites_model`; ``check`` runs ``onnx.checker.check_model(full_check=True)``
    before writing.
    Raises:
        QpassError: see :func:`rollout_sites_model`; onnx.checker.ValidationError: invalid graph.
    """
    model, recs = rollout_sites_model(source, flavour=flavour, sites=sites, dtype=dtype, io_dtype=io_dtype)
    if check:
        onnx.checker.check_model(model, full_check=True)
    path = Path(path)
    data = model.SerializeToString()  # raises ValueError above the 2 GiB protobuf limit
    write_atomic(path, data)
    return ExportReport(path, flavour, model.opset_import[0].version, tuple(s.site for s in recs), len(data))
