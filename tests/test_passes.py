"""Passes and the pass manager on a tiny random Llama: rewrites are proven against reference semantics.

"Proven" here means: every node a pass created is run on the activations the graph actually feeds
it and compared bit for bit with the reference function (qpass.quant.linear / nvfp4_qdq); the
learner graph is compared bit for bit with the eager model whose weights are replaced by the same
QDQ weights.
"""

from __future__ import annotations

import copy

import pytest
import torch

from qpass.errors import NoMatchError, PassError, PostconditionError, PreconditionError, RecipeError, VerificationError
from qpass.compiler.verify import verify
from qpass.ops import NVFP4_LINEAR, FP8LinearCall
from qpass.ops.linear import nvfp4_linear_ref
from qpass.compiler.manager import Pass, PassContext, PassManager, Rewrites
from qpass.quant.groups import group_amax
from qpass.quant.linear import fp8_linear_reference
from qpass.quant.nvfp4 import nvfp4_quantize
from qpass.compiler.recipe import load_recipe, parse_recipe
from qpass.sampling import positions_from_mask

from .conftest import tiny_llama


def _ids(b: int = 2, t: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (b, t), generator=g)
    am = torch.ones(b, t, dtype=torch.long)
    am[0, :3] = 0  # left padding on row 0
    return ids, am


class _NodeIO(torch.fx.Interpreter):
    """Record (args, output) of every node whose target is in ``targets``."""

    def __init__(self, gm, targets):
        super().__init__(gm)
        self.targets, self.seen = targets, []

    def run_node(self, n):
        out = super().run_node(n)
        if n.op == "call_function" and n.target in self.targets:
            self.seen.append((n, self.map_nodes_to_values(n.args, n), out))
        return out


def _prefill(qg, ids, am):
    full = torch.zeros(ids.shape[0], qg.captured.max_len, dtype=torch.long)
    full[:, : ids.shape[1]] = am
    return ids, positions_from_mask(am), torch.arange(ids.shape[1]), full


def test_sites_and_fused_groups(tiny_pipeline):
    sites = tiny_pipeline.base_scoring.sites
    assert len(sites) == 2 * 7 + 1  # 7 projections per layer + lm_head
    q = sites["model.layers.1.self_attn.q_proj"]
    assert (q.group, q.out_features, q.in_features) == ("model.layers.1.self_attn.qkv", 64, 64)
    assert sites["model.layers.0.mlp.up_proj"].group == "model.layers.0.mlp.gate_up"
    assert sites["model.layers.0.mlp.down_proj"].group == "model.layers.0.mlp.down_proj"
    assert set(tiny_pipeline.base_step.sites) == set(sites)
    for n in tiny_pipeline.base_scoring.gm.graph.nodes:
        assert "qpass_handle" in n.meta


class _FactoredSTE(torch.autograd.Function):
    """SPEC §3.1 learner linear, written out: ``y = fl(acc(X B^T) * S) (+ bias)``; backward
    ``dX = S * (dY B)``, ``dW = dY^T X`` (STE with ``W_hat = B * S``), ``dbias = sum dY``."""

    @staticmethod
    def forward(ctx, x, w, b, s, bias):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, b, s)
        ctx.wdt, ctx.bias_dt = w.dtype, None if bias is None else bias.dtype
        y = (x.reshape(-1, x.shape[-1]).float() @ b.t()) * s
        if bias is not None:
            y = y + bias.float()
        return y.reshape(*x.shape[:-1], b.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx, gy):  # noqa: ANN001, ANN205
        x, b, s = ctx.saved_tensors
        g2 = gy.reshape(-1, b.shape[0]).float()
        gx = ((g2 @ b) * s).reshape(x.shape).to(x.dtype)
        gw = (g2.t() @ x.reshape(-1, x.shape[-1]).float()).to(ctx.wdt)
        return gx, gw, None, None, None if ctx.bias_dt is None else g2.sum(0).to(ctx.bias_dt)


def _factored_eager_model(model):
    """A copy of ``model`` whose targeted linears compute the factored STE linear on their own group's
    NVFP4 quantization (independent of the graph and of qpass's learner op)."""
    from qpass.quant.nvfp4 import nvfp4_operand

    ref = copy.deepcopy(model)
    for layer in ref.model.layers:
        for group in ((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                      (layer.mlp.gate_proj, layer.mlp.up_proj), (layer.self_attn.o_proj,), (layer.mlp.down_proj,)):
            amax = group_amax([m.weight.detach() for m in group])
            for m in group:
                q = nvfp4_quantize(m.weight.detach(), amax)
                b, sd = nvfp4_operand(q), q.s_dec
                m.forward = lambda x, m=m, b=b, sd=sd: _FactoredSTE.apply(x, m.weight, b, sd, m.bias)
    return ref


def test_weight_qdq_learner_equals_eager_model_with_qdq_weights(tiny_pipeline):
    """The learner graph = the eager model with every targeted linear factored on its group's NVFP4
    quantization (SPEC §3.1), bit for bit."""
    learner, _ = tiny_pipeline.build(load_recipe("w4a16_qat"))
    assert learner.history[0].matches == 14 and learner.history[0].details["groups"] == 2 * 3 + 2 * 2 - 2 * 0 - 2
    ids, am = _ids()
    with torch.no_grad():
        got = learner.gm(ids, am, positions_from_mask(am))
        want = _factored_eager_model(tiny_pipeline.loaded.model)(
            input_ids=ids, attention_mask=am, position_ids=positions_from_mask(am), use_cache=False).logits
    assert torch.equal(got, want)


def test_weight_qdq_backward_is_straight_through(tiny_pipeline):
    learner, _ = tiny_pipeline.build(load_recipe("w4a16_qat"))
    ids, am = _ids()
    out = learner.gm(ids, am, positions_from_mask(am))
    out.float().square().mean().backward()
    w = learner.attr("model.model.layers.0.mlp.down_proj.weight")
    assert w.grad is not None and w.grad.abs().sum() > 0
    # STE: dL/dW = dL/dW_hat = dY^T X of the same factored forward, dL/dX = S_dec (dY B)
    ref = _factored_eager_model(tiny_pipeline.loaded.model)
    for p in ref.parameters():
        p.requires_grad_(True)
    ref(input_ids=ids, attention_mask=am, position_ids=positions_from_mask(am), use_cache=False).logits.float().square().mean().backward()
    assert torch.equal(w.grad, ref.model.layers[0].mlp.down_proj.weight.grad)


@pytest.mark.parametrize("recipe", ["naive_nvfp4", "w4a16_qat", "quads_nvfp4"])
def test_nvfp4_lowered_nodes_compute_reference_semantics(tiny_pipeline, recipe):
    _, rollout = tiny_pipeline.build(load_recipe(recipe))
    op = torch.ops.qpass.nvfp4_linear.default
    rec = _NodeIO(rollout.gm, {op})
    ids, am = _ids(b=4)
    with torch.no_grad():
        rec.run(*_prefill(rollout, ids, am))
    assert len(rec.seen) == 14
    base = tiny_pipeline.base_step
    for node, args, out in rec.seen:
        sid = args[5]
        assert torch.equal(out, nvfp4_linear_ref(NVFP4_LINEAR.make_call(*args)))  # the node computes the reference op on its real input
        members = rollout.quant[sid].members
        amax = group_amax([base.attr(base.sites[m].weight) for m in members])
        q = nvfp4_quantize(base.attr(base.sites[sid].weight), amax)
        assert torch.equal(args[1], q.codes) and torch.equal(args[2].view(torch.uint8), q.scales.view(torch.uint8))
        assert torch.equal(args[3], q.s_dec)
    kinds = {(a[6], a[7] > 0) for _, a, _ in rec.seen}
    expect = {"naive_nvfp4": {("nvfp4", False)}, "w4a16_qat": {("none", False)}, "quads_nvfp4": {("nvfp4", False), ("nvfp4", True)}}
    assert kinds == expect[recipe]
    # fused q/k/v share one global scale: identical S_dec bits
    sdec = {a[5]: a[3] for _, a, _ in rec.seen}
    assert torch.equal(sdec["model.layers.0.self_attn.q_proj"], sdec["model.layers.0.self_attn.v_proj"])


def test_fp8_lower_nodes_compute_reference(tiny_pipeline):
    _, rollout = tiny_pipeline.build(load_recipe("fp8_block"))
    op = torch.ops.qpass.fp8_linear.default
    rec = _NodeIO(rollout.gm, {op})
    ids, am = _ids(b=4)
    with torch.no_grad():
        rec.run(*_prefill(rollout, ids, am))
    assert len(rec.seen) == 14
    from qpass.formats.spec import FP8Spec, Granularity
    from qpass.quant.fp8 import FP8Tensor

    for _, a, out in rec.seen:
        w = FP8Tensor(a[1], a[2], a[1].shape, torch.bfloat16, FP8Spec(role="weight", granularity=Granularity.BLOCK_128X128))
        call = FP8LinearCall(x=a[0], weight=w, bias=a[3], act=FP8Spec(role="activation", granularity=Granularity.BLOCK_1X128),
                             site=a[4], out_dtype=a[0].dtype)
        assert torch.equal(out, fp8_linear_reference(call))


def test_static_rac_calibration(tiny_pipeline):
    text = ("name: s\nlearner:\n  - pass: weight_qdq\nrollout:\n  - pass: w4a4_lower\n"
            "  - pass: residual_compensation\n    ratio: 0.25\n    selection: static\n    mode: gathered\n")
    from qpass.calibration.source import ActivationSource
    from qpass.quant.rac import static_channels

    calls = []
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    x[:, 9] *= 30

    def collect(sites):
        calls.append(sites)
        return {s: x for s in sites}

    _, rollout = tiny_pipeline.build(parse_recipe(text), calibration=ActivationSource(collect))
    nodes = [n for n in rollout.gm.graph.nodes if n.target == torch.ops.qpass.nvfp4_linear.default and n.args[7] > 0]
    assert len(nodes) == 4 and calls and len(calls[0]) == 4
    ch = rollout.gm.get_buffer(nodes[0].args[10].target)
    assert ch.dtype == torch.int64 and ch.numel() == 16 and 9 in ch.tolist() and torch.equal(ch, ch.sort().values)
    assert torch.equal(ch, static_channels(x, 0.25))  # the one channel function, on the same data
    with pytest.raises(PassError, match="qpass calibrate"):
        tiny_pipeline.build(parse_recipe(text))


def test_pass_that_matches_nothing_fails_loudly(tiny_pipeline):
    # a pattern that matches no captured site fails before any pass runs (qpass.recipe.check_site_globs)
    text = 'name: x\nrollout:\n  - pass: w4a4_lower\n    targets: ["*.no_such_proj"]\n'
    with pytest.raises(RecipeError, match=r"<recipe>:3: rollout pass 'w4a4_lower': targets pattern '\*.no_such_proj' matches no site"):
        tiny_pipeline.build(parse_recipe(text))
    text = 'name: x\nrollout:\n  - pass: w4a4_lower\n    targets: ["*lm_head"]\n'
    with pytest.raises(NoMatchError):  # lm_head is excluded by default: explicit, not silent
        tiny_pipeline.build(parse_recipe(text))


def test_precondition_is_checked_on_the_graph_not_trusted(tiny_pipeline):
    rollout = tiny_pipeline.base_step.clone("rollout")
    rollout.properties.add("nvfp4_lowered")  # a lie: nothing is lowered
    rac = load_recipe("quads_nvfp4").rollout[1]
    with pytest.raises(PreconditionError, match="nvfp4_lowered"):
        PassManager([rac], side="rollout").run(rollout)


class _LyingPass(Pass):
    name = "lying"
    sides = ("learner",)
    ensures = ("weight_qdq",)

    def run(self, qg, ctx):
        return Rewrites(rewritten=["model.layers.0.self_attn.q_proj"])  # a lie: nothing was rewritten


class _CrashingPass(Pass):
    name = "crashing"
    sides = ("learner",)

    def run(self, qg, ctx):
        raise RuntimeError("boom")


def test_postcondition_and_reproducer(tiny_pipeline, tmp_path):
    learner = tiny_pipeline.base_scoring.clone("learner")
    with pytest.raises(PostconditionError, match="weight_qdq"):
        PassManager([_LyingPass()], side="learner").run(learner, PassContext(reproducer_dir=tmp_path))
    with pytest.raises(PassError, match="boom") as ei:
        PassManager([_CrashingPass()], side="learner").run(learner, PassContext(reproducer_dir=tmp_path))
    repro = [p for p in tmp_path.iterdir() if p.name.endswith("crashing")]
    assert repro and {"graph.py", "graph.txt", "passes.json", "error.txt"} <= {f.name for f in repro[0].iterdir()}
    assert "boom" in (repro[0] / "error.txt").read_text() and str(repro[0]) in str(ei.value)


def test_verifier_names_a_learner_op_in_the_rollout(tiny_pipeline):
    _, rollout = tiny_pipeline.build(load_recipe("naive_nvfp4"))
    verify(rollout)
    g = rollout.gm.graph
    emb = next(n for n in g.nodes if n.op == "get_attr" and "embed_tokens" in str(n.target))
    with g.inserting_after(emb):
        bad = g.call_function(torch.ops.qpass.group_amax.default, ([emb],))
    with pytest.raises(VerificationError, match=bad.name):
        verify(rollout)


def test_history_records_each_pass(tiny_pipeline):
    learner, rollout = tiny_pipeline.build(load_recipe("quads_nvfp4"))
    assert [h.name for h in learner.history] == ["weight_qdq"]
    assert [(h.name, h.matches) for h in rollout.history] == [("w4a4_lower", 14), ("residual_compensation", 4)]
    assert rollout.history[0].line == 9 and rollout.history[0].elapsed_s > 0
    assert rollout.history[0].details["removed_params"] >= 14  # BF16 weights of lowered sites left the rollout graph
