#!/usr/bin/env bash
# Body of `bash scripts/gpu.sh cuda` (scripts/README.md): sourced by scripts/gpu.sh, which defines gpu_open /
# gpu_setup / gpu_import_or_setup; not run alone.
# Provenance (lab launcher for the GPU box): the run directories of docs/results/cuda_kernels/ (run 5 on): the
# cuda kernel backend's exactness checks and its same-run table (BENCHMARKS.md "Current same-run table").
# One device call instead of four (device starts fail often: a session may get one start): the steps of
# docs/results/cuda_kernels/run4_h100/README.md in order, each one under `timeout`, each only while the
# call's budget (TOTAL_S, default 560 s; the device runner's limit is 600 s) still holds its estimate:
#   1. cuda_check --only-act (activation checks, select_variants, act_profile, act_sweep) -> $OUT/a/
#      (~90 s); when it fails (its exit status or "ok": false) nothing else runs: the select or the
#      activation kernels are wrong, fix or revert before timing anything
#   2. cuda_check, kernels + prefill + GRPO sample phase + end-to-end B = 1, 16 (quick recipes) -> $OUT/b/ (~210 s)
#   3. cuda_check --e2e-only, B = 16, 64 -> $OUT/c/ (~170 s)
#   4. triton_selfcheck --quick -> $OUT/selfcheck.json (what is left, at least 60 s)
#   5. cuda_tables $OUT/b $OUT/c -> $OUT/tables.md (c's end-to-end rows replace b's of the same model, B, recipe)
# Knobs: TOTAL_S, ACT_SWEEP_S (30), STEPS (default "1 2 3 4 5": a subset runs those steps only).
# Exit status: 0 when every step that ran exited 0; otherwise the first failing step's number.
TOTAL_S=${TOTAL_S:-560}
ACT_SWEEP_S=${ACT_SWEEP_S:-30}
STEPS=${STEPS:-"1 2 3 4 5"}
gpu_open
gpu_import_or_setup qpass.apps.bench.cuda_check
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
RC=0
left() { echo $(( TOTAL_S - ($(date +%s) - START) )); }
wants() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
# step N ESTIMATE_S LIMIT_S CMD...: run CMD (log $OUT/stepN.log) when STEPS has N and the budget holds ESTIMATE_S
step() {
  local n=$1 est=$2 lim=$3 rc
  shift 3
  wants "$n" || return 0
  if [ "$(left)" -lt "$est" ]; then echo "step $n skipped: $(left) s left, needs ~$est s"; return 0; fi
  [ "$lim" -gt "$(left)" ] && lim=$(left)
  echo "=== step $n: $* (limit ${lim} s)"
  timeout -k 5 "$lim" "$@" > "$OUT/step$n.log" 2>&1
  rc=$?
  tail -n 8 "$OUT/step$n.log"
  echo "step $n rc=$rc ($(( $(date +%s) - START )) s)"
  if [ $rc -ne 0 ] && [ $RC -eq 0 ]; then RC=$n; fi
  return $rc
}
CC="python3 -m qpass.apps.bench.cuda_check"
if ! step 1 90 150 $CC --out "$OUT/a" --only-act --act-sweep-s "$ACT_SWEEP_S"; then
  echo "FAIL: the activation checks (step 1) failed: nothing is timed"; exit 1
fi
grep -h '"sel_agg"' "$OUT/step1.log" 2>/dev/null || true
step 2 200 300 $CC --out "$OUT/b" --budget-s 80 --prefill-s 20 --with-rollout 35 --with-e2e 110 --e2e-recipes quick \
  --with-e2e-large 0 --e2e-batches 1,16 --act-sweep-s 0
step 3 120 200 $CC --e2e-only --out "$OUT/c" --budget-s 170 --e2e-batches 16,64
step 4 60 200 python3 -m qpass.apps.bench.triton_selfcheck --quick --out "$OUT/selfcheck.json"
dirs=()
for d in b c; do [ -d "$OUT/$d" ] && dirs+=("$OUT/$d"); done
if wants 5 && [ ${#dirs[@]} -gt 0 ]; then
  python3 -m qpass.apps.bench.cuda_tables "${dirs[@]}" > "$OUT/tables.md" 2>&1 && echo "tables: $OUT/tables.md"
fi
exit $RC
