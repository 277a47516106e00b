"""``qpass grpo-compare`` (between-arm block-bootstrap CIs, both collapse verdicts) and the cost plot's x axis,
on hand-made run directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qpass.apps.grpo.plots import load_run
from qpass.diagnostics.compare import Window, arm_of, bootstrap_diff, compare_runs, parse_metric


def _run(d: Path, gaps, evals, rollout_s=1.0) -> Path:
    d.mkdir(parents=True)
    cum = 0.0
    rows = []
    for i, g in enumerate(gaps, start=1):
        cum += rollout_s
        rows.append({"step": i, "gap/token/g_abs": g, "reward/mean": 0.5, "time/rollout_s": rollout_s, "time/rollout_s_cum": cum})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "eval.jsonl").write_text("".join(json.dumps({"step": s, "eval/accuracy": a}) + "\n" for s, a in evals))
    return d


def test_window_and_metric_parsing():
    assert parse_metric("eval/accuracy@last:3") == ("eval/accuracy", Window("last", n=3))
    assert parse_metric("gap/token/g_abs") == ("gap/token/g_abs", Window())
    assert Window.parse("steps:2-4").select([1, 2, 3, 4, 5], [10, 20, 30, 40, 50]) == [20, 30, 40]
    assert Window.parse("last:2").select([1, 2, 3], [1.0, 2.0, 3.0]) == [2.0, 3.0]
    for bad in ("last:0", "steps:5-2", "first:3", ""):
        with pytest.raises(ValueError, match="window must be"):
            Window.parse(bad)
    assert arm_of("naive_tis_s12") == ("naive_tis", 12) and arm_of("bf16") == ("bf16", None)


def test_bootstrap_hand_values():
    # constant series: every replicate is the point estimate
    r = bootstrap_diff([[1.0, 1.0, 1.0]], [[0.25, 0.25]], block=2, n_boot=50)
    assert (r["diff"], r["lo"], r["hi"], r["runs_a"], r["points_b"]) == (0.75, 0.75, 0.75, 1, [2])
    # two seeds in arm A (run means 1 and 3): the arm mean is 2, a replicate is 1, 2 or 3 minus 0
    r = bootstrap_diff([[1.0, 1.0], [3.0, 3.0]], [[0.0]], block=1, n_boot=400, seed=1)
    assert r["diff"] == 2.0 and r["lo"] == 1.0 and r["hi"] == 3.0
    # one run, i.i.d. points 0/1: the CI covers the mean and stays inside [0, 1]
    r = bootstrap_diff([[0.0, 1.0] * 20], [[0.0] * 5], block=1, n_boot=2000)
    assert r["diff"] == 0.5 and 0.3 < r["lo"] < 0.5 < r["hi"] < 0.7
    with pytest.raises(ValueError, match="no points"):
        bootstrap_diff([[]], [[1.0]])


def test_compare_runs_and_both_collapse_verdicts(tmp_path):
    # naive_s0: accuracy falls 0.8 -> 0.1 while its gap falls: collapse by accuracy alone, not by the written
    # definition; quads_s0 / quads_s1 learn
    ev_fall = [(0, 0.4), (10, 0.8), (20, 0.6), (30, 0.3), (40, 0.1)]
    naive = _run(tmp_path / "naive_s0", [0.5 - 0.01 * i for i in range(40)], ev_fall)
    q0 = _run(tmp_path / "quads_s0", [0.2] * 40, [(0, 0.4), (10, 0.6), (20, 0.8), (30, 0.9), (40, 0.95)])
    q1 = _run(tmp_path / "quads_s1", [0.1] * 40, [(0, 0.4), (10, 0.7), (20, 0.8), (30, 0.9), (40, 0.9)])
    res = compare_runs({"naive": [naive], "quads": [q0, q1]}, [parse_metric("eval/accuracy@last:1"),
                                                            parse_metric("gap/token/g_abs@all")], load=load_run, n_boot=200)
    acc = res["metrics"]["eval/accuracy@last:1"]
    assert acc["per_arm"]["quads"] == {"runs": 2, "per_run": [0.95, 0.9], "mean": pytest.approx(0.925)}
    d = acc["pairs"]["naive_vs_quads"]
    assert d["diff"] == pytest.approx(0.1 - 0.925) and d["runs_b"] == 2 and d["block"] == 1  # evals: block 1
    assert d["lo"] <= d["diff"] <= d["hi"]
    gap = res["metrics"]["gap/token/g_abs@all"]["pairs"]["naive_vs_quads"]
    assert gap["block"] == 5 and gap["diff"] == pytest.approx(sum(0.5 - 0.01 * i for i in range(40)) / 40 - 0.15)
    c = res["collapse"]["naive_s0"]
    assert c["written_definition"]["collapsed"] is False
    assert c["accuracy_only"]["collapsed"] is True and c["accuracy_only"]["step"] == 40
    assert c["accuracy_only"]["onset_step"] == 20 and c["accuracy_only"]["best_accuracy"] == 0.8
    assert res["collapse"]["quads_s0"]["accuracy_only"]["collapsed"] is False
    with pytest.raises(ValueError, match="not an arm"):
        compare_runs({"naive": [naive]}, [parse_metric("gap/token/g_abs")], load=load_run, baseline="bf16")


def test_cli_compare_and_cost_plot(tmp_path, capsys):
    from qpass.apps.grpo.cli import main

    a = _run(tmp_path / "naive_s0", [0.5] * 4, [(0, 0.2), (2, 0.4), (4, 0.5)], rollout_s=2.0)
    b = _run(tmp_path / "bf16_s0", [0.01] * 4, [(0, 0.2), (2, 0.6), (4, 0.7)], rollout_s=0.5)
    out = tmp_path / "cmp.json"
    assert main(["grpo-compare", str(a), str(b), "--out", str(out), "--boot", "100"]) == 0
    res = json.loads(out.read_text())
    assert set(res["arms"]) == {"naive", "bf16"} and (tmp_path / "cmp.md").read_text().startswith("# GRPO arm comparison")
    assert main(["grpo-compare", str(a), "--metric", "gap@first:2", "--out", str(out)]) == 2
    assert "--metric: window must be" in capsys.readouterr().err
    assert main(["grpo-compare", str(tmp_path), "--out", str(out)]) == 2  # not a run directory
    assert "no metrics.jsonl" in capsys.readouterr().err
    # accuracy against cumulative rollout seconds: eval step s sits at step s's time/rollout_s_cum (step 0 at 0)
    assert load_run(a).series("eval/accuracy", "time/rollout_s_cum") == ([0.0, 4.0, 8.0], [0.2, 0.4, 0.5])
    assert load_run(b).series("eval/accuracy", "time/rollout_s_cum") == ([0.0, 1.0, 2.0], [0.2, 0.6, 0.7])
    png = tmp_path / "cost.png"
    assert main(["grpo-plot", str(a), str(b), "--preset", "cost", "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
