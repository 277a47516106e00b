"""The first hour of a new user: what the commands say while they run and when they finish.

* ``qpass apply`` shows every long phase (plain lines off a terminal), ends with a one-line verdict
  that states the log-prob gap in units of the BF16 engine-drift floor, and lists every file it wrote;
* ``qpass export`` says which weights it wrote and what the chosen format cannot carry;
* ``--help`` of every subcommand shows the defaults; ``qpass --help`` names every export format;
* ``qpass grpo --preset smoke`` sets small defaults that explicit flags still override.

Fast tier: the tiny Llama (conftest), one apply per module.
"""

from __future__ import annotations

import dataclasses
import io
import json

import pytest

from qpass.apps.apply import ApplyOptions, run_apply
from qpass.apps.cli import COMMANDS, USAGE, main as cli_main
from qpass.apps.progress import LineReporter
from qpass.apps.report import verdict
from qpass.progress import reporting
from tests.test_export import char_tokenizer, tiny_apply, tiny_hf  # noqa: F401 - module fixtures
from tests.test_grpo import FakeTok


@pytest.fixture(scope="module")
def applied_with_progress(tiny_pipeline, tmp_path_factory):
    from qpass.graph.model import LoadedModel

    pipe = dataclasses.replace(tiny_pipeline, loaded=LoadedModel(model=tiny_pipeline.loaded.model, tokenizer=FakeTok(),
                                                                 name="tiny-llama", source="random"))
    out = tmp_path_factory.mktemp("apply") / "quads"
    lines = io.StringIO()
    with reporting(LineReporter(lines, interval_s=0.0)):
        status, report = run_apply("quads_nvfp4", out, ApplyOptions(prompts=2, samples=2, max_new_tokens=4, batch_size=4),
                                   pipeline=pipe)
    return status, report, out, lines.getvalue()


def test_apply_reports_every_phase_with_counts(applied_with_progress):
    status, _, _, text = applied_with_progress
    assert status == 0
    done = [ln for ln in text.splitlines() if ": done " in ln]
    for phase_done in ("learner passes: done 1/1 pass", "rollout passes: done 2/2 passes", "w4a4_lower: quantize and lower: done 8/8 groups",
                       "bit-level weight parity: done 8/8 groups", "structural parity check: done",
                       "log-prob gap: sample 4 responses from the rollout graph, score with the learner: done 1/1 batch",
                       "BF16 engine-drift floor (base graphs): done 1/1 batch", "diagnostics and plots: done 3/3 steps",
                       "write the artifacts: done 2/2 file sets"):
        assert any(phase_done in ln for ln in done), (phase_done, done)
    assert "ETA" in text


def test_check_reports_its_phases(applied_with_progress, tiny_pipeline):
    from qpass.apps.check import run_check
    from qpass.graph.model import LoadedModel

    _, _, out, _ = applied_with_progress
    pipe = dataclasses.replace(tiny_pipeline, loaded=LoadedModel(model=tiny_pipeline.loaded.model, tokenizer=FakeTok(),
                                                                 name="tiny-llama", source="random"))
    lines = io.StringIO()
    with reporting(LineReporter(lines, interval_s=0.0)):
        status, _ = run_check(str(out), ApplyOptions(), pipeline=pipe)
    assert status == 0
    done = [ln for ln in lines.getvalue().splitlines() if ": done " in ln]
    for phase_done in ("rollout passes: done 2/2 passes", "load the saved learner state: done",
                       "weight sync: re-quantize the rollout weights: done 8/8 groups",
                       "compare and load every saved rollout tensor: done", "bit-level weight parity: done 8/8 groups"):
        assert any(phase_done in ln for ln in done), (phase_done, done)


def test_apply_summary_lists_every_file_and_ends_with_the_verdict(applied_with_progress, capsys):
    from qpass.apps.console import console, print_summary

    _, report, out, _ = applied_with_progress
    print_summary(console(), report, out)
    err = capsys.readouterr().err.splitlines()
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert len(files) == 9 and "learner/model.safetensors" in files and "residual_heatmap.png" in files
    listed = [ln.split()[0] for ln in err if ln.startswith("  ") and ln.split() and ln.split()[0] in files]
    assert listed == files
    assert any(ln.startswith(f"wrote {out}/ (9 files)") for ln in err)
    assert err[-1] == report["verdict"]["line"]
    assert report["verdict"] == json.loads((out / "report.json").read_text())["verdict"]
    assert f"**{report['verdict']['line']}**" in (out / "report.md").read_text()


def _report(gap, floor, gated=None, bitexact=True, groups=120):
    checks = [{"check": "structural", "ok": True, "detail": ""},
              {"check": "weights_bitexact", "ok": bitexact, "detail": f"{groups} groups compared"},
              {"check": "logprob_gap", "ok": gated, "detail": ""}]
    return {"ok": bitexact is not False and gated is not False,
            "parity": {"structural_ok": True, "weights_bitexact": bitexact, "mismatched_groups": [] if bitexact else ["g1", "g2"],
                       "logprob_gap": None if gap is None else {"mean_abs": gap},
                       "floor_logprob_gap": None if floor is None else {"mean_abs": floor}, "checks": checks}}


def test_verdict_states_the_gap_in_units_of_the_floor():
    v = verdict(_report(0.4733, 0.0355))
    assert v["gap_over_floor"] == pytest.approx(0.4733 / 0.0355)
    assert v["line"] == ("PASS: learner and rollout share the NVFP4 weight quantizer bit for bit (120 groups compared); "
                         "rollout/learner log-prob gap mean|d| 0.4733 = 13.3x the BF16 engine-drift floor (0.0355) "
                         "(not gated: the recipe sets no max_abs_gap)")
    assert verdict(_report(0.7, 0.05, gated=False))["line"].startswith("FAIL: ")
    assert "ABOVE the recipe's max_abs_gap" in verdict(_report(0.7, 0.05, gated=False))["line"]
    assert "14.0x the BF16 engine-drift floor" in verdict(_report(0.7, 0.05, gated=True))["line"]
    bad = verdict(_report(0.7, 0.05, bitexact=False))
    assert bad["line"].startswith("FAIL: learner and rollout do NOT share one quantizer (2 fused group(s) differ bit-wise)")
    assert "no BF16 floor measured" in verdict(_report(0.2, None))["line"]
    assert verdict(_report(0.2, None))["gap_over_floor"] is None
    assert "exactly 0" in verdict(_report(0.2, 0.0))["line"]
    assert "not measured" in verdict(_report(None, None))["line"]


# ----------------------------------------------------------------------------- export


def test_export_modelopt_of_a_rac_recipe_says_what_it_drops(tiny_apply, tmp_path, capsys):  # noqa: F811
    assert cli_main(["export", str(tiny_apply), "--format", "modelopt", "--out", str(tmp_path / "mo"),
                     "--calibration-prompts", "2"]) == 0
    out = capsys.readouterr().out
    rac = json.loads((tiny_apply / "rollout" / "hf_quant_config.json").read_text())["quantization"]["rac"]
    assert len(rac) == 4  # gate/up of the tiny Llama's 2 layers
    assert f"not carried: RAC on {len(rac)} site(s)" in out and "runs plain W4A4 there" in out
    assert "not carried: dynamic per-tensor activation scales" in out
    assert "weights: 14 NVFP4 linear(s) as the rollout's bytes" in out
    rec = json.loads((tmp_path / "mo" / "qpass_export.json").read_text())
    assert rec["carried"]["not_carried"][0].startswith(f"RAC on {len(rac)} site(s)")
    assert "wrote " in out and "model.safetensors" in out and "hf_quant_config.json" in out


def test_export_plain_of_an_apply_dir_says_it_wrote_the_masters_not_the_fake_quantized_learner(tiny_apply, tmp_path, capsys):  # noqa: F811
    assert cli_main(["export", str(tiny_apply), "--format", "plain", "--out", str(tmp_path / "plain")]) == 0
    out = capsys.readouterr().out
    assert f"weights: unquantized bf16 master weights from {tiny_apply / 'learner' / 'model.safetensors'}" in out
    assert "NOT the NVFP4 fake-quantized weights" in out
    assert "not carried: the recipe's quantization" in out


def test_export_qpass_carries_everything(tiny_apply, tmp_path, capsys):  # noqa: F811
    assert cli_main(["export", str(tiny_apply), "--format", "qpass", "--out", str(tmp_path / "q"), "--calibration-prompts", "2"]) == 0
    out = capsys.readouterr().out
    assert "not carried: nothing" in out and "note: the static input_scale" in out


# ----------------------------------------------------------------------------- help


def _parsers():
    import inspect

    from qpass.apps.cli import _resolve

    for c in COMMANDS.values():
        if c.parser is None:
            continue
        fn = _resolve(c.parser)
        yield c.name, (fn(f"qpass {c.name}") if inspect.signature(fn).parameters else fn())


def test_every_option_of_every_subcommand_shows_its_default():
    from qpass.apps.cliutil import help_defaults_missing

    missing = {name: help_defaults_missing(ap) for name, ap in _parsers()}
    assert {k: v for k, v in missing.items() if v} == {}


def test_qpass_help_names_every_export_format(capsys):
    from qpass.checkpoint.formats import CHECKPOINT_FORMATS

    assert cli_main(["--help"]) == 0
    text = capsys.readouterr().out
    assert text.strip() == USAGE.strip()
    export_line = " ".join(ln.strip() for ln in USAGE.splitlines() if "export" in ln or "modelopt" in ln)
    for fmt in CHECKPOINT_FORMATS:
        assert fmt in export_line, fmt


def test_grpo_smoke_preset_sets_defaults_that_flags_override():
    from qpass.apps.grpo.cli import GRPO_PRESETS, _apply_preset, build_grpo_parser

    smoke = GRPO_PRESETS["smoke"].values
    assert smoke["steps"] == 2 and smoke["prompts_per_step"] * smoke["group_size"] == 4 and smoke["no_shadow"]
    ap = build_grpo_parser()
    argv = ["--preset", "smoke", "--recipe", "quads_nvfp4", "--out", "x", "--max-new-tokens", "20"]
    assert _apply_preset(ap, argv) == "smoke"
    a = ap.parse_args(argv)
    assert (a.steps, a.group_size, a.eval_every, a.diag_every, a.task) == (2, smoke["group_size"], 0, 0, "larger")
    assert a.max_new_tokens == 20  # the explicit flag wins
    plain = build_grpo_parser().parse_args(["--recipe", "quads_nvfp4", "--out", "x"])
    assert plain.steps == 20 and plain.eval_prompts == 400  # no preset: the GRPOConfig defaults
    assert "smoke: a real 2-step run" in build_grpo_parser().format_help().replace("\n", " ").replace("  ", " ")
