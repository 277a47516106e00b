"""SPEC §3.1, the factored decode (issue 28 item 1): every NVFP4 GEMM multiplies ``B = e2m1 * s_b`` and
applies the per-tensor scales once, as the epilogue ``alpha``."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from qpass import ops  # noqa: F401 - registers the rollout ops
from qpass.formats.e2m1 import E2M1_VALUES
from qpass.formats.spec import NVFP4_ACT, NVFP4_ACT_PER_TOKEN
from qpass.ops.calls import NVFP4LinearCall
from qpass.quant.linear import nvfp4_linear_exact, nvfp4_linear_reference
from qpass.quant.nvfp4 import NVFP4Tensor, global_scales, nvfp4_operand, nvfp4_quantize
from qpass.quant.qdq import learner_weight_operand
from qpass.quant.rac import RACConfig

from ._triton_testutil import activations, fresh_seed

ALL_RAC = [RACConfig(0.5, m, s) for m in ("masked", "gathered") for s in ("batch", "token", "static")]


def _e2m1(code: int) -> Fraction:
    v = Fraction(E2M1_VALUES[code & 7]).limit_denominator(4)
    return -v if code & 8 else v


def test_operand_is_exact_for_all_16_codes_and_256_scale_bytes():
    """``B = e2m1 * s_b`` is exact in bf16, fp16 and fp32 for every (code, E4M3 byte) pair (NaN bytes stay NaN)."""
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).repeat(256, 1)  # one 16-element block per row: every code once
    scale_bytes = torch.arange(256, dtype=torch.uint8).reshape(256, 1)
    q = NVFP4Tensor.from_parts(packed, scale_bytes, torch.tensor(1.0))
    s_vals = scale_bytes.view(torch.float8_e4m3fn).double().flatten().tolist()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        b = nvfp4_operand(q, dtype)
        assert b.dtype == dtype and b.shape == (256, 16)
        got = b.double()
        for byte in range(256):
            s = s_vals[byte]
            for code in range(16):
                g = got[byte, code].item()
                if s != s:  # 0x7F / 0xFF: NaN scale
                    assert g != g, (dtype, byte, code)
                    continue
                exact = _e2m1(code) * Fraction(s)
                assert Fraction(g) == exact, (dtype, byte, code, g, float(exact))
    assert torch.isnan(nvfp4_operand(q)).sum() == 2 * 16


def test_learner_and_rollout_multiply_identical_operands():
    """The learner's weight-QDQ op and the rollout's reference op: the same B (torch.equal), the
    same S_dec bits, and on CPU (both the reference accumulation) the same Y, bit for bit."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(48, 96, generator=g) * 0.05).bfloat16()
    w[3, 5] = 0.9  # a large element: other blocks get small E4M3 scales
    others = (torch.randn(20, 96, generator=g) * 0.2).bfloat16()  # the rest of a fused group
    amax = torch.ops.qpass.group_amax([w, others])
    q = nvfp4_quantize(w, amax)
    b_learn, s_learn = learner_weight_operand(w, amax, "s")
    assert torch.equal(b_learn.float(), nvfp4_operand(q))
    assert torch.equal(s_learn.view(torch.int32), q.s_dec.view(torch.int32))
    bias = torch.randn(48, generator=g).bfloat16()
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(2, 7, 96, generator=g) * 3).to(dtype)
        y_learn = torch.ops.qpass.nvfp4_qdq_linear(x, w, amax, bias, "s")
        y_roll = torch.ops.qpass.nvfp4_linear(x, q.codes, q.scales, q.s_dec, bias, "s", "none", 0.0, "masked", "batch", None)
        assert y_learn.dtype == y_roll.dtype == dtype
        assert torch.equal(y_learn, y_roll), dtype


def test_ste_gradients_against_a_hand_computed_case():
    """w rows [6, 3, 0..] and [-1.5, 0.5, 0..] (amax 6): S_enc = 448, S_dec = fl(1/448), block scales
    448 and 112, codes 6/3 and -6/2, so B = [[2688, 1344, 0..], [-672, 224, 0..]] (hand-derived).
    Forward y = fl((x B^T) * S_dec); backward dX = S_dec * (dY B), dW = dY^T X, dbias = sum dY."""
    w = torch.zeros(2, 16)
    w[0, :2] = torch.tensor([6.0, 3.0])
    w[1, :2] = torch.tensor([-1.5, 0.5])
    w.requires_grad_(True)
    bias = torch.tensor([0.25, -0.5], requires_grad=True)
    x = torch.zeros(1, 16)
    x[0, :2] = torch.tensor([1.0, 2.0])
    x.requires_grad_(True)
    amax = torch.tensor(6.0)
    b_hand = torch.zeros(2, 16)
    b_hand[0, :2] = torch.tensor([2688.0, 1344.0])
    b_hand[1, :2] = torch.tensor([-672.0, 224.0])
    s_dec = torch.tensor(1.0) / torch.tensor(448.0)  # fl(1/fl(2688/6)); 2688/6 = 448 exactly
    assert torch.equal(learner_weight_operand(w, amax)[0].float(), b_hand)
    assert torch.equal(global_scales(amax)[1], s_dec)
    y = torch.ops.qpass.nvfp4_qdq_linear(x, w, amax, bias, "hand")
    acc = torch.tensor([[1 * 2688.0 + 2 * 1344.0, 1 * -672.0 + 2 * 224.0]])  # [[5376, -224]], exact
    assert torch.equal(y.detach(), acc * s_dec + bias.detach())
    gy = torch.tensor([[1.0, -2.0]])
    y.backward(gy)
    gx = torch.zeros(1, 16)
    gx[0, :2] = torch.tensor([1 * 2688.0 - 2 * -672.0, 1 * 1344.0 - 2 * 224.0]) * s_dec  # S_dec * (dY B)
    gw = torch.zeros(2, 16)
    gw[0, :2] = torch.tensor([1.0, 2.0])
    gw[1, :2] = torch.tensor([-2.0, -4.0])  # dY^T X
    assert torch.equal(x.grad, gx)
    assert torch.equal(w.grad, gw)
    assert torch.equal(bias.grad, torch.tensor([1.0, -2.0]))


def _within_bound(y: torch.Tensor, call: NVFP4LinearCall) -> tuple[bool, float]:
    exact, bound = nvfp4_linear_exact(call)
    err = (y.double().reshape(exact.shape) - exact).abs()
    return bool((err <= bound).all()), float((err / bound.clamp_min(1e-300)).max())


def _calls(x, q, bias):
    yield NVFP4LinearCall(x=x, weight=q, bias=bias, act=None, rac=None, rac_channels=None, site="s", out_dtype=torch.float32)
    for act in (NVFP4_ACT, NVFP4_ACT_PER_TOKEN):
        yield NVFP4LinearCall(x=x, weight=q, bias=bias, act=act, rac=None, rac_channels=None, site="s", out_dtype=torch.float32)
        for rac in ALL_RAC:
            st = torch.tensor([1, 2, 5, 40, 41, 100, 200, 271][: max(1, rac.num_channels(x.shape[-1]) // 17)]) \
                if rac.selection == "static" else None
            yield NVFP4LinearCall(x=x, weight=q, bias=bias, act=act, rac=rac, rac_channels=st, site="s",
                                  out_dtype=torch.float32)


def _problem(m: int = 5, n: int = 40, k: int = 272):
    fresh_seed()
    x = activations(m, k, torch.bfloat16)
    w = torch.randn(n, k) * torch.exp(torch.randn(n, k // 16, 1) * 2).repeat_interleave(16, 2).reshape(n, k)
    w = w / w.abs().max() * 0.7  # amax bf16(0.7): S_dec has 24 significant bits (some amax give short ones, e.g. 126 -> 3/64)
    return x, nvfp4_quantize(w.bfloat16()), torch.randn(n)


def test_reference_gemms_are_within_the_accumulation_bound():
    """SPEC §3.1: |acc - exact| <= gamma_K sum|a||b| elementwise (vs fp64), for every reference variant;
    the materialised bf16 decode (the old operand) is not (negative control)."""
    x, q, bias = _problem()
    n_calls = 0
    for call in _calls(x, q, bias):
        ok, worst = _within_bound(nvfp4_linear_reference(call), call)
        assert ok, (call.act, call.rac, worst)
        n_calls += 1
    assert n_calls == 15
    call = next(_calls(x, q, None))
    w_hat = q.dequantize(torch.bfloat16).float()  # bf16(B * S_dec): not the operand SPEC §3.1 multiplies
    assert not _within_bound(x.float() @ w_hat.t(), call)[0]


def test_learner_op_is_within_the_accumulation_bound():
    x, q, bias = _problem()
    w = (torch.randn(40, 272) * 0.05).bfloat16()
    amax = w.float().abs().amax()
    y = torch.ops.qpass.nvfp4_qdq_linear(x.float(), w, amax, bias, "s")
    call = NVFP4LinearCall(x=x.float(), weight=nvfp4_quantize(w, amax), bias=bias, act=None, rac=None, rac_channels=None,
                           site="s", out_dtype=torch.float32)
    assert _within_bound(y, call)[0]


def test_triton_gemm_and_gemv_are_within_the_accumulation_bound(triton_backend):
    """The Triton kernels (interpreter): the GEMM (gemv=False), the GEMV (M <= 4) and split-K, every variant."""
    from qpass.backends.triton import nvfp4_linear_triton

    x, q, bias = _problem()
    for call in _calls(x, q, bias):
        ok, worst = _within_bound(nvfp4_linear_triton(call, gemv=False), call)
        assert ok, ("gemm", call.act, call.rac, worst)
    for m in (1, 3):
        for call in list(_calls(x[:m], q, bias))[:3]:  # W4A16, W4A4 per tensor / per token (RAC never takes the GEMV)
            ok, worst = _within_bound(nvfp4_linear_triton(call, gemv=True), call)
            assert ok, ("gemv", m, call.act, worst)


def test_triton_grouped_moe_gemm_is_within_the_accumulation_bound(triton_backend):
    from qpass.backends.triton.moe import grouped_w4a4_triton

    fresh_seed()
    k, n = 64, 32
    weights = [nvfp4_quantize((torch.randn(n, k) * 0.05).bfloat16()) for _ in range(3)]
    offs = [0, 4, 4, 9]  # expert 1 has no token
    x = activations(9, k, torch.bfloat16)
    for rac in (None, RACConfig(0.5, "masked", "batch")):
        y = grouped_w4a4_triton(x, offs, weights, act_spec=NVFP4_ACT, rac=rac, out_dtype=torch.float32)
        for e in range(3):
            lo, hi = offs[e], offs[e + 1]
            if hi > lo:
                call = NVFP4LinearCall(x=x[lo:hi], weight=weights[e], bias=None, act=NVFP4_ACT, rac=rac, rac_channels=None,
                                       site="e", out_dtype=torch.float32)
                assert _within_bound(y[lo:hi], call)[0], (rac, e)


def test_onnx_site_graph_is_factored_and_within_the_bound():
    """The ONNX site graph multiplies B (a DequantizeLinear of the FP4 codes) and scales the output by a Mul."""
    pytest.importorskip("onnx")
    from qpass.backends.onnx.export import SiteLinear, rollout_sites_model
    from qpass.backends.onnx.runtime import run_onnx
    from qpass.formats.spec import NVFP4_WEIGHT

    x, q, bias = _problem(m=4, n=32, k=64)
    for act, rac in ((None, None), (NVFP4_ACT, None), (NVFP4_ACT, RACConfig(0.5, "gathered", "batch"))):
        s = SiteLinear("p", NVFP4_WEIGHT, q, None, act, rac)
        model, _ = rollout_sites_model([s], flavour="spec", dtype=torch.float32)
        ops_ = [n.op_type for n in model.graph.node]
        assert "DequantizeLinear" in ops_ and any(n.name.endswith("acc_alpha") or "acc_alpha" in n.output[0]
                                                   for n in model.graph.node)
        y = run_onnx(model, {"p.x": x.float()})["p.y"]
        call = NVFP4LinearCall(x=x.float(), weight=q, bias=None, act=act, rac=rac, rac_channels=None, site="p",
                               out_dtype=torch.float32)
        assert _within_bound(y, call)[0], (act, rac)


def test_modelopt_convention_global_scale_goes_to_alpha():
    """A ModelOpt-arithmetic weight (``S_dec = weight_scale_2 = fl(amax/2688)``) through the rollout op:
    the same operand B and its own S_dec bits in alpha."""
    from qpass.formats.spec import NVFP4_WEIGHT_MODELOPT

    g = torch.Generator().manual_seed(7)
    w = (torch.randn(32, 64, generator=g) * 0.05).bfloat16()
    q = nvfp4_quantize(w, spec=NVFP4_WEIGHT_MODELOPT)
    x = torch.randn(3, 64, generator=g).bfloat16()
    y = torch.ops.qpass.nvfp4_linear(x.float(), q.codes, q.scales, q.s_dec, None, "m", "none", 0.0, "masked", "batch", None)
    want = (x.float() @ nvfp4_operand(q).t()) * q.s_dec
    assert torch.equal(y, want)
    amax = torch.ops.qpass.group_amax([w])
    assert torch.equal(torch.ops.qpass.nvfp4_qdq_linear(x.float(), w, amax, None, "m", "modelopt"), y)


def test_parity_checker_catches_an_operand_mismatch(tiny_pipeline, monkeypatch):
    from qpass.parity import checker
    from qpass.recipe import load_recipe

    learner, rollout = tiny_pipeline.build(load_recipe("w4a16_qat"))
    assert checker.check_weights_bitexact(learner, rollout).ok
    real = checker.learner_weight_operand

    def off_by_one_ulp(w, amax, site="", arithmetic="te_reference"):  # noqa: ANN001
        b, s = real(w, amax, site, arithmetic)
        return b, (s.view(torch.int32) + 1).view(torch.float32)

    monkeypatch.setattr(checker, "learner_weight_operand", off_by_one_ulp)
    rep = checker.check_weights_bitexact(learner, rollout, identify_divergence=False)
    assert not rep.ok and all(d.ok for g in rep.groups for d in g.diffs)  # bytes agree, the scale bits do not
    assert any("scales by S_dec bits" in n for g in rep.groups for n in g.operand_notes)
