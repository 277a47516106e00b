"""Learner weight QDQ and weight-sync quantization of a SmolLM2-135M-shaped model: the reference
quantizer vs the Triton quantizer (``qpass.tables.backend_quantize`` under ``use_kernels("triton")``),
timed in one process, interleaved, with the bytes compared (issue 13: this work dominated a GPU GRPO
step of the weight-QDQ recipes).

What is timed, per backend and repeat (CUDA events around the whole pass, after a warm-up pass):
* ``qdq``: ``nvfp4_qdq(w, group amax, site)`` over the 210 linear weights (30 layers x q/k/v/o/gate/up/
  down, bf16, SmolLM2-135M shapes, random N(0, 0.02) values), i.e. one learner forward's weight QDQ;
* ``sync``: ``quantize_site_weights(NVFP4_WEIGHT, group)`` over the same 210 weights in their fused
  groups (q/k/v, gate/up, o, down), i.e. one weight sync's quantization.

Exactness: every QDQ output (bf16 bits) and every sync member's codes, block-scale bytes, s_dec, s_enc
and flushed-block count are compared between the backends (``torch.equal``).

Usage (GPU box): ``python3 scripts/probes/weight_qdq_speed.py --out $OUT/weight_qdq_speed.json``.
Prints one line per backend and the ratio reference/triton of the medians.

Provenance (lab file; scripts/README.md): produced `docs/results/h100/weight_qdq_speed.json` (BENCHMARKS.md
and docs/results/grpo.md, learner weight QDQ speed); needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def model_weights(device: str, layers: int = 30, hidden: int = 576, inter: int = 1536, kv: int = 192):
    g = torch.Generator(device="cpu").manual_seed(0)
    shapes = {"q_proj": (hidden, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, hidden),
              "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    groups = []
    for i in range(layers):
        w = {f"model.layers.{i}.{n}": (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16).to(device) for n, s in shapes.items()}
        p = f"model.layers.{i}."
        groups += [{k: w[p + k.split(".")[-1]] for k in (p + "q_proj", p + "k_proj", p + "v_proj")},
                   {p + "o_proj": w[p + "o_proj"]},
                   {k: w[k] for k in (p + "gate_proj", p + "up_proj")},
                   {p + "down_proj": w[p + "down_proj"]}]
    return groups


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--dims", default="576,1536,192", help="hidden,intermediate,kv widths (SmolLM2-135M)")
    a = ap.parse_args(argv)

    from qpass.apps.plugins import load_backends
    from qpass.formats.spec import NVFP4_WEIGHT
    from qpass.jsonio import write_json
    from qpass.ops import effective_backend, use_kernels
    from qpass.quant.groups import group_amax
    from qpass.quant.qdq import nvfp4_qdq
    from qpass.quant.weights import quantize_site_weights

    load_backends(["triton"])
    if effective_backend("triton", a.device) != "triton":
        print(f"weight_qdq_speed: the Triton kernels do not run on {a.device}", file=sys.stderr)
        return 2
    hidden, inter, kv = map(int, a.dims.split(","))
    groups = model_weights(a.device, layers=a.layers, hidden=hidden, inter=inter, kv=kv)
    amaxes = [group_amax(list(gr.values())) for gr in groups]

    def qdq_pass():
        return {s: nvfp4_qdq(w, am, site=s) for gr, am in zip(groups, amaxes) for s, w in gr.items()}

    def sync_pass():
        return {s: sw for gr in groups for s, sw in quantize_site_weights(NVFP4_WEIGHT, gr).items()}

    def timed(fn):
        if not a.device.startswith("cuda"):  # CPU check of the script under TRITON_INTERPRET=1
            t0 = time.perf_counter()
            out = fn()
            return out, time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        return out, start.elapsed_time(end) / 1e3

    times = {b: {"qdq": [], "sync": []} for b in ("reference", "triton")}
    outs = {}
    for rep in range(a.repeats + 1):  # repeat 0 = warm-up (Triton JIT, allocator), not counted
        for b in ("reference", "triton"):
            with use_kernels(b):
                q, tq = timed(qdq_pass)
                s, ts = timed(sync_pass)
            if rep == 0:
                outs[b] = (q, s)
            else:
                times[b]["qdq"].append(tq)
                times[b]["sync"].append(ts)

    (rq, rs), (tq, ts) = outs["reference"], outs["triton"]
    qdq_equal = all(torch.equal(rq[k].view(torch.int16), tq[k].view(torch.int16)) for k in rq)
    sync_equal = all(
        torch.equal(rs[k].tensor.codes, ts[k].tensor.codes)
        and torch.equal(rs[k].tensor.scales.view(torch.uint8), ts[k].tensor.scales.view(torch.uint8))
        and torch.equal(rs[k].tensor.s_dec, ts[k].tensor.s_dec) and torch.equal(rs[k].tensor.s_enc, ts[k].tensor.s_enc)
        and rs[k].flushed_blocks == ts[k].flushed_blocks for k in rs)
    med = {b: {k: statistics.median(v) for k, v in t.items()} for b, t in times.items()}
    res = {"device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu (TRITON_INTERPRET)", "torch": torch.__version__, "sites": len(rq), "repeats": a.repeats,
           "seconds": times, "median_s": med,
           "ratio_reference_over_triton": {k: med["reference"][k] / med["triton"][k] for k in ("qdq", "sync")},
           "qdq_bits_equal": qdq_equal, "sync_bytes_equal": sync_equal}
    for b in med:
        print(f"{b:9s} qdq pass {med[b]['qdq'] * 1e3:8.1f} ms   sync pass {med[b]['sync'] * 1e3:8.1f} ms (median of {a.repeats})")
    print(f"ratio reference/triton: qdq {res['ratio_reference_over_triton']['qdq']:.2f}x, sync "
          f"{res['ratio_reference_over_triton']['sync']:.2f}x; qdq bits equal {qdq_equal}, sync bytes equal {sync_equal}")
    write_json(a.out, res)  # strict JSON, temp file + rename
    return 0 if qdq_equal and sync_equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
