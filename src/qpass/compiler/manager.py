"""Pass infrastructure: pass base class with declared contracts, registry, and the pass manager.

A pass is a small class with:

* ``name`` (the recipe's ``pass:`` value) registered with :func:`register_pass`;
* ``Options``: a pydantic model (``extra='forbid'``) of its recipe keys;
* ``sides``: where it may run (``learner`` / ``rollout``);
* ``requires`` / ``ensures``: graph properties (:mod:`qpass.compiler.properties`) that must hold
  before / will hold after. The manager *checks* both on the graph (PreconditionError /
  PostconditionError) instead of trusting them;
* ``run(qg, ctx) -> PassResult``.

The manager validates the order of a pass list before running anything (networkx: an edge A -> B
when B requires a property A ensures; the list must be a topological order of that graph), runs
each pass, records a :class:`PassResult` on ``qg.history``, fails loudly when a pass with
``expect_matches`` matched fewer sites, verifies the graph after every pass in debug mode, and on
any failure writes a reproducer (graph code + pass list + error) before re-raising.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import networkx as nx
import pydantic

from qpass.errors import NoMatchError, PassError, PostconditionError, PreconditionError, RecipeError
from qpass.compiler.properties import check_property
from qpass.graph.qgraph import QGraph
from qpass.graph.sites import DEFAULT_EXCLUDE
from qpass.compiler.verify import verify
from qpass.jsonio import dumps
from qpass.progress import phase

log = logging.getLogger(__name__)


class PassOptions(pydantic.BaseModel):
    """Options every pass accepts. Subclasses add their own; unknown keys are rejected."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    targets: list[str] = ["*"]
    exclude: list[str] = list(DEFAULT_EXCLUDE)
    expect_matches: int = pydantic.Field(1, ge=0, description="fail if fewer sites match (0 disables)")

    @pydantic.field_validator("targets", "exclude")
    @classmethod
    def _patterns_compile(cls, v: list[str]) -> list[str]:
        """Site patterns are globs or ``re:REGEX``: a regex that does not compile, or an empty
        pattern, is refused with the recipe (not when the pass first matches sites, after capture)."""
        import re

        for pat in v:
            if not pat:
                raise ValueError("an empty site pattern matches nothing")
            if pat.startswith("re:"):
                try:
                    re.compile(pat[3:])
                except re.error as exc:
                    raise ValueError(f"pattern {pat!r} is not a valid regular expression: {exc}") from None
        return v


@dataclasses.dataclass
class PassResult:
    """What one pass did.

    Attributes:
        name: pass name. side: ``learner`` / ``rollout``.
        matches: number of sites rewritten.
        skipped: ``(site, reason)`` for targeted sites left alone.
        changed: whether the graph changed.
        elapsed_s: wall time.
        sites: ids of the sites rewritten.
        details: pass-specific facts (e.g. groups formed, constants added).
        line: recipe line of the pass, when known.
    """

    name: str
    side: str
    matches: int = 0
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    changed: bool = False
    elapsed_s: float = 0.0
    sites: list[str] = dataclasses.field(default_factory=list)
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    line: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "side": self.side, "matches": self.matches, "changed": self.changed,
            "elapsed_s": round(self.elapsed_s, 4), "skipped": [list(s) for s in self.skipped],
            "details": self.details, "line": self.line,
        }


@dataclasses.dataclass
class PassContext:
    """Inputs a pass may need beyond the graph.

    Attributes:
        debug: verify the graph after every pass.
        reproducer_dir: where failure reproducers go (None: ``$QPASS_REPRODUCER_DIR``, else
            ``<tempdir>/qpass_reproducers``).
        calibration: a :class:`qpass.calibration.source.CalibrationSource` the calibrating passes ask
            (``w4a4_lower`` with ``act_scale: static``, ``residual_compensation`` with ``selection:
            static``): a verified calibration file (``qpass calibrate``) or calibration activations;
            None if the caller provides none (those passes then refuse, saying how to get one).
        recipe_path: for messages.
    """

    debug: bool = False
    reproducer_dir: Path | None = None
    calibration: Any = None
    recipe_path: str | None = None


class Pass:
    """Base class of qpass passes (see module docstring)."""

    name: ClassVar[str] = ""
    Options: ClassVar[type[PassOptions]] = PassOptions
    sides: ClassVar[tuple[str, ...]] = ("learner", "rollout")
    requires: ClassVar[tuple[str, ...]] = ("sites_stamped",)
    ensures: ClassVar[tuple[str, ...]] = ()

    def __init__(self, options: PassOptions | dict[str, Any] | None = None, *, line: int | None = None) -> None:
        if isinstance(options, PassOptions):
            self.options = options
        else:
            self.options = self.Options(**(options or {}))
        self.line = line

    def run(self, qg: QGraph, ctx: PassContext) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"pass": self.name, **self.options.model_dump(), **({"line": self.line} if self.line else {})}


PASSES: dict[str, type[Pass]] = {}


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator: make a pass available to recipes under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in PASSES and PASSES[cls.name] is not cls:
        raise ValueError(f"pass name {cls.name!r} registered twice ({PASSES[cls.name].__name__}, {cls.__name__})")
    PASSES[cls.name] = cls
    return cls


def get_pass(name: str) -> type[Pass]:
    """The pass class registered as ``name``. The built-in passes register when ``qpass.compiler.passes`` is
    imported (``qpass.compiler.recipe`` does; the pass manager never imports its passes).

    Raises:
        RecipeError: unknown name (suggests the nearest one and lists the registered passes).
    """
    if name not in PASSES:
        import difflib

        near = difflib.get_close_matches(name, PASSES, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise RecipeError(f"unknown pass {name!r}{hint}; known passes: {sorted(PASSES)}")
    return PASSES[name]


def _where(p: Pass) -> str:
    return f"pass {p.name!r}" + (f" (recipe line {p.line})" if p.line else "")


def validate_order(passes: Sequence[Pass], initial: set[str]) -> nx.DiGraph:
    """Check the list order satisfies every ``requires`` (networkx dependency graph).

    Raises:
        RecipeError: a pass requires a property that no earlier pass ensures and the input graph
            lacks; the message names the pass that would provide it and its position.
    """
    g = nx.DiGraph()
    for i, p in enumerate(passes):
        g.add_node(i, name=p.name)
    providers: dict[str, list[int]] = {}
    for i, p in enumerate(passes):
        for prop in p.ensures:
            providers.setdefault(prop, []).append(i)
    for i, p in enumerate(passes):
        for prop in p.requires:
            if prop in initial:
                continue
            prov = providers.get(prop, [])
            earlier = [j for j in prov if j < i]
            if earlier:
                g.add_edge(earlier[-1], i, prop=prop)
                continue
            if prov:
                later = passes[prov[0]]
                raise RecipeError(
                    f"{_where(p)} requires {prop!r}, which {_where(later)} ensures; move {p.name!r} after {later.name!r}"
                )
            raise RecipeError(f"{_where(p)} requires {prop!r}, which the graph lacks and no pass in the list ensures")
    assert nx.is_directed_acyclic_graph(g)
    return g


class PassManager:
    """Run an ordered pass list on one graph (one side)."""

    def __init__(self, passes: Sequence[Pass], *, side: str) -> None:
        self.passes = list(passes)
        self.side = side
        for p in self.passes:
            if side not in p.sides:
                raise RecipeError(f"{_where(p)} cannot run on the {side} side (allowed: {list(p.sides)})")

    def run(self, qg: QGraph, ctx: PassContext | None = None) -> list[PassResult]:
        """Apply every pass in order to ``qg`` (in place). Returns the new history entries.

        Raises:
            RecipeError: invalid order. PreconditionError / PostconditionError: a contract does
            not hold on the graph. NoMatchError: a pass matched fewer sites than
            ``expect_matches``. VerificationError (debug). PassError: the pass itself failed.
        """
        ctx = ctx or PassContext()
        if qg.side != self.side:
            raise PassError(f"graph side is {qg.side!r} but this pass list is for {self.side!r}")
        validate_order(self.passes, qg.properties)
        results: list[PassResult] = []
        if not self.passes:
            return results
        with phase(f"{qg.side} passes", total=len(self.passes), unit="pass") as ph:
            for p in self.passes:
                ph.advance(0, note=p.name)
                results.append(self._run_logged(p, qg, ctx))
                ph.advance()
        return results

    def _run_logged(self, p: Pass, qg: QGraph, ctx: PassContext) -> PassResult:
        """:meth:`_run_one`, with a reproducer written when it fails."""
        try:
            return self._run_one(p, qg, ctx)
        except Exception as exc:
            path = self._reproducer(p, qg, ctx, exc)
            if isinstance(exc, PassError | RecipeError):
                exc.args = (f"{exc.args[0] if exc.args else exc} [reproducer: {path}]",)
                raise
            raise PassError(f"{_where(p)} failed on the {qg.side} graph: {type(exc).__name__}: {exc} [reproducer: {path}]") from exc

    def _run_one(self, p: Pass, qg: QGraph, ctx: PassContext) -> PassResult:
        for prop in p.requires:
            bad = check_property(qg, prop)
            if bad:
                raise PreconditionError(f"{_where(p)} requires {prop!r}, which does not hold: {bad[:3]}")
        t0 = time.perf_counter()
        res = p.run(qg, ctx)
        res.elapsed_s = time.perf_counter() - t0
        res.line = p.line
        res.side = qg.side
        need = p.options.expect_matches
        if need and res.matches < need:
            reasons = "; ".join(f"{s}: {r}" for s, r in res.skipped[:5]) or "no site matched targets " + str(p.options.targets)
            raise NoMatchError(f"{_where(p)} matched {res.matches} site(s), expected at least {need} ({reasons})")
        for prop in p.ensures:
            bad = check_property(qg, prop)
            if bad:
                raise PostconditionError(f"{_where(p)} ensures {prop!r}, which does not hold after it ran: {bad[:3]}")
            qg.properties.add(prop)
        if ctx.debug:
            verify(qg)
        qg.history.append(res)
        log.info("%s/%s: %d matches, %.2fs", qg.side, p.name, res.matches, res.elapsed_s)
        return res

    def _reproducer(self, p: Pass, qg: QGraph, ctx: PassContext, exc: BaseException) -> Path:
        import tempfile

        base = ctx.reproducer_dir or os.environ.get("QPASS_REPRODUCER_DIR") or Path(tempfile.gettempdir()) / "qpass_reproducers"
        d = Path(base) / f"{time.strftime('%Y%m%d-%H%M%S')}_{qg.side}_{p.name}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "graph.py").write_text(qg.gm.code)
        (d / "graph.txt").write_text(str(qg.gm.graph))
        (d / "passes.json").write_text(dumps(
            {"side": qg.side, "kind": qg.kind, "failed": p.name, "recipe": ctx.recipe_path,
             "passes": [q.describe() for q in self.passes], "history": [h.to_json() for h in qg.history]},
            indent=2))
        (d / "error.txt").write_text("".join(traceback.format_exception(exc)))
        return d
