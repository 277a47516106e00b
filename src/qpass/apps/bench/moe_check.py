"""Grouped NVFP4 experts GEMM on a CUDA device: bit-identity checks, then timing at QUADS-like shapes.

Checks (each a named entry of the JSON report, :class:`qpass.apps.bench.triton_selfcheck.Report`):

* operands: per expert segment, the activation ``x_hat`` (and RAC masked-mode ``comp``) the grouped
  path feeds its GEMM equal the reference quantizer's (``qpass.quant.rac.rac_reference`` /
  ``nvfp4_quantize`` + ``nvfp4_dequantize`` over that expert's tokens) bit for bit;
* tile independence: the grouped launch equals, bit for bit, each expert segment launched alone
  through the same kernel (so its result does not depend on the other experts' tokens);
* accuracy: relative Frobenius error of the grouped GEMM vs an fp64 product of the same dequantized
  operands (< 1e-5, the GEMM contract of ``BENCHMARKS.md``) and vs the per-expert reference
  (``grouped_reference``).

Timing (``triton.testing.do_bench`` medians, ms): the grouped GEMM alone (operands prepared), the
grouped W4A4 + RAC path end to end (per-expert quantization launches + one GEMM), the per-expert
loop of the per-site Triton W4A4 + RAC linear, and BF16 per-expert ``torch.mm`` as the baseline.

Shapes (QUADS-like expert GEMMs, one EP rank of a 25B-A2.8B-class model): hidden H = 2048, expert
MLP I = 1024, E = 64 local experts, top-8, tokens T in {16, 512, 4096}; W13: N = 2I, K = H; W2:
N = H, K = I. ``--quick``: tiny shapes (CPU interpreter, seconds).

Usage: ``python -m qpass.apps.bench.moe_check [--out report.json] [--quick] [--budget-s S]``;
exit 1 on any failed check.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import qpass.backends.triton  # noqa: F401 - needs triton; registers its kernels (as when this module lived there)
from qpass.formats.spec import NVFP4_ACT
from qpass.quant.groups import group_amax
from qpass.quant.nvfp4 import nvfp4_dequantize, nvfp4_operand, nvfp4_quantize
from qpass.quant.rac import RACConfig, rac_reference, residual_operand
from qpass.backends.triton._loader import kernel_lib
from qpass.backends.triton.linear import _act_quant_operand, w4a4_linear_triton
from qpass.backends.triton.moe import grouped_reference, grouped_w4a4_triton, sort_by_expert, stack_experts
from qpass.backends.triton.rac import rac_run
from qpass.apps.bench.triton_selfcheck import Report

RAC = RACConfig(0.5, "masked", "batch")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def _problem(t: int, e: int, k_top: int, n: int, k: int, dev: str, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    scale = torch.exp(torch.randn(k, generator=g) * 0.7)
    x = (torch.randn(t, k, generator=g) * scale)
    x[:, torch.randperm(k, generator=g)[:4]] *= 30.0
    logits = torch.randn(t, e, generator=g)
    routes = logits.topk(k_top, dim=-1).indices
    tok, _slot, offs = sort_by_expert(routes, e)
    ws = [(torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16) for _ in range(e)]
    wq = [nvfp4_quantize(w.to(dev), amax=group_amax([w.to(dev)])) for w in ws]
    return x.to(torch.bfloat16)[tok].to(dev), offs, wq


def _experts(offs, e: int) -> list[tuple[int, int, int]]:
    """``(expert j, first row, end row)`` of each of the ``e`` experts that got rows (``offs``: ``e + 1`` row offsets)."""
    return [(j, offs[j], offs[j + 1]) for j in range(e) if offs[j + 1] > offs[j]]


def _operands(xs, offs, rac):
    """``(B_X, S_dec_X per row, B_R, S_dec_R per row)`` of every expert segment (SPEC §3.1)."""
    a = torch.empty(xs.shape, dtype=torch.bfloat16, device=xs.device)
    sx = torch.zeros(xs.shape[0], dtype=torch.float32, device=xs.device)
    a2 = torch.zeros_like(a) if rac else None
    sr = torch.zeros_like(sx) if rac else None
    for e in range(len(offs) - 1):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            if rac:
                o = rac_run(xs[lo:hi], RAC, NVFP4_ACT, outputs="gemm")
                a[lo:hi], sx[lo:hi], a2[lo:hi], sr[lo:hi] = o.b_x, o.s_dec_x, o.b_r, o.s_dec_r
            else:
                a[lo:hi], sx[lo:hi] = _act_quant_operand(xs[lo:hi], NVFP4_ACT, None)
    return a, sx, a2, sr


def check_shape(rep: Report, t: int, e: int, k_top: int, n: int, k: int, dev: str, tag: str) -> None:
    xs, offs, wq = _problem(t, e, k_top, n, k, dev, seed=t * 7 + n)
    codes, scales, sdec = stack_experts(wq)
    lib = kernel_lib(xs.device).nvfp4_grouped
    for rac in (False, True):
        name = f"{tag} T={t} E={e} top{k_top} N={n} K={k} {'rac50' if rac else 'w4a4'}"
        a, sx, a2, sr = _operands(xs, offs, rac)

        def operands_bitexact(a=a, sx=sx, a2=a2, sr=sr, rac=rac):
            bad = 0
            for j, lo, hi in _experts(offs, e):
                if rac:
                    r = rac_reference(xs[lo:hi], RAC, NVFP4_ACT)
                    bad += int(not torch.equal(nvfp4_operand(r.qa, torch.bfloat16), a[lo:hi]))
                    bad += int(not torch.equal(residual_operand(r).to(torch.bfloat16), a2[lo:hi]))
                    bad += int(not torch.equal(r.qr.s_dec.reshape(()).expand(hi - lo), sr[lo:hi]))
                    q = r.qa
                else:
                    q = nvfp4_quantize(xs[lo:hi], spec=NVFP4_ACT)
                    bad += int(not torch.equal(nvfp4_operand(q, torch.bfloat16), a[lo:hi]))
                bad += int(not torch.equal(q.s_dec.reshape(()).expand(hi - lo), sx[lo:hi]))
            return bad == 0, f"{bad} expert operand(s) differ from the reference quantizer"

        out = torch.empty(xs.shape[0], n, dtype=torch.float32, device=xs.device)
        lib.launch_grouped(a, codes, scales, sdec, offs, out, xs=sx, a2=a2, rs=sr)

        def tiles_independent(out=out, a=a, sx=sx, a2=a2, sr=sr):
            bad = 0
            for j, lo, hi in _experts(offs, e):
                alone = torch.empty(hi - lo, n, dtype=torch.float32, device=xs.device)
                lib.launch_grouped(a[lo:hi].contiguous(), codes[j:j + 1].contiguous(), scales[j:j + 1].contiguous(),
                                   sdec[j:j + 1].contiguous(), [0, hi - lo], alone, xs=sx[lo:hi].contiguous(),
                                   a2=None if a2 is None else a2[lo:hi].contiguous(),
                                   rs=None if sr is None else sr[lo:hi].contiguous())
                bad += int(not torch.equal(alone, out[lo:hi]))
            return bad == 0, f"{bad} expert(s) differ when launched alone"

        def accuracy(out=out, a=a, sx=sx, a2=a2, sr=sr, rac=rac):
            worst, worst_ref = 0.0, 0.0
            # float32 input (an exact copy of the bf16 tokens: same quantized bytes) -> float32 output
            ref = grouped_reference(xs.float(), offs, wq, act_spec=NVFP4_ACT, rac=RAC if rac else None)
            for j, lo, hi in _experts(offs, e):
                b_w, s_w = nvfp4_operand(wq[j]).double(), wq[j].s_dec.double()
                exact = (a[lo:hi].double() @ b_w.t()) * (sx[lo:hi].double() * s_w)[:, None]
                if a2 is not None:
                    exact = exact + (a2[lo:hi].double() @ b_w.t()) * (sr[lo:hi].double() * s_w)[:, None]
                worst = max(worst, _rel(out[lo:hi], exact))
            worst_ref = _rel(out, ref)
            return worst < 1e-5 and worst_ref < 1e-5, f"max rel_fro vs fp64 {worst:.2e}; vs per-expert reference {worst_ref:.2e}"

        rep.run(f"{name}: operands bit-exact", operands_bitexact)
        rep.run(f"{name}: grouped == each expert alone (bits)", tiles_independent)
        rep.run(f"{name}: accuracy", accuracy)


def bench_shape(rows: list, t: int, e: int, k_top: int, n: int, k: int, dev: str, tag: str) -> None:
    import triton

    xs, offs, wq = _problem(t, e, k_top, n, k, dev, seed=t * 7 + n)
    codes, scales, sdec = stack_experts(wq)
    lib = kernel_lib(xs.device).nvfp4_grouped
    a, sx, a2, sr = _operands(xs, offs, True)
    out = torch.empty(xs.shape[0], n, dtype=torch.bfloat16, device=dev)
    w_bf16 = [nvfp4_dequantize(w, torch.bfloat16) for w in wq]

    def bf16_loop():  # expert j's rows times expert j's weight (experts without rows are skipped)
        for j, lo, hi in _experts(offs, e):
            torch.mm(xs[lo:hi], w_bf16[j].t())

    def per_expert_loop():
        for j, lo, hi in _experts(offs, e):
            w4a4_linear_triton(xs[lo:hi], wq[j].codes, wq[j].scales, wq[j].s_dec, act_spec=NVFP4_ACT, rac=RAC)

    cases = {
        "grouped_gemm_rac_operands_ready": lambda: lib.launch_grouped(a, codes, scales, sdec, offs, out, xs=sx, a2=a2, rs=sr),
        "grouped_w4a4_rac_end_to_end": lambda: grouped_w4a4_triton(xs, offs, wq, act_spec=NVFP4_ACT, rac=RAC),
        "per_expert_w4a4_rac_loop": per_expert_loop,
        "bf16_per_expert_mm_loop": bf16_loop,
    }
    for case, fn in cases.items():
        ms = triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")
        rows.append({"shape": tag, "T": t, "E": e, "top_k": k_top, "N": n, "K": k, "rows": int(xs.shape[0]),
                     "case": case, "ms": round(ms, 4)})
        print(f"{tag:4s} T={t:5d} rows={xs.shape[0]:6d} N={n} K={k} {case:34s} {ms:9.4f} ms", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU interpreter)")
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop starting new timing shapes after this")
    args = ap.parse_args(argv)
    dev = "cpu" if args.quick or not torch.cuda.is_available() else "cuda"
    if args.quick:
        shapes, tokens, e, k_top = [("w13", 64, 32), ("w2", 32, 32)], [5, 24], 4, 2
    else:
        shapes, tokens, e, k_top = [("w13", 2048, 2048), ("w2", 2048, 1024)], [16, 512, 4096], 64, 8
    rep = Report(args.out, {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu (interpreter)",
                            "torch": torch.__version__})
    t0 = time.monotonic()
    for tag, n, k in shapes:
        for t in tokens[:2] if not args.quick else tokens:
            check_shape(rep, t, e, k_top, n, k, dev, tag)
    rep.meta["timing"] = rows = []
    if dev == "cuda":
        for tag, n, k in shapes:
            for t in tokens:
                if time.monotonic() - t0 > args.budget_s:
                    rows.append({"shape": tag, "T": t, "skipped": "budget"})
                    continue
                bench_shape(rows, t, e, k_top, n, k, dev, tag)
    rep.save(final=True)
    for it in rep.items:
        print(("PASS " if it.get("ok") else "FAIL ") + it["name"] + ": " + str(it.get("detail", "")))
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
