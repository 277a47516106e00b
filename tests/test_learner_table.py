"""The learner table is real (issue 33 item 3): weight_qdq / act_qdq look up ``learner_qdq`` by spec;
FP8 (block) and MXFP4 QAT recipes with bit-level parity."""

from __future__ import annotations

import typing

import pytest
import torch

from qpass.formats.spec import ALL_SPECS
from qpass.graph.verify import LEARNER_QPASS_OPS, ROLLOUT_QPASS_OPS
from qpass.passes.act_qdq import ActQDQOptions
from qpass.passes.weight_qdq import WeightQDQOptions
import qpass.passes  # noqa: F401 - registers the passes
from qpass.pm import PASSES
from qpass.recipe import load_recipe, parse_recipe
from qpass.tables import entry, missing_entries



def _literal(model, field):
    return typing.get_args(model.model_fields[field].annotation)


def _option_specs():
    """Every spec a recipe can ask the learner passes for (each Literal value of their options)."""
    out = []
    for fmt in _literal(WeightQDQOptions, "format"):
        kw = {"format": fmt}
        if fmt == "fp8":
            out += [WeightQDQOptions(format=fmt, granularity=g).spec() for g in _literal(WeightQDQOptions, "granularity")]
        elif fmt == "nvfp4":
            out += [WeightQDQOptions(format=fmt, arithmetic=a).spec() for a in _literal(WeightQDQOptions, "arithmetic")]
        else:
            out.append(WeightQDQOptions(**kw).spec())
    for fmt in _literal(ActQDQOptions, "format"):
        if fmt == "fp8":
            out += [ActQDQOptions(format=fmt, granularity=g).spec() for g in _literal(ActQDQOptions, "granularity")]
        else:
            out += [ActQDQOptions(format=fmt, per_token=p).spec() for p in (False, True)]
    return out


def test_every_spec_has_every_table_entry_a_recipe_can_ask_for():
    """Every spec the learner passes' options can name (and every canonical spec) has a reference
    quantizer, a learner_qdq rule with registered ops and argument builders, and a rollout lowering
    whose pass exists; the ops are known to the graph verifier. A missing rule is this failure."""
    specs = _option_specs() + list(ALL_SPECS)
    assert len({s.key for s in specs}) >= 10
    for spec in specs:
        assert entry("reference", spec) is not None, spec.key
        lq = entry("learner_qdq", spec)
        lo = entry("rollout_lower", spec)
        assert lo.lower_pass in PASSES, (spec.key, lo.lower_pass)
        role = "linear" if spec.role == "weight" else "activation"
        assert f"qpass::{lq.overload(role).name().split('::')[-1]}" in LEARNER_QPASS_OPS | ROLLOUT_QPASS_OPS, spec.key
        assert (lq.linear_args if role == "linear" else lq.act_args) is not None, spec.key
    assert missing_entries()["learner_qdq"] == []


def test_options_of_another_format_are_refused():
    with pytest.raises(ValueError, match="arithmetic is an NVFP4 option"):
        WeightQDQOptions(format="fp8", arithmetic="modelopt")
    with pytest.raises(ValueError, match="granularity is an FP8 option"):
        WeightQDQOptions(format="mxfp4", granularity="per_tensor")
    with pytest.raises(ValueError, match="per_token is an NVFP4 option"):
        ActQDQOptions(format="fp8", per_token=True)


def test_fp8_learner_op_multiplies_the_rollout_weight_operand():
    """``qpass::qdq_linear`` (FP8 blocks): y = x @ W_deq^T with the very float32 decode the rollout's
    reference op multiplies; STE backward dW = dY^T X, dX = dY W_deq."""
    from qpass.formats.spec import FP8_WEIGHT_BLOCK
    from qpass.quant.fp8 import fp8_dequantize, fp8_quantize

    g = torch.Generator().manual_seed(11)
    w = (torch.randn(256, 256, generator=g) * 0.05).bfloat16().requires_grad_(True)
    x = torch.randn(3, 256, generator=g).requires_grad_(True)
    y = torch.ops.qpass.qdq_linear(x, w, None, FP8_WEIGHT_BLOCK.key, "f")
    w_deq = fp8_dequantize(fp8_quantize(w.detach(), spec=FP8_WEIGHT_BLOCK), torch.float32)
    assert torch.equal(y.detach(), x.detach() @ w_deq.t())
    gy = torch.randn(3, 256, generator=g)
    y.backward(gy)
    assert torch.equal(x.grad, gy @ w_deq)
    assert torch.equal(w.grad, (gy.t() @ x.detach()).bfloat16())


@pytest.mark.parametrize("recipe,format_", [("fp8_qat", "fp8"), ("mxfp4_qat", "mxfp4")])
def test_dense_format_qat_recipes_have_bit_level_parity(tiny_pipeline, recipe, format_):
    """The shipped FP8 / MXFP4 QAT recipes: structural and bit-level parity hold; a planted byte in one
    rollout weight is found and named."""
    from qpass.parity.checker import check_structural, check_weights_bitexact

    learner, rollout = tiny_pipeline.build(load_recipe(recipe))
    n_sites = sum(1 for r in learner.quant.values() if r.weight_fake_quant)
    assert n_sites > 0 and all(r.op == "qpass::qdq_linear" for r in learner.quant.values())
    s = check_structural(learner, rollout)
    assert s.ok and s.matched == n_sites, s.problems
    b = check_weights_bitexact(learner, rollout)
    assert b.ok and len(b.groups) == n_sites and not b.skipped
    sid = sorted(r.site for r in rollout.quant.values() if r.lowered)[0]
    key = "data" if format_ == "fp8" else "codes"
    buf = rollout.gm.get_buffer(rollout.quant[sid].constants[key]).view(torch.uint8)
    buf.view(-1)[5] ^= 0x01
    b = check_weights_bitexact(learner, rollout)
    assert not b.ok and b.mismatched_groups == [sid]
    assert any(sid in f and "codes differ" in f for f in b.failures())


def test_fp8_learner_against_an_nvfp4_rollout_fails_structural_parity(tiny_pipeline):
    from qpass.parity.checker import check_structural

    learner, _ = tiny_pipeline.build(parse_recipe("name: l\nlearner:\n  - pass: weight_qdq\n    format: fp8\n"))
    _, rollout = tiny_pipeline.build(load_recipe("w4a16_qat"))
    s = check_structural(learner, rollout)
    assert not s.ok and any("spec learner=fp8_e4m3.weight.block_128x128 rollout=nvfp4.weight.per_tensor" in p
                            for p in s.problems)


def test_fp8_activation_qdq_on_the_learner(tiny_pipeline):
    """act_qdq format fp8 inserts qpass::qdq of the FP8 activation spec in front of weight_qdq's op."""
    learner, _ = tiny_pipeline.build(parse_recipe(
        "name: a\nlearner:\n  - pass: weight_qdq\n    format: fp8\n  - pass: act_qdq\n    format: fp8\n    granularity: per_token\n"))
    acts = [n for n in learner.call_nodes(torch.ops.qpass.qdq.default) if n.meta.get("qpass_act_site")]
    assert acts and all(n.args[2] == "fp8_e4m3.activation.per_token" for n in acts)
    assert all(any(u.target == torch.ops.qpass.qdq_linear.default for u in n.users) for n in acts)


def test_fp8_qat_recipe_runs_through_apply_and_check(tiny_pipeline, tmp_path):
    """``qpass apply`` / ``qpass check`` with the FP8 QAT recipe (tiny Llama): exit 0, the parity
    checks pass, and check re-verifies the written artifacts."""
    import dataclasses

    from qpass.apps.apply import ApplyOptions, run_apply, run_check
    from qpass.graph.model import LoadedModel
    from tests.test_grpo import FakeTok

    pipe = dataclasses.replace(tiny_pipeline, loaded=LoadedModel(model=tiny_pipeline.loaded.model, tokenizer=FakeTok(),
                                                                 name="tiny-llama", source="random"))
    out = tmp_path / "fp8"
    status, report = run_apply("fp8_qat", out, ApplyOptions(prompts=2, samples=2, max_new_tokens=4, batch_size=4),
                               pipeline=pipe)
    assert status == 0, report
    parity = report["parity"]
    checks = {c["check"]: c["ok"] for c in parity["checks"]}
    assert checks.get("structural") and checks.get("weights_bitexact"), checks
    assert parity["structural_ok"] and parity["weights_bitexact"]
    status, res = run_check(str(out), ApplyOptions(), pipeline=pipe)
    assert status == 0, res
