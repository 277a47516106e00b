"""The NVFP4 reference quantizer (SPEC §3): hand-computed known answers, properties, bad input.

Notation in the comments: fl(.) = one float32 round-to-nearest-even; S_enc = fl(2688/amax),
S_dec = fl(1/S_enc), mult = fl(S_enc * fl(1/6)) with fl(1/6) = 0x3E2AAAAB = 0.16666667163372,
sf = fl(vmax * mult), s_b = e4m3_rne(min(sf, 448)), enc = min(fl(1/fl(s_b * S_dec)), FLT_MAX),
y = clamp(fl(x * enc), -6, 6), code = e2m1_rne(y) (magnitude index | sign << 3).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qpass.errors import QuantizationError
from qpass.formats.e2m1 import e2m1_decode
from qpass.formats.fp32 import FLT_MAX, bits
from qpass.formats.spec import NVFP4_ACT_PER_TOKEN
from qpass.parity.object import compare_parity, parity_object
from qpass.quant.nvfp4 import (
    NVFP4Tensor,
    block_scales,
    global_scales,
    nvfp4_dequantize,
    nvfp4_quantize,
    quantize_with_amax,
)


def _bf16(values: list[float], width: int = 16) -> torch.Tensor:
    x = torch.zeros(1, width, dtype=torch.float32)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float64).float()
    out = x.bfloat16()
    assert torch.equal(out.float(), x), "known-answer inputs must be exact bf16 values"
    return out


def _scale_bytes(q: NVFP4Tensor) -> list[int]:
    return q.scales.view(torch.uint8).flatten().tolist()


def _bits(t: torch.Tensor) -> int:
    return int(bits(t.float().reshape(()))) & 0xFFFFFFFF


# =============================================================================================
# known answers (hand computation in the comments)


def test_every_e2m1_tie_inside_a_real_block():
    # amax = 2.625 -> S_enc = 2688/2.625 = 1024 exactly (0x44800000), S_dec = 2^-10 (0x3A800000),
    # mult = 1024 * fl(1/6) = 170.66667175 (exact: a power-of-two multiple).
    # Block 0 = [2.625, 0 x 15]: sf = fl(2.625 * 170.66667175) = fl(448.0000019) = 448.0 -> s_b = 448 (0x7E);
    #   enc = fl(1/fl(448 * 2^-10)) = fl(2.2857142857) = 2.2857143879; y = fl(2.625 * 2.2857143879)
    #   = 6.0000005 -> clamped to 6 -> code 7; zeros -> code 0.
    # Block 1 = 2^-10 * [6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -.25, -.75, -1.25, -1.75, -2.5, -3.5, -5, -6]:
    #   vmax = 6 * 2^-10; sf = fl(6 * 2^-10 * 170.66667175) = 4 * fl(1.5 * fl(1/6)) and
    #   1.5 * 0x3E2AAAAB = 1.5 * 11184811 * 2^-26 = 16777216.5 * 2^-26 -> rounds to 2^24 * 2^-26, so
    #   sf = 1.0 exactly -> s_b = 1.0 (0x38); enc = fl(1/fl(1.0 * 2^-10)) = 1024, y = x * 1024 exactly:
    #   every element lands exactly on an E2M1 midpoint: .25->0 .75->1 1.25->1 1.75->2 2.5->2 3.5->4 5->4
    #   codes [7, 0, 2, 2, 4, 4, 6, 6,  8, 10, 10, 12, 12, 14, 14, 15]  (-0.25 -> 0 with the sign kept: 0x8)
    #   packed low nibble first: 0x07 0x22 0x44 0x66 0xA8 0xCA 0xEC 0xFE
    ties = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5]
    block1 = [t * 2.0**-10 for t in ties] + [-t * 2.0**-10 for t in ties[1:]] + [-6 * 2.0**-10]
    x = torch.cat([_bf16([2.625]), _bf16(block1)], dim=1)
    q = nvfp4_quantize(x)
    assert _bits(q.s_enc) == 0x44800000 and _bits(q.s_dec) == 0x3A800000
    assert _scale_bytes(q) == [0x7E, 0x38]
    assert q.unpacked_codes()[0, 16:].tolist() == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 15]
    assert q.codes[0].tolist() == [0x07, 0, 0, 0, 0, 0, 0, 0] + [0x07, 0x22, 0x44, 0x66, 0xA8, 0xCA, 0xEC, 0xFE]
    # dequant: e2m1 * s_b * S_dec, all exact here
    expected = [6, 0, 1, 1, 2, 2, 4, 4, -0.0, -1, -1, -2, -2, -4, -4, -6]
    assert nvfp4_dequantize(q, torch.float32)[0, 16:].tolist() == [v * 2.0**-10 for v in expected]
    assert nvfp4_dequantize(q, torch.float32)[0, 0].item() == 6 * 448 * 2.0**-10  # 2.625


def test_block_scale_on_an_e4m3_midpoint_d1():
    # D1 (prior-art §8): amax = 0.8125, block vmax = bf16 0x3C9C = 39/2048 = 0.01904296875.
    # Exact scale vmax * 2688 / (6 * amax) = 21/2 = 10.5: the E4M3 midpoint of 10 (0x52, even
    # mantissa) and 11 (0x53). TE arithmetic:
    #   S_enc = fl(43008/13 = 3308.3076923) = 3308.3076171875 (0x454EC4EC)
    #   S_dec = fl(1/S_enc) = 3.0226935e-4 (0x399E79E8)
    #   mult  = fl(3308.3076171875 * 0.16666667163) = fl(551.38461930) = 551.3846435546875
    #   sf    = fl(39/2048 * 551.3846435546875) = fl(10.50000054) = 10.500000953674316 (0x41280001)
    #   -> above the midpoint -> s_b = 11 (0x53).  (vLLM's gs*fl(vmax*fl(1/6)) gives exactly 10.5 -> 10.)
    # Block elements [vmax, vmax/2, -vmax/4, vmax/8]: enc = fl(1/fl(11 * S_dec)) = fl(1/0.003324963)
    #   = 300.75522; y = 5.727272, 2.863636, -1.431818, 0.715909 -> codes 7 (6), 5 (3), 11 (-1.5), 1 (0.5).
    # Block 0 = [0.8125, 0...]: sf = fl(0.8125 * 551.38464) = 448.00003 -> min(., 448) -> 0x7E;
    #   y = fl(0.8125 * fl(1/fl(448 * S_dec))) = 5.9999995 -> code 7.
    vmax = 39 / 2048
    x = torch.cat([_bf16([0.8125]), _bf16([vmax, vmax / 2, -vmax / 4, vmax / 8])], dim=1)
    assert x[0, 16].view(torch.int16).item() == 0x3C9C
    q = nvfp4_quantize(x)
    assert _bits(q.s_enc) == 0x454EC4EC and _bits(q.s_dec) == 0x399E79E8
    assert _scale_bytes(q) == [0x7E, 0x53]
    assert q.unpacked_codes()[0, 16:20].tolist() == [7, 5, 11, 1]
    assert q.unpacked_codes()[0, 0].item() == 7


def test_element_on_an_e2m1_midpoint_d2():
    # D2 (prior-art §9): amax = 3.84375 -> S_enc = fl(699.31707317) = 699.3170776 (0x442ED44B),
    # S_dec = fl(1/S_enc) = 0.0014299665 (0x3ABB6DB7), mult = 116.55285.
    # Block 1 = [0.04296875, x = bf16 0x3CCD = 205/8192 = 0.0250244140625]: sf = fl(0.04296875 * 116.55285)
    #   = 5.0081301 -> s_b = 5 (0x4A). Exact x * 2688 / (amax * 5) = 3.5: an E2M1 midpoint (3 | 4).
    #   TE: enc = fl(1/fl(5 * S_dec)) = fl(1/0.0071498328) = 139.8634033 (0x430BDD08),
    #       y = fl(x * enc) = 3.4999998 (0x405FFFFF) -> below the tie -> code 5 (3.0).
    #   (torchao's x * fl(fl(1/pts)/5) = x * 139.8634186 = 3.5 exactly -> tie -> code 6 (4.0).)
    x = torch.cat([_bf16([3.84375]), _bf16([0.04296875, 205 / 8192])], dim=1)
    q = nvfp4_quantize(x)
    assert _bits(q.s_enc) == 0x442ED44B and _bits(q.s_dec) == 0x3ABB6DB7
    assert _scale_bytes(q) == [0x7E, 0x4A]
    assert q.unpacked_codes()[0, 16:18].tolist() == [7, 5]


def test_all_zero_block_and_negative_zero():
    # Block 1 all zeros (some -0.0): vmax = 0 -> sf = 0 -> s_b = 0 (byte 0x00);
    # enc = min(1/(0 * S_dec) = inf, FLT_MAX) = FLT_MAX; y = (+-0) * FLT_MAX = +-0 -> code 0
    # (-0.0 is not < 0: code 0x0, as in the TE reference). Dequant: exactly 0.
    x = torch.cat([_bf16([1.0, -0.5]), _bf16([0.0, -0.0, 0.0, -0.0])], dim=1)
    q = nvfp4_quantize(x)
    assert _scale_bytes(q)[1] == 0x00
    assert q.unpacked_codes()[0, 16:].tolist() == [0] * 16
    assert torch.equal(nvfp4_dequantize(q, torch.float32)[0, 16:], torch.zeros(16))
    # block 0: amax = 1 -> S_enc = 2688, S_dec = fl(1/2688); sf = fl(1 * fl(2688 * fl(1/6))) = 448.00002 -> 448;
    # x = 1 -> y = 6 (code 7), x = -0.5 -> y = -3.0000002 -> code 13 (-3)
    assert q.unpacked_codes()[0, :2].tolist() == [7, 13]


def test_amax_zero_tensor():
    # amax = 0 -> 2688/0 = inf -> replaced by S_enc = 1 (rule), S_dec = 1; every block as above.
    x = torch.zeros(3, 32, dtype=torch.bfloat16)
    x[1, 5] = -0.0
    q = nvfp4_quantize(x)
    assert _bits(q.s_enc) == 0x3F800000 and _bits(q.s_dec) == 0x3F800000
    assert _scale_bytes(q) == [0] * 6
    assert q.codes.tolist() == [[0] * 16] * 3
    assert q.amax.item() == 0.0
    assert torch.equal(nvfp4_dequantize(q), torch.zeros(3, 32, dtype=torch.bfloat16))


def test_subnormal_e4m3_block_scale():
    # amax = 2.625 (S_enc = 1024, S_dec = 2^-10 as above). Block 1 vmax = 30 * 2^-19 = 5.72e-5:
    #   sf = fl(30 * 2^-19 * 170.66667175) = fl(5/512 * (1 + 3e-8)) = 5/512 = 0.009765625 < 2^-6:
    #   the E4M3 subnormal grid is k * 2^-9, sf = 5 * 2^-9 exactly -> s_b = 5 * 2^-9 (byte 0x05).
    #   enc = fl(1/fl(5 * 2^-9 * 2^-10)) = fl(2^19 / 5 = 104857.6) = 104857.6015625;
    #   elements k * 2^-19 give y = fl(k * 0.20000000298):
    #   k  = 30   1    2    4    5    7    10   12   13   15   17   20   25   0   -30  -13
    #   y  = 6    .2   .4   .8   1.0  1.4  2.0  2.4  2.6  3.0  3.4  4.0  5.0  0   -6   -2.6
    #   (k = 25: 25 * 104857.6015625 * 2^-19 = 5.0000000745 rounds to exactly 5.0 in fp32: a tie -> 4)
    #   code 7    0    1    2    2    3    4    4    5    5    5    6    6    0   15   13
    ks = [30, 1, 2, 4, 5, 7, 10, 12, 13, 15, 17, 20, 25, 0, -30, -13]
    x = torch.cat([_bf16([2.625]), _bf16([k * 2.0**-19 for k in ks])], dim=1)
    q = nvfp4_quantize(x)
    assert _scale_bytes(q) == [0x7E, 0x05]
    assert q.scales.float()[0, 1].item() == 5 * 2.0**-9
    assert q.unpacked_codes()[0, 16:].tolist() == [7, 0, 1, 2, 2, 3, 4, 4, 5, 5, 5, 6, 6, 0, 15, 13]
    assert q.codes[0, 8:].tolist() == [0x07, 0x21, 0x32, 0x44, 0x55, 0x65, 0x06, 0xDF]


def test_satfinite_clamps_prevent_overflow():
    # (1) A block scale above 448 saturates to 448 (0x7E) instead of becoming NaN (0x7F). With a
    #     fresh amax sf <= 448 * (1 + 3 ulp); a stale global makes it larger. quantize_with_amax skips
    #     the staleness check, so amax = 1 for data with max 2: sf = fl(2 * fl(2688 * fl(1/6))) = 896.00004.
    x = _bf16([2.0, -2.0, 1.0])
    q = quantize_with_amax(x, torch.tensor(1.0))
    assert _scale_bytes(q) == [0x7E]
    # a non-saturating cast (ml_dtypes; eager torch <= 2.11) gives NaN for 896:
    assert np.isnan(np.float32(896.00004).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    # elements: enc = fl(1/fl(448 * S_dec)) with S_dec = fl(1/2688): y(2) = 12.000001 -> clamp 6 -> code 7;
    # y(1) = 6.0000005 -> code 7
    assert q.unpacked_codes()[0, :3].tolist() == [7, 15, 7]
    # (2) S_enc = 2688/amax overflows float32 for amax < 7.9e-36: min(inf, FLT_MAX) keeps it finite and
    #     S_dec = fl(1/FLT_MAX) = 2^-128 (0x00200000) instead of 0. amax = 1e-38 (fp32 input):
    xt = torch.zeros(1, 16)
    xt[0, 0] = 1e-38
    qt = nvfp4_quantize(xt)
    assert _bits(qt.s_enc) == 0x7F7FFFFF and _bits(qt.s_dec) == 0x00200000
    # mult = fl(FLT_MAX * fl(1/6)), sf = fl(1e-38 * mult) = 0.567 -> s_b = 0.5625; enc = 1/(0.5625*2^-128)
    # overflows -> FLT_MAX; y = fl(1e-38 * FLT_MAX) = 3.4028 -> code 5 (3.0). No NaN/inf anywhere, but the
    # value decodes to 3 * 0.5625 * 2^-128 = 4.96e-39: the FLT_MAX clamps cost precision this far down.
    assert qt.scales.float().item() == 0.5625
    assert qt.unpacked_codes()[0, 0].item() == 5
    assert torch.isfinite(nvfp4_dequantize(qt, torch.float32)).all()
    # (3) zero block scale: enc = min(1/0, FLT_MAX) = FLT_MAX (not inf), so 0 * enc = 0 (not NaN)
    s_enc, s_dec = global_scales(torch.tensor(1.0))
    assert block_scales(torch.tensor([0.0]), s_enc).item() == 0.0
    # (4) float32 inputs near FLT_MAX: the block at amax = FLT_MAX decodes to FLT_MAX, no inf
    xb = torch.zeros(1, 16)
    xb[0, 0] = FLT_MAX
    xb[0, 1] = -FLT_MAX / 3
    qb = nvfp4_quantize(xb)
    deq = nvfp4_dequantize(qb, torch.float32)
    assert torch.isfinite(deq).all() and deq[0, 0].item() == FLT_MAX
    assert qb.unpacked_codes()[0, :2].tolist() == [7, 12]  # 6, -2 (y = -2.0000002)


# =============================================================================================
# property tests

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
PATTERNS = ["normal", "ties", "outlier", "zero_blocks", "denormal", "student_t"]


def _make_input(seed: int, rows: int, nblocks: int, dtype: torch.dtype, log10_mag: float, pattern: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = 16 * nblocks
    if dtype == torch.float16:
        log10_mag = max(-3.0, min(3.0, log10_mag))  # keep fp16 data out of inf and mostly out of subnormals
    mag = 10.0**log10_mag
    if pattern == "normal":
        x = torch.randn(rows, k, generator=g) * mag
    elif pattern == "student_t":
        x = torch.randn(rows, k, generator=g) / torch.rand(rows, k, generator=g).clamp(min=0.02) * mag
    elif pattern == "ties":
        # integers times a power of two: bf16 data with many exact E2M1/E4M3 midpoints
        e = math.floor(math.log2(mag)) - 6
        x = torch.randint(-100, 101, (rows, k), generator=g).float() * 2.0**e
    elif pattern == "outlier":
        x = torch.randn(rows, k, generator=g) * mag * 1e-3
        x.view(rows, nblocks, 16)[:, :, 0] = mag * (1 + torch.rand(rows, nblocks, generator=g))
    elif pattern == "zero_blocks":
        x = torch.randn(rows, k, generator=g) * mag
        x.view(rows, nblocks, 16)[:, ::2, :] = 0.0
        x.view(rows, nblocks, 16)[:, 1::3, 3] = -0.0
    else:  # denormal: subnormal values of the dtype beside normal ones
        tiny = {torch.bfloat16: 1e-39, torch.float16: 3e-6, torch.float32: 1e-41}[dtype]
        x = torch.randn(rows, k, generator=g) * tiny
        x[:, ::5] = torch.randn(rows, (k + 4) // 5, generator=g) * (mag if dtype != torch.float16 else 1.0)
    if dtype == torch.float16:
        x = x.clamp(-60000.0, 60000.0)
    return x.to(dtype)


input_params = st.tuples(
    st.integers(0, 2**31 - 1),
    st.integers(1, 4),
    st.integers(1, 4),
    st.sampled_from(DTYPES),
    st.floats(-30.0, 30.0),
    st.sampled_from(PATTERNS),
)

PROP = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _grid_half_step(t: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 grid spacing around |y| = t (in units of the block's decode step D)."""
    return torch.where(t < 2, 0.25, torch.where(t < 4, 0.5, 1.0)).double()


@PROP
@given(input_params)
def test_error_at_most_half_the_local_grid_step(params):
    """|x - x_hat| <= (h/2) * D + |x| * 2^-21 + |x_hat| * 2^-24, or x_hat = +-6 D when |x| > 6 D.

    D = s_b * S_dec (exact in float64) is the decode step of the block: values are q * D. h is the
    E2M1 spacing at |x|/D (0.5 below 2, 1 below 4, 2 up to 6), so h/2 * D is the largest
    round-to-nearest error. The two slack terms bound float32 rounding: y = fl(x * fl(1/fl(D))) is
    x/D to within 3 roundings (relative 3 * 2^-24 < 2^-21), which can move a near-tie to the other
    neighbour, and x_hat = fl(q * s_b * S_dec) is one more rounding. Elements with |x| > 6 D (the
    block max when E4M3 rounded s_b down) saturate: x_hat is exactly fl(+-6 * s_b * S_dec). A block
    with s_b = 0 decodes to 0 and then |x| <= vmax < (2^-10 / mult)(1 + 2^-22): its scale underflowed.
    """
    seed, rows, nblocks, dtype, mag, pattern = params
    x = _make_input(seed, rows, nblocks, dtype, mag, pattern)
    q = nvfp4_quantize(x)
    xh = nvfp4_dequantize(q, torch.float32).double().reshape(rows, nblocks, 16)
    xd = x.double().reshape(rows, nblocks, 16)
    s_b = q.scales.double().unsqueeze(-1)
    step = s_b * q.s_dec.double()
    zero = (s_b == 0).expand_as(xd)
    assert torch.all(xh[zero] == 0)
    mult = float(q.s_enc) * float(torch.tensor(1 / 6, dtype=torch.float32))
    assert torch.all(xd[zero].abs() <= 2.0**-10 / mult * (1 + 2.0**-22))
    t = torch.where(step > 0, xd.abs() / torch.where(step > 0, step, 1.0), 0.0)
    slack = xd.abs() * 2.0**-21 + xh.abs() * 2.0**-24
    inside = (~zero) & (t <= 6 * (1 + 2.0**-21))
    err = (xd - xh).abs()
    assert torch.all(err[inside] <= (_grid_half_step(t) * step)[inside] + slack[inside])
    sat = (~zero) & ~inside
    six = (6 * step).float().double().expand_as(xd)  # fl(6 * s_b * S_dec)
    assert torch.all(xh[sat].abs() == six[sat])
    assert torch.all(torch.sign(xh[sat]) == torch.sign(xd[sat]))


@PROP
@given(input_params)
def test_sign_symmetry(params):
    seed, rows, nblocks, dtype, mag, pattern = params
    x = _make_input(seed, rows, nblocks, dtype, mag, pattern)
    qp, qn = nvfp4_quantize(x), nvfp4_quantize(-x)
    assert torch.equal(qp.scales.view(torch.uint8), qn.scales.view(torch.uint8))
    assert _bits(qp.s_dec) == _bits(qn.s_dec)
    cp, cn = qp.unpacked_codes(), qn.unpacked_codes()
    assert torch.equal(cp & 0x7, cn & 0x7)  # same magnitudes everywhere
    mag = (cp & 0x7) != 0
    assert torch.equal(cn[mag], cp[mag] ^ 0x8)  # nonzero codes flip exactly their sign bit
    # magnitude-0 codes: +-0.0 input, or y = fl(x * enc) underflowed to +-0, encode as 0x0; a tiny
    # y != 0 keeps its sign (0x8 for negative). Either way 0x0 and 0x8 are the same value (rule 4).
    zero_in = x == 0
    assert torch.all(cp[zero_in] == 0) and torch.all(cn[zero_in] == 0)
    assert torch.equal(parity_object(qn).codes[mag.reshape(parity_object(qn).codes.shape)] ^ 0x8,
                       parity_object(qp).codes[mag.reshape(parity_object(qp).codes.shape)])


@PROP
@given(input_params, st.sampled_from([torch.float32, torch.bfloat16]))
def test_requantizing_the_dequantized_tensor_with_the_same_amax(params, deq_dtype):
    """Q(DQ(Q(x))) == Q(x) (canonical bytes) with the same amax, for every block whose scale is 0
    or a *normal* E4M3 value; blocks with a subnormal scale may differ.

    Why: with the same amax, S_enc/S_dec/mult are unchanged. A block with a normal s_b has its max
    element at |y| >= 6/(1 + 2^-4) > 5, i.e. code 6; its dequantized max 6 * s_b * S_dec gives
    sf' = s_b * (1 + d) with |d| <= 2^-9 (bf16 dequant) or 4 * 2^-24 (fp32), and s_b is an E4M3
    value at least 2^-5 (relative) from any E4M3 midpoint, so s_b' = s_b; every element then gives
    y' = q (1 + d'), and E2M1 values are 1/3 (relative) or more from a midpoint, so q' = q (a -0
    element re-encodes as +0: equal after canonicalisation). With a subnormal s_b = k * 2^-9 the
    block max can map to a code below 6 (E4M3 rounding up to 1.5x), so the re-derived scale is
    smaller. "Same amax" matters: max|DQ(Q(x))| may exceed max|x| by an ulp, which
    nvfp4_quantize would reject as stale, hence quantize_with_amax.
    """
    seed, rows, nblocks, dtype, mag, pattern = params
    x = _make_input(seed, rows, nblocks, dtype, mag, pattern)
    q1 = nvfp4_quantize(x)
    q2 = quantize_with_amax(nvfp4_dequantize(q1, deq_dtype), q1.amax)
    assert _bits(q1.s_dec) == _bits(q2.s_dec)
    p1, p2 = parity_object(q1), parity_object(q2)
    s = q1.scales.float()
    safe = (s == 0) | (s >= 2.0**-6)
    assert torch.equal(p1.scale_bytes[safe], p2.scale_bytes[safe])
    c1 = p1.codes.reshape(rows, nblocks, 16)
    c2 = p2.codes.reshape(rows, nblocks, 16)
    assert torch.equal(c1[safe], c2[safe])
    # the blocks that did change all have a subnormal scale and a largest code below 6
    changed = (p1.scale_bytes != p2.scale_bytes) | (c1 != c2).any(-1)
    maxcode = (c1 & 0x7).amax(-1)
    assert torch.all((s[changed] < 2.0**-6) & (s[changed] > 0) & (maxcode[changed] < 7))


def test_requantization_counterexample_with_subnormal_scale():
    # amax = 2.625 (S_enc = 1024, S_dec = 2^-10, mult = 1024 * fl(1/6)). Block vmax = 4.75 * 2^-18:
    #   sf = fl(4.75 * 2^-18 * 170.66667) = 1.5833 * 2^-9 -> E4M3 subnormal grid k * 2^-9 -> k = 2:
    #   s_b = 2^-8 (byte 0x02); y = vmax / (2^-8 * 2^-10) = 4.75 -> code 6 (4.0), not 6.0: a subnormal
    #   scale can round up by more than the 1/16 a normal one can.
    # DQ: x_hat = 4 * 2^-8 * 2^-10 = 2^-16. Requantized: sf' = 2^-16 * 170.66667 = 1.3333 * 2^-9 -> k = 1:
    #   s_b' = 2^-9 (byte 0x01) and y' = 2^-16 / 2^-19 = 8 -> clamped -> code 7: different bytes (and value).
    x = torch.cat([_bf16([2.625]), _bf16([4.75 * 2.0**-18])], dim=1)
    q1 = nvfp4_quantize(x)
    assert _scale_bytes(q1) == [0x7E, 0x02] and q1.unpacked_codes()[0, 16].item() == 6
    q2 = quantize_with_amax(nvfp4_dequantize(q1, torch.float32), q1.amax)
    assert _scale_bytes(q2) == [0x7E, 0x01] and q2.unpacked_codes()[0, 16].item() == 7
    assert not compare_parity(parity_object(q1), parity_object(q2)).ok


@settings(max_examples=25, deadline=None)
@given(input_params)
def test_dequantize_is_one_rounding_of_the_exact_product(params):
    seed, rows, nblocks, dtype, mag, pattern = params
    x = _make_input(seed, rows, nblocks, dtype, mag, pattern)
    q = nvfp4_quantize(x)
    vals = e2m1_decode(q.unpacked_codes()).double().reshape(rows, nblocks, 16)
    exact = (vals * q.scales.double().unsqueeze(-1) * q.s_dec.double()).reshape(rows, 16 * nblocks)  # <= 31 bits: exact
    assert torch.equal(nvfp4_dequantize(q, torch.float32), exact.float())
    assert torch.equal(nvfp4_dequantize(q, torch.bfloat16), exact.float().bfloat16())


@settings(max_examples=25, deadline=None)
@given(input_params)
def test_per_token_equals_per_row_quantization(params):
    seed, rows, nblocks, dtype, mag, pattern = params
    x = _make_input(seed, rows, nblocks, dtype, mag, pattern)
    q = nvfp4_quantize(x, spec=NVFP4_ACT_PER_TOKEN)
    assert q.s_dec.shape == (rows, 1)
    for r in range(rows):
        qr = nvfp4_quantize(x[r : r + 1])
        assert torch.equal(q.codes[r], qr.codes[0])
        assert torch.equal(q.scales[r].view(torch.uint8), qr.scales[0].view(torch.uint8))
        assert _bits(q.s_dec[r]) == _bits(qr.s_dec)
    assert torch.equal(q.dequantize(), torch.cat([nvfp4_quantize(x[r : r + 1]).dequantize() for r in range(rows)]))


def test_leading_dims_and_explicit_amax():
    x = _make_input(3, 6, 2, torch.bfloat16, -1.0, "ties")
    q2 = nvfp4_quantize(x)
    q3 = nvfp4_quantize(x.reshape(2, 3, 32))
    assert q3.codes.shape == (2, 3, 16) and q3.scales.shape == (2, 3, 2)
    assert torch.equal(q3.codes.reshape(6, 16), q2.codes)
    amax = x.abs().amax().float() * 2
    qa = nvfp4_quantize(x, amax)
    assert qa.amax.item() == amax.item()
    assert torch.equal(qa.codes, quantize_with_amax(x, amax).codes)
    q1 = nvfp4_quantize(x, amax.reshape(1))  # a [1]-shaped amax (checkpoint convention) is a scalar
    assert q1.s_dec.shape == () and torch.equal(q1.codes, qa.codes)


# =============================================================================================
# bad input


@pytest.mark.parametrize(
    "x, match",
    [
        (torch.tensor([[1.0, float("nan")] + [0.0] * 14]), "non-finite"),
        (torch.tensor([[1.0, float("inf")] + [0.0] * 14]), "non-finite"),
        (torch.tensor([[1.0, float("-inf")] + [0.0] * 14]), "non-finite"),
        (torch.ones(2, 24), "multiple of 16"),
        (torch.ones(32), "at least 2 dims"),
        (torch.ones(0, 16), "empty"),
        (torch.ones(2, 16, dtype=torch.int32), "dtype"),
        (torch.ones(2, 16, dtype=torch.uint8), "dtype"),
        (torch.ones(2, 16, dtype=torch.float64), "float64"),
    ],
)
def test_bad_input_raises_naming_tensor_and_site(x, match):
    with pytest.raises(QuantizationError, match=match) as e:
        nvfp4_quantize(x, name="w_up", site="model.layers.3.mlp.up_proj")
    assert "'w_up'" in str(e.value) and "model.layers.3.mlp.up_proj" in str(e.value)


def test_nan_error_gives_count_and_first_index():
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    x[1, 17] = float("nan")
    x[1, 20] = float("inf")
    with pytest.raises(QuantizationError, match=r"2 non-finite value\(s\).*first at index \(1, 17\)"):
        nvfp4_quantize(x, site="layers.0.attn.q_proj")


def test_stale_and_invalid_amax_raise():
    x = torch.ones(2, 16, dtype=torch.bfloat16)
    with pytest.raises(QuantizationError, match="stale amax for tensor 'w' at site s0"):
        nvfp4_quantize(x, 0.5, name="w", site="s0")
    with pytest.raises(QuantizationError, match="finite"):
        nvfp4_quantize(x, float("nan"), name="w")
    with pytest.raises(QuantizationError, match="finite"):
        nvfp4_quantize(x, -1.0, name="w")
    with pytest.raises(QuantizationError, match="shape"):
        nvfp4_quantize(x, torch.ones(3), name="w")
    # the current max itself is fine, and so is a larger one
    nvfp4_quantize(x, 1.0)
    nvfp4_quantize(x, 2.0)


def test_group_members_are_checked_and_share_the_amax():
    q = torch.ones(2, 16, dtype=torch.bfloat16)
    k = torch.full((2, 16), 3.0, dtype=torch.bfloat16)
    a = nvfp4_quantize(q, group=[k])
    assert a.amax.item() == 3.0
    bad = k.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(QuantizationError, match=r"'q.group\[0\]' at site L0"):
        nvfp4_quantize(q, group=[bad], name="q", site="L0")


def test_from_parts_round_trip_and_checks():
    x = _make_input(7, 3, 2, torch.bfloat16, 0.0, "normal")
    q = nvfp4_quantize(x)
    r = NVFP4Tensor.from_parts(q.codes, q.scales.view(torch.uint8), q.s_dec)  # raw bytes are reinterpreted
    assert r.scales.dtype == torch.float8_e4m3fn
    assert torch.equal(r.dequantize(), q.dequantize())
    with pytest.raises(QuantizationError, match="uint8"):
        NVFP4Tensor.from_parts(q.codes.to(torch.int32), q.scales, q.s_dec)
    with pytest.raises(QuantizationError, match="do not match"):
        NVFP4Tensor.from_parts(q.codes, q.scales[:, :1], q.s_dec)
    with pytest.raises(QuantizationError, match="float8_e4m3fn"):
        NVFP4Tensor.from_parts(q.codes, q.scales.float(), q.s_dec)


def test_rac_score_shift_on_device_equals_the_host_formula():
    """The capture-safe shift (a tensor, no float(amax)) has the host formula's value everywhere."""
    import math

    from qpass.quant.rac import score_shift, score_shift_tensor

    amaxes = [0.0, 1e-30, 2.0**-126, 3e-8, 0.5, 1.0, 1.5, 6.0, 448.0, 2688.0, 65504.0, 3e38]
    for a in amaxes:
        for rows in (1, 2, 3, 24, 4096):
            t = torch.tensor(a, dtype=torch.float32)
            assert int(score_shift_tensor(t, rows)) == score_shift(t, rows), (a, rows)
    # a hand value: amax 6 = 0.75 * 2^3, M = 24 -> 61 - ceil(log2 24) - 2*3 = 61 - 5 - 6 = 50
    assert int(score_shift_tensor(torch.tensor(6.0), 24)) == 50 == 61 - math.ceil(math.log2(24)) - 6


def test_value_checks_are_skipped_under_no_sync_checks_and_nan_propagates():
    from qpass.errors import QuantizationError
    from qpass.quant.nvfp4 import nvfp4_dequantize, nvfp4_quantize
    from qpass.sync_checks import no_sync_checks, sync_checks_enabled

    x = torch.ones(2, 32)
    x[1, 5] = float("nan")
    with pytest.raises(QuantizationError, match="non-finite"):
        nvfp4_quantize(x)
    with no_sync_checks():
        assert not sync_checks_enabled("cpu")
        q = nvfp4_quantize(x)  # no check: the NaN reaches the global scale, so every decoded value is NaN
        assert torch.isnan(nvfp4_dequantize(q, torch.float32)).all()
    assert sync_checks_enabled("cpu")
