#!/usr/bin/env bash
# Body of `bash scripts/gpu.sh kernels` (old path: see scripts/README.md): sourced by scripts/gpu.sh, which defines
# gpu_open / gpu_setup / gpu_import_or_setup; not run alone.
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
gpu_open

# --- qpass importable without installing (the same shim as every other GPU script)
gpu_setup
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
python3 "$REPO/scripts/gpu_summary.py" kernels "$OUT" "$RC_CHECK" "$RC_BENCH" "$START" 2>&1 | tee "$OUT/summary.md"
[ $RC_CHECK -eq 0 ] && [ $RC_BENCH -eq 0 ]
