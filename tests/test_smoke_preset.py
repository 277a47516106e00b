"""``qpass grpo --preset smoke``: its exact defaults (fast tier) and a real end-to-end run (slow tier).

The slow run loads the default model (SmolLM2-135M GGUF), captures both graphs and trains 2 GRPO
steps with learner, rollout and weight sync; it checks the exit status and every output file, not the
wall time (measured in docs/results/suite_time.md, claims table).
"""

from __future__ import annotations

import json

import pytest
import torch

from qpass.apps.grpo.cli import GRPO_PRESETS, _apply_preset, build_grpo_parser

SMOKE = {"steps": 2, "task": "larger", "template": "larger_fewshot", "temperature": 0.5, "reward": "first",
         "prompts_per_step": 1, "group_size": 4, "max_new_tokens": 6, "n_train": 64, "n_eval": 8, "eval_every": 0,
         "diag_every": 0, "bitexact_every": 0, "no_initial_check": True, "no_shadow": True}


def test_smoke_preset_values_are_exactly_these():
    assert GRPO_PRESETS["smoke"].values == SMOKE


def test_smoke_preset_becomes_the_parsed_arguments():
    ap = build_grpo_parser()
    argv = ["--preset", "smoke", "--recipe", "quads_nvfp4", "--out", "x"]
    assert _apply_preset(ap, argv) == "smoke"
    args = vars(ap.parse_args(argv))
    assert {k: args[k] for k in SMOKE} == SMOKE
    assert (args["model"], args["dtype"], args["rollout_engine"]) == ("default", "bf16", "qpass")  # the real model, not a toy


@pytest.mark.slow
def test_default_model_loads_the_same_with_one_gguf_parse(monkeypatch):
    import contextlib

    import qpass.graph.gguf_once as once
    from qpass.graph.model import load_model

    shared = load_model()
    monkeypatch.setattr(once, "gguf_parsed_once", lambda: contextlib.nullcontext())
    plain = load_model()
    sa, sb = shared.model.state_dict(), plain.model.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    assert shared.model.config.to_dict() == plain.model.config.to_dict()
    assert shared.tokenizer.get_vocab() == plain.tokenizer.get_vocab()
    assert shared.tokenizer.backend_tokenizer.to_str() == plain.tokenizer.backend_tokenizer.to_str()


@pytest.mark.slow
def test_smoke_preset_runs_end_to_end(tmp_path, capsys):
    from qpass.apps.cli import main

    out = tmp_path / "smoke"
    status = main(["grpo", "--preset", "smoke", "--recipe", "quads_nvfp4", "--out", str(out), "--no-progress"])
    assert status == 0
    for name in ("config.json", "provenance.json", "kernel_tiles.json", "recipe.yaml", "metrics.jsonl", "summary.json",
                 "plots.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["resp/n_loss_tokens"] > 0 for r in rows)  # the update had tokens to train on
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_done"] == 2 and summary["parity_all_steps_ok"] is True
    assert (rows[-1]["parity/bitexact_ok"], rows[-1]["parity/bitexact_failures"]) == (True, [])  # the last step's check ran
    assert rows[-1]["parity/bitexact_groups"] > 0
