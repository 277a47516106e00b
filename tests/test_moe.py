"""MoE: per-expert sites, w1/w3 shared amax, W4A4 + RAC per expert, routing record/replay, upcycling.

Tiny random Qwen3-MoE / OLMoE / Mixtral configs (hidden 32, 2 layers, 4 experts, top-2): the same
code path as any Hugging Face MoE directory and as ``--model moe-default``.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_llama

E, K_TOP, H, I_MOE = 4, 2, 32, 32


def tiny_moe(kind: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16, vocab: int = 128) -> torch.nn.Module:
    """2-layer MoE of class ``kind`` (hidden 32, expert MLP 32, 4 experts, top-2, vocab ``vocab``)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, max_position_embeddings=128, num_experts_per_tok=K_TOP)
    if kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, intermediate_size=64, moe_intermediate_size=I_MOE, num_experts=E, norm_topk_prob=True)
        cls = tf.Qwen3MoeForCausalLM
    elif kind == "olmoe":
        cfg = tf.OlmoeConfig(**common, intermediate_size=I_MOE, num_experts=E, pad_token_id=0, eos_token_id=1, bos_token_id=1)
        cls = tf.OlmoeForCausalLM
    else:
        cfg = tf.MixtralConfig(**common, intermediate_size=I_MOE, num_local_experts=E)
        cls = tf.MixtralForCausalLM
    m = cls(cfg).to(dtype).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)  # routers (zero-initialised in Qwen3/OLMoE) must route
    for p in m.parameters():
        p.requires_grad_(False)
    return m


KINDS = ("qwen3_moe", "olmoe", "mixtral")


@pytest.mark.parametrize("kind", KINDS)
def test_prepare_moe_keeps_the_function_and_the_router(kind):
    from qpass.moe import prepare_moe
    from qpass.moe.routing import record_routes

    m = tiny_moe(kind, dtype=torch.float32)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    ref = m(ids).logits
    gate = m.model.layers[0].mlp.gate
    h = torch.randn(18, H, generator=torch.Generator().manual_seed(2))
    ref_router = gate(h)
    assert prepare_moe(m) == 2 and prepare_moe(m) == 0  # idempotent
    new_router = gate(h)
    for a, b in zip(ref_router, new_router):
        assert torch.equal(a, b)  # recomputed top-k weights are bit-identical to transformers' router
    ex = m.model.layers[1].mlp.experts
    assert [n for n, _ in ex.named_children()] == [str(e) for e in range(E)]
    with record_routes() as tape:
        out = m(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)  # split vs fused GEMM: fp32 summation order only
    assert sorted(tape.records) == ["layers.0", "layers.1"] and tape.records["layers.0"][0].shape == (18, K_TOP)


@pytest.fixture(scope="module")
def moe_pipes():
    from qpass.graph.model import LoadedModel
    from qpass.pipeline import Pipeline

    return {k: Pipeline.prepare(loaded=LoadedModel(model=tiny_moe(k), tokenizer=None, name=f"tiny-{k}", source="random"),
                                batch_size=2, max_len=24) for k in ("qwen3_moe", "mixtral")}


def test_expert_sites_are_stable_and_the_router_is_excluded(moe_pipes):
    from qpass.graph.sites import select_sites
    from qpass.pm import PassOptions

    for pipe in moe_pipes.values():
        for qg in (pipe.base_scoring, pipe.base_step):
            ids = list(qg.sites)
            expert = [s for s in ids if ".experts." in s]
            assert len(expert) == 2 * E * 3
            assert "model.layers.1.mlp.experts.3.down_proj" in expert and "model.layers.0.mlp.gate" in ids
            assert not any("slice(" in s for s in ids)
            grp = qg.sites["model.layers.0.mlp.experts.2.up_proj"].group
            assert grp == qg.sites["model.layers.0.mlp.experts.2.gate_proj"].group == "model.layers.0.mlp.experts.2.gate_up"
            sel = [s.id for s in select_sites(qg.sites.values(), ["*"], PassOptions().exclude)]
            assert "model.layers.0.mlp.gate" not in sel and "model.layers.0.mlp.experts.0.gate_proj" in sel
            glob = select_sites(qg.sites.values(), ["*.mlp.experts.*.gate_proj"])
            assert len(glob) == 2 * E


def test_learner_w13_share_one_global_scale_per_expert(moe_pipes):
    from qpass.quant.groups import group_amax
    from qpass.quant.nvfp4 import nvfp4_quantize
    from qpass.recipe import load_recipe

    pipe = moe_pipes["qwen3_moe"]
    learner = pipe.build_side(load_recipe("quads_nvfp4_moe"), "learner", share_params=True)
    amax_nodes = [n for n in learner.gm.graph.nodes if n.target == torch.ops.qpass.group_amax.default]
    w13 = [n for n in amax_nodes if n.meta["qpass_group"].endswith(".gate_up") and ".experts." in n.meta["qpass_group"]]
    assert len(w13) == 2 * E and all(len(n.args[0]) == 2 for n in w13)
    rec = learner.quant["model.layers.0.mlp.experts.1.gate_proj"]
    assert rec.group == "model.layers.0.mlp.experts.1.gate_up" and rec.members[1].endswith("experts.1.up_proj")
    # the shared scale: S_dec of gate == S_dec of up == fl(1 / fl(2688 / max(amax_gate, amax_up)))
    ex = pipe.loaded.model.model.layers[0].mlp.experts[1]
    amax = group_amax([ex.gate_proj.weight, ex.up_proj.weight])
    g = nvfp4_quantize(ex.gate_proj.weight, amax=amax)
    u = nvfp4_quantize(ex.up_proj.weight, amax=amax)
    assert torch.equal(g.s_dec, u.s_dec)
    assert max(ex.gate_proj.weight.abs().max(), ex.up_proj.weight.abs().max()).float() == amax


@pytest.mark.parametrize("rac", [None, 0.5])
def test_triton_grouped_gemm_matches_the_per_expert_reference(rac):
    """Interpreter: operands of the grouped path are the per-expert reference's bit for bit; the
    grouped GEMM equals each expert's per-site Triton W4A4 linear bit for bit (same interpreter
    tiles, K = 128 so no split-K) and the reference within the float32-summation contract."""
    from qpass.backends.triton.linear import w4a4_linear_triton
    from qpass.backends.triton.moe import grouped_reference, grouped_w4a4_triton, sort_by_expert
    from qpass.formats.spec import NVFP4_ACT
    from qpass.quant.groups import group_amax
    from qpass.quant.nvfp4 import nvfp4_quantize
    from qpass.quant.rac import RACConfig
    from tests._triton_testutil import activations, fresh_seed

    seed = fresh_seed()
    e_n, t, k, n = 4, 13, 128, 48
    x = activations(t, k)
    routes = torch.stack([torch.randperm(e_n)[:2] for _ in range(t)])
    routes[routes == 3] = 2  # expert 3 gets no token; expert 2 some rows twice? no: keep sets distinct
    routes = torch.stack([torch.tensor([0, 2]) if r[0] == r[1] else r for r in routes])
    tok, _slot, offs = sort_by_expert(routes, e_n)
    assert offs[4] - offs[3] == 0 and offs[-1] == 2 * t
    ws = [torch.randn(n, k).to(torch.bfloat16) for _ in range(e_n)]
    wq = [nvfp4_quantize(w, amax=group_amax([w])) for w in ws]
    cfg = RACConfig(rac, "masked", "batch") if rac else None
    xs = x[tok]
    y = grouped_w4a4_triton(xs, offs, wq, act_spec=NVFP4_ACT, rac=cfg, out_dtype=torch.float32)
    ref = grouped_reference(xs.float(), offs, wq, act_spec=NVFP4_ACT, rac=cfg)
    for e in range(e_n):
        lo, hi = offs[e], offs[e + 1]
        if hi == lo:
            continue
        alone = w4a4_linear_triton(xs[lo:hi], wq[e].codes, wq[e].scales, wq[e].s_dec, act_spec=NVFP4_ACT, rac=cfg,
                                   out_dtype=torch.float32)
        assert torch.equal(y[lo:hi], alone), (seed, e)
    rel = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    assert rel < 1e-5, (seed, rel)


def test_rollout_expert_op_sees_only_its_tokens_with_rac(moe_pipes):
    """Each expert's W4A4 + RAC op quantizes exactly the tokens routed to it (its own dynamic global
    scale and RAC channel scores), and equals the reference linear on those rows bit for bit."""
    from qpass.graph.opargs import op_args
    from qpass.moe.routing import record_routes
    from qpass.quant.linear import w4a4_linear_reference
    from qpass.quant.nvfp4 import NVFP4Tensor, nvfp4_act_spec
    from qpass.quant.rac import RACConfig
    from qpass.recipe import load_recipe
    from qpass.runtime.prefill import step_prefill_args

    pipe = moe_pipes["qwen3_moe"]
    ro = pipe.build_side(load_recipe("quads_nvfp4_moe"), "rollout", share_params=True)
    site = "model.layers.1.mlp.experts.2.gate_proj"
    assert ro.quant[site].lowered and ro.quant[site].group.endswith("experts.2.gate_up")
    seen = {}

    class Spy(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):
            out = super().call_function(target, args, kwargs)
            if target == torch.ops.qpass.nvfp4_linear.default and args[5] == site:
                seen["args"], seen["out"] = args, out
            return out

    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(3))
    args = step_prefill_args(ids, torch.ones_like(ids), batch_size=2, max_len=24)
    with record_routes() as tape, torch.no_grad():
        Spy(ro.gm).run(*args)
    routes = tape.records["layers.1"][0]
    x, codes, scales, sdec = seen["args"][:4]
    assert x.shape[0] == int((routes == 2).any(-1).sum()) > 0
    assert seen["args"][6:10] == ("nvfp4", 0.5, "masked", "batch")
    down = [n for n in ro.gm.graph.nodes if n.target == torch.ops.qpass.nvfp4_linear.default
            and op_args(n)["site"] == site.replace("gate_proj", "down_proj")]
    assert op_args(down[0])["rac_ratio"] == 0.0  # RAC only on W13
    w = NVFP4Tensor.from_parts(codes, scales, sdec)
    ref = w4a4_linear_reference(x, w, act_spec=nvfp4_act_spec(False), rac=RACConfig(0.5, "masked", "batch"))
    assert torch.equal(seen["out"], ref)


def test_routing_mismatch_and_route_assembly_by_hand():
    from qpass.moe.routing import RoutingError, generate_routes, routing_mismatch

    a = {"layers.0": torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])}
    b = {"layers.0": torch.tensor([[1, 0], [2, 1], [1, 0], [0, 2]])}
    m = routing_mismatch(a, b)
    assert m == {"layers.0": {"mismatch": 0.5, "tokens": 4}}  # sets {0,1}={0,1}, {2,3}!={1,2}, same, {2,3}!={0,2}
    assert routing_mismatch(a, b, torch.tensor([True, True, False, False]))["layers.0"] == {"mismatch": 0.5, "tokens": 2}
    # a rollout with B=2, P=3: prefill [6, k], then decode calls [2, k]; seq 3 + 2 generated tokens = 5
    pre = torch.arange(12).reshape(6, 2)
    dec = torch.tensor([[7, 7], [8, 8]])
    full = generate_routes({"layers.0": [pre, dec]}, batch_size=2, prompt_len=3, seq_len=5)["layers.0"].reshape(2, 5, 2)
    assert torch.equal(full[1, :3], pre[3:]) and torch.equal(full[:, 3], dec) and (full[:, 4] == -1).all()
    with pytest.raises(RoutingError, match="layers.0.*prefill"):
        generate_routes({"layers.0": [dec]}, batch_size=2, prompt_len=3, seq_len=5)


def test_routing_replay_takes_effect_in_the_learner_graph(moe_pipes):
    from qpass.moe.routing import RoutingError, concat_records, record_routes, replay_routes

    pipe = moe_pipes["mixtral"]
    gm = pipe.base_scoring.gm
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(4))
    am, pos = torch.ones_like(ids), torch.arange(7).expand(2, 7)
    with torch.no_grad(), record_routes() as tape:
        ref = gm(ids, am, pos)
    own = concat_records(tape.records)
    with torch.no_grad(), replay_routes(own):
        assert torch.equal(gm(ids, am, pos), ref)  # replaying its own routes is the identity, bit for bit
    shifted = {k: (v + 1) % E for k, v in own.items()}
    with torch.no_grad(), replay_routes(shifted):
        assert not torch.equal(gm(ids, am, pos), ref)
    keep = {k: torch.full_like(v, -1) for k, v in own.items()}  # -1: keep the graph's own route
    with torch.no_grad(), replay_routes(keep):
        assert torch.equal(gm(ids, am, pos), ref)
    with torch.no_grad(), replay_routes({"layers.0": own["layers.0"]}), pytest.raises(RoutingError, match="layers.1"):
        gm(ids, am, pos)


def test_logprob_gap_with_and_without_routing_replay(moe_pipes):
    from qpass.parity.behavior import logprob_gap
    from qpass.recipe import load_recipe

    pipe = moe_pipes["mixtral"]
    learner, rollout = pipe.build(load_recipe("quads_nvfp4_moe"))
    prompts = [[5, 9, 17, 3], [44, 2, 8]]
    gap = logprob_gap(learner, rollout, prompts, pad_token_id=0, eos_token_id=1, max_new_tokens=6, routing=True)
    s = gap.summary()
    assert s["routing_replay"]["tokens"] == s["tokens"] > 0
    mm = s["routing_mismatch"]
    assert sorted(mm["layers"]) == ["layers.0", "layers.1"]
    # valid tokens: real prompt tokens + valid responses, minus the last position (never routed by the rollout)
    n_valid = sum(int(b.attention_mask[:b.n_real, :-1].sum()) for b in gap.batches)
    assert all(v["tokens"] == n_valid and 0.0 <= v["mismatch"] <= 1.0 for v in mm["layers"].values())
    assert mm["layers"]["layers.0"]["mismatch"] > 0  # W4A4 rollout vs W4A16 learner routes differ somewhere
    plain = logprob_gap(learner, rollout, prompts, pad_token_id=0, eos_token_id=1, max_new_tokens=6)
    assert torch.equal(plain.d, gap.d) and plain.replay is None  # the no-replay path is the plain check


def test_fused_moe_export_round_trip_and_one_w13_scale(moe_pipes):
    from qpass.apps.artifacts import rollout_tensors
    from qpass.errors import QpassError
    from qpass.moe.export import checkpoint_name, fused_moe_params, unfuse_moe_params
    from qpass.recipe import load_recipe

    ro = moe_pipes["qwen3_moe"].build_side(load_recipe("quads_nvfp4_moe"), "rollout", share_params=True)
    per_site = rollout_tensors(ro)
    fused = fused_moe_params(per_site)
    p = "model.layers.1.mlp.experts."
    assert fused[p + "w13_weight"].shape == (E, 2 * I_MOE, H // 2) and fused[p + "w13_weight"].dtype == torch.uint8
    assert fused[p + "w13_weight_scale"].shape == (E, 2 * I_MOE, H // 16)
    assert fused[p + "w13_weight_scale_2"].shape == (E, 2) and fused[p + "w2_weight_scale_2"].shape == (E,)
    g13 = fused[p + "w13_weight_scale_2"]
    assert torch.equal(g13[:, 0].view(torch.int32), g13[:, 1].view(torch.int32))  # one w13 scale per expert
    back = unfuse_moe_params(fused)
    expert_keys = {k for k in per_site if ".experts." in k and not k.endswith("weight_global_scale")}
    assert set(back) == expert_keys
    for k in expert_keys:
        a, b = per_site[k], back[k]
        assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), k
    bad = dict(per_site)
    bad["model.layers.0.mlp.experts.1.up_proj.weight_scale_2"] = bad["model.layers.0.mlp.experts.1.up_proj.weight_scale_2"] * 2
    with pytest.raises(QpassError, match=r"layers.0.mlp.experts.1: gate and up weight_scale_2 differ"):
        fused_moe_params(bad)
    assert checkpoint_name("model.layers.3.mlp.experts.5.up_proj.weight_scale", "mixtral") == \
        "model.layers.3.block_sparse_moe.experts.5.w3.weight_scale"
    assert checkpoint_name("model.layers.3.mlp.experts.5.up_proj.weight", "qwen3_moe") == "model.layers.3.mlp.experts.5.up_proj.weight"


def test_sites_do_not_depend_on_the_experts_implementation():
    from qpass.graph.capture import capture_scoring
    from qpass.graph.sites import discover_sites
    from qpass.moe import prepare_moe

    ids = {}
    for impl in ("eager", "batched_mm"):
        m = tiny_moe("mixtral")
        m.config._experts_implementation = impl
        prepare_moe(m)
        ids[impl] = list(discover_sites(capture_scoring(m, example_len=4).gm))
    assert ids["eager"] == ids["batched_mm"] and "model.layers.1.mlp.experts.3.up_proj" in ids["eager"]


def test_sparse_upcycling_preserves_the_dense_function_at_zero_noise():
    from qpass.moe.upcycle import UpcycleConfig, upcycle

    dense = tiny_llama(dtype=torch.float32)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(5))
    ref = dense(ids).logits
    exact = upcycle(dense, UpcycleConfig(num_experts=4, top_k=2, noise=0.0))
    assert type(exact).__name__ == "MixtralForCausalLM" and exact.config.num_local_experts == 4
    torch.testing.assert_close(exact(ids).logits, ref, rtol=1e-5, atol=1e-5)  # every expert = the dense MLP, weights sum to 1
    noisy = upcycle(dense, UpcycleConfig(num_experts=4, top_k=2, noise=0.01))
    gu = noisy.model.layers[0].mlp.experts.gate_up_proj
    assert not torch.equal(gu[0], gu[1])  # experts differ
    g = dense.model.layers[0].mlp.gate_proj.weight
    rel = ((gu[0, : g.shape[0]] - g).std() / g.std()).item()
    assert 0.005 < rel < 0.02  # noise = 0.01 x std(W)
    assert not torch.equal(noisy.model.layers[0].mlp.gate.weight, torch.zeros_like(noisy.model.layers[0].mlp.gate.weight))


def test_expert_without_tokens_passes_through_the_quantized_ops():
    """An expert no token was routed to runs the rollout and learner-QDQ ops on 0 rows."""
    import qpass.ops  # noqa: F401 - registers qpass::nvfp4_linear
    import qpass.quant.qdq  # noqa: F401 - registers qpass::nvfp4_act_qdq
    from qpass.quant.nvfp4 import nvfp4_quantize

    w = nvfp4_quantize(torch.randn(48, 32).to(torch.bfloat16))
    x = torch.empty(0, 32, dtype=torch.bfloat16)
    y = torch.ops.qpass.nvfp4_linear(x, w.codes, w.scales, w.s_dec, None, "e0", "nvfp4", 0.5, "masked", "batch", None)
    assert y.shape == (0, 48) and y.dtype == torch.bfloat16
    assert torch.ops.qpass.nvfp4_act_qdq(x, "e0", False).shape == (0, 32)


def test_study_layer_restriction_keeps_rac_on_expert_w13():
    import re

    from qpass.apps.study.configs import RACOverride, study_recipe

    r = study_recipe("quads_nvfp4_moe", layers=2, rac=RACOverride(0.25, "masked", "batch"))
    rac = next(p for p in r.rollout if p.name == "residual_compensation")
    assert rac.options.ratio == 0.25
    pat = rac.options.targets[0][3:]
    assert re.fullmatch(pat, "model.layers.1.mlp.experts.7.up_proj") and re.fullmatch(pat, "model.layers.0.mlp.experts.0.gate_proj")
    assert not re.fullmatch(pat, "model.layers.2.mlp.experts.7.up_proj") and not re.fullmatch(pat, "model.layers.1.mlp.experts.7.down_proj")


def test_input_scale_calibration_skips_experts_a_prompt_does_not_reach():
    """One token reaches 2 of 4 experts per layer; the others get an empty input, which must not crash
    ``qpass export``'s input_scale calibration (it did on moe-default: ``amax()`` of an empty tensor)."""
    from qpass.checkpoint.calibrate import input_amax
    from qpass.moe import prepare_moe

    m = tiny_moe("mixtral", dtype=torch.float32)
    prepare_moe(m)
    sites = [f"model.layers.0.mlp.experts.{e}.gate_proj" for e in range(E)]
    amax = input_amax(m, sites, [[5]])
    assert len(amax) == K_TOP and all(float(a) > 0 for a in amax.values())
    from qpass.checkpoint.calibrate import group_input_amax

    unreached: list[str] = []
    g = group_input_amax(amax, {s: s for s in sites}, unreached)  # unreached experts: the layer's max for that projection
    assert sorted(unreached) == sorted(set(sites) - set(amax)) and len(unreached) == E - K_TOP
    top = max(float(a) for a in amax.values())
    assert all(float(g[s]) == top for s in unreached)
