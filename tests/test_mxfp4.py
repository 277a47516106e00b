"""MXFP4 reference quantizer (OCP MX v1.0 §6.3): E8M0 scale 2^(floor(log2 vmax) - 2) per 32 elements,
E2M1 elements with round-to-nearest-even, saturating at 6. Cross-checked against torchao's ``to_mx``
(``ScaleCalculationMode.FLOOR``, the OCP rule)."""

from __future__ import annotations

import os

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qpass.errors import QuantizationError
from qpass.formats.e2m1 import e2m1_decode, unpack_e2m1
from qpass.quant.mxfp4 import mxfp4_dequantize, mxfp4_quantize

mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
mx_config = pytest.importorskip("torchao.prototype.mx_formats.config")


def _block(values: list[float]) -> torch.Tensor:
    x = torch.zeros(1, 32)
    x[0, : len(values)] = torch.tensor(values)
    return x.bfloat16()


def test_known_answers():
    # vmax = 6 -> floor(log2 6) = 2 -> e = 0 -> byte 127, scale 1: elements encode as themselves
    q = mxfp4_quantize(_block([6.0, -3.0, 0.75, 0.25]))
    assert q.scales.tolist() == [[127]]
    assert unpack_e2m1(q.codes)[0, :5].tolist() == [7, 13, 2, 0, 0]  # 0.75 -> 1.0 (tie to even), 0.25 -> 0
    # vmax = 1 -> e = -2 -> byte 125, x * 4: 1 -> 4 (code 6), 0.3125 -> 1.25 -> tie -> 1.0 (code 2)
    q = mxfp4_quantize(_block([1.0, 0.3125, -0.0625]))
    assert q.scales.tolist() == [[125]]
    assert unpack_e2m1(q.codes)[0, :3].tolist() == [6, 2, 8]  # -0.25 -> -0 with the sign kept (0x8)
    # vmax = 7.5 -> e = 0 (floor(log2 7.5) = 2): 7.5 saturates to 6 (OCP: clamp to the max normal)
    q = mxfp4_quantize(_block([7.5, 5.0]))
    assert q.scales.tolist() == [[127]] and unpack_e2m1(q.codes)[0, :2].tolist() == [7, 6]
    # all-zero block: exponent -127 -> byte 0, codes 0
    q = mxfp4_quantize(torch.zeros(2, 64, dtype=torch.bfloat16))
    assert q.scales.tolist() == [[0, 0], [0, 0]] and q.codes.sum().item() == 0
    # exact powers of two: floor(log2(2^k)) = k exactly (read from the exponent, not libm log2)
    for k in (-100, -3, 0, 5, 100):
        q = mxfp4_quantize(_block([2.0**k]))
        assert q.scales.item() == k - 2 + 127
        assert mxfp4_dequantize(q, torch.float32)[0, 0].item() == 2.0**k


def test_extreme_exponents_clamp_to_e8m0_range():
    x = torch.zeros(1, 64)
    x[0, 0] = 1e-40  # fp32 subnormal: floor(log2) - 2 = -135 -> clamped to -127 (byte 0)
    x[0, 32] = 3.0e38  # floor(log2) = 127 -> e = 125 (byte 252)
    q = mxfp4_quantize(x)
    assert q.scales.tolist() == [[0, 252]]
    deq = mxfp4_dequantize(q, torch.float32)
    # 3e38 / 2^125 = 7.05 saturates to 6; 1e-40 / 2^-127 = 0.017 -> 0
    assert torch.isfinite(deq).all() and deq[0, 32].item() == 6 * 2.0**125 and deq[0, 0].item() == 0.0


def _torchao_mx(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales, data = mx.to_mx(x, torch.float4_e2m1fn_x2, 32, mx_config.ScaleCalculationMode.FLOOR)
    return scales.view(torch.uint8).reshape(*x.shape[:-1], -1), data.view(torch.uint8).reshape(*x.shape[:-1], -1)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.integers(1, 8),
    st.integers(1, 4),
    st.sampled_from(["normal", "ties", "zero_blocks", "powers_of_two"]),
    st.floats(-20, 20),
)
def test_matches_torchao_floor_mode(seed, rows, nblocks, pattern, log_mag):
    g = torch.Generator().manual_seed(seed)
    k = 32 * nblocks
    if pattern == "normal":
        x = torch.randn(rows, k, generator=g) * 10.0**log_mag
    elif pattern == "ties":
        x = torch.randint(-48, 49, (rows, k), generator=g).float() * 2.0**-4
    elif pattern == "zero_blocks":
        x = torch.randn(rows, k, generator=g)
        x.view(rows, nblocks, 32)[:, ::2] = 0.0
    else:
        x = torch.exp2(torch.randint(-30, 30, (rows, k), generator=g).float()) * torch.sign(torch.randn(rows, k, generator=g))
    x = x.bfloat16()
    q = mxfp4_quantize(x)
    scales, codes = _torchao_mx(x)
    assert torch.equal(q.scales, scales)
    assert torch.equal(q.codes, codes)
    # dequant is exact: e2m1 value * 2^(byte - 127), computed independently in float64
    deq = mxfp4_dequantize(q, torch.float32)
    vals = e2m1_decode(unpack_e2m1(codes)).double().reshape(rows, nblocks, 32)
    exact = vals * torch.exp2(scales.double() - 127).unsqueeze(-1)
    assert torch.equal(deq.double(), exact.reshape(rows, k))


def test_bad_input():
    with pytest.raises(QuantizationError, match="multiple of 32"):
        mxfp4_quantize(torch.ones(2, 48), name="w")
    with pytest.raises(QuantizationError, match="non-finite"):
        mxfp4_quantize(torch.full((1, 32), float("nan")))
