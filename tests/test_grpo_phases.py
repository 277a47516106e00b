"""The GRPO step's phases (qpass.apps.grpo.phases), each run alone on the tiny random Llama, and the
domain pieces they call (qpass.rl.rewards, qpass.rl.update): exact values where two paths must agree."""

from __future__ import annotations

import math

import pytest
import torch

from qpass.apps.grpo import phases
from qpass.apps.grpo.phases import SampleInput
from qpass.jsonio import dumps
from qpass.rl.experience import response_logprobs
from qpass.rl.loss import group_advantages
from qpass.rl.rewards import score_responses
from qpass.rl.seeds import derive_seed
from qpass.rl.task import safe_reward
from qpass.rl.update import LossStats, minibatch_sizes
from tests.test_grpo import tiny_cfg, tiny_trainer


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _quiet(**kw):
    return tiny_cfg(steps=1, eval_every=0, diag_every=0, initial_check=False, **kw)


def _input(tr, step=1):
    return SampleInput.of(tr, step, next(tr.batches))


# --------------------------------------------------------------------------- domain pieces (qpass.rl)


def test_derive_seed_is_the_old_trainer_seed():
    from qpass.apps.grpo.grpo import _seed

    assert _seed is derive_seed
    assert derive_seed() == 1469598103934665603 & 0x7FFFFFFFFFFFFFFF
    assert derive_seed(0, 1, 2) == derive_seed(0, 1, 2) != derive_seed(0, 2, 1)


def test_minibatch_sizes_spread_the_remainder_first():
    assert minibatch_sizes(4, 2) == [2, 2]
    assert minibatch_sizes(5, 2) == [3, 2]
    assert minibatch_sizes(7, 3) == [3, 2, 2]
    assert sum(minibatch_sizes(9, 4)) == 9


def test_score_responses_rewards_advantages_and_failures():
    rewards = {"a": 1.0, "b": 0.0, "c": 0.5}

    def reward(meta, text):  # noqa: ANN001, ARG001
        if text == "boom":
            raise RuntimeError("grader crashed")
        return rewards[text]

    safe = safe_reward(reward)
    metas = [{}] * 4
    out = score_responses(safe, lambda m, t: 1.0 if t == "a" else 0.0, metas, ["a", "b", "c", "boom"], group_size=2)
    assert out.rewards.tolist() == [1.0, 0.0, 0.5, 0.0] and out.rewards.dtype == torch.float64
    assert torch.equal(out.advantages, group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.0], dtype=torch.float64), group_size=2))
    assert out.correct == [True, False, False, False]
    row = out.row()
    assert row["reward/n_exceptions_step"] == 1 and row["reward/n_failures_step"] == 1
    assert row["adv/zero_groups"] == 0 and row["reward/correct_frac"] == 0.25 and row["reward/max"] == 1.0
    same = score_responses(safe, lambda m, t: 0.0, metas[:2], ["b", "b"], group_size=2)
    assert same.zero_groups == 1 and same.advantages.tolist() == [0.0, 0.0] and same.row()["reward/n_exceptions_step"] == 0


def test_loss_stats_aggregate_by_minibatch_and_token():
    agg = LossStats()
    base = dict.fromkeys(("n_dropped", "n_kl_dropped", "n_clip_pos", "n_clip_neg", "n_coupled_clip_pos",
                          "n_coupled_clip_neg", "clip_low_frac", "clip_high_frac"), 0.0)
    agg.start_minibatch()
    agg.add({**base, "n_tokens": 2.0, "n_pos": 2.0, "n_neg": 0.0, "n_clip_pos": 1.0, "clip_frac": 0.5, "ratio_min": 0.5,
             "ratio_max": 1.0, "loss": 1.0, "pg_loss": 1.0})
    agg.add({**base, "n_tokens": 6.0, "n_pos": 0.0, "n_neg": 6.0, "clip_frac": 0.0, "ratio_min": math.inf,
             "ratio_max": -math.inf, "loss": 2.0, "pg_loss": 1.5, "kl": 0.25})
    agg.end_minibatch()
    agg.opt.append({"skipped": False, "grad_norm": 3.0, "n_changed": 5, "changed_frac": 0.5})
    r = agg.result()
    assert (r["loss/loss"], r["loss/pg_loss"], r["loss/kl"]) == (3.0, 2.5, 0.25)
    assert r["loss/tokens_processed"] == 8.0 and r["loss/clip_frac"] == 1.0 / 8.0
    assert (r["loss/ratio_min"], r["loss/ratio_max"]) == (0.5, 1.0)  # the non-finite (no token) range is ignored
    assert r["loss/clip_pos_frac"] == 0.5 and r["loss/clip_neg_frac"] == 0.0
    assert (r["opt/steps"], r["opt/grad_norm"], r["opt/n_changed"], r["loss/micro_done"]) == (1.0, 3.0, 5, 2.0)


# --------------------------------------------------------------------------- phases alone (tiny Llama)


def test_sample_alone_is_a_function_of_its_input(tiny_pipeline):
    a = tiny_trainer(tiny_pipeline, "quads_nvfp4", _quiet(shadow=False))
    b = tiny_trainer(tiny_pipeline, "quads_nvfp4", _quiet(shadow=False))
    sa, sb = phases.sample(a, _input(a)), phases.sample(b, _input(b))
    assert sa.exp.n == 4 and len(sa.metas) == 4 and sa.metas[0] is sa.metas[1]  # 2 prompts x G = 2, group-major
    assert sa.routes is None and sa.row["rollout/n_tokens"] == int(sa.exp.sampled_mask.sum())
    for f in ("input_ids", "attention_mask", "response_mask", "sampled_mask", "logq", "finished"):
        assert torch.equal(getattr(sa.exp, f), getattr(sb.exp, f)), f
    other = phases.sample(b, SampleInput(2, _input(a).prompts, sa.metas[::2]))  # another step: other seeds
    assert not torch.equal(other.exp.logq, sa.exp.logq)


def test_score_alone_matches_direct_scoring(tiny_pipeline):
    tr = tiny_trainer(tiny_pipeline, "quads_nvfp4", _quiet(micro_batch_size=2))
    sc = phases.score(tr, phases.sample(tr, _input(tr)))
    assert [m.tolist() for m in sc.micro] == [[0, 1], [2, 3]]
    with torch.no_grad():
        direct = torch.cat([response_logprobs(tr.le, sc.exp.select(i))[0] for i in sc.micro])
    assert torch.equal(sc.lprox, direct)
    assert sc.lref is None and sc.lshadow is not None and sc.lshadow.shape == sc.lprox.shape
    assert torch.equal(sc.adv, sc.responses.advantages.float())
    assert sc.row["gap/n_tokens"] == sc.row["resp/n_loss_tokens"] == int(sc.exp.response_mask.sum())


def test_score_alone_applies_mask_truncated_without_touching_the_sample(tiny_pipeline):
    tr = tiny_trainer(tiny_pipeline, "quads_nvfp4", _quiet(shadow=False, mask_truncated=True))
    s = phases.sample(tr, _input(tr))
    before = s.exp.response_mask.clone()
    sc = phases.score(tr, s)
    assert torch.equal(s.exp.response_mask, before)
    assert torch.equal(sc.exp.response_mask, before & s.exp.finished.unsqueeze(-1))


def test_update_alone_first_minibatch_ratio_is_exactly_one_and_zero_adv_is_a_no_op(tiny_pipeline):
    tr = tiny_trainer(tiny_pipeline, "w4a16_qat", _quiet(shadow=False))
    sc = phases.score(tr, phases.sample(tr, _input(tr)))
    w0 = {k: v.detach().clone() for k, v in tr.le.named_parameters()}
    zero = phases.update(tr, phases.Scored(**{**sc.__dict__, "adv": torch.zeros_like(sc.adv)}), 1)
    assert zero.forwards == [] and zero.row["opt/steps"] == 0.0 and zero.row["loss/micro_skipped_zero_adv"] == 1.0
    assert all(torch.equal(v, w0[k]) for k, v in tr.le.named_parameters())
    up = phases.update(tr, sc, 1)
    assert up.row["check/first_minibatch_ratio_exact"] is True and up.row["check/first_minibatch_ratio_maxdev"] == 0.0
    assert up.row["opt/steps"] == 1.0 and len(up.forwards) == 1 and up.clip_row == {}
    assert torch.equal(up.forwards[0][1], sc.lprox)  # p_theta at the first forward is p_prox, bit for bit
    assert any(not torch.equal(v, w0[k]) for k, v in tr.le.named_parameters())


def test_sync_alone_verifies_and_sees_no_change_without_an_update(tiny_pipeline):
    tr = tiny_trainer(tiny_pipeline, "quads_nvfp4", _quiet(shadow=False))
    out = phases.sync(tr, 1, final=True)
    assert out.failures == [] and out.row["parity/fp_ok"] and out.row["parity/bitexact_ok"]
    assert out.row["vis/code_frac"] == 0.0 and out.row["parity/sync_requantized"] == 14
    phases.update(tr, phases.score(tr, phases.sample(tr, _input(tr))), 1)
    moved = phases.sync(tr, 2, final=False)
    assert moved.failures == [] and moved.row["vis/code_frac"] > 0.0 and "parity/bitexact_ok" in moved.row  # every 1


def test_step_equals_the_phases_wired_by_hand(tiny_pipeline):
    """The trainer's step and the four phases called one after the other give the same row, bit for bit."""
    cfg = _quiet()
    a = tiny_trainer(tiny_pipeline, "quads_nvfp4", cfg)
    row = a.step(final=True)
    b = tiny_trainer(tiny_pipeline, "quads_nvfp4", cfg)
    s = phases.sample(b, _input(b))
    sc = phases.score(b, s)
    up = phases.update(b, sc, 1)
    sy = phases.sync(b, 1, True)
    b.quant_reuse.clear()
    manual = {"step": 1, **s.row, **sc.row, **up.row, **up.clip_row, **sy.row}

    def strip(r):
        return dumps({k: v for k, v in sorted(r.items()) if not k.startswith("time/") and k not in
                      ("rollout/tokens_per_s", "rollout/n_tokens_cum")})

    assert strip(manual) == strip(row)
    assert all(torch.equal(p, q) for p, q in zip(a.le.parameters(), b.le.parameters()))
