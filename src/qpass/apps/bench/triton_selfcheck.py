"""Large-shape correctness of the Triton kernels on a CUDA device (the GPU half of the test suite).

Checks, each against the plain-torch reference running on the same device:

* quantization bytes bit for bit: NVFP4 (8192x8192 bf16 weights per tensor, activations per
  token, fp16/fp32 inputs, outlier channels), FP8 (all four granularities), MXFP4; the GPU
  reference itself is spot-checked against the CPU reference;
* RAC: ``rac_triton`` vs ``rac_reference`` (qa/qr bytes, channels, operands) for every
  mode x selection x global-scope combination at 4096x4096;
* the GEMM's in-register weight decode, both variants (``ref`` arithmetic, ``lut`` table + byte
  permutes), bit for bit via one-hot activation rows;
* GEMMs: relative Frobenius error vs an fp64 product of the same dequantized operands (< 1e-5)
  for W4A16, W4A4 (+RAC) at decode and prefill sizes and a K that is not a multiple of any tile;
  the small-M GEMV (M = 1..4, Llama-8B / SmolLM2 / ragged shapes, both decodes) to the same bound,
  its repeated calls bit-identical, its bf16 output within rounding of the reference;
  FP8 paths (``torch._scaled_mm`` blockwise and the Triton kernels) report their error;
* CUDA-graph capture of the decode path (W4A4 + RAC) replays to the eager bits;
* ``qpass.ops`` dispatch under ``use_kernels('triton')``.

Usage: ``python -m qpass.apps.bench.triton_selfcheck [--out report.json] [--quick] [--only SUBSTR]``; exit 1 on
any failure (``--only GEMV``: the small-M GEMV checks alone).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import sys
import time
from pathlib import Path
import traceback
from collections.abc import Callable

import torch

import qpass.backends.triton  # noqa: F401 - needs triton; registers its kernels (as when this module lived there)
from qpass.formats.spec import FP8_ACT_BLOCK, NVFP4_ACT, NVFP4_ACT_PER_TOKEN
from qpass.quant.fp8 import fp8_dequantize, fp8_quantize
from qpass.quant.mxfp4 import mxfp4_quantize
from qpass.quant.nvfp4 import nvfp4_dequantize, nvfp4_quantize
from qpass.quant.rac import RACConfig, rac_reference

#: a check: ``() -> (ok, detail)``. The check functions below import their kernels from ``qpass.backends.triton``
#: inside the function, not at module import, so a test that patches that package before :func:`checks` reaches them
Check = Callable[[], tuple[bool, str]]


class Report:
    """Collects named checks; a check that raises is a failure with its traceback.

    With ``path`` the JSON report is rewritten (atomically) after every check, so a run that is
    killed part-way still leaves the results so far.
    """

    def __init__(self, path: str | None = None, meta: dict | None = None, only: str | None = None):
        # run only the checks whose name contains one of these ';'-separated substrings
        self.only = [o for o in (only or "").split(";") if o]
        self.items: list[dict] = []
        self.path = path
        self.meta = dict(meta or {})
        self.t0 = time.monotonic()

    def save(self, final: bool = False) -> None:
        if not self.path:
            return
        from pathlib import Path

        from qpass.jsonio import write_json

        out = {**self.meta, "ok": self.ok, "complete": final, "wall_s": round(time.monotonic() - self.t0, 1),
               "checks": self.items}
        write_json(Path(self.path), out, indent=1)

    def run(self, name: str, fn: Callable[[], tuple[bool, str]]) -> None:
        if self.only and not any(o in name for o in self.only):
            return
        t = time.monotonic()
        try:
            ok, detail = fn()
        except Exception as exc:  # noqa: BLE001
            ok, detail = False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
        item = {"name": name, "ok": bool(ok), "detail": detail, "seconds": round(time.monotonic() - t, 2)}
        self.items.append(item)
        self.save()
        print(f"[{'PASS' if ok else 'FAIL'}] {name} ({item['seconds']}s): {detail.splitlines()[0] if detail else ''}", flush=True)

    @property
    def ok(self) -> bool:
        return all(i["ok"] for i in self.items)


def _acts(m, k, dev, dtype=torch.bfloat16):
    scale = torch.exp(torch.randn(k, device=dev) * 0.7)
    x = torch.randn(m, k, device=dev) * scale
    ch = torch.randperm(k, device=dev)[:8]
    x[:, ch] *= torch.empty(8, device=dev).uniform_(20, 60)
    x[0, :16] = 0
    if m > 1 and k >= 32:
        x[1, 16:32] *= 1e-4
    return x.to(dtype)


def _u8(t):
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _same(a, b) -> list[str]:
    bad = []
    if not torch.equal(a.codes, b.codes):
        bad.append(f"codes ({int((a.codes != b.codes).sum())} bytes differ)")
    if not torch.equal(_u8(a.scales), _u8(b.scales)):
        bad.append("scales")
    if not torch.equal(a.s_dec, b.s_dec):
        bad.append("s_dec")
    return bad


def _rel(y, ref) -> float:
    ref = ref.double()
    return float((y.double() - ref).norm() / ref.norm())


def _cublas_floor(parts, bias, ref) -> float | None:
    """Relative error of cuBLAS on the same exact bf16 terms (``sum_i fl(A_i @ W_i^T * alpha_i)``,
    fp32 accumulate and output; ``parts`` = ``(A, W, alpha)`` of :func:`qpass.quant.linear.nvfp4_gemm_terms`),
    or None off CUDA: the fp32-accumulation floor of a tensor-core GEMM at this shape, reported
    beside our kernel's error."""
    if parts[0][0].device.type != "cuda":
        return None
    y = sum(torch.mm(a.to(torch.bfloat16), w.to(torch.bfloat16).t(), out_dtype=torch.float32) * al for a, w, al in parts)
    return _rel(y + bias, ref)


def _call(x, w, bias=None, act=None, rac=None, static=None):
    """The typed call of one NVFP4 linear (``qpass.ops.calls.NVFP4LinearCall``)."""
    from qpass.ops.calls import NVFP4LinearCall

    return NVFP4LinearCall(x=x, weight=w, bias=bias, act=act, rac=rac, rac_channels=static, site="selfcheck",
                           out_dtype=torch.float32)


def _exact(x, w, bias=None, act=None, rac=None, static=None):
    """fp64 value of the factored product (SPEC §3.1) of the same quantized operands."""
    from qpass.quant.linear import nvfp4_linear_exact

    return nvfp4_linear_exact(_call(x, w, bias, act, rac, static))[0]


def _terms(x, w, act=None, rac=None, static=None):
    from qpass.quant.linear import nvfp4_gemm_terms

    return nvfp4_gemm_terms(_call(x, w, None, act, rac, static))


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """Device and problem sizes of one run of :func:`checks` (its arguments and the sizes derived from them)."""

    dev: torch.device
    big: int
    quick: bool
    tiny: bool

    @property
    def sm(self) -> int:
        """Divisor of the toy sizes (``tiny``: the CPU interpreter's smoke run)."""
        return 16 if self.tiny else 1

    @property
    def n_big(self) -> int:
        """N = K of the large GEMMs."""
        return self.big if self.tiny else (4096 if self.quick else self.big)

    @property
    def m_big(self) -> int:
        """The largest M of the GEMMs."""
        return 16 if self.tiny else 4096


# ---- quantization bytes
def _q_nvfp4(s: _Sizes, m: int, k: int, dtype: torch.dtype, per_token: bool) -> Check:
    from qpass.backends.triton import nvfp4_quantize_triton

    dev = s.dev

    def f():
        x = _acts(m, k, dev, dtype)
        spec = NVFP4_ACT_PER_TOKEN if per_token else None
        got = nvfp4_quantize_triton(x, per_token=per_token)
        ref = nvfp4_quantize(x, spec=spec) if spec else nvfp4_quantize(x)
        bad = _same(got, ref)
        # the GPU reference equals the CPU reference (spot check of 256 rows)
        xc = x[:256].cpu()
        refc = nvfp4_quantize(xc, spec=spec) if spec else nvfp4_quantize(xc, ref.amax.cpu() if not per_token else None)
        if not torch.equal(refc.codes, ref.codes[:256].cpu()):
            bad.append("GPU reference != CPU reference")
        return not bad, ", ".join(bad) or f"bit-identical ({m}x{k} {dtype})"
    return f


def _q_fp8(s: _Sizes) -> tuple[bool, str]:
    from qpass.backends.triton import fp8_quantize_triton

    dev, big = s.dev, s.big
    x = _acts(big, big, dev)
    bad = []
    for g in ("per_tensor", "per_token", "block_1x128", "block_128x128"):
        a, b = fp8_quantize_triton(x, g), fp8_quantize(x, g)
        if not (torch.equal(_u8(a.data), _u8(b.data)) and torch.equal(a.scale, b.scale)):
            bad.append(g)
    return not bad, ("differs: " + ", ".join(bad)) if bad else "4 granularities bit-identical"


def _q_mx(s: _Sizes) -> tuple[bool, str]:
    from qpass.backends.triton import mxfp4_quantize_triton

    dev, sm = s.dev, s.sm
    x = _acts(4096 // sm, 4096 // sm, dev)
    a, b = mxfp4_quantize_triton(x), mxfp4_quantize(x)
    return torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales), "mxfp4 4096x4096"


# ---- RAC
def _rac_all(s: _Sizes) -> tuple[bool, str]:
    from qpass.backends.triton import rac_triton

    dev, tiny, quick = s.dev, s.tiny, s.quick
    m, k = (32, 64) if tiny else ((1024, 2048) if quick else (4096, 4096))
    x = _acts(m, k, dev)
    bad = []
    for mode, sel, pt in itertools.product(("masked", "gathered"), ("batch", "token", "static"), (False, True)):
        cfg = RACConfig(0.5, mode, sel)
        spec = NVFP4_ACT_PER_TOKEN if pt else NVFP4_ACT
        st = torch.randperm(k, device=dev)[: k // 3] if sel == "static" else None
        a, b = rac_triton(x, cfg, spec, static_channels=st), rac_reference(x, cfg, spec, static_channels=st)
        diff = [n for n, ok in (
            ("channels", torch.equal(a.channels, b.channels)),
            ("qa", not _same(a.qa, b.qa)), ("qr", not _same(a.qr, b.qr)),
            ("x_hat", torch.equal(a.x_hat, b.x_hat)), ("comp", torch.equal(a.comp, b.comp)),
        ) if not ok]
        if diff:
            bad.append(f"{mode}/{sel}/{'token' if pt else 'tensor'}: {diff}")
    return not bad, "; ".join(bad) or f"12 combinations bit-identical at {m}x{k}"


# ---- exact in-register weight decode: a one-hot activation row picks one weight column, and
# a float32 output holds the decoded bf16 value exactly (products with 1, sums of exact zeros)
def _decode_exact(s: _Sizes, decode: str, m: int, gemv: bool | None = None) -> Check:
    from qpass.backends.triton import w4a16_linear_triton

    dev, tiny = s.dev, s.tiny

    def f():
        n, k = (64, 256) if tiny else (512, 2048)
        blocks = torch.exp(torch.empty(n, k // 16, 1, device=dev).uniform_(-9, 9))
        wf = (torch.randn(n, k // 16, 16, device=dev) * blocks).reshape(n, k)
        w = nvfp4_quantize(wf.to(torch.bfloat16))
        wh = nvfp4_dequantize(w, torch.float32)  # fl(B * S_dec): a one-hot row's fl(acc * alpha)
        cols = torch.arange(k, device=dev) if m >= k else torch.randperm(k, device=dev)[:m]
        x = torch.zeros(cols.numel(), k, device=dev, dtype=torch.bfloat16)
        x[torch.arange(cols.numel(), device=dev), cols] = 1.0
        y = w4a16_linear_triton(x, w.codes, w.scales, w.s_dec, out_dtype=torch.float32, decode=decode, gemv=gemv)
        ref = wh[:, cols].t()
        same = torch.equal(y, ref)  # value equality: the accumulator turns a decoded -0.0 into +0.0
        return same, f"{int((y != ref).sum())} of {y.numel()} decoded values differ" if not same else \
            f"{y.numel()} decoded values equal the reference ({cols.numel()} one-hot rows)"
    return f


# ---- GEMMs
def _gemm_w4a16(s: _Sizes) -> tuple[bool, str]:
    from qpass.backends.triton import w4a16_linear_triton

    dev, n_big, m_big = s.dev, s.n_big, s.m_big
    w = nvfp4_quantize((torch.randn(n_big, n_big, device=dev) * 0.02).to(torch.bfloat16))
    errs, mma, floors = {}, {}, {}
    for m in (1, 16, 128, m_big):
        x = _acts(m, n_big, dev)
        ref = _exact(x, w)
        y = w4a16_linear_triton(x, w.codes, w.scales, w.s_dec, out_dtype=torch.float32)
        errs[m] = _rel(y, ref)
        y = w4a16_linear_triton(x, w.codes, w.scales, w.s_dec, out_dtype=torch.float32, accumulation="mma")
        mma[m] = _rel(y, ref)
        floors[m] = _cublas_floor(_terms(x, w), 0.0, ref)
    fmt = lambda d: "{" + ", ".join(f"{a}: {b:.1e}" for a, b in d.items()) + "}"  # noqa: E731
    fl = "" if floors[1] is None else f"; cuBLAS on the same bf16 terms: {fmt(floors)}"
    return max(errs.values()) < 1e-5, f"rel err by M: {fmt(errs)}; with accumulation='mma': {fmt(mma)}{fl}"


def _gemv(s: _Sizes, shapes: list[tuple[int, int]], decode: str | None = None) -> Check:
    """Small-M GEMV (M = 1..4, ``gemv=True``) vs fp64 of the same factored operands (SPEC §3.1),
    the GEMM's bound (< 1e-5); the tensor-core GEMM (``gemv=False``) and cuBLAS on the same inputs
    are reported beside it; a repeated call must give the same bits (no atomics)."""
    from qpass.backends.triton import w4a16_linear_triton

    dev, tiny = s.dev, s.tiny
    from qpass.quant.linear import nvfp4_linear_reference

    def f():
        errs, gemm, floors, bad = {}, {}, {}, []
        for n, k in shapes:
            w = nvfp4_quantize((torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16))
            bias = torch.randn(n, device=dev)
            for m in (1, 3) if tiny else (1, 2, 3, 4):
                x = _acts(m, k, dev)
                ref = _exact(x, w, bias)
                key = f"{n}x{k} M={m}"
                y = w4a16_linear_triton(x, w.codes, w.scales, w.s_dec, bias, out_dtype=torch.float32, decode=decode,
                                        gemv=True)
                errs[key] = _rel(y, ref)
                y2 = w4a16_linear_triton(x, w.codes, w.scales, w.s_dec, bias, out_dtype=torch.float32, decode=decode,
                                         gemv=True)
                if not torch.equal(y, y2):
                    bad.append(f"{key}: repeated call differs")
                gemm[key] = _rel(w4a16_linear_triton(x, w.codes, w.scales, w.s_dec, bias, out_dtype=torch.float32,
                                                     decode=decode, gemv=False), ref)
                floors[key] = _cublas_floor(_terms(x, w), bias, ref)
                # bf16 output through the default route (the GEMV on CUDA) vs the reference op
                yb = w4a16_linear_triton(x, w.codes, w.scales, w.s_dec, bias.to(torch.bfloat16), decode=decode)
                c = _call(x, w, bias.to(torch.bfloat16))
                rb = nvfp4_linear_reference(c).float()
                if not bool(((yb.float() - rb).abs() <= 2**-7 * rb.abs() + 1e-3 * rb.abs().max()).all()):
                    bad.append(f"{key}: bf16 output off the reference by more than rounding")
        worst = max(errs.values())
        fmt = lambda d: ", ".join(f"{a}: {b:.1e}" for a, b in d.items() if b is not None)  # noqa: E731
        ok = worst < 1e-5 and not bad
        return ok, (f"max rel err {worst:.2e}; {'; '.join(bad) + '; ' if bad else ''}GEMV: {fmt(errs)}; "
                    f"GEMM (gemv=False): {fmt(gemm)}" + (f"; cuBLAS on the same bf16 terms: {fmt(floors)}"
                                                        if floors and None not in floors.values() else ""))
    return f


def _gemv_w4a4(s: _Sizes) -> tuple[bool, str]:
    from qpass.backends.triton import w4a4_linear_triton

    dev, tiny = s.dev, s.tiny
    n, k = (64, 256) if tiny else (4096, 4096)
    w = nvfp4_quantize((torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16))
    errs = {}
    for m, pt in ((1, False), (4, True)) if tiny else ((1, False), (3, False), (4, True)):
        spec = NVFP4_ACT_PER_TOKEN if pt else NVFP4_ACT
        x = _acts(m, k, dev)
        y = w4a4_linear_triton(x, w.codes, w.scales, w.s_dec, act_spec=spec, out_dtype=torch.float32, gemv=True)
        errs[f"M={m}{'/tok' if pt else ''}"] = _rel(y, _exact(x, w, act=spec))
    worst = max(errs.values())
    return worst < 1e-5, f"max rel err {worst:.2e}; " + ", ".join(f"{a}: {b:.1e}" for a, b in errs.items())


def _gemm_w4a4(s: _Sizes, n: int, k: int, decode: str | None = None, compare_mma: bool = False) -> Check:
    """Gated on the default (two-level) accumulation; ``compare_mma`` also reports the error of
    ``accumulation='mma'`` (whole K sum in the tensor-core accumulator) on the same inputs."""
    from qpass.backends.triton import w4a4_linear_triton

    dev, sm, m_big = s.dev, s.sm, s.m_big

    def f():
        w = nvfp4_quantize((torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16))
        bias = torch.randn(n, device=dev)
        errs, floors, mma = {}, {}, {}

        def measure(key, ref, x, **kw):
            """Error of the default accumulation (and of ``mma`` when compared) against ``ref``."""
            errs[key] = _rel(w4a4_linear_triton(x, w.codes, w.scales, w.s_dec, bias, out_dtype=torch.float32,
                                                decode=decode, **kw), ref)
            if compare_mma:
                mma[key] = _rel(w4a4_linear_triton(x, w.codes, w.scales, w.s_dec, bias, out_dtype=torch.float32,
                                                   decode=decode, accumulation="mma", **kw), ref)

        for m, pt in ((16, False), (128 // sm, False), (m_big, False), (64 // sm, True)):
            spec = NVFP4_ACT_PER_TOKEN if pt else NVFP4_ACT
            key = f"M={m}{'/tok' if pt else ''}"
            x = _acts(m, k, dev)
            ref = _exact(x, w, bias, spec)
            measure(key, ref, x, act_spec=spec)
            floors[key] = _cublas_floor(_terms(x, w, spec), bias, ref)
        # M = 128: two 64-row tiles of the small-M kernel; with N = 1000 it also splits K (8 ways)
        for m, (mode, sel) in itertools.product((16, 128 // sm, m_big // 2), (("gathered", "batch"), ("masked", "batch"),
                                                              ("gathered", "token"), ("masked", "static"))):
            cfg = RACConfig(0.5, mode, sel)
            x = _acts(m, k, dev)
            st = torch.randperm(k, device=dev)[: k // 4] if sel == "static" else None
            ref = _exact(x, w, bias, NVFP4_ACT, cfg, st)
            key = f"M={m} rac {mode}/{sel}"
            measure(key, ref, x, act_spec=NVFP4_ACT, rac=cfg, static_channels=st)
            # B_X and B_R are exact bf16 operands; two accumulations, each with its own alpha
            floors[key] = _cublas_floor(_terms(x, w, NVFP4_ACT, cfg, st), bias, ref)
        worst = max(errs.values())
        fl = "" if floors["M=16"] is None else "; cuBLAS on the same bf16 terms: " + ", ".join(
            f"{a}: {b:.1e}" for a, b in floors.items())
        fm = "" if not mma else "; with accumulation='mma': " + ", ".join(f"{a}: {b:.1e}" for a, b in mma.items())
        return worst < 1e-5, (f"max rel err {worst:.2e}; " + ", ".join(f"{a}: {b:.1e}" for a, b in errs.items())
                              + fm + fl)
    return f


def _gemm_fp8(s: _Sizes) -> tuple[bool, str]:
    from qpass.backends.triton import fp8_linear_triton

    dev, n_big, m_big = s.dev, s.n_big, s.m_big
    n = k = n_big
    w = fp8_quantize((torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16), "block_128x128")
    wd = fp8_dequantize(w, torch.float32).double()
    out = {}
    for m in (16, m_big):
        x = _acts(m, k, dev)
        ref = fp8_dequantize(fp8_quantize(x, spec=FP8_ACT_BLOCK), torch.float32).double() @ wd.t()
        for be in ("scaled_mm", "triton", "triton_fp8"):
            try:
                y = fp8_linear_triton(x if be == "scaled_mm" else x.float(), w.data, w.scale, None,
                                      act_spec=FP8_ACT_BLOCK, w_spec=w.spec, backend=be)
                out[f"{be} M={m}"] = _rel(y, ref)
            except Exception as exc:  # noqa: BLE001
                out[f"{be} M={m}"] = f"{type(exc).__name__}: {str(exc)[:120]}"
    ok = all(isinstance(v, float) and v < 1e-5 for kk, v in out.items() if kk.startswith("triton M="))
    ok = ok and all(isinstance(v, float) and v < 1e-2 for v in out.values() if isinstance(v, float))
    return ok, "rel err (scaled_mm: bf16 output; triton: fp32 output): " + ", ".join(
        f"{a}: {b:.1e}" if isinstance(b, float) else f"{a}: {b}" for a, b in out.items())


# ---- CUDA graph capture of the decode path
def _graph(s: _Sizes) -> tuple[bool, str]:
    from qpass.backends.triton import no_sync_checks, w4a4_linear_triton

    dev = s.dev
    n = k = 4096
    w = nvfp4_quantize((torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16))
    cfg = RACConfig(0.5, "gathered", "batch")
    x_static = _acts(16, k, dev)
    with no_sync_checks():
        eager = w4a4_linear_triton(x_static, w.codes, w.scales, w.s_dec, act_spec=NVFP4_ACT, rac=cfg)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            w4a4_linear_triton(x_static, w.codes, w.scales, w.s_dec, act_spec=NVFP4_ACT, rac=cfg)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y_static = w4a4_linear_triton(x_static, w.codes, w.scales, w.s_dec, act_spec=NVFP4_ACT, rac=cfg)
        g.replay()
        same1 = torch.equal(y_static, eager)
        x_new = _acts(16, k, dev)
        x_static.copy_(x_new)
        g.replay()
        eager2 = w4a4_linear_triton(x_new, w.codes, w.scales, w.s_dec, act_spec=NVFP4_ACT, rac=cfg)
        same2 = torch.equal(y_static, eager2)
    return same1 and same2, f"replay == eager: {same1}; after new input: {same2}"


def _graph_gemv(s: _Sizes) -> tuple[bool, str]:
    from qpass.backends.triton import no_sync_checks, w4a4_linear_triton

    dev = s.dev
    n = k = 4096
    w = nvfp4_quantize((torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16))
    x_static = _acts(2, k, dev)
    with no_sync_checks():
        run = lambda: w4a4_linear_triton(x_static, w.codes, w.scales, w.s_dec, act_spec=NVFP4_ACT, gemv=True)  # noqa: E731
        eager = run()  # autotunes outside the capture
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y_static = run()
        g.replay()
        same1 = torch.equal(y_static, eager)
        x_static.copy_(_acts(2, k, dev))
        g.replay()
        same2 = torch.equal(y_static, run())
    return same1 and same2, f"replay == eager: {same1}; after new input: {same2}"


# ---- ops dispatch
def _ops_dispatch(s: _Sizes) -> tuple[bool, str]:
    dev, sm = s.dev, s.sm
    from qpass import ops as qops

    w = nvfp4_quantize((torch.randn(512 // sm, 1024 // sm, device=dev) * 0.02).to(torch.bfloat16))
    x = _acts(24, 1024 // sm, dev).reshape(2, 12, 1024 // sm)
    args = (x, w.codes, w.scales, w.s_dec, None, "site", "nvfp4", 0.5, "gathered", "batch", None)
    with qops.use_kernels("triton"):
        y = qops.nvfp4_linear(*args)
    yr = qops.nvfp4_linear(*args)
    close = bool(((y.float() - yr.float()).abs() <= 2**-7 * yr.float().abs() + 1e-6).all())
    return close, f"triton vs reference op, max |diff| {float((y.float() - yr.float()).abs().max()):.3g}"

def check_table(s: _Sizes) -> list[tuple[str, Check]]:
    """``(name, check)`` of every check, in run order (the CUDA-graph checks only on a CUDA device)."""
    big, sm, tiny, n_big = s.big, s.sm, s.tiny, s.n_big
    table = [
        (f"nvfp4 quantize weights per-tensor {big}x{big} bf16", _q_nvfp4(s, big, big, torch.bfloat16, False)),
        (f"nvfp4 quantize activations per-token {big}x{big} bf16", _q_nvfp4(s, big, big, torch.bfloat16, True)),
        ("nvfp4 quantize 2048x4112 fp16 per-tensor", _q_nvfp4(s, 2048 // sm, 272 if tiny else 4112, torch.float16, False)),
        ("nvfp4 quantize 1024x4096 fp32 per-token", _q_nvfp4(s, 1024 // sm, 4096 // sm, torch.float32, True)),
        (f"fp8 quantize {big}x{big} bf16", functools.partial(_q_fp8, s)),
        ("mxfp4 quantize", functools.partial(_q_mx, s)),
        ("RAC kernels vs rac_reference", functools.partial(_rac_all, s)),
    ]
    for dec in ("ref", "lut"):
        table += [
            (f"weight decode '{dec}' exact (one-hot rows, small-M path)", _decode_exact(s, dec, 16)),
            (f"weight decode '{dec}' exact (one-hot rows, large-M path)", _decode_exact(s, dec, 256 if tiny else 2048)),
            (f"weight decode '{dec}' exact (one-hot rows, GEMV M=4)", _decode_exact(s, dec, 4, gemv=True)),
        ]
    gemv_shapes = [(40, 272)] if tiny else [(4096, 4096), (14336, 4096), (4096, 14336), (1000, 4112),
                                            (576, 576), (192, 576), (576, 1536)]
    table += [
        (f"W4A16 bf16 GEMM N=K={n_big} vs fp64", functools.partial(_gemm_w4a16, s)),
        ("W4A16 GEMV M=1..4 (8B, SmolLM2, ragged shapes) vs fp64", _gemv(s, gemv_shapes)),
        ("W4A16 GEMV M=1..4, 'lut' weight decode, vs fp64", _gemv(s, gemv_shapes[:4], decode="lut")),
        ("W4A4 GEMV (B_X operand, alpha epilogue) M=1..4 vs fp64", functools.partial(_gemv_w4a4, s)),
        (f"W4A4 (+RAC) GEMM N=K={n_big} vs fp64", _gemm_w4a4(s, n_big, n_big, compare_mma=True)),
        ("W4A4 (+RAC) GEMM N=1000 K=4112 (ragged tiles) vs fp64", _gemm_w4a4(s, 1000 // sm, 272 if tiny else 4112)),
        ("W4A4 (+RAC) GEMM N=1000 K=4112, 'lut' weight decode, vs fp64",
         _gemm_w4a4(s, 1000 // sm, 272 if tiny else 4112, decode="lut")),
        ("FP8 block W8A8 paths vs fp64", functools.partial(_gemm_fp8, s)),
    ]
    if s.dev.type == "cuda":
        table += [("CUDA graph capture of W4A4+RAC decode (M=16)", functools.partial(_graph, s)),
                  ("CUDA graph capture of W4A4 GEMV decode (M=2)", functools.partial(_graph_gemv, s))]
    table.append(("qpass.ops.nvfp4_linear dispatch (triton vs reference)", functools.partial(_ops_dispatch, s)))
    return table


def checks(rep: Report, dev: torch.device, big: int = 8192, quick: bool = False, tiny: bool = False) -> None:
    """Run every check on ``dev``. ``tiny``: toy sizes (CPU interpreter smoke run of this module)."""
    for name, fn in check_table(_Sizes(dev, big, quick, tiny)):
        rep.run(name, fn)



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qpass.apps.bench.triton_selfcheck")
    ap.add_argument("--out", default=None, help="write the JSON report here (atomically)")
    ap.add_argument("--quick", action="store_true", help="smaller shapes")
    ap.add_argument("--seed", type=int, default=0, help="torch seed of the random inputs (default: %(default)s)")
    ap.add_argument("--only", default=None, help="run only the checks whose name contains one of these ';'-separated substrings (e.g. GEMV, or 'FP8;CUDA graph')")
    args = ap.parse_args(argv)
    if args.out is not None and Path(args.out).is_dir():
        ap.error(f"--out {args.out} is a directory: give the JSON report's file path (e.g. {Path(args.out) / 'selfcheck.json'})")
    if not torch.cuda.is_available():
        print("selfcheck needs a CUDA device", file=sys.stderr)
        return 2
    seed = args.seed
    torch.manual_seed(seed)  # fixed (--seed): a failure reproduces with the same inputs
    rep = Report(args.out, {"seed": seed, "device": torch.cuda.get_device_name(), "only": args.only}, only=args.only)
    checks(rep, torch.device("cuda"), big=4096 if args.quick else 8192, quick=args.quick)
    rep.save(final=True)
    print(f"selfcheck: {'ALL PASS' if rep.ok else 'FAILURES'} ({sum(i['ok'] for i in rep.items)}/{len(rep.items)}), "
          f"seed {seed}, {time.monotonic() - rep.t0:.1f}s", flush=True)
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
