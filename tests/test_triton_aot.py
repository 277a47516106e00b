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
)


def test_compile_for_sm90():
    lib = kernel_lib(torch.device("cuda"))  # the compiled-mode copy; importing it needs no GPU
    seen = {}
    for name, fn, sig, consts, nw, ns in aot.variants(lib):
        if name in WANTED:
            ck = aot.compile_variant(fn, sig, consts, nw, ns)
            usage, sass = aot.resource_usage(ck.asm["cubin"])
            seen[name] = usage
            assert "LOCAL=0" in usage, (name, usage)
            if name.startswith("gemm"):
                assert "HGMMA" in sass, (name, usage)  # wgmma, not the mma.sync fallback
    assert set(seen) == set(WANTED), seen
