"""Triton NVFP4/FP8 linears vs ``qpass.quant.linear`` (CPU interpreter).

fp32 activations keep the float32 accumulator visible in the output, so the kernels are checked
against the fp64 factored product of the same operands (SPEC §3.1: ``B = e2m1 * s_b``, ``alpha`` on
the output; relative Frobenius error < 1e-5; the elementwise accumulation bound is
tests/test_factored_decode.py's); bf16 / fp16 outputs must equal the reference op up to one output
rounding step.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from qpass.formats.spec import NVFP4_ACT, NVFP4_ACT_PER_TOKEN, FP8Spec
from qpass.quant.fp8 import fp8_dequantize, fp8_quantize
from qpass.quant.linear import w4a4_linear_reference, w4a16_linear_reference
from qpass.quant.nvfp4 import nvfp4_quantize
from qpass.quant.rac import RACConfig

from qpass.backends.triton import fp8_linear_triton, w4a4_linear_triton, w4a16_linear_triton

try:  # tests/ may or may not be a package
    from ._triton_testutil import activations, factored_exact, fresh_seed, rel_fro
except ImportError:
    from _triton_testutil import activations, factored_exact, fresh_seed, rel_fro

N, K = 72, 176  # K: not a multiple of the 64-wide interpreter K tile; > 2 tiles, so split-K runs too


def _weight():
    w = nvfp4_quantize(torch.randn(N, K) * 0.05)
    return w, None


def _close_to_rounding(y: torch.Tensor, ref: torch.Tensor) -> bool:
    """Equal up to one rounding step of the output dtype (both round the same float32 value +- reordering)."""
    eps = torch.finfo(y.dtype).eps
    return bool(((y.float() - ref.float()).abs() <= eps * ref.float().abs() + 1e-6).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 21])
def test_w4a16(dtype, m):
    seed = fresh_seed()
    w, _ = _weight()
    x = activations(m, K, dtype)
    bias = torch.randn(N) if m == 1 else None
    y = w4a16_linear_triton(x, w.codes, w.scales, w.s_dec, bias)
    assert y.dtype == dtype and y.shape == (m, N)
    if dtype == torch.float32:
        assert rel_fro(y, factored_exact(x, w, bias)) < 1e-5, seed
    else:
        assert _close_to_rounding(y, w4a16_linear_reference(x, w, bias)), seed


@pytest.mark.parametrize("accumulation", ["two_level", "mma"])
def test_w4a16_accumulation_forms(accumulation):
    """Both accumulation forms compute the same product (to fp32 reordering) on the interpreter."""
    seed = fresh_seed()
    w, _ = _weight()
    x = activations(21, K, torch.bfloat16)
    y = w4a16_linear_triton(x, w.codes, w.scales, w.s_dec, out_dtype=torch.float32, accumulation=accumulation)
    assert rel_fro(y, factored_exact(x, w)) < 1e-6, seed


def test_accumulation_choice_is_validated(monkeypatch):
    w, _ = _weight()
    x = activations(3, K, torch.bfloat16)
    with pytest.raises(ValueError, match="accumulation must be one of"):
        w4a16_linear_triton(x, w.codes, w.scales, w.s_dec, accumulation="fast")
    monkeypatch.setenv("QPASS_GEMM_ACCUMULATION", "fp16")
    with pytest.raises(ValueError, match="QPASS_GEMM_ACCUMULATION must be one of"):
        w4a16_linear_triton(x, w.codes, w.scales, w.s_dec)


@pytest.mark.parametrize("per_token", [False, True])
def test_w4a4_plain(per_token):
    seed = fresh_seed()
    w, _ = _weight()
    spec = NVFP4_ACT_PER_TOKEN if per_token else NVFP4_ACT
    x = activations(17, K, torch.float32).reshape(1, 17, K)
    y = w4a4_linear_triton(x, w.codes, w.scales, w.s_dec, act_spec=spec)
    assert y.shape == (1, 17, N)
    assert rel_fro(y.reshape(17, N), factored_exact(x, w, act=spec)) < 1e-5, seed
    xb = x.to(torch.bfloat16)
    assert _close_to_rounding(w4a4_linear_triton(xb, w.codes, w.scales, w.s_dec, act_spec=spec),
                              w4a4_linear_reference(xb, w, act_spec=spec)), seed


@pytest.mark.parametrize(
    "mode,selection,per_token",
    [(m, s, False) for m, s in itertools.product(["masked", "gathered"], ["batch", "token", "static"])]
    + [("masked", "batch", True), ("gathered", "token", True)],
)
def test_w4a4_rac(mode, selection, per_token):
    seed = fresh_seed()
    w, _ = _weight()
    m = int(torch.randint(1, 20, ()))
    x = activations(m, K, torch.float32)
    bias = torch.randn(N)
    cfg = RACConfig(0.5, mode, selection)
    static = torch.randperm(K)[:23] if selection == "static" else None
    spec = NVFP4_ACT_PER_TOKEN if per_token else NVFP4_ACT
    y = w4a4_linear_triton(x, w.codes, w.scales, w.s_dec, bias, act_spec=spec, rac=cfg, static_channels=static)
    assert rel_fro(y, factored_exact(x, w, bias, spec, cfg, static)) < 1e-5, (seed, m)


def test_ops_dispatch_to_triton(monkeypatch, triton_backend):
    """``use_kernels('triton')`` routes both custom ops to these kernels (CPU needs TRITON_INTERPRET=1)."""
    import qpass.ops as ops

    seed = fresh_seed()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    w, _ = _weight()
    x = activations(6, K, torch.bfloat16).reshape(2, 3, K)
    wf = fp8_quantize(torch.randn(N, K) * 0.05, "block_128x128")
    args = (x, w.codes, w.scales, w.s_dec, None, "site", "nvfp4", 0.5, "gathered", "batch", None)
    fargs = (x, wf.data, wf.scale, None, "site", "block_1x128", "block_128x128")
    with ops.use_kernels("triton"):
        y, yf = ops.nvfp4_linear(*args), ops.fp8_linear(*fargs)
    assert "triton" in ops.kernel_backends("nvfp4_linear") and "triton" in ops.kernel_backends("fp8_linear")
    assert _close_to_rounding(y, ops.nvfp4_linear(*args)), seed
    assert _close_to_rounding(yf, ops.fp8_linear(*fargs)), seed


@pytest.mark.parametrize(
    "act,wgt", [("block_1x128", "block_128x128"), ("per_token", "per_tensor"), ("per_tensor", "block_128x128")]
)
def test_fp8_linear(act, wgt):
    seed = fresh_seed()
    w = fp8_quantize(torch.randn(N, K) * 0.05, wgt)
    x = activations(19, K, torch.float32)
    aspec = FP8Spec(role="activation", granularity=act)
    y = fp8_linear_triton(x, w.data, w.scale, None, act_spec=aspec, w_spec=w.spec)
    ref = fp8_dequantize(fp8_quantize(x, spec=aspec), torch.float32).double() @ fp8_dequantize(w, torch.float32).double().t()
    assert rel_fro(y, ref) < 1e-5, seed


@pytest.mark.parametrize("tiles,promote_k", [("large", 128), ("large", 1), ("large", 0), ("small_m128_splitk", 1),
                                             ("small_m128_splitk", 256)])
@pytest.mark.parametrize("mode,selection", [("masked", "batch"), ("gathered", "token"), ("gathered", "batch")])
def test_w4a4_rac_large_path_tiles(mode, selection, tiles, promote_k):
    """GPU tile shapes with the RAC operand: ``large`` = the prefill tiling (BM = BN = 128, BK = 64,
    8 warps); ``small_m128_splitk`` = the small-M kernel at 64 < M <= 128 (two 64-row tiles,
    BN = 64, BK = 128, split-K 2 + the reduce kernel), the route ``launch_nvfp4_gemm`` takes there.

    Regression for the H200 failure of the dense RAC second segment at M = 2048 (rel err 4e-3,
    docs/results/h200/selfcheck.json): the dense operand now shares the K loop and the decoded
    weight tile with the main operand. The interpreter cannot reproduce a GPU miscompile; this pins
    the arithmetic of the large-tile kernel (two M tiles, a ragged K tail, the 32-wide gathered tile)
    with each accumulation (``promote_k``: products per promoted partial sum; 128 = chunks of two
    64-wide tiles, the nested-loop form of the large-M default; 1 = every tile, the small-M default;
    0 = the whole sum in the dot).
    """
    import triton

    from qpass.backends.triton._loader import kernel_lib
    from qpass.quant.nvfp4 import nvfp4_operand
    from qpass.quant.rac import rac_reference, residual_operand, scatter_gathered

    G = kernel_lib(torch.device("cpu")).nvfp4_gemm  # the interpreter's copy of the kernel module

    seed = fresh_seed()
    m, n, k = (130, 128, 208) if tiles == "large" else (128, 72, 400)
    w = nvfp4_quantize(torch.randn(n, k) * 0.05)
    x = activations(m, k, torch.bfloat16)
    # the GEMM operands as ``rac_run(..., outputs="gemm")`` hands them to the kernel, built from the
    # reference (bit-identical to the Triton RAC kernels: test_triton_rac.py::test_rac_gemm_operands;
    # the interpreter's RAC kernels cost ~90% of this test's CPU time): B_X; masked: dense B_R;
    # gathered/batch: B_R [M, K'] + int32 column index; gathered/token: B_R scattered to dense [M, K]
    cfg = RACConfig(0.5, mode, selection)
    res = rac_reference(x, cfg, NVFP4_ACT)
    b_x, a2, gather_idx = nvfp4_operand(res.qa, torch.bfloat16), residual_operand(res), None
    if res.gather_index is not None and res.gather_index.dim() == 2:
        a2 = scatter_gathered(a2, res.gather_index, k)  # exact: disjoint values
    elif res.gather_index is not None:
        gather_idx = res.gather_index.to(torch.int32)
    a2 = a2.to(torch.bfloat16)
    xs, rs = res.qa.s_dec.reshape(1).float(), res.qr.s_dec.reshape(1).float()
    ref = factored_exact(x, w, act=NVFP4_ACT, rac=cfg)
    out = torch.full((m, n), float("nan"))
    sdec = w.s_dec.reshape(1).float()
    gidx = gather_idx if gather_idx is not None else sdec
    bm, bn, bk, split, warps = (128, 128, 64, 1, 8) if tiles == "large" else (64, 64, 128, 2, 4)
    ws = torch.full((2 * split, m, n), float("nan")) if split > 1 else sdec
    G._nvfp4_gemm_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm), split)](
        b_x, b_x.stride(0), w.codes, w.codes.stride(0), w.scales.view(torch.uint8), w.scales.stride(0), sdec, xs,
        a2, a2.stride(0), a2.shape[1], gidx, rs, sdec, out, out.stride(0), ws, m, n, k, 256,
        BM=bm, BN=bn, BK=bk, SPLIT_K=split, STAGES=1, SEG2=1 if gather_idx is None else 2, A_F32=False,
        HAS_BIAS=False, OUT_DTYPE=triton.language.float32, DECODE=0, PROMOTE_K=promote_k, XS=1, RS=1, num_warps=warps,
        enable_fp_fusion=False,
    )
    if split > 1:
        G._splitk_reduce_kernel[(triton.cdiv(m * n, 1024),)](
            ws, sdec, out, out.stride(0), m, n, sdec, xs, rs, SPLIT_K=split, HAS_BIAS=False,
            OUT_DTYPE=triton.language.float32, BLOCK=1024, SEG2=1, XS=1, RS=1, num_warps=4, enable_fp_fusion=False,
        )
    assert rel_fro(out, ref) < 1e-5, seed
