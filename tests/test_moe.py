"""MoE: per-expert sites, w1/w3 shared amax, W4A4 + RAC per expert, routing record/replay, upcycling.

Tiny random Qwen3-MoE / OLMoE / Mixtral configs (hidden 32, 2 layers, 4 experts, top-2): the same
code path as any Hugging Face MoE directory and as ``--model moe-default``.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_llama

E, K_TOP, H, I_MOE = 4, 2, 32, 32


def tiny_moe(kind: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """2-layer MoE of class ``kind`` (hidden 32, expert MLP 32, 4 experts, top-2, vocab 128)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=128, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
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
