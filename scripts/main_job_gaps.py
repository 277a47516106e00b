"""Measure the main job's log-prob gap for several recipes on one probe set (one model load).

    python scripts/main_job_gaps.py --out out/main_job [--device cuda] [--kernels triton]
        [--recipes naive_nvfp4 w4a16_qat quads_nvfp4 bf16] [--prompts 8 --samples 2 --max-new-tokens 24]

Runs ``qpass apply`` (``qpass.apps.apply.run_apply``) for each recipe against one captured pipeline,
so every recipe sees the same probe prompts, seeds and base graphs, then writes ``gaps.json`` and
``gaps.md`` (a table of mean/max |d|, K1, K3 per recipe, the BF16 floor, and the parity results).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default=os.environ.get("QPASS_MODEL", "default"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kernels", default="reference")
    ap.add_argument("--recipes", nargs="+", default=["naive_nvfp4", "w4a16_qat", "quads_nvfp4", "bf16"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    from qpass.apps.apply import ApplyOptions, run_apply
    from qpass.apps.artifacts import write_json
    from qpass.graph.model import load_model
    from qpass.pipeline import DTYPES, Pipeline
    from qpass.prompts import encode_chat, probe_prompts

    t0 = time.perf_counter()
    lm = load_model(a.model, dtype=DTYPES["bf16"], device=a.device)
    prompts = encode_chat(lm.tokenizer, probe_prompts(a.prompts))
    rows = a.prompts * a.samples
    pipe = Pipeline.prepare(a.model, batch_size=min(16, rows), max_len=max(map(len, prompts)) + a.max_new_tokens + 1, loaded=lm)
    setup_s = time.perf_counter() - t0
    a.out.mkdir(parents=True, exist_ok=True)
    rows_out = []
    for name in a.recipes:
        o = ApplyOptions(model=a.model, device=a.device, kernels=a.kernels, prompts=a.prompts, samples=a.samples,
                         max_new_tokens=a.max_new_tokens, seed=a.seed, save_learner=False, force=True)
        t = time.perf_counter()
        status, rep = run_apply(name, a.out / name, o, pipeline=pipe)
        p = rep["parity"]
        rows_out.append({"recipe": name, "status": status, "seconds": round(time.perf_counter() - t, 1),
                         "structural_ok": p["structural_ok"], "weights_bitexact": p["weights_bitexact"],
                         "gap": p["logprob_gap"], "floor": p["floor_logprob_gap"],
                         "rollout_tokens_per_s": rep["diagnostics"].get("rollout_tokens_per_s")})
    result = {"model": lm.name, "device": a.device, "kernels": a.kernels, "prompts": a.prompts, "samples": a.samples,
              "max_new_tokens": a.max_new_tokens, "seed": a.seed, "setup_s": round(setup_s, 1), "rows": rows_out,
              "command": "python scripts/main_job_gaps.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    write_json(a.out / "gaps.json", result)
    fmt = lambda v: "n/a" if v is None else (f"{v:.4f}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = [f"Model {lm.name}, device {a.device}, kernels {a.kernels}; {a.prompts} probe prompts x {a.samples} samples, "
             f"{a.max_new_tokens} new tokens, temperature 1, seed {a.seed}.", "",
             "| recipe | mean abs d | max abs d | K1 | K3 | tokens | structural | bit-exact | rollout tok/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows_out:
        g = r["gap"]
        lines.append(f"| {r['recipe']} | {fmt(g['mean_abs'])} | {fmt(g['max_abs'])} | {fmt(g['k1'])} | {fmt(g['k3'])} | {g['tokens']} | "
                     f"{fmt(r['structural_ok'])} | {fmt(r['weights_bitexact'])} | {fmt(r['rollout_tokens_per_s'])} |")
    f = rows_out[0]["floor"]
    lines.append(f"| bf16 floor (base graphs) | {fmt(f['mean_abs'])} | {fmt(f['max_abs'])} | {fmt(f['k1'])} | {fmt(f['k3'])} | {f['tokens']} | | | |")
    (a.out / "gaps.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["status"] == 0 for r in rows_out) else 1


if __name__ == "__main__":
    sys.exit(main())
