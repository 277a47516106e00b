"""The PTX of the table ("lut") NVFP4 weight decode, executed by a small PTX interpreter on CPU.

The GEMM's ``decode='lut'`` path is inline PTX (``prmt``/``lop3``), which the Triton interpreter
cannot run. This test executes the *exact asm strings* the kernel embeds, instruction by
instruction, on every code byte and many block scales, and requires bf16 bits equal to the
reference decode ``bf16(fl(fl(e2m1 * s_b) * s_dec))``. (The GPU self-check repeats the comparison
on the device.)
"""

from __future__ import annotations

import re

import numpy as np
import torch

from qpass.backends.triton._loader import kernel_lib
from qpass.formats.e2m1 import e2m1_decode

U32 = np.uint64(0xFFFFFFFF)


def _f32_bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)


def _bits_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint64) & U32).astype(np.uint32).view(np.float32)


def _bf16_rne_bits(f: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(f.astype(np.float32))).to(torch.bfloat16)
    return t.view(torch.int16).numpy().astype(np.uint16).astype(np.uint64)


def _prmt(a, b, sel):
    src = (a & U32) | ((b & U32) << np.uint64(32))
    out = np.zeros_like(src)
    for i in range(4):
        n = (sel >> np.uint64(4 * i)) & np.uint64(15)
        byte = (src >> ((n & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        rep = np.where((byte & np.uint64(0x80)) != 0, np.uint64(0xFF), np.uint64(0))
        out |= np.where((n & np.uint64(8)) != 0, rep, byte) << np.uint64(8 * i)
    return out


def _lop3(a, b, c, lut):
    out = np.zeros_like(a)
    for idx in range(8):
        if (lut >> idx) & 1:
            t = (a if idx & 4 else ~a) & (b if idx & 2 else ~b) & (c if idx & 1 else ~c)
            out |= t
    return out & U32


def run_ptx(asm: str, operands: dict[int, np.ndarray], n_out: int, n: int) -> list[np.ndarray]:
    """Execute the subset of PTX the decode asm uses; registers are uint64 arrays holding 32-bit values."""
    regs: dict[str, np.ndarray] = {f"${i}": v for i, v in operands.items()}

    def val(tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if tok.startswith("0f"):
            return np.full(n, int(tok[2:], 16), dtype=np.uint64)
        return np.full(n, int(tok, 0) & 0xFFFFFFFF, dtype=np.uint64)

    for raw in asm.replace("\\n", "\n").splitlines():
        line = raw.strip().rstrip(";").strip()
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        m = re.match(r"([\w.]+)\s+(.*)", line)
        op, args = m.group(1), m.group(2)
        if op == "mov.b32" and args.startswith("{"):
            lo, hi, src = re.match(r"\{\s*(\$\d+)\s*,\s*(\$\d+)\s*\}\s*,\s*(\S+)", args).groups()
            v = val(src)
            regs[lo], regs[hi] = v & np.uint64(0xFFFF), (v >> np.uint64(16)) & np.uint64(0xFFFF)
            continue
        a = [t.strip() for t in args.split(",")]
        d = a[0]
        if op in ("mov.b32", "mov.f32"):
            regs[d] = val(a[1])
        elif op == "shr.u32":
            regs[d] = (val(a[1]) & U32) >> np.uint64(int(a[2], 0))
        elif op == "shl.b32":
            regs[d] = (val(a[1]) << np.uint64(int(a[2], 0))) & U32
        elif op == "and.b32":
            regs[d] = val(a[1]) & val(a[2])
        elif op == "mad.lo.u32":
            regs[d] = (val(a[1]) * val(a[2]) + val(a[3])) & U32
        elif op == "prmt.b32":
            regs[d] = _prmt(val(a[1]), val(a[2]), val(a[3]))
        elif op == "lop3.b32":
            regs[d] = _lop3(val(a[1]), val(a[2]), val(a[3]), int(a[4], 0))
        elif op == "mul.rn.f32":
            regs[d] = _f32_bits(_bits_f32(val(a[1])) * _bits_f32(val(a[2])))  # numpy float32: one RNE rounding
        elif op == "cvt.rn.bf16x2.f32":
            regs[d] = (_bf16_rne_bits(_bits_f32(val(a[1]))) << np.uint64(16)) | _bf16_rne_bits(_bits_f32(val(a[2])))
        else:
            raise AssertionError(f"PTX instruction not modelled: {line}")
    return [regs[f"${i}"] for i in range(n_out)]


def test_lut_decode_ptx_matches_reference():
    gemm = kernel_lib("cpu").nvfp4_gemm
    table_asm, decode_asm = gemm._LUT_TABLE_ASM.value, gemm._LUT_DECODE_ASM.value
    rng = np.random.default_rng(20240611)  # fixed: the same words every run
    words = np.concatenate([np.arange(256, dtype=np.uint64) * np.uint64(0x01010101),  # every byte value
                            rng.integers(0, 2**32, size=256, dtype=np.uint64)])
    scale_bytes = np.concatenate([np.arange(0, 127, 9), rng.integers(0, 127, size=6)]).astype(np.uint8)
    for sdec in (1 / 3, 7.77e-3, 2.0**-20, 123.4):
        for sb in scale_bytes:
            s = float(torch.tensor([int(sb)], dtype=torch.uint8).view(torch.float8_e4m3fn).float())
            n = words.size
            sf = _f32_bits(np.full(n, s, dtype=np.float32))
            sd = _f32_bits(np.full(n, sdec, dtype=np.float32))
            t = run_ptx(table_asm, {4: sf, 5: sd}, 4, n)
            outs = run_ptx(decode_asm, {8: words, 9: t[0], 10: t[1], 11: t[2], 12: t[3]}, 8, n)
            for k in range(8):  # element k of the word: byte k // 2, low nibble first
                code = ((words >> np.uint64(4 * k)) & np.uint64(15)).astype(np.uint8)
                ref = (e2m1_decode(torch.from_numpy(code)) * torch.tensor(s)) * torch.tensor(sdec, dtype=torch.float32)
                ref_bits = ref.to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint16).astype(np.uint64)
                assert np.array_equal(outs[k], ref_bits), (k, int(sb), sdec)
