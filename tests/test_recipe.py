"""Recipe schema: every bad input is a RecipeError that names file:line; built-ins validate."""

from __future__ import annotations

import pytest

from qpass.errors import RecipeError
from qpass.recipe import builtin_recipes, load_recipe, parse_recipe


def _err(text: str) -> str:
    with pytest.raises(RecipeError) as ei:
        parse_recipe(text, "r.yaml")
    return str(ei.value)


def test_builtin_recipes_all_validate_and_have_expected_passes():
    names = set(builtin_recipes())
    assert names == {"bf16", "w4a16_qat", "naive_nvfp4", "quads_nvfp4", "quads_nvfp4_moe", "w4a4_qat", "fp8_block",
                     "qat_only", "fp8_qat", "mxfp4_qat", "w4a16_rollout", "w16a4_rollout"}
    # the RL-time operand ablation (QUADS Fig. 2): BF16 learners, one operand quantized in the rollout
    for name, passes in (("w4a16_rollout", ["w4a16_lower"]), ("w16a4_rollout", ["act_qdq"])):
        r = load_recipe(name)
        assert r.learner == [] and [p.name for p in r.rollout] == passes, name
    assert load_recipe("w16a4_rollout").rollout[0].options.per_token is False
    qo = load_recipe("qat_only")  # weight-QDQ learner, plain W4A4 rollout, no RAC
    assert [p.name for p in qo.learner] == ["weight_qdq"] and [p.name for p in qo.rollout] == ["w4a4_lower"]
    assert qo.rollout[0].options.act == "nvfp4"
    q = load_recipe("quads_nvfp4")
    assert [p.name for p in q.learner] == ["weight_qdq"]
    assert [p.name for p in q.rollout] == ["w4a4_lower", "residual_compensation"]
    rac = q.rollout[1].options
    assert (rac.ratio, rac.mode, rac.selection) == (0.5, "masked", "batch")
    assert rac.targets == ["*.mlp.gate_proj", "*.mlp.up_proj"]
    assert [c.check for c in q.parity] == ["structural", "weights_bitexact", "logprob_gap"]
    assert load_recipe("bf16").learner == [] and load_recipe("bf16").rollout == []
    assert [p.name for p in load_recipe("w4a4_qat").learner] == ["weight_qdq", "act_qdq"]
    assert load_recipe("w4a16_qat").rollout[0].options.act == "none"
    fq = load_recipe("fp8_qat")  # the learner table's FP8 / MXFP4 entries (issue 33 item 3)
    assert (fq.learner[0].options.format, fq.learner[0].options.granularity) == ("fp8", "block_128x128")
    assert fq.rollout[0].options.weight_granularity == "block_128x128"
    assert load_recipe("mxfp4_qat").learner[0].options.format == "mxfp4"


def test_unknown_key_in_pass_names_line_and_suggests():
    msg = _err("name: x\nrollout:\n  - pass: w4a4_lower\n  - pass: residual_compensation\n    ratoi: 0.5\n")
    assert msg.startswith("r.yaml:5:") and "'ratoi'" in msg and "did you mean 'ratio'" in msg


def test_unknown_pass_and_unknown_top_level_key():
    assert "unknown pass 'w4a4_lowr'" in _err("name: x\nrollout:\n  - pass: w4a4_lowr\n")
    assert "did you mean 'w4a4_lower'" in _err("name: x\nrollout:\n  - pass: w4a4_lowr\n")
    msg = _err("name: x\nrollouts: []\n")
    assert msg.startswith("r.yaml:2:") and "did you mean 'rollout'" in msg


def test_bad_values_and_missing_name():
    assert "ratio" in _err("name: x\nrollout:\n  - pass: w4a4_lower\n  - pass: residual_compensation\n    ratio: 1.5\n")
    assert "mode" in _err("name: x\nrollout:\n  - pass: w4a4_lower\n  - pass: residual_compensation\n    mode: sparse\n")
    assert "no 'name:'" in _err("learner: []\n")
    assert "YAML syntax error" in _err("name: [unclosed\n")


def test_wrong_side_and_order_errors_name_lines():
    msg = _err("name: x\nlearner:\n  - pass: w4a4_lower\n")
    assert msg.startswith("r.yaml:3:") and "cannot run on the learner side" in msg
    msg = _err("name: x\nrollout:\n  - pass: residual_compensation\n  - pass: w4a4_lower\n")
    assert "recipe line 3" in msg and "recipe line 4" in msg and "move 'residual_compensation' after 'w4a4_lower'" in msg


def test_parity_checks_validate():
    assert "unknown parity check" in _err("name: x\nparity:\n  - check: bitexact\n")
    r = parse_recipe("name: x\nparity:\n  - check: logprob_gap\n    prompts: 3\n    max_abs_gap: 0.5\n")
    assert r.check("logprob_gap").prompts == 3 and r.check("logprob_gap").max_abs_gap == 0.5
    assert "unknown key 'tokens'" in _err("name: x\nparity:\n  - check: logprob_gap\n    tokens: 3\n")


def test_missing_recipe_lists_builtins():
    with pytest.raises(RecipeError, match=r"built-in recipes \(by name\): .*quads_nvfp4"):
        load_recipe("recipes/does_not_exist.yaml")


def test_target_glob_that_matches_nothing_fails_before_any_pass_with_nearest_names(tiny_pipeline, monkeypatch):
    """Old code: the typo surfaced only when its pass ran (after every pass before it)."""
    import qpass.pm as pm
    from qpass.errors import RecipeError

    text = ('name: x\nlearner:\n  - pass: weight_qdq\nrollout:\n  - pass: w4a4_lower\n  - pass: residual_compensation\n'
            '    targets: ["*.mlp.gate_proj", "*.mlp.up_projj"]\n')
    ran = []
    real_run = pm.PassManager.run
    monkeypatch.setattr(pm.PassManager, "run", lambda self, *a, **k: ran.append(1) or real_run(self, *a, **k))
    with pytest.raises(RecipeError) as e:
        tiny_pipeline.build(parse_recipe(text))
    msg = str(e.value)
    assert msg.startswith("<recipe>:6: rollout pass 'residual_compensation': targets pattern '*.mlp.up_projj' matches no site")
    assert "nearest: *.mlp.up_proj" in msg and ran == []
    bad_exclude = 'name: x\nrollout:\n  - pass: w4a4_lower\n    exclude: ["model.layers.9.*"]\n'
    with pytest.raises(RecipeError, match=r"exclude pattern 'model.layers.9.\*' matches no site.*nearest: model.layers.1."):
        tiny_pipeline.build(parse_recipe(bad_exclude))


def test_a_recipe_path_that_does_not_exist_says_so(tmp_path):
    """A fresh user's `recipes/nope.yaml` got the built-in list only ('not found'), as if it were a name."""
    from qpass.compiler.recipe import load_recipe
    from qpass.errors import RecipeError

    with pytest.raises(RecipeError, match=r"recipe file recipes/nope\.yaml does not exist; built-in recipes \(by name\)"):
        load_recipe("recipes/nope.yaml")
    with pytest.raises(RecipeError, match="is a directory, not a recipe file"):
        load_recipe(str(tmp_path))
    with pytest.raises(RecipeError, match=r"recipe 'nope' not found; built-in recipes"):
        load_recipe("nope")
