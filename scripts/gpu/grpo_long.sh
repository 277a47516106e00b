#!/usr/bin/env bash
# Body of `bash scripts/gpu.sh grpo-long` (old path: see scripts/README.md): sourced by scripts/gpu.sh, which defines
# gpu_open / gpu_setup / gpu_import_or_setup; not run alone.
# Provenance (lab launcher for the GPU box; scripts/README.md): produced
# `docs/results/h200/grpo_long_attempt1/` and `docs/results/h100/grpo_long_larger/` (docs/results/grpo.md, long
# runs).
# Long GRPO runs on the H200 (issue 13): rollout speed with/without CUDA graphs, then bf16,
# naive_nvfp4, qat_only and quads_nvfp4 trained for $STEPS steps each, same seed, chained over
# several calls of this script through checkpoints that stay on the (warm) GPU machine.
#
# Run from the repository root on the GPU box (scripts/gpu_setup.sh is sourced if qpass is not
# importable). Every call stays under 9 minutes; call it again (same environment) to continue:
#
#   bash scripts/gpu.sh grpo-long speed     # (a) steps/s, CUDA graphs off vs on, 128 seqs x 64 tokens (~3 min)
#   bash scripts/gpu.sh grpo-long long      # (b) one segment of every unfinished recipe (<= SEG_S s), resumable
#   bash scripts/gpu.sh grpo-long all       # speed, then one long segment within the same 9 minutes (SEG_S shrinks)
#
# State between calls: $CKPT_DIR (default $REPO/.device_out/grpo_long_ckpt, git-ignored, kept on
# a warm machine): one <recipe>.ckpt directory per run (model, AdamW, RNG, step, every metric row so far; manifest-verified).
# Each call writes the complete runs so far under $OUT (fresh per call), so whatever call is the
# last, $OUT holds the metrics of the whole chain:
#   speed/{off,on}/<recipe>/   run dirs of the speed probe; speed.json: steps/s off vs on
#   long/<recipe>/             run dir (config.json, metrics.jsonl, eval.jsonl, summary.json, plots)
#   long_quads.png             QUADS Fig. 1/6 curves, all recipes (grpo-plot --preset quads)
#   long_overlay.png           gap / max|d| / reward / eval overlay
#   long_summary.md / .json    one row per recipe incl. the collapse verdict / observation limit
#   grpo_long.log
#
# Knobs (environment): STEPS (150, the runs' total) SEG_S (450: training seconds per call, split
#   over the unfinished recipes) HARD_S (525: hard stop of the grpo process) RECIPES
#   (bf16,naive_nvfp4,qat_only,quads_nvfp4) PROMPTS (8) GROUP (8) MAX_NEW (16) LR (3e-5)
#   TASK (larger) TEMPLATE (larger_fewshot) TEMPERATURE (0.7) REWARD (first): the calibration of
#   docs/results/grpo.md that meets the W4A4 step-0 reward target ("Which is larger,
#   47 or 52?" after two worked examples, exact match of the response's first integer);
#   DIFFICULTY (2) and OPERATORS (empty: the preset's) apply to TASK=arithmetic only (the earlier
#   default was TASK=arithmetic DIFFICULTY=2 OPERATORS=+ TEMPLATE=terse TEMPERATURE=1.0 REWARD=exact) SEED (0) RATIO (coupled) CORRECTION (none) MINIBATCHES (4) EPOCHS (1)
#   MICRO (16: learner rows per forward; MINIBATCHES needs PROMPTS*GROUP/MICRO >= MINIBATCHES)
#   PARALLEL (1: one grpo process per recipe, all on the one GPU, each with the whole SEG_S; 0: one
#   process, SEG_S split over the recipes) EVAL_PROMPTS (400) EVAL_EVERY (10) KERNELS (triton if importable, else reference)
#   SPEED_RECIPES (bf16,quads_nvfp4) SPEED_STEPS (3) CKPT_DIR DEVICE (cuda) EXTRA
MODE="${1:-all}"
gpu_open
LOG="$OUT/grpo_long.log"

gpu_import_or_setup qpass.apps.grpo.cli

MODEL="${QPASS_MODEL:-default}"
STEPS="${STEPS:-150}"; SEG_S="${SEG_S:-450}"; HARD_S="${HARD_S:-525}"
RECIPES="${RECIPES:-bf16,naive_nvfp4,qat_only,quads_nvfp4}"
PROMPTS="${PROMPTS:-8}"; GROUP="${GROUP:-8}"; MAX_NEW="${MAX_NEW:-16}"; LR="${LR:-3e-5}"
TASK="${TASK:-larger}"; DIFFICULTY="${DIFFICULTY:-2}"; OPERATORS="${OPERATORS:-}"; TEMPLATE="${TEMPLATE:-larger_fewshot}"
TEMPERATURE="${TEMPERATURE:-0.7}"; REWARD="${REWARD:-first}"
TASK_ARGS=(--task "$TASK" --difficulty "$DIFFICULTY" --reward "$REWARD")
[ -n "$OPERATORS" ] && TASK_ARGS+=(--operators "$OPERATORS")
SEED="${SEED:-0}"; RATIO="${RATIO:-coupled}"; CORRECTION="${CORRECTION:-none}"; MICRO="${MICRO:-16}"; PARALLEL="${PARALLEL:-1}"
MINIBATCHES="${MINIBATCHES:-4}"; EPOCHS="${EPOCHS:-1}"; EVAL_PROMPTS="${EVAL_PROMPTS:-400}"; EVAL_EVERY="${EVAL_EVERY:-10}"
SPEED_RECIPES="${SPEED_RECIPES:-bf16,quads_nvfp4}"; SPEED_STEPS="${SPEED_STEPS:-3}"
CKPT_DIR="${CKPT_DIR:-$REPO/.device_out/grpo_long_ckpt}"
DEVICE="${DEVICE:-cuda}"; EXTRA="${EXTRA:-}"
if [ -z "${KERNELS:-}" ]; then
  if python3 -c "import torch, qpass.backends.triton; assert torch.cuda.is_available()" >/dev/null 2>&1; then KERNELS=triton; else KERNELS=reference; fi
fi
GRPO=(python3 -m qpass.apps.grpo.cli grpo --model "$MODEL" --device "$DEVICE" --kernels "$KERNELS" --seed "$SEED" --no-progress)
echo "gpu_grpo_long: mode=$MODE model=$MODEL kernels=$KERNELS steps=$STEPS recipes=$RECIPES prompts=$PROMPTS group=$GROUP" \
     "max_new=$MAX_NEW lr=$LR task=$TASK template=$TEMPLATE temperature=$TEMPERATURE reward=$REWARD difficulty=$DIFFICULTY ratio=$RATIO correction=$CORRECTION minibatches=$MINIBATCHES" \
     "epochs=$EPOCHS ckpt=$CKPT_DIR" | tee -a "$LOG"
RC=0

speed() {
  # (a) GRPO steps/s at 128 sequences x 64 tokens, decode eager vs CUDA graphs, same seeds
  for cg in off on; do
    # shellcheck disable=SC2086
    timeout -s INT -k 10 230 "${GRPO[@]}" --recipe "$SPEED_RECIPES" --steps "$SPEED_STEPS" --out "$OUT/speed/$cg" --overwrite \
      --prompts-per-step 16 --group-size 8 --max-new-tokens 64 --batch-size 128 --lr "$LR" --difficulty "$DIFFICULTY" \
      --template default --n-eval 16 \
      --cuda-graphs "$cg" --eval-every 0 --diag-every 0 --bitexact-every 0 --no-initial-check --no-plots \
      --total-time-s 170 $EXTRA 2>&1 | tee -a "$LOG" || RC=1
  done
  python3 - "$OUT" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
from qpass.apps.grpo.jsonl import read_jsonl
from qpass.jsonio import write_json
out = Path(sys.argv[1]); res = {}
for cg in ("off", "on"):
    for d in sorted((out / "speed" / cg).glob("*/metrics.jsonl")):
        rows = read_jsonl(d)
        later = rows[1:] or rows  # step 1 includes the CUDA-graph capture and the first Triton compilations
        st = sum(r["time/step_s"] for r in later) / len(later)
        ro = sum(r["time/rollout_s"] for r in later) / len(later)
        res.setdefault(d.parent.name, {})[cg] = {"steps": len(rows), "mean_step_s_after_step1": st, "steps_per_s": 1 / st,
            "mean_rollout_s": ro, "decode_graph": rows[-1].get("rollout/decode_graph"),
            "tokens_per_s": sum(r["rollout/tokens_per_s"] for r in later) / len(later)}
for r, v in res.items():
    if "off" in v and "on" in v:
        v["speedup_steps_per_s"] = v["on"]["steps_per_s"] / v["off"]["steps_per_s"]
write_json(out / "speed.json", {"sequences": 128, "max_new_tokens": 64, "runs": res})
print(json.dumps(res, indent=1))
PY
}

long_args() {
  # shellcheck disable=SC2086
  echo --steps "$STEPS" --overwrite --keep-partial \
    --checkpoint-dir "$CKPT_DIR" --resume --checkpoint-every 10 \
    --prompts-per-step "$PROMPTS" --group-size "$GROUP" --max-new-tokens "$MAX_NEW" --lr "$LR" "${TASK_ARGS[@]}" \
    --template "$TEMPLATE" --temperature "$TEMPERATURE" --n-train 500 --n-eval 500 \
    --ratio "$RATIO" --correction "$CORRECTION" --minibatches "$MINIBATCHES" --ppo-epochs "$EPOCHS" \
    --micro-batch-size "$MICRO" --eval-every "$EVAL_EVERY" --eval-prompts "$EVAL_PROMPTS" --diag-every 50 --bitexact-every 50 $EXTRA
}

long() {
  local budget="$1"
  mkdir -p "$CKPT_DIR"
  if [ "$PARALLEL" = 1 ]; then
    # one process per recipe on the same GPU (the 135M model leaves it mostly idle): each gets the
    # whole budget instead of a share; CPU threads split over the processes
    local pids=() r n
    n=$(echo "${RECIPES//,/ }" | wc -w)
    for r in ${RECIPES//,/ }; do
      # shellcheck disable=SC2046
      timeout -s INT -k 15 "$HARD_S" "${GRPO[@]}" --recipe "$r" --out "$OUT/long/$r" --total-time-s "$budget" \
        --threads $(( $(nproc) / n > 0 ? $(nproc) / n : 1 )) $(long_args) > "$OUT/long_$r.log" 2>&1 &
      pids+=($!)
    done
    RC=0
    for p in "${pids[@]}"; do wait "$p" || RC=1; done
    for r in ${RECIPES//,/ }; do tail -n 5 "$OUT/long_$r.log" | tee -a "$LOG"; done
  else
    # shellcheck disable=SC2046
    timeout -s INT -k 15 "$HARD_S" "${GRPO[@]}" --recipe "$RECIPES" --out "$OUT/long" --total-time-s "$budget" $(long_args) 2>&1 | tee -a "$LOG"
    RC=${PIPESTATUS[0]}
  fi
  RUNS=()
  for r in ${RECIPES//,/ }; do [ -f "$OUT/long/$r/metrics.jsonl" ] && RUNS+=("$OUT/long/$r"); done
  if [ "${#RUNS[@]}" -gt 0 ]; then
    python3 -m qpass.apps.grpo.cli grpo-plot "${RUNS[@]}" --out "$OUT/long_quads.png" --preset quads --smooth 5 \
      --title "GRPO long runs ($KERNELS, seed $SEED, ratio $RATIO)" 2>&1 | tee -a "$LOG"
    python3 -m qpass.apps.grpo.cli grpo-plot "${RUNS[@]}" --out "$OUT/long_overlay.png" --smooth 5 2>&1 | tee -a "$LOG"
    python3 "$REPO/scripts/grpo_long_summary.py" "$OUT/long_summary.md" "${RUNS[@]}" 2>&1 | tee -a "$LOG"
  fi
}

case "$MODE" in
  speed) speed ;;
  long) long "$SEG_S" ;;
  all) speed; left=$(( 480 - ($(date +%s) - START) )); [ "$left" -gt 90 ] && long "$left" ;;
  *) echo "usage: bash scripts/gpu.sh grpo-long speed|long|all"; exit 2 ;;
esac
echo "gpu_grpo_long: $MODE done in $(( $(date +%s) - START )) s (exit $RC)" | tee -a "$LOG"
ls -la "$OUT" "$CKPT_DIR" 2>&1 | tee -a "$LOG"
exit "$RC"
