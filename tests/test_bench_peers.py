"""The 4-bit peers ``qpass bench`` times (qpass.apps.bench.peers): quantization and the CPU twin of tinygemm."""

import pytest
import torch

from qpass.apps.bench.peers import int4_g128_quantize, tinygemm


def test_int4_g128_codes_and_rounding_error_bound():
    w = (torch.randn(8, 256, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    wq = int4_g128_quantize(w)
    assert wq.q.dtype == torch.uint8 and int(wq.q.max()) <= 15 and wq.scale.shape == (8, 2)
    # each group's min and max are representable codes 0 and 15 (up to fp32 rounding of (hi-lo)/15*15)
    assert bool((wq.q.reshape(8, 2, 128).amin(-1) == 0).all()) and bool((wq.q.reshape(8, 2, 128).amax(-1) == 15).all())
    err = (wq.dequantize().float() - w.float()).abs().reshape(8, 2, 128)
    # round-to-nearest: at most half a step (+ bf16 rounding of w_hat: 2^-8 relative)
    assert bool((err <= wq.scale[..., None] / 2 + w.float().abs().reshape(8, 2, 128).amax(-1, keepdim=True) * 2**-8).all())


def test_int4_g128_rejects_ragged_k():
    with pytest.raises(ValueError, match="K % 128"):
        int4_g128_quantize(torch.zeros(4, 96))


def test_tinygemm_cpu_twin_computes_x_times_its_dequantized_weight():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 256, generator=g) * 0.02).bfloat16()
    x = torch.randn(3, 256, generator=g).bfloat16()
    wq = int4_g128_quantize(w)
    fn, state = tinygemm(wq)
    y = fn(x, *state)
    ref = x.double() @ wq.dequantize().double().t()
    assert y.shape == (3, 64) and y.dtype == torch.bfloat16
    assert float((y.double() - ref).norm() / ref.norm()) < 5e-3  # bf16 output rounding only
