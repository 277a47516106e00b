#!/usr/bin/env bash
# Provenance (lab launcher for the GPU box; scripts/README.md): produced
# `docs/results/h200/selfcheck.json`, `docs/results/h200/bench.json` and `docs/results/h200_peers/`
# (BENCHMARKS.md).
# GPU run of the qpass Triton kernels (H200 / sm_90): large-shape correctness, then the benchmark
# (kernel grid + the end-to-end decode step under CUDA graphs, one process, one bench.json).
#
# Run from the repository root on the GPU box (python3 with torch + triton + transformers; qpass need
# not be installed, no model files or network needed: the end-to-end models have random weights).
# Writes at most 7 files to $OUT (default ./gpu_out):
#   env.txt  selfcheck.log  selfcheck.json  bench.log  bench.json  bench.md  summary.md
# and prints a short summary last. Parts are independent: a failing or timed-out part is reported
# (FAIL lines, non-zero exit) but does not stop the others. Wall time < 9 min by construction (the
# budgets below, seconds; each can be set from the environment; SELFCHECK_S=0 skips the selfcheck): selfcheck <= SELFCHECK_S; benchmark budget = what is left of TOTAL_S after
# the selfcheck, the summary and the hard-stop margin (at most BENCH_MAX_S), of which E2E_S is reserved
# for the end-to-end section (the kernel steps before it stop E2E_S early); hard stop budget + MARGIN_S.
TOTAL_S=${TOTAL_S:-520}        # whole script, < 540 s (9 min)
SELFCHECK_S=${SELFCHECK_S:-180}    # (a) selfcheck hard limit
BENCH_MAX_S=${BENCH_MAX_S:-300}    # (b) benchmark budget cap
E2E_S=${E2E_S:-180}          # (b) of the benchmark budget, reserved for the end-to-end decode section
MARGIN_S=${MARGIN_S:-40}        # (b) hard stop after the budget: a step in progress may finish
SUMMARY_S=${SUMMARY_S:-10}       # (c) summary
# shellcheck disable=SC1091
source "$(pwd)/scripts/gpu_common.sh"

# --- qpass importable without installing (the same shim as every other GPU script)
# shellcheck disable=SC1091
source "$REPO/scripts/gpu_setup.sh"
unset TRITON_INTERPRET

{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1
  python3 - <<'PY' 2>&1
import platform, torch, triton
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, "sm", f"{p.major}.{p.minor}", "SMs", p.multi_processor_count, "mem GiB", round(p.total_memory / 2**30, 1))
import qpass.backends.triton as qt
print("qpass.backends.triton imported; kernels:", sorted(qt.TRITON_KERNELS))
try:  # the end-to-end section builds its models with transformers' LlamaForCausalLM
    import transformers
    print("transformers", transformers.__version__)
except Exception as e:
    print("!!! transformers not importable (the end-to-end section will fail):", type(e).__name__, e)
PY
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# --- (a) correctness at large shapes
echo "=== (a) selfcheck ==="
if [ "$SELFCHECK_S" -gt 0 ]; then
  timeout -k 10 $SELFCHECK_S python3 -m qpass.backends.triton.selfcheck --out "$OUT/selfcheck.json" 2>&1 | tee "$OUT/selfcheck.log"
  RC_CHECK=$?
else
  echo "selfcheck skipped (SELFCHECK_S=0)"; RC_CHECK=0
fi
[ $RC_CHECK -ne 0 ] && echo "!!! SELFCHECK FAILED OR TIMED OUT (rc=$RC_CHECK) -- see selfcheck.log" | tee -a "$OUT/selfcheck.log"

# --- (b) benchmark (budgeted; the rest of the grid is recorded as skipped): calibration, act quant,
# decode M <= 16, prefill M = 4096, then the end-to-end decode section (E2E_S reserved), then the rest
echo "=== (b) benchmark ==="
ELAPSED=$(( $(date +%s) - START ))
BUDGET=$(( TOTAL_S - ELAPSED - MARGIN_S - SUMMARY_S - 10 ))
[ $BUDGET -gt $BENCH_MAX_S ] && BUDGET=$BENCH_MAX_S
[ $BUDGET -lt 60 ] && BUDGET=60
RESERVE=$E2E_S
[ $RESERVE -gt $(( BUDGET - 90 )) ] && RESERVE=$(( BUDGET - 90 ))  # the priority kernel steps keep >= 90 s
echo "benchmark budget ${BUDGET} s (end-to-end section reserve ${RESERVE} s), hard stop +${MARGIN_S} s"
timeout -k 10 $(( BUDGET + MARGIN_S )) python3 -m qpass.apps.cli bench --out "$OUT/bench.json" --budget-s "$BUDGET" \
  --e2e-budget-s "$RESERVE" > "$OUT/bench.log" 2>&1
RC_BENCH=$?
tail -n 5 "$OUT/bench.log"
[ $RC_BENCH -ne 0 ] && echo "!!! BENCHMARK FAILED, TIMED OUT OR RECORDED ERRORS (rc=$RC_BENCH) -- see bench.log / bench.md" | tee -a "$OUT/bench.log"

# --- (c) summary (printed last)
python3 - "$OUT" "$RC_CHECK" "$RC_BENCH" "$START" <<'PY' 2>&1 | tee "$OUT/summary.md"
import json, sys, time
from pathlib import Path
out, rc_check, rc_bench, start = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
lines = ["# qpass GPU kernel run: summary", ""]
try:
    sc = json.loads((out / "selfcheck.json").read_text())
    state = "" if sc.get("complete", True) else " -- INCOMPLETE (killed or timed out; results so far)"
    lines += [f"## correctness: {'ALL PASS' if sc['ok'] else 'FAILURES'}{state} (rc={rc_check}, seed {sc['seed']}, {sc['wall_s']} s)", "",
              "| check | result | detail |", "| --- | --- | --- |"]
    for c in sc["checks"]:
        d = (c["detail"].splitlines() or [""])[0][:160].replace("|", "/")
        lines.append(f"| {c['name']} | {'PASS' if c['ok'] else '**FAIL**'} | {d} |")
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
    lines += ["", "| section | kernel | M | N | K | us | vs BF16 | of roofline | mode |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"
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
lines += ["", f"total wall time {int(time.time()) - start} s; files in {out}"]
print("\n".join(lines))
PY
[ $RC_CHECK -eq 0 ] && [ $RC_BENCH -eq 0 ]
