"""Compile every qpass Triton kernel variant for sm_90 on a machine without a GPU (ptxas ships with
the triton wheel) and report registers, spills, shared memory and whether the GEMMs use wgmma.

Usage: python scripts/triton_aot_check.py [--filter SUBSTR] [--sass]
Exit status 1 if any variant fails to compile. Catches frontend/layout/ptxas errors before a GPU run.
"""

from __future__ import annotations

import argparse
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


def variants(lib):
    q = lib.nvfp4_quant._nvfp4_quant_kernel
    base_q = {"x_ptr": P["bf16"], "amax_ptr": P["f32"], "codes_ptr": P["u8"], "scales_ptr": P["u8"], "xhat_ptr": P["bf16"],
              "senc_ptr": P["f32"], "sdec_ptr": P["f32"], "gamax_bits_ptr": P["i32"], "scores_ptr": P["i64"],
              "rcolmax_ptr": P["i32"], "rrowmax_ptr": P["i32"], "rabs_ptr": P["f32"]}
    for name, extra in (
        ("quant_plain", dict(WRITE_CODES=True, WRITE_XHAT=False, WRITE_GLOBAL=True, SCORES=False, RSTATS=False, RABS=False)),
        ("quant_xhat", dict(WRITE_CODES=False, WRITE_XHAT=True, WRITE_GLOBAL=False, SCORES=False, RSTATS=False, RABS=False)),
        ("quant_rac_batch", dict(WRITE_CODES=True, WRITE_XHAT=True, WRITE_GLOBAL=True, SCORES=True, RSTATS=True, RABS=False)),
        ("quant_rac_token", dict(WRITE_CODES=True, WRITE_XHAT=True, WRITE_GLOBAL=True, SCORES=False, RSTATS=True, RABS=True)),
    ):
        for per_row in (False, True):
            c = dict(BM=16, BK=128, ROW_ITERS=4, STAGES=3, PER_ROW=per_row, **extra)
            yield f"{name}[per_row={per_row}]", q, _sig(q, base_q, c), c, 4, False
    m = lib.rac._residual_masked_kernel
    tm = {"x_ptr": P["bf16"], "amax_x_ptr": P["f32"], "amax_r_ptr": P["f32"], "mask_ptr": P["i8"], "codes_ptr": P["u8"],
          "scales_ptr": P["u8"], "comp_ptr": P["bf16"], "senc_ptr": P["f32"], "sdec_ptr": P["f32"]}
    for mask2d in (False, True):
        c = dict(BM=16, BK=128, ROW_ITERS=4, STAGES=3, PER_ROW=False, MASK_2D=mask2d, WRITE_CODES=True, WRITE_COMP=True, WRITE_GLOBAL=True)
        yield f"residual_masked[mask2d={mask2d}]", m, _sig(m, tm, c), c, 4, False
    g = lib.rac._residual_gathered_kernel
    tg = {"x_ptr": P["bf16"], "qa_codes_ptr": P["u8"], "qa_scales_ptr": P["u8"], "qa_sdec_ptr": P["f32"], "idx_ptr": P["i32"],
          "amax_g_ptr": P["f32"], "codes_ptr": P["u8"], "scales_ptr": P["u8"], "comp_ptr": P["bf16"], "dense_ptr": P["bf16"],
          "senc_ptr": P["f32"], "sdec_ptr": P["f32"]}
    for per_row, idx2d in ((False, False), (True, True), (True, False)):
        c = dict(BM=16, BKG=128, PER_ROW=per_row, IDX_2D=idx2d, WRITE_CODES=True, WRITE_COMP=True, WRITE_DENSE=idx2d, WRITE_GLOBAL=True)
        yield f"residual_gathered[per_row={per_row},idx2d={idx2d}]", g, _sig(g, tg, c), c, 4, False
    a = lib.amax
    ta = {"x_ptr": P["bf16"], "out_bits_ptr": P["i32"], "out_ptr": P["f32"]}
    c = dict(BM=32, BK=256)
    yield "amax_tile", a._amax_tile_kernel, _sig(a._amax_tile_kernel, ta, c), c, 4, False
    c = dict(BM=4, BK=512)
    yield "amax_rows", a._amax_rows_kernel, _sig(a._amax_rows_kernel, ta, c), c, 4, False
    gm = lib.nvfp4_gemm._nvfp4_gemm_kernel
    tgm = {"a_ptr": P["bf16"], "w_codes_ptr": P["u8"], "w_scales_ptr": P["u8"], "w_sdec_ptr": P["f32"], "a2_ptr": P["bf16"],
           "gidx_ptr": P["i32"], "bias_ptr": P["bf16"], "out_ptr": P["bf16"], "ws_ptr": P["f32"]}
    import triton.language as tl
    for label, cfg, nw, ns in (
        ("decode", dict(BM=16, BN=64, BK=256, SPLIT_K=4, STAGES=4), 4, 4),
        ("decode_bk128", dict(BM=16, BN=64, BK=128, SPLIT_K=1, STAGES=5), 4, 5),
        ("mid", dict(BM=64, BN=64, BK=128, SPLIT_K=2, STAGES=4), 8, 4),
        ("prefill", dict(BM=128, BN=128, BK=64, SPLIT_K=1, STAGES=4), 8, 4),
        ("prefill_256", dict(BM=256, BN=128, BK=64, SPLIT_K=1, STAGES=3), 8, 3),
        ("prefill_bn256", dict(BM=128, BN=256, BK=64, SPLIT_K=1, STAGES=3), 8, 3),
    ):
        for seg2 in (0, 1, 2):
            c = dict(cfg, SEG2=seg2, A_F32=False, HAS_BIAS=True, OUT_DTYPE=tl.bfloat16)
            yield f"gemm_{label}[seg2={seg2}]", gm, _sig(gm, tgm, c), c, nw, ns
    c = dict(BM=16, BN=64, BK=128, SPLIT_K=1, STAGES=3, SEG2=0, A_F32=True, HAS_BIAS=False, OUT_DTYPE=tl.float32)
    t32 = dict(tgm, a_ptr=P["f32"], out_ptr=P["f32"])
    yield "gemm_f32_input", gm, _sig(gm, t32, c), c, 4, 3
    red = lib.nvfp4_gemm._splitk_reduce_kernel
    c = dict(SPLIT_K=4, HAS_BIAS=True, OUT_DTYPE=tl.bfloat16, BLOCK=1024)
    yield "splitk_reduce", red, _sig(red, {"ws_ptr": P["f32"], "bias_ptr": P["bf16"], "out_ptr": P["bf16"]}, c), c, 4, False
    fq = lib.fp8._fp8_quant_kernel
    tf = {"x_ptr": P["bf16"], "amax_ptr": P["f32"], "zero_scale": "fp32", "data_ptr": P["u8"], "scale_ptr": P["f32"]}
    for gran, br, bm in ((0, 1, 16), (1, 1, 16), (2, 1, 16), (2, 128, 128)):
        c = dict(BM=bm, BK=128, GRAN=gran, BLOCK_ROWS=br)
        yield f"fp8_quant[gran={gran},br={br}]", fq, _sig(fq, tf, c), c, 8 if bm == 128 else 4, False
    fg = lib.fp8._fp8_gemm_kernel
    tfg = {"a_ptr": P["u8"], "sa_ptr": P["f32"], "w_ptr": P["u8"], "sw_ptr": P["f32"], "bias_ptr": P["bf16"], "out_ptr": P["bf16"]}
    for dot_fp8 in (True, False):
        c = dict(A_BR=1, W_BR=128, BM=128, BN=128, BK=128, DOT_FP8=dot_fp8, HAS_BIAS=False, OUT_DTYPE=tl.bfloat16)
        yield f"fp8_gemm[dot_fp8={dot_fp8}]", fg, _sig(fg, tfg, c), c, 8, 3
    mx = lib.mxfp4._mxfp4_quant_kernel
    c = dict(BM=16, BK=128)
    yield "mxfp4_quant", mx, _sig(mx, {"x_ptr": P["bf16"], "codes_ptr": P["u8"], "scales_ptr": P["u8"]}, c), c, 4, False


def resource_usage(cubin: bytes) -> str:
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
    args = ap.parse_args(argv)
    lib = kernel_lib(torch.device("cuda"))
    failures = 0
    for name, fn, sig, consts, nw, ns in variants(lib):
        if args.filter and args.filter not in name:
            continue
        t = time.time()
        opts = {"num_warps": nw, "enable_fp_fusion": False}
        if ns:
            opts["num_stages"] = ns
        try:
            ck = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=_attrs(fn, sig)), target=TARGET, options=opts)
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
