"""Repeatability of GRPO runs (issue 32): recipes that serve the same weights sample the same tokens;
two same-seed runs give the same rows; on the GPU, two fresh processes with pinned tiles do too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qpass.apps.grpo.phases import SampleInput, sample
from tests.test_grpo import _one_thread, tiny_cfg, tiny_trainer  # noqa: F401 - _one_thread: autouse, 1 torch thread


def _strip(rows):
    from qpass.jsonio import dumps

    return [dumps({k: v for k, v in r.items() if not k.startswith("time/") and k != "rollout/tokens_per_s"}) for r in rows]


def test_naive_and_qat_only_share_the_step0_rollout(tiny_pipeline):
    """Both recipes build the W4A4 rollout from the same BF16 weights (qat_only's learner QDQ does not
    touch the rollout): same served bytes, and after each trainer's initial checks (qat_only's run a
    bit-exact check, naive's none) the first step samples the same tokens with the same log q. So the
    H100 difference of 2026-12-05 (step-1 reward 0.2656 vs 0.375) is not in the recipe code path."""
    out = {}
    for recipe in ("naive_nvfp4", "qat_only"):
        tr = tiny_trainer(tiny_pipeline, recipe, tiny_cfg(steps=1, eval_every=1, eval_prompts=4, diag_every=0, shadow=False))
        init = tr.initial_checks()
        served = {k: (v.codes.clone(), v.scales.view(torch.uint8).clone(), v.global_scale.clone())
                  for k, v in tr.ro.served_weights().items()}
        exp = sample(tr, SampleInput.of(tr, 1, next(tr.batches))).exp
        out[recipe] = (served, exp, init)
    (sa, ea, ia), (sb, eb, ib) = out["naive_nvfp4"], out["qat_only"]
    assert "parity/bitexact_ok" not in ia and ib["parity/bitexact_ok"] is True
    assert sa.keys() == sb.keys() and len(sa) == 14
    for k in sa:
        assert all(torch.equal(x, y) for x, y in zip(sa[k], sb[k])), k
    assert torch.equal(ea.input_ids, eb.input_ids) and torch.equal(ea.logq, eb.logq)
    assert ia["eval/accuracy"] == ib["eval/accuracy"]


def test_two_same_seed_runs_give_the_same_rows(tiny_pipeline):
    cfg = tiny_cfg(steps=2, eval_every=1, diag_every=0, bitexact_every=1)
    a = tiny_trainer(tiny_pipeline, "quads_nvfp4", cfg)
    a.run()
    b = tiny_trainer(tiny_pipeline, "quads_nvfp4", cfg)
    b.run()
    assert _strip(a.history["metrics"]) == _strip(b.history["metrics"])
    assert a.history["eval"] == [{**r, "time/eval_s": a.history["eval"][i]["time/eval_s"]} for i, r in enumerate(b.history["eval"])]


@pytest.mark.gpu
def test_two_processes_same_seed_same_rows(tmp_path):
    """GPU, Triton kernels, pinned tiles: two fresh ``qpass grpo`` processes started together (each
    sees the other's GPU load, as parallel runs do) give every dense built-in recipe the same rows,
    3 steps each. With ``--kernel-tiles autotune`` they need not."""
    import qpass.backends.triton  # noqa: F401 - registers the triton kernels
    from qpass.graph.model import load_model
    from qpass.pipeline import Pipeline
    from qpass.recipe import builtin_recipes, load_recipe
    from qpass.tables import KernelMissingError
    from tests._tiny_hf import write_tiny_hf_model

    model = write_tiny_hf_model(tmp_path / "tiny")
    pipe = Pipeline.prepare(str(model), device="cuda", batch_size=4, max_len=64, loaded=load_model(str(model), device="cuda"))

    def buildable(n: str) -> bool:  # the Triton backend has no kernel for some FP8 layouts at this tiny K
        try:
            pipe.build_side(load_recipe(n), "rollout", kernels="triton")
            return True
        except KernelMissingError:
            return False

    names = [n for n in sorted(builtin_recipes()) if not n.endswith("_moe") and buildable(n)]
    assert {"naive_nvfp4", "qat_only", "quads_nvfp4", "w4a16_rollout", "w16a4_rollout"} <= set(names)
    del pipe
    recipes = ",".join(names)
    src = str(Path(__file__).resolve().parents[1] / "src")  # ahead of, not instead of, the caller's path (its site dirs)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("TRITON_INTERPRET", None)
    procs = []
    for run in ("a", "b"):
        cmd = [sys.executable, "-m", "qpass.apps.cli", "grpo", "--recipe", recipes, "--model", str(model), "--device", "cuda",
               "--kernels", "triton", "--kernel-tiles", "pinned", "--steps", "3", "--seed", "0", "--out", str(tmp_path / run),
               "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "24", "--n-train", "64", "--n-eval", "16",
               "--eval-prompts", "16", "--eval-every", "3", "--diag-every", "0", "--task", "arithmetic", "--template", "terse",
               "--no-progress", "--no-plots"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        assert p.returncode == 0, out[-4000:]
    for name in recipes.split(","):
        ra = [json.loads(x) for x in (tmp_path / "a" / name / "metrics.jsonl").read_text().splitlines()]
        rb = [json.loads(x) for x in (tmp_path / "b" / name / "metrics.jsonl").read_text().splitlines()]
        assert len(ra) == 3 and _strip(ra) == _strip(rb), name
        tiles = json.loads((tmp_path / "a" / name / "kernel_tiles.json").read_text())
        assert tiles["mode"] == "pinned" and (name == "bf16" or tiles["pinned"]), name  # bf16 runs no Triton kernel
