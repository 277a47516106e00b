"""The pass lifecycle the manager owns (qpass.compiler.manager): frozen results, declared mutation
mode, declared cleanup, history on ``gm.meta``, and the declarations refused at registration."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from qpass.compiler.manager import (
    HISTORY_KEY,
    Cleanup,
    Pass,
    PassContext,
    PassManager,
    PassOptions,
    PassResult,
    Rewrites,
    check_declarations,
    pass_history,
    register_pass,
)
from qpass.compiler.recipe import load_recipe
from qpass.errors import NoMatchError, PassError

SITE = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def quads(tiny_pipeline):
    return tiny_pipeline.build(load_recipe("quads_nvfp4"))


def _learner(tiny_pipeline):
    return tiny_pipeline.base_scoring.clone("learner")


def _add_dead_relu(qg) -> torch.fx.Node:
    """Insert an ``aten.relu`` nobody reads after the first linear node (a dead node)."""
    g = qg.gm.graph
    lin = qg.linear_nodes()[0]
    with g.inserting_after(lin):
        return g.call_function(torch.ops.aten.relu.default, (lin,))


# ----------------------------------------------------------------------------- frozen result


def test_result_is_frozen(quads):
    _, rollout = quads
    res = rollout.history[0]
    assert isinstance(res, PassResult) and res.name == "w4a4_lower"
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.matches = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.sites = ()
    with pytest.raises(TypeError):  # a read-only mapping
        res.details["removed_params"] = 0
    assert res.matches == 14 and len(res.sites) == 14 and isinstance(res.sites, tuple) and isinstance(res.skipped, tuple)


# ----------------------------------------------------------------------------- history on gm.meta


def test_history_on_gm_meta_matches_the_passes_run(quads, tiny_pipeline):
    learner, rollout = quads
    got = [(h["pass"], h["side"], h["line"], h["matched"], len(h["rewritten"]), h["skipped"]) for h in rollout.gm.meta[HISTORY_KEY]]
    assert got == [("w4a4_lower", "rollout", 9, 14, 14, []), ("residual_compensation", "rollout", 11, 4, 4, [])]
    assert [(h["pass"], h["line"], h["matched"]) for h in pass_history(learner.gm)] == [("weight_qdq", 7, 14)]
    for qg in (learner, rollout):
        assert qg.gm.meta[HISTORY_KEY] == [r.history_entry() for r in qg.history]
        assert json.loads(json.dumps(qg.gm.meta[HISTORY_KEY])) == qg.gm.meta[HISTORY_KEY]  # JSON as it is
    rac = rollout.gm.meta[HISTORY_KEY][1]
    assert sorted(rac["rewritten"]) == sorted(f"model.layers.{i}.mlp.{p}_proj" for i in (0, 1) for p in ("gate", "up"))
    assert set(rac) == {"pass", "side", "line", "matched", "rewritten", "skipped"}  # no timings: a rebuild carries the same
    # the base graphs the builds were cloned from carry none; a copy of a built graph carries it
    assert pass_history(tiny_pipeline.base_step.gm) == [] and pass_history(tiny_pipeline.base_scoring.gm) == []
    assert rollout.clone("rollout").gm.meta[HISTORY_KEY] == rollout.gm.meta[HISTORY_KEY]


def test_history_is_the_same_on_a_rebuild(quads, tiny_pipeline):
    _, rollout = quads
    again = tiny_pipeline.build_side(load_recipe("quads_nvfp4"), "rollout")
    assert again.gm.meta[HISTORY_KEY] == rollout.gm.meta[HISTORY_KEY]


# ----------------------------------------------------------------------------- mutation mode


class _CountLinears(Pass):
    """A well-behaved analysis pass: reads the graph, reports every targeted site it saw."""

    name = "count_linears"
    sides = ("learner",)
    mutation = "analysis"
    cleanup = Cleanup.NONE

    def run(self, qg, ctx):
        return Rewrites(rewritten=sorted({n.meta["qpass_linear_site"] for n in qg.linear_nodes()}))


class _SneakyAnalysis(_CountLinears):
    """Declares analysis, edits the graph."""

    name = "sneaky_analysis"

    def run(self, qg, ctx):
        _add_dead_relu(qg)
        return super().run(qg, ctx)


class _BufferAnalysis(_CountLinears):
    """Declares analysis, adds a buffer."""

    name = "buffer_analysis"

    def run(self, qg, ctx):
        qg.gm.register_buffer("qpass_sneaky", torch.zeros(1))
        return super().run(qg, ctx)


def test_analysis_pass_leaves_the_graph_alone(tiny_pipeline):
    qg = _learner(tiny_pipeline)
    code = qg.gm.code
    (res,) = PassManager([_CountLinears()], side="learner").run(qg)
    assert qg.gm.code == code and res.matches == 2 * 7 + 1 and res.changed is True  # 7 per layer + lm_head
    assert res.sites == tuple(sorted(qg.sites))
    assert pass_history(qg.gm) == [res.history_entry()] and pass_history(qg.gm)[0]["pass"] == "count_linears"


@pytest.mark.parametrize(("cls", "what"), [(_SneakyAnalysis, "graph nodes"), (_BufferAnalysis, "buffers")])
def test_analysis_pass_that_mutates_fails_naming_it(tiny_pipeline, tmp_path, cls, what):
    qg = _learner(tiny_pipeline)
    with pytest.raises(PassError) as ei:
        PassManager([cls()], side="learner").run(qg, PassContext(reproducer_dir=tmp_path))
    assert str(ei.value).startswith(
        f"pass {cls.name!r} declares mutation 'analysis' but changed the learner graph ({what}) [reproducer: ")
    assert qg.history == [] and pass_history(qg.gm) == []  # a failed pass leaves no history


# ----------------------------------------------------------------------------- cleanup flags


def _dead_node_pass(flags: Cleanup) -> Pass:
    class DeadNode(Pass):
        name = "dead_node"
        sides = ("learner",)
        cleanup = flags

        def run(self, qg, ctx):
            self.node_name = _add_dead_relu(qg).name
            return Rewrites(rewritten=[SITE])

    return DeadNode()


@pytest.mark.parametrize(("flags", "in_graph", "in_code"), [
    (Cleanup.NONE, True, False),  # left in the graph, code not regenerated
    (Cleanup.TIDY, True, True),  # lint + recompile: the dead node is in the generated code
    (Cleanup.DCE | Cleanup.LINT | Cleanup.RECOMPILE, False, False),  # eliminated
])
def test_cleanup_flags_are_honoured(tiny_pipeline, flags, in_graph, in_code):
    qg = _learner(tiny_pipeline)
    p = _dead_node_pass(flags)
    (res,) = PassManager([p], side="learner").run(qg)
    assert (p.node_name in {n.name for n in qg.gm.graph.nodes}) is in_graph
    assert (f"{p.node_name} = " in qg.gm.code) is in_code
    assert dict(res.details) == {}


def test_prune_cleanup_drops_the_replaced_weights(quads, tiny_pipeline):
    _, rollout = quads
    lowered = rollout.history[0]
    assert dict(lowered.details) == {"removed_params": 14, "flushed_blocks": {}}  # cleanup's fact first, as before
    n_base = sum(1 for _ in tiny_pipeline.base_step.gm.named_parameters())
    assert n_base - sum(1 for _ in rollout.gm.named_parameters()) == 14


# ----------------------------------------------------------------------------- no match, wrong return, declarations


def test_pass_that_rewrites_nothing_fails_before_its_history_is_kept(tiny_pipeline, tmp_path):
    class Nothing(Pass):
        name = "nothing"
        sides = ("learner",)

        def run(self, qg, ctx):
            return Rewrites(skipped=[(SITE, "not today")])

    qg = _learner(tiny_pipeline)
    with pytest.raises(NoMatchError, match=rf"pass 'nothing' matched 0 site\(s\), expected at least 1 \({SITE}: not today\)"):
        PassManager([Nothing()], side="learner").run(qg, PassContext(reproducer_dir=tmp_path))
    assert qg.history == [] and pass_history(qg.gm) == []


def test_pass_must_return_rewrites(tiny_pipeline, tmp_path):
    class Legacy(Pass):
        name = "legacy"
        sides = ("learner",)

        def run(self, qg, ctx):
            return PassResult(self.name, qg.side, matches=1)

    with pytest.raises(PassError, match=r"pass 'legacy' returned PassResult; a pass returns qpass.compiler.manager.Rewrites"):
        PassManager([Legacy()], side="learner").run(_learner(tiny_pipeline), PassContext(reproducer_dir=tmp_path))


@pytest.mark.parametrize(("attrs", "msg"), [
    ({"mutation": "sometimes"}, r"mutation must be one of \['in_place', 'analysis'\], got 'sometimes'"),
    ({"cleanup": "lint"}, r"cleanup must be a qpass.compiler.manager.Cleanup, got 'lint'"),
    ({"cleanup": Cleanup.PRUNE_PARAMS}, r"PRUNE_PARAMS also eliminates dead code, lints and recompiles; declare Cleanup.PRUNE"),
    ({"mutation": "analysis", "cleanup": Cleanup.TIDY}, r"an analysis pass declares no cleanup"),
])
def test_bad_declarations_are_refused_at_registration(attrs, msg):
    cls = type("Bad", (Pass,), {"name": "bad_declarations", "Options": PassOptions, **attrs})
    with pytest.raises(ValueError, match=r"pass 'bad_declarations': " + msg):
        register_pass(cls)
    with pytest.raises(ValueError, match=msg):
        check_declarations(cls)


def test_builtin_passes_declare_their_lifecycle():
    from qpass.compiler.manager import PASSES
    import qpass.compiler.passes  # noqa: F401

    got = {name: (cls.mutation, cls.cleanup) for name, cls in PASSES.items() if cls.__module__.startswith("qpass.compiler.passes.")}
    tidy, prune = ("in_place", Cleanup.TIDY), ("in_place", Cleanup.PRUNE)
    assert got == {"weight_qdq": tidy, "act_qdq": tidy, "fp32_accumulate_linear": tidy, "residual_compensation": tidy,
                   "w4a4_lower": prune, "w4a16_lower": prune, "fp8_lower": prune, "mxfp4_lower": prune}
    # each pass lives in the file named after its recipe word
    assert {name: cls.__module__.rpartition(".")[2] for name, cls in PASSES.items() if name in got} == {n: n for n in got}
