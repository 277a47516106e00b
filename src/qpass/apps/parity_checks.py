"""The parity checks ``qpass apply`` and ``qpass check`` both run: one registry, keyed by recipe check name.

A recipe's ``parity:`` list names checks (``- check: structural``); each name is registered here
with :func:`register_check` next to its ``run(context) -> CheckResult``. ``apply`` runs the checks
its recipe lists; ``check`` runs the same entries on rebuilt graphs that carry the saved bytes. A
check returns a frozen :class:`CheckResult`: a verdict (``True``/``False``, or ``None`` for
"measured, not gated"), a one-line detail, the problems it found (each naming a site or tensor) and
the report fields it owns (``report.json["parity"]``).

Registered: ``structural`` (site pairing, specs, groups, dataflow), ``weights_bitexact`` (learner QDQ
vs rollout codes/scales/``S_dec`` per fused group) and ``logprob_gap`` (behavioural: sample from the
rollout, score with the learner, next to the BF16 engine-drift floor; needs a
:class:`BehaviorProbe` in the context; on an MoE model also with routing replay and the per-layer
routing mismatch, ``logprob_gap.routing_replay`` / ``logprob_gap.routing_mismatch``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

from qpass.errors import QpassError
from qpass.progress import phase

__all__ = ["PARITY_CHECKS", "BehaviorProbe", "CheckContext", "CheckResult", "ParityCheck", "register_check", "run_checks"]


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """What one parity check found.

    Attributes:
        name: the registry / recipe name (``structural``, ``weights_bitexact``, ``logprob_gap``).
        ok: True pass, False fail (exit status 1), None measured but not gated.
        detail: one line for the console and ``report.json["parity"]["checks"]``.
        problems: one message per failure, each naming the site, group or tensor.
        fields: the ``report.json["parity"]`` entries this check owns.
        data: in-memory results later stages use (e.g. the sampled batches of ``logprob_gap``).
    """

    name: str
    ok: bool | None
    detail: str
    problems: tuple[str, ...] = ()
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    data: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def row(self) -> dict[str, Any]:
        """The entry of ``report.json["parity"]["checks"]``."""
        return {"check": self.name, "ok": self.ok, "detail": self.detail}


@dataclasses.dataclass(frozen=True)
class BehaviorProbe:
    """Inputs of the behavioural check: encoded prompts, sampling options, the base graphs for the floor.

    Attributes:
        prompts: token id lists (chat-encoded probe prompts).
        sampling: keyword arguments of :func:`qpass.parity.behavior.logprob_gap` (pad/eos ids,
            max_new_tokens, samples_per_prompt, temperature, top_p, seed).
        max_abs_gap: the recipe's gate on mean |d| (None: not gated).
        floor: (scoring, step) base graphs for the BF16 engine-drift floor, or None to skip it.
        floor_engine: optional factory of a context manager yielding the floor's rollout engine
            (a BF16 vLLM engine): then the floor pairs ``floor[0]`` (the BF16 learner) with it,
            a real engine drift instead of the step graph's.
    """

    prompts: list[list[int]]
    sampling: dict[str, Any]
    max_abs_gap: float | None = None
    floor: tuple[Any, Any] | None = None
    floor_engine: Callable[[], contextlib.AbstractContextManager] | None = None


@dataclasses.dataclass
class CheckContext:
    """What a check reads: the recipe, both graphs, timings to fill, the probe, and
    optionally a live rollout engine (``--rollout-engine vllm``) that samples instead of the rollout
    graph and whose served bytes the bit-level check also compares (``release_engine`` stops it once the
    behavioural check has sampled, before a floor engine starts)."""

    recipe: Any
    learner: Any
    rollout: Any
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    probe: BehaviorProbe | None = None
    engine: Any = None
    release_engine: Callable[[], None] | None = None


@dataclasses.dataclass(frozen=True)
class ParityCheck:
    """A registry entry: the recipe name, the function, and whether it samples (slow)."""

    name: str
    run: Callable[[CheckContext], CheckResult]
    behavioral: bool = False


PARITY_CHECKS: dict[str, ParityCheck] = {}


def register_check(name: str, *, behavioral: bool = False) -> Callable[[Callable[[CheckContext], CheckResult]], Callable]:
    """Decorator: register ``run(context) -> CheckResult`` under the recipe check name ``name``.

    Raises:
        ValueError: ``name`` is registered already.
    """

    def deco(fn: Callable[[CheckContext], CheckResult]) -> Callable[[CheckContext], CheckResult]:
        if name in PARITY_CHECKS:
            raise ValueError(f"parity check {name!r} is registered twice")
        PARITY_CHECKS[name] = ParityCheck(name, fn, behavioral)
        return fn

    return deco


def run_checks(ctx: CheckContext, names: list[str]) -> Iterator[CheckResult]:
    """Run the named checks in registry order (yielded one by one, so a caller can print as they finish).

    Raises:
        QpassError: a name has no registered check.
    """
    unknown = [n for n in names if n not in PARITY_CHECKS]
    if unknown:
        raise QpassError(f"no parity check registered for {unknown}; known: {sorted(PARITY_CHECKS)}")
    for name, chk in PARITY_CHECKS.items():
        if name in names:
            yield chk.run(ctx)


@register_check("structural")
def structural(ctx: CheckContext) -> CheckResult:
    from qpass.parity.checker import check_structural

    with phase("structural parity check"):
        s = check_structural(ctx.learner, ctx.rollout)
    return CheckResult("structural", s.ok, f"{s.matched}/{s.rollout_quantized} sites matched", tuple(s.problems),
                       {"structural_ok": s.ok})


@register_check("weights_bitexact")
def weights_bitexact(ctx: CheckContext) -> CheckResult:
    from qpass.parity.checker import check_weights_bitexact

    t0 = time.perf_counter()
    b = check_weights_bitexact(ctx.learner, ctx.rollout)  # a phase of its own, one unit per fused group
    ctx.timings["bitexact_s"] = time.perf_counter() - t0
    fields = {"weights_bitexact": b.ok, "mismatched_groups": b.mismatched_groups,
              "mismatch_detail": [g.to_json() for g in b.groups if not g.ok]}
    problems, detail, ok = list(b.failures()), f"{len(b.groups)} groups compared", b.ok
    if ctx.engine is not None:
        from qpass.parity.served import check_served_weights
        from qpass.runtime.graph_engine import graph_weights

        with phase(f"bit-level check of the bytes the {ctx.engine.name} engine serves"):
            t0 = time.perf_counter()
            e = check_served_weights(graph_weights(ctx.learner), ctx.engine.served_weights())
            ctx.timings["engine_bitexact_s"] = time.perf_counter() - t0
        ok = ok and e.ok
        problems += [f"{ctx.engine.name} engine: {m}" for m in e.mismatches]
        detail += f"; {e.checked} sites read back from the {ctx.engine.name} engine" + ("" if e.ok else f", {len(e.mismatches)} differ")
        fields |= {"weights_bitexact": ok, "engine_weights": {"engine": ctx.engine.name, "ok": e.ok, "checked": e.checked,
                                                              "skipped": e.skipped, "mismatches": list(e.mismatches[:20]),
                                                              **({"unquantized": e.unquantized} if e.unquantized else {})}}
    return CheckResult("weights_bitexact", ok, detail, tuple(problems), fields)


def _is_moe(graph: Any) -> bool:
    from qpass.moe.routing import has_routing

    gm = getattr(graph, "gm", None)
    return gm is not None and has_routing(gm)


@register_check("logprob_gap", behavioral=True)
def logprob_gap(ctx: CheckContext) -> CheckResult:
    from qpass.parity import behavior

    p = ctx.probe
    if p is None:
        raise QpassError("the logprob_gap check needs a behaviour probe (prompts and sampling options)")
    rows = len(p.prompts) * p.sampling.get("samples_per_prompt", 1)
    who = f"the {ctx.engine.name} engine" if ctx.engine is not None else "the rollout graph"
    t0 = time.perf_counter()
    gap = behavior.logprob_gap(ctx.learner, ctx.engine if ctx.engine is not None else ctx.rollout, p.prompts,
                               routing=_is_moe(ctx.rollout) and ctx.engine is None,
                               progress=f"log-prob gap: sample {rows} responses from {who}, score with the learner", **p.sampling)
    ctx.timings["logprob_gap_s"] = time.perf_counter() - t0
    floor = None
    if ctx.release_engine is not None:
        ctx.release_engine()
    if p.floor is not None and p.floor_engine is not None:
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            with phase("BF16 engine-drift floor: start the BF16 engine"):
                fe = stack.enter_context(p.floor_engine())
            floor = behavior.logprob_gap(p.floor[0], fe, p.prompts, progress="BF16 engine-drift floor (BF16 engine vs BF16 learner)",
                                         **p.sampling)
        ctx.timings["floor_s"] = time.perf_counter() - t0
    elif p.floor is not None:
        t0 = time.perf_counter()
        floor = behavior.logprob_gap(p.floor[0], p.floor[1], p.prompts, progress="BF16 engine-drift floor (base graphs)",
                                     **p.sampling)
        ctx.timings["floor_s"] = time.perf_counter() - t0
    g = gap.metrics.token.g_abs
    ok, problems = None, ()
    detail = f"mean |d| {g:.4f} (not gated: the recipe sets no max_abs_gap)"
    if p.max_abs_gap is not None:
        ok = g <= p.max_abs_gap
        detail = f"mean |d| {g:.4f} (limit {p.max_abs_gap})"
        if not ok:
            problems = (f"log-prob gap {g:.4f} exceeds max_abs_gap {p.max_abs_gap}",)
    return CheckResult("logprob_gap", ok, detail, problems,
                       {"logprob_gap": gap.summary(), "floor_logprob_gap": floor.summary() if floor else None},
                       {"gap": gap, "floor": floor})
