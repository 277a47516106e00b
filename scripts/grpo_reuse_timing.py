"""Before/after per-step GRPO times of weight-quantization reuse (issue 13), in one process.

    PYTHONPATH=src:. python scripts/grpo_reuse_timing.py --model default --recipe quads_nvfp4 --steps 2 \
        --out docs/results/grpo_long/reuse_timing_cpu.json

Builds two identical trainers on the same model and recipe: one with the quantization reuse of
:mod:`qpass.quant.reuse` disabled (``ReuseStore(enabled=False)``: every quantization computed, the
code path before issue 13), one with it on (the default). Their steps are interleaved (off 1, on 1,
off 2, on 2, ...) so both see the same machine load, and the script checks that both runs produce
the same metric rows (wall-clock keys aside), the same parameters and the same rollout bytes, bit
for bit. Prints and writes the ``time/*`` keys per step and the mean ratio off / on.

The structure mirrors the H200 long runs (4 micro-batches, 4 minibatches of one micro-batch each,
decoupled PPO ratio, no BF16 shadow by default) at a CPU-sized batch. CPU numbers: the reference
quantizer's share of a step differs on a GPU.

Provenance (lab file; scripts/README.md): produced `docs/results/grpo_long/reuse_timing_cpu_tiny.json` and
`docs/results/grpo_long/reuse_timing_cpu_default.txt` (docs/results/grpo.md, weight-quantization reuse of issue
13).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch


def _strip(row: dict) -> str:
    from qpass.jsonio import dumps

    return dumps({k: v for k, v in row.items() if not k.startswith("time/") and k != "rollout/tokens_per_s"})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="'tiny' (random 2-layer Llama) or a qpass model name/path")
    ap.add_argument("--recipe", default="quads_nvfp4")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rows", type=int, default=8, help="rows per step (prompts x group size 4)")
    ap.add_argument("--micro", type=int, default=2, help="micro-batch size")
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from qpass.apps.grpo.grpo import GRPOConfig, GRPOTrainer
    from qpass.apps.grpo.weights import snapshot_rollout_constants
    from qpass.graph.model import LoadedModel, load_model
    from qpass.pipeline import Pipeline
    from qpass.quant.reuse import ReuseStore
    from qpass.recipe import load_recipe
    from qpass.rl.task import ArithmeticTask, difficulty_preset
    from tests.test_grpo import FakeTok, text_hash_reward  # the repository root on PYTHONPATH (usage line)

    if a.model == "tiny":
        from tests.conftest import tiny_llama

        pipe = Pipeline.prepare(loaded=LoadedModel(model=tiny_llama(), tokenizer=None, name="tiny-llama", source="random"),
                                batch_size=4, max_len=32)
        tok, template = FakeTok(), "{expression}"
    else:
        pipe = Pipeline.prepare(loaded=load_model(a.model), batch_size=4, max_len=64)
        tok, template = pipe.tokenizer, "Compute {expression}."
    cfg = GRPOConfig(steps=a.steps, prompts_per_step=a.rows // 4, group_size=4, max_new_tokens=a.max_new_tokens, lr=1e-4,
                     micro_batch_size=a.micro, minibatches=a.minibatches, bitexact_every=0, initial_check=False,
                     eval_every=0, diag_every=0, shadow=False)
    task = ArithmeticTask(difficulty_preset(1, n_train=64, n_eval=0, seed=0))
    trainers = {}
    for name, enabled in (("off", False), ("on", True)):
        learner, rollout = pipe.build(load_recipe(a.recipe))
        tr = GRPOTrainer(learner, rollout, tok, task, cfg, reward_fn=text_hash_reward, template=template, recipe_name=a.recipe)
        tr.quant_reuse = ReuseStore(enabled=enabled)
        trainers[name] = tr
    rows: dict[str, list[dict]] = {"off": [], "on": []}
    t0 = time.perf_counter()
    for s in range(a.steps):
        for name, tr in trainers.items():
            rows[name].append(tr.step(final=s == a.steps - 1))
            print(f"step {s + 1} reuse {name}: " + " ".join(f"{k[5:]}={v:.3f}" for k, v in rows[name][-1].items()
                                                             if k.startswith("time/")), flush=True)
    same_rows = [_strip(r) for r in rows["off"]] == [_strip(r) for r in rows["on"]]
    same_params = all(torch.equal(p, q) for p, q in zip(trainers["off"].le.parameters(), trainers["on"].le.parameters()))
    s_off, s_on = (snapshot_rollout_constants(trainers[n].rollout_qg) for n in ("off", "on"))
    same_bytes = all(all(torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x, y.view(torch.uint8)
                                     if y.dtype == torch.float8_e4m3fn else y) for x, y in zip(s_off.nvfp4[k], s_on.nvfp4[k]))
                     for k in s_off.nvfp4)
    keys = sorted({k for r in rows["off"] for k in r if k.startswith("time/")})
    mean = {n: {k: sum(r[k] for r in rows[n]) / len(rows[n]) for k in keys} for n in rows}
    ratio = {k: (mean["off"][k] / mean["on"][k] if mean["on"][k] > 0 else None) for k in keys}
    out = {
        "what": "GRPO per-step times with weight-quantization reuse off (before issue 13) and on, interleaved steps",
        "device": "CPU", "threads": a.threads, "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__, "argv": sys.argv[1:] if argv is None else argv, "model": a.model, "recipe": a.recipe,
        "config": cfg.to_dict(), "identical_rows": same_rows, "identical_params": same_params,
        "identical_rollout_bytes": same_bytes, "mean_s": mean, "ratio_off_over_on": ratio,
        "per_step": {n: [{k: r[k] for k in keys} for r in rows[n]] for n in rows},
        "wall_s": time.perf_counter() - t0,
    }
    print(json.dumps({"identical_rows": same_rows, "identical_params": same_params, "identical_rollout_bytes": same_bytes}))
    for k in keys:
        print(f"{k:24s} off {mean['off'][k]:8.3f}  on {mean['on'][k]:8.3f}  ratio {ratio[k] or float('nan'):6.2f}")
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if (same_rows and same_params and same_bytes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
