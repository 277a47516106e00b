"""Compile representative kernels for sm_90 without a GPU (ptxas from the triton wheel).

Catches Triton frontend / layout / ptxas errors in CI; the full variant list is
``python -m qpass.backends.triton.aot``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton

from qpass.backends.triton import aot
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


def test_two_level_autotune_drops_spilling_tiles_for_dense_rac():
    """BN = 64 x BM = 256 two-level tiles spill with the dense RAC operand (SEG2 = 1; AOT report:
    255 registers + 256 B stack) and are pruned there, and only there."""
    g = kernel_lib(torch.device("cuda")).nvfp4_gemm
    cfgs = g._configs(False, True)
    wide = [c for c in cfgs if (c.kwargs["BN"], c.kwargs["BM"]) == (64, 256)]
    assert wide, "the two-level large-M configs should include BN=64 x BM=256 tiles"
    kept = g._prune(cfgs, {}, SEG2=1, PROMOTE_K=g.PROMOTE_K_LARGE)
    assert not [c for c in kept if (c.kwargs["BN"], c.kwargs["BM"]) == (64, 256)]
    assert len(kept) == len(cfgs) - len(wide)
    assert g._prune(cfgs, {}, SEG2=2, PROMOTE_K=g.PROMOTE_K_LARGE) == cfgs
    assert g._prune(cfgs, {}, SEG2=1, PROMOTE_K=0) == cfgs


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
