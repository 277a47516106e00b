"""``qpass study`` and ``TorchRollout.replay``.

* replay of the tokens ``generate`` sampled reproduces generate's ``logq`` (and response mask) bit
  for bit: on the default model (BF16 and W4A4 rollouts) and on the tiny random Llama with many
  EOS ids, temperature and top-p (rows ending early, truncated sampling distribution);
* a quick study on the default model: files exist, the JSON has every configuration, and the exact
  relations hold (zero-channel RAC == plain W4A4 bit for bit in all four mode x selection combos,
  k = 100% selects all channels and gives one log q for all four combos, BF16 replay == sampled).

The default model is loaded once per run (the session fixture of ``conftest.py``; slow tier) and the
module runs torch with one thread: on a CPU shared with other jobs, OpenMP oversubscription makes
two threads ~10x slower.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from qpass.runtime import TorchRollout
from qpass.errors import QpassError
from qpass.prompts import encode_chat, probe_prompts
from tests.test_grpo import _one_thread  # noqa: F401 - autouse: 1 torch thread


@pytest.fixture(scope="module")
def pipe(default_pipeline):
    """The default model captured with a 4-row static batch (the session's shared pipeline)."""
    return default_pipeline


def _rows(b) -> list[list[int]]:
    return [b.responses[i][b.response_mask[i]].tolist() for i in range(b.input_ids.shape[0])]


def _assert_replay_equals_generate(qg, prompts, pad, eos, **kw):
    ro = TorchRollout(qg, pad_token_id=pad, eos_token_id=eos)
    b = ro.generate(prompts, **kw)
    full = list(prompts) + [prompts[-1]] * (ro.batch_size - len(prompts))  # the static batch generate ran
    logq, mask = ro.replay(full, _rows(b), temperature=kw.get("temperature", 1.0), top_p=kw.get("top_p", 1.0))
    assert logq.dtype == torch.float32 and mask.dtype == torch.bool
    assert torch.equal(mask, b.response_mask.cpu())
    assert torch.equal(logq.view(torch.int32), b.logq.cpu().view(torch.int32))  # bit for bit, -0.0 included
    return b


@pytest.mark.slow
def test_replay_equals_generate_default_model(pipe):
    from qpass.apps.study.configs import ROLLOUTS, study_recipe
    from qpass.apps.study.run import build_config

    tok = pipe.tokenizer
    prompts = encode_chat(tok, probe_prompts(3))  # 3 real rows + 1 filler row in the static batch of 4
    bf16 = build_config(pipe, "rollout", study_recipe(ROLLOUTS["bf16"]))
    b = _assert_replay_equals_generate(bf16, prompts, tok.pad_token_id, tok.eos_token_id, max_new_tokens=4, seed=3)
    assert int(b.response_mask.sum()) > 0
    w4a4 = build_config(pipe, "rollout", study_recipe(ROLLOUTS["w4a4"], layers=1))
    _assert_replay_equals_generate(w4a4, prompts, tok.pad_token_id, tok.eos_token_id, max_new_tokens=4, seed=3)


def test_replay_equals_generate_early_eos_top_p(tiny_pipeline):
    from qpass.recipe import load_recipe

    _, rollout = tiny_pipeline.build(load_recipe("quads_nvfp4"))
    prompts = [[5, 6, 9, 10, 11], [12, 13], [20, 21, 22, 23], [30]]
    eos = list(range(1, 40))  # ~15% of the vocabulary ends a row: rows stop at different steps
    b = _assert_replay_equals_generate(rollout, prompts, 0, eos, max_new_tokens=12, seed=1, temperature=0.7, top_p=0.9)
    lengths = b.response_mask.sum(1).tolist()
    assert len(set(lengths)) > 1 and min(lengths) < 12  # early stops actually happened


def test_replay_rejects_bad_input(tiny_pipeline):
    ro = TorchRollout(tiny_pipeline.base_step, pad_token_id=0, eos_token_id=1)
    with pytest.raises(QpassError, match="one response per prompt"):
        ro.replay([[5, 6]], [[7], [8]])
    with pytest.raises(QpassError, match="only empty responses"):
        ro.replay([[5, 6]], [[]])
    with pytest.raises(QpassError, match="exceeds the KV cache"):
        ro.replay([[5, 6]], [list(range(2, 40))])


@pytest.mark.slow
def test_study_quick(pipe, tmp_path):
    from qpass.apps.study import QUICK_RATIOS, build_parser, config_from_args, run_study, write_outputs

    out = tmp_path / "study"
    cfg = config_from_args(build_parser().parse_args(["--quick", "--out", str(out), "--no-progress"]))
    assert cfg.ratios == QUICK_RATIOS and cfg.layers == 1 and cfg.prompts == 2 and cfg.max_new_tokens == 3
    res = run_study(cfg, pipe=pipe)
    write_outputs(res, out)
    for f in ("study.json", "study.md", "gap_vs_k.png", "layerwise.png", "operand_ablation.png", "gaps.safetensors",
              "provenance.json", "kernel_tiles.json"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    data = json.loads((out / "study.json").read_text())

    # every configuration is present and measured
    combos = [f"{m}_{s}" for m in ("masked", "gathered") for s in ("batch", "token")]
    rollouts = {"bf16", "bf16_fp32acc", "w4a16", "w16a4", "w4a4", "w16a4_pt", "w4a4_pt"} | {f"rac_k{k}_{c}" for k in (50, 100) for c in combos} \
        | {"rac_zero_channels_masked_batch", "rac_zero_channels_gathered_token"}
    assert set(data["rollouts"]) == rollouts
    assert set(data["learners"]) == {"bf16", "w_qdq", "a_qdq", "wa_qdq", "a_qdq_pt", "wa_qdq_pt"}
    pairs = {"floor", "floor_kernel", "op_w4a16", "op_w16a4", "op_w4a4", "qdq_w4a16_wqdq", "qdq_w16a4_aqdq", "quads_k0",
             "sym_w4a4_waqdq", "rac_k0", "quads_ref", "op_w16a4_pt", "qdq_w16a4_aqdq_pt", "quads_k0_pt",
             "sym_w4a4_waqdq_pt"} | {f"rac_k{k}_{c}" for k in (50, 100) for c in combos}
    assert set(data["pairs"]) == pairs
    for k, p in data["pairs"].items():
        assert p["replay"]["tokens"] == data["sampled"]["tokens"] > 0, k
        assert p["replay"]["mean_abs"] >= 0 and p["replay"]["max_abs"] >= p["replay"]["mean_abs"], k
    for k in ("floor", "op_w4a16", "op_w16a4", "op_w4a4"):
        assert data["pairs"][k]["on_policy"]["tokens"] > 0
    # learner-side QDQ on-policy: the weight-QDQ learner scores the very tokens the W4A16 / W4A4 rollouts sampled
    for k, op in (("qdq_w4a16_wqdq", "op_w4a16"), ("quads_k0", "op_w4a4")):
        assert data["pairs"][k]["on_policy"]["tokens"] == data["pairs"][op]["on_policy"]["tokens"] > 0
        assert data["pairs"][k]["on_policy"]["mean_abs"] != data["pairs"][op]["on_policy"]["mean_abs"]
    assert [p["k"] for p in data["rac"]["sweep"]["masked/batch"]] == [0.0, 0.5, 1.0]
    assert set(data["layerwise"]["summary"]) == {"decode"}  # the degenerate prefill reading is not reported
    assert (out / "gaps.safetensors").is_file() and (out / "provenance.json").is_file()
    assert len(data["layerwise"]["per_site"]["decode"]["asym"]) == len(pipe.base_step.sites)
    assert [c["id"] for c in data["claims"]] == ["C1", "C2a", "C2b", "C3", "C4", "C5"]
    assert all(c["quick"] is True and c["verdict"] == "quick run: not evidence" and c["toy_outcome"]
               for c in data["claims"])  # a toy run is no evidence for or against a claim

    # exact relations
    inv = data["invariants"]
    assert inv["bf16_replay_equals_sampled_logq"] is True
    assert inv["replay_masks_equal_sampled"] is True
    assert inv["rac_zero_channels_logq_equals_w4a4"] == {"rac_zero_channels_masked_batch": True,
                                                         "rac_zero_channels_gathered_token": True}
    assert inv["rac_k100_logq_equal_across_mode_selection"] is True
    assert all(inv[f"k100_{c}_selects_all_channels"] for c in combos)
    assert inv["k100_compensation_equal_across_mode_selection"] is True
    assert inv["floor_on_policy_equals_replay"] is True
    sweep = data["rac"]["sweep"]
    assert len({json.dumps(sweep[c][0], sort_keys=True) for c in sweep}) == 1  # k = 0 is one configuration
    assert sweep["masked/batch"][0]["mean_abs"] == data["pairs"]["quads_k0"]["replay"]["mean_abs"]
    k100 = {sweep[c][2]["mean_abs"] for c in sweep}
    assert len(k100) == 1  # k = 100%: all four combos compute the same log q
    # RAC FLOPs: masked pays a full second GEMM, gathered K' = ceil16(k) columns (288 of 576 at 50%)
    cost = data["rac"]["cost"]["configs"]
    assert cost["k50_masked_batch"]["extra_vs_rac_sites"] == 1.0
    assert cost["k50_gathered_batch"]["k_prime"] == 288 and cost["k50_gathered_batch"]["extra_vs_rac_sites"] == 0.5
    assert cost["k50_gathered_token"]["reference_extra_flops_per_token"] == cost["k50_masked_token"]["extra_flops_per_token"]
    assert data["rac"]["timing"]["available"] is False  # CPU: FLOPs only
    md = (out / "study.md").read_text()
    for claim in ("C1", "C2a", "C2b", "C3", "C4", "C5"):
        assert f"| {claim}: " in md
    claims_md = md.split("## 7. Paper claims")[1]
    assert "verdicts are not evidence" in claims_md
    assert claims_md.count("**quick run: not evidence** (toy outcome: ") == 6


# ------------------------------------------------------------------ configurations as recipes
# The configurations the study built as Python dicts before it used recipes (pass entries per
# name, quick run: decoder layer 0 only): the recipes must give exactly these pass lists.
_L0 = [r"re:model\.layers\.(0)\..*"]
_RAC_L0 = [r"re:model\.layers\.(0)\.mlp\.(gate_proj|up_proj)"]
_OLD_LEARNERS = {"bf16": [], "w_qdq": [("weight_qdq", {})], "a_qdq": [("act_qdq", {})],
                 "wa_qdq": [("weight_qdq", {}), ("act_qdq", {})],
                 # per-token controls (issue 13), not former configurations
                 "a_qdq_pt": [("act_qdq", {"per_token": True})],
                 "wa_qdq_pt": [("weight_qdq", {}), ("act_qdq", {"per_token": True})]}
_OLD_ROLLOUTS = {"bf16": [], "w4a16": [("w4a16_lower", {})], "w16a4": [("act_qdq", {})],
                 "w4a4": [("w4a4_lower", {"act": "nvfp4"})], "bf16_fp32acc": [("fp32_accumulate_linear", {})],
                 "w16a4_pt": [("act_qdq", {"per_token": True})], "w4a4_pt": [("w4a4_lower", {"act": "nvfp4_per_token"})]}


def _entries(passes) -> list[tuple[str, dict]]:
    """``(pass, every option value)`` of built passes."""
    return [(p.name, p.options.model_dump()) for p in passes]


def _expected(entries: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """``(pass, every option value)`` of recipe-style entries (defaults filled in by the pass)."""
    from qpass.pm import get_pass

    return [(n, get_pass(n).Options(**o).model_dump()) for n, o in entries]


@pytest.mark.parametrize("layers", [None, 1])
def test_study_configurations_are_the_former_pass_lists(layers):
    from qpass.apps.study.configs import LEARNERS, ROLLOUTS, study_recipe

    def restrict(entries):
        return _expected([(n, {**o, "targets": _L0}) if layers else (n, o) for n, o in entries])

    assert set(LEARNERS) == set(_OLD_LEARNERS) and set(ROLLOUTS) == set(_OLD_ROLLOUTS)
    for name, ref in LEARNERS.items():
        assert _entries(study_recipe(ref, layers=layers).learner) == restrict(_OLD_LEARNERS[name]), name
    for name, ref in ROLLOUTS.items():
        assert _entries(study_recipe(ref, layers=layers).rollout) == restrict(_OLD_ROLLOUTS[name]), name


def test_study_rac_override_and_its_validation():
    from qpass.apps.study.configs import RACOverride, rac_targets, study_recipe, study_recipes
    from qpass.errors import QpassError, RecipeError
    from qpass.recipe import builtin_recipes

    assert not set(study_recipes()) & set(builtin_recipes())  # one name, one recipe
    rec = study_recipe("quads_nvfp4", layers=1, rac=RACOverride(0.25, "gathered", "token"))
    assert _entries(rec.rollout) == _expected([
        ("w4a4_lower", {"act": "nvfp4", "targets": _L0}),
        ("residual_compensation", {"targets": _RAC_L0, "ratio": 0.25, "mode": "gathered", "selection": "token"})])
    assert rec.name == "quads_nvfp4[layers<1, rac=0.25/gathered/token]" and "rac=0.25" in rec.path
    assert rac_targets(None) == ["*.mlp.gate_proj", "*.mlp.up_proj"] and rac_targets(1) == _RAC_L0
    full = study_recipe("quads_nvfp4", rac=RACOverride(1.0, "masked", "batch"))
    assert _entries(full.rollout) == _expected([("w4a4_lower", {"act": "nvfp4"}), ("residual_compensation", {
        "targets": ["*.mlp.gate_proj", "*.mlp.up_proj"], "ratio": 1.0, "mode": "masked", "selection": "batch"})])
    with pytest.raises(RecipeError, match="quads_nvfp4.yaml \\+ rac=0.5/sideways/batch.*mode"):
        study_recipe("quads_nvfp4", rac=RACOverride(0.5, "sideways", "batch"))  # validated like a recipe file
    with pytest.raises(QpassError, match="no 'residual_compensation' entry"):
        study_recipe("naive_nvfp4", rac=RACOverride(0.5, "masked", "batch"))
    with pytest.raises(QpassError, match="not found"):
        study_recipe("no_such_recipe")


def test_kernel_control_pass_equals_the_former_graph_edit(tiny_pipeline):
    """The ``fp32_accumulate_linear`` pass (study recipe ``kernel_control``, verifier on) samples the
    same tokens with the same log q, bit for bit, as the study-local graph edit it replaces (every
    targeted ``aten.linear`` node's target swapped for an eager fp32-accumulate function)."""
    from qpass.apps.study.configs import study_recipe
    from qpass.graph.properties import check_property
    from qpass.graph.sites import select_sites
    from qpass.graph.verify import verify
    from qpass.passes.fp32_accumulate import fp32_accumulate_linear

    pipe = tiny_pipeline
    for layers in (None, 1):
        new = pipe.build_side(study_recipe("kernel_control", layers=layers), "rollout", share_params=True)
        verify(new)
        assert not check_property(new, "fp32_accumulate") and "fp32_accumulate" in new.properties
        (res,) = new.history
        targets = [r"re:model\.layers\.(0)\..*"] if layers else ["*"]
        chosen = {s.id for s in select_sites(pipe.base_step.sites.values(), targets)}
        assert res.name == "fp32_accumulate_linear" and set(res.sites) == chosen and res.matches == len(chosen) > 0
        assert not any(n.target == torch.ops.aten.linear.default and n.meta.get("qpass_linear_site") in chosen
                       for n in new.gm.graph.nodes)
        old = pipe.base_step.clone("rollout", share_params=True)  # the former study-local edit
        for node in old.gm.graph.nodes:
            if node.target == torch.ops.aten.linear.default and node.meta.get("qpass_linear_site") in chosen:
                node.target = fp32_accumulate_linear
        old.gm.recompile()
        prompts = [[5, 6, 9, 10, 11], [12, 13], [20, 21, 22, 23], [30]]
        kw = {"max_new_tokens": 6, "seed": 2, "temperature": 0.8}
        a = TorchRollout(new, pad_token_id=0, eos_token_id=1).generate(prompts, **kw)
        b = TorchRollout(old, pad_token_id=0, eos_token_id=1).generate(prompts, **kw)
        assert torch.equal(a.responses, b.responses) and torch.equal(a.logq.view(torch.int32), b.logq.view(torch.int32))


def test_fp32_accumulate_pass_rejects_the_learner_side():
    from qpass.errors import RecipeError
    from qpass.recipe import parse_recipe

    with pytest.raises(RecipeError, match="<recipe>:3: .*cannot run on the learner side"):
        parse_recipe("name: x\nlearner:\n  - pass: fp32_accumulate_linear\n")


def _toy_result(quick: bool) -> dict:
    """The slice of a study result the C1 rule reads (W16A4 gap 4x the W4A16 gap, CI above 0)."""
    rep = {"mean_abs": 0.0, "max_abs": 0.0}
    return {"config": {"quick": quick}, "comparisons": {"op_w16a4_vs_op_w4a16": {"diff": 0.3, "lo": 0.2, "hi": 0.4}},
            "pairs": {"floor": {"replay": {**rep, "mean_abs": 0.05}}, "op_w4a16": {"replay": {**rep, "mean_abs": 0.1}},
                      "op_w16a4": {"replay": {**rep, "mean_abs": 0.4}}}}


def test_quick_run_claims_are_marked_not_evidence():
    """``--quick`` verdicts come from a toy run: every claim says so (JSON field + verdict text);
    a full run keeps the rule's verdict."""
    from qpass.apps.study.report import QUICK_VERDICT, evaluate_claims

    full = evaluate_claims(_toy_result(quick=False))
    assert [(c["id"], c["verdict"], c["quick"]) for c in full] == [("C1", "reproduced", False)]
    assert "toy_outcome" not in full[0]
    quick = evaluate_claims(_toy_result(quick=True))
    assert [(c["id"], c["verdict"], c["toy_outcome"], c["quick"]) for c in quick] == \
        [("C1", QUICK_VERDICT, "reproduced", True)]
    assert QUICK_VERDICT == "quick run: not evidence"


def test_cli_rejects_bad_ratios(tmp_path):
    from qpass.apps.study import main

    assert main(["--quick", "--out", str(tmp_path / "x"), "--ratios", "0,150"]) == 2
    assert main(["--quick", "--out", str(tmp_path / "x"), "--ratios", "a,b"]) == 2
    assert not (tmp_path / "x").exists()


def test_rescore_pairs_another_learner_with_the_same_samples(tiny_pipeline):
    """``rescore`` with the learner that scored the samples reproduces the gap bit for bit; with another
    learner it keeps the tokens and ``log q`` and changes only ``log p``."""
    from qpass.parity.behavior import logprob_gap, rescore
    from qpass.recipe import load_recipe

    learner, rollout = tiny_pipeline.build(load_recipe("quads_nvfp4"))
    prompts = [[5, 6, 9, 10, 11], [12, 13], [20, 21, 22, 23], [30]]
    kw = dict(max_new_tokens=6, temperature=1.0, top_p=1.0)
    g = logprob_gap(learner, rollout, prompts, pad_token_id=0, eos_token_id=1, seed=2, **kw)
    same = rescore(learner, g, **kw)
    assert torch.equal(same.d, g.d) and same.summary() == g.summary()
    bf16_learner, _ = tiny_pipeline.build(load_recipe("bf16"))
    other = rescore(bf16_learner, g, **kw)
    assert other.metrics.n_tokens == g.metrics.n_tokens > 0 and not torch.equal(other.d, g.d)
    with pytest.raises(ValueError, match="no sampled batches"):
        rescore(learner, dataclasses.replace(g, batches=[]), **kw)
