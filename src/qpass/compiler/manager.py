"""Pass infrastructure: pass base class with declared contracts, registry, and the pass manager.

A pass is a small class with:

* ``name`` (the recipe's ``pass:`` value) registered with :func:`register_pass`;
* ``Options``: a pydantic model (``extra='forbid'``) of its recipe keys;
* ``sides``: where it may run (``learner`` / ``rollout``);
* ``requires`` / ``ensures``: graph properties (:mod:`qpass.compiler.properties`) that must hold
  before / will hold after. The manager *checks* both on the graph (PreconditionError /
  PostconditionError) instead of trusting them;
* ``mutation``: ``"in_place"`` (it rewrites the graph it is given) or ``"analysis"`` (it only
  reads it: the manager fingerprints the graph before and after and fails naming the pass if it
  changed);
* ``cleanup``: the :class:`Cleanup` flags the manager applies after the pass ran (dead-code
  elimination, dropping unread parameters, lint, recompile); a pass never tidies up itself;
* ``run(qg, ctx) -> Rewrites``: what it rewrote and what it skipped (and why), nothing else.

The manager owns the lifecycle. It validates the order of a pass list before running anything
(networkx: an edge A -> B when B requires a property A ensures; the list must be a topological order
of that graph), then for each pass: checks ``requires``, runs it, checks its mutation mode, runs its
cleanup, builds the frozen :class:`PassResult`, fails loudly (:class:`NoMatchError`) when a pass with
``expect_matches`` rewrote fewer sites, checks ``ensures``, verifies the graph in debug mode, and
records the result twice: on ``qg.history`` (the :class:`PassResult` objects) and, as JSON-ready
dicts (:meth:`PassResult.history_entry`), on ``qg.gm.meta["qpass_pass_history"]``, which deep
copies and pickles of the graph module carry. On any failure it writes a reproducer (graph code +
pass list + error) before re-raising.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Literal

import networkx as nx
import pydantic
import torch

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


#: Key of the pass history on ``GraphModule.meta`` (a list of :meth:`PassResult.history_entry` dicts).
HISTORY_KEY = "qpass_pass_history"

Mutation = Literal["in_place", "analysis"]
MUTATIONS: tuple[str, ...] = ("in_place", "analysis")


class Cleanup(enum.Flag):
    """What the manager does to the graph after a pass ran, in this order (the pass declares it).

    ``DCE``: ``graph.eliminate_dead_code()``. ``PRUNE_PARAMS``: drop parameters no node reads any
    more (:meth:`qpass.graph.qgraph.QGraph.prune`, which also eliminates dead code, lints and
    recompiles, so it is only declared as part of ``PRUNE``); their count goes to
    ``details["removed_params"]``. ``LINT``: ``graph.lint()``. ``RECOMPILE``: ``gm.recompile()``.
    """

    NONE = 0
    DCE = 1
    PRUNE_PARAMS = 2
    LINT = 4
    RECOMPILE = 8
    TIDY = LINT | RECOMPILE  # every graph edit
    PRUNE = DCE | PRUNE_PARAMS | LINT | RECOMPILE  # a lowering that drops the weights it replaced


def run_cleanup(qg: QGraph, flags: Cleanup) -> dict[str, Any]:
    """Apply ``flags`` to ``qg`` (see :class:`Cleanup`). Returns the facts cleanup adds to a pass's
    ``details`` (``{"removed_params": n}`` for ``PRUNE_PARAMS``, else empty)."""
    if Cleanup.PRUNE_PARAMS in flags:
        return {"removed_params": len(qg.prune())}
    g = qg.gm.graph
    if Cleanup.DCE in flags:
        g.eliminate_dead_code()
    if Cleanup.LINT in flags:
        g.lint()
    if Cleanup.RECOMPILE in flags:
        qg.gm.recompile()
    return {}


@dataclasses.dataclass
class Rewrites:
    """What one run of a pass did, as the pass reports it (:meth:`Pass.run` returns one).

    Attributes:
        rewritten: ids of the sites rewritten, in order (a site once even if it has several nodes).
        skipped: ``(site, reason)`` for targeted sites left alone.
        details: pass-specific facts (e.g. groups formed), JSON-serialisable values.
    """

    rewritten: list[str] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def rewrote(self, site: str) -> None:
        """Record ``site`` as rewritten."""
        self.rewritten.append(site)

    def skip(self, site: str, reason: str) -> None:
        """Record ``site`` as targeted but left alone, with the reason."""
        self.skipped.append((site, reason))


@dataclasses.dataclass(frozen=True)
class PassResult:
    """What one pass did, built by the manager (frozen: assigning a field raises
    ``dataclasses.FrozenInstanceError``; ``details`` is a read-only mapping).

    Attributes:
        name: pass name. side: ``learner`` / ``rollout``.
        matches: number of sites rewritten (what ``expect_matches`` is compared with).
        skipped: ``(site, reason)`` for targeted sites left alone.
        changed: whether the graph changed (a site was rewritten).
        elapsed_s: wall time of the pass and its cleanup.
        sites: ids of the sites rewritten.
        details: pass-specific facts (e.g. groups formed, parameters removed by cleanup).
        line: recipe line of the pass, when known.
    """

    name: str
    side: str
    matches: int = 0
    skipped: tuple[tuple[str, str], ...] = ()
    changed: bool = False
    elapsed_s: float = 0.0
    sites: tuple[str, ...] = ()
    details: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    line: int | None = None

    @classmethod
    def of(cls, p: "Pass", side: str, rec: Rewrites, *, elapsed_s: float, cleanup_facts: Mapping[str, Any]) -> "PassResult":
        """The frozen result of pass ``p`` from what it reported and what its cleanup found."""
        sites = tuple(rec.rewritten)
        return cls(name=p.name, side=side, matches=len(sites), skipped=tuple((str(s), str(r)) for s, r in rec.skipped),
                   changed=bool(sites), elapsed_s=elapsed_s, sites=sites,
                   details=MappingProxyType({**cleanup_facts, **rec.details}), line=p.line)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "side": self.side, "matches": self.matches, "changed": self.changed,
            "elapsed_s": round(self.elapsed_s, 4), "skipped": [list(s) for s in self.skipped],
            "details": dict(self.details), "line": self.line,
        }

    def history_entry(self) -> dict[str, Any]:
        """The entry kept on ``gm.meta[HISTORY_KEY]``: JSON-serialisable and free of timings (so a
        graph built twice carries the same history).

        Keys: ``pass`` (name), ``side``, ``line`` (recipe line or None), ``matched`` (sites
        rewritten, the count ``expect_matches`` checks), ``rewritten`` (their ids), ``skipped``
        (``[site, reason]`` pairs).
        """
        return {"pass": self.name, "side": self.side, "line": self.line, "matched": self.matches,
                "rewritten": list(self.sites), "skipped": [list(s) for s in self.skipped]}


def pass_history(gm: torch.fx.GraphModule) -> list[dict[str, Any]]:
    """The pass history a graph module carries (``gm.meta[HISTORY_KEY]``; empty if no pass ran)."""
    return list(getattr(gm, "meta", {}).get(HISTORY_KEY, []))


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
    mutation: ClassVar[Mutation] = "in_place"
    cleanup: ClassVar[Cleanup] = Cleanup.TIDY

    def __init__(self, options: PassOptions | dict[str, Any] | None = None, *, line: int | None = None) -> None:
        if isinstance(options, PassOptions):
            self.options = options
        else:
            self.options = self.Options(**(options or {}))
        self.line = line

    def run(self, qg: QGraph, ctx: PassContext) -> Rewrites:  # pragma: no cover - abstract
        """Rewrite (or, for ``mutation = "analysis"``, only read) ``qg``; report sites rewritten and skipped."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"pass": self.name, **self.options.model_dump(), **({"line": self.line} if self.line else {})}


PASSES: dict[str, type[Pass]] = {}


def check_declarations(cls: type[Pass]) -> None:
    """A pass's declared lifecycle is one the manager can honour.

    Raises:
        ValueError: no name; ``mutation`` not one of :data:`MUTATIONS`; ``cleanup`` not a
            :class:`Cleanup`; ``PRUNE_PARAMS`` without the rest of ``PRUNE``; an analysis pass
            that declares cleanup (cleanup edits the graph).
    """
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.mutation not in MUTATIONS:
        raise ValueError(f"pass {cls.name!r}: mutation must be one of {list(MUTATIONS)}, got {cls.mutation!r}")
    if not isinstance(cls.cleanup, Cleanup):
        raise ValueError(f"pass {cls.name!r}: cleanup must be a qpass.compiler.manager.Cleanup, got {cls.cleanup!r}")
    if Cleanup.PRUNE_PARAMS in cls.cleanup and cls.cleanup & Cleanup.PRUNE != Cleanup.PRUNE:
        raise ValueError(f"pass {cls.name!r}: PRUNE_PARAMS also eliminates dead code, lints and recompiles; declare Cleanup.PRUNE")
    if cls.mutation == "analysis" and cls.cleanup != Cleanup.NONE:
        raise ValueError(f"pass {cls.name!r}: an analysis pass declares no cleanup (cleanup edits the graph), got {cls.cleanup}")


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator: make a pass available to recipes under ``cls.name``.

    Raises:
        ValueError: the declarations are invalid (:func:`check_declarations`), or the name is
            taken by another class.
    """
    check_declarations(cls)
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
            check_declarations(type(p))
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
        before = _fingerprint(qg) if p.mutation == "analysis" else None
        t0 = time.perf_counter()
        rec = p.run(qg, ctx)
        if not isinstance(rec, Rewrites):
            raise PassError(f"{_where(p)} returned {type(rec).__name__}; a pass returns qpass.compiler.manager.Rewrites")
        if before is not None:
            changed = _what_changed(before, _fingerprint(qg))
            if changed:
                raise PassError(f"{_where(p)} declares mutation 'analysis' but changed the {qg.side} graph ({changed})")
        facts = run_cleanup(qg, p.cleanup)
        res = PassResult.of(p, qg.side, rec, elapsed_s=time.perf_counter() - t0, cleanup_facts=facts)
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
        qg.gm.meta.setdefault(HISTORY_KEY, []).append(res.history_entry())
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


def _fingerprint(qg: QGraph) -> tuple[Any, ...]:
    """What an analysis pass must leave unchanged: the graph's nodes (text), the module's
    parameters and buffers (names and tensor objects) and the graph's site records."""
    gm = qg.gm
    return (str(gm.graph),
            tuple((k, id(v)) for k, v in gm.named_parameters(remove_duplicate=False)),
            tuple((k, id(v)) for k, v in gm.named_buffers(remove_duplicate=False)),
            tuple((k, id(v)) for k, v in qg.quant.items()))


def _what_changed(before: tuple[Any, ...], after: tuple[Any, ...]) -> str:
    parts = ("graph nodes", "parameters", "buffers", "site quantization records")
    return ", ".join(name for name, a, b in zip(parts, before, after) if a != b)
