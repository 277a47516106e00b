"""FP8 E4M3 reference quantizer (SPEC §3, last paragraph): scale = fl(amax/448) (a decode multiplier),
element = e4m3_rne_satfinite(fl(x * fl(1/scale))). Oracle: numpy float32 arithmetic + ml_dtypes casts."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qpass.errors import QuantizationError
from qpass.formats.spec import FP8Spec, Granularity
from qpass.quant.fp8 import fp8_dequantize, fp8_quantize

GRANULARITIES = ["per_tensor", "per_token", "block_1x128", "block_128x128"]


def _oracle(x: np.ndarray, granularity: str) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 values as float32, scales float32) computed block by block in numpy float32."""
    x = x.astype(np.float32)
    r, k = x.shape
    br, bc = {"per_tensor": (r, k), "per_token": (1, k), "block_1x128": (1, 128), "block_128x128": (128, 128)}[granularity]
    nr, nc = math.ceil(r / br), math.ceil(k / bc)
    scales = np.zeros((nr, nc), np.float32)
    out = np.zeros_like(x)
    for i in range(nr):
        for j in range(nc):
            blk = x[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            s = np.float32(np.abs(blk).max()) / np.float32(448.0)
            s = np.float32(1.0) if s == 0 else s
            inv = np.float32(1.0) / s
            y = blk * inv  # float32 * float32 -> float32
            assert np.abs(y).max() <= np.float32(448.0) * np.float32(1 + 2**-22)
            out[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = y.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
            scales[i, j] = s
    if granularity == "per_tensor":
        scales = scales.reshape(())
    return out, scales


def test_known_answer_per_tensor():
    # amax = 2: scale = fl(2/448) = 0.004464286 (0x3B924925); inv = fl(1/scale) = 223.99998;
    # -2 -> fl(-2 * 223.99998) = -447.99997 -> e4m3 -448 (0xFE); 1 -> 223.99998 -> 224 (0x76);
    # 0.3 (fp32 0.30000001) -> 67.2 -> grid 64, 72 -> 64 (0x68); 0 -> 0.
    x = torch.tensor([[1.0, -2.0, 0.3, 0.0]])
    q = fp8_quantize(x, "per_tensor")
    assert q.scale.item() == np.float32(2.0) / np.float32(448.0)
    assert q.scale.view(torch.int32).item() == 0x3B924925
    assert q.data.view(torch.uint8).tolist() == [[0x76, 0xFE, 0x68, 0x00]]
    deq = fp8_dequantize(q, torch.float32)
    assert deq.tolist() == [[float(np.float32(224) * q.scale.numpy()), float(np.float32(-448) * q.scale.numpy()),
                             float(np.float32(64) * q.scale.numpy()), 0.0]]


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_numpy_ml_dtypes_oracle(granularity, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 300, generator=g) * 3  # partial edge blocks in both directions
    x[5, :] = 0.0  # a zero row: per-token scale falls back to 1
    x[130:, 256:] = 0.0  # a zero 128x128 edge block and zero 1x128 blocks
    x[7, 9] = 1000.0  # an outlier
    x = x.to(dtype)
    q = fp8_quantize(x, granularity)
    vals, scales = _oracle(x.float().numpy(), granularity)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == x.shape
    assert torch.equal(q.data.float(), torch.from_numpy(vals))
    assert torch.equal(q.scale, torch.from_numpy(scales))
    # dequant: one float32 rounding of e * scale (scale broadcast over its block), then the output dtype
    deq = fp8_dequantize(q, torch.float32)
    assert torch.isfinite(deq).all()
    if granularity == "per_tensor":
        assert torch.equal(deq, q.data.float() * q.scale)
    assert torch.equal(fp8_dequantize(q, torch.bfloat16), deq.bfloat16())


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from(GRANULARITIES),
    st.integers(1, 140),
    st.integers(1, 260),
    st.floats(-20, 20),
)
def test_property_oracle_and_error_bound(seed, granularity, rows, cols, log_mag):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * 10.0**log_mag).bfloat16()
    q = fp8_quantize(x, granularity)
    vals, scales = _oracle(x.float().numpy(), granularity)
    assert torch.equal(q.data.float(), torch.from_numpy(vals))
    assert torch.equal(q.scale, torch.from_numpy(scales))
    # relative error of a normal e4m3 value <= 2^-4; absolute error near zero <= half a subnormal step
    deq = fp8_dequantize(q, torch.float32).double()
    xd = x.double()
    amax = xd.abs().max().item()
    assert torch.all((deq - xd).abs() <= xd.abs() * 2.0**-4 * (1 + 2.0**-20) + amax / 448 * 2.0**-10 + 1e-300)


def test_zero_tensor_and_zero_amax_scale():
    x = torch.zeros(3, 256, dtype=torch.bfloat16)
    for gran in GRANULARITIES:
        q = fp8_quantize(x, gran)
        assert torch.all(q.scale == 1.0)
        assert torch.all(q.data.view(torch.uint8) == 0)
        assert torch.equal(q.dequantize(), x)
    q = fp8_quantize(x, spec=FP8Spec(granularity=Granularity.PER_TENSOR, zero_amax_scale=0.5))
    assert q.scale.item() == 0.5


def test_shapes_of_scales():
    x = torch.randn(2, 3, 300)
    assert fp8_quantize(x, "per_tensor").scale.shape == ()
    assert fp8_quantize(x, "per_token").scale.shape == (6, 1)
    assert fp8_quantize(x, "block_1x128").scale.shape == (6, 3)
    assert fp8_quantize(x[0], "block_128x128").scale.shape == (1, 3)
    # a spec overrides the granularity argument
    q = fp8_quantize(x, "per_tensor", spec=FP8Spec(granularity=Granularity.PER_TOKEN))
    assert q.spec.granularity == Granularity.PER_TOKEN and q.scale.shape == (6, 1)
    assert q.dequantize(torch.float32).shape == x.shape


def test_bad_input():
    with pytest.raises(QuantizationError, match="2-D"):
        fp8_quantize(torch.ones(2, 2, 128), "block_128x128", name="w")
    with pytest.raises(QuantizationError, match="non-finite.*'act' at site L1"):
        fp8_quantize(torch.tensor([[1.0, float("inf")]]), "per_token", name="act", site="L1")
    with pytest.raises(QuantizationError, match="float64"):
        fp8_quantize(torch.ones(2, 2, dtype=torch.float64))
    with pytest.raises(QuantizationError, match="at least 2 dims"):
        fp8_quantize(torch.ones(4))
    with pytest.raises(ValueError):
        fp8_quantize(torch.ones(2, 2), "block_1x16")
    with pytest.raises(ValueError, match="granularity"):
        FP8Spec(granularity=Granularity.BLOCK_1X32)
