"""The learner as a Megatron-core GPTModel (issue 12) on a tiny random Llama.

Unit tier without processes: the HF config mapping and its refusals, HF <-> Megatron weights (bit-exact
round trip, the per-query-group q/k/v interleave, vocab padding), the recipe -> module plan.
In-process TP=1: logits vs HF in fp32 (left padding), the fake-quantized weights and NVFP4 bytes vs
qpass's learner QDQ of the HF sites (bit for bit), the LearnerEngine protocol and its registration.
TP=2 (one worker process, gloo): logits vs TP=1 vs HF, fake-quant bytes gathered over TP vs TP=1,
gradients and the weights after one optimizer step, and a rank that dies.
"""

from __future__ import annotations

import os
import signal
import types

import pytest
import torch

from qpass.backends.megatron import megatron_available
from qpass.backends.megatron.config import MegatronConfigError, layout_from_hf
from qpass.backends.megatron.convert import hf_to_mcore, mcore_to_hf
from qpass.backends.megatron.plan import fake_quant_plan

from tests.conftest import tiny_llama

needs_megatron = pytest.mark.skipif(not megatron_available(), reason="megatron-core not installed (pip install megatron-core==0.16.1)")


def _cfg(**kw):
    from transformers import LlamaConfig

    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, vocab_size=200, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=True)
    base.update(kw)
    cfg = LlamaConfig(**base)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 50000.0}
    return cfg


def _random_state(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in LlamaForCausalLM(cfg).state_dict().items()}


# ----------------------------------------------------------------------------- config mapping (plain Python)


def test_layout_maps_the_llama_fields_and_pads_the_vocab():
    lay = layout_from_hf(_cfg(), tp=2)
    assert (lay.num_layers, lay.hidden, lay.ffn, lay.heads, lay.kv_heads, lay.head_dim) == (2, 64, 128, 4, 2, 16)
    assert (lay.vocab, lay.padded_vocab, lay.eps, lay.rope_base, lay.max_positions, lay.tied) == (200, 256, 1e-5, 50000.0, 128, True)
    assert layout_from_hf(_cfg(vocab_size=300), tp=1).padded_vocab == 384  # next multiple of 128 * TP
    assert layout_from_hf(_cfg(vocab_size=300), tp=2).padded_vocab == 512


@pytest.mark.parametrize("kw, tp, words", [
    ({"attention_bias": True}, 1, "attention_bias"),
    ({"mlp_bias": True}, 1, "mlp_bias"),
    ({"hidden_act": "gelu"}, 1, "SwiGLU"),
    ({}, 4, "TP=4 does not divide num_key_value_heads=2"),
    ({"num_key_value_heads": 4}, 3, "TP=3 does not divide num_key_value_heads=4"),
])
def test_configs_megatron_cannot_express_are_refused(kw, tp, words):
    with pytest.raises(MegatronConfigError, match=words):
        layout_from_hf(_cfg(**kw), tp=tp)


def test_rope_scaling_is_refused():
    cfg = _cfg()
    cfg.rope_parameters = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    with pytest.raises(MegatronConfigError, match="rope_type 'llama3'"):
        layout_from_hf(cfg)


# ----------------------------------------------------------------------------- weights HF <-> Megatron (plain torch)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("tied", [True, False])
def test_weights_round_trip_bit_exact(tp, tied):
    cfg = _cfg(tie_word_embeddings=tied)
    hf = _random_state(cfg)
    lay = layout_from_hf(cfg, tp=tp)
    shards = [hf_to_mcore(hf, lay, rank=r) for r in range(tp)]
    back = mcore_to_hf(shards, lay)
    assert set(back) == set(hf) | {"lm_head.weight"}
    for k, v in hf.items():
        assert torch.equal(back[k], v), k
    emb = torch.cat([s["embedding.word_embeddings.weight"] for s in shards])
    assert emb.shape == (256, 64) and torch.equal(emb[200:], torch.zeros(56, 64))  # padded vocab rows are zero
    assert ("output_layer.weight" in shards[0]) == (not tied)


def test_qkv_interleave_and_fc1_shards_by_hand():
    cfg = _cfg()
    hf = _random_state(cfg)
    lay = layout_from_hf(cfg, tp=2)
    q, k, v = (hf[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    s0, s1 = (hf_to_mcore(hf, lay, rank=r) for r in range(2))
    qkv0, qkv1 = s0["decoder.layers.1.self_attention.linear_qkv.weight"], s1["decoder.layers.1.self_attention.linear_qkv.weight"]
    # 2 query groups of 2 q heads (16 rows each) + 1 k head + 1 v head: rank r holds group r
    assert torch.equal(qkv0, torch.cat([q[0:32], k[0:16], v[0:16]]))
    assert torch.equal(qkv1, torch.cat([q[32:64], k[16:32], v[16:32]]))
    assert torch.equal(s1["decoder.layers.1.mlp.linear_fc1.weight"], torch.cat([gate[64:], up[64:]]))
    assert torch.equal(s1["decoder.layers.1.mlp.linear_fc2.weight"], hf["model.layers.1.mlp.down_proj.weight"][:, 64:])
    assert torch.equal(s0["decoder.layers.1.self_attention.linear_proj.weight"], hf["model.layers.1.self_attn.o_proj.weight"][:, :32])


# ----------------------------------------------------------------------------- recipe -> plan


def _rec(group, members, fq=True, act=None):
    return types.SimpleNamespace(weight_fake_quant=fq, group=group, members=tuple(members), act_spec=act)


def test_plan_maps_qpass_groups_and_refuses_what_megatron_fuses_differently():
    lay = layout_from_hf(_cfg(num_hidden_layers=1))
    qkv = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    recs = {s: _rec("model.layers.0.self_attn.qkv", qkv) for s in qkv}
    recs["model.layers.0.mlp.down_proj"] = _rec("model.layers.0.mlp.down_proj", ["model.layers.0.mlp.down_proj"])
    assert fake_quant_plan(recs, lay) == {"decoder.layers.0.self_attention.linear_qkv": tuple(qkv),
                                          "decoder.layers.0.mlp.linear_fc2": ("model.layers.0.mlp.down_proj",)}
    assert fake_quant_plan({}, lay) == {}
    partial = {qkv[0]: _rec(qkv[0], [qkv[0]])}
    with pytest.raises(Exception, match="fuses .*q_proj.*only model.layers.0.self_attn.q_proj"):
        fake_quant_plan(partial, lay)
    split = {s: _rec(s, [s]) for s in qkv}  # three separate amaxes: Megatron's linear_qkv has one
    with pytest.raises(Exception, match="under one amax"):
        fake_quant_plan(split, lay)
    with pytest.raises(Exception, match="weight_qdq only"):
        fake_quant_plan({**recs, qkv[0]: _rec("g", qkv, act=object())}, lay)


# ----------------------------------------------------------------------------- TP=1 in-process


def _batch(vocab: int = 256):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, vocab, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, :1] = 0
    return ids, mask


def _hf_logits(model, ids, mask):
    from qpass.sampling import positions_from_mask

    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits.float()


@pytest.fixture(scope="module")
def tiny_quads(tiny_pipeline):
    from qpass.recipe import load_recipe

    return tiny_pipeline.build(load_recipe("quads_nvfp4"))


@needs_megatron
def test_tp1_logits_match_hf_fp32_with_left_padding():
    from qpass.backends.megatron.learner import MegatronLearner
    from qpass.errors import QpassError

    hf = tiny_llama(dtype=torch.float32)
    ids, mask = _batch()
    with MegatronLearner(hf, tp=1) as le:
        with torch.no_grad():
            out = le(ids, mask).float()
        with pytest.raises(QpassError, match="padding between real tokens"):
            bad = mask.clone()
            bad[0, 5] = 0
            le(ids, bad)
    ref = _hf_logits(hf, ids, mask)
    real = mask.bool()
    assert out.shape == (3, 12, 256)
    assert float((out - ref).abs()[real].max()) <= 1e-5


@needs_megatron
def test_tp1_fake_quant_is_bit_identical_to_qpass_learner_qdq(tiny_quads):
    from qpass.apps.plugins import load_backends
    from qpass.backends.megatron.learner import MegatronLearner
    from qpass.formats.spec import NVFP4_WEIGHT
    from qpass.quant import qdq  # noqa: F401 - registers qpass::nvfp4_qdq
    from qpass.quant.weights import quantize_site_weights
    from qpass.runtime.engine import LearnerEngine, make_learner_engine

    learner, _ = tiny_quads
    load_backends(["megatron"])
    hf = tiny_llama()
    le = make_learner_engine("megatron", hf_model=hf, tp=1, learner_sites=learner.quant)
    try:
        assert isinstance(le, MegatronLearner) and isinstance(le, LearnerEngine) and le.name == "megatron"
        values, sites = le.fake_quant_values(), le.fake_quant_sites()
        exported = le.export_weights()
        lp = {n[len("model."):]: p for n, p in learner.gm.named_parameters()}  # graph paths -> HF names
        assert len(learner.quant) == 14 and set(values) == set(sites) == set(learner.quant)
        for sid, rec in learner.quant.items():
            ws = [lp[f"{m}.weight"] for m in rec.members]
            ref = torch.ops.qpass.nvfp4_qdq(lp[f"{sid}.weight"], torch.ops.qpass.group_amax(ws), sid)
            assert torch.equal(values[sid], ref), sid
            q = quantize_site_weights(NVFP4_WEIGHT, {m: lp[f"{m}.weight"] for m in rec.members})[sid].tensor
            assert torch.equal(sites[sid].codes, q.codes), sid
            assert torch.equal(sites[sid].scales.view(torch.uint8), q.scales.view(torch.uint8)), sid
            assert torch.equal(sites[sid].s_dec.view(torch.int32), q.s_dec.view(torch.int32)), sid
        for name, t in hf.state_dict().items():
            assert torch.equal(exported[name], t), name

        # LearnerEngine: log-probs with grad, an optimizer on FP32 masters, the update exported
        from qpass.apps.grpo.weights import MasterOptimizer

        ids, mask = _batch()
        opt = le.make_optimizer(MasterOptimizer, lr=1e-3)
        lp_tok = le.token_logprobs(ids, mask)
        logits = le(ids, mask).float()
        manual = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        assert lp_tok.shape == (3, 11) and lp_tok.dtype == torch.float32 and torch.equal(lp_tok, manual)
        (lp_tok * mask[:, 1:]).sum().backward()
        stats = opt.step(1.0)
        assert stats["skipped"] == 0.0 and stats["n_changed"] > 0 and stats["grad_norm"] > 0
        after = le.export_weights()
        assert not hf.config.tie_word_embeddings  # every exported name is its own parameter
        changed = sum(int((after[k] != exported[k]).sum()) for k in exported)
        assert changed == stats["n_changed"]
    finally:
        le.close()


# ----------------------------------------------------------------------------- TP=2 (one worker process)


def _tp_run(tp: int, hf, learner_sites, ids, mask, kill_after: bool = False) -> dict:
    from qpass.apps.grpo.weights import MasterOptimizer
    from qpass.backends.megatron.learner import MegatronLearner

    le = MegatronLearner(hf, tp=tp, learner_sites=learner_sites, timeout_s=60)
    try:
        res = {"values": le.fake_quant_values(), "sites": le.fake_quant_sites(), "export0": le.export_weights()}
        opt = le.make_optimizer(MasterOptimizer, lr=1e-3)
        lp = le.token_logprobs(ids, mask)
        (lp * mask[:, 1:]).sum().backward()
        res["logits"] = le(ids, mask).detach().float()
        res["grads"] = le.export_grads()
        res["stats"] = opt.step(1.0)
        res["export1"] = le.export_weights()
        if kill_after:
            rt = le._rt  # noqa: SLF001
            res["workdir"] = rt.workdir
            os.kill(rt.worker_pids[0], signal.SIGKILL)
            try:
                le.export_weights()
                res["death"] = None
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                res["death"] = exc
            res["workdir_left"] = os.path.exists(rt.workdir)
            res["alive_after"] = rt.alive_workers()
        return res
    finally:
        le.close()


@pytest.fixture(scope="module")
def tp_runs(tiny_quads):
    learner, _ = tiny_quads
    hf = tiny_llama(dtype=torch.float32)
    ids, mask = _batch()
    return {1: _tp_run(1, hf, learner.quant, ids, mask), 2: _tp_run(2, hf, learner.quant, ids, mask, kill_after=True),
            "hf": hf, "batch": (ids, mask)}


@pytest.mark.distributed
@needs_megatron
def test_tp2_logits_match_tp1_and_hf(tp_runs):
    import copy

    ids, mask = tp_runs["batch"]
    real = mask.bool()
    # HF with the fake-quantized weights W_hat computes what both Megatron runs compute
    hf = copy.deepcopy(tp_runs["hf"])
    sd = hf.state_dict()
    for sid, w in tp_runs[1]["values"].items():
        sd[f"{sid}.weight"] = w
    hf.load_state_dict(sd)
    ref = _hf_logits(hf, ids, mask)
    l1, l2 = tp_runs[1]["logits"], tp_runs[2]["logits"]
    assert float((l2 - l1).abs()[real].max()) <= 1e-5
    assert float((l1 - ref).abs()[real].max()) <= 1e-5
    assert float((l2 - ref).abs()[real].max()) <= 1e-5


@pytest.mark.distributed
@needs_megatron
def test_tp2_fake_quant_bytes_gathered_equal_tp1(tp_runs):
    s1, s2 = tp_runs[1]["sites"], tp_runs[2]["sites"]
    assert set(s1) == set(s2) and len(s1) == 14
    for sid in s1:
        assert torch.equal(s1[sid].codes, s2[sid].codes), sid
        assert torch.equal(s1[sid].scales.view(torch.uint8), s2[sid].scales.view(torch.uint8)), sid
        assert torch.equal(s1[sid].s_dec.view(torch.int32), s2[sid].s_dec.view(torch.int32)), sid
        assert torch.equal(tp_runs[1]["values"][sid], tp_runs[2]["values"][sid]), sid
    for k, v in tp_runs["hf"].state_dict().items():
        assert torch.equal(tp_runs[2]["export0"][k], v), k


@pytest.mark.distributed
@needs_megatron
def test_tp2_gradients_and_one_step_match_tp1(tp_runs):
    g1, g2 = tp_runs[1]["grads"], tp_runs[2]["grads"]
    assert set(g1) == set(g2)
    for k in g1:
        scale = float(g1[k].abs().max()) + 1e-12
        assert float((g1[k] - g2[k]).abs().max()) <= 1e-5 * scale, k
    n1, n2 = tp_runs[1]["stats"]["grad_norm"], tp_runs[2]["stats"]["grad_norm"]
    assert abs(n1 - n2) <= 1e-5 * n1  # the TP-reduced norm is the global one
    # AdamW's first step moves an element by lr * g / (|g| + eps): where |g| ~ eps (1e-8) the fp32
    # summation order of the two runs shows; elsewhere the step is ~lr * sign(g) on both
    e1, e2 = tp_runs[1]["export1"], tp_runs[2]["export1"]
    for k in e1:
        assert float((e1[k] - e2[k]).abs().max()) <= 1e-2 * 1e-3, k
    moved = sum(int((e1[k] != tp_runs[1]["export0"][k]).sum()) for k in e1)
    assert moved > 0


@pytest.mark.distributed
@needs_megatron
def test_a_rank_that_dies_fails_the_call_naming_it(tp_runs):
    from qpass.backends.megatron.dist import MegatronRankError

    r = tp_runs[2]
    assert isinstance(r["death"], MegatronRankError), r["death"]
    assert "rank 1 (exit code -9)" in str(r["death"])
    assert not r["workdir_left"] and r["alive_after"] == 0
