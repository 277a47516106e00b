"""Structural and bit-level parity checks, weight sync, and the torch eager backends (tiny Llama)."""

from __future__ import annotations

import torch

from qpass.runtime import TorchLearner, TorchRollout, sync_weights
from qpass.parity.checker import check_structural, check_weights_bitexact, site_dataflow
from qpass.quant.emulation import emulate
from qpass.quant.groups import group_amax
from qpass.recipe import load_recipe, parse_recipe

SITE = "model.layers.1.mlp.down_proj"


def test_quads_parity_passes_and_topology_matches(tiny_pipeline):
    learner, rollout = tiny_pipeline.build(load_recipe("quads_nvfp4"))
    s = check_structural(learner, rollout)
    assert s.ok and s.matched == 14 and s.topology_ok, s.problems
    g = site_dataflow(learner)
    assert ("model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.o_proj") in g.edges  # through attention
    assert ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj") in g.edges  # through the residual
    b = check_weights_bitexact(learner, rollout)
    assert b.ok and len(b.groups) == 2 * 4 and b.mismatched_groups == []


def test_structural_names_group_and_missing_qdq_problems(tiny_pipeline):
    learner, _ = tiny_pipeline.build(load_recipe("quads_nvfp4"))
    only_q = parse_recipe('name: x\nrollout:\n  - pass: w4a4_lower\n    targets: ["*.q_proj", "*.mlp.*"]\n')
    _, rollout = tiny_pipeline.build(only_q)
    s = check_structural(learner, rollout)
    assert not s.ok
    assert any("model.layers.0.self_attn.q_proj: fused group differs" in p for p in s.problems)
    assert any("model.layers.0.self_attn.k_proj: learner fake-quantizes" in p for p in s.problems)
    naive_learner, naive_rollout = tiny_pipeline.build(load_recipe("naive_nvfp4"))
    s = check_structural(naive_learner, naive_rollout)
    assert not s.ok and any("no nvfp4_qdq_linear on this site" in p for p in s.problems)


def test_planted_scale_bit_flip_is_found_and_named(tiny_pipeline):
    learner, rollout = tiny_pipeline.build(load_recipe("quads_nvfp4"))
    buf = rollout.gm.get_buffer(rollout.quant[SITE].constants["scales"]).view(torch.uint8)
    buf[3, 1] ^= 0x01
    b = check_weights_bitexact(learner, rollout)
    assert not b.ok and b.mismatched_groups == [SITE]
    assert b.failures() == [f"{SITE}: 1/{buf.numel()} scale bytes differ (first at (3, 1)) [looks like no known convention]"]
    buf[3, 1] ^= 0x01
    assert check_weights_bitexact(learner, rollout).ok


def test_foreign_arithmetic_is_named(tiny_pipeline):
    """Rollout bytes produced by torchao's arithmetic on a tie-rich weight: the checker says so."""
    learner, rollout = tiny_pipeline.build(load_recipe("w4a16_qat"))
    w = learner.attr(learner.quant[SITE].weight)
    g = torch.Generator().manual_seed(0)
    tie_rich = (torch.randint(-52, 53, w.shape, generator=g).float() * 2.0**-6).to(torch.bfloat16)
    tie_rich[0, 0] = 0.8125  # amax with a short mantissa: many E4M3/E2M1 midpoints
    with torch.no_grad():
        w.copy_(tie_rich)
    sync_weights(learner, rollout)
    assert check_weights_bitexact(learner, rollout).ok
    foreign = emulate("torchao", tie_rich, group_amax([tie_rich]))
    c = rollout.quant[SITE].constants
    for key, val in (("codes", foreign.codes), ("scales", foreign.scales), ("s_dec", foreign.s_dec)):
        rollout.gm.get_buffer(c[key]).copy_(val.reshape(rollout.gm.get_buffer(c[key]).shape))
    b = check_weights_bitexact(learner, rollout)
    assert not b.ok and b.mismatched_groups == [SITE]
    (grp,) = [g_ for g_ in b.groups if not g_.ok]
    assert grp.divergence is not None and "torchao" in grp.divergence.split(", ")


def test_optimizer_step_changes_codes_and_resync_restores_parity(tiny_pipeline):
    learner, rollout = tiny_pipeline.build(load_recipe("quads_nvfp4"))
    codes = rollout.gm.get_buffer(rollout.quant[SITE].constants["codes"])
    before = codes.clone()
    le = TorchLearner(learner)
    ids = torch.randint(3, 256, (4, 10), generator=torch.Generator().manual_seed(2))
    am = torch.ones_like(ids)
    le.token_logprobs(ids, am).sum().backward()
    with torch.no_grad():
        for p in le.parameters():
            if p.grad is not None:
                p.add_(torch.sign(p.grad), alpha=-0.01)
    assert not check_weights_bitexact(learner, rollout).ok  # stale rollout is caught
    rep = sync_weights(learner, rollout)
    assert rep.requantized == 14 and rep.copied > 0
    assert not torch.equal(codes, before)  # the step is visible in the rollout's codes
    assert check_weights_bitexact(learner, rollout).ok


def test_bf16_rollout_and_learner_agree_within_engine_drift(tiny_pipeline):
    learner, rollout = tiny_pipeline.build(load_recipe("bf16"))
    ro = TorchRollout(rollout, pad_token_id=0, eos_token_id=1)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16], [17, 18]]
    b = ro.generate(prompts, max_new_tokens=8, seed=3)
    assert b.input_ids.shape == (4, 5 + 8) and b.response_mask.dtype == torch.bool
    lp = TorchLearner(learner).token_logprobs(b.input_ids, b.attention_mask)[:, b.prompt_len - 1:]
    d = (lp - b.logq)[b.response_mask]
    assert d.numel() > 0 and float(d.abs().max()) < 0.1  # same weights: only decode-vs-prefill drift
    again = ro.generate(prompts, max_new_tokens=8, seed=3)
    assert torch.equal(again.input_ids, b.input_ids) and torch.equal(again.logq, b.logq)
