#!/usr/bin/env bash
# Body of `bash scripts/gpu.sh study` (old path: see scripts/README.md): sourced by scripts/gpu.sh, which defines
# gpu_open / gpu_setup / gpu_import_or_setup; not run alone.
# Provenance (lab launcher for the GPU box; scripts/README.md): produced `docs/results/h200/study.json` /
# `docs/results/h200/study.md` (docs/results/quads_study.md, QUADS study on the H200).
# QUADS study (qpass study) on the H200: the full ablation set on CUDA, <= 5 min wall time.
#
# Run from the repository root on the GPU box. qpass is not installed there: if `qpass.apps.study` is not
# importable, scripts/gpu_setup.sh (the import shim) is sourced. The model is $QPASS_MODEL (a .gguf
# path; "default" if unset).
#
# Writes $OUT/study/ (study.json, study.md, gap_vs_k.png, layerwise.png, operand_ablation.png;
# the directory appears only when the study completed: it is built in a temp dir and renamed) and
# $OUT/study.log.
#
# Wall time: a Triton preflight (<= 60 s; falls back to the reference kernels if the Triton backend
# does not import or disagrees with the reference on one W4A4+RAC linear), then the study with
# --budget-s = what is left of $TOTAL_S (default 285 s) minus a 40 s margin for the RAC-cost timing
# tail, plots and writing. The budget covers model load and capture; RAC configurations not started
# before it runs out are recorded as skipped (the paper's k = 50% runs first, then 100%, 25%, 75%,
# 12.5%). A hard stop (SIGINT) at the remaining $TOTAL_S bounds the worst case.
#
# Knobs (environment): PROMPTS (24) MAX_NEW (32) BATCH (24) SEED (0) KERNELS (auto) TOTAL_S (285)
#   RATIOS (0,12.5,25,50,75,100) EXTRA (extra CLI arguments)
gpu_open
LOG="$OUT/study.log"

gpu_import_or_setup qpass.apps.study
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 PYTHONUNBUFFERED=1

MODEL="${QPASS_MODEL:-default}"
PROMPTS="${PROMPTS:-24}"
MAX_NEW="${MAX_NEW:-32}"
BATCH="${BATCH:-24}"
SEED="${SEED:-0}"
TOTAL_S="${TOTAL_S:-285}"
RATIOS="${RATIOS:-0,12.5,25,50,75,100}"
EXTRA="${EXTRA:-}"

if [ -z "${KERNELS:-}" ]; then
  # Triton only if it imports on CUDA and one W4A4+RAC linear agrees with the reference semantics.
  if timeout 60 python3 - >>"$LOG" 2>&1 <<'PY'
import sys, torch
assert torch.cuda.is_available(), "no CUDA device"
from qpass import ops
from qpass.quant.nvfp4 import nvfp4_quantize
g = torch.Generator(device="cuda").manual_seed(0)
w = (torch.randn(1536, 576, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
x = (torch.randn(48, 576, device="cuda", generator=g) * torch.exp(torch.randn(576, device="cuda", generator=g))).to(torch.bfloat16)
q = nvfp4_quantize(w)
outs = {}
for backend in ("reference", "triton"):
    with ops.use_kernels(backend):
        for mode in ("masked", "gathered"):
            outs[backend, mode] = torch.ops.qpass.nvfp4_linear(x, q.codes, q.scales, q.s_dec, None, "preflight", "nvfp4",
                                                               0.5, mode, "batch", None).float()
for mode in ("masked", "gathered"):
    r, t = outs["reference", mode], outs["triton", mode]
    rel = float((r - t).norm() / r.norm())
    print(f"preflight {mode}: rel diff triton vs reference {rel:.2e}")
    assert torch.isfinite(t).all() and rel < 1e-2, mode
PY
  then KERNELS=triton; else KERNELS=reference; fi
fi

NOW=$(date +%s)
LEFT=$(( TOTAL_S - (NOW - START) ))
BUDGET=$(( LEFT - 40 ))
[ "$BUDGET" -lt 60 ] && BUDGET=60
echo "gpu_study: model=$MODEL kernels=$KERNELS prompts=$PROMPTS max_new=$MAX_NEW batch=$BATCH seed=$SEED" \
     "ratios=$RATIOS budget=${BUDGET}s hard=${LEFT}s out=$OUT/study" | tee -a "$LOG"

# shellcheck disable=SC2086
timeout -s INT -k 10 "$LEFT" python3 -m qpass.apps.study \
  --model "$MODEL" --device cuda --kernels "$KERNELS" --out "$OUT/study" --force --no-progress \
  --prompts "$PROMPTS" --max-new-tokens "$MAX_NEW" --batch-size "$BATCH" --seed "$SEED" \
  --ratios "$RATIOS" --budget-s "$BUDGET" $EXTRA 2>&1 | tee -a "$LOG"
RC=${PIPESTATUS[0]}
echo "gpu_study: exit status $RC after $(( $(date +%s) - START )) s" | tee -a "$LOG"
if [ -f "$OUT/study/study.md" ]; then
  sed -n '/## 7. Paper claims/,$p' "$OUT/study/study.md" | tee -a "$LOG"
fi
ls -la "$OUT/study" 2>&1 | tee -a "$LOG"
exit "$RC"
