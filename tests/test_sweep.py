"""``qpass grpo-sweep``: validation before anything starts, the job plan, stopping on the budget, and a
2-step toy sweep of two arms as parallel ``qpass grpo`` processes on CPU, resumed by a second call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from qpass.apps.grpo import sweep as sw


def _main(*args: str) -> int:
    return sw.sweep_main(list(args))


def test_validation_refuses_before_any_process(tmp_path, capsys):
    st = str(tmp_path / "st")
    assert _main("run", "--state", st, "--arms", "c5,nope") == 2
    assert "unknown arm or set 'nope'" in capsys.readouterr().err
    assert _main("run", "--state", st, "--seeds", "0,0") == 2
    assert "distinct" in capsys.readouterr().err
    assert _main("run", "--state", st, "--", "--seed", "3") == 2
    assert "--seed after '--' is set by the sweep" in capsys.readouterr().err
    assert _main("run", "--state", st, "--arms", "bf16", "--", "--top-p", "abc") == 2
    err = capsys.readouterr().err
    assert "job bf16_s0: qpass grpo" in err and "--top-p" in err
    assert _main("run", "--state", st, "--arms", "naive_nvfp4", "--", "--ratio", "coupled", "--correction", "tis") == 2
    assert "takes no importance correction" in capsys.readouterr().err  # the loss config, checked before any process
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x.txt").write_text("not a sweep output")
    assert _main("collect", "--state", st, "--out", str(tmp_path / "busy")) == 2
    assert "non-empty directory without sweep.json" in capsys.readouterr().err
    assert _main("run", "--state", st, "--budget-s", "0") == 2  # argparse: expected a finite number > 0
    assert not (tmp_path / "st").exists()


def test_plan_is_seed_major_and_arms_carry_their_flags():
    arms = sw._resolve_arms("c1,b1")
    assert [a.name for a in arms] == ["bf16", "w4a16_rollout", "w16a4_rollout", "naive_nvfp4", "naive_decoupled",
                                      "naive_tis", "naive_mis"]
    jobs = sw.plan_jobs(sw._resolve_arms("naive_tis,moe_quads_replay"), [0, 1], "default")
    assert [j.name for j in jobs] == ["naive_tis_s0", "moe_quads_replay_s0", "naive_tis_s1", "moe_quads_replay_s1"]
    argv = jobs[1].argv(Path("S"), steps=5, device="cuda", kernels="triton", threads=2, checkpoint_every=10,
                        total_time_s=300.4, extra=["--task", "chain"])
    assert argv[:6] == ["--recipe", "quads_nvfp4_moe", "--model", "moe-default", "--seed", "0"]
    assert argv[-4:] == ["--task", "chain", "--routing-replay", "on"]
    assert "--total-time-s" in argv and argv[argv.index("--total-time-s") + 1] == "300"
    assert jobs[0].argv(Path("S"), steps=5, device="cpu", kernels="reference", threads=1, checkpoint_every=10,
                        total_time_s=10, extra=[])[-4:] == ["--ratio", "decoupled", "--correction", "tis"]


def test_stop_all_terminates_the_process_group(tmp_path):
    (tmp_path / "jobs").mkdir()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    logf = open(tmp_path / "x.log", "w")  # noqa: SIM115 - closed by _stop_all
    rec = {"job": "x", "rc": None}
    t0 = time.monotonic()
    sw._stop_all({"x": (proc, logf, rec)}, tmp_path)
    assert rec["rc"] == -15 and rec["stopped"] == "budget" and time.monotonic() - t0 < 15
    assert json.loads((tmp_path / "jobs" / "x.json").read_text())["rc"] == -15


@pytest.mark.slow
def test_two_arm_toy_sweep_on_cpu_and_resume(tmp_path):
    """Two arms as parallel processes, 2 steps, then a second call continues both to 3 steps from their
    checkpoints; the fetch directory holds <= 8 files."""
    from tests._tiny_hf import write_tiny_hf_model

    model = write_tiny_hf_model(tmp_path / "tiny")
    st, out = tmp_path / "state", tmp_path / "out"
    common = ["--state", str(st), "--out", str(out), "--arms", "bf16,naive_nvfp4", "--seeds", "0", "--model", str(model),
              "--device", "cpu", "--kernels", "reference", "--budget-s", "500", "--threads", "1", "--min-start-s", "5"]
    grpo = ["--", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "6", "--n-train", "24", "--n-eval", "4",
            "--eval-prompts", "4", "--eval-every", "1", "--diag-every", "0", "--task", "arithmetic", "--template", "terse"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    cmd = [sys.executable, "-m", "qpass.apps.cli", "grpo-sweep", "run"]
    r = subprocess.run([*cmd, *common, "--steps", "2", *grpo], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    files = sorted(p.name for p in out.iterdir())
    assert files == ["compare.json", "compare.md", "cost.png", "logs.tar.gz", "runs.tar.gz", "summary.md", "sweep.json"]
    assert all(p.stat().st_size <= sw.MAX_FILE_BYTES for p in out.iterdir())
    meta = json.loads((out / "sweep.json").read_text())
    assert [(j["job"], j["steps_done"], j["rc"]) for j in meta["jobs"]] == [("bf16_s0", 2, 0), ("naive_nvfp4_s0", 2, 0)]
    assert meta["provenance"]["command"]["argv"][:2] == ["grpo-sweep", "run"]
    with tarfile.open(out / "runs.tar.gz") as tf:
        names = tf.getnames()
    assert "runs/naive_nvfp4_s0/provenance.json" in names and not any(n.endswith(".pt") for n in names)
    first = [json.loads(x) for x in (st / "runs" / "naive_nvfp4_s0" / "metrics.jsonl").read_text().splitlines()]
    # second call: both resume from their checkpoints to step 3
    r = subprocess.run([*cmd, *common, "--steps", "3", *grpo], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(x) for x in (st / "runs" / "naive_nvfp4_s0" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2, 3]
    strip = lambda rr: [{k: v for k, v in x.items() if not k.startswith("time/") and k != "rollout/tokens_per_s"} for x in rr]  # noqa: E731
    assert strip(rows[:2]) == strip(first)  # the resumed run kept its first two rows
    assert rows[2]["time/rollout_s_cum"] > rows[1]["time/rollout_s_cum"]
    assert "resumed at step 2" in (st / "logs" / "naive_nvfp4_s0.log").read_text()
    # third call: nothing left to do
    r = subprocess.run([*cmd, *common, "--steps", "3", *grpo], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "already complete: bf16_s0, naive_nvfp4_s0" in r.stdout
