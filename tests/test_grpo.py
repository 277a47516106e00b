"""GRPO loop (issue 5): bookkeeping with fakes and a tiny random Llama, the CLI, and one end-to-end
run of two steps of ``quads_nvfp4`` on the real default model (slow tier).

Threads: every test here runs with ``torch.set_num_threads(1)``. On the shared 2-core machine the
default of 2 OpenMP threads is up to ~10x slower whenever another process is busy (measured:
4-token quads decode 10.8 s with 1 thread vs 108 s with 2 at load average 7).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from qpass.runtime import RolloutBatch
from qpass.diagnostics import update_visibility_groups
from qpass.errors import ParityError
from qpass.quant.nvfp4 import NVFP4Tensor, nvfp4_quantize
from qpass.rl.experience import Experience, assemble, micro_batches, response_logprobs
from qpass.runtime.prefill import step_prefill_args
from qpass.apps.grpo.grpo import GRPOConfig, GRPOTrainer, _seed
from qpass.apps.grpo.jsonl import append_jsonl, read_jsonl, write_json_atomic
from qpass.rl.loss import Correction, LossConfig
from qpass.rl.task import ArithmeticTask, difficulty_preset
from qpass.apps.grpo.weights import MasterOptimizer, RolloutConstants, byte_visibility, verify_sync
from qpass.sampling import sampling_logprobs


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --------------------------------------------------------------------------- fakes


class FakeTok:
    """Char-level chat tokenizer for the tiny model: digits are tokens 10-19, space 2, letters 20+."""

    pad_token_id = 0
    eos_token_id = 1

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):  # noqa: ANN001, ARG002
        text = messages[0]["content"]
        ids = [3]
        for c in text[:15]:
            ids.append(10 + int(c) if c.isdigit() else 2 if c == " " else 20 + ord(c) % 200)
        return ids

    def decode(self, ids, skip_special_tokens=True):  # noqa: ANN001, ARG002
        out = []
        for i in ids:
            i = int(i)
            if 10 <= i <= 19:
                out.append(str(i - 10))
            elif i == 2:
                out.append(" ")
            elif i >= 20:
                out.append(chr(ord("a") + (i - 20) % 26))
        return "".join(out)


def text_hash_reward(meta, text):  # noqa: ANN001, ARG001
    """A deterministic reward that differs between almost any two responses (non-zero advantages)."""
    return float(sum((i + 1) * ord(c) for i, c in enumerate(text)) % 10007) / 10007.0


TINY_TASK = ArithmeticTask(difficulty_preset(1, n_train=24, n_eval=4, seed=0))


def tiny_cfg(**kw) -> GRPOConfig:
    base = dict(steps=2, prompts_per_step=2, group_size=2, max_new_tokens=6, lr=1e-3, diag_every=2, eval_every=2,
                eval_prompts=4, bitexact_every=1, initial_check=True)
    base.update(kw)
    return GRPOConfig(**base)


def tiny_trainer(pipe, recipe: str, cfg: GRPOConfig, tmp: Path | None = None, **kw) -> GRPOTrainer:
    from qpass.recipe import load_recipe

    learner, rollout = pipe.build(load_recipe(recipe))
    paths = {} if tmp is None else {"metrics_path": tmp / "metrics.jsonl", "layerwise_path": tmp / "layerwise.jsonl",
                                    "eval_path": tmp / "eval.jsonl"}
    kw.setdefault("reward_fn", text_hash_reward)
    if cfg.shadow:
        kw.setdefault("shadow", bf16_shadow(pipe))
    return GRPOTrainer(learner, rollout, FakeTok(), TINY_TASK, cfg, recipe_name=recipe, **paths, **kw)


def bf16_shadow(pipe):
    """The BF16 shadow as qpass grpo builds it: the bf16 recipe's rollout graph."""
    from qpass.recipe import load_recipe

    return pipe.build_side(load_recipe("bf16"), "rollout")


# --------------------------------------------------------------------------- jsonl


def test_jsonl_nan_as_null_and_truncated_tail(tmp_path):
    p = tmp_path / "m.jsonl"
    append_jsonl(p, {"step": 1, "g": float("nan"), "x": [1.5, float("inf")], "ok": True, "t": torch.tensor(2.5)})
    append_jsonl(p, {"step": 2, "g": 0.25})
    # one NaN policy (qpass.jsonio): null, and a KEY_reason field saying what was there
    assert p.read_text().splitlines()[0] == ('{"step":1,"g":null,"x":[1.5,null],"ok":true,"t":2.5,'
                                             '"g_reason":"non-finite: nan","x_reason":"non-finite: inf at [1]"}')
    with open(p, "a") as f:
        f.write('{"step":3,"g"')  # a crash mid-write leaves a truncated last line
    assert read_jsonl(p) == [{"step": 1, "g": None, "x": [1.5, None], "ok": True, "t": 2.5, "g_reason": "non-finite: nan",
                              "x_reason": "non-finite: inf at [1]"}, {"step": 2, "g": 0.25}]
    p.write_text('{"a":1}\n{broken\n{"b":2}\n')
    with pytest.raises(ValueError, match=r"m.jsonl:2"):
        read_jsonl(p)
    write_json_atomic(tmp_path / "s.json", {"v": float("-inf")})
    assert json.loads((tmp_path / "s.json").read_text()) == {"v": None, "v_reason": "non-finite: -inf"}
    assert not [q for q in tmp_path.iterdir() if q.name.startswith(".")]


# --------------------------------------------------------------------------- experience


def test_assemble_repads_chunks_and_drops_filler_rows():
    # chunk A: batch 2, prompt width 3, 2 response tokens, both rows real; row 1 ends with EOS (=1) at t=0
    a = RolloutBatch(
        input_ids=torch.tensor([[0, 5, 6, 7, 8], [4, 5, 6, 1, 0]]),
        attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]),
        prompt_len=3, response_mask=torch.tensor([[True, True], [True, False]]),
        logq=torch.tensor([[-0.5, -1.0], [-0.25, 0.0]]), n_real=2)
    # chunk B: batch 2, prompt width 2, 3 response tokens, only row 0 is real (row 1 fills the static batch)
    b = RolloutBatch(
        input_ids=torch.tensor([[9, 9, 3, 3, 1], [9, 9, 7, 7, 7]]),
        attention_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]),
        prompt_len=2, response_mask=torch.tensor([[True, True, True], [True, True, True]]),
        logq=torch.tensor([[-1.0, -2.0, -3.0], [-9.0, -9.0, -9.0]]), n_real=1)
    e = assemble([a, b], pad_token_id=0, eos_token_ids=[1], max_new_tokens=4)
    assert e.prompt_len == 3 and e.response_width == 4 and e.n == 3
    assert e.input_ids.tolist() == [[0, 5, 6, 7, 8, 0, 0], [4, 5, 6, 1, 0, 0, 0], [0, 9, 9, 3, 3, 1, 0]]
    assert e.attention_mask.tolist() == [[0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1, 0]]
    assert e.response_mask.tolist() == [[True, True, False, False], [True, False, False, False], [True, True, True, False]]
    assert e.logq.tolist() == [[-0.5, -1.0, 0.0, 0.0], [-0.25, 0.0, 0.0, 0.0], [-1.0, -2.0, -3.0, 0.0]]
    assert e.finished.tolist() == [False, True, True]
    s = e.select([2, 0])
    assert s.input_ids[0].tolist() == e.input_ids[2].tolist() and s.finished.tolist() == [True, False]
    with pytest.raises(ValueError, match="max_new_tokens=2"):
        assemble([b], pad_token_id=0, eos_token_ids=[1], max_new_tokens=2)


class _FixedLogits(torch.nn.Module):
    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, input_ids, attention_mask):  # noqa: ANN001, ARG002
        return self.logits[: input_ids.shape[0], : input_ids.shape[1]]


def test_response_logprobs_equals_full_scoring_slice():
    g = torch.Generator().manual_seed(0)
    n, p, r, v = 3, 4, 3, 11
    logits = torch.randn(n, p + r, v, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, v, (n, p + r), generator=g)
    mask = torch.ones(n, r, dtype=torch.bool)
    exp = Experience(ids, torch.ones_like(ids), p, mask, mask, torch.zeros(n, r), torch.zeros(n, dtype=torch.bool))
    for top_p in (1.0, 0.7):
        lp, ent = response_logprobs(_FixedLogits(logits), exp, temperature=0.8, top_p=top_p, with_entropy=True)
        full = sampling_logprobs(logits[:, :-1], 0.8, top_p).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        assert torch.equal(lp, full[:, p - 1:])  # TorchLearner.token_logprobs(...)[:, P-1:], bit for bit
        dist = sampling_logprobs(logits[:, p - 1:p - 1 + r], 0.8, top_p)
        probs = dist.exp()
        manual = -(torch.where(probs > 0, probs * dist, torch.zeros_like(dist))).sum(-1)
        torch.testing.assert_close(ent, manual, rtol=0, atol=1e-6)
    # uniform logits: entropy is exactly log V
    uni = _FixedLogits(torch.zeros(n, p + r, v))
    _, ent = response_logprobs(uni, exp, with_entropy=True)
    torch.testing.assert_close(ent, torch.full((n, r), math.log(v)), rtol=0, atol=1e-6)


def test_micro_batches_and_step_prefill_args():
    assert [m.tolist() for m in micro_batches(5, 2)] == [[0, 1], [2, 3], [4]]
    assert micro_batches(0, 3) == []
    with pytest.raises(ValueError, match="size >= 1"):
        micro_batches(4, 0)
    ids = torch.tensor([[0, 7, 8, 9], [5, 6, 7, 8]])
    am = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])
    i, pos, cpos, ml = step_prefill_args(ids, am, batch_size=3, max_len=6)
    assert i.tolist() == [[0, 7, 8, 9], [5, 6, 7, 8], [5, 6, 7, 8]]  # row 2 repeats the last row
    assert pos.tolist() == [[0, 0, 1, 2], [0, 1, 2, 2], [0, 1, 2, 2]]
    assert cpos.tolist() == [0, 1, 2, 3]
    assert ml.tolist() == [[0, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0]]
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        step_prefill_args(ids, am, batch_size=3, max_len=3)
    with pytest.raises(ValueError, match="1..1"):
        step_prefill_args(ids, am, batch_size=1, max_len=6)


# --------------------------------------------------------------------------- optimizer, visibility


def test_master_weights_accumulate_updates_bf16_would_round_away():
    # Adam with a constant gradient moves every element by lr * g / (|g| + eps) ~= lr per step.
    # bf16 around 1.0: the next value below is 1 - 2^-8 = 0.99609375; the midpoint is 0.998046875.
    def run(master: str) -> tuple[list[float], list[float]]:
        p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        opt = MasterOptimizer([p], lr=1e-3, master_dtype=torch.float32 if master == "fp32" else None)
        vals, changed = [], []
        for _ in range(2):
            opt.zero_grad()
            p.grad = torch.ones_like(p)
            st = opt.step(grad_clip=None)
            vals.append(float(p[0]))
            changed.append(st["n_changed"])
        return vals, changed

    # FP32 masters: 0.999 rounds back to 1.0 (no visible change), 0.998 < midpoint -> 0.99609375
    assert run("fp32") == ([1.0, 0.99609375], [0.0, 4.0])
    # stepping bf16 directly: 1 - 0.001 rounds to 1.0 every time; the update is lost for good
    assert run("param") == ([1.0, 1.0], [0.0, 0.0])


def test_master_optimizer_clips_and_skips_nonfinite():
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float32))
    opt = MasterOptimizer([p], lr=0.1)
    p.grad = torch.tensor([3.0, 4.0])
    st = opt.step(grad_clip=1.0)
    assert st["grad_norm"] == 5.0 and st["skipped"] == 0.0  # norm reported before clipping
    before = p.detach().clone()
    opt.zero_grad()
    p.grad = torch.tensor([float("nan"), 1.0])
    st = opt.step(grad_clip=1.0)
    assert st["skipped"] == 1.0 and torch.equal(p.detach(), before)
    with pytest.raises(ValueError, match="lr must be"):
        MasterOptimizer([p], lr=0.0)


def _consts(tensors: dict[str, NVFP4Tensor]) -> RolloutConstants:
    return RolloutConstants({k: (q.codes.clone(), q.scales.clone(), q.s_dec.clone()) for k, q in tensors.items()}, {})


def test_byte_visibility_matches_update_visibility_canonical_counts():
    g = torch.Generator().manual_seed(1)
    w = {f"w{i}": torch.randn(32, 64, generator=g).to(torch.bfloat16) for i in range(3)}
    w2 = {k: (v.float() + 0.02 * torch.randn(v.shape, generator=g)).to(torch.bfloat16) for k, v in w.items()}
    w2["w2"] = w["w2"] * 2  # doubling every value: all scale bytes change, codes do not
    before = {k: nvfp4_quantize(v) for k, v in w.items()}
    after = {k: nvfp4_quantize(v) for k, v in w2.items()}
    vis = byte_visibility(_consts(before), _consts(after))
    ref = update_visibility_groups(before, after).total
    assert vis["code_frac"] == ref.code_frac and vis["scale_frac"] == ref.scale_frac
    assert vis["n_codes"] == 3 * 32 * 64 and vis["n_scales"] == 3 * 32 * 4
    assert 0 < vis["code_frac"] < 1 and vis["scale_frac"] > 0
    # canonical form: a -0 code (0x8) equals +0, and a zero-scale block equals any other zero block
    codes = torch.zeros(1, 8, dtype=torch.uint8)
    scales = torch.tensor([[0x38]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    b = RolloutConstants({"s": (codes.clone(), scales.clone(), one.clone())}, {})
    neg0 = codes.clone()
    neg0[0, 0] = 0x08
    a = RolloutConstants({"s": (neg0, scales.clone(), one.clone())}, {})
    assert byte_visibility(b, a)["code_frac"] == 0.0
    z0 = RolloutConstants({"s": (torch.full((1, 8), 0x21, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.uint8).view(torch.float8_e4m3fn), one.clone())}, {})
    z1 = RolloutConstants({"s": (torch.full((1, 8), 0x73, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.uint8).view(torch.float8_e4m3fn), one.clone())}, {})
    v = byte_visibility(z0, z1)
    assert (v["code_frac"], v["scale_frac"], v["global_frac"]) == (0.0, 0.0, 0.0)
    one_code = codes.clone()
    one_code[0, 3] = 0x20  # element 7 becomes code 2 (value 1.0): one element, no scale change
    assert byte_visibility(b, RolloutConstants({"s": (one_code, scales.clone(), one.clone())}, {}))["code_frac"] == 1 / 16


# --------------------------------------------------------------------------- config


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="group_size"):
        GRPOConfig(group_size=0)
    with pytest.raises(ValueError, match="top_p"):
        GRPOConfig(top_p=1.5)
    with pytest.raises(ValueError, match="shadow_weights"):
        GRPOConfig(shadow_weights="fp8")
    with pytest.raises(TypeError, match="LossConfig"):
        GRPOConfig(loss={"beta": 0.1})
    assert _seed(0, 1, 2) == _seed(0, 1, 2) and _seed(0, 1, 2) != _seed(0, 2, 1) and 0 <= _seed(5, 9) < 2**63


# --------------------------------------------------------------------------- tiny model loop


def test_tiny_quads_two_steps_bookkeeping(tiny_pipeline, tmp_path):
    tr = tiny_trainer(tiny_pipeline, "quads_nvfp4", tiny_cfg(), tmp_path)
    w0 = {k: v.detach().clone() for k, v in tr.le.named_parameters()}
    res = tr.run()
    assert res.stop_reason == "completed" and len(res.rows) == 2
    assert res.initial["parity/structural_ok"] and res.initial["parity/bitexact_ok"]
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    n_groups = len({rec.group for rec in tr.rollout_qg.quant.values()})
    for r in rows:
        # 2 prompts x G=2 rows; every row sampled exactly 6 tokens unless it hit EOS
        assert r["reward/n_failures_step"] == 0 and r["adv/zero_groups"] == 0
        assert r["gap/n_tokens"] == r["resp/n_loss_tokens"] > 0 and math.isfinite(r["gap/token/g_abs"])
        assert r["gap/max_abs"] >= r["gap/token/g_abs"] > 0
        assert r["check/first_minibatch_ratio_exact"] is True and r["loss/ratio_min"] == r["loss/ratio_max"] == 1.0
        assert r["opt/steps"] == 1 and r["opt/n_changed"] > 0
        assert r["parity/fp_ok"] and r["parity/fp_checked"] == r["parity/fp_aligned"] == n_groups == 8
        assert r["parity/bitexact_ok"] and r["parity/bitexact_groups"] == 8
        assert r["parity/sync_requantized"] == 14
        assert 0 <= r["clip/frac"] <= 1 and r["clip/n_tokens"] == r["gap/n_tokens"]
        assert r["vis/n_codes"] == sum(q.shape[0] * q.shape[1] * 2 for q, _, _ in tr.snapshot.nvfp4.values())
    assert rows[1]["layerwise/n_sites"] > 0 and "eval/accuracy" in rows[1] and "vis/value_frac" in rows[1]
    assert [r["step"] for r in read_jsonl(tmp_path / "eval.jsonl")] == [0, 2]
    assert [r["step"] for r in read_jsonl(tmp_path / "layerwise.jsonl")] == [0, 2]
    changed = sum(int((v != w0[k]).sum()) for k, v in tr.le.named_parameters())
    assert changed > 0


def test_tiny_all_equal_rewards_give_zero_update_and_counted_failures(tiny_pipeline):
    calls = {"n": 0}

    def bad_reward(meta, text):  # noqa: ANN001, ARG001
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("grader crashed")
        return float("nan") if calls["n"] % 3 == 1 else 0.0

    tr = tiny_trainer(tiny_pipeline, "quads_nvfp4", tiny_cfg(steps=1, eval_every=0, diag_every=0, initial_check=False),
                      reward_fn=bad_reward)
    w0 = {k: v.detach().clone() for k, v in tr.le.named_parameters()}
    row = tr.step(final=True)
    # 4 calls: #1 NaN, #2 0.0, #3 raises, #4 NaN -> all rewards 0 -> every advantage exactly 0
    assert (row["reward/n_nonfinite_step"], row["reward/n_exceptions_step"], row["reward/mean"]) == (2, 1, 0.0)
    assert row["adv/zero_groups"] == 2 and row["adv/abs_mean"] == 0.0
    assert row["loss/micro_skipped_zero_adv"] == 1 and row["opt/steps"] == 0
    assert all(torch.equal(v, w0[k]) for k, v in tr.le.named_parameters())
    assert row["vis/code_frac"] == 0.0 and row["parity/fp_ok"] and row["parity/bitexact_ok"]
    assert math.isfinite(row["gap/token/g_abs"])  # diagnostics still measured on the sampled tokens


def test_tiny_every_response_masked(tiny_pipeline):
    class NoEosTok(FakeTok):
        eos_token_id = 100_000  # never sampled: no response finishes

    from qpass.recipe import load_recipe

    learner, rollout = tiny_pipeline.build(load_recipe("naive_nvfp4"))
    cfg = tiny_cfg(steps=1, eval_every=0, diag_every=0, mask_truncated=True)
    tr = GRPOTrainer(learner, rollout, NoEosTok(), TINY_TASK, cfg, reward_fn=text_hash_reward, shadow=bf16_shadow(tiny_pipeline))
    row = tr.step(final=True)
    assert row["resp/finished_frac"] == 0.0 and row["resp/n_loss_tokens"] == 0 and row["resp/n_all_masked"] == 4
    assert row["gap/token/g_abs"] is None or math.isnan(row["gap/token/g_abs"])
    assert row["loss/minibatch_empty"] == 1 and row["opt/steps"] == 0
    assert row["gap/n_empty_responses"] == 4 and math.isnan(row["entropy/token_mean"])
    # naive_nvfp4: BF16 learner, so the sync is checked for freshness only (no bit-exact claim)
    assert row["parity/fp_ok"] and row["parity/fp_checked"] == 8 and row["parity/fp_aligned"] == 0
    assert "parity/bitexact_ok" not in row


def test_tiny_epochs_minibatches_kl_and_tis(tiny_pipeline):
    loss = LossConfig(eps_low=0.2, eps_high=0.28, correction=Correction("tis", cap=2.0), beta=0.05)
    cfg = tiny_cfg(steps=1, prompts_per_step=4, ppo_epochs=2, minibatches=2, micro_batch_size=2, loss=loss,
                   eval_every=0, diag_every=0, initial_check=False, shadow=False)
    tr = tiny_trainer(tiny_pipeline, "w4a16_qat", cfg)
    row = tr.step(final=True)
    # 8 rows in 4 fixed micro-batches of 2; 2 epochs x 2 minibatches = 4 optimizer steps
    assert row["opt/steps"] == 4 and row["loss/micro_done"] == 8
    assert row["check/first_minibatch_ratio_exact"] is True
    assert row["loss/kl"] >= 0 and math.isfinite(row["loss/kl"])
    assert row["loss/ratio_max"] > 1.0 or row["loss/ratio_min"] < 1.0  # later minibatches see moved weights
    assert "clip/frac" not in row and row["parity/bitexact_ok"]
    with pytest.raises(ValueError, match="minibatches=5"):
        tiny_trainer(tiny_pipeline, "bf16", tiny_cfg(minibatches=5, micro_batch_size=1, prompts_per_step=2, group_size=2))


def test_tiny_sync_corruption_is_caught(tiny_pipeline, tmp_path, monkeypatch):
    import qpass.runtime.graph_engine as bt  # the built-in rollout engine's update path

    real = bt.sync_weights
    site = {}

    def corrupting_sync(learner, rollout):  # noqa: ANN001
        rep = real(learner, rollout)
        sid, rec = next((s, r) for s, r in rollout.quant.items() if r.kind == "nvfp4_linear")
        buf = rollout.gm.get_buffer(rec.constants["codes"])
        buf[0, 0] ^= 0x11  # flip one element code in each nibble: the rollout no longer holds the learner's bytes
        site["group"] = rec.group
        return rep

    monkeypatch.setattr(bt, "sync_weights", corrupting_sync)
    cfg = tiny_cfg(steps=1, eval_every=0, diag_every=0, initial_check=False, shadow=False)
    tr = tiny_trainer(tiny_pipeline, "quads_nvfp4", cfg, tmp_path)
    with pytest.raises(ParityError, match=site.get("group", "self_attn")):
        tr.step(final=True)
    row = read_jsonl(tmp_path / "metrics.jsonl")[0]  # the row is written before the error is raised
    assert row["parity/fp_ok"] is False and row["parity/bitexact_ok"] is False
    assert site["group"] in row["parity/fp_mismatches"][0]
    ver = verify_sync(tr.learner_qg, tr.rollout_qg, {})
    assert not ver.ok and ver.n_checked == 8


def test_tiny_fp8_and_bf16_recipes_sync_checks(tiny_pipeline):
    cfg = tiny_cfg(steps=1, eval_every=0, diag_every=0)
    row = tiny_trainer(tiny_pipeline, "fp8_block", cfg).step(final=True)
    assert row["parity/fp_ok"] and row["parity/fp_checked"] == 14 and row["parity/fp_aligned"] == 0
    assert row["vis/n_fp8"] > 0 and math.isnan(row["vis/code_frac"])
    row = tiny_trainer(tiny_pipeline, "bf16", cfg).step(final=True)
    assert row["parity/fp_ok"] and row["parity/fp_checked"] == 0 and row["parity/sync_requantized"] == 0


def test_tiny_shadow_weights_modes(tiny_pipeline):
    from qpass.apps.grpo.probes import shadow_weights
    from qpass.graph.capture import site_of

    tr = tiny_trainer(tiny_pipeline, "w4a16_qat", tiny_cfg(steps=1, eval_every=0, diag_every=0, initial_check=False))
    lp = dict(tr.learner_qg.gm.named_parameters())
    sid, rec = next((s, r) for s, r in tr.learner_qg.quant.items() if r.weight_fake_quant)
    exported = tr.le.export_weights()
    master = shadow_weights(tr.learner_qg, exported, mode="master")
    assert master.keys() == exported.keys() and all(master[k] is exported[k] for k in exported)
    learner = shadow_weights(tr.learner_qg, exported, mode="learner")
    amax = torch.ops.qpass.group_amax([lp[tr.learner_qg.quant[m].weight] for m in rec.members])
    w_hat = torch.ops.qpass.nvfp4_qdq(lp[rec.weight].detach(), amax, sid)
    assert torch.equal(learner[site_of(rec.weight)], w_hat) and not torch.equal(w_hat, lp[rec.weight])
    with pytest.raises(ValueError, match="must be 'master' or 'learner'"):
        shadow_weights(tr.learner_qg, exported, mode="fp32")


def test_tiny_time_budget_stops_cleanly_with_final_checks(tiny_pipeline, tmp_path):
    cfg = tiny_cfg(steps=50, eval_every=0, diag_every=0, initial_check=False, shadow=False, bitexact_every=0,
                   max_time_s=1e-3)
    tr = tiny_trainer(tiny_pipeline, "quads_nvfp4", cfg, tmp_path)
    res = tr.run()
    # the first step always runs; the budget is then spent, so the loop stops with the final check done
    assert res.stop_reason == "time budget" and len(res.rows) == 1
    assert res.rows[0].get("parity/bitexact_ok") is True or res.final.get("parity/bitexact_ok") is True


# --------------------------------------------------------------------------- CLI


@pytest.fixture()
def tiny_cli(tiny_pipeline, monkeypatch):
    """Make ``--model tiny`` load the tiny Llama with FakeTok and reuse its captured graphs."""
    import qpass.graph.model as gm
    from qpass.graph.model import LoadedModel
    from qpass.pipeline import Pipeline

    loaded = LoadedModel(model=tiny_pipeline.loaded.model, tokenizer=FakeTok(), name="tiny-llama", source="random")
    pipe = dataclasses.replace(tiny_pipeline, loaded=loaded)
    monkeypatch.setattr(gm, "load_model", lambda *a, **k: loaded)
    monkeypatch.setattr(Pipeline, "prepare", classmethod(lambda cls, *a, **k: pipe))
    monkeypatch.setattr("qpass.apps.validate.check_model_ref", lambda *a, **k: None)  # 'tiny' is no path
    return ["--model", "tiny", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "6",
            "--n-train", "24", "--n-eval", "4", "--eval-prompts", "4", "--eval-every", "2", "--diag-every", "2",
            "--lr", "1e-3", "--reward", "tests.test_grpo:text_hash_reward", "--no-progress", "--no-plots"]


def _hidden(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


def test_cli_grpo_run_dir_and_overwrite(tiny_cli, tmp_path, capsys):
    from qpass.apps.grpo.cli import main

    out = tmp_path / "run"
    assert main(["grpo", "--recipe", "quads_nvfp4", "--steps", "2", "--out", str(out), *tiny_cli]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert files == ["config.json", "eval.jsonl", "kernel_tiles.json", "layerwise.jsonl", "metrics.jsonl", "provenance.json",
                     "recipe.yaml", "summary.json"]
    assert _hidden(tmp_path) == []  # the temporary build directory was renamed, nothing left behind
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["command"]["argv"][:3] == ["grpo", "--recipe", "quads_nvfp4"]
    assert prov["command"]["cmdline"].startswith("qpass grpo --recipe quads_nvfp4 --steps 2 --out ")
    assert prov["extra"] == {"kernels": "reference", "kernel_tiles": "pinned"} and prov["run"]["recipe"] == "quads_nvfp4"
    assert prov["device"]["type"] == "cpu" and prov["versions"]["torch"] == torch.__version__
    assert len(prov["code"]["source_sha256"]) == 64 and isinstance(prov["code"]["git_dirty"], bool)
    assert json.loads((out / "kernel_tiles.json").read_text())["mode"] == "pinned"
    rows0 = read_jsonl(out / "metrics.jsonl")
    assert rows0[1]["time/rollout_s_cum"] == rows0[0]["time/rollout_s"] + rows0[1]["time/rollout_s"]
    assert rows0[1]["time/learner_s"] == rows0[1]["time/prox_s"] + rows0[1]["time/update_s"]
    assert rows0[1]["rollout/n_tokens_cum"] == rows0[0]["rollout/n_tokens"] + rows0[1]["rollout/n_tokens"]
    assert (out.stat().st_mode & 0o777, (out / "summary.json").stat().st_mode & 0o777) == (0o755, 0o644)
    rows = read_jsonl(out / "metrics.jsonl")
    assert len(rows) == 2 and all(r["parity/fp_ok"] for r in rows) and rows[-1]["parity/bitexact_ok"] is True
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_done"] == 2 and summary["parity_all_steps_ok"] is True and summary["stop_reason"] == "completed"
    assert json.loads((out / "config.json").read_text())["grpo"]["loss"]["correction"]["kind"] == "none"
    assert main(["grpo", "--recipe", "quads_nvfp4", "--steps", "1", "--out", str(out), *tiny_cli]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["grpo", "--recipe", "quads_nvfp4", "--steps", "1", "--out", str(out), "--overwrite", *tiny_cli]) == 0
    assert len(read_jsonl(out / "metrics.jsonl")) == 1 and _hidden(tmp_path) == []


def test_cli_interrupt_leaves_no_run_dir(tiny_cli, tmp_path, monkeypatch):
    from qpass.apps.grpo import cli
    from qpass.apps.grpo.grpo import GRPOTrainer as T

    real_step = T.step
    calls = {"n": 0}

    def step(self, **kw):  # noqa: ANN001
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_step(self, **kw)

    monkeypatch.setattr(T, "step", step)
    out = tmp_path / "run"
    assert cli.main(["grpo", "--recipe", "quads_nvfp4", "--steps", "3", "--out", str(out), *tiny_cli]) == 130
    assert not out.exists() and _hidden(tmp_path) == []
    calls["n"] = 0
    assert cli.main(["grpo", "--recipe", "quads_nvfp4", "--steps", "3", "--out", str(out), "--keep-partial", *tiny_cli]) == 130
    assert not out.exists() and len(read_jsonl(tmp_path / "run.partial" / "metrics.jsonl")) == 1


def test_cli_several_recipes_and_plot(tiny_cli, tmp_path):
    from qpass.apps.grpo.cli import main

    out = tmp_path / "cmp"
    args = [a for a in tiny_cli if a != "--no-plots"]
    assert main(["grpo", "--recipe", "bf16,naive_nvfp4", "--steps", "1", "--out", str(out), *args]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["bf16", "naive_nvfp4", "overlay.png"]
    assert (out / "bf16" / "plots.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png = tmp_path / "o.png"
    assert main(["grpo-plot", str(out / "bf16"), str(out / "naive_nvfp4"), "--out", str(png), "--metric", "gap/token/g_abs",
                 "--metric", "reward/mean"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["grpo-plot", str(tmp_path), "--out", str(png)]) == 2  # not a run directory


def test_cli_argument_errors(tmp_path, capsys):
    from qpass.apps.grpo.cli import main

    assert main(["grpo", "--recipe", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "built-in recipes" in capsys.readouterr().err
    assert main(["grpo", "--recipe", "bf16", "--out", str(tmp_path / "x"), "--lr", "-1"]) == 2
    assert "--lr" in capsys.readouterr().err
    assert main(["grpo", "--recipe", "bf16", "--out", str(tmp_path / "x"), "--reward", "nomodule_xyz:f"]) == 2
    assert "--reward" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------- end to end (real model)


@pytest.mark.slow
def test_e2e_quads_two_grpo_steps_default_model(default_pipeline, tmp_path):
    """Two GRPO steps of quads_nvfp4 on SmolLM2-135M: the weights move, the rollout is re-synced after
    every step and its bytes equal the learner's quantization (three-way fingerprints after each step,
    the full canonical bit-exact check after the last), and the JSONL log has two complete rows.

    Budget (1 thread, 2 busy cores): ~45 s per step (rollout ~12, proximal scoring ~6, update ~13,
    sync ~5, fingerprint check ~5) plus ~16 s for the final full check; the BF16 shadow, eval and the
    layer-wise probe are covered on the tiny model.
    """
    from qpass.recipe import load_recipe

    pipe = default_pipeline  # batch 4, KV cache 64: a short template keeps prompt (~40) + 8 new tokens inside
    learner, rollout = pipe.build(load_recipe("quads_nvfp4"))
    cfg = GRPOConfig(steps=2, prompts_per_step=2, group_size=2, max_new_tokens=8, lr=1e-4, bitexact_every=0,
                     initial_check=False, eval_every=0, diag_every=0, shadow=False)
    task = ArithmeticTask(difficulty_preset(1, n_train=16, n_eval=0, seed=0))
    tr = GRPOTrainer(learner, rollout, pipe.tokenizer, task, cfg, reward_fn=text_hash_reward,
                     metrics_path=tmp_path / "metrics.jsonl", template="Compute {expression}.", recipe_name="quads_nvfp4")
    w0 = {k: v.detach().clone() for k, v in tr.le.named_parameters()}
    codes0 = {s: c.clone() for s, (c, _, _) in tr.snapshot.nvfp4.items()}
    res = tr.run()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(rows) == 2 == len(res.rows) and [r["step"] for r in rows] == [1, 2] and res.final == {}
    for r in rows:
        assert r["resp/n_loss_tokens"] > 0 and r["gap/n_tokens"] == r["resp/n_loss_tokens"]
        g = r["gap/token/g_abs"]
        assert g is not None and math.isfinite(g) and 0 < g <= r["gap/max_abs"]  # W4A4 rollout vs W4A16 learner
        assert math.isfinite(r["gap/token/k3"]) and r["gap/token/k3"] >= 0 and 0 < r["gap/token/ess_raw"] <= 1
        assert r["check/first_minibatch_ratio_exact"] is True  # p_theta == p_prox before the first optimizer step
        # a group whose two samples get one reward has advantage 0; at least one group must carry signal
        assert r["adv/zero_groups"] < cfg.prompts_per_step and r["opt/steps"] == 1 and r["opt/changed_frac"] > 0
        # re-synced (210 linears re-quantized from the new weights) and bit-identical to the learner
        assert r["parity/sync_requantized"] == 210 and r["parity/fp_ok"] is True
        assert r["parity/fp_checked"] == r["parity/fp_aligned"] == 120 and r["parity/fp_mismatches"] == []
    last = rows[-1]
    assert last["parity/bitexact_ok"] is True and last["parity/bitexact_groups"] == 120 and last["parity/bitexact_failures"] == []
    changed = sum(int((v != w0[k]).sum()) for k, v in tr.le.named_parameters())
    assert changed > 0
    moved = sum(int((tr.snapshot.nvfp4[s][0] != c).sum()) for s, c in codes0.items())
    assert moved > 0 and rows[0]["vis/code_frac"] + rows[1]["vis/code_frac"] > 0  # the rollout received the update
    # (was also test_main_job::test_learner_step_changes_codes_and_resync_passes: one Adam step on the
    # real model changes some but not all codes, and the re-synced rollout is bit-exact to the learner)
    assert moved < sum(c.numel() for c in codes0.values())
