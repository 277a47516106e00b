"""Markdown summary of a GPU-box run (printed last by ``scripts/gpu.sh kernels`` / ``scripts/gpu.sh moe``).

    python3 scripts/gpu_summary.py kernels OUT RC_CHECK RC_BENCH START   # OUT/selfcheck.json + OUT/bench.json
    python3 scripts/gpu_summary.py moe OUT RC START                      # OUT/moe_check.json

OUT is the run's output directory, RC_* the exit statuses of its parts (printed as given), START the
run's start time in epoch seconds (the footer gives the wall time since). A missing or unreadable
report becomes a "NO REPORT" line, never an error: the summary is printed even when a part failed.
Prints the summary on stdout (the launchers tee it to OUT/summary.md); exit 0, or 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def check_rows(checks: list[dict], *, pipe_safe: bool) -> list[str]:
    """The ``| check | result | detail |`` table of a selfcheck-style report's ``checks`` (name, ok, detail).

    Only the detail's first line is kept, cut at 160 characters; ``pipe_safe`` turns ``|`` into ``/``.
    """
    rows = ["| check | result | detail |", "| --- | --- | --- |"]
    for c in checks:
        d = (c["detail"].splitlines() or [""])[0][:160]
        if pipe_safe:
            d = d.replace("|", "/")
        rows.append(f"| {c['name']} | {'PASS' if c['ok'] else '**FAIL**'} | {d} |")
    return rows


def verdict(report: dict) -> str:
    return "ALL PASS" if report["ok"] else "FAILURES"


def footer(out: Path, start: int) -> list[str]:
    return ["", f"total wall time {int(time.time()) - start} s; files in {out}"]


def kernels_summary(out: Path, rc_check: str, rc_bench: str, start: int) -> list[str]:
    """selfcheck.json (checks table) and bench.json (targets, key rows, end-to-end rows, errors)."""
    lines = ["# qpass GPU kernel run: summary", ""]
    try:
        sc = json.loads((out / "selfcheck.json").read_text())
        state = "" if sc.get("complete", True) else " -- INCOMPLETE (killed or timed out; results so far)"
        lines += [f"## correctness: {verdict(sc)}{state} (rc={rc_check}, seed {sc['seed']}, {sc['wall_s']} s)", "",
                  *check_rows(sc["checks"], pipe_safe=True)]
    except Exception as e:
        lines.append(f"## correctness: NO REPORT (rc={rc_check}): {type(e).__name__}: {e}")
    lines.append("")
    try:
        b = json.loads((out / "bench.json").read_text())
        cal = b["meta"].get("calibration", {})
        state = "" if b["meta"].get("complete", True) else " -- INCOMPLETE (killed or timed out; rows so far)"
        lines += [f"## benchmark{state} (rc={rc_bench}, {b['meta'].get('wall_s')} s): copy {cal.get('copy_GBps', 0):.0f} GB/s, "
                  f"BF16 {cal.get('bf16_TFLOPs', 0):.0f} TFLOP/s, FP8 {cal.get('fp8_TFLOPs', 0) or 0:.0f} TFLOP/s", "",
                  "| target | goal | measured | met |", "| --- | --- | --- | --- |"]
        for t in b["targets"]:
            met = {True: "yes", False: "NO", None: "n/a"}[t.get("met")]
            lines.append(f"| {t['name']} | {t['goal']} | {t['measured']} | {met} |")
        rows = b["rows"]
        key = [r for r in rows if r["time_us"] and (
            r["section"].startswith("activation") or
            (r["section"].startswith("decode") and r["m"] in (1, 16)) or
            (r["section"].startswith("prefill") and r["m"] == 4096))]
        lines += ["", "| section | kernel | M | N | K | us | vs BF16 | of roofline | mode |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

        def f(v, p=2):
            return "-" if v is None else f"{v:.{p}f}"

        for r in key[:40]:
            lines.append(f"| {r['section'].split(' (')[0]} | {r['name']} | {r['m']} | {r['n'] or '-'} | {r['k']} | {f(r['time_us'], 1)} | "
                         f"{f(r['vs_bf16'])} | {f(r['roofline_frac'])} | {r['mode']} |")
        e2e = [r for r in rows if r["section"].startswith("end-to-end")]
        if e2e:
            lines += ["", "| end-to-end decode step (CUDA graphs) | B | step us | tokens/s | vs bf16 | replay == eager | mode |",
                      "| --- | --- | --- | --- | --- | --- | --- |"]
            for r in e2e:
                x = r["extra"]
                lines.append(f"| {r['name']} | {r['m']} | {f(r['time_us'], 1)} | {f(x.get('tokens_per_s'), 0)} | {f(r['vs_bf16'])} | "
                             f"{x.get('replay_equals_eager', '-')} | {r['mode']} |")
        skipped = sum(1 for r in rows if r["mode"].startswith("skipped"))
        failed = [r for r in rows if r["mode"] == "failed"]
        lines += ["", f"rows: {len(rows)} ({skipped} skipped for budget, {len(failed)} failed); errors: {len(b['errors'])}"]
        for e in b["errors"][:8]:
            lines.append(f"- ERROR: {e.splitlines()[0][:200]}")
    except Exception as e:
        lines.append(f"## benchmark: NO REPORT (rc={rc_bench}): {type(e).__name__}: {e}")
    return lines + footer(out, start)


def moe_summary(out: Path, rc: str, start: int) -> list[str]:
    """moe_check.json: checks table, then the timing rows (skipped shapes say why)."""
    lines = ["# qpass grouped experts GEMM on the GPU: summary", ""]
    try:
        r = json.loads((out / "moe_check.json").read_text())
        state = "" if r.get("complete", True) else " -- INCOMPLETE"
        lines += [f"## checks: {verdict(r)}{state} (rc={rc}, {r['wall_s']} s, {r.get('device')})", "",
                  *check_rows(r["checks"], pipe_safe=False)]
        lines += ["", "| shape | T | rows | N | K | case | ms |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for t in r.get("timing", []):
            if "skipped" in t:
                lines.append(f"| {t['shape']} | {t['T']} | - | - | - | skipped ({t['skipped']}) | - |")
            else:
                lines.append(f"| {t['shape']} | {t['T']} | {t['rows']} | {t['N']} | {t['K']} | {t['case']} | {t['ms']} |")
    except Exception as e:
        lines.append(f"## NO REPORT (rc={rc}): {type(e).__name__}: {e}")
    return lines + footer(out, start)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="run", required=True)
    k = sub.add_parser("kernels", help="selfcheck.json + bench.json of `gpu.sh kernels`")
    k.add_argument("out", type=Path)
    k.add_argument("rc_check")
    k.add_argument("rc_bench")
    k.add_argument("start", type=int)
    m = sub.add_parser("moe", help="moe_check.json of `gpu.sh moe`")
    m.add_argument("out", type=Path)
    m.add_argument("rc")
    m.add_argument("start", type=int)
    a = ap.parse_args(argv)
    lines = (kernels_summary(a.out, a.rc_check, a.rc_bench, a.start) if a.run == "kernels"
             else moe_summary(a.out, a.rc, a.start))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
