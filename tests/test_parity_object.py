"""Parity object (SPEC §3 rule 4): canonical codes (-0 -> +0), scale bytes, S_dec bits; zero-scale
blocks compare by decoded value; a planted one-bit change is found with its index."""

from __future__ import annotations

import torch

from qpass.formats.e2m1 import pack_e2m1
from qpass.parity.object import compare_parity, parity_object, parity_object_from_parts
from qpass.quant.nvfp4 import nvfp4_quantize


def _parts(codes: list[int], scale_bytes: list[int], s_dec: float = 0.5):
    c = pack_e2m1(torch.tensor([codes], dtype=torch.uint8))
    s = torch.tensor([scale_bytes], dtype=torch.uint8)
    return c, s, torch.tensor(s_dec)


def test_negative_zero_codes_are_canonicalised():
    a = parity_object_from_parts(*_parts([7, 0x8] + [0] * 14, [0x38]))
    b = parity_object_from_parts(*_parts([7, 0x0] + [0x8] * 14, [0x38]))
    assert a.codes[0, :2].tolist() == [7, 0]
    d = compare_parity(a, b)
    assert d.ok and d.summary().endswith("S_dec bits)")
    # but a real sign difference is one differing code
    c = parity_object_from_parts(*_parts([15, 0] + [0] * 14, [0x38]))
    d = compare_parity(a, c)
    assert (d.differing_codes, d.first_code) == (1, (0, 0))


def test_zero_scale_blocks_compare_by_decoded_value():
    # TE reference: scale 0 with saturated codes; torchao-like: scale 2^-6 (0x08) with zero codes;
    # E4M3 -0.0 (0x80) scale: all decode to 0 and are equal
    te = parity_object_from_parts(*_parts([7, 15, 0] + [7] * 13, [0x00]))
    ao = parity_object_from_parts(*_parts([0] * 16, [0x08]))
    neg = parity_object_from_parts(*_parts([3] * 16, [0x80]))
    assert compare_parity(te, ao).ok and compare_parity(te, neg).ok
    assert te.scale_bytes.tolist() == [[0]] and te.codes.sum().item() == 0
    # a zero-scale block against one that decodes to something nonzero: differs
    nz = parity_object_from_parts(*_parts([1] + [0] * 15, [0x08]))
    d = compare_parity(te, nz)
    assert (d.differing_scales, d.first_scale) == (1, (0, 0))
    assert (d.differing_codes, d.first_code) == (1, (0, 0))


def test_nan_scale_block_is_never_a_zero_block():
    # all-zero codes under a NaN scale decode to 0 * NaN = NaN: not equal to a zero block
    zero = parity_object_from_parts(*_parts([0] * 16, [0x00]))
    for nan_byte in (0x7F, 0xFF):
        nan = parity_object_from_parts(*_parts([0] * 16, [nan_byte]))
        assert nan.scale_bytes.item() == nan_byte
        d = compare_parity(zero, nan)
        assert (d.differing_scales, d.differing_codes) == (1, 0)


def test_planted_one_bit_changes_are_found_with_their_index():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 256, generator=g) * 0.02).bfloat16()
    q = nvfp4_quantize(x)
    ref = parity_object(q, "layers.0.mlp.up_proj")
    # one bit of one scale byte
    scales = q.scales.view(torch.uint8).clone()
    scales[37, 11] ^= 0x02
    d = compare_parity(ref, parity_object_from_parts(q.codes, scales, q.s_dec))
    assert (d.differing_scales, d.first_scale, d.differing_codes, d.global_differs) == (1, (37, 11), 0, False)
    assert "1/1024 scale bytes differ (first at (37, 11))" in d.summary()
    assert d.name == "layers.0.mlp.up_proj"
    # one bit of one code nibble: byte (5, 100) high nibble = element (5, 201)
    codes = q.codes.clone()
    codes[5, 100] ^= 0x10
    d = compare_parity(ref, parity_object_from_parts(codes, q.scales, q.s_dec))
    assert (d.differing_codes, d.first_code, d.differing_scales) == (1, (5, 201), 0)
    # one bit of S_dec
    s_dec = (q.s_dec.view(torch.int32) ^ 1).view(torch.float32)
    d = compare_parity(ref, parity_object_from_parts(q.codes, q.scales, s_dec))
    assert d.global_differs and not d.ok and "S_dec bits differ" in d.summary()


def test_shape_mismatch():
    a = parity_object(nvfp4_quantize(torch.ones(2, 32)))
    b = parity_object(nvfp4_quantize(torch.ones(2, 16)))
    d = compare_parity(a, b, name="x")
    assert d.shape_differs and not d.ok and d.summary() == "x: shapes differ"
