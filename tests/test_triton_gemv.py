"""Small-M NVFP4 GEMV (``kernels/nvfp4_gemv.py``) vs the reference and the tensor-core GEMM (CPU interpreter).

The contract is the GEMM's (``linear.py``: "outputs equal the reference up to the order of float32
summation"; ``selfcheck``: relative Frobenius error < 1e-5 vs the fp64 factored product of the
same operands, SPEC §3.1; bf16/fp16 outputs within one rounding step of the reference op). The GEMM's
own summation order cannot be reproduced (its K-tile sums run inside the tensor cores, whose
additions are not IEEE), so no test asserts bit-identity with it on general inputs. Where the
arithmetic is exact - every product and partial sum representable in float32, so every summation
order gives the same bits - the GEMV must equal the reference and the GEMM bit for bit
(``torch.equal``), and one-hot activation rows must return ``fl(B * S_dec)`` exactly.
"""

from __future__ import annotations

import pytest
import torch
import triton

from qpass.quant.linear import w4a4_linear_reference, w4a16_linear_reference
from qpass.quant.nvfp4 import nvfp4_dequantize, nvfp4_quantize
from qpass.formats.spec import NVFP4_ACT
from qpass.quant.rac import RACConfig

from qpass.backends.triton import w4a4_linear_triton, w4a16_linear_triton
from qpass.backends.triton._loader import kernel_lib

try:  # tests/ may or may not be a package
    from ._triton_testutil import activations, factored_exact, fresh_seed, rel_fro
except ImportError:
    from _triton_testutil import activations, factored_exact, fresh_seed, rel_fro

GV = kernel_lib(torch.device("cpu")).nvfp4_gemv  # the interpreter's copy
N, K = 20, 176  # N: not a multiple of the 8-row interpreter tile; K: 2 full 64-wide tiles + a 48-column tail


def _weight(n=N, k=K, special=True):
    wf = torch.randn(n, k) * 0.05
    if not special:
        return nvfp4_quantize(wf), None
    wf[1, 16:32] = 0.0  # a zero block (scale byte 0)
    wf[2, 32:48] *= 1e-5  # a block whose E4M3 scale is subnormal (next to the rest of the tensor)
    w = nvfp4_quantize(wf)
    sc = w.scales.view(torch.uint8)
    assert int(sc[1, 1]) == 0 and 0 < int(sc[2, 2]) < 8, "the test weight must hold a zero and a subnormal scale"
    return w, nvfp4_dequantize(w, torch.float32)  # fl(B * S_dec): a one-hot row's output


def _gemv(x, w, out_dtype=torch.float32, bias=None, **kw):
    out = torch.full((x.shape[0], w.codes.shape[0]), float("nan"), dtype=out_dtype)
    GV.launch_nvfp4_gemv(x, w.codes, w.scales.view(torch.uint8), w.s_dec.reshape(1).float(), out, bias=bias, **kw)
    return out


def _close_to_rounding(y: torch.Tensor, ref: torch.Tensor) -> bool:
    eps = torch.finfo(y.dtype).eps
    return bool(((y.float() - ref.float()).abs() <= eps * ref.float().abs() + 1e-6).all())


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gemv_error_bound(m):
    """fp32 output (the accumulator times alpha) vs the fp64 factored product: the GEMM's bound;
    split-K and the unsplit form both; bias; masked rows (M = 3 runs the 4-row kernel)."""
    seed = fresh_seed()
    w, _ = _weight()
    x = activations(m, K, torch.bfloat16)
    bias = torch.randn(N)
    ref = factored_exact(x, w, bias)
    for split in (1, 3):  # 3 splits over 3 K tiles: the tail tile in the last split
        y = _gemv(x, w, bias=bias, split_k=split)
        assert rel_fro(y, ref) < 1e-5, (seed, m, split)
    # the tensor-core GEMM path (interpreter) is held to the same bound on the same inputs
    y_gemm = w4a16_linear_triton(x, w.codes, w.scales, w.s_dec, bias, out_dtype=torch.float32, gemv=False)
    assert rel_fro(y_gemm, ref) < 1e-5, seed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gemv_dtypes_vs_reference_op(dtype):
    """bf16 / fp16 / fp32 activations in, the same dtype out, through ``w4a16_linear_triton``:
    within one output rounding step of ``w4a16_linear_reference`` (the GEMM tests' comparison)."""
    seed = fresh_seed()
    w, wh = _weight()
    x = activations(2, K, dtype)
    bias = torch.randn(N)
    y = w4a16_linear_triton(x, w.codes, w.scales, w.s_dec, bias, gemv=True)
    assert y.dtype == dtype
    ref = w4a16_linear_reference(x, w, bias)
    if dtype == torch.float32:
        assert rel_fro(y, factored_exact(x, w, bias)) < 1e-5, seed
    else:
        assert _close_to_rounding(y, ref), seed


def test_gemv_w4a4_on_the_activation_operand():
    """W4A4 (plain) at decode M: the GEMV on the quantization kernel's ``B_X`` with ``alpha``."""
    seed = fresh_seed()
    w, _ = _weight()
    x = activations(3, K, torch.bfloat16)
    y = w4a4_linear_triton(x, w.codes, w.scales, w.s_dec, act_spec=NVFP4_ACT, gemv=True)
    assert _close_to_rounding(y, w4a4_linear_reference(x, w, act_spec=NVFP4_ACT)), seed


def _exact_weight(n, k):
    """Weights whose every product with a small-integer activation, and every partial sum, is exact
    in float32: ``s_dec = 1``, E4M3 scales 0, 2^-9, 2^-7 (subnormal), 0.5, 1, random codes."""
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    # e4m3 bytes: 0 (zero block), 0x01 = 2^-9 and 0x04 = 2^-7 (subnormal), 0x30 = 0.5, 0x38 = 1
    choice = torch.tensor([0x00, 0x01, 0x04, 0x30, 0x38], dtype=torch.uint8)
    scales = choice[torch.randint(0, len(choice), (n, k // 16))]
    return codes, scales, torch.ones(1)


@pytest.mark.parametrize("m", [1, 4])
def test_gemv_bit_identical_where_exact(m):
    """Exact arithmetic: GEMV == fp64 reference == tensor-core GEMM path, ``torch.equal``.

    Every product is a multiple of 2^-10 (0.5 * 2^-9 * 1) of magnitude <= 6 * 1 * 4, so every partial
    sum of the K = 208 terms is a multiple of 2^-10 below 208 * 24 < 2^13: 23 significant bits,
    exact in float32 whatever the summation order - the comparison the GEMM satisfies too."""
    seed = fresh_seed()
    n, k = 12, 208
    codes, scales, sdec = _exact_weight(n, k)
    x = torch.randint(-4, 5, (m, k)).to(torch.bfloat16)
    out = torch.empty(m, n)
    GV.launch_nvfp4_gemv(x, codes, scales, sdec, out)
    wh = _decoded(codes, scales, sdec)
    ref = (x.double() @ wh.double().t()).float()
    assert torch.equal(out, ref), seed
    gemm = torch.empty(m, n)
    kernel_lib(torch.device("cpu")).nvfp4_gemm.launch_nvfp4_gemm(x, codes, scales, sdec, gemm)
    assert torch.equal(gemm, ref) and torch.equal(out, gemm), seed


def _decoded(codes, scales, sdec):
    """Reference decode ``bf16(fl(fl(e2m1 * s_b) * s_dec))`` of raw code / scale bytes (as float32; with
    ``s_dec = 1`` it is the operand ``B`` itself)."""
    from qpass.formats.e2m1 import e2m1_decode, unpack_e2m1

    v = e2m1_decode(unpack_e2m1(codes)).float()
    s = scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, 1)
    return ((v * s) * sdec.float()).to(torch.bfloat16).float()


def test_gemv_decode_exact_one_hot():
    """One-hot rows pick single weight columns: ``fl(B * S_dec)`` comes out exactly."""
    seed = fresh_seed()
    w, wh = _weight()
    cols = torch.tensor([0, 17, 40, K - 1])  # incl. the zero block, the subnormal-scale block, the tail
    x = torch.zeros(4, K, dtype=torch.bfloat16)
    x[torch.arange(4), cols] = 1.0
    y = _gemv(x, w)
    assert torch.equal(y, wh[:, cols].t()), seed


def test_gemv_unpaired_rows_and_determinism():
    """A bf16 row stride that is odd (rows read element by element, not as int32 pairs) gives the
    same bits as the paired read; repeated calls are bit-identical (no atomics)."""
    seed = fresh_seed()
    w, _ = _weight()
    base = activations(2, K + 1, torch.bfloat16)
    x_odd = base[:, :K]  # stride K + 1: odd
    assert x_odd.stride(0) % 2 == 1
    y_odd = _gemv(x_odd, w)
    y_pair = _gemv(x_odd.contiguous(), w)
    assert torch.equal(y_odd, y_pair), seed
    assert torch.equal(_gemv(x_odd.contiguous(), w), y_pair), seed


def test_gemv_dispatch(monkeypatch):
    """Routing: CPU default = GEMM; ``gemv=True`` / ``QPASS_NVFP4_GEMV=on`` = GEMV for M <= 4 only;
    ``off`` / ``gemv=False`` / RAC = GEMM; a bad switch value raises."""
    calls = []
    orig = GV.launch_nvfp4_gemv
    monkeypatch.setattr(GV, "launch_nvfp4_gemv", lambda *a, **kw: (calls.append(a[0].shape[0]), orig(*a, **kw))[1])
    w, _ = _weight(8, 32, special=False)
    x1 = activations(1, 32, torch.bfloat16)
    w4a16_linear_triton(x1, w.codes, w.scales, w.s_dec)
    assert calls == []
    w4a16_linear_triton(x1, w.codes, w.scales, w.s_dec, gemv=True)
    assert calls == [1]
    monkeypatch.setenv("QPASS_NVFP4_GEMV", "on")
    w4a16_linear_triton(x1, w.codes, w.scales, w.s_dec)
    w4a16_linear_triton(activations(5, 32, torch.bfloat16), w.codes, w.scales, w.s_dec)  # M = 5: GEMM
    w4a16_linear_triton(x1, w.codes, w.scales, w.s_dec, gemv=False)
    w4a4_linear_triton(x1, w.codes, w.scales, w.s_dec, act_spec=NVFP4_ACT, rac=RACConfig(0.5, "gathered", "batch"))
    assert calls == [1, 1]
    monkeypatch.setenv("QPASS_NVFP4_GEMV", "off")
    w4a16_linear_triton(x1, w.codes, w.scales, w.s_dec)
    assert calls == [1, 1]
    monkeypatch.setenv("QPASS_NVFP4_GEMV", "fast")
    with pytest.raises(ValueError, match="QPASS_NVFP4_GEMV must be one of"):
        w4a16_linear_triton(x1, w.codes, w.scales, w.s_dec)


def test_gemv_auto_row_limit_follows_the_measured_crossover():
    """``auto``: Llama-8B weights (>= 16.8M elements) up to M = 2, SmolLM2 weights up to M = 4."""
    assert GV.gemv_auto_max_m(4096, 4096) == 2
    assert GV.gemv_auto_max_m(14336, 4096) == 2
    assert GV.gemv_auto_max_m(4096, 14336) == 2
    assert GV.gemv_auto_max_m(1536, 576) == 4
    assert GV.gemv_auto_max_m(576, 1536) == 4
    assert GV.gemv_auto_max_m(2048, 2048) == 4  # exactly 4M elements: not above the limit


def test_gemv_split_heuristic():
    """Target shapes run unsplit (one launch); split-K only for few weight rows and long K."""
    assert GV.gemv_split(4096, 4096, 132) == 1
    assert GV.gemv_split(14336, 4096, 132) == 1
    assert GV.gemv_split(4096, 14336, 132) == 1
    assert GV.gemv_split(576, 1536, 132) == 1
    assert GV.gemv_split(256, 8192, 132) == 4  # 32 programs of 8 rows: 4 splits of 2048 columns
    assert triton.cdiv(256, GV.SPLIT_BN) * GV.gemv_split(256, 8192, 132) <= 132


def test_gemv_k_shorter_than_a_tile():
    """K = 48 < the 64-wide interpreter tile: no full tile (the prefetched first tile is masked
    off), only the ragged one; N = 9: one full 8-row program and one with 1 row."""
    seed = fresh_seed()
    w = nvfp4_quantize(torch.randn(9, 48) * 0.05)
    x = activations(2, 48, torch.bfloat16)
    assert rel_fro(_gemv(x, w), factored_exact(x, w)) < 1e-5, seed
