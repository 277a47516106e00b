"""Pinned Triton launch tiles (``qpass.backends.triton.tiles``): rules, recording, launcher dispatch,
and why they matter (a different ``BK`` of the same kernel sums differently: other output bits)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from qpass.backends.triton import tiles  # noqa: E402
from qpass.backends.triton._loader import kernel_lib  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_mode():
    tiles.set_tile_mode(None)
    tiles.reset_record()
    yield
    tiles.set_tile_mode(None)
    tiles.reset_record()


def _cfg_set(cfgs):
    return {(tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages) for c in cfgs}


def _as_cfg(t: tiles.Tile):
    return (tuple(sorted(t.meta)), t.num_warps, t.num_stages)


def test_every_rule_picks_one_of_its_autotuners_candidates():
    lib = kernel_lib("cpu")  # the candidate lists are plain Python in either copy
    g, v, f, q = lib.nvfp4_gemm, lib.nvfp4_gemv, lib.fp8, lib.nvfp4_quant
    assert _as_cfg(tiles.RULES["gemm_small"]({})) in _cfg_set(g._configs(True))
    # the large-M tile is one its autotuner keeps after the register prune, for every RAC segment kind
    # (SEG2 0: none, 1: dense B_R, 2: gathered) under either accumulation
    for promote, pk in ((True, 1024), (False, 0)):
        for seg2 in (0, 1, 2):
            shape = {"PROMOTE_K": pk, "SEG2": seg2}
            kept = g._prune(g._configs(False, promote), {}, **shape)
            assert _as_cfg(tiles.RULES["gemm_large"](shape)) in _cfg_set(kept), shape
    assert _as_cfg(tiles.RULES["gemv"]({})) in _cfg_set(v._configs(False))
    assert _as_cfg(tiles.RULES["gemv_split"]({})) in _cfg_set(v._configs(True))
    assert _as_cfg(tiles.RULES["fp8_gemm"]({"M_BUCKET": 64})) in _cfg_set(f._fp8_configs())
    assert _as_cfg(tiles.RULES["fp8_gemm"]({"M_BUCKET": 4096})) in _cfg_set(f._fp8_configs())
    assert _as_cfg(tiles.RULES["nvfp4_quant"]({})) in _cfg_set(q.big_configs())
    assert _as_cfg(tiles.RULES["rac_masked"]({})) in _cfg_set(q.big_configs())


def test_cli_choices_are_the_modes():
    from qpass.apps.runinfo import KERNEL_TILE_MODES

    assert set(KERNEL_TILE_MODES) == set(tiles.TILE_MODES) and KERNEL_TILE_MODES[0] == "pinned"  # the CLI default


def test_mode_env_scope_and_record(monkeypatch):
    monkeypatch.delenv(tiles.ENV, raising=False)
    assert tiles.tile_mode() == "autotune"
    assert tiles.pinned_tile("gemm_small", M_BUCKET=64, N=576, K=576) is None
    monkeypatch.setenv(tiles.ENV, "pinned")
    assert tiles.tile_mode() == "pinned"
    monkeypatch.setenv(tiles.ENV, "fastest")
    with pytest.raises(ValueError, match="QPASS_TRITON_TILES must be one of"):
        tiles.tile_mode()
    with pytest.raises(ValueError, match="tile mode must be one of"):
        tiles.set_tile_mode("fastest")
    with tiles.tile_mode_scope("pinned"):
        t = tiles.pinned_tile("gemm_small", M_BUCKET=64, N=576, K=576)
        assert t.kwargs() == {"BK": 128, "STAGES": 4, "num_warps": 4, "num_stages": 4}
        rep = tiles.report(autotuned=False)
    assert rep == {"mode": "pinned", "pinned": {"gemm_small": {"K=576,M_BUCKET=64,N=576": "BK: 128, STAGES: 4, num_warps: 4, num_stages: 4"}}}


class _Rec:
    """A fake kernel / autotuner: ``k[grid](*args, **kw)`` records the call."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *a, **kw: self.calls.append((grid, kw))


def _gemm_operands(m: int, n: int, k: int):
    from qpass.quant.nvfp4 import nvfp4_quantize

    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    q = nvfp4_quantize(w, w.float().abs().amax())
    a = torch.randn(m, k, dtype=torch.bfloat16)
    return a, q.codes.contiguous(), q.scales.view(torch.uint8).contiguous(), q.s_dec.reshape(1).float(), torch.empty(m, n, dtype=torch.bfloat16)


def test_gemm_launcher_calls_the_plain_kernel_with_the_pinned_tile(monkeypatch):
    """GPU dispatch code run on CPU with fake kernels: pinned -> the jit kernel with the rule's tile;
    autotune -> the autotuner."""
    mod = kernel_lib("cpu").nvfp4_gemm
    small, large, plain = _Rec(), {True: _Rec(), False: _Rec()}, _Rec()
    monkeypatch.setattr(mod, "INTERP", False)
    monkeypatch.setattr(mod, "_gemm_small", small, raising=False)
    monkeypatch.setattr(mod, "_gemm_large", large, raising=False)
    monkeypatch.setattr(mod, "_nvfp4_gemm_kernel", plain)
    a, c, s, d, out = _gemm_operands(64, 64, 576)
    mod.launch_nvfp4_gemm(a, c, s, d, out)  # autotune (default)
    assert len(small.calls) == 1 and not plain.calls
    with tiles.tile_mode_scope("pinned"):
        mod.launch_nvfp4_gemm(a, c, s, d, out)
        a2, c2, s2, d2, out2 = _gemm_operands(512, 64, 576)
        mod.launch_nvfp4_gemm(a2, c2, s2, d2, out2)
    assert len(small.calls) == 1 and not large[True].calls
    (g1, kw1), (g2, kw2) = plain.calls
    assert (kw1["BK"], kw1["STAGES"], kw1["num_warps"], kw1["num_stages"], kw1["BM"], kw1["BN"]) == (128, 4, 4, 4, 64, 64)
    assert (kw2["BN"], kw2["BM"], kw2["BK"], kw2["num_warps"], kw2["PROMOTE_K"]) == (64, 128, 64, 4, 1024)
    assert g2 == (1, 4, 1)  # cdiv(64, BN 64), cdiv(512, BM 128)
    rec = tiles.report(autotuned=False)["pinned"]
    assert set(rec) == {"gemm_small", "gemm_large"}


def test_gemv_and_quant_launchers_pin(monkeypatch):
    gv = kernel_lib("cpu").nvfp4_gemv
    auto, plain = _Rec(), _Rec()
    monkeypatch.setattr(gv, "INTERP", False)
    monkeypatch.setattr(gv, "_gemv_auto", auto, raising=False)
    monkeypatch.setattr(gv, "_gemv_split", _Rec(), raising=False)
    monkeypatch.setattr(gv, "_nvfp4_gemv_kernel", plain)
    monkeypatch.delenv("QPASS_NVFP4_GEMV_TILE", raising=False)
    a, c, s, d, out = _gemm_operands(1, 64, 576)
    with tiles.tile_mode_scope("pinned"):
        gv.launch_nvfp4_gemv(a, c, s, d, out)
    assert not auto.calls and plain.calls[0][1]["BN"] == 8 and plain.calls[0][1]["BK"] == 512
    assert plain.calls[0][1]["num_warps"] == 4
    qm = kernel_lib("cpu").nvfp4_quant
    qauto, qplain = _Rec(), _Rec()
    monkeypatch.setattr(qm, "INTERP", False)
    monkeypatch.setattr(qm, "_quant_tuned", qauto, raising=False)
    monkeypatch.setattr(qm, "_nvfp4_quant_kernel", qplain)
    x = torch.randn(128, 576, dtype=torch.bfloat16)
    with tiles.tile_mode_scope("pinned"):
        qm.launch_nvfp4_quant(x, torch.ones(1), False, xhat=torch.empty_like(x))
    assert not qauto.calls and qplain.calls[0][0] == (2, 5)  # cdiv(128, 16 x 4), cdiv(576, 128)


def test_a_different_bk_of_the_same_gemm_gives_other_bits():
    """Why autotuned tiles break repeatability: the small-M NVFP4 GEMM (two-level accumulation, every
    K tile promoted) at SmolLM2's K = 576 with BK 128 (the pick of bench_e2e.json) vs BK 256 (the pick
    of bench_m128_routing.json for the same key) - run under the interpreter through the same launch
    the pinned mode uses."""
    mod = kernel_lib("cpu").nvfp4_gemm
    a, c, s, d, _ = _gemm_operands(16, 64, 576)
    outs = []
    for bk in (128, 256):
        out = torch.empty(16, 64, dtype=torch.float32)
        grid = (1, 1, 1)
        # (a, codes, scales, S_dec_W, xs, a2, stride, K2, gidx, rs, bias, out, ws): W4A16, no RAC segment, no bias
        mod._nvfp4_gemm_kernel[grid](a, a.stride(0), c, c.stride(0), s, s.stride(0), d, d, d, 0, 0, d, d, d, out, out.stride(0),
                                     d, 16, 64, 576, 16, BM=16, BN=64, BK=bk, SPLIT_K=1, STAGES=1, num_warps=4, SEG2=0,
                                     A_F32=False, HAS_BIAS=False, OUT_DTYPE=mod._out_tl_dtype(torch.float32), DECODE=0,
                                     PROMOTE_K=1, XS=0, RS=0)
        outs.append(out)
    ref = (a.double() @ _operand(c, s, d).double().T) * float(d)  # factored decode (SPEC §3.1): acc(X B_W^T) * S_dec_W
    assert not torch.equal(outs[0], outs[1])
    for o in outs:  # both are the same product up to float32 summation order
        assert torch.allclose(o.double(), ref, rtol=1e-5, atol=1e-4)


def _operand(codes, scales, s_dec):
    from qpass.formats.spec import NVFP4_WEIGHT
    from qpass.quant.nvfp4 import NVFP4Tensor, nvfp4_operand

    t = NVFP4Tensor.from_parts(codes, scales.view(torch.float8_e4m3fn), s_dec.reshape(()), NVFP4_WEIGHT)
    return nvfp4_operand(t)  # B_W = e2m1 * s_b, exact
