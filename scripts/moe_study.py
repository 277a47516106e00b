"""MoE study: operand ablation and RAC sweep on an MoE model (RAC site W13), with routing mismatch.

    python scripts/moe_study.py --out out/moe_study [--model moe-default] [--layers L]
        [--prompts 4 --samples 1 --max-new-tokens 16] [--ratios 12.5,25,50,75] [--threads 1]
        [--device cpu|cuda] [--kernels reference|triton]

One model load and capture (:class:`qpass.pipeline.Pipeline`), then every configuration is one side
of a recipe built through the pass manager (``qpass.apps.study.configs.study_recipe``: the study's
recipes and overrides, ``--layers L`` restricting every pass to decoder layers ``[0, L)``):

=================  ================================  ======================================
pair               learner                           rollout
=================  ================================  ======================================
floor              bf16                              bf16
w4a16 / qat        bf16 / w4a16_qat (weight QDQ)     w4a16_qat (W4A16)
w16a4              bf16                              w16a4_qdq (activation QDQ)
w4a4 / qat         bf16 / w4a16_qat                  naive_nvfp4 (W4A4)
rac_k              w4a16_qat                         quads_nvfp4_moe, RAC ratio k on W13
=================  ================================  ======================================

Each pair is measured on-policy with :func:`qpass.parity.behavior.logprob_gap` (``routing=True``):
the rollout samples (same prompts and seeds for every pair), the learner scores with its own routes
and again replaying the rollout's routes; reported per pair: mean/max |d| without and with routing
replay, and the per-layer routing mismatch (fraction of valid tokens whose top-k set differs).
Writes ``moe_study.json`` (raw) and ``moe_study.md`` (table) into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="moe-default")
    ap.add_argument("--layers", type=int, default=None, help="quantize only decoder layers [0, L) (default: all)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--ratios", default="12.5,25,50,75")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--kernels", default="reference", choices=("reference", "triton"),
                    help="rollout kernel backend (triton runs on CUDA only; elsewhere the reference ops)")
    a = ap.parse_args(argv)

    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch.cuda.is_available() is False")
    from qpass.apps.plugins import load_backends
    from qpass.ops import use_kernels

    load_backends([a.kernels])
    with use_kernels(a.kernels), torch.no_grad():
        return _run(a, t0=time.perf_counter())


def _run(a: argparse.Namespace, *, t0: float) -> int:
    from qpass.apps.study.configs import RACOverride, study_recipe
    from qpass.parity.behavior import logprob_gap
    from qpass.pipeline import Pipeline
    from qpass.prompts import encode_chat, probe_prompts

    rows = a.prompts * a.samples
    pipe = Pipeline.prepare(a.model, device=a.device, batch_size=rows, max_len=96)
    tok = pipe.tokenizer
    prompts = encode_chat(tok, probe_prompts(a.prompts))
    eos = tok.eos_token_id
    timings = {"prepare_s": time.perf_counter() - t0}
    ratios = [float(r) for r in a.ratios.split(",") if r]

    def side(name: str, which: str, rac: float | None = None):
        if name == "bf16":
            return pipe.base_scoring if which == "learner" else pipe.base_step
        ov = RACOverride(rac / 100, "masked", "batch") if rac is not None else None
        return pipe.build_side(study_recipe(name, layers=a.layers, rac=ov), which, share_params=True)

    t = time.perf_counter()
    learners = {"bf16": side("bf16", "learner"), "w_qdq": side("w4a16_qat", "learner")}
    timings["learners_s"] = time.perf_counter() - t
    pairs = [("floor", "bf16", ("bf16", None)), ("w4a16", "bf16", ("w4a16_qat", None)),
             ("w4a16_qat", "w_qdq", ("w4a16_qat", None)), ("w16a4", "bf16", ("w16a4_qdq", None)),
             ("w4a4", "bf16", ("naive_nvfp4", None)), ("w4a4_qat", "w_qdq", ("naive_nvfp4", None))]
    pairs += [(f"rac_{r:g}", "w_qdq", ("quads_nvfp4_moe", r)) for r in ratios]
    results, rollouts = {}, {}
    for key, lname, (rname, rac) in pairs:
        t = time.perf_counter()
        rkey = rname if rac is None else f"{rname}@{rac:g}"
        if rkey not in rollouts:
            rollouts.clear()  # keep one rollout graph in memory
            rollouts[rkey] = side(rname, "rollout", rac)
        build_s = time.perf_counter() - t
        gap = logprob_gap(learners[lname], rollouts[rkey], prompts, pad_token_id=tok.pad_token_id, eos_token_id=eos,
                          max_new_tokens=a.max_new_tokens, samples_per_prompt=a.samples, seed=a.seed, routing=True)
        s = gap.summary()
        results[key] = {"learner": lname, "rollout": rkey, **s, "build_s": build_s,
                        "gap_s": time.perf_counter() - t - build_s}
        mm = s["routing_mismatch"]["mean"]
        print(f"{key:12s} mean|d| {s['mean_abs']:.4f} (replay {s['routing_replay']['mean_abs']:.4f})  "
              f"max|d| {s['max_abs']:.3f} (replay {s['routing_replay']['max_abs']:.3f})  routing mismatch {mm:.4f}", flush=True)
        _write(a, pipe.loaded.name, ratios, results, timings, t0, complete=False)  # a killed run keeps its pairs
    _write(a, pipe.loaded.name, ratios, results, timings, t0, complete=True)
    return 0


def _write(a: argparse.Namespace, model: str, ratios: list[float], results: dict, timings: dict, t0: float, *,
           complete: bool) -> None:
    """Write ``moe_study.json`` / ``moe_study.md`` (atomic) with the pairs measured so far;
    ``complete`` is False until every pair has run."""
    from qpass.atomic import write_atomic
    from qpass.jsonio import write_json

    timings["total_s"] = time.perf_counter() - t0
    res = {"model": model, "device": a.device, "kernels": a.kernels, "layers": a.layers, "prompts": a.prompts, "samples": a.samples,
           "max_new_tokens": a.max_new_tokens, "seed": a.seed, "ratios_percent": ratios, "pairs": results,
           "timings": timings, "complete": complete, "command": " ".join(["python", "scripts/moe_study.py", *sys.argv[1:]])}
    a.out.mkdir(parents=True, exist_ok=True)
    write_json(a.out / "moe_study.json", res)
    lines = [f"# MoE study: {model}" + ("" if complete else " (incomplete: pairs so far)"), "", f"layers quantized: {a.layers or 'all'}; {a.prompts} prompts x "
             f"{a.samples} samples, {a.max_new_tokens} new tokens, seed {a.seed}; device {a.device}, kernels {a.kernels}; token means over valid sampled tokens", "",
             "| pair | learner | rollout | mean abs d | mean abs d, replay | max abs d | max abs d, replay | routing mismatch (mean over layers) | tokens |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, r in results.items():
        lines.append(f"| {key} | {r['learner']} | {r['rollout']} | {r['mean_abs']:.4f} | {r['routing_replay']['mean_abs']:.4f} | "
                     f"{r['max_abs']:.3f} | {r['routing_replay']['max_abs']:.3f} | {r['routing_mismatch']['mean']:.4f} | {r['tokens']} |")
    write_atomic(a.out / "moe_study.md", "\n".join(lines) + "\n")
    if complete:
        print("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    sys.exit(main())
