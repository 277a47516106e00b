"""``qpass bench``'s end-to-end decode section (issue 14) and the issue's targets in ``_targets``.

On CPU the section runs at toy sizes under ``--smoke`` (reference kernels, the decode step through
``DecodeGraph``'s captured path with :class:`~qpass.apps.bench.e2e.EagerReplay`); nothing is
timed here. What is checkable: the rows (models, recipes, batch sizes), and that the decode step the
benchmark times computes exactly what an eager call of the same step on an independent rollout
computes.
"""

from __future__ import annotations

import json

import pytest
import torch

from qpass.apps.bench import triton_bench as bench
from qpass.apps.bench.triton_bench import E2E_SECTION, Results, Row, _targets
from qpass.apps.bench.e2e import (
    E2E_MODELS,
    E2E_RECIPES,
    decode_inputs,
    measure_decode,
    rollout_engine,
)


def test_bench_e2e_only_smoke_cpu(tmp_path):
    """``--e2e-only --smoke``: every (toy model, recipe, B) row, each replay equal to the eager step."""
    out = tmp_path / "e2e.json"
    assert bench.run(bench.BenchOptions(smoke=True, e2e_only=True, out=str(out), budget_s=3600)) == 0
    data = json.loads(out.read_text())
    assert not data["errors"], data["errors"]
    rows = data["rows"]
    assert {r["section"] for r in rows} == {E2E_SECTION}
    labels = [m.toy().label for m in E2E_MODELS]
    assert labels == ["SmolLM2-135M architecture, random weights [toy sizes, smoke]",
                      "Llama-8B shapes, 4 layers, random weights [toy sizes, smoke]"]
    assert sorted((r["name"], r["m"]) for r in rows) == sorted(
        (f"{lab}: {rec}", b) for lab in labels for rec in E2E_RECIPES for b in (1, 4))
    for r in rows:
        x = r["extra"]
        assert (x["model"], x["recipe"]) == tuple(r["name"].rsplit(": ", 1))
        assert r["mode"] == "smoke" and x["decode_graph"] == "captured" and x["replays"] == 2
        assert x["replay_equals_eager"] is True and x["kernels"] in ("reference", "triton")
        assert r["time_us"] > 0 and x["tokens_per_s"] == pytest.approx(r["m"] / (r["time_us"] * 1e-6))
        assert r["vs_bf16"] is not None and (x["recipe"] != "bf16" or r["vs_bf16"] == 1.0)
    # the toy configs keep each model's architecture flags
    assert [m.toy().config["tie_word_embeddings"] for m in E2E_MODELS] == [True, False]
    e2e_targets = [t for t in data["targets"] if t["name"].startswith("end to end: quads_nvfp4")]
    assert sorted(t["name"] for t in e2e_targets) == sorted(
        f"end to end: quads_nvfp4 decode tokens/s vs bf16, {lab}, B={b}" for lab in labels for b in (1, 4))
    assert all(t["goal"] == ">= 0.8x" and isinstance(t["met"], bool) for t in e2e_targets)
    assert data["meta"]["e2e_only"] is True and data["meta"]["complete"] is True


@pytest.mark.parametrize("recipe", E2E_RECIPES)
def test_timed_decode_step_equals_an_independent_eager_step(tiny_pipeline, recipe):
    """The benchmark's decode call (``DecodeGraph`` captured path, replays) gives exactly the logits
    and greedy tokens of the same step on a second rollout built from the same pipeline and called
    eagerly (own graph clone, own KV cache, own prefill)."""
    from qpass.ops import use_kernels
    from qpass.recipe import load_recipe
    from qpass.runtime.rollout import TorchRollout

    dev = torch.device("cpu")
    with use_kernels("triton"):
        ro = rollout_engine(tiny_pipeline, recipe, kernels="triton", smoke=True)
        args = decode_inputs(ro, prompt_len=8, vocab_size=256, device=dev, seed=3)
        meas = measure_decode(ro, args, smoke=True)
        qg = tiny_pipeline.build_side(load_recipe(recipe), "rollout", kernels="triton")
        eager = TorchRollout(qg, pad_token_id=0, eos_token_id=1, cuda_graphs="off")
        args2 = decode_inputs(eager, prompt_len=8, vocab_size=256, device=dev, seed=3)
        with torch.no_grad():
            ref = eager.decode(*args2)[:, -1].float()
    assert eager.decode.status == "eager (off)" and meas.status == "captured" and meas.replays == 2
    assert all(torch.equal(a, b) for a, b in zip(args, args2))
    assert meas.logits.shape == (4, 256) and torch.equal(meas.logits, ref)
    assert meas.greedy_tokens == ref.argmax(-1).tolist()


def _dec(name: str, m: int, n: int, vs: float | None, t: float = 10.0) -> Row:
    return Row("decode (Llama-8B shapes)", name, m, n, 4096, time_us=t, mode="graph", vs_bf16=vs)


def _e2e(model: str, recipe: str, b: int, t_us: float, t_bf16_us: float) -> Row:
    return Row(E2E_SECTION, f"{model}: {recipe}", b, time_us=t_us, mode="graph", vs_bf16=t_bf16_us / t_us,
               extra={"model": model, "recipe": recipe, "tokens_per_s": b / (t_us * 1e-6)})


def test_targets_issue14_rows_on_hand_made_results():
    res = Results(rows=[
        _dec("w4a16 triton", 1, 4096, 2.0), _dec("w4a16 triton", 1, 14336, 3.125),  # geomean 2.5
        _dec("w4a4 triton", 1, 4096, 2.25), _dec("w4a4 triton", 1, 14336, 2.0),
        _dec("w4a16 triton", 16, 4096, 1.4), _dec("w4a16 triton", 16, 14336, 1.6),
        _dec("w4a4 triton", 16, 4096, 9.0),  # no M=16 W4A4 target
        Row("prefill (Llama-8B shapes)", "w4a4 triton", 4096, 4096, 4096, time_us=5.0, vs_bf16=0.8),
        Row("prefill (Llama-8B shapes)", "w4a4 triton", 1024, 4096, 4096, time_us=5.0, vs_bf16=0.1),  # M < 4096
        _e2e("m", "bf16", 1, 1000.0, 1000.0), _e2e("m", "quads_nvfp4", 1, 1250.0, 1000.0),  # 0.8x: met
        _e2e("m", "bf16", 16, 2000.0, 2000.0), _e2e("m", "quads_nvfp4", 16, 4000.0, 2000.0),  # 0.5x
        _e2e("m", "naive_nvfp4", 16, 1000.0, 2000.0),  # not a target recipe
    ])
    _targets(res)
    got = {t["name"]: (t["goal"], t["measured"], t["met"]) for t in res.targets}
    assert got == {
        "w4a16 triton decode M=1, 8B shapes, vs BF16": (">= 2.5x", "min 2.00x, geomean 2.50x over 2", False),
        "w4a4 triton decode M=1, 8B shapes, vs BF16": (">= 2x", "min 2.00x, geomean 2.12x over 2", True),
        "w4a16 triton decode M=16, 8B shapes, vs BF16": (">= 1.5x", "min 1.40x, geomean 1.50x over 2", False),
        "w4a4 triton prefill M>=4096, 8B shapes, vs BF16": (">= 0.8x", "min 0.80x, geomean 0.80x over 1", True),
        "end to end: quads_nvfp4 decode tokens/s vs bf16, m, B=1":
            (">= 0.8x", "0.80x (800 vs 1000 tokens/s)", True),
        "end to end: quads_nvfp4 decode tokens/s vs bf16, m, B=16":
            (">= 0.8x", "0.50x (4000 vs 8000 tokens/s)", False),
    }


def test_e2e_models_plan_and_flags():
    """The two architectures as issue 14 names them, B-major priority order, and the CLI flags."""
    from qpass.apps.bench import build_bench_parser
    from qpass.apps.bench.triton_bench import e2e_plan
    from qpass.apps.bench.e2e import LLAMA8B_4L, SMOLLM2_135M

    s, b = SMOLLM2_135M.config, LLAMA8B_4L.config
    assert (s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"],
            s["intermediate_size"], s["vocab_size"], s["tie_word_embeddings"], s["rms_norm_eps"],
            s["rope_parameters"]["rope_theta"]) == (576, 30, 9, 3, 64, 1536, 49152, True, 1e-5, 100000.0)
    assert (b["hidden_size"], b["num_hidden_layers"], b["num_attention_heads"], b["num_key_value_heads"], b["head_dim"],
            b["intermediate_size"], b["vocab_size"], b["tie_word_embeddings"],
            b["rope_parameters"]["rope_theta"]) == (4096, 4, 32, 8, 128, 14336, 128256, False, 500000.0)
    assert [(m.label, n) for m, n in e2e_plan(False)] == [
        (SMOLLM2_135M.label, 1), (LLAMA8B_4L.label, 1), (SMOLLM2_135M.label, 16), (LLAMA8B_4L.label, 16),
        (SMOLLM2_135M.label, 64), (LLAMA8B_4L.label, 64)]
    a = build_bench_parser().parse_args(["--e2e-only", "--e2e-budget-s", "0"])
    assert (a.e2e_only, a.e2e_budget_s) == (True, 0.0)
    assert build_bench_parser().parse_args([]).e2e_budget_s == 150.0


def test_e2e_section_that_cannot_start_is_an_error_not_a_crash(monkeypatch):
    """A missing dependency of the model build (the H200 run of 2026-12-04 had no pydantic) is recorded
    in ``errors`` and the full run goes on to the rest of the grid, instead of ending it."""
    from qpass.apps.bench import triton_bench as bench

    def boom(smoke):
        raise ModuleNotFoundError("No module named 'pydantic'")

    monkeypatch.setattr(bench, "e2e_plan", boom)
    res = bench.Results()
    calls = []
    bench.run_e2e(res, bench.Budget(10.0), lambda *a: calls.append(a))
    assert calls == []
    assert res.errors == ["e2e section: ModuleNotFoundError: No module named 'pydantic'"]
