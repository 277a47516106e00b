#!/usr/bin/env bash
# GPU run of the small-M NVFP4 GEMV (issue 14): its selfcheck rows, then the decode M <= 4 benchmark
# grid (GEMV vs the old GEMM path, BF16 cuBLAS, FP8, the INT4 peers; Llama-8B and SmolLM2 shapes).
#
# Run from the repository root on the H200 box (python3 with torch + triton; qpass need not be
# installed). Writes to $OUT (default ./gpu_out_gemv): env.txt selfcheck_gemv.{json,log}
# bench_gemv.{json,md,log}. Wall time < 9 min by construction (selfcheck <= 200 s, bench budget
# 240 s + 50 s hard stop); a failing or timed-out part is reported and the other still runs.
set -u
set -o pipefail
REPO="$(pwd)"
OUT="${OUT:-$REPO/gpu_out_gemv}"
mkdir -p "$OUT"
# shellcheck disable=SC1091
source "$REPO/scripts/gpu_setup.sh"
unset TRITON_INTERPRET
{
  echo "date: $(date -u +%FT%TZ)"; echo "commit: $(git -C "$REPO" rev-parse HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1
} > "$OUT/env.txt"
cat "$OUT/env.txt"
echo "=== (a) selfcheck --only GEMV ==="
timeout -k 10 200 python3 -m qpass.backends.triton.selfcheck --only GEMV --out "$OUT/selfcheck_gemv.json" 2>&1 \
  | tee "$OUT/selfcheck_gemv.log"
RC_CHECK=$?
echo "=== (b) bench --gemv-only ==="
timeout -k 10 290 python3 -m qpass.apps.cli bench --gemv-only --out "$OUT/bench_gemv.json" --budget-s 240 \
  > "$OUT/bench_gemv.log" 2>&1
RC_BENCH=$?
grep -A40 "^## Targets" "$OUT/bench_gemv.md" 2>/dev/null | head -45
echo "selfcheck rc=$RC_CHECK bench rc=$RC_BENCH (outputs in $OUT)"
[ $RC_CHECK -eq 0 ] && [ $RC_BENCH -eq 0 ]
