"""Whole-graph ONNX export of a rollout-lowered scoring graph (torch.onnx dynamo exporter + qpass
site subgraphs spliced in for the custom ops).

Every quantized site inside the exported graph is checked on the very input the ONNX graph feeds
it: its output equals the qpass rollout op on that input (bit for bit in bf16, where the final
rounding hides float32 summation order; to float32 reordering error in fp32). End to end, the
fp32 model's logits match the torch rollout graph within float32 error in onnxruntime (portable
flavour) and in the ONNX reference evaluator; in bf16 the non-quantized ops (norms, attention,
softmax) are the exporter's bf16 ops, which onnxruntime's CPU provider does not implement.
"""

from __future__ import annotations

import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript", reason="the dynamo ONNX exporter needs onnxscript")

from qpass.backends.onnx import run_onnx  # noqa: E402
from qpass.backends.onnx.graph_export import export_rollout_graph_onnx, rollout_graph_model, rollout_scoring_graph  # noqa: E402
from qpass.recipe import load_recipe  # noqa: E402

try:
    import onnxruntime  # noqa: F401

    HAVE_ORT = True
except ImportError:  # pragma: no cover
    HAVE_ORT = False


def _inputs(seq: int = 9) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones(2, seq, dtype=torch.long), "position_ids": torch.arange(seq).expand(2, seq).contiguous()}


def _expose_sites(model) -> dict[str, tuple[str, str]]:
    """Make every site's input and output graph outputs; returns {site: (x value, y value)}."""
    xs, ys = {}, {}
    for n in model.graph.node:
        for o in n.output:
            if o.endswith(".x2") and n.op_type == "Reshape":
                xs[o[:-3]] = n.input[0]
        if n.op_type == "Reshape" and n.name.startswith("n_") and n.name.endswith(".y"):
            ys[n.name[2:-2]] = n.output[0]
    for s in xs:
        for v in (xs[s], ys[s]):
            vi = onnx.ValueInfoProto()
            vi.name = v
            model.graph.output.append(vi)
    return {s: (xs[s], ys[s]) for s in xs}


def _site_outputs_match_ops(rollout, out, sites, *, exact: bool) -> int:
    n_exact = 0
    for s, (xv, yv) in sites.items():
        node = next(n for n in rollout.nodes_of_site(s) if n.op == "call_function" and str(n.target).startswith("qpass"))
        args = [rollout.attr(str(a.target)) if isinstance(a, torch.fx.Node) else a for a in node.args[1:]]
        ref = node.target(out[xv], *args)
        assert torch.allclose(out[yv].float(), ref.float(), rtol=1e-5, atol=1e-6), s
        n_exact += int(torch.equal(out[yv], ref))
    if exact:
        assert n_exact == len(sites)
    return n_exact


def test_whole_rollout_graph_bf16_spec_flavour(tiny_pipeline, tmp_path):
    rollout = rollout_scoring_graph(tiny_pipeline, load_recipe("quads_nvfp4"))  # W4A4 + RAC on gate/up
    path = tmp_path / "rollout_graph.onnx"
    rep = export_rollout_graph_onnx(rollout, path, flavour="spec")
    assert rep.opset == 23 and len(rep.sites) == 14 and [p.name for p in tmp_path.iterdir()] == [path.name]
    model = onnx.load(str(path))
    assert not any(n.domain == "qpass" for n in model.graph.node)
    assert sum(n.op_type == "DequantizeLinear" for n in model.graph.node) >= 14
    sites = _expose_sites(model)
    assert len(sites) == 14
    feeds = _inputs()
    out = run_onnx(model, feeds)
    _site_outputs_match_ops(rollout, out, sites, exact=True)
    with torch.no_grad():
        ref = rollout.gm(*feeds.values())
    logits = out[model.graph.output[0].name]
    assert logits.shape == ref.shape and logits.dtype == torch.bfloat16
    # bf16 norms/attention differ from torch's kernels by bf16 rounding; W4A4 amplifies it a little
    assert (logits.float() - ref.float()).abs().max() < 0.25 * ref.float().abs().max()


@pytest.mark.skipif(not HAVE_ORT, reason="onnxruntime not installed")
def test_whole_rollout_graph_fp32_portable_runs_in_onnxruntime():
    from .conftest import tiny_llama

    from qpass.graph.model import LoadedModel
    from qpass.pipeline import Pipeline

    pipe = Pipeline.prepare(loaded=LoadedModel(model=tiny_llama(dtype=torch.float32), tokenizer=None, name="tiny-f32", source="random"),
                            dtype=torch.float32, batch_size=2, max_len=16)
    rollout = rollout_scoring_graph(pipe, load_recipe("quads_nvfp4"))
    model = rollout_graph_model(rollout, flavour="portable", dtype=torch.float32)
    assert next(o.version for o in model.opset_import if o.domain == "") == 21
    sites = _expose_sites(model)
    feeds = _inputs()
    with torch.no_grad():
        ref = rollout.gm(*feeds.values())
    for runtime in ("onnxruntime", "reference"):
        out = run_onnx(model, feeds, runtime=runtime)
        _site_outputs_match_ops(rollout, out, sites, exact=False)
        logits = out[model.graph.output[0].name]
        assert torch.allclose(logits, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max())), runtime


def test_step_graph_is_refused_with_a_pointer(tiny_pipeline):
    from qpass.errors import QpassError
    from qpass.recipe import parse_recipe

    _, step = tiny_pipeline.build(parse_recipe("name: t\nrollout:\n  - pass: w4a16_lower\n"))
    with pytest.raises(QpassError, match="needs a scoring-kind rollout graph"):
        rollout_graph_model(step)
