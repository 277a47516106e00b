"""``qpass grpo-sweep``: N arms x seeds of ``qpass grpo`` as parallel processes on one GPU, resumable.

    qpass grpo-sweep run   --arms c5,c1 --seeds 0,1,2 --steps 150 --state S --out O --budget-s 540 -- GRPO_ARGS...
    qpass grpo-sweep start ...same...      # the same run detached (own session): returns at once
    qpass grpo-sweep status --state S      # one line per job
    qpass grpo-sweep collect --state S --out O

**Jobs.** An arm (:data:`ARMS`: a recipe, its extra ``qpass grpo`` flags, optionally its model) times
a seed is one job ``<arm>_s<seed>``; :data:`ARM_SETS` name groups of arms (``c5`` the long-run arms
of claim C5 including fp8_block, ``c1`` the RL-time operand ablation, ``b1`` correction alone, ``moe``
the MoE arms). Every job is one ``python -m qpass.apps.cli grpo`` process with
``--checkpoint-dir STATE/ckpt/<job> --resume --checkpoint-every K --overwrite``, its run directory
``STATE/runs/<job>`` and log ``STATE/logs/<job>.log``; arguments after ``--`` go to every job (the
task, sampling and loss settings), before the arm's own flags, which therefore win (``naive_tis``
stays decoupled + TIS under a common ``--ratio coupled``). Jobs start seed-major (every arm's seed 0 first), at most
``--parallel`` at a time, each with ``--threads`` CPU threads; all share the GPU.

**Budget and resume.** ``--budget-s`` is this call's wall clock. A job starts only while at least
``--min-start-s`` remain and gets ``--total-time-s`` = what remains minus ``--margin-s`` (model load
included; ``qpass grpo`` stops between steps and writes its run directory and checkpoint). A job
still alive ``--grace-s`` after the budget is sent SIGTERM (its process group), SIGKILL 20 s later;
its last checkpoint (every ``--checkpoint-every`` steps) survives. A later call with the same
``--state`` continues every unfinished job from its checkpoint and skips finished ones
(``summary.json``: ``steps_done == --steps``). Only one ``run`` per state directory at a time
(``STATE/sweep.lock``). ``moe-default`` is built once before any MoE job starts (the jobs would
race building it).

**What to fetch.** ``--out`` (written at the end of ``run`` and by ``collect``) holds at most 8 files,
none over 16 MiB: ``sweep.json`` (jobs, commands, exit codes, steps, provenance), ``summary.md``
(per job: steps, s/step, rollout tokens/s, learner s/step, eval, G_abs, collapse by the written
definition and by accuracy alone), ``compare.json`` / ``compare.md`` (``qpass grpo-compare`` over the
arms), ``cost.png`` (held-out accuracy against cumulative rollout seconds, every job),
``runs.tar.gz`` (every run directory, no checkpoints; split into ``runs.tar.gz.partNN`` when larger
than 16 MiB) and ``logs.tar.gz``.

Exit status: 0 every job finished or stopped on its budget with exit 0; 1 a job failed; 2 bad
arguments (validated, including every job's ``qpass grpo`` arguments, before anything starts).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qpass.apps.cliutil import Parser, add_kernels, add_verbose, pos_float, pos_int
from qpass.atomic import pid_alive

__all__ = ["ARMS", "ARM_SETS", "Arm", "Job", "build_sweep_parser", "plan_jobs", "sweep_main"]

MAX_FILES = 8
MAX_FILE_BYTES = 16 << 20
PART_BYTES = 15 << 20
#: ``qpass grpo`` flags the sweep sets itself (refused after ``--``).
OWNED_FLAGS = ("--recipe", "--out", "--seed", "--steps", "--model", "--checkpoint-dir", "--resume", "--checkpoint-every",
               "--total-time-s", "--max-time-s", "--segment-steps", "--overwrite", "--force", "--threads", "--device",
               "--kernels", "--keep-partial")


@dataclasses.dataclass(frozen=True)
class Arm:
    """One arm: a recipe, the ``qpass grpo`` flags that make it, and optionally its own model."""

    name: str
    recipe: str
    flags: tuple[str, ...] = ()
    model: str | None = None
    note: str = ""


_ARM_LIST = (
    Arm("bf16", "bf16", note="BF16 learner and rollout: the floor"),
    Arm("fp8_block", "fp8_block", note="FP8 W8A8 rollout with DeepSeek block scales: the Hopper baseline"),
    Arm("naive_nvfp4", "naive_nvfp4", note="BF16 learner, W4A4 rollout"),
    Arm("qat_only", "qat_only", note="weight-QDQ learner, W4A4 rollout, no RAC"),
    Arm("quads_nvfp4", "quads_nvfp4", note="weight-QDQ learner, W4A4 + RAC rollout"),
    Arm("w4a16_rollout", "w4a16_rollout", note="C1 at RL time: BF16 learner, W4A16 rollout"),
    Arm("w16a4_rollout", "w16a4_rollout", note="C1 at RL time: BF16 learner, W16A4 rollout"),
    Arm("naive_decoupled", "naive_nvfp4", ("--ratio", "decoupled", "--correction", "none"),
        note="B1 control: the decoupled objective without an importance weight"),
    Arm("naive_tis", "naive_nvfp4", ("--ratio", "decoupled", "--correction", "tis"),
        note="B1: truncated importance sampling min(p_prox/q, --tis-cap)"),
    Arm("naive_mis", "naive_nvfp4", ("--ratio", "decoupled", "--correction", "mis"),
        note="B1: masked importance sampling outside [--mis-lo, --mis-hi]"),
    Arm("moe_bf16", "bf16", model="moe-default", note="MoE: BF16"),
    Arm("moe_naive_nvfp4", "naive_nvfp4", model="moe-default", note="MoE: BF16 learner, W4A4 rollout"),
    Arm("moe_quads_replay", "quads_nvfp4_moe", ("--routing-replay", "on"), model="moe-default",
        note="MoE: QUADS (RAC on W13), learner replays the rollout's routes"),
    Arm("moe_quads_noreplay", "quads_nvfp4_moe", ("--routing-replay", "off"), model="moe-default",
        note="MoE: QUADS (RAC on W13), learner routes itself"),
)
#: Arms by name.
ARMS: dict[str, Arm] = {a.name: a for a in _ARM_LIST}
#: Named groups of arms (``--arms c5,b1``).
ARM_SETS: dict[str, tuple[str, ...]] = {
    "c5": ("bf16", "fp8_block", "naive_nvfp4", "qat_only", "quads_nvfp4"),
    "c1": ("bf16", "w4a16_rollout", "w16a4_rollout", "naive_nvfp4"),
    "b1": ("naive_nvfp4", "naive_decoupled", "naive_tis", "naive_mis"),
    "moe": ("moe_bf16", "moe_naive_nvfp4", "moe_quads_replay", "moe_quads_noreplay"),
    "all": tuple(ARMS),
}


@dataclasses.dataclass(frozen=True)
class Job:
    """One ``qpass grpo`` process of the sweep."""

    name: str
    arm: Arm
    seed: int
    model: str

    def argv(self, state: Path, *, steps: int, device: str, kernels: str, threads: int, checkpoint_every: int,
             total_time_s: float, extra: Sequence[str]) -> list[str]:
        """``qpass grpo`` arguments (after the subcommand name)."""
        return ["--recipe", self.arm.recipe, "--model", self.model, "--seed", str(self.seed), "--steps", str(steps),
                "--out", str(state / "runs" / self.name), "--overwrite", "--checkpoint-dir", str(state / "ckpt" / self.name),
                "--resume", "--checkpoint-every", str(checkpoint_every), "--total-time-s", f"{total_time_s:.0f}",
                "--device", device, "--kernels", kernels, "--threads", str(threads), "--no-progress", "--no-plots",
                *extra, *self.arm.flags]  # the arm's own flags last: they win over the common ones


class SweepError(Exception):
    """Bad sweep arguments (exit status 2)."""


def _resolve_arms(spec: str) -> list[Arm]:
    names: list[str] = []
    for tok in (t.strip() for t in spec.split(",")):
        if not tok:
            continue
        if tok in ARM_SETS:
            names += ARM_SETS[tok]
        elif tok in ARMS:
            names.append(tok)
        else:
            raise SweepError(f"--arms: unknown arm or set {tok!r}; arms: {sorted(ARMS)}; sets: {sorted(ARM_SETS)}")
    if not names:
        raise SweepError("--arms is empty")
    return [ARMS[n] for n in dict.fromkeys(names)]


def _seeds(spec: str) -> list[int]:
    try:
        out = [int(t) for t in spec.split(",") if t.strip()]
    except ValueError:
        raise SweepError(f"--seeds must be a comma list of integers, got {spec!r}") from None
    if not out or len(set(out)) != len(out):
        raise SweepError(f"--seeds must list distinct integers, got {spec!r}")
    return out


def plan_jobs(arms: Sequence[Arm], seeds: Sequence[int], model: str) -> list[Job]:
    """Jobs in start order: seed-major (every arm's first seed before any second seed)."""
    return [Job(f"{a.name}_s{s}", a, s, a.model or model) for s in seeds for a in arms]


def build_sweep_parser(prog: str = "qpass grpo-sweep") -> argparse.ArgumentParser:
    """The ``qpass grpo-sweep`` argument parser."""
    ap = Parser(prog=prog, description="Arms x seeds of qpass grpo as parallel processes on one GPU with "
                                 "checkpoint/resume and a wall-clock budget; everything to fetch under one directory.")
    ap.add_argument("action", choices=["run", "start", "status", "collect"])
    ap.add_argument("--state", required=True, type=Path, help="state directory: runs, checkpoints, logs (kept between calls)")
    ap.add_argument("--out", type=Path, default=None, help="fetch directory (<= 8 files, each <= 16 MiB); run: written at the end; collect: needed "
                    "(default: none, nothing collected)")
    ap.add_argument("--arms", default="c5", help=f"comma list of arms {sorted(ARMS)} or sets {sorted(ARM_SETS)} (default c5)")
    ap.add_argument("--seeds", default="0", help="comma list of seeds (default 0)")
    ap.add_argument("--steps", type=pos_int, default=150, help="GRPO steps per job (the run's total; default 150)")
    ap.add_argument("--model", default="default", help="model of the dense arms (MoE arms use moe-default)")
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    add_kernels(ap, default="triton", help="rollout kernel backend of every job")
    ap.add_argument("--budget-s", type=pos_float, default=540.0, help="wall clock of this call (default 540)")
    ap.add_argument("--parallel", type=pos_int, default=None, help="most jobs at a time (default: all)")
    ap.add_argument("--threads", type=pos_int, default=None, help="CPU threads per job (default: cores / parallel)")
    ap.add_argument("--checkpoint-every", type=pos_int, default=10, help="checkpoint every N steps (default 10)")
    ap.add_argument("--min-start-s", type=pos_float, default=90.0, help="start a job only with this much budget left")
    ap.add_argument("--margin-s", type=pos_float, default=30.0, help="budget kept back from each job's --total-time-s")
    ap.add_argument("--grace-s", type=pos_float, default=60.0, help="after the budget, wait this long before SIGTERM")
    ap.add_argument("--force", action="store_true", help="replace --out if it is a previous sweep output")
    add_verbose(ap)
    ap.epilog = "Arguments after a lone '--' are qpass grpo flags given to every job (task, sampling, loss)."
    return ap


@dataclasses.dataclass
class _Plan:
    args: argparse.Namespace
    arms: list[Arm]
    jobs: list[Job]
    extra: list[str]
    threads: int
    parallel: int
    argv: list[str] = dataclasses.field(default_factory=list)  # the sweep's own arguments (after the subcommand)


def _validate(a: argparse.Namespace) -> _Plan:
    """Everything checked before a process starts (each job's ``qpass grpo`` arguments parsed)."""
    from qpass.apps.grpo.cli import build_grpo_parser

    extra = list(a.grpo_args)
    for f in extra:
        name = f.split("=", 1)[0]
        if name in OWNED_FLAGS:
            raise SweepError(f"{name} after '--' is set by the sweep per job; use the sweep's own flag")
    arms = _resolve_arms(a.arms)
    jobs = plan_jobs(arms, _seeds(a.seeds), a.model)
    parallel = min(a.parallel or len(jobs), len(jobs))
    threads = a.threads or max(1, (os.cpu_count() or 1) // parallel)
    if a.out is not None and a.out.resolve() == a.state.resolve():
        raise SweepError("--out must not be the --state directory")
    parser = build_grpo_parser()
    for j in jobs:
        argv = j.argv(a.state, steps=a.steps, device=a.device, kernels=a.kernels, threads=threads,
                      checkpoint_every=a.checkpoint_every, total_time_s=a.budget_s, extra=extra)
        err = _parse_quietly(parser, argv)
        if err is not None:
            raise SweepError(f"job {j.name}: qpass grpo {shlex.join(argv)}: {err}")
    return _Plan(a, arms, jobs, extra, threads, parallel)


def _parse_quietly(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The error ``qpass grpo`` would print for ``argv`` before loading a model (argparse, then the
    GRPO / loss configuration), or None."""
    import io

    from qpass.apps.grpo.cli import CliError, _grpo_config

    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        try:
            a = parser.parse_args(argv)
        except SystemExit:
            return buf.getvalue().strip().splitlines()[-1] if buf.getvalue().strip() else "invalid arguments"
    try:
        _grpo_config(a, a.steps, None)
    except CliError as exc:
        return str(exc)
    return None


# ------------------------------------------------------------------------------ state files


def _job_file(state: Path, name: str) -> Path:
    return state / "jobs" / f"{name}.json"


def _write_job(state: Path, name: str, rec: dict[str, Any]) -> None:
    from qpass.jsonio import write_json

    write_json(_job_file(state, name), rec)


def _read_json(p: Path) -> dict[str, Any] | None:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _done(state: Path, job: Job, steps: int) -> bool:
    s = _read_json(state / "runs" / job.name / "summary.json")
    return bool(s) and int(s.get("steps_done") or 0) >= steps


@contextlib.contextmanager
def _lock(state: Path):
    p = state / "sweep.lock"
    old = _read_json(p)
    if old and pid_alive(int(old.get("pid", -1))) and int(old["pid"]) != os.getpid():
        raise SweepError(f"{state} is in use by sweep process {old['pid']} (its lock {p})")
    from qpass.jsonio import write_json

    write_json(p, {"pid": os.getpid(), "started": time.time()})
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            p.unlink()


# ------------------------------------------------------------------------------ run


def _prebuild_moe(plan: _Plan, log: Any) -> None:
    if not any(j.model == "moe-default" for j in plan.jobs):
        return
    code = ("from qpass.graph.model import default_model_file; from qpass.moe.upcycle import moe_default_dir; "
            "print(moe_default_dir(default_model_file()))")
    print("grpo-sweep: building moe-default once before the MoE jobs", file=log, flush=True)
    subprocess.run([sys.executable, "-c", code], check=True, stdout=log, stderr=subprocess.STDOUT)


def _run(plan: _Plan) -> int:
    a = plan.args
    state = a.state
    for sub in ("runs", "ckpt", "logs", "jobs"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    deadline = t0 + a.budget_s
    todo = [j for j in plan.jobs if not _done(state, j, a.steps)]
    skipped = [j.name for j in plan.jobs if j not in todo]
    if skipped:
        print(f"grpo-sweep: already complete: {', '.join(skipped)}", flush=True)
    if todo:
        _prebuild_moe(plan, sys.stdout)
    running: dict[str, tuple[subprocess.Popen, Any, dict[str, Any]]] = {}
    failed: list[str] = []
    stop = {"flag": False}

    def on_term(signum: int, _frame: Any) -> None:
        stop["flag"] = True

    prev = {s: signal.signal(s, on_term) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while todo or running:
            now = time.monotonic()
            while todo and len(running) < plan.parallel and not stop["flag"] and deadline - now >= a.min_start_s:
                j = todo.pop(0)
                total = max(1.0, deadline - now - a.margin_s)
                argv = j.argv(state, steps=a.steps, device=a.device, kernels=a.kernels, threads=plan.threads,
                              checkpoint_every=a.checkpoint_every, total_time_s=total, extra=plan.extra)
                cmd = [sys.executable, "-m", "qpass.apps.cli", "grpo", *argv]
                logf = open(state / "logs" / f"{j.name}.log", "a")  # noqa: SIM115 - closed when the job ends
                print(f"=== grpo-sweep {time.strftime('%Y-%m-%dT%H:%M:%S')}: {shlex.join(cmd)}", file=logf, flush=True)
                proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
                rec = {"job": j.name, "arm": j.arm.name, "recipe": j.arm.recipe, "seed": j.seed, "model": j.model,
                       "cmd": cmd, "pid": proc.pid, "started": time.time(), "total_time_s": total, "rc": None}
                _write_job(state, j.name, rec)
                running[j.name] = (proc, logf, rec)
                print(f"grpo-sweep: started {j.name} (pid {proc.pid}, {total:.0f} s)", flush=True)
            if not todo and not running:
                break
            if (stop["flag"] or time.monotonic() > deadline + a.grace_s) and running:
                _stop_all(running, state)
            if todo and (stop["flag"] or deadline - time.monotonic() < a.min_start_s) and not running:
                for j in todo:
                    print(f"grpo-sweep: not started this call (budget): {j.name}", flush=True)
                todo.clear()
            for name in list(running):
                proc, logf, rec = running[name]
                rc = proc.poll()
                if rc is None:
                    continue
                logf.close()
                rec.update(rc=rc, ended=time.time())
                _write_job(state, name, rec)
                del running[name]
                if rc != 0:
                    failed.append(name)
                print(f"grpo-sweep: {name} exited {rc} after {rec['ended'] - rec['started']:.0f} s", flush=True)
            time.sleep(0.5)
    finally:
        if running:
            _stop_all(running, state)
        for s, h in prev.items():
            signal.signal(s, h)
    if a.out is not None:
        _collect(plan, a.out, force=True)
    return 1 if failed else 0


def _stop_all(running: dict[str, tuple[subprocess.Popen, Any, dict[str, Any]]], state: Path) -> None:
    """SIGTERM every running job's process group, SIGKILL after 20 s; record their exit codes."""
    for proc, _, _ in running.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    end = time.monotonic() + 20
    while time.monotonic() < end and any(p.poll() is None for p, _, _ in running.values()):
        time.sleep(0.2)
    for name, (proc, logf, rec) in list(running.items()):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        logf.close()
        rec.update(rc=proc.returncode, ended=time.time(), stopped="budget")
        _write_job(state, name, rec)
        print(f"grpo-sweep: {name} stopped (exit {proc.returncode})", flush=True)
    running.clear()


# ------------------------------------------------------------------------------ collect


def _mean(xs: Sequence[Any]) -> float | None:
    v = [float(x) for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)]
    return sum(v) / len(v) if v else None


def _job_row(state: Path, job: Job) -> dict[str, Any]:
    from qpass.apps.grpo.jsonl import read_jsonl
    from qpass.diagnostics.collapse import accuracy_collapse_summary, collapse_summary

    d = state / "runs" / job.name
    rec = _read_json(_job_file(state, job.name)) or {}
    row: dict[str, Any] = {"job": job.name, "arm": job.arm.name, "recipe": job.arm.recipe, "seed": job.seed,
                           "model": job.model, "flags": list(job.arm.flags), "rc": rec.get("rc"), "cmd": rec.get("cmd"),
                           "run_dir": str(d)}
    if not (d / "metrics.jsonl").is_file():
        row["steps_done"] = 0
        return row
    rows = read_jsonl(d / "metrics.jsonl")
    ev = read_jsonl(d / "eval.jsonl") if (d / "eval.jsonl").is_file() else []
    summ = _read_json(d / "summary.json") or {}
    acc = [e.get("eval/accuracy") for e in ev if isinstance(e.get("eval/accuracy"), (int, float))]
    later = rows[1:] or rows
    row.update({
        "steps_done": len(rows), "stop_reason": summ.get("stop_reason"),
        "step_s": _mean([r.get("time/step_s") for r in later]),
        "rollout_tokens_per_s": _mean([r.get("rollout/tokens_per_s") for r in later]),
        "learner_s": _mean([r.get("time/learner_s") for r in later]),
        "rollout_s_cum": rows[-1].get("time/rollout_s_cum") if rows else None,
        "eval_first": acc[0] if acc else None, "eval_best": max(acc) if acc else None, "eval_last": acc[-1] if acc else None,
        "g_abs_mean": _mean([r.get("gap/token/g_abs") for r in rows]),
        "collapse_written": collapse_summary(ev, rows), "collapse_accuracy_only": accuracy_collapse_summary(ev),
    })
    return row


def _fmt(v: Any, nd: int = 3) -> str:
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def _verdict(c: dict[str, Any] | None) -> str:
    if not c:
        return "-"
    return f"at step {c['step']}" if c.get("collapsed") else f"none within {c.get('observed_until')} steps"


def _summary_md(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = ["# qpass grpo-sweep", "", f"State {meta['state']}; {meta['steps']} steps per job; budget {meta['budget_s']:.0f} s "
             f"per call; device {meta['device']} ({meta.get('gpu') or '-'}); kernels {meta['kernels']}.", "",
             "| job | arm | steps | stop | exit | s/step | rollout tok/s | learner s/step | rollout s (cum) | eval first / best / last "
             "| mean G_abs | collapse (written) | collapse (accuracy) |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | --- |"]
    for r in rows:
        ev = " / ".join(_fmt(r.get(k)) for k in ("eval_first", "eval_best", "eval_last"))
        lines.append(f"| {r['job']} | {r['arm']} | {r.get('steps_done', 0)} | {_fmt(r.get('stop_reason'))} | {_fmt(r.get('rc'))} "
                     f"| {_fmt(r.get('step_s'), 2)} | {_fmt(r.get('rollout_tokens_per_s'), 0)} | {_fmt(r.get('learner_s'), 2)} "
                     f"| {_fmt(r.get('rollout_s_cum'), 1)} | {ev} | {_fmt(r.get('g_abs_mean'), 4)} "
                     f"| {_verdict(r.get('collapse_written'))} | {_verdict(r.get('collapse_accuracy_only'))} |")
    lines += ["", "Timings are wall seconds of processes sharing one GPU (not GPU-exclusive seconds)."]
    return "\n".join(lines) + "\n"


def _tar(out: Path, root: Path, members: Sequence[Path], exclude_suffixes: tuple[str, ...] = (".pt",)) -> None:
    def flt(ti: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if ti.name.endswith(exclude_suffixes) else ti

    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tf:
        for m in members:
            if m.exists():
                tf.add(m, arcname=str(m.relative_to(root)), filter=flt)
    tmp.replace(out)


def _split(path: Path) -> list[Path]:
    """``path`` itself if it is at most 16 MiB, else parts ``path.partNN`` of 15 MiB (``cat`` them back)."""
    if path.stat().st_size <= MAX_FILE_BYTES:
        return [path]
    parts = []
    with open(path, "rb") as f:
        i = 0
        while chunk := f.read(PART_BYTES):
            p = path.with_name(f"{path.name}.part{i:02d}")
            p.write_bytes(chunk)
            parts.append(p)
            i += 1
    path.unlink()
    return parts


def _collect(plan: _Plan, out: Path, *, force: bool) -> list[Path]:
    """Write the fetch directory (see the module docstring); returns its files."""
    from qpass.apps.grpo.plots import load_run, plot_runs
    from qpass.atomic import atomic_dir, write_atomic
    from qpass.diagnostics.compare import compare_runs, parse_metric, to_markdown
    from qpass.jsonio import write_json
    from qpass.provenance import collect as provenance

    a, state = plan.args, plan.args.state
    rows = [_job_row(state, j) for j in plan.jobs]
    prov = provenance(["grpo-sweep", *plan.argv], device=a.device)
    meta = {"state": str(state), "steps": a.steps, "budget_s": a.budget_s, "device": a.device, "kernels": a.kernels,
            "gpu": prov["device"].get("name"), "arms": [dataclasses.asdict(x) for x in plan.arms],
            "seeds": sorted({j.seed for j in plan.jobs}), "grpo_args": plan.extra, "parallel": plan.parallel,
            "threads_per_job": plan.threads}
    with atomic_dir(out, force=force, marker="sweep.json") as tmp:
        write_json(tmp / "sweep.json", {"schema": "qpass.grpo_sweep/1", **meta, "provenance": prov, "jobs": rows})
        write_atomic(tmp / "summary.md", _summary_md(rows, meta))
        have = [state / "runs" / r["job"] for r in rows if r.get("steps_done")]
        if have:
            arms: dict[str, list[Path]] = {}
            for r in rows:
                if r.get("steps_done"):
                    arms.setdefault(r["arm"], []).append(state / "runs" / r["job"])
            from qpass.apps.grpo.cli import DEFAULT_COMPARE_METRICS

            res = compare_runs(arms, [parse_metric(m) for m in DEFAULT_COMPARE_METRICS], load=load_run, n_boot=1000)
            write_json(tmp / "compare.json", res)
            write_atomic(tmp / "compare.md", to_markdown(res))
            plot_runs(have, tmp / "cost.png", preset="cost", title="held-out accuracy vs cumulative rollout seconds")
        _tar(tmp / "runs.tar.gz", state, [state / "runs"])
        _tar(tmp / "logs.tar.gz", state, [state / "logs", state / "jobs", state / "sweep.log"])
        files = []
        for p in sorted(tmp.iterdir()):
            files += _split(p)
        if len(files) > MAX_FILES:
            raise SweepError(f"the fetch directory would hold {len(files)} files (> {MAX_FILES}): "
                             f"{[p.name for p in files]}; fewer jobs per state directory")
    return [out / p.name for p in files]


# ------------------------------------------------------------------------------ status / start


def _status(plan: _Plan) -> int:
    state = plan.args.state
    lock = _read_json(state / "sweep.lock")
    if lock and pid_alive(int(lock.get("pid", -1))):
        print(f"grpo-sweep: running (pid {lock['pid']})")
    for j in plan.jobs:
        rec = _read_json(_job_file(state, j.name)) or {}
        summ = _read_json(state / "runs" / j.name / "summary.json") or {}
        alive = rec.get("rc") is None and rec.get("pid") and pid_alive(int(rec["pid"]))
        what = "running" if alive else ("not started" if not rec else f"exit {rec.get('rc')}")
        print(f"{j.name}: {what}; steps {summ.get('steps_done', 0)}/{plan.args.steps} ({summ.get('stop_reason', '-')})")
    return 0


def _start(plan: _Plan) -> int:
    a = plan.args
    a.state.mkdir(parents=True, exist_ok=True)
    argv = list(plan.argv)
    argv[argv.index("start")] = "run"
    with open(a.state / "sweep.log", "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "qpass.apps.cli", "grpo-sweep", *argv], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    print(f"grpo-sweep: started detached (pid {proc.pid}); log {a.state / 'sweep.log'}")
    return 0


def sweep_main(argv: Sequence[str] | None = None) -> int:
    """``qpass grpo-sweep ACTION ...`` (arguments after the subcommand). Returns the exit status."""
    ap = build_sweep_parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    own, extra = (raw[:raw.index("--")], raw[raw.index("--") + 1:]) if "--" in raw else (raw, [])
    try:
        a = ap.parse_args(own)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    a.grpo_args = extra
    try:
        plan = _validate(a)
        plan.argv = raw
        if a.action in ("run", "start", "collect") and a.out is not None:
            from qpass.atomic import check_output_path
            from qpass.errors import QpassError

            try:  # a previous sweep output is replaced (the same --out is reused call after call); nothing else
                check_output_path(a.out, force=a.force or (a.out / "sweep.json").is_file(), marker="sweep.json")
            except QpassError as exc:
                raise SweepError(f"--out: {exc}") from None
        if a.action == "collect" and a.out is None:
            raise SweepError("collect needs --out")
        if a.action == "status":
            return _status(plan)
        if a.action == "start":
            return _start(plan)
        if a.action == "collect":
            files = _collect(plan, a.out, force=True)
            print("\n".join(str(f) for f in files))
            return 0
        a.state.mkdir(parents=True, exist_ok=True)
        with _lock(a.state):
            return _run(plan)
    except SweepError as exc:
        print(f"qpass grpo-sweep: error: {exc}", file=sys.stderr)
        return 2
