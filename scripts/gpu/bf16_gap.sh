#!/usr/bin/env bash
# Body of `bash scripts/gpu.sh bf16-gap` (old path: see scripts/README.md): sourced by scripts/gpu.sh, which defines
# gpu_open / gpu_setup / gpu_import_or_setup; not run alone.
# Provenance (lab launcher for the GPU box; scripts/README.md): produced
# `docs/results/h200/bf16_gap_probe/` (docs/results/grpo.md, long runs on the H200).
# Why is the bf16 GRPO gap exactly 0 in the long runs (docs/results/grpo.md) but
# 0.036 in the speed runs? Two GRPO steps of the bf16 recipe per arm, on the GPU, one process per
# arm; prints gap/token/g_abs and gap/max_abs per step. Arms differ in one setting each from the
# long-run settings (terse template, 16 new tokens, 8 prompts x 8 samples, micro-batch 16, CUDA graphs on).
REPO="$(pwd)"
gpu_setup > /dev/null 2>&1
OUT="${OUT:-out/bf16_gap_probe}"; mkdir -p "$OUT"
BASE=(python3 -m qpass.apps.grpo.cli grpo --model "${QPASS_MODEL:-default}" --device cuda --kernels triton --seed 0 --no-progress
      --recipe bf16 --steps 2 --overwrite --prompts-per-step 8 --group-size 8 --lr 3e-5 --difficulty 2 --operators +
      --temperature 1.0 --n-train 500 --n-eval 16 --ratio coupled --correction none --minibatches 4 --ppo-epochs 1
      --eval-every 0 --diag-every 0 --bitexact-every 0 --no-initial-check --no-plots --threads 4)
declare -A ARMS=(
  [long]="--template terse --max-new-tokens 16 --micro-batch-size 16 --cuda-graphs on"
  [eager]="--template terse --max-new-tokens 16 --micro-batch-size 16 --cuda-graphs off"
  [default_template_64]="--template default --max-new-tokens 64 --micro-batch-size 16 --cuda-graphs on"
  [micro64]="--template terse --max-new-tokens 16 --micro-batch-size 64 --minibatches 1 --cuda-graphs on"
)
if [ "${ARMSET:-1}" = 2 ]; then  # second call: which of template / length makes the gap nonzero
  ARMS=(
    [terse_64]="--template terse --max-new-tokens 64 --micro-batch-size 16 --cuda-graphs on"
    [default_16]="--template default --max-new-tokens 16 --micro-batch-size 16 --cuda-graphs on"
    [terse_32]="--template terse --max-new-tokens 32 --micro-batch-size 16 --cuda-graphs on"
    [micro64]="--template terse --max-new-tokens 16 --micro-batch-size 64 --minibatches 1 --cuda-graphs on"
  )
fi
for a in "${!ARMS[@]}"; do
  # shellcheck disable=SC2086
  timeout 400 "${BASE[@]}" ${ARMS[$a]} --out "$OUT/$a" > "$OUT/$a.log" 2>&1 &
done
wait
for a in "${!ARMS[@]}"; do
  echo "== $a: ${ARMS[$a]}"; tail -n 2 "$OUT/$a.log"
  python3 -c "
import json,sys
for l in open('$OUT/$a/metrics.jsonl'):
    r=json.loads(l); print(' step', r.get('step'), 'g_abs', r.get('gap/token/g_abs'), 'max_abs', r.get('gap/max_abs'), 'tokens', r.get('gap/n_tokens', r.get('gap/tokens')))
" 2>&1 | tail -3
done
