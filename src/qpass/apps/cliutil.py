"""What every ``qpass`` subcommand shares: the exit-code map, the shared flags, logging set up once.

Exit status (one map for every subcommand):

==== ==========================================================================================
0    ok
1    a parity check failed (or, with several GRPO recipes, one of them failed)
2    bad input: recipe, model path, flags, output path, missing or corrupt artifacts
130  interrupted (Ctrl-C); no partial output directory is left behind
143  terminated (SIGTERM); likewise
70   internal error: an exception that is not bad input (a bug in qpass); the traceback is printed
==== ==========================================================================================

Bad input never shows a traceback and is refused before any heavy work (model load, capture,
training): the checks of :mod:`qpass.apps.validate`, the strict recipe loader, argparse types.

Shared flags are defined here once (:func:`add_threads`, :func:`add_dtype`, :func:`add_force`,
:func:`add_verbose`) and added by each subcommand's parser. Logging is configured once, by the
``qpass`` entry point (:func:`configure_logging`), from ``-v``/``--verbose`` (DEBUG for qpass) or
``$QPASS_LOG``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["DefaultsHelpFormatter", "help_defaults_missing", "SEED_MAX", "bounded", "nonneg_float", "nonneg_int", "pos_float", "pos_int", "seed_int", "EXIT_BAD_INPUT", "EXIT_INTERNAL", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_PARITY", "EXIT_TERMINATED", "ROLLOUT_ENGINES", "add_dtype", "add_force", "add_rollout_engine",
           "add_threads", "add_verbose", "configure_logging", "exit_status", "verbosity"]

EXIT_OK = 0
EXIT_PARITY = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
EXIT_INTERNAL = 70  # sysexits.h EX_SOFTWARE

NOISY_LOGGERS = ("torch.utils._pytree", "torchao", "transformers")


def exit_status(exc: BaseException) -> int:
    """The exit status of a command that raised ``exc`` (see the module table).

    Raises:
        TypeError: ``exc`` is not one the map covers (a bug: let the traceback show).
    """
    from qpass.errors import ParityError, QpassError, Terminated

    if isinstance(exc, Terminated):
        return EXIT_TERMINATED
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, ParityError):
        return EXIT_PARITY
    if isinstance(exc, QpassError):
        return EXIT_BAD_INPUT
    raise TypeError(f"no exit status for {type(exc).__name__}")


# ----------------------------------------------------------------------------- help


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line on stderr, exit 2:
    ``PROG: error: MESSAGE (see PROG --help)`` — not the usage block first (a fresh user found a
    42-line usage block ahead of a one-word typo). Subparsers inherit it."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` with every option's default: ``(default: X)`` is appended unless the help text already
    says what the default is (the word "default"), the default is None/False (then the help text says
    what happens: e.g. "the recipe's value"), or the option is a flag without a value."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default is None or action.default is False or action.default == argparse.SUPPRESS \
                or not action.option_strings:
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._CountAction,
                               argparse._HelpAction, argparse._VersionAction)):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def help_defaults_missing(ap: argparse.ArgumentParser) -> list[str]:
    """Options of ``ap`` whose ``--help`` line says nothing about a default (tests: every option must).

    Required options and flags without a value (store_true/false, count, help) are exempt; a None default must be explained
    in the help text (it contains "default").
    """
    fmt = DefaultsHelpFormatter(ap.prog)
    out = []
    for act in ap._actions:
        if not act.option_strings or act.required or isinstance(act, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._CountAction,
                                                       argparse._HelpAction, argparse._VersionAction)) or act.help == argparse.SUPPRESS:
            continue
        if "default" not in fmt._get_help_string(act).lower():
            out.append(act.option_strings[-1])
    return out


# ----------------------------------------------------------------------------- shared flags


def bounded(cast: type, lo: int, strict: bool) -> Callable[[str], Any]:
    """An argparse type: ``cast(s)`` (int, or a finite float) that is ``> lo`` (strict) or ``>= lo``."""
    op = ">" if strict else ">="
    kind = "an integer" if cast is int else "a number"

    def parse(s: str):
        try:
            v = cast(s)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected {kind} {op} {lo}, got {s!r}") from exc
        if not ((v > lo if strict else v >= lo) and (cast is int or math.isfinite(v))):
            got = v if cast is int else repr(s)
            raise argparse.ArgumentTypeError(f"expected {'an integer' if cast is int else 'a finite number'} {op} {lo}, got {got}")
        return v

    return parse


#: The largest seed (torch generators take 64-bit seeds; qpass derives per-step seeds from it).
SEED_MAX = 2**63 - 1


def seed_int(s: str) -> int:
    """An argparse type: a seed, an integer in ``[0, 2^63 - 1]`` (a larger one overflows torch's
    generator after the model load)."""
    try:
        v = int(s)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected an integer seed in [0, 2^63 - 1], got {s!r}") from exc
    if not 0 <= v <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"expected an integer seed in [0, 2^63 - 1], got {v}")
    return v


pos_int = bounded(int, 1, strict=False)
nonneg_int = bounded(int, 0, strict=False)
pos_float = bounded(float, 0, strict=True)
nonneg_float = bounded(float, 0, strict=False)



def add_threads(ap: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--threads N``: torch CPU threads (default: torch's choice)."""
    ap.add_argument("--threads", type=pos_int, default=None,
                    help="torch CPU threads (default: torch's choice; 1 is much faster on an oversubscribed machine)")


ROLLOUT_ENGINES = ("qpass", "vllm")


def add_rollout_engine(ap: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--rollout-engine qpass|vllm`` (apply, check, study, grpo): who samples — qpass's rollout graph
    (default) or a live vLLM engine serving the recipe's exported checkpoint (:mod:`qpass.apps.engines`)."""
    ap.add_argument("--rollout-engine", default="qpass", choices=ROLLOUT_ENGINES,
                    help="who samples: qpass's rollout graph (default: qpass) or a live vLLM engine serving the recipe's "
                         "exported checkpoint (needs qpass[vllm])")


def add_kernels(ap: argparse.ArgumentParser | argparse._ArgumentGroup, default: str = "reference",
                help: str = "rollout op implementations") -> None:
    """``--kernels reference|triton|cuda`` (apply, check, grpo, grpo-sweep, study), from the one list
    :data:`qpass.kernel_select.KERNEL_CHOICES`; off CUDA, ``cuda`` runs the reference ops
    (:func:`qpass.kernel_select.effective_backend`)."""
    from qpass.kernel_select import KERNEL_CHOICES

    ap.add_argument("--kernels", default=default, choices=KERNEL_CHOICES,
                    help=f"{help} (cuda: the NVRTC tensor-core kernels; off CUDA the reference ops run; default: %(default)s)")


def add_dtype(ap: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--dtype bf16|fp16|fp32``: the model dtype (default bf16)."""
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="model dtype (default: bf16)")


def add_force(ap: argparse.ArgumentParser | argparse._ArgumentGroup, marker: str, *aliases: str) -> None:
    """``--force`` (plus ``aliases``): replace an existing output only if empty or a previous output holding ``marker``."""
    ap.add_argument("--force", *aliases, action="store_true", dest="force",
                    help=f"replace an existing output directory if it is empty or a previous output (holds {marker}); "
                         "never anything else")


def add_verbose(ap: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``-v/--verbose``: debug logging of qpass (read by the entry point, see :func:`verbosity`)."""
    ap.add_argument("-v", "--verbose", action="count", default=0, help="debug logging (qpass loggers)")


def verbosity(argv: list[str]) -> int:
    """How many ``-v``/``--verbose`` flags ``argv`` holds (before a ``--``)."""
    n = 0
    for a in argv:
        if a == "--":
            break
        if a == "--verbose":
            n += 1
        elif a.startswith("-") and not a.startswith("--") and set(a[1:]) == {"v"}:
            n += len(a) - 1
    return n


# ----------------------------------------------------------------------------- logging


class _StderrHandler(logging.StreamHandler):
    """Writes to the *current* ``sys.stderr`` (so redirections made after setup are honoured)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # noqa: ANN001
        pass


def configure_logging(verbose: int = 0) -> int:
    """Set up qpass logging (called once, by the ``qpass`` entry point). Returns the level set.

    One stderr handler on the ``qpass`` logger (added once; a second call only changes the level),
    level DEBUG with ``verbose`` >= 1, else ``$QPASS_LOG`` (default WARNING). Third-party loggers
    that are noisy at import are set to ERROR; the root logger is left alone.
    """
    level: int | str = logging.DEBUG if verbose else os.environ.get("QPASS_LOG", "WARNING").upper()
    qlog = logging.getLogger("qpass")
    if not any(isinstance(h, _StderrHandler) for h in qlog.handlers):
        h = _StderrHandler()
        h.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        qlog.addHandler(h)
    qlog.setLevel(level)
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.ERROR)
    return qlog.level
