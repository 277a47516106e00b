#!/usr/bin/env bash
# Body of `bash scripts/gpu.sh gemv` (old path: see scripts/README.md): sourced by scripts/gpu.sh, which defines
# gpu_open / gpu_setup / gpu_import_or_setup; not run alone.
# Provenance (lab launcher for the GPU box; scripts/README.md): produced `docs/results/h200/gemv/`
# (BENCHMARKS.md, small-M GEMV).
# GPU run of the small-M NVFP4 GEMV (issue 14): its selfcheck rows, then the decode M <= 4 benchmark
# grid (GEMV vs the old GEMM path, BF16 cuBLAS, FP8, the INT4 peers; Llama-8B and SmolLM2 shapes).
#
# Run from the repository root on the H200 box (python3 with torch + triton; qpass need not be
# installed). Writes to $OUT (default ./gpu_out_gemv): env.txt selfcheck_gemv.{json,log}
# bench_gemv.{json,md,log}. PART=selfcheck|bench|all (default all). Limits: CHECK_S (selfcheck
# timeout, default 270 s), BENCH_S (benchmark budget, default 200 s; hard stop +50 s): the defaults
# keep PART=all under 9 min; run the parts as two calls with a larger BENCH_S (e.g. 480) to get the
# whole grid (the first call of every shape compiles and autotunes the GEMV variants: most of the
# selfcheck's time). A failing or timed-out part is reported and the other still runs.
gpu_open gpu_out_gemv
gpu_setup
unset TRITON_INTERPRET
{
  echo "date: $(date -u +%FT%TZ)"; echo "commit: $(git -C "$REPO" rev-parse HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1
} > "$OUT/env.txt"
cat "$OUT/env.txt"
PART="${PART:-all}"
CHECK_S="${CHECK_S:-270}"
BENCH_S="${BENCH_S:-200}"
RC_CHECK=0
RC_BENCH=0
if [ "$PART" != bench ]; then
  echo "=== (a) selfcheck --only GEMV ==="
  timeout -k 10 "$CHECK_S" python3 -m qpass.backends.triton.selfcheck --only GEMV --out "$OUT/selfcheck_gemv.json" 2>&1 \
    | tee "$OUT/selfcheck_gemv.log"
  RC_CHECK=$?
fi
if [ "$PART" != selfcheck ]; then
  echo "=== (b) bench --gemv-only ==="
  timeout -k 10 $(( BENCH_S + 50 )) python3 -m qpass.apps.cli bench --gemv-only --out "$OUT/bench_gemv.json" \
    --budget-s "$BENCH_S" > "$OUT/bench_gemv.log" 2>&1
  RC_BENCH=$?
  grep -A40 "^## Targets" "$OUT/bench_gemv.md" 2>/dev/null | head -45
fi
echo "selfcheck rc=$RC_CHECK bench rc=$RC_BENCH (outputs in $OUT)"
[ $RC_CHECK -eq 0 ] && [ $RC_BENCH -eq 0 ]
