"""Step-level eager vs CUDA-graph decode on a tiny Llama (H200 probe): which RAC setting differs, and is eager
itself repeatable? One line per (kernels, variant); $OUT/graph_step_probe.json.

Provenance (lab file; scripts/README.md): produced `docs/results/h200/cuda_graph_probe/graph_step_probe.json`
and `docs/results/h200/kv_reset/graph_step_probe_after_kv_reset.json` (docs/results/grpo.md, long runs on the H200
and "CUDA graphs with the reference kernels"). Run from the repository root with the tests package importable:
`PYTHONPATH=src:. OUT=... python3 scripts/probes/graph_step_probe.py` (PROBE_DEVICE=cuda by default).
"""
import json
import os
import tempfile

import torch

import qpass.backends.triton  # noqa: F401
from qpass.graph.model import LoadedModel
from qpass.ops import use_kernels
from qpass.pipeline import Pipeline
from qpass.recipe import load_recipe
from qpass.runtime.engine import make_rollout_engine
from tests.conftest import tiny_llama  # the repository root on PYTHONPATH (see the docstring)

DEV = os.environ.get("PROBE_DEVICE", "cuda")
pipe = Pipeline.prepare(loaded=LoadedModel(model=tiny_llama().to(DEV), tokenizer=None, name="tiny-llama", source="random"),
                        device=DEV, batch_size=4, max_len=32)
prompts = [[3, 11, 12, 2, 13], [3, 14], [3, 15, 16], [3, 17, 18, 19]]
tmp = tempfile.mkdtemp()
variants = {"plain": None}
for mode in ("masked", "gathered"):
    for sel in ("batch", "token"):
        for tg in ("gateup", "all"):
            variants[f"{mode}-{sel}-{tg}"] = (mode, sel, tg)
res = {}
for kern in ("reference", "triton"):
    for name, v in variants.items():
        y = "name: probe\nlearner:\n  - pass: weight_qdq\nrollout:\n  - pass: w4a4_lower\n    act: nvfp4\n"
        if v:
            tg = '["*.mlp.gate_proj", "*.mlp.up_proj"]' if v[2] == "gateup" else '["*"]'
            y += f"  - pass: residual_compensation\n    targets: {tg}\n    ratio: 0.5\n    mode: {v[0]}\n    selection: {v[1]}\n"
        p = os.path.join(tmp, f"{name}.yaml")
        open(p, "w").write(y)
        try:
            rollout = pipe.build_side(load_recipe(p), "rollout", kernels=kern)
            with use_kernels(kern):
                outs = []
                for cg in ("off", "off", "on" if DEV == "cuda" else "off"):
                    e = make_rollout_engine("qpass", qg=rollout, pad_token_id=0, eos_token_id=[1], cuda_graphs=cg)
                    outs.append((e.generate(prompts, max_new_tokens=12, seed=5), e.decode.status))
            (a, _), (a2, _), (b, st) = outs
            row = {"status": st, "eager_repeat_equal": bool(torch.equal(a.logq, a2.logq)),
                   "tokens_equal": bool(torch.equal(a.input_ids, b.input_ids)), "logq_equal": bool(torch.equal(a.logq, b.logq)),
                   "max_logq_diff": float((a.logq - b.logq).abs().max())}
            d = (a.logq - b.logq).abs()
            row["first_diff_pos"] = int((d.amax(0) > 0).float().argmax()) if row["max_logq_diff"] > 0 else None
        except Exception as exc:  # noqa: BLE001
            row = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        res[f"{kern}/{name}"] = row
        print(kern, name, row, flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "graph_step_probe.json"), "w"), indent=1)
