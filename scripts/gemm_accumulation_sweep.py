"""Speed and error of the NVFP4 GEMM per accumulation form, in one run (H200 experiment).

    python scripts/gemm_accumulation_sweep.py --out sweep.json [--budget-s 200]

For each (M, N, K) and second segment (none = W4A16 / plain W4A4 GEMM, masked RAC, gathered RAC) it
times ``launch_nvfp4_gemm`` with ``accumulation="mma"`` and with two-level accumulation at several
``promote_k`` (products per tensor-core partial sum; 1 = every K tile), and reports each one's time
relative to ``mma`` and its relative Frobenius error against an fp64 product of the same bf16
operands. Times are ``triton.testing.do_bench`` medians (L2 flushed between calls).

Provenance (lab file; scripts/README.md): produced `docs/results/h200/accumulation_sweep.json` (BENCHMARKS.md,
the accumulation sweep); needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--promote-k", type=int, nargs="+", default=[1, 512, 1024, 2048])
    a = ap.parse_args(argv)

    import triton

    from qpass.atomic import write_atomic
    from qpass.backends.triton._loader import kernel_lib
    from qpass.quant.nvfp4 import nvfp4_dequantize, nvfp4_quantize

    dev = torch.device("cuda")
    g = kernel_lib(dev).nvfp4_gemm
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    t0 = time.monotonic()
    rows = []
    shapes = [(4096, 4096, 4096), (4096, 4096, 14336), (16, 4096, 14336)]
    for (m, n, k), seg2 in ((s, q) for s in shapes for q in (0, 1, 2)):
        if time.monotonic() - t0 > a.budget_s:
            rows.append({"m": m, "n": n, "k": k, "seg2": seg2, "skipped": "budget"})
            continue
        torch.manual_seed(0)
        w = nvfp4_quantize((torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16))
        wh = nvfp4_dequantize(w, torch.bfloat16)
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        a2 = gidx = None
        ref = x.double() @ wh.double().t()
        if seg2 == 1:
            a2 = (torch.randn(m, k, device=dev) * 0.01).to(torch.bfloat16)
            ref = ref + a2.double() @ wh.double().t()
        elif seg2 == 2:
            gidx = torch.randperm(k, device=dev)[: k // 2].sort().values.to(torch.int32)
            a2 = (torch.randn(m, k // 2, device=dev) * 0.01).to(torch.bfloat16)
            ref = ref + a2.double() @ wh.double()[:, gidx.long()].t()
        sdec = w.s_dec.reshape(1).float()
        out = torch.empty(m, n, dtype=torch.float32, device=dev)

        def run(acc, pk):
            g.launch_nvfp4_gemm(x, w.codes, w.scales.view(torch.uint8), sdec, out, a2=a2, gidx=gidx, num_sms=sms,
                                accumulation=acc, promote_k=pk)

        res = {"m": m, "n": n, "k": k, "seg2": seg2, "variants": {}}
        for label, acc, pk in [("mma", "mma", None)] + [(f"two_level/{p}", "two_level", p) for p in a.promote_k]:
            run(acc, pk)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            t = triton.testing.do_bench(lambda: run(acc, pk), warmup=5, rep=40)
            res["variants"][label] = {"us": t * 1e3, "rel_err": err}
        base = res["variants"]["mma"]["us"]
        for v in res["variants"].values():
            v["time_vs_mma"] = v["us"] / base
        rows.append(res)
        print(json.dumps(res), flush=True)
        write_atomic(a.out, json.dumps({"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                                        "triton": triton.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
