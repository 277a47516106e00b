"""The ``qpass`` CLI tree: shared flags, one exit-code map, logging set up once, one source of GRPO defaults."""

from __future__ import annotations

import logging

import pytest

from qpass.apps.cli import COMMANDS, build_parser
from qpass.apps.cli import main as cli_main


@pytest.fixture()
def restore_logging():
    qlog = logging.getLogger("qpass")
    level, handlers = qlog.level, list(qlog.handlers)
    yield
    qlog.setLevel(level)
    qlog.handlers[:] = handlers


def _options(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def test_one_tree_with_shared_flags():
    ap = build_parser()
    sub = next(a for a in ap._actions if a.dest == "command")
    assert set(sub.choices) == set(COMMANDS) == {"apply", "check", "export", "calibrate", "recipes", "bench", "grpo", "grpo-plot",
                                                       "grpo-compare", "grpo-sweep", "study"}
    shared = {"apply": {"--threads", "--dtype", "--force", "-v", "--verbose", "--rollout-engine", "--calibration"},
              "check": {"--threads", "--dtype", "-v", "--verbose", "--rollout-engine", "--calibration"},
              "export": {"--threads", "--force", "-v", "--verbose", "--calibration"},
              "calibrate": {"--threads", "--dtype", "--force", "-v", "--verbose"},
              "grpo": {"--threads", "--dtype", "--force", "--overwrite", "-v", "--verbose", "--rollout-engine", "--calibration",
                       "--recalibrate"},
              "study": {"--threads", "--force", "-v", "--verbose", "--rollout-engine"},
              "bench": {"--threads", "-v", "--verbose"}}  # bench: parser in qpass.apps.bench (was none)
    for name, flags in shared.items():
        assert flags <= _options(sub.choices[name]), (name, flags - _options(sub.choices[name]))
    assert {"-v", "--verbose"} <= _options(sub.choices["grpo-plot"])
    assert {"-v", "--verbose"} <= _options(sub.choices["grpo-compare"]) & _options(sub.choices["grpo-sweep"])
    tiles = {tuple(a.choices) for name in ("grpo", "study") for a in sub.choices[name]._actions
             if "--kernel-tiles" in a.option_strings}
    assert tiles == {("pinned", "autotune")}  # one flag, one default, in both run commands
    # defined once: the same help text wherever a shared flag appears
    helps = {}
    for name in shared:
        for a in sub.choices[name]._actions:
            if {"--threads", "--verbose", "--rollout-engine"} & set(a.option_strings):
                helps.setdefault(a.option_strings[-1], set()).add(a.help)
    assert all(len(h) == 1 for h in helps.values()), helps
    engines = {tuple(a.choices) for name in ("apply", "check", "grpo", "study") for a in sub.choices[name]._actions
               if "--rollout-engine" in a.option_strings}
    assert engines == {("qpass", "vllm")}


def test_verbose_gives_debug_output(capsys, tmp_path, restore_logging):
    """Old code: cli.main called logging.basicConfig first, so grpo's own basicConfig(-v) was a no-op."""
    assert cli_main(["grpo", "-v", "--recipe", "no_such_recipe", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "DEBUG qpass.apps.cli: qpass grpo: argv" in err
    assert logging.getLogger("qpass.apps.grpo.cli").isEnabledFor(logging.DEBUG)
    logging.getLogger("qpass.apps.grpo.grpo").debug("a debug line")
    assert "DEBUG qpass.apps.grpo.grpo: a debug line" in capsys.readouterr().err
    # without -v (and no QPASS_LOG) debug is off again; the handler is not added twice
    assert cli_main(["recipes", "--json"]) == 0
    assert not logging.getLogger("qpass").isEnabledFor(logging.DEBUG)
    assert sum(type(h).__name__ == "_StderrHandler" for h in logging.getLogger("qpass").handlers) == 1


def test_one_exit_code_map():
    from qpass.apps.cliutil import exit_status
    from qpass.errors import CaptureError, ParityError, QpassError, RecipeError, Terminated

    assert [exit_status(e) for e in (ParityError("x"), RecipeError("x"), CaptureError("x"), QpassError("x"),
                                     KeyboardInterrupt(), Terminated(15))] == [1, 2, 2, 2, 130, 143]
    with pytest.raises(TypeError):
        exit_status(ValueError("a bug"))


def test_grpo_cli_defaults_are_the_config_defaults(tmp_path):
    """Old code: the CLI said --bitexact-every 10, GRPOConfig() said 0."""
    from qpass.apps.grpo.cli import _grpo_config, build_grpo_parser
    from qpass.apps.grpo.grpo import GRPOConfig

    a = build_grpo_parser().parse_args(["--recipe", "bf16", "--out", str(tmp_path / "x")])
    assert _grpo_config(a, a.steps, None) == GRPOConfig()


def test_every_recipe_check_has_one_registered_parity_check(monkeypatch):
    """apply and check iterate one registry; a recipe check without an entry is an error, not a skip."""
    from qpass.apps import parity_checks as pc
    from qpass.errors import QpassError
    from qpass.recipe import CHECKS

    assert set(pc.PARITY_CHECKS) == set(CHECKS)
    assert [c.name for c in pc.PARITY_CHECKS.values() if c.behavioral] == ["logprob_gap"]
    with pytest.raises(ValueError, match="registered twice"):
        pc.register_check("structural")(lambda ctx: None)
    # a registry without the entry (a copy: deleting and restoring the shared dict would move the entry
    # to the end and change the check order later tests see)
    monkeypatch.setattr(pc, "PARITY_CHECKS", {k: v for k, v in pc.PARITY_CHECKS.items() if k != "weights_bitexact"})
    with pytest.raises(QpassError, match=r"no parity check registered for \['weights_bitexact'\]"):
        list(pc.run_checks(pc.CheckContext(None, None, None), ["structural", "weights_bitexact"]))


def test_recipes_json_is_strict(capsys):
    import json

    assert cli_main(["recipes", "--json", "-v"]) == 0
    rows = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(c))
    assert {"bf16", "quads_nvfp4"} <= {r["name"] for r in rows}


def test_every_kernels_flag_offers_the_same_backends():
    """apply, check, grpo, grpo-sweep and study spell ``--kernels`` from one list (cuda included)."""
    import argparse

    from qpass.kernel_select import KERNEL_CHOICES

    assert KERNEL_CHOICES == ("reference", "triton", "cuda")
    import qpass.apps.grpo.cli as g
    import qpass.apps.grpo.sweep as sw
    import qpass.apps.options as o
    import qpass.apps.study.run as st

    common = argparse.ArgumentParser()
    o.add_common_args(common)
    for ap in (g.build_grpo_parser(), sw.build_sweep_parser(), common, st.build_parser()):
        (action,) = [a for a in ap._actions if "--kernels" in a.option_strings]
        assert action.choices is KERNEL_CHOICES, ap.prog
    assert common.parse_args(["--kernels", "cuda"]).kernels == "cuda"


@pytest.mark.parametrize("argv,prog", [
    (["apply", "quads_nvfp4", "--out", "OUT", "--dtype", "bf17"], "qpass apply"),
    (["grpo", "--recipe", "quads_nvfp4", "--out", "OUT", "--preset", "smok"], "qpass grpo"),
    (["grpo", "--recipe", "quads_nvfp5", "--out", "OUT", "--steps", "abc"], "qpass grpo"),
    (["export", "DIR", "--format", "onnx2", "--out", "OUT"], "qpass export"),
])
def test_a_usage_error_is_one_line_naming_the_command(argv, prog, capsys, tmp_path):
    """A fresh user met argparse's 10-42 line usage block before a one-word typo, and `--preset smok`
    named the program `qpass` instead of `qpass grpo`."""
    from qpass.apps.cli import main

    argv = [str(tmp_path / a) if a in ("OUT", "DIR") else a for a in argv]
    try:
        status = main(argv)
    except SystemExit as exc:  # the console script's exit status either way
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: ") and err[0].endswith(f"(see {prog} --help)"), err
