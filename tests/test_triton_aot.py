"""Compile representative kernels for sm_90 without a GPU (ptxas from the triton wheel).

Catches Triton frontend / layout / ptxas errors in CI; the full variant list is
``python -m qpass.apps.bench.aot``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton

from qpass.apps.bench import aot
from qpass.backends.triton._loader import kernel_lib

_PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"

pytestmark = pytest.mark.skipif(not _PTXAS.exists(), reason="triton wheel without ptxas")

WANTED = (
    "quant_rac_batch[per_row=False,bm=16,bk=128,ri=4,w=4]",
    "residual_masked[mask2d=False,bm=16,bk=128,ri=4,w=4]",
    "gemm_decode_bk128[seg2=2]",
    "gemm_prefill[seg2=1]",
    "gemm_prefill[seg2=0]",
    "gemm_prefill_every_tile[seg2=0]",
    "gemm_prefill_mma[seg2=0]",
)


def test_compile_for_sm90():
    lib = kernel_lib(torch.device("cuda"))  # the compiled-mode copy; importing it needs no GPU
    seen, fadds, ptx = {}, {}, {}
    for name, fn, sig, consts, nw, ns in aot.variants(lib):
        if name in WANTED:
            ck = aot.compile_variant(fn, sig, consts, nw, ns)
            usage, sass = aot.resource_usage(ck.asm["cubin"])
            seen[name] = usage
            assert "LOCAL=0" in usage, (name, usage)
            if name.startswith("gemm"):
                assert "HGMMA" in sass, (name, usage)  # wgmma, not the mma.sync fallback
            fadds[name] = sass.count("FADD")
            ptx[name] = ck.asm["ptx"]
    assert set(seen) == set(WANTED), seen
    # two-level accumulation keeps its own float32 add per accumulator element (a plain
    # ``acc + dot(a, b, 0)`` would be folded back into the wgmma accumulator): 128 x 128 tile over
    # 256 threads = at least 64 more FADDs than the mma-accumulated variant
    for name in ("gemm_prefill[seg2=0]", "gemm_prefill_every_tile[seg2=0]"):
        assert fadds[name] >= fadds["gemm_prefill_mma[seg2=0]"] + 64, fadds
    # the chunked form (the large-M default) keeps the wgmma asynchronous inside a chunk, as the
    # mma form does (up to 3 groups in flight); promoting every tile has to wait for each one
    assert "wgmma.wait_group.sync.aligned 3" in ptx["gemm_prefill_mma[seg2=0]"]
    assert "wgmma.wait_group.sync.aligned 3" in ptx["gemm_prefill[seg2=0]"]
    assert "wgmma.wait_group.sync.aligned 3" not in ptx["gemm_prefill_every_tile[seg2=0]"]


def test_two_level_autotune_keeps_only_non_spilling_tiles_for_dense_rac():
    """The dense RAC operand (SEG2 = 1) has two accumulations (SPEC §3.1) and their two-level partials:
    four float32 tiles. The autotuner keeps only the 64 x 64 tiles there, each of which compiles for
    sm_90 without spilling; the gathered operand and plain launches keep the whole list."""
    import triton.language as tl

    g = kernel_lib(torch.device("cuda")).nvfp4_gemm
    cfgs = g._configs(False, True)
    kept = g._prune(cfgs, {}, SEG2=1, PROMOTE_K=g.PROMOTE_K_LARGE)
    assert kept and all(c.kwargs["BN"] * c.kwargs["BM"] <= 64 * 64 for c in kept) and len(kept) < len(cfgs)
    assert g._prune(cfgs, {}, SEG2=2, PROMOTE_K=g.PROMOTE_K_LARGE) == cfgs
    assert g._prune(cfgs, {}, SEG2=0, PROMOTE_K=g.PROMOTE_K_LARGE) == cfgs
    mma = g._configs(False, False)
    assert all(c.kwargs["BN"] * c.kwargs["BM"] <= 128 * 128 for c in g._prune(mma, {}, SEG2=1, PROMOTE_K=0))
    assert g._prune(mma, {}, SEG2=0, PROMOTE_K=0) == mma
    gm = g._nvfp4_gemm_kernel
    P = aot.P
    types = {"a_ptr": P["bf16"], "w_codes_ptr": P["u8"], "w_scales_ptr": P["u8"], "w_sdec_ptr": P["f32"], "xs_ptr": P["f32"],
             "a2_ptr": P["bf16"], "gidx_ptr": P["i32"], "rs_ptr": P["f32"], "bias_ptr": P["bf16"], "out_ptr": P["bf16"],
             "ws_ptr": P["f32"]}
    for cfg in kept:
        c = dict(cfg.kwargs, SPLIT_K=1, SEG2=1, A_F32=False, HAS_BIAS=True, OUT_DTYPE=tl.bfloat16, DECODE=0,
                 PROMOTE_K=g.PROMOTE_K_LARGE, XS=1, RS=1)
        ck = aot.compile_variant(gm, aot._sig(gm, types, c), c, cfg.num_warps, cfg.num_stages)
        usage, _ = aot.resource_usage(ck.asm["cubin"])
        assert "STACK=0 " in usage and "LOCAL=0" in usage, (cfg.kwargs, usage)


def _loop_bodies(ptx: str) -> list[str]:
    """PTX text of every loop: from a label to a later branch back to it."""
    import re

    bodies = []
    for m in re.finditer(r"^(\$L__BB\d+_\d+):", ptx, re.M):
        back = re.search(r"bra(?:\.uni)?\s+" + re.escape(m.group(1)) + ";", ptx[m.end():])
        if back:
            bodies.append(ptx[m.end(): m.end() + back.start()])
    return bodies


def test_gemv_compiles_without_spills_or_shared_memory_in_its_k_loop():
    """The small-M GEMV at its autotune tiles: no spills, and its K loop never goes through shared
    memory (no layout conversion of the code words, scales or activations per tile: the design
    keeps every decoded element in the thread that loaded its word)."""
    lib = kernel_lib(torch.device("cuda"))
    wanted = {"gemv[bm=1,bn=8,bk=512,w=4,split=4]", "gemv[bm=2,bn=8,bk=512,w=4,lut]"}
    for bn, bk, nw in lib.nvfp4_gemv.TILES:  # every autotune tile, 1 row / arithmetic and 4 rows / lut decode
        wanted |= {f"gemv[bm=1,bn={bn},bk={bk},w={nw}]", f"gemv[bm=4,bn={bn},bk={bk},w={nw},lut]"}
    seen = set()
    for name, fn, sig, consts, nw, ns in aot.variants(lib, full=True):
        if name in wanted:
            ck = aot.compile_variant(fn, sig, consts, nw, ns)
            usage, sass = aot.resource_usage(ck.asm["cubin"])
            assert "LOCAL=0" in usage and "STACK=0" in usage, (name, usage)
            loops = _loop_bodies(ck.asm["ptx"])
            assert loops, name
            for body in loops:
                assert "bar.sync" not in body and "st.shared" not in body and "ld.shared" not in body, name
                assert "ld.global.v4.b32" in body or "ld.global.v2.b32" in body, name  # code words: vector loads
            seen.add(name)
    assert seen == wanted, seen
