"""Export the quantized linears of a rollout to one ONNX model (per-site subgraphs).

For every quantized site the model has an input ``<site>.x`` ``[tokens, K]`` and an output
``<site>.y`` ``[tokens, N]`` computing exactly what the rollout op computes
(:mod:`qpass.quant.linear`): weight decode from the stored bytes, the activation's dynamic
fake-quant (plus RAC where the site has it), a float32 ``MatMul``, ``+ bias`` in float32 and one
rounding to the model dtype. Every site is read and emitted by the ``onnx`` spec-table entry of
its weight spec type (``entry("onnx", spec).linear``, :mod:`.linear`); a saved site's spec type is
the ``export`` table format its tensor names match. The only difference to the reference is the
order of the float32 summation inside ``MatMul``.

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
from qpass.tables import TABLES, entry

from qpass.backends.onnx import emit
from qpass.backends.onnx.builder import TORCH_TO_ONNX, GraphBuilder, check_flavour
from qpass.backends.onnx.linear import SiteLinear
from qpass.backends.onnx.table import onnx_linear

F = TensorProto.FLOAT


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
    """Quantized sites of a rollout QGraph, read from their rollout op nodes (the op is the weight
    spec's ``rollout_lower`` entry) by the ``onnx`` table entry of the spec type.

    Raises:
        QpassError: a lowered site whose op is not in the graph.
        KeyError: a spec type without an ``onnx`` entry (names the table and the spec).
    """
    from qpass.graph.opargs import op_args

    out: list[SiteLinear] = []
    for sid, rec in rollout.quant.items():
        if not rec.lowered or rec.spec is None:
            continue
        lin = onnx_linear(rec.spec)
        target = entry("rollout_lower", rec.spec).op_overload()
        nodes = [n for n in rollout.nodes_of_site(sid) if n.target == target]
        if not nodes:
            raise QpassError(f"ONNX export: site {sid} is recorded as {rec.kind} but the graph has no such node")
        buf = lambda node: None if node is None else (rollout.attr(str(node.target)) if isinstance(node, torch.fx.Node) else node)  # noqa: E731
        out.append(lin.from_op_args(sid, rec.spec, op_args(nodes[0]), buf))
    return out


def _checkpoint_spec(site: str, names: set[str]) -> tuple[type, Any] | None:
    """The spec type whose ``export`` format a saved site matches: every tensor name of the format
    is present for ``site``; the format with the most names wins (NVFP4's four names contain
    MXFP4's two). None: no quantized site (e.g. a bias or norm)."""
    best = None
    for spec_type, fmt in TABLES["export"].items():
        if all(f"{site}.{suffix}" in names for suffix in fmt.names.values()):
            if best is None or len(fmt.names) > len(best[1].names):
                best = (spec_type, fmt)
    return best


def sites_from_artifacts(directory: str | Path) -> list[SiteLinear]:
    """Quantized sites of a ``qpass apply`` output (``DIR`` or ``DIR/rollout``): each site's tensors
    are matched to a spec type by the ``export`` table's names and read by that type's ``onnx``
    table entry, which takes the activation options from the recipe's rollout passes.

    Raises:
        QpassError: missing files, a site the recipe does not explain, or a static-RAC site
            (its calibrated channels are not part of the artifacts).
    """
    from safetensors.torch import load_file

    from qpass.formats.spec import ALL_SPECS
    from qpass.graph.sites import _matches
    from qpass.compiler.recipe import parse_recipe
    from qpass.tables import load_core

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
    recipe = parse_recipe(rfile.read_bytes(), str(rfile))  # bytes: a non-UTF-8 file is a RecipeError naming the offset

    def pass_for(site: str):
        def find(names: tuple[str, ...]) -> Any:
            found = None
            for p in recipe.rollout:
                if p.name in names:
                    o = p.options
                    if any(_matches(site, t) for t in o.targets) and not any(_matches(site, e) for e in o.exclude):
                        found = p
            return found
        return find

    load_core()
    canonical = {type(s): s for s in ALL_SPECS if s.role == "weight"}  # the reader refines it (FP8 granularity)
    names = set(tensors)
    out: list[SiteLinear] = []
    for sid in sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight")}):
        found = _checkpoint_spec(sid, names)
        if found is None:
            continue
        spec_type, fmt = found
        spec = canonical[spec_type]
        consts = {c: tensors[f"{sid}.{suffix}"] for c, suffix in fmt.names.items()}
        out.append(onnx_linear(spec).from_checkpoint(sid, spec, consts, biases.get(f"{sid}.bias"), pass_for(sid), str(rfile)))
    if not out:
        raise QpassError(f"ONNX export: {wfile} holds no quantized site")
    return out


# ------------------------------------------------------------------------------------ graph
def emit_site_linear(b: GraphBuilder, s: SiteLinear, x: str, *, elem_type: int, out_type: int) -> str:
    """Emit ``y = <the site's rollout op>(x, ...)`` for one site; ``x`` is ``[tokens, K]`` of ``elem_type``.

    The operands come from the ``onnx`` table entry of the site's weight spec type; the float32
    ``MatMul`` (twice with RAC), the ``Mul`` by each accumulation's ``alpha`` (NVFP4, SPEC §3.1),
    ``+ bias`` and the one rounding are shared.
    Returns the output value (``out_type``: the model dtype rounding of the float32 accumulator).
    """
    xf = emit.to_float(b, x, elem_type)
    ops = onnx_linear(s.spec).operands(b, s, xf, elem_type)
    acc = b.op("MatMul", [ops.xq, b.op("Transpose", [ops.w], f"{s.site}.w_t", perm=[1, 0])], f"{s.site}.acc")
    if ops.alpha is not None:  # SPEC §3.1: the per-tensor scales once, on the output
        acc = b.op("Mul", [acc, ops.alpha], f"{s.site}.acc_alpha")
    if ops.comp is not None:
        w2 = ops.w if ops.cols is None else ops.cols
        acc2 = b.op("MatMul", [ops.comp, b.op("Transpose", [w2], f"{s.site}.w2_t", perm=[1, 0])], f"{s.site}.acc_comp")
        if ops.alpha2 is not None:
            acc2 = b.op("Mul", [acc2, ops.alpha2], f"{s.site}.acc_comp_alpha")
        acc = b.op("Add", [acc, acc2], f"{s.site}.acc_total")
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
    doc = f"qpass rollout linears ({flavour}): " + ", ".join(f"{s.site}={s.kind}/{s.act_label}" + (f"/rac{s.rac.ratio}-{s.rac.mode}-{s.rac.selection}" if s.rac else "") for s in recs)
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
