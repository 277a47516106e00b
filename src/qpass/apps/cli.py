"""usage: qpass COMMAND [ARGS]   (qpass COMMAND --help for a command's options)

    qpass apply RECIPE --model default --out DIR     recipe -> learner + rollout graphs + parity report
    qpass check DIR|RECIPE                           re-verify parity (saved artifacts or a recipe)
    qpass export DIR|MODEL --format F --out CKPT     standalone HF checkpoint; F: qpass (default; carries RAC),
                                                     modelopt, compressed-tensors, plain (unquantized masters)
    qpass calibrate RECIPE --out CAL                 static RAC channels + activation scales from prompts
    qpass recipes                                    list built-in recipes
    qpass bench [--quick]                            kernel benchmarks (ratios vs baselines, same run)
    qpass grpo --recipe R --out DIR                  GRPO with mismatch diagnostics and corrections
                                                     (--preset smoke: a real 2-step run, a few CPU-minutes)
    qpass grpo-plot RUN_DIR... --out PNG             overlay GRPO curves (--preset cost: accuracy vs rollout seconds)
    qpass grpo-compare RUN_DIR... --out F.json       between-arm CIs (block bootstrap), collapse per run
    qpass grpo-sweep run --arms A,B --seeds 0,1 ...  N arms x seeds as parallel grpo processes on one GPU
    qpass study --out DIR                            QUADS ablations on the default model

Shared flags: -v/--verbose (debug logging), --threads N, --dtype bf16|fp16|fp32, --force
(replace an output only if it is empty or a previous output of that command).

Exit status: 0 ok, 1 a parity check failed, 2 bad input (recipe, model path, flags, output path,
artifacts), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM), 70 an internal error (a bug: the
traceback is printed); outputs are written atomically, so an interrupted run leaves no partial
output directory.
"""

from __future__ import annotations

import argparse

from qpass.apps.cliutil import Parser
import dataclasses
import logging
import os
import sys
from collections.abc import Callable

USAGE = __doc__
log = logging.getLogger("qpass.apps.cli")


def _recipes(argv: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    from qpass.apps.cliutil import add_verbose
    from qpass.compiler.recipe import builtin_recipes, load_recipe

    ap = Parser(prog="qpass recipes", description="List built-in recipes")
    ap.add_argument("--json", action="store_true")
    add_verbose(ap)
    a = ap.parse_args(argv)
    rows = []
    for name, path in sorted(builtin_recipes().items()):
        r = load_recipe(str(path))
        rows.append((name, ", ".join(p.name for p in r.learner) or "-", ", ".join(p.name for p in r.rollout) or "-",
                     ", ".join(c.check for c in r.parity), r.description, str(path)))
    if a.json:
        from qpass.jsonio import dumps

        print(dumps([dict(zip(("name", "learner", "rollout", "parity", "description", "path"), r)) for r in rows]))
        return 0
    t = Table(title="qpass built-in recipes")
    for col in ("name", "learner passes", "rollout passes", "parity checks", "description"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(*r[:5])
    # piped output: one wide table instead of rich's 80-column default
    Console(width=None if sys.stdout.isatty() else 200).print(t)
    return 0


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand of the ``qpass`` tree: entry ``module:func(argv) -> status`` and its parser builder."""

    name: str
    entry: str
    parser: str | None = None  # "module:func" returning the subcommand's ArgumentParser (None: passthrough)

    def run(self, argv: list[str]) -> int:
        return _resolve(self.entry)(argv)


def _resolve(ref: str) -> Callable:
    import importlib

    module, func = ref.split(":")
    return getattr(importlib.import_module(module), func)


COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("apply", "qpass.apps.apply:main_apply", "qpass.apps.apply:build_apply_parser"),
    Command("check", "qpass.apps.check:main_check", "qpass.apps.check:build_check_parser"),
    Command("export", "qpass.apps.export:main_export", "qpass.apps.export:build_export_parser"),
    Command("calibrate", "qpass.apps.calibrate:main_calibrate", "qpass.apps.calibrate:build_calibrate_parser"),
    Command("recipes", "qpass.apps.cli:_recipes"),
    Command("bench", "qpass.apps.bench.cli:main", "qpass.apps.bench.cli:build_bench_parser"),  # implementation: qpass.apps.bench.triton_bench
    Command("grpo", "qpass.apps.grpo.cli:grpo_main", "qpass.apps.grpo.cli:build_grpo_parser"),
    Command("grpo-plot", "qpass.apps.grpo.cli:grpo_plot_main", "qpass.apps.grpo.cli:build_plot_parser"),
    Command("grpo-compare", "qpass.apps.grpo.cli:grpo_compare_main", "qpass.apps.grpo.cli:build_compare_parser"),
    Command("grpo-sweep", "qpass.apps.grpo.sweep:sweep_main", "qpass.apps.grpo.sweep:build_sweep_parser"),
    Command("study", "qpass.apps.study:main", "qpass.apps.study:build_parser"),
)}


def build_parser() -> argparse.ArgumentParser:
    """The whole ``qpass`` CLI as one argparse tree (each subcommand's parser as a child).

    Used for ``--help`` and to check the tree (shared flags on every subcommand); each command's
    entry point parses its own arguments with the same builder.
    """
    ap = Parser(prog="qpass", description="compiler passes for NVFP4/FP8 rollouts in LLM RL",
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=USAGE)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    for c in COMMANDS.values():
        if c.parser is None:
            sub.add_parser(c.name, add_help=False, help=f"qpass {c.name} --help")
            continue
        import inspect

        fn = _resolve(c.parser)
        child = fn(f"qpass {c.name}") if inspect.signature(fn).parameters else fn()
        sub.add_parser(c.name, parents=[child], add_help=False, description=child.description, help=child.description)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``qpass`` console script (logging set up here, once; exit codes: cliutil)."""
    from qpass.apps.cliutil import EXIT_BAD_INPUT, EXIT_INTERNAL, configure_logging, exit_status, verbosity

    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    configure_logging(verbosity(argv))
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else EXIT_BAD_INPUT
    if argv[0] in ("-V", "--version"):
        from qpass import __version__

        print(f"qpass {__version__}")
        return 0
    cmd = COMMANDS.get(argv[0])
    if cmd is None:
        import difflib

        near = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        print(f"qpass: unknown command {argv[0]!r}" + (f" (did you mean {near[0]!r}?)" if near else "") + f"; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    log.debug("qpass %s: argv %s", cmd.name, argv[1:])
    from qpass.errors import ParityError, QpassError, Terminated

    import signal

    def _terminate(signum: int, _frame: object) -> None:
        raise Terminated(signum)

    previous = None
    try:  # SIGTERM unwinds like Ctrl-C, so atomic outputs are removed (main thread only)
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:
        pass
    try:
        return int(cmd.run(argv[1:]) or 0)
    except Terminated as exc:
        print("qpass: terminated; no partial output directory was left behind", file=sys.stderr)
        return exit_status(exc)
    except KeyboardInterrupt as exc:
        print("qpass: interrupted; no partial output directory was left behind", file=sys.stderr)
        return exit_status(exc)
    except ParityError as exc:
        print(f"qpass: parity check failed: {exc}", file=sys.stderr)
        return exit_status(exc)
    except QpassError as exc:
        print(f"qpass: error: {exc}", file=sys.stderr)
        return exit_status(exc)
    except Exception as exc:  # noqa: BLE001 - a bug, not bad input: show it, but never as exit 1 (a parity failure)
        import traceback

        traceback.print_exc()
        print(f"qpass: internal error ({type(exc).__name__}: {exc}); this is a bug in qpass, please report it "
              f"with the command line (exit status {EXIT_INTERNAL})", file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
