"""Numerics defect classes of issue 10, each with a test that fails on the code before the fix."""

from __future__ import annotations

import pytest
import torch

from qpass.errors import PassError, QuantizationError
from qpass.formats.spec import NVFP4_WEIGHT
from qpass.recipe import parse_recipe

from .conftest import tiny_llama

FLUSH_SITE = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def fp32_pipeline():
    """A float32 tiny Llama whose q_proj (layer 0) has one non-zero block that flushes to zero."""
    from qpass.graph.model import LoadedModel
    from qpass.pipeline import Pipeline

    m = tiny_llama(seed=1, dtype=torch.float32)
    with torch.no_grad():
        w = m.model.layers[0].self_attn.q_proj.weight
        w[0, :16] = 1e-7  # block amax 1e-7 against a group amax of 1000: the E4M3 block scale is 0
        w[1, 0] = 1000.0
    return Pipeline.prepare(loaded=LoadedModel(model=m, tokenizer=None, name="tiny-fp32", source="random"),
                            batch_size=2, max_len=24)


# -------------------------------------------------------------------------------- parity dtypes
def test_parity_checker_compares_what_each_side_multiplies(fp32_pipeline, tiny_pipeline):
    """The checker compares what each op multiplies, ``B_W`` and the ``S_dec_W`` bits (SPEC §3.1).

    Before the factored decode an fp32 model's learner multiplied fp32-decoded weights and the
    rollout op bf16-decoded ones (the check failed there by design); now both multiply the exact
    ``B_W`` and scale by the same ``S_dec_W`` in every model dtype, so the fp32 model passes too (an
    operand mismatch is still caught: tests/test_factored_decode.py)."""
    from qpass.parity.checker import check_weights_bitexact

    recipe = parse_recipe("name: q\nlearner:\n  - pass: weight_qdq\nrollout:\n  - pass: w4a16_lower\n")
    learner, rollout = fp32_pipeline.build(recipe)
    rep = check_weights_bitexact(learner, rollout, identify_divergence=False)
    assert all(d.ok for g in rep.groups for d in g.diffs)  # the stored bytes agree (incl. the flushed block) ...
    assert rep.ok and all(g.dequant_equal for g in rep.groups)  # ... and so do the multiplied operands
    lb, rb = tiny_pipeline.build(recipe)
    assert check_weights_bitexact(lb, rb).ok


# -------------------------------------------------------------------------------- fp16 overflow
def _fp16_near_max():
    """fp16 activations with 65504 (the fp16 max) in channel 0 and a weight whose rows 0 and 1 decode
    to the unit vectors e_0, e_1: y[:, 0] is channel 0's operand, exactly."""
    from qpass.quant.nvfp4 import nvfp4_quantize

    x = torch.zeros(2, 32, dtype=torch.float16)
    x[:, 0] = 65504.0
    x[1, 17] = -60000.0
    w = torch.zeros(16, 32)
    w[0, 0] = w[1, 1] = 1.0
    return x, nvfp4_quantize(w.bfloat16())


def test_fp16_activation_near_fp16_max_stays_finite_in_the_row_parallel_w4a4_operand():
    from qpass.backends.sglang.plugin import activation_for_row_parallel
    from qpass.formats.spec import NVFP4_ACT
    from qpass.quant.nvfp4 import nvfp4_act_operand, nvfp4_dequantize, nvfp4_quantize

    x = torch.full((2, 32), 65504.0, dtype=torch.float16)
    x[:, 3] = -60000.0
    got = activation_for_row_parallel(x, "nvfp4", None, "s")
    assert bool(torch.isfinite(got).all())  # bf16 rounds 65504 up to 65536: an fp16 cast made it inf
    # the main op's operand (was the unsaturated bf16 decode, 65536): inside the fp16 range now
    assert torch.equal(got, nvfp4_act_operand(nvfp4_quantize(x, spec=NVFP4_ACT)).float())
    assert got[0, 0].item() == 65280.0 and got.to(torch.float16).isfinite().all()
    xb = x.bfloat16()  # bf16 activations keep the bf16 operand, and its values are the plain bf16 decode
    assert activation_for_row_parallel(xb, "nvfp4", None, "s").dtype == torch.bfloat16
    assert torch.equal(activation_for_row_parallel(xb, "nvfp4", None, "s"),
                       nvfp4_dequantize(nvfp4_quantize(xb, spec=NVFP4_ACT), torch.bfloat16))


def test_act_operand_limit_is_the_largest_bf16_inside_the_activation_range():
    from qpass.quant.nvfp4 import act_operand_limit

    assert act_operand_limit(torch.float16) == 65280.0  # bf16 0x477F; 65504 would round to 65536 = inf in fp16
    bf16_max = torch.finfo(torch.bfloat16).max
    assert act_operand_limit(torch.bfloat16) == act_operand_limit(torch.float32) == bf16_max


@pytest.mark.parametrize("act", ["nvfp4", "nvfp4_per_token"])
def test_fp16_activation_near_fp16_max_stays_finite_in_the_w4a4_op(act):
    """``qpass::nvfp4_linear`` (reference): 65504 decoded to ~65504.0002, rounded to a bf16 operand
    65536, times 1.0 gave y = 65536 = inf in fp16 (the fp16 model itself gives 65504). With the
    factored decode (SPEC §3.1) the GEMM multiplies the exact ``B_X = 6 * 448`` and ``B_W = 6 * 448``
    and scales once: ``fl(2688^2 * alpha)`` ~65504.0002 rounds to 65504 in fp16. RAC's residual is
    ``x - bf16(DQ(Q_A(x))) = 65504 - 65536 = -32`` on channel 0 (where it is selected): 65472, finite
    (a residual against an fp16-clamped 65280 would add 224 to the exact first term: inf)."""
    from qpass import ops  # noqa: F401 - registers torch.ops.qpass

    x, q = _fp16_near_max()
    plain = torch.ops.qpass.nvfp4_linear(x, q.codes, q.scales, q.s_dec, None, "s", act, 0.0, "masked", "batch", None)
    assert plain.dtype == torch.float16 and bool(plain.isfinite().all())
    assert plain[:, 0].tolist() == [65504.0, 65504.0]
    # gathered/token: row 1 ranks channel 17 (-60000, residual larger than 32) above channel 0
    for (mode, sel), want in ((("masked", "batch"), [65472.0, 65472.0]), (("gathered", "token"), [65472.0, 65504.0])):
        rac = torch.ops.qpass.nvfp4_linear(x, q.codes, q.scales, q.s_dec, None, "s", act, 0.5, mode, sel, None)
        assert bool(rac.isfinite().all()) and rac[:, 0].tolist() == want, (mode, sel)
    # bf16 activations: the operand is the plain bf16 decode (nothing saturates inside the bf16 range)
    from qpass.formats.spec import NVFP4_ACT
    from qpass.quant.nvfp4 import nvfp4_act_operand, nvfp4_dequantize, nvfp4_quantize

    xb = (torch.randn(4, 64, generator=torch.Generator().manual_seed(3)) * 1e4).bfloat16()
    qa = nvfp4_quantize(xb, spec=NVFP4_ACT)
    assert torch.equal(nvfp4_act_operand(qa), nvfp4_dequantize(qa, torch.bfloat16))


def test_fp16_activation_near_fp16_max_triton_kernels_match_the_reference(triton_backend):
    """The Triton W4A4 kernels (interpreter on CPU) at the fp16 max: the reference's output bits,
    plain and with RAC (masked: residual re-formed in the kernel; gathered: re-decoded from the
    activation bytes), and the RAC parity views equal ``rac_reference``'s (the bf16 dequant 65536)."""
    from qpass.backends.triton import rac_triton, w4a4_linear_triton
    from qpass.formats.spec import NVFP4_ACT
    from qpass.quant.linear import w4a4_linear_reference
    from qpass.quant.rac import RACConfig, rac_reference

    x, q = _fp16_near_max()
    for rac in (None, RACConfig(0.5, "masked", "batch"), RACConfig(0.5, "gathered", "batch"), RACConfig(0.5, "gathered", "token")):
        ref = w4a4_linear_reference(x, q, act_spec=NVFP4_ACT, rac=rac)
        got = w4a4_linear_triton(x, q.codes, q.scales, q.s_dec, act_spec=NVFP4_ACT, rac=rac)
        assert bool(got.isfinite().all()) and torch.equal(got, ref), rac
        if rac is not None:
            a, b = rac_triton(x, rac, NVFP4_ACT), rac_reference(x, rac, NVFP4_ACT)
            assert a.x_hat.float().max().item() == 65536.0
            assert torch.equal(a.x_hat, b.x_hat) and torch.equal(a.comp, b.comp), rac


# -------------------------------------------------------------------------------- RAC ratio
def test_rac_ratio_with_zero_channels_on_every_site_is_an_error(tiny_pipeline):
    recipe = parse_recipe(
        "name: r\nrollout:\n  - pass: w4a4_lower\n  - pass: residual_compensation\n    ratio: 0.001\n"
    )
    with pytest.raises(PassError, match=r"ratio 0\.001 selects 0 channels on every targeted site .*mlp\.(gate|up)_proj"):
        tiny_pipeline.build(recipe)
    _, rollout = tiny_pipeline.build(parse_recipe(
        "name: r\nrollout:\n  - pass: w4a4_lower\n  - pass: residual_compensation\n    ratio: 0.5\n"))
    assert sum(r.rac is not None for r in rollout.quant.values()) == 4
    _, rollout = tiny_pipeline.build(parse_recipe(  # explicit opt-in keeps the zero-channel configuration
        "name: r\nrollout:\n  - pass: w4a4_lower\n  - pass: residual_compensation\n    ratio: 0.001\n"
        "    allow_zero_channels: true\n"))
    assert sum(r.rac is not None for r in rollout.quant.values()) == 4


# -------------------------------------------------------------------------------- flushed blocks
def test_flushed_blocks_are_counted_per_site(fp32_pipeline):
    from qpass.quant.nvfp4 import flushed_blocks, nvfp4_dequantize, nvfp4_quantize
    from qpass.quant.weights import quantize_site_weights

    w = torch.zeros(2, 32)
    w[0, :16] = 1e-7
    w[1, 0] = 1000.0
    q = nvfp4_quantize(w)
    assert flushed_blocks(q) == 1 and q.flushed_blocks() == 1  # the all-zero blocks are not counted
    assert torch.equal(nvfp4_dequantize(q, torch.float32)[0, :16], torch.zeros(16))  # SPEC §3 semantics kept
    assert quantize_site_weights(NVFP4_WEIGHT, {"a": w})["a"].flushed_blocks == 1
    _, rollout = fp32_pipeline.build(parse_recipe("name: w\nrollout:\n  - pass: w4a16_lower\n"))
    res = rollout.history[-1]
    assert res.details["flushed_blocks"] == {FLUSH_SITE: 1}
    assert rollout.quant[FLUSH_SITE].flushed_blocks == 1
    assert rollout.quant[FLUSH_SITE].describe()["flushed_blocks"] == 1


# -------------------------------------------------------------------------------- fused groups
def test_error_in_one_fused_member_names_that_member():
    from qpass.quant.weights import quantize_site_weights

    good = torch.randn(8, 32)
    bad = torch.randn(8, 32)
    bad[3, 5] = float("inf")
    with pytest.raises(QuantizationError, match=r"at site m\.k_proj") as ei:
        quantize_site_weights(NVFP4_WEIGHT, {"m.q_proj": good, "m.k_proj": bad})
    assert "q_proj" not in str(ei.value)


def test_learner_qdq_with_a_poisoned_group_amax_blames_another_member():
    from qpass.quant import qdq  # noqa: F401

    good, bad = torch.randn(8, 32), torch.randn(8, 32)
    bad[0, 0] = float("nan")
    amax = torch.ops.qpass.group_amax([good, bad])
    with pytest.raises(QuantizationError, match="another member of its quantization group"):
        torch.ops.qpass.nvfp4_qdq(good, amax, "m.q_proj")
