"""The main job on the real default model (SmolLM2-135M-Instruct): apply, artifacts, one full check.

A training step + re-sync on the real model is asserted by ``test_grpo.py::test_e2e_quads_two_grpo_steps_default_model``;
the artifact corruption cases run on the tiny model (``test_apply_check.py``).

Slow tier: the model is loaded and captured once per pytest run (``default_pipeline``) and the apply
output is the session's one ``quads_apply_dir`` (read-only: tests that corrupt artifacts work on a copy
from ``copy_apply_output``). Tests that need no model are in the unit tier (no ``slow`` marker).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qpass.apps.apply import ApplyOptions, run_apply, run_check
from qpass.apps.cli import main as cli_main
from qpass.errors import CaptureError

from ._tamper import flip_rollout_scale_bit
from .conftest import copy_apply_output

SITE = "model.layers.7.mlp.up_proj"


@pytest.mark.slow
def test_apply_quads_report(quads_apply_dir):
    status, report, out = quads_apply_dir
    assert status == 0 and report["ok"]
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["recipe"]["name"] == "quads_nvfp4" and on_disk["model"]["name"].startswith("SmolLM2-135M")
    s = on_disk["sites"]
    assert (s["total"], s["learner_qdq"], s["rollout_w4a4"], s["rac"]) == (211, 210, 210, 60)
    assert s["uncaptured"] == []
    assert [(p["name"], p["matches"]) for p in on_disk["passes"]] == [("weight_qdq", 210), ("w4a4_lower", 210), ("residual_compensation", 60)]
    par = on_disk["parity"]
    assert par["structural_ok"] is True and par["weights_bitexact"] is True and par["mismatched_groups"] == []
    for key in ("logprob_gap", "floor_logprob_gap"):
        g = par[key]
        assert set(g) >= {"mean_abs", "max_abs", "k1", "k3", "tokens"} and g["tokens"] > 0
        assert g["max_abs"] >= g["mean_abs"] > 0 and g["k3"] >= 0
    # W4A4 activations make the recipe's gap larger than the BF16 engine-drift floor
    assert par["logprob_gap"]["mean_abs"] > par["floor_logprob_gap"]["mean_abs"]
    for f in ("report.md", "activation_mismatch.png", "residual_heatmap.png", "logprob_gap_hist.png",
              "rollout/weights.safetensors", "rollout/hf_quant_config.json", "rollout/recipe.yaml", "learner/model.safetensors"):
        assert (out / f).is_file(), f
    assert not list(out.parent.glob(".quads.partial-*"))
    # modes as the umask gives plain files (mkdtemp makes 0700, safetensors writes 0600)
    mask = os.umask(0)
    os.umask(mask)
    assert (out.stat().st_mode & 0o777, (out / "learner" / "model.safetensors").stat().st_mode & 0o777) == (
        0o777 & ~mask, 0o666 & ~mask)
    w = load_file(str(out / "rollout" / "weights.safetensors"))
    assert w[f"{SITE}.weight"].dtype == torch.uint8 and w[f"{SITE}.weight"].shape == (1536, 288)
    assert w[f"{SITE}.weight_scale"].dtype == torch.float8_e4m3fn and w[f"{SITE}.weight_scale"].shape == (1536, 36)
    assert w[f"{SITE}.weight_scale_2"].dtype == torch.float32 and w[f"{SITE}.weight_scale_2"].dim() == 0
    # both global conventions are stored; the gate and up halves of one MLP share them (one group amax)
    gate = SITE.replace("up_proj", "gate_proj")
    assert torch.equal(w[f"{SITE}.weight_scale_2"], w[f"{gate}.weight_scale_2"])
    assert torch.equal(w[f"{SITE}.weight_global_scale"], w[f"{gate}.weight_global_scale"])


@pytest.mark.slow
def test_check_passes_then_a_planted_scale_bit_fails_the_checksum(quads_apply_dir, default_pipeline, tmp_path):
    """The one full ``qpass check`` of the real model's output (every one of the 840 tensors compared).
    Naming the site, group and position of a planted bit after a rebuild (``checksums=False``) is
    model-independent: ``tests/test_apply_check.py::test_planted_block_scale_bit_is_named_by_site_group_and_position``."""
    _, _, out = quads_apply_dir
    status, res = run_check(str(out), ApplyOptions(), pipeline=default_pipeline)
    # every tensor written is loaded and compared (codes, scales, S_dec and S_enc per site; was 3 * 210)
    assert status == 0 and res["weights_bitexact"] is True and res["loaded"]["rollout_tensors"] == 4 * 210
    assert res["compared"]["rollout_tensors"] == 4 * 210 and res["checksums_ok"] is True
    d = copy_apply_output(out, tmp_path / "copy")  # the session's apply output stays untouched
    flip_rollout_scale_bit(d, SITE, (100, 7))
    status, res = run_check(str(d), ApplyOptions(), pipeline=default_pipeline)
    assert status == 1 and res["checksums_ok"] is False  # found by the sha256 in report.json, before any rebuild
    assert res["failures"] == ["rollout/weights.safetensors: sha256 differs from report.json (the file changed after qpass apply wrote it)"]


def test_cli_bad_inputs_exit_2_and_leave_nothing(tmp_path, capsys):
    assert cli_main(["apply", "quads_nvfp4", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nrollout:\n  - pass: w4a4_lower\n    act: fp4\n")
    assert cli_main(["apply", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "bad.yaml:4: pass 'w4a4_lower': act:" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert cli_main(["aply"]) == 2 and "did you mean 'apply'" in capsys.readouterr().err


def test_interrupted_apply_leaves_no_output_dir(tiny_pipeline, tmp_path, monkeypatch):
    """Unit tier: the tiny Llama with a char-level chat tokenizer (was the default model; the atomic
    output directory does not depend on the model)."""
    import dataclasses

    import qpass.parity.behavior as behavior
    from qpass.graph.model import LoadedModel

    from .test_grpo import FakeTok

    pipe = dataclasses.replace(tiny_pipeline, loaded=LoadedModel(model=tiny_pipeline.loaded.model, tokenizer=FakeTok(),
                                                                 name="tiny-llama", source="random"))
    calls = []

    def interrupt(*a, **k):
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(behavior, "logprob_gap", interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_apply("naive_nvfp4", tmp_path / "o", ApplyOptions(prompts=1, samples=1, max_new_tokens=4), pipeline=pipe)
    assert calls == [1]  # interrupted inside the job (after the graphs were built), not before it
    assert list(tmp_path.iterdir()) == []


def test_model_without_linear_layers_is_a_clear_error():
    from qpass.graph.model import LoadedModel
    from qpass.pipeline import Pipeline

    class NoLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 8)

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
            return type("Out", (), {"logits": self.emb(input_ids)})()

    with pytest.raises(CaptureError, match="no linear projection"):
        Pipeline.prepare(loaded=LoadedModel(NoLinear(), None, "no-linear", "test"))


def test_check_rejects_a_corrupt_report(tmp_path, capsys):
    d = tmp_path / "o"
    d.mkdir()
    (d / "report.json").write_text("{not json")
    assert cli_main(["check", str(d)]) == 2
    assert "report.json is not a readable qpass report" in capsys.readouterr().err
    (d / "report.json").write_text("{}")
    assert cli_main(["check", str(d)]) == 2
    assert "KeyError" in capsys.readouterr().err
    assert cli_main(["check", "no_such_output"]) == 2
    assert "output directory or a recipe" in capsys.readouterr().err


def test_force_replaces_only_empty_or_previous_qpass_output(tmp_path):
    from qpass.apps.artifacts import atomic_dir
    from qpass.errors import QpassError

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(QpassError, match="non-empty directory without report.json"):
        with atomic_dir(mine, force=True):
            pass
    assert (mine / "notes.txt").read_text() == "keep me"
    prev = tmp_path / "prev"
    prev.mkdir()
    (prev / "report.json").write_text("{}")
    with atomic_dir(prev, force=True) as tmp:
        (tmp / "new.txt").write_text("x")
    assert sorted(p.name for p in prev.iterdir()) == ["new.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with atomic_dir(empty, force=True) as tmp:
        (tmp / "a").write_text("y")
    assert (empty / "a").read_text() == "y"


def test_sigterm_during_apply_leaves_no_output(tmp_path, monkeypatch, capsys):
    import signal

    import qpass.apps.apply as apply_mod
    from qpass.apps.artifacts import atomic_dir

    def fake_run_apply(recipe, out, o, **kw):
        with atomic_dir(out) as tmp:
            (tmp / "report.json").write_text("{}")
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler raises at the next bytecode boundary
                time.sleep(0.001)
        raise AssertionError("SIGTERM did not interrupt")

    monkeypatch.setattr(apply_mod, "run_apply", fake_run_apply)
    before = signal.getsignal(signal.SIGTERM)
    assert cli_main(["apply", "quads_nvfp4", "--out", str(tmp_path / "o")]) == 143
    assert "terminated" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # neither DIR nor .DIR.partial-*
    assert signal.getsignal(signal.SIGTERM) is before
