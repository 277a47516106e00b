"""Emulation modes (qpass.quant.emulation) and convention identification (qpass.parity.identify).

The torchao mode is cross-checked bit for bit against the installed torchao 0.18 (CPU eager).
The other modes have no library installed here; they are pinned by hand-computed bytes on the
divergence examples of ``prior-art/nvfp4_semantics.md`` §8/§9 (D1, D2, D5).
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")  # before torchao is imported anywhere

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qpass.errors import QuantizationError
from qpass.formats.e2m1 import E2M1_MIDPOINTS, unpack_e2m1
from qpass.formats.e4m3 import e4m3_round
from qpass.formats.fp32 import bits
from qpass.parity.identify import identify
from qpass.parity.object import compare_parity, parity_object, parity_object_from_parts
from qpass.quant.emulation import EMULATION_INFO, EMULATIONS, emulate, register_emulation
from qpass.quant.layout import to_swizzled_128x4
from qpass.quant.nvfp4 import NVFP4Tensor, nvfp4_quantize

ao = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")

REQUIRED = ("te_reference", "vllm_sglang", "torchao", "modelopt_export", "compressed_tensors")


def _bits(t: torch.Tensor) -> int:
    return int(bits(t.float().reshape(()))) & 0xFFFFFFFF


def _row(values: list[float]) -> torch.Tensor:
    x = torch.zeros(1, 16)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float64).float()
    out = x.bfloat16()
    assert torch.equal(out.float(), x)
    return out


def _torchao(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed codes uint8, scale bytes uint8, per_tensor_scale fp32) from torchao's own nvfp4_quantize."""
    pts = ao.per_tensor_amax_to_scale(x.abs().amax())
    scales, data = ao.nvfp4_quantize(x, 16, pts)
    return data, scales.view(torch.uint8), pts


def _hash_ints(rows: int, cols: int, salt: int, modulus: int) -> torch.Tensor:
    """Deterministic pseudo-random integers in [0, modulus) (no RNG state, stable across versions)."""
    i = torch.arange(rows, dtype=torch.int64).unsqueeze(1)
    j = torch.arange(cols, dtype=torch.int64).unsqueeze(0)
    h = (i * 2654435761 + j * 40503 + salt * 97531) % 4294967296
    h = (h ^ (h >> 13)) * 1274126177 % 4294967296
    return (h >> 7) % modulus


def tie_rich(amax: float, rows: int = 48, cols: int = 256) -> torch.Tensor:
    """bf16 [3*rows, cols]: integers * 2^-6, integers * 2^-8 and a bell-shaped integer family, each
    rescaled to max |x| = ``amax``. With a short-mantissa amax these have many exact E4M3 / E2M1
    midpoints, where the libraries' operation orders disagree."""
    a = (_hash_ints(rows, cols, 1, 201) - 100).float() * 2**-6
    b = (_hash_ints(rows, cols, 2, 601) - 300).float() * 2**-8
    c = (_hash_ints(rows, cols, 3, 257) + _hash_ints(rows, cols, 4, 257) + _hash_ints(rows, cols, 5, 257) - 384).float()
    x = torch.cat([p / p.abs().max() * amax for p in (a, b, c)]).bfloat16()
    x[0, 0] = amax
    return x


# =============================================================================================
# registry


def test_registry_has_the_required_modes_with_sources():
    for name in REQUIRED:
        assert name in EMULATIONS
        info = EMULATION_INFO[name]
        assert info.native_global in ("decode", "encode") and info.source
        assert "Source" in (EMULATIONS[name].__doc__ or ""), name
    assert set(EMULATIONS) == set(EMULATION_INFO)


def test_register_rejects_duplicates_and_emulate_rejects_unknown():
    with pytest.raises(ValueError, match="already registered"):
        register_emulation("torchao", native_global="decode", source="x")(lambda x, amax=None: None)
    with pytest.raises(KeyError, match="known"):
        emulate("no_such_library", torch.ones(1, 16))


@pytest.mark.parametrize("mode", list(EMULATIONS))
def test_every_mode_returns_the_reference_container(mode):
    x = tie_rich(0.8125, rows=4, cols=64)
    q = emulate(mode, x)
    assert isinstance(q, NVFP4Tensor)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (12, 32)
    assert q.scales.dtype == torch.float8_e4m3fn and q.scales.shape == (12, 4)
    assert q.s_dec.dtype == torch.float32 and q.s_enc.dtype == torch.float32
    assert q.shape == x.shape and q.orig_dtype == torch.bfloat16
    assert torch.isfinite(q.scales.float()).all()
    # decodes to something close to x (every mode is a faithful NVFP4 quantizer)
    err = (q.dequantize(torch.float32) - x.float()).abs().max().item()
    assert err <= 0.8125 / 6 + 1e-6  # half of the largest grid step 2 * (448 * S_dec) at amax


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), st.floats(-3, 3))
def test_te_reference_mode_is_the_reference_quantizer(seed, dtype, log_mag):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(4, 64, generator=g) * 10.0**log_mag).to(dtype)
    a, b = emulate("te_reference", x), nvfp4_quantize(x)
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
    assert _bits(a.s_dec) == _bits(b.s_dec) and _bits(a.s_enc) == _bits(b.s_enc)


# =============================================================================================
# hand-computed divergences (fl = one float32 rounding)


def test_d1_block_scale_association_per_mode():
    # amax = 0.8125, vmax = 39/2048 (bf16 0x3C9C); exact scale = vmax * 2688 / (6 amax) = 10.5, the
    # E4M3 midpoint of 10 (0x52) and 11 (0x53).
    #  te_reference  fl(vmax * fl(S_enc * fl(1/6))) = 10.500000954                  -> 11 (0x53)
    #  vllm_sglang   fl(gs * fl(vmax * fl(1/6))) = fl(3308.3076 * 13/4096) = 10.5   -> 10 (0x52)
    #  torchao       fl(fl(vmax/6) / fl(amax/2688)) = fl((13/4096) / 3.0226936e-4) = 10.5 -> 10
    #  modelopt      fl(vmax / fl(6 * wsf2)) = 10.5                                 -> 10
    #  compressed_t. gs = fl(fl(1/0.8125) * 2688) = fl(1.23076928 * 2688) = 3308.3078613 (0x454EC4ED,
    #                one ulp above fl(2688/0.8125)); fl(gs * 13/4096) = 10.500000954 -> 11
    x = torch.cat([_row([0.8125]), _row([39 / 2048])], dim=1)
    expected = {
        "te_reference": 0x53,
        "vllm_sglang": 0x52,
        "torchao": 0x52,
        "torchao_cuda": 0x52,
        "modelopt_export": 0x52,
        "modelopt_export_cuda": 0x52,
        "compressed_tensors": 0x53,
        "compressed_tensors_cuda": 0x53,
    }
    for mode, byte in expected.items():
        q = emulate(mode, x)
        assert q.scales.view(torch.uint8)[0].tolist() == [0x7E, byte], mode
    assert _bits(emulate("compressed_tensors", x).s_enc) == 0x454EC4ED
    assert _bits(emulate("te_reference", x).s_enc) == 0x454EC4EC
    # the bytes really come from torchao too
    assert _torchao(x)[1][0].tolist() == [0x7E, 0x52]


def test_d2_element_multiplier_per_mode():
    # amax = 3.84375, block [0.04296875, x = 205/8192]: s_b = 5 in every mode; exact x*2688/(amax*5) = 3.5.
    #  te / vllm   x * fl(1/fl(5 * fl(1/S_enc)))  = x * 139.8634033 = 3.4999998 -> 3.0 (code 5)
    #  torchao     x * fl(fl(1/fl(amax/2688))/5)  = x * 139.8634186 = 3.5       -> tie -> 4.0 (code 6)
    #  modelopt    x / fl(5 * fl(amax/2688))      = 3.5                          -> 4.0 (code 6)
    #  compressed  gs = fl(fl(1/amax)*2688) = 699.3170166 (0x442ED44A, one ulp below S_enc);
    #              x / fl(5/gs) = x / 0.0071498333 = 3.4999998 -> 3.0 (code 5)
    x = torch.cat([_row([3.84375]), _row([0.04296875, 205 / 8192])], dim=1)
    expected = {"te_reference": 5, "vllm_sglang": 5, "torchao": 6, "modelopt_export": 6, "compressed_tensors": 5}
    for mode, code in expected.items():
        q = emulate(mode, x)
        assert q.scales.float()[0, 1].item() == 5.0, mode
        assert q.unpacked_codes()[0, 17].item() == code, mode
    assert unpack_e2m1(_torchao(x)[0])[0, 17].item() == 6
    assert _bits(emulate("compressed_tensors", x).s_enc) == 0x442ED44A


def test_d5_tiny_block_scale_rules():
    # amax = 2.625 -> S_enc = 1024 exactly. Block vmax = 4.5 * 2^-20: exact sf = vmax * 1024/6 = 0.75 * 2^-10,
    # below half the smallest subnormal E4M3 (2^-10).
    #  te_reference   s_b = 0 (byte 0), enc = FLT_MAX -> codes +-6: decodes to 0
    #  vllm_sglang    s_b = 0, enc = 0 -> codes 0
    #  torchao        clamp(sf, min=2^-6) -> s_b = 2^-6 (byte 0x08); y = vmax / (2^-10 * 2^-6) = 0.28125
    #                 -> above the 0.25 midpoint -> code 1 (0.5): decodes to 0.5 * 2^-16, NOT 0
    #  modelopt       sf > 0 rounds to E4M3 0; x / 0 = inf -> code 7 with scale 0: decodes to 0
    #  compressed_t.  E4M3 0 -> 0.125; y = vmax * gs / 0.125 ~ 0.035 -> code 0: decodes to 0
    x = torch.cat([_row([2.625]), _row([4.5 * 2.0**-20])], dim=1)
    got = {m: emulate(m, x) for m in REQUIRED}
    assert got["te_reference"].scales.view(torch.uint8)[0, 1].item() == 0
    assert got["te_reference"].unpacked_codes()[0, 16].item() == 7
    assert got["vllm_sglang"].unpacked_codes()[0, 16].item() == 0
    assert got["torchao"].scales.view(torch.uint8)[0, 1].item() == 0x08
    assert got["torchao"].unpacked_codes()[0, 16].item() == 1
    assert got["modelopt_export"].scales.view(torch.uint8)[0, 1].item() == 0
    assert got["modelopt_export"].unpacked_codes()[0, 16].item() == 7
    assert got["compressed_tensors"].scales.float()[0, 1].item() == 0.125
    assert got["compressed_tensors"].unpacked_codes()[0, 16].item() == 0
    ref = parity_object(got["te_reference"])
    for m, q in got.items():  # after canonicalisation only torchao's block decodes to nonzero
        assert compare_parity(ref, parity_object(q)).ok == (m != "torchao"), m
    data, scales, _ = _torchao(x)
    assert scales[0].tolist() == [0x7E, 0x08] and unpack_e2m1(data)[0, 16].item() == 1


def test_modes_without_defined_bytes_for_amax_zero():
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    for mode in ("torchao", "torchao_cuda", "modelopt_export", "compressed_tensors"):
        with pytest.raises(QuantizationError, match="amax == 0"):
            emulate(mode, x)
    assert emulate("vllm_sglang", x).codes.sum().item() == 0


def test_cuda_lowering_differs_only_through_scalar_division():
    # amax = 1.296875: fl(amax/2688) = 4.8246838e-4 but fl(amax * fl(1/2688)) is one ulp away, so the
    # CPU and CUDA eager runs of torchao / ModelOpt store different global scales.
    a = torch.tensor(1.296875)
    cpu, cuda = a / torch.tensor(2688.0), a * (torch.tensor(1.0) / torch.tensor(2688.0))
    assert _bits(cpu) != _bits(cuda)
    x = tie_rich(1.296875, rows=4, cols=64)
    assert _bits(emulate("torchao", x).s_dec) == _bits(cpu)
    assert _bits(emulate("torchao_cuda", x).s_dec) == _bits(cuda)
    assert _bits(emulate("modelopt_export_cuda", x).s_dec) == _bits(cuda)


# =============================================================================================
# torchao cross-check


def _tie_free(x: torch.Tensor, delta: float = 2.0**-12) -> torch.Tensor:
    """Edit bf16 ``x`` [R, K] so that no quantity any library rounds is within ``delta`` (relative)
    of a rounding boundary, and no block scale is below torchao's 2^-6 floor.

    Why this makes every library agree: each library computes the block scale ``v = vmax * 2688 /
    (6 amax)`` and the element ratio ``y = |x| * 2688 / (amax * s_b)`` with at most five float32
    roundings from exact bf16 inputs, i.e. to within 5 * 2^-24 < 2^-21 relative. If the exact value
    is farther than 2^-12 (relative) from every E4M3 midpoint (for ``v``) and every E2M1 midpoint
    (for ``y``), all of them round to the same side, so codes and scale bytes coincide; only the
    global-scale bits may differ (decode ``amax/2688`` vs ``1/fl(2688/amax)``, D4).
    Edits: a block whose ``v`` is near a midpoint gets its max element raised by one bf16 ulp
    (moves ``v`` by 2^-8..2^-7 relative, far from the 2^-3-spaced midpoints); a block with ``v``
    under 2^-6 is scaled up; an element whose ``y`` is near a midpoint is set to 0.
    """
    grid = torch.unique(torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().abs())
    grid = grid[torch.isfinite(grid)].double()
    e4m3_mids = (grid[:-1] + grid[1:]) / 2
    e2m1_mids = torch.tensor(E2M1_MIDPOINTS, dtype=torch.float64)
    x = x.clone()
    r, k = x.shape
    amax = x.abs().amax().double()
    for _ in range(4):
        xb = x.double().reshape(r, k // 16, 16)
        vmax, imax = xb.abs().max(dim=-1)
        v = vmax * 2688 / (6 * amax)
        near = ((v.unsqueeze(-1) - e4m3_mids).abs() / e4m3_mids < delta).any(-1)
        tiny = (v > 0) & (v < 2.0**-6 * (1 + delta))
        if not (near.any() or tiny.any()):
            break
        xv = x.view(r, k // 16, 16)
        raw = xv.view(torch.int16)
        for i, j in near.nonzero().tolist():
            raw[i, j, imax[i, j]] += 1  # sign-magnitude: +1 on the bit pattern = next bf16 away from 0
        for i, j in tiny.nonzero().tolist():
            xv[i, j] = xv[i, j] * 64  # exact in bf16: a power of two
    else:
        raise AssertionError("tie-free construction did not converge")
    xb = x.double().reshape(r, k // 16, 16)
    vmax = xb.abs().amax(-1)
    s_b = e4m3_round((vmax * 2688 / (6 * amax)).float()).double().unsqueeze(-1)
    y = xb.abs() * 2688 / (amax * torch.where(s_b > 0, s_b, 1.0))
    near_y = ((y.unsqueeze(-1) - e2m1_mids).abs() / e2m1_mids < delta).any(-1)
    assert not (near_y & (xb.abs() == vmax.unsqueeze(-1))).any()  # the block max has y in [5.6, 6.4]
    x.view(r, k // 16, 16)[near_y] = 0.0
    assert x.abs().amax().double() == amax
    return x


def _realistic_weights(rows: int = 256, k: int = 2048) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = [
        ("normal(0, 0.02)", torch.randn(rows, k, generator=g) * 0.02),
        ("student_t3 * 0.01", torch.randn(rows, k, generator=g) / torch.rand(rows, k, generator=g).clamp(min=0.05) * 0.01),
        ("kaiming_uniform", (torch.rand(rows, k, generator=g) * 2 - 1) / math.sqrt(k)),
    ]
    for a in (0.099609375, 0.8125, 0.5078125):  # short-mantissa amax values: tie-rich (prior-art §9)
        w = (torch.randn(rows, k, generator=g) * 0.02).clamp(-a, a)
        w[0, 0] = a
        out.append((f"normal, amax={a}", w))
    out.append(("integers * 2^-6", torch.randint(-100, 101, (rows, k), generator=g).float() * 2**-6))
    return [(n, w.bfloat16()) for n, w in out]


def test_torchao_equals_reference_on_tie_free_input():
    for name, w in _realistic_weights(rows=96):
        x = _tie_free(w)
        assert (x != w).float().mean().item() < 0.02, name  # a light edit of realistic data
        data, scales, pts = _torchao(x)
        ref = nvfp4_quantize(x)
        assert torch.equal(data, ref.codes), name
        assert torch.equal(scales, ref.scales.view(torch.uint8)), name
        # global scales: same value to within one ulp (decode amax/2688 vs 1/fl(2688/amax), D4)
        assert abs(_bits(pts) - _bits(ref.s_dec)) <= 1, name


def test_torchao_emulation_reproduces_torchao_bit_for_bit(capsys):
    rates = []
    for name, w in _realistic_weights() + [(f"tie_rich({a})", tie_rich(a)) for a in (0.8125, 0.099609375, 1.09375)]:
        data, scales, pts = _torchao(w)
        emu = emulate("torchao", w)
        assert torch.equal(emu.codes, data), name
        assert torch.equal(emu.scales.view(torch.uint8), scales), name
        assert _bits(emu.s_dec) == _bits(pts), name
        d = compare_parity(parity_object(nvfp4_quantize(w)), parity_object_from_parts(data, scales, pts))
        rates.append((name, d.differing_codes / d.total_codes, d.differing_scales / d.total_scales))
    with capsys.disabled():
        print("\ntorchao 0.18 vs qpass reference (canonical codes / scale bytes differing):")
        for name, c, s in rates:
            print(f"  {name:28s} codes {100 * c:.4f} %   scale bytes {100 * s:.4f} %")
    # the tie-rich inputs do differ, so the bit-for-bit agreement above is not vacuous
    assert sum(1 for _, c, s in rates if c or s) >= 4


def test_identify_names_torchao_on_torchao_bytes():
    for a in (0.8125, 0.099609375, 1.09375):
        x = tie_rich(a)
        data, scales, pts = _torchao(x)
        res = identify(data, scales, pts, x, global_is="decode")
        assert "torchao" in res.matches and "te_reference" not in res.matches, res.summary()
        assert res.per_mode["te_reference"].differing_codes + res.per_mode["te_reference"].differing_scales > 0
    assert res.mode == "torchao", res.summary()  # amax = 1.09375 separates every mode (below)


# =============================================================================================
# identify


@pytest.mark.parametrize("global_is", ["native", "auto"])
def test_identify_names_every_mode_on_a_tie_rich_tensor(global_is):
    # amax = 1.09375 = 35/32: fl(amax/2688) != fl(amax * fl(1/2688)) (separates CPU/CUDA lowering of the
    # decode global) and the three integer families put blocks and elements on E4M3/E2M1 midpoints where
    # each pair of modes rounds differently (checked below pair by pair).
    x = tie_rich(1.09375)
    for mode, fn in EMULATIONS.items():
        q = fn(x)
        native = EMULATION_INFO[mode].native_global
        g = q.s_dec if native == "decode" else q.s_enc
        res = identify(q.codes, q.scales, g, x, global_is=native if global_is == "native" else "auto")
        assert res.matches == (mode,), res.summary()
        assert res.mode == mode and res.per_mode[mode].global_match == native


def test_identify_counts_equal_direct_comparison():
    x = tie_rich(0.8125, rows=16)
    q = emulate("modelopt_export", x)
    res = identify(q.codes, q.scales, q.s_dec, x, global_is="decode")
    assert set(res.matches) >= {"modelopt_export"}
    for mode, r in res.per_mode.items():
        d = compare_parity(parity_object(q), parity_object(emulate(mode, x)))
        assert (r.differing_codes, r.differing_scales) == (d.differing_codes, d.differing_scales), mode
        assert r.first_code == d.first_code and r.first_scale == d.first_scale
    assert res.total_codes == x.numel() and res.total_scales == x.numel() // 16


def test_identify_d1_example_and_a_planted_change():
    x = torch.cat([_row([0.8125]), _row([39 / 2048, 39 / 4096, -39 / 8192])], dim=1)
    te = emulate("te_reference", x)
    res = identify(te.codes, te.scales, te.s_enc, x, global_is="encode")
    assert res.matches == ("te_reference",), res.summary()
    assert res.per_mode["vllm_sglang"].differing_scales == 1 and res.per_mode["vllm_sglang"].first_scale == (0, 1)
    # flip one bit of one scale byte (11 -> 15): nothing reproduces it any more. (Flipping the lowest
    # bit instead gives 10, vLLM's byte, with the same codes here: then vLLM & co. match.)
    bad = te.scales.view(torch.uint8).clone()
    bad[0, 1] ^= 0x04
    res = identify(te.codes, bad, te.s_enc, x, global_is="encode")
    assert res.matches == () and res.mode is None
    assert "none of the emulated conventions" in res.summary()


def test_identify_d2_example():
    # D2 block (see test_d2_element_multiplier_per_mode): te_reference and vllm_sglang agree on every byte
    # and on S_enc, so their bytes name both; torchao and ModelOpt put the tie on code 6 and share the
    # decode global fl(amax/2688); compressed-tensors has code 5 but its own global (0x442ED44A).
    x = torch.cat([_row([3.84375]), _row([0.04296875, 205 / 8192, -205 / 8192])], dim=1)
    te = emulate("te_reference", x)
    assert identify(te.codes, te.scales, te.s_enc, x, global_is="encode").matches == ("te_reference", "vllm_sglang")
    ao_data, ao_scales, pts = _torchao(x)
    got = identify(ao_data, ao_scales, pts, x, global_is="decode").matches
    assert got == ("torchao", "torchao_cuda", "modelopt_export", "modelopt_export_cuda")  # amax/2688 lowers alike here
    ct = emulate("compressed_tensors", x)
    assert identify(ct.codes, ct.scales, ct.s_enc, x, global_is="encode").matches == ("compressed_tensors", "compressed_tensors_cuda")


def test_identify_global_conventions():
    x = tie_rich(0.8125, rows=4)
    ct = emulate("compressed_tensors", x)
    assert "compressed_tensors" in identify(ct.codes, ct.scales, ct.s_enc, x, global_is="encode").matches
    # the same value read as a decode multiplier matches nothing
    assert "compressed_tensors" not in identify(ct.codes, ct.scales, ct.s_enc, x, global_is="decode").matches
    r = identify(ct.codes, ct.scales, ct.s_dec, x, global_is="auto").per_mode["compressed_tensors"]
    assert r.global_match == "decode" and r.exact
    # a python float and a [1]-shaped tensor are accepted (compressed-tensors stores shape [1])
    assert "compressed_tensors" in identify(ct.codes, ct.scales, ct.s_enc.reshape(1), x, global_is="encode").matches
    assert "compressed_tensors" in identify(ct.codes, ct.scales, float(ct.s_enc), x, global_is="encode").matches
    with pytest.raises(QuantizationError, match="global_is"):
        identify(ct.codes, ct.scales, ct.s_enc, x, global_is="both")


def test_identify_input_forms():
    x = tie_rich(0.099609375, rows=48)  # 144 rows: swizzling pads rows to 256 and scale columns to 16
    q = emulate("vllm_sglang", x)
    packed = identify(q.codes, q.scales, q.s_enc, x, global_is="encode")
    unpacked = identify(q.unpacked_codes(), q.scales.view(torch.uint8), q.s_enc, x, global_is="encode")
    swz = identify(q.codes, to_swizzled_128x4(q.scales), q.s_enc, x, global_is="encode", scale_layout="swizzled_128x4")
    assert "vllm_sglang" in packed.matches
    assert packed.matches == unpacked.matches == swz.matches
    only = identify(q.codes, q.scales, q.s_enc, x, global_is="encode", modes=("vllm_sglang", "torchao"))
    assert set(only.per_mode) == {"vllm_sglang", "torchao"}
    with pytest.raises(QuantizationError, match="codes shape"):
        identify(q.codes[:, :-1], q.scales, q.s_enc, x)
    with pytest.raises(QuantizationError, match="scales shape"):
        identify(q.codes, q.scales[:-1], q.s_enc, x)
    with pytest.raises(QuantizationError, match="float32"):
        identify(q.codes, q.scales, q.s_enc.double(), x)
    with pytest.raises(KeyError):
        identify(q.codes, q.scales, q.s_enc, x, modes=("nope",))


def test_identify_reports_modes_without_bytes():
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    q = nvfp4_quantize(x)
    res = identify(q.codes, q.scales, q.s_enc, x, global_is="encode")
    assert set(res.matches) == {"te_reference", "vllm_sglang"}
    assert "amax == 0" in res.per_mode["torchao"].error and not res.per_mode["torchao"].exact
    assert "not applicable" in res.summary()
