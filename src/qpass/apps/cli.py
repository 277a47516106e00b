"""usage: qpass COMMAND [ARGS]   (qpass COMMAND --help for a command's options)

    qpass apply RECIPE --model default --out DIR     recipe -> learner + rollout graphs + parity report
    qpass check DIR|RECIPE                           re-verify parity (saved artifacts or a recipe)
    qpass recipes                                    list built-in recipes
    qpass bench [--quick]                            kernel benchmarks (ratios vs baselines, same run)
    qpass grpo --recipe R --out DIR                  GRPO with mismatch diagnostics and corrections
    qpass grpo-plot RUN_DIR... --out PNG             overlay GRPO curves
    qpass study --out DIR                            QUADS ablations on the default model

Exit status: 0 ok, 1 a parity check failed, 2 bad input (recipe, model path, flags, artifacts),
130 interrupted (Ctrl-C), 143 terminated (SIGTERM); outputs are written atomically, so an
interrupted run leaves no partial output directory.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

USAGE = __doc__


def _recipes(argv: list[str]) -> int:
    import argparse

    from rich.console import Console
    from rich.table import Table

    from qpass.recipe import builtin_recipes, load_recipe

    ap = argparse.ArgumentParser(prog="qpass recipes", description="List built-in recipes")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = []
    for name, path in sorted(builtin_recipes().items()):
        r = load_recipe(str(path))
        rows.append((name, ", ".join(p.name for p in r.learner) or "-", ", ".join(p.name for p in r.rollout) or "-",
                     ", ".join(c.check for c in r.parity), r.description, str(path)))
    if a.json:
        import json

        print(json.dumps([dict(zip(("name", "learner", "rollout", "parity", "description", "path"), r)) for r in rows], indent=2))
        return 0
    t = Table(title="qpass built-in recipes")
    for col in ("name", "learner passes", "rollout passes", "parity checks", "description"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(*r[:5])
    # piped output: one wide table instead of rich's 80-column default
    Console(width=None if sys.stdout.isatty() else 200).print(t)
    return 0


def _lazy(module: str, func: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        import importlib

        return getattr(importlib.import_module(module), func)(argv)

    return run


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "apply": _lazy("qpass.apps.apply", "main_apply"),
    "check": _lazy("qpass.apps.check", "main_check"),
    "recipes": _recipes,
    "bench": _lazy("qpass.backends.triton.bench", "main"),
    "grpo": _lazy("qpass.apps.grpo.cli", "grpo_main"),
    "grpo-plot": _lazy("qpass.apps.grpo.cli", "grpo_plot_main"),
    "study": _lazy("qpass.apps.study", "main"),
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``qpass`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    logging.basicConfig(level=os.environ.get("QPASS_LOG", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("torch.utils._pytree", "torchao", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from qpass import __version__

        print(f"qpass {__version__}")
        return 0
    cmd = COMMANDS.get(argv[0])
    if cmd is None:
        import difflib

        near = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        print(f"qpass: unknown command {argv[0]!r}" + (f" (did you mean {near[0]!r}?)" if near else "") + f"; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    from qpass.errors import CaptureError, ParityError, QpassError, RecipeError, Terminated

    import signal

    def _terminate(signum: int, _frame: object) -> None:
        raise Terminated(signum)

    previous = None
    try:  # SIGTERM unwinds like Ctrl-C, so atomic outputs are removed (main thread only)
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:
        pass
    try:
        return int(cmd(argv[1:]) or 0)
    except Terminated:
        print("qpass: terminated; no partial output directory was left behind", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("qpass: interrupted; no partial output directory was left behind", file=sys.stderr)
        return 130
    except (RecipeError, CaptureError) as exc:
        print(f"qpass: error: {exc}", file=sys.stderr)
        return 2
    except ParityError as exc:
        print(f"qpass: parity check failed: {exc}", file=sys.stderr)
        return 1
    except QpassError as exc:
        print(f"qpass: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
