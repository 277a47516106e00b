"""Element and scale formats: E4M3 rounding, E2M1 encoding and packing, E8M0, float32 bit helpers.

Independent oracles: ``ml_dtypes`` (numpy casts, round-to-nearest-even) for E4M3, the OCP/PTX E2M1
value table for E2M1, and plain arithmetic for E8M0.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from qpass.formats.e2m1 import E2M1_MIDPOINTS, E2M1_VALUES, e2m1_decode, e2m1_encode, pack_e2m1, unpack_e2m1
from qpass.formats.e4m3 import e4m3_bytes, e4m3_rne_satfinite, e4m3_round, e4m3_round_magnitude, e4m3_to_float
from qpass.formats.e8m0 import e8m0_to_float
from qpass.formats.fp32 import bits, bits_hex, f32, from_bits
from qpass.formats.spec import TieRule

# ---------------------------------------------------------------------------------------------
# helpers


def _all_e4m3_values() -> torch.Tensor:
    """All 254 finite E4M3FN values as float32 (0x7F / 0xFF are NaN), from the bit patterns."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return v[torch.isfinite(v)]


def _nonneg_grid() -> torch.Tensor:
    """Sorted distinct non-negative E4M3 values: 0, 2^-9 ... 448 (127 values)."""
    v = _all_e4m3_values()
    return torch.unique(v[v >= 0])


def _ml_dtypes_e4m3(x: torch.Tensor) -> torch.Tensor:
    """ml_dtypes RNE cast fp32 -> float8_e4m3fn -> fp32 (non-saturating: >= 464 gives NaN)."""
    return torch.from_numpy(x.numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float32))


def _next_up(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, float("inf")))


def _next_down(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, float("-inf")))


# ---------------------------------------------------------------------------------------------
# E4M3


def test_e4m3_grid_has_expected_extent():
    g = _nonneg_grid()
    assert g.numel() == 127
    assert g[1].item() == 2.0**-9  # smallest subnormal
    assert g[8].item() == 2.0**-6  # smallest normal (subnormals are 1..7 x 2^-9)
    assert g[-1].item() == 448.0


def test_e4m3_round_fixes_every_representable_value():
    v = _all_e4m3_values()
    assert torch.equal(e4m3_round(v), v)
    # torch's own cast agrees on representable values (it is only used to store them)
    assert torch.equal(v.to(torch.float8_e4m3fn).float(), v)


def test_e4m3_round_matches_ml_dtypes_on_midpoints_and_neighbours():
    g = _nonneg_grid().double()
    mids = ((g[:-1] + g[1:]) / 2).float()  # exact in float32 (E4M3 has 4 significant bits)
    assert torch.equal(mids.double(), (g[:-1] + g[1:]) / 2)
    probes = torch.cat([mids, _next_up(mids), _next_down(mids)])
    probes = torch.cat([probes, -probes])
    ours = e4m3_round(probes)
    ref = _ml_dtypes_e4m3(probes)
    assert torch.equal(ours, ref)
    # and torch's cast (RNE too): agrees everywhere below the saturation point
    assert torch.equal(probes.to(torch.float8_e4m3fn).float(), ref)


def test_e4m3_midpoints_round_to_even_mantissa():
    g = _nonneg_grid()
    mids = ((g[:-1].double() + g[1:].double()) / 2).float()
    out = e4m3_round(mids)
    even_side = torch.where((torch.arange(g.numel() - 1) % 2) == 0, g[:-1], g[1:])  # index parity = mantissa parity
    assert torch.equal(out, even_side)
    # spot checks: 10.5 (between 10 = 1.010b*2^3 and 11 = 1.011b*2^3) -> 10; 11.5 -> 12
    assert e4m3_round(torch.tensor([10.5, 11.5, 2.0**-10, 3 * 2.0**-10])).tolist() == [10.0, 12.0, 0.0, 2 * 2.0**-9]


def test_e4m3_subnormals_dense_sweep_matches_ml_dtypes():
    # every float32 multiple of 2^-16 in [0, 2^-5): covers the whole subnormal range, the first
    # normal binade and all their midpoints, plus random float32 values in the same range
    grid = torch.arange(0, 2**11, dtype=torch.float32) * 2.0**-16
    rnd = torch.rand(20000, generator=torch.Generator().manual_seed(0)) * 2.0**-5
    probes = torch.cat([grid, rnd, _next_up(grid), _next_down(grid[1:])])
    assert torch.equal(e4m3_round(probes), _ml_dtypes_e4m3(probes))


def test_e4m3_random_fp32_matches_ml_dtypes():
    g = torch.Generator().manual_seed(1)
    x = torch.exp2(torch.rand(50000, generator=g) * 40 - 30) * torch.where(torch.rand(50000, generator=g) < 0.5, -1.0, 1.0)
    x = x[x.abs() < 448]
    assert torch.equal(e4m3_round(x), _ml_dtypes_e4m3(x))


def test_e4m3_satfinite_saturates_instead_of_nan():
    big = torch.tensor([448.0, 448.5, 463.99, 464.0, 465.0, 1e30, 3.4e38])
    assert e4m3_round(big).tolist() == [448.0] * 7
    assert e4m3_round(-big).tolist() == [-448.0] * 7
    # ml_dtypes does not saturate: 464 is the midpoint to the (NaN) code above 448
    assert torch.isnan(_ml_dtypes_e4m3(torch.tensor([465.0]))).all()
    stored = e4m3_rne_satfinite(big)
    assert stored.dtype == torch.float8_e4m3fn
    assert e4m3_bytes(stored).tolist() == [0x7E] * 7  # 0x7E = 448; 0x7F would be NaN


def test_e4m3_round_magnitude_and_byte_helpers():
    x = torch.tensor([0.0, 2.0**-9, 1.0, 1.0625, 1.1875, 448.0])
    # 1.0625 = 1 + 1/16 is the midpoint of 1.0 and 1.125 -> even (1.0); 1.1875 -> 1.25
    assert e4m3_round_magnitude(x).tolist() == [0.0, 2.0**-9, 1.0, 1.0, 1.25, 448.0]
    s = e4m3_rne_satfinite(torch.tensor([1.0, 2.0**-9, 0.0, 11.0]))
    assert e4m3_bytes(s).tolist() == [0x38, 0x01, 0x00, 0x53]
    assert e4m3_to_float(s).tolist() == [1.0, 2.0**-9, 0.0, 11.0]
    with pytest.raises(TypeError):
        e4m3_to_float(torch.ones(2))
    with pytest.raises(TypeError):
        e4m3_bytes(torch.ones(2))


# ---------------------------------------------------------------------------------------------
# E2M1


def test_e2m1_every_tie_rounds_to_even():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    # .25->0  .75->1  1.25->1  1.75->2  2.5->2  3.5->4  5->4   (codes are magnitude indices)
    assert e2m1_encode(ties).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert e2m1_decode(e2m1_encode(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    # negative ties: same magnitudes, sign bit 3 set
    assert e2m1_encode(-ties).tolist() == [8, 10, 10, 12, 12, 14, 14]


def test_e2m1_just_off_the_ties():
    ties = torch.tensor(list(E2M1_MIDPOINTS), dtype=torch.float32)
    below = e2m1_decode(e2m1_encode(_next_down(ties)))
    above = e2m1_decode(e2m1_encode(_next_up(ties)))
    assert below.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
    assert above.tolist() == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_e2m1_representable_values_and_saturation():
    vals = torch.tensor(E2M1_VALUES)
    assert e2m1_encode(vals).tolist() == list(range(8))
    assert e2m1_encode(-vals[1:]).tolist() == list(range(9, 16))
    assert e2m1_decode(torch.arange(16, dtype=torch.uint8)).tolist() == list(E2M1_VALUES) + [-v for v in E2M1_VALUES]
    # callers clamp to [-6, 6] first; the encoder itself also maps anything >= 5 (non-tie) to 6
    assert e2m1_encode(torch.tensor([6.0, 5.5, -6.0])).tolist() == [7, 7, 15]


def test_e2m1_sign_handling():
    x = torch.tensor([0.0, -0.0, -1e-30, 1e-30, -0.1, -0.25, -0.2500001])
    # -0.0 -> 0x0 (TE reference), a tiny negative keeps its sign (0x8), like the hardware cvt
    assert e2m1_encode(x).tolist() == [0, 0, 8, 0, 8, 8, 9]
    d = e2m1_decode(torch.tensor([8], dtype=torch.uint8))
    assert d.item() == 0.0 and torch.signbit(d).item()  # code 8 decodes to -0.0


def test_e2m1_other_tie_rules():
    ties = torch.tensor(list(E2M1_MIDPOINTS), dtype=torch.float32)
    assert e2m1_encode(ties, TieRule.TOWARD_ZERO).tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert e2m1_encode(ties, TieRule.AWAY_FROM_ZERO).tolist() == [1, 2, 3, 4, 5, 6, 7]


def test_e2m1_matches_ml_dtypes_float4():
    # ml_dtypes.float4_e2m1fn is an independent RNE implementation (saturating to 6 happens before)
    g = torch.Generator().manual_seed(2)
    x = (torch.rand(20000, generator=g) * 12 - 6).float()
    x = torch.cat([x, torch.tensor(list(E2M1_MIDPOINTS)), -torch.tensor(list(E2M1_MIDPOINTS))])
    ref = torch.from_numpy(x.numpy().astype(ml_dtypes.float4_e2m1fn).astype(np.float32))
    ours = e2m1_decode(e2m1_encode(x))
    assert torch.equal(ours, ref)


def test_pack_unpack_round_trip_every_byte():
    allbytes = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(4, 64)
    codes = unpack_e2m1(allbytes)
    assert codes.shape == (4, 128)
    assert torch.equal(pack_e2m1(codes), allbytes)
    # nibble order: element 2j in the low nibble
    assert pack_e2m1(torch.tensor([[1, 2]], dtype=torch.uint8)).item() == 0x21  # elements (0.5, 1.0)
    assert unpack_e2m1(torch.tensor([0x21], dtype=torch.uint8)).tolist() == [1, 2]


def test_pack_unpack_errors():
    with pytest.raises(ValueError, match="even"):
        pack_e2m1(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        unpack_e2m1(torch.zeros(3, dtype=torch.int32))
    # a value that does not fit a nibble would silently corrupt its neighbour
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_e2m1(torch.tensor([16, 1], dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_e2m1(torch.tensor([1.0, 2.0]))
    assert pack_e2m1(torch.tensor([15, 15], dtype=torch.int64)).item() == 0xFF


# ---------------------------------------------------------------------------------------------
# E8M0 and float32 helpers


def test_e8m0_every_byte():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = e8m0_to_float(b)
    assert torch.isnan(v[255])
    expected = torch.tensor([2.0 ** (i - 127) for i in range(255)], dtype=torch.float64)
    assert torch.equal(v[:255].double(), expected)  # 2^-127 is an exact fp32 subnormal
    assert v[127].item() == 1.0 and v[0].item() == 2.0**-127 and v[254].item() == 2.0**127
    with pytest.raises(TypeError):
        e8m0_to_float(torch.zeros(2, dtype=torch.int32))


def test_fp32_bit_helpers():
    assert bits_hex(f32(1.0 / 6.0)) == "0x3E2AAAAB"
    assert bits_hex(f32(2688.0)) == "0x45280000"
    x = torch.tensor([1.0, -0.0, 3.4028234663852886e38, 1e-45])
    assert bits(x).tolist() == [0x3F800000, -(2**31), 0x7F7FFFFF, 1]
    assert torch.equal(from_bits(bits(x)), x)
    with pytest.raises(TypeError):
        bits(torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(TypeError):
        from_bits(torch.ones(2, dtype=torch.int64))
