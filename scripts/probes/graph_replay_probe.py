"""Which Triton op differs between eager and CUDA-graph replay? (H200 probe; issue 13 CUDA graphs)

For each W4A4 variant: y_eager = op(x); capture op(x_static) in a CUDA graph; copy x into x_static,
replay, compare with y_eager bit for bit; then a second x' (different values, same shape): replay vs
eager on x'. Also the step-level check on a tiny Llama (quads_nvfp4, triton): eager twice.
Prints one line per case; writes $OUT/graph_replay_probe.json.

Provenance (lab file; scripts/README.md): produced
`docs/results/h200/cuda_graph_probe/graph_replay_probe.json` (docs/results/grpo.md); needs a CUDA GPU.
"""
import json
import os
import sys

import torch

import qpass.backends.triton  # noqa: F401
from qpass.ops import use_kernels
from qpass.quant.nvfp4 import nvfp4_quantize

dev = torch.device("cuda")
torch.manual_seed(0)
res = {}
w = torch.randn(96, 256, device=dev, dtype=torch.bfloat16)
qw = nvfp4_quantize(w)
for act in ("nvfp4", "nvfp4_per_token", "none"):
    for rac in (None, (0.5, "masked", "batch"), (0.5, "masked", "token"), (0.5, "gathered", "batch"), (0.5, "gathered", "token")):
        if act == "none" and rac is not None:
            continue
        name = f"{act}/{'plain' if rac is None else rac[1] + '-' + rac[2]}"
        ratio, mode, sel = rac or (0.0, "masked", "batch")
        try:
            def f(x, name=name, ratio=ratio, mode=mode, sel=sel, act=act):
                with use_kernels("triton"):
                    return torch.ops.qpass.nvfp4_linear(x, qw.codes, qw.scales, qw.s_dec, None, name, act, ratio, mode, sel, None)
            x1 = torch.randn(4, 256, device=dev, dtype=torch.bfloat16)
            x2 = torch.randn(4, 256, device=dev, dtype=torch.bfloat16) * 3
            e1, e1b, e2 = f(x1), f(x1), f(x2)
            xs = x1.clone()
            s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                f(xs)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                ys = f(xs)
            g.replay(); torch.cuda.synchronize(); r1 = ys.clone()
            xs.copy_(x2); g.replay(); torch.cuda.synchronize(); r2 = ys.clone()
            row = {"eager_repeat_equal": bool(torch.equal(e1, e1b)), "replay_x1_equal": bool(torch.equal(r1, e1)),
                   "replay_x2_equal": bool(torch.equal(r2, e2)), "max_diff_x2": float((r2.float() - e2.float()).abs().max())}
        except Exception as exc:  # noqa: BLE001
            row = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        res[name] = row
        print(name, row, flush=True)
out = os.environ.get("OUT", ".")
json.dump(res, open(os.path.join(out, "graph_replay_probe.json"), "w"), indent=1)
sys.exit(0)
