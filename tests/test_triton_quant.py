"""Triton quantization kernels vs the reference quantizers: bytes equal bit for bit (CPU interpreter)."""

from __future__ import annotations

import pytest
import torch

from qpass.errors import QuantizationError
from qpass.formats.e2m1 import e2m1_decode, e2m1_encode
from qpass.formats.e4m3 import e4m3_round_magnitude
from qpass.formats.spec import ALL_SPECS, FP8Spec, MXFP4Spec, NVFP4_ACT_PER_TOKEN, NVFP4Spec
from qpass.quant.fp8 import fp8_quantize
from qpass.quant.mxfp4 import mxfp4_quantize
from qpass.quant.nvfp4 import nvfp4_quantize

from qpass.backends.triton import TRITON_KERNELS, fp8_quantize_triton, mxfp4_quantize_triton, nvfp4_quantize_triton
from qpass.backends.triton._loader import kernel_lib

try:  # tests/ may or may not be a package
    from ._triton_testutil import activations, fresh_seed, same_nvfp4, u8
except ImportError:
    from _triton_testutil import activations, fresh_seed, same_nvfp4, u8


def _nb(t: torch.Tensor, d: int) -> torch.Tensor:
    return (t.view(torch.int32) + d).view(torch.float32)


def test_numeric_helpers_exhaustive():
    """E4M3 rounding on every E4M3 value and midpoint (+-1 ulp), E2M1 ties, bf16 RNE, decoders."""
    seed = fresh_seed()
    probe = kernel_lib("cpu").probe.probe
    vals = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (vals[1:] + vals[:-1]) / 2
    x = torch.cat([vals, mids, _nb(mids, 1), _nb(mids, -1), torch.tensor([448.0, 464.0, 1e30, 3.4e38, 2.0**-10]),
                   torch.rand(4000) * 500, torch.rand(1000) * 0.02])
    ref = e4m3_round_magnitude(x)
    assert torch.equal(probe(x, 0), ref), seed
    assert torch.equal(probe(x, 3), ref), seed  # value -> byte -> value round trip
    t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    y = torch.cat([t, -t, _nb(t, 1), _nb(t, -1), -_nb(t, 1), torch.tensor([0.0, -0.0, 6.0, -6.0, 7.0, -1e-30]),
                   torch.randn(2000) * 4])
    assert torch.equal(probe(y, 1).to(torch.uint8), e2m1_encode(y.clamp(-6, 6))), seed
    b = torch.randn(2000).bfloat16().float()
    mid = _nb(b, 0x8000)
    xb = torch.cat([torch.randn(2000) * 10, mid, _nb(mid, 1), _nb(mid, -1), torch.tensor([3.3895314e38, 1e-40, -1e-41])])
    assert torch.equal(probe(xb, 2), xb.bfloat16().float()), seed
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(probe(codes.float(), 4).view(torch.int32), e2m1_decode(codes).view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("per_token", [False, True])
def test_nvfp4_quantize_bit_identical(dtype, per_token):
    seed = fresh_seed()
    m = int(torch.randint(3, 40, ()))
    k = 16 * int(torch.randint(1, 13, ()))  # often not a multiple of the 32-wide interpreter tile
    x = activations(m, k, dtype)
    spec = NVFP4_ACT_PER_TOKEN if per_token else NVFP4Spec()
    got = nvfp4_quantize_triton(x, per_token=per_token)
    ref = nvfp4_quantize(x, spec=spec)
    eq = same_nvfp4(got, ref)
    assert all(eq.values()), (seed, m, k, eq)
    assert torch.equal(got.amax, ref.amax), seed


def test_nvfp4_quantize_ties_subnormal_and_zero_scales():
    """amax = 2688 pins S_enc = S_dec = 1: exact E2M1 midpoints, E4M3-subnormal and zero block scales."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    row = torch.cat([
        torch.tensor([2688.0] + [0.0] * 15),
        torch.cat([ties, -ties]),  # block max 6 -> s_b = e4m3(6 * fl(1/6)) = 1: every element a tie
        torch.cat([ties, -ties]) * 2.0**-8,  # s_b = 2^-8, an E4M3 subnormal
        torch.full((16,), 1e-4),  # s_b rounds to 0 -> multiplier FLT_MAX
    ])
    x = torch.stack([row, -row, row * 0.5])
    for dtype in (torch.float32, torch.bfloat16):
        got = nvfp4_quantize_triton(x.to(dtype))
        ref = nvfp4_quantize(x.to(dtype))
        eq = same_nvfp4(got, ref)
        assert all(eq.values()), eq


def test_nvfp4_quantize_given_amax_and_3d():
    seed = fresh_seed()
    x = activations(6, 64, torch.bfloat16).reshape(2, 3, 64)
    big = x.abs().amax().float() * 3
    for amax in (big, big.reshape(1)):
        eq = same_nvfp4(nvfp4_quantize_triton(x, amax), nvfp4_quantize(x, amax))
        assert all(eq.values()), (seed, eq)
    rows = x.abs().amax(dim=-1, keepdim=True).float() * 1.5
    eq = same_nvfp4(nvfp4_quantize_triton(x, rows, per_token=True), nvfp4_quantize(x, rows, spec=NVFP4_ACT_PER_TOKEN))
    assert all(eq.values()), (seed, eq)


def test_nvfp4_quantize_errors():
    x = torch.randn(4, 32)
    with pytest.raises(QuantizationError, match="multiple of 16"):
        nvfp4_quantize_triton(torch.randn(4, 24))
    bad = x.clone()
    bad[2, 5] = float("nan")
    with pytest.raises(QuantizationError, match="non-finite"):
        nvfp4_quantize_triton(bad, site="layers.0.mlp")
    with pytest.raises(QuantizationError, match="stale amax"):
        nvfp4_quantize_triton(x, x.abs().amax() * 0.5)
    with pytest.raises(QuantizationError, match="bf16/fp16/fp32"):
        nvfp4_quantize_triton(x.double())


@pytest.mark.parametrize("granularity", ["per_tensor", "per_token", "block_1x128", "block_128x128"])
def test_fp8_quantize_bit_identical(granularity):
    seed = fresh_seed()
    m, k = 130 + int(torch.randint(0, 20, ())), 136 + 8 * int(torch.randint(0, 10, ()))  # partial edge blocks
    x = activations(m, k, torch.bfloat16)
    x[3, 7] = -1e-30  # rounds to -0: byte 0x80 like the reference
    got, ref = fp8_quantize_triton(x, granularity), fp8_quantize(x, granularity)
    assert torch.equal(u8(got.data), u8(ref.data)), (seed, granularity)
    assert torch.equal(got.scale, ref.scale), (seed, granularity)


def test_mxfp4_quantize_bit_identical():
    seed = fresh_seed()
    x = activations(9, 160, torch.float32)
    x[1, :32] = 0.0
    x[2, 32:64] = 2.0**-130  # subnormal block max
    x[3, 64:96] *= 1e30
    got, ref = mxfp4_quantize_triton(x), mxfp4_quantize(x)
    assert torch.equal(got.codes, ref.codes) and torch.equal(got.scales, ref.scales), seed


def test_triton_kernels_table_covers_every_spec():
    """One Triton quantizer per canonical spec key, each byte-identical to the reference quantizer."""
    seed = fresh_seed()
    assert set(TRITON_KERNELS) == {s.key for s in ALL_SPECS}
    x = activations(8, 64, torch.bfloat16)
    for spec in ALL_SPECS:
        got = TRITON_KERNELS[spec.key](x)
        if isinstance(spec, NVFP4Spec):
            ref = nvfp4_quantize(x, spec=spec)
            assert all(same_nvfp4(got, ref).values()) and got.spec == spec, (seed, spec.key)
        elif isinstance(spec, MXFP4Spec):
            ref = mxfp4_quantize(x)
            assert torch.equal(got.codes, ref.codes) and torch.equal(got.scales, ref.scales), (seed, spec.key)
        else:
            assert isinstance(spec, FP8Spec)
            ref = fp8_quantize(x, spec=spec)
            assert torch.equal(u8(got.data), u8(ref.data)) and torch.equal(got.scale, ref.scale), (seed, spec.key)
