"""Whole-graph ONNX export of a rollout-lowered **scoring** graph (prefill semantics, no KV cache).

``torch.onnx.export(gm, dynamo=True, custom_translation_table=...)`` translates every ATen node
itself; each qpass rollout op (``qpass::nvfp4_linear`` / ``fp8_linear`` / ``mxfp4_linear``) is
translated into a placeholder node of domain ``qpass`` carrying its site id, which is then replaced
by the per-site subgraph of :func:`qpass.backends.onnx.export.emit_site_linear` (weight decode from
the stored bytes, dynamic activation fake-quant, RAC, float32 MatMul) — the same emitters the
per-site export uses, so the quantized linears are qpass's arithmetic op for op.

Scope (measured on torch 2.13 / onnxscript 0.7.2): the **step** graph (static KV cache updated in
place) does not re-export — ``torch.onnx.export`` stops in its decomposition step with
``AssertionError: expected compiled_fn to be GraphModule, got <class 'function'>`` — so this
exports the scoring graph with the recipe's rollout passes applied (:func:`rollout_scoring_graph`):
one forward over whole sequences, i.e. the rollout's prefill of a batch. The non-quantized parts
(norms, rotary, attention, softmax) are the exporter's ONNX ops in the model dtype; they are not
bit-exact to torch (different bf16 op implementations), the quantized linears are.

Needs ``onnxscript`` (the dynamo exporter's translation library).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
import torch
from onnx import helper

from qpass.atomic import write_atomic
from qpass.errors import QpassError

from qpass.backends.onnx import emit
from qpass.backends.onnx.builder import PORTABLE_OPSET, TORCH_TO_ONNX, GraphBuilder, check_flavour
from qpass.backends.onnx.export import ExportReport, emit_site_linear, sites_from_qgraph
from qpass.backends.onnx.table import onnx_lowering

QPASS_DOMAIN = "qpass"


def rollout_scoring_graph(pipeline: Any, recipe: Any) -> Any:
    """Clone ``pipeline.base_scoring`` and run ``recipe``'s rollout passes on it (side ``rollout``).

    Returns a :class:`~qpass.graph.qgraph.QGraph` of kind ``scoring`` whose linears are the
    rollout's quantized ops (same quantized bytes as the step graph ``Pipeline.build`` makes).
    """
    from qpass.compiler.manager import PassContext, PassManager

    qg = pipeline.base_scoring.clone("rollout")
    PassManager(recipe.rollout, side="rollout").run(qg, PassContext(recipe_path=getattr(recipe, "path", None)))
    return qg


def _placeholder_translations() -> dict[Any, Any]:
    import onnxscript
    from onnx import defs

    from qpass.graph.qgraph import quantized_linear_targets

    dom = onnxscript.values.Opset(QPASS_DOMAIN, 1)
    fp = defs.OpSchema.FormalParameter
    tensor_types = ["tensor(bfloat16)", "tensor(float16)", "tensor(float)", "tensor(uint8)", "tensor(float8e4m3fn)"]

    def schema(name: str, n_in: int) -> defs.OpSchema:
        return defs.OpSchema(
            name, QPASS_DOMAIN, 1, inputs=[fp(f"i{i}", "T") for i in range(n_in)], outputs=[fp("y", "T")],
            type_constraints=[("T", tensor_types, "")], attributes=[defs.OpSchema.Attribute("site", defs.OpSchema.AttrType.STRING, "")],
        )

    nv_op, fp8_op, mx_op = quantized_linear_targets()
    nv = onnxscript.values.Op(dom, "nvfp4_linear", schema("nvfp4_linear", 1))
    f8 = onnxscript.values.Op(dom, "fp8_linear", schema("fp8_linear", 1))
    mx = onnxscript.values.Op(dom, "mxfp4_linear", schema("mxfp4_linear", 1))

    # Only x and the site id matter: the weight bytes and options are re-read from the QGraph.
    def nv_tr(x, w_codes, w_scales, w_s_dec, bias=None, site="", act="none", rac_ratio=0.0, rac_mode="masked", rac_selection="batch", rac_channels=None):  # noqa: ANN001, ARG001
        return nv(x, site=site)

    def f8_tr(x, w_data, w_scale, bias=None, site="", act_granularity="", w_granularity=""):  # noqa: ANN001, ARG001
        return f8(x, site=site)

    def mx_tr(x, w_codes, w_scales, bias=None, site=""):  # noqa: ANN001, ARG001
        return mx(x, site=site)

    return {nv_op: nv_tr, fp8_op: f8_tr, mx_op: mx_tr}


def _example_inputs(gm: torch.fx.GraphModule, batch: int, seq: int) -> tuple[tuple[torch.Tensor, ...], tuple[dict[int, Any], ...]]:
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if names != ["input_ids", "attention_mask", "position_ids"]:
        raise QpassError(f"whole-graph ONNX export needs a scoring graph (input_ids, attention_mask, position_ids), got inputs {names}")
    ids = torch.zeros(batch, seq, dtype=torch.long)
    am = torch.ones(batch, seq, dtype=torch.long)
    pos = torch.arange(seq).expand(batch, seq).contiguous()
    bd, td = torch.export.Dim("batch", min=1, max=4096), torch.export.Dim("seq", min=2, max=8192)
    return (ids, am, pos), ({0: bd, 1: td}, {0: bd, 1: td}, {0: bd, 1: td})


def rollout_graph_model(rollout: Any, *, flavour: str = "spec", dtype: torch.dtype = torch.bfloat16) -> onnx.ModelProto:
    """The whole rollout scoring graph as ONNX (see module docstring).

    Raises:
        QpassError: ``rollout`` is not a scoring graph, or a placeholder names an unknown site.
    """
    check_flavour(flavour)
    if getattr(rollout, "kind", None) != "scoring":
        raise QpassError(f"whole-graph ONNX export needs a scoring-kind rollout graph (see rollout_scoring_graph), got kind={getattr(rollout, 'kind', None)!r}")
    sites = {s.site: s for s in sites_from_qgraph(rollout)}
    # the highest opset any site's weight emitter needs (``onnx`` table; MXFP4's E8M0 scales: 24)
    opset = max([emit.OPSET_FP4 if flavour == "spec" else PORTABLE_OPSET]
                + [onnx_lowering(s.spec).opset[flavour] for s in sites.values()])
    args, dyn = _example_inputs(rollout.gm, 2, 5)
    prog = torch.onnx.export(rollout.gm, args, dynamic_shapes=dyn, dynamo=True, custom_translation_table=_placeholder_translations(),
                             optimize=False, verify=False, opset_version=opset)
    src = prog.model_proto
    g = src.graph
    b = GraphBuilder(flavour, name=g.name or "qpass_rollout")
    b.need_opset(opset)
    b._names.update(v for n in g.node for v in list(n.input) + list(n.output))
    b._names.update(v.name for v in list(g.input) + list(g.output) + list(g.initializer))
    et = TORCH_TO_ONNX[dtype]
    new_nodes: list[onnx.NodeProto] = []
    done: set[str] = set()
    for node in g.node:
        if node.domain != QPASS_DOMAIN:
            new_nodes.append(node)
            continue
        site = next((a.s.decode() for a in node.attribute if a.name == "site"), "")
        if site not in sites:
            raise QpassError(f"whole-graph ONNX export: placeholder {node.name} names site {site!r}, not a quantized site of the rollout")
        s = sites[site]
        start = len(b.nodes)
        x = node.input[0]
        x2 = b.op("Reshape", [x, b.i64([-1, s.in_features])], f"{site}.x2")
        y2 = emit_site_linear(b, s, x2, elem_type=et, out_type=et)
        lead = b.op("Slice", [b.op("Shape", [x], f"{site}.x_shape"), b.i64([0]), b.i64([-1])], f"{site}.lead")
        shape = b.op("Concat", [lead, b.i64([s.out_features])], f"{site}.y_shape", axis=0)
        b.nodes.append(helper.make_node("Reshape", [y2, shape], [node.output[0]], name=b.fresh(f"n_{site}.y")))
        new_nodes.extend(b.nodes[start:])
        done.add(site)
    used = {i for n in new_nodes for i in n.input}
    inits = [t for t in g.initializer if t.name in used] + b.initializers
    graph = helper.make_graph(new_nodes, g.name, list(g.input), list(g.output), initializer=inits,
                              value_info=[v for v in g.value_info if not v.name.startswith(tuple(done))])
    opsets = [helper.make_opsetid(o.domain, max(o.version, b.opset) if o.domain == "" else o.version) for o in src.opset_import if o.domain != QPASS_DOMAIN]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="qpass", doc_string=f"qpass rollout scoring graph ({flavour}); quantized sites: {sorted(done)}")
    model.ir_version = max(src.ir_version, helper.find_min_ir_version_for(opsets))
    for f in src.functions:  # exporter-generated local functions, if any
        model.functions.append(f)
    if len(done) != len(sites):
        raise QpassError(f"whole-graph ONNX export: sites {sorted(set(sites) - done)} have no op in the exported graph")
    return model


def export_rollout_graph_onnx(rollout: Any, path: str | Path, *, flavour: str = "spec", dtype: torch.dtype = torch.bfloat16, check: bool = True) -> ExportReport:
    """Write :func:`rollout_graph_model` to ``path`` atomically (temp file + rename); the spec
    flavour is validated with ``onnx.checker.check_model(full_check=True)`` first."""
    model = rollout_graph_model(rollout, flavour=flavour, dtype=dtype)
    if check:
        onnx.checker.check_model(model, full_check=flavour == "spec")
    path = Path(path)
    data = model.SerializeToString()
    write_atomic(path, data)
    opset = next(o.version for o in model.opset_import if o.domain == "")
    sites = tuple(sorted(s.site for s in sites_from_qgraph(rollout)))
    return ExportReport(path, flavour, opset, sites, len(data))


__all__ = ["QPASS_DOMAIN", "export_rollout_graph_onnx", "rollout_graph_model", "rollout_scoring_graph"]
