"""Ahead-of-time compile of every qpass Triton kernel variant for sm_90, on a machine without a GPU.

``ptxas``/``cuobjdump`` ship inside the triton wheel, so a CPU box can run the whole Triton ->
TTGIR -> PTX -> cubin pipeline for Hopper and report registers, spills (``STACK``/``LOCAL``) and
whether the GEMMs issue wgmma (``HGMMA``/``QGMMA`` in the SASS). Catches frontend, layout and
ptxas errors before a GPU run; divisibility hints mimic the JIT's specialisation of aligned pointers
and K/N/strides that are multiples of 16.

Usage: ``python -m qpass.apps.bench.aot [--filter SUBSTR] [--sass SUBSTR]``; exit status 1 if any
variant fails to compile.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import qpass.backends.triton  # noqa: F401 - needs triton; registers its kernels (as when this module lived there)
from qpass.backends.triton._loader import kernel_lib

TARGET = GPUTarget("cuda", 90, 32)
P = {"bf16": "*bf16", "f16": "*fp16", "f32": "*fp32", "u8": "*u8", "i8": "*i8", "i32": "*i32", "i64": "*i64"}


DIV16_INTS = {"K", "N", "stride_xm", "stride_am", "stride_wn", "stride_sn", "stride_om", "stride_a2m", "KP", "K2",
              "stride_m", "s_stride0"}


def _attrs(fn, sig):
    """Divisibility-by-16 hints the JIT would derive at run time (aligned pointers, K/N/strides % 16 == 0)."""
    out = {}
    for i, name in enumerate(fn.arg_names):
        t = sig.get(name)
        if t is not None and (t.startswith("*") or name in DIV16_INTS):
            out[(i,)] = [["tt.divisibility", 16]]
    return out


def _sig(fn, types: dict[str, str], consts: dict[str, object]):
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        else:
            sig[name] = types.get(name, "i32")
    return sig


def _quant_variants(lib, tiles: list[tuple[int, int, int, int, int]]):
    """Variants of the fused NVFP4 quantize kernel (every flag set x tile, per tensor / per row)."""
    q = lib.nvfp4_quant._nvfp4_quant_kernel
    base_q = {"x_ptr": P["bf16"], "amax_ptr": P["f32"], "codes_ptr": P["u8"], "scales_ptr": P["u8"], "xhat_ptr": P["bf16"],
              "bx_ptr": P["bf16"], "senc_ptr": P["f32"], "sdec_ptr": P["f32"], "gamax_bits_ptr": P["i32"],
              "scores_ptr": P["i64"], "rcolmax_ptr": P["i32"], "rrowmax_ptr": P["i32"], "rabs_ptr": P["f32"]}
    flag_sets = (
        ("quant_plain", dict(WRITE_CODES=True, WRITE_XHAT=False, WRITE_GLOBAL=True, SCORES=False, RSTATS=False, RABS=False,
                             WRITE_BX=False)),
        ("quant_operand", dict(WRITE_CODES=False, WRITE_XHAT=False, WRITE_GLOBAL=True, SCORES=False, RSTATS=False,
                               RABS=False, WRITE_BX=True)),
        ("quant_xhat", dict(WRITE_CODES=False, WRITE_XHAT=True, WRITE_GLOBAL=False, SCORES=False, RSTATS=False, RABS=False,
                            WRITE_BX=False)),
        ("quant_rac_batch", dict(WRITE_CODES=True, WRITE_XHAT=False, WRITE_GLOBAL=True, SCORES=True, RSTATS=True, RABS=False,
                                 WRITE_BX=True)),
        ("quant_rac_token", dict(WRITE_CODES=True, WRITE_XHAT=False, WRITE_GLOBAL=True, SCORES=False, RSTATS=True, RABS=True,
                                 WRITE_BX=True)),
    )
    for (name, extra), (bm, bk, ri, nw, st) in itertools.product(flag_sets, tiles):
        for per_row in (False, True):
            c = dict(BM=bm, BK=bk, ROW_ITERS=ri, STAGES=st, PER_ROW=per_row, **extra)
            yield f"{name}[per_row={per_row},bm={bm},bk={bk},ri={ri},w={nw}]", q, _sig(q, base_q, c), c, nw, False


def _residual_variants(lib, full: bool, tiles: list[tuple[int, int, int, int, int]]):
    """Variants of the RAC residual kernels (masked, gathered)."""
    m = lib.rac._residual_masked_kernel
    tm = {"x_ptr": P["bf16"], "amax_x_ptr": P["f32"], "amax_r_ptr": P["f32"], "mask_ptr": P["i8"], "codes_ptr": P["u8"],
          "scales_ptr": P["u8"], "comp_ptr": P["bf16"], "senc_ptr": P["f32"], "sdec_ptr": P["f32"]}
    for mask2d, (bm, bk, ri, nw, st) in itertools.product((False, True), tiles):
        c = dict(BM=bm, BK=bk, ROW_ITERS=ri, STAGES=st, PER_ROW=False, MASK_2D=mask2d, WRITE_CODES=True, WRITE_COMP=True,
                 WRITE_GLOBAL=True, OPERAND=True)
        yield f"residual_masked[mask2d={mask2d},bm={bm},bk={bk},ri={ri},w={nw}]", m, _sig(m, tm, c), c, nw, False
    g = lib.rac._residual_gathered_kernel
    tg = {"x_ptr": P["bf16"], "qa_codes_ptr": P["u8"], "qa_scales_ptr": P["u8"], "qa_sdec_ptr": P["f32"], "idx_ptr": P["i32"],
          "amax_g_ptr": P["f32"], "codes_ptr": P["u8"], "scales_ptr": P["u8"], "comp_ptr": P["bf16"], "dense_ptr": P["bf16"],
          "senc_ptr": P["f32"], "sdec_ptr": P["f32"]}
    for (per_row, idx2d), bm in itertools.product(((False, False), (True, True), (True, False)), (1, 4, 16) if full else (16,)):
        c = dict(BM=bm, BKG=128, PER_ROW=per_row, IDX_2D=idx2d, WRITE_CODES=True, WRITE_COMP=True, WRITE_DENSE=idx2d,
                 WRITE_GLOBAL=True, OPERAND=True)
        yield f"residual_gathered[per_row={per_row},idx2d={idx2d},bm={bm}]", g, _sig(g, tg, c), c, 4, False


def _amax_variants(lib):
    """Variants of the amax kernels."""
    a = lib.amax
    ta = {"x_ptr": P["bf16"], "out_bits_ptr": P["i32"], "out_ptr": P["f32"]}
    c = dict(BM=32, BK=256)
    yield "amax_tile", a._amax_tile_kernel, _sig(a._amax_tile_kernel, ta, c), c, 4, False
    for bm, bk in ((1, 1024), (4, 512)):
        for glob in (True, False):
            c = dict(BM=bm, BK=bk, GLOBAL=glob)
            yield f"amax_rows[bm={bm},global={glob}]", a._amax_rows_kernel, _sig(a._amax_rows_kernel, ta, c), c, 4, False
    c = dict(BLOCK=16384)
    yield "amax_single", a._amax_single_kernel, _sig(a._amax_single_kernel, ta, c), c, 8, False


def _gemm_variants(lib, full: bool):
    """Variants of the NVFP4 GEMM (tile configs x RAC segments x weight decodes; fp32/fp16 inputs)."""
    import triton.language as tl

    gm = lib.nvfp4_gemm._nvfp4_gemm_kernel
    tgm = {"a_ptr": P["bf16"], "w_codes_ptr": P["u8"], "w_scales_ptr": P["u8"], "w_sdec_ptr": P["f32"], "xs_ptr": P["f32"],
           "a2_ptr": P["bf16"], "gidx_ptr": P["i32"], "rs_ptr": P["f32"], "bias_ptr": P["bf16"], "out_ptr": P["bf16"],
           "ws_ptr": P["f32"]}
    g = lib.nvfp4_gemm
    small_k, large_k = g.PROMOTE_K_SMALL, g.PROMOTE_K_LARGE
    # (label, tile config, warps, stages, PROMOTE_K: products per promoted partial sum, 0 = mma)
    gemm = [("decode", dict(BM=16, BN=64, BK=256, SPLIT_K=4, STAGES=3), 4, 3, small_k),
            ("decode_bk128", dict(BM=16, BN=64, BK=128, SPLIT_K=1, STAGES=4), 4, 4, small_k),
            ("mid", dict(BM=64, BN=64, BK=128, SPLIT_K=2, STAGES=4), 4, 4, small_k),
            ("prefill", dict(BM=128, BN=128, BK=64, SPLIT_K=1, STAGES=4), 8, 4, large_k),
            ("prefill_every_tile", dict(BM=128, BN=128, BK=64, SPLIT_K=1, STAGES=4), 8, 4, 1),
            ("prefill_mma", dict(BM=128, BN=128, BK=64, SPLIT_K=1, STAGES=4), 8, 4, 0),
            ("prefill_256_mma", dict(BM=256, BN=128, BK=64, SPLIT_K=1, STAGES=3), 8, 3, 0)]
    if full:
        gemm = []
        for (bm, split), promote in itertools.product(itertools.product((16, 32, 64), (1, 8)), (True, False)):
            for cfg in g._configs(True):
                kw = cfg.kwargs
                gemm.append((f"small_bm{bm}_s{split}_bk{kw['BK']}{'' if promote else '_mma'}",
                             dict(BM=bm, BN=64, BK=kw["BK"], SPLIT_K=split, STAGES=kw["STAGES"]), cfg.num_warps,
                             cfg.num_stages, small_k if promote else 0))
        for promote in (True, False):
            for cfg in g._configs(False, promote):
                kw = cfg.kwargs
                gemm.append((f"large_{kw['BN']}x{kw['BM']}x{kw['BK']}_s{kw['STAGES']}{'' if promote else '_mma'}",
                             dict(kw, SPLIT_K=1),
                             cfg.num_warps, cfg.num_stages, large_k if promote else 0))
    for label, cfg, nw, ns, promote_k in gemm:
        for seg2, dec in ((0, 0), (1, 0), (2, 0), (0, 1), (2, 1)):
            # W4A4 (+RAC): one activation scale (per tensor); seg2 = 0 is also the per-token variant's shape
            c = dict(cfg, SEG2=seg2, A_F32=False, HAS_BIAS=True, OUT_DTYPE=tl.bfloat16, DECODE=dec, PROMOTE_K=promote_k,
                     XS=1 if seg2 else 2, RS=1 if seg2 else 0)
            yield f"gemm_{label}[seg2={seg2}{',lut' if dec else ''}]", gm, _sig(gm, tgm, c), c, nw, ns
    for adt, odt, tdt in (("f32", "f32", tl.float32), ("f16", "f16", tl.float16)):
        for dec in (0, 1):
            c = dict(BM=16, BN=64, BK=128, SPLIT_K=1, STAGES=4, SEG2=0, A_F32=True, HAS_BIAS=False, OUT_DTYPE=tdt,
                     DECODE=dec, PROMOTE_K=small_k, XS=0, RS=0)
            yield (f"gemm_{adt}_input{'[lut]' if dec else ''}", gm, _sig(gm, dict(tgm, a_ptr=P[adt], out_ptr=P[odt]), c),
                   c, 4, 4)


def _gemv_variants(lib, full: bool):
    """Variants of the small-M NVFP4 GEMV."""
    import triton.language as tl

    gv = lib.nvfp4_gemv._nvfp4_gemv_kernel
    tgv = {"x_ptr": P["bf16"], "w_codes_ptr": P["u8"], "w_scales_ptr": P["u8"], "w_sdec_ptr": P["f32"], "xs_ptr": P["f32"],
           "bias_ptr": P["bf16"], "out_ptr": P["bf16"], "ws_ptr": P["f32"]}
    # (BN, BK, warps) of the GEMV autotune list; representative subset by default
    gv_tiles = [(8, 512, 4)]
    if full:
        gv_tiles = list(lib.nvfp4_gemv.TILES)
    for (bn, bk, nw), bm, dec in itertools.product(gv_tiles, (1, 2, 4), (0, 1)):
        for pairs, split in ((True, 1), (False, 1), (True, 4)) if (bm, dec) == (1, 0) else ((True, 1),):
            c = dict(BM=bm, BN=bn, BK=bk, SPLIT_K=split, HAS_BIAS=split == 1, OUT_DTYPE=tl.bfloat16, DECODE=dec,
                     X_PAIRS=pairs, XS=dec)  # W4A16 (XS = 0) and W4A4 with one activation scale (XS = 1)
            yield (f"gemv[bm={bm},bn={bn},bk={bk},w={nw}{',lut' if dec else ''}{'' if pairs else ',x16'}"
                   f"{f',split={split}' if split > 1 else ''}]", gv, _sig(gv, tgv, c), c, nw, False)
    # the row count as a compile-time 1: what Triton's specialization of an integer argument equal to 1
    # produces at every M = 1 launch (the H200 run of e986d31 failed to compile exactly this case)
    c = dict(BM=1, BN=8, BK=512, SPLIT_K=1, HAS_BIAS=True, OUT_DTYPE=tl.bfloat16, DECODE=0, X_PAIRS=True, M=1, XS=0)
    yield "gemv[bm=1,bn=8,bk=512,w=4,M=1 constexpr]", gv, _sig(gv, tgv, c), c, 4, False
    c = dict(BM=1, BN=8, BK=512, SPLIT_K=1, HAS_BIAS=False, OUT_DTYPE=tl.float32, DECODE=0, X_PAIRS=False, XS=0)
    yield "gemv_f32_input[bm=1,bn=8,bk=512,w=4]", gv, _sig(gv, dict(tgv, x_ptr=P["f32"], out_ptr=P["f32"]), c), c, 4, False


def _other_variants(lib, full: bool):
    """Variants of split-K reduce, FP8 quantize / GEMM, MXFP4 quantize, the probe."""
    import triton.language as tl

    red = lib.nvfp4_gemm._splitk_reduce_kernel
    tred = {"ws_ptr": P["f32"], "bias_ptr": P["bf16"], "w_sdec_ptr": P["f32"], "xs_ptr": P["f32"], "rs_ptr": P["f32"]}
    for odt, tdt in (("bf16", tl.bfloat16), ("f32", tl.float32)):
        for seg2 in (0, 1):
            c = dict(SPLIT_K=4, HAS_BIAS=True, OUT_DTYPE=tdt, BLOCK=1024, SEG2=seg2, XS=2, RS=2 if seg2 else 0)
            yield (f"splitk_reduce[{odt}{',seg2' if seg2 else ''}]", red, _sig(red, dict(tred, out_ptr=P[odt]), c), c, 4,
                   False)
    fq = lib.fp8._fp8_quant_kernel
    tf = {"x_ptr": P["bf16"], "amax_ptr": P["f32"], "zero_scale": "fp32", "data_ptr": P["u8"], "scale_ptr": P["f32"]}
    for gran, br, bm in ((0, 1, 16), (1, 1, 16), (2, 1, 16), (2, 128, 128)):
        c = dict(BM=bm, BK=128, GRAN=gran, BLOCK_ROWS=br)
        yield f"fp8_quant[gran={gran},br={br}]", fq, _sig(fq, tf, c), c, 8 if bm == 128 else 4, False
    fg = lib.fp8._fp8_gemm_kernel
    tfg = {"a_ptr": P["u8"], "sa_ptr": P["f32"], "w_ptr": P["u8"], "sw_ptr": P["f32"], "bias_ptr": P["bf16"], "out_ptr": P["bf16"]}
    fcfgs = [(128, 128, 8, 3)] if not full else [(c.kwargs["BM"], c.kwargs["BN"], c.num_warps, c.num_stages)
                                                  for c in lib.fp8._fp8_configs()]
    for (bm, bn, nw, ns), dot_fp8 in itertools.product(fcfgs, (True, False)):
        c = dict(A_BR=1, W_BR=128, BM=bm, BN=bn, BK=128, DOT_FP8=dot_fp8, HAS_BIAS=False, OUT_DTYPE=tl.bfloat16)
        yield f"fp8_gemm[{bm}x{bn},dot_fp8={dot_fp8}]", fg, _sig(fg, tfg, c), c, nw, ns
    mx = lib.mxfp4._mxfp4_quant_kernel
    c = dict(BM=16, BK=128)
    yield "mxfp4_quant", mx, _sig(mx, {"x_ptr": P["bf16"], "codes_ptr": P["u8"], "scales_ptr": P["u8"]}, c), c, 4, False
    pr = lib.probe._probe_kernel
    c = dict(OP=0, BLOCK=1024)
    yield "probe", pr, _sig(pr, {"x_ptr": P["f32"], "out_ptr": P["f32"]}, c), c, 4, False


def variants(lib, full: bool = False):
    """``(name, fn, signature, constexprs, num_warps, num_stages)`` of the kernels' launch variants.

    ``full``: every config the launchers/autotuners can pick (slow); default: a representative set.
    """
    tiles = [(16, 128, 4, 4, 3)]
    if full:
        tiles = [(c.kwargs["BM"], c.kwargs["BK"], c.kwargs["ROW_ITERS"], c.num_warps, c.kwargs["STAGES"])
                 for c in lib.nvfp4_quant.big_configs()] + [(bm, 128, 1, 4, 1) for bm in (1, 2, 8, 16)]
    yield from _quant_variants(lib, tiles)
    yield from _residual_variants(lib, full, tiles)
    yield from _amax_variants(lib)
    yield from _gemm_variants(lib, full)
    yield from _gemv_variants(lib, full)
    yield from _other_variants(lib, full)


def compile_variant(fn, sig, consts, num_warps: int, num_stages: int | bool):
    """``triton.compile`` one variant for sm_90 (no driver needed)."""
    opts = {"num_warps": num_warps, "enable_fp_fusion": False}
    if num_stages:
        opts["num_stages"] = num_stages
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=_attrs(fn, sig)), target=TARGET, options=opts)


def resource_usage(cubin: bytes) -> tuple[str, str]:
    """``("REG=.. STACK=.. SHARED=.. LOCAL=.. mma=..", sass)`` of a cubin (cuobjdump from the triton wheel)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    res = f"REG={m.group(1)} STACK={m.group(2)} SHARED={m.group(3)} LOCAL={m.group(4)}" if m else out.strip()[-120:]
    mma = "HGMMA" if "HGMMA" in sass else ("QGMMA" if "QGMMA" in sass else ("HMMA" if "HMMA" in sass else "-"))
    return f"{res} mma={mma}", sass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--filter", default="")
    ap.add_argument("--sass", default="", help="dump the SASS of variants matching this substring")
    ap.add_argument("--full", action="store_true", help="every config the launchers and autotuners can pick")
    args = ap.parse_args(argv)
    lib = kernel_lib(torch.device("cuda"))
    failures = 0
    for name, fn, sig, consts, nw, ns in variants(lib, full=args.full):
        if args.filter and args.filter not in name:
            continue
        t = time.time()
        try:
            ck = compile_variant(fn, sig, consts, nw, ns)
            usage, sass = resource_usage(ck.asm["cubin"])
            print(f"OK   {name:45s} {time.time() - t:5.1f}s {usage}", flush=True)
            if args.sass and args.sass in name:
                print(sass)
        except Exception as exc:  # noqa: BLE001
            failures += 1
            print(f"FAIL {name:45s} {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.exit(main())
