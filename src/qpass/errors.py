"""Exceptions raised by qpass. Every message names the tensor, site or recipe line at fault."""

from __future__ import annotations


class QpassError(Exception):
    """Base class of every qpass error."""


class QuantizationError(QpassError, ValueError):
    """Input a quantizer cannot encode faithfully: bad shape or dtype, NaN/inf, stale amax."""


class RecipeError(QpassError, ValueError):
    """A recipe file that does not validate (unknown key, unknown pass, bad value, bad order).

    The message starts with ``path:line:`` when the location is known.
    """


class PassError(QpassError, RuntimeError):
    """A pass failed while rewriting a graph."""


class NoMatchError(PassError):
    """A pass with ``expect_matches`` matched nothing (a recipe that silently does nothing)."""


class PreconditionError(PassError):
    """A pass's declared ``requires`` property does not hold on its input graph."""


class PostconditionError(PassError):
    """A pass's declared ``ensures`` property does not hold on its output graph."""


class VerificationError(PassError):
    """The graph verifier rejected a node after a pass (debug mode)."""


class CaptureError(QpassError, RuntimeError):
    """A model could not be loaded or captured into a graph."""


class ParityError(QpassError, AssertionError):
    """A learner/rollout parity check failed. The message names the first differing site."""


class IntegrityError(ParityError):
    """A command's input (another command's output: an apply directory, a GRPO checkpoint) differs
    from what its writer recorded (sha256, the report's own digest) or is inconsistent with itself
    (recipe copy vs report vs quantization config vs the rebuilt graphs). The message names the file
    and what differs. Exit status 1, like a failed parity check; nothing is written from the input."""


class MissingDependencyError(QpassError, ImportError):
    """An optional dependency (a backend's extra) is not installed. The message names the package
    and the install command; the ``qpass`` CLI reports it with exit status 2, like a usage error."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread by the ``qpass`` CLI so cleanup runs as for Ctrl-C
    (a ``KeyboardInterrupt``); commands that catch it report exit status 143 instead of 130."""
