"""``qpass grpo --learner megatron --tp 2`` on the tiny random Llama (the CI-sized version of the
issue-12 run): loss, backward and optimizer step in Megatron-core (rank 0 here, rank 1 a worker
process), weights synced into the qpass rollout graph, bit-level parity every step; a rank that
dies fails the run naming it and leaves no run directory; bad combinations fail before any work."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from qpass.backends.megatron import megatron_available

from tests.test_grpo import FakeTok, tiny_cli  # noqa: F401 - tiny_cli is a fixture

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not megatron_available(), reason="megatron-core not installed")]


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cli_grpo_megatron_tp2_runs_with_parity_every_step(tiny_cli, tmp_path):  # noqa: F811
    from qpass.apps.grpo.cli import main

    out = tmp_path / "run"
    assert main(["grpo", "--recipe", "quads_nvfp4", "--learner", "megatron", "--tp", "2", "--steps", "2",
                 "--out", str(out), *tiny_cli]) == 0
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["parity/served_ok"] and r["parity/served_checked"] == 14
        assert r["parity/learner_bytes_ok"] and r["parity/learner_bytes_checked"] == 14
        assert r["parity/fp_ok"] and r.get("parity/bitexact_ok", True)
    assert rows[-1]["parity/bitexact_ok"]  # the graph-level check of the mirrored learner graph, last step
    assert sum(r["opt/steps"] for r in rows) >= 1 and any(r["opt/n_changed"] > 0 for r in rows)
    assert any(r["vis/code_frac"] > 0 for r in rows)  # the trained weights reached the rollout bytes
    assert rows[0]["check/first_minibatch_ratio_exact"] in (True, None)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parity_all_steps_ok"] and summary["steps_done"] == 2
    assert summary["initial"]["parity/served_ok"] and summary["initial"]["parity/learner_bytes_ok"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["learner_engine"] == {"name": "megatron", "tp": 2, "timeout_s": 300.0, "fake_quant_modules": 8}


def test_cli_grpo_megatron_rank_death_fails_naming_it_without_run_dir(tiny_cli, tmp_path, monkeypatch, capsys):  # noqa: F811
    from qpass.apps.grpo import grpo as grpo_mod
    from qpass.apps.grpo.cli import main

    real_step = grpo_mod.GRPOTrainer.step

    def step(self, **kw):
        if self.step_idx == 1:  # before step 2: rank 1 is killed
            os.kill(self.le._rt.worker_pids[0], signal.SIGKILL)  # noqa: SLF001
        return real_step(self, **kw)

    monkeypatch.setattr(grpo_mod.GRPOTrainer, "step", step)
    out = tmp_path / "run"
    assert main(["grpo", "--recipe", "quads_nvfp4", "--learner", "megatron", "--tp", "2", "--steps", "3",
                 "--out", str(out), *tiny_cli]) == 1
    err = capsys.readouterr().err
    assert "MegatronRankError" in err and "rank 1 (exit code -9)" in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("extra, words", [
    (["--tp", "4"], "TP=4 does not divide num_key_value_heads=2"),
    (["--learner", "qpass", "--tp", "2"], "--tp needs --learner megatron"),
    (["--beta", "0.1"], "--beta > 0 needs a reference policy"),
])
def test_cli_grpo_megatron_refuses_before_any_work(tiny_cli, tmp_path, capsys, extra, words):  # noqa: F811
    from qpass.apps.grpo.cli import main

    out = tmp_path / "run"
    args = ["grpo", "--recipe", "quads_nvfp4", "--learner", "megatron", "--steps", "1", "--out", str(out), *tiny_cli, *extra]
    assert main(args) == 2
    assert words in capsys.readouterr().err
    assert not out.exists()


def test_trainer_with_a_tp1_megatron_learner_one_step(tiny_pipeline):
    """TP=1 (what the H200 script runs): in-process learner, the optimizer is MasterOptimizer itself."""
    from qpass.apps.grpo.weights import MasterOptimizer
    from qpass.backends.megatron.learner import MegatronLearner

    from tests.test_grpo import text_hash_reward, tiny_cfg, tiny_trainer

    from qpass.recipe import load_recipe

    learner, _ = tiny_pipeline.build(load_recipe("quads_nvfp4"))
    before = {n: p.detach().clone() for n, p in tiny_pipeline.loaded.model.named_parameters()}  # the HF weights
    with MegatronLearner(tiny_pipeline.loaded.model, tp=1, learner_sites=learner.quant) as le:
        tr = tiny_trainer(tiny_pipeline, "quads_nvfp4", tiny_cfg(steps=1, eval_every=0, diag_every=0), learner_engine=le,
                          reward_fn=text_hash_reward)
        assert isinstance(tr.opt, MasterOptimizer) and tr.le is le
        row = tr.step(final=True)
        after = le.export_weights()
    assert row["parity/served_ok"] and row["parity/learner_bytes_ok"] and row["parity/learner_bytes_checked"] == 14
    assert row["parity/fp_ok"] and row["parity/bitexact_ok"] and row["opt/steps"] >= 1
    assert any(not torch.equal(after[n], before[n]) for n in before)  # Megatron's step moved the weights
    lp = dict(tr.learner_qg.gm.named_parameters())
    assert all(torch.equal(lp[f"model.{n}"], after[n]) for n in before)  # qpass's learner graph mirrors them
