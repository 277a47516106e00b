#!/usr/bin/env bash
# Body of `bash scripts/gpu.sh grpo` (old path: see scripts/README.md): sourced by scripts/gpu.sh, which defines
# gpu_open / gpu_setup / gpu_import_or_setup; not run alone.
# Provenance (lab launcher for the GPU box; scripts/README.md): produced `docs/results/h200/grpo/`
# (docs/results/grpo.md, GRPO on the H200).
# GRPO on the H200: bf16, naive_nvfp4, w4a16_qat, quads_nvfp4 and fp8_block with the same seed,
# prompts, sampling seeds and budget, in ONE process (model loaded and both graphs captured once).
#
# Run from the repository root on the GPU box after the import shim (scripts/gpu_setup.sh, sourced
# here if qpass is not importable yet). The model is $QPASS_MODEL (a .gguf path; "default" if unset).
#
# Writes under $OUT (default ./gpu_out):
#   grpo/<recipe>/            one complete run directory per recipe (config.json, metrics.jsonl,
#                             eval.jsonl, layerwise.jsonl, summary.json, plots.png); a recipe stopped
#                             by Ctrl-C / the hard timeout leaves grpo/<recipe>.partial instead
#   grpo/overlay.png          gap / max|d| / reward / eval accuracy vs step, all recipes
#   grpo_overlay.png          the same figure at the top of $OUT
#   grpo_diagnostics.png      shadow gap, clip-branch disagreement, update visibility, entropy
#   grpo.log, grpo_summary.md
#
# Wall time: the run gets --total-time-s $BUDGET_S (default 420 s, model load and capture
# included) split evenly over the recipes still to run; each recipe stops cleanly (final parity
# check, eval and probe included) before a step that would overrun its share. A hard stop
# (SIGINT at $HARD_S, default 465 s) bounds the worst case; plots and the summary take seconds.
# Total < 8 min.
#
# Knobs (environment): STEPS (12) PROMPTS (8) GROUP (8) MAX_NEW (32) LR (3e-5) DIFFICULTY (2)
#   SEED (0) KERNELS (triton if it imports on a CUDA device, else reference) BUDGET_S (420)
#   HARD_S (465) CORRECTION (is) EVAL_PROMPTS (64) RECIPES (the five above, comma-separated)
#   DEVICE (cuda; "cpu" for a dry run) EXTRA (extra CLI arguments, e.g. "--beta 0.01")
gpu_open

gpu_import_or_setup qpass.apps.grpo.cli

MODEL="${QPASS_MODEL:-default}"
STEPS="${STEPS:-12}"
PROMPTS="${PROMPTS:-8}"
GROUP="${GROUP:-8}"
MAX_NEW="${MAX_NEW:-32}"
LR="${LR:-3e-5}"
DIFFICULTY="${DIFFICULTY:-2}"
SEED="${SEED:-0}"
BUDGET_S="${BUDGET_S:-420}"
HARD_S="${HARD_S:-465}"
CORRECTION="${CORRECTION:-is}"  # the old runs' setting: untruncated p_prox/q (called "none" before issue 13)
EVAL_PROMPTS="${EVAL_PROMPTS:-64}"
DEVICE="${DEVICE:-cuda}"
EXTRA="${EXTRA:-}"
if [ -z "${KERNELS:-}" ]; then
  if python3 -c "import torch, qpass.backends.triton; assert torch.cuda.is_available()" >/dev/null 2>&1; then
    KERNELS=triton
  else
    KERNELS=reference
  fi
fi
RECIPES="${RECIPES:-bf16,naive_nvfp4,w4a16_qat,quads_nvfp4,fp8_block}"
BATCH=$(( PROMPTS * GROUP ))
[ "$BATCH" -gt 64 ] && BATCH=64

echo "gpu_grpo: model=$MODEL device=$DEVICE recipes=$RECIPES kernels=$KERNELS steps=$STEPS prompts=$PROMPTS group=$GROUP max_new=$MAX_NEW lr=$LR" \
     "difficulty=$DIFFICULTY seed=$SEED budget=${BUDGET_S}s hard=${HARD_S}s out=$OUT" | tee "$OUT/grpo.log"
rm -rf "$OUT/grpo"

# One process, five recipes. --keep-partial: a recipe interrupted by the hard stop keeps its rows.
# Diagnostics cadence: layer-wise probe + decoded visibility before step 1 and on the last step;
# eval before step 1, every 4 steps and on the last step; full bit-exact parity before step 1 and
# on the last step (the three-way sync fingerprint check runs after every step).
# shellcheck disable=SC2086
timeout -s INT -k 15 "$HARD_S" python3 -m qpass.apps.grpo.cli grpo \
  --recipe "$RECIPES" --model "$MODEL" --device "$DEVICE" --kernels "$KERNELS" \
  --steps "$STEPS" --seed "$SEED" --out "$OUT/grpo" --overwrite --keep-partial --no-progress \
  --prompts-per-step "$PROMPTS" --group-size "$GROUP" --max-new-tokens "$MAX_NEW" --batch-size "$BATCH" \
  --lr "$LR" --difficulty "$DIFFICULTY" --correction "$CORRECTION" \
  --bitexact-every 0 --diag-every "$STEPS" --eval-every 4 --eval-prompts "$EVAL_PROMPTS" \
  --total-time-s "$BUDGET_S" $EXTRA 2>&1 | tee -a "$OUT/grpo.log"
RC=${PIPESTATUS[0]}
echo "gpu_grpo: grpo exit status $RC after $(( $(date +%s) - START )) s" | tee -a "$OUT/grpo.log"

RUNS=()
for r in ${RECIPES//,/ }; do
  if [ -f "$OUT/grpo/$r/metrics.jsonl" ]; then RUNS+=("$OUT/grpo/$r")
  elif [ -f "$OUT/grpo/$r.partial/metrics.jsonl" ]; then RUNS+=("$OUT/grpo/$r.partial"); fi
done
if [ "${#RUNS[@]}" -gt 0 ]; then
  python3 -m qpass.apps.grpo.cli grpo-plot "${RUNS[@]}" --out "$OUT/grpo_overlay.png" \
    --title "GRPO ($MODEL, $KERNELS kernels, seed $SEED)" 2>&1 | tee -a "$OUT/grpo.log"
  python3 -m qpass.apps.grpo.cli grpo-plot "${RUNS[@]}" --out "$OUT/grpo_diagnostics.png" \
    --metric shadow_gap/token/g_abs --metric clip/frac --metric vis/code_frac --metric entropy/token_mean \
    --metric gap/token/k3 --metric rollout/tokens_per_s 2>&1 | tee -a "$OUT/grpo.log"
  python3 - "$OUT" "${RUNS[@]}" <<'PY' 2>&1 | tee -a "$OUT/grpo.log"
import json, math, sys
from pathlib import Path
from qpass.apps.grpo.jsonl import read_jsonl

out, runs = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
def mean(xs):
    v = [x for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)]
    return sum(v) / len(v) if v else None
fmt = lambda v: "n/a" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
lines = ["| recipe | steps | stop | mean G_abs | mean max abs d | mean shadow G_abs | mean clip disagreement | "
         "reward first->last | eval acc first->last | parity every step | tok/s |",
         "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
for d in runs:
    rows = read_jsonl(d / "metrics.jsonl")
    ev = read_jsonl(d / "eval.jsonl") if (d / "eval.jsonl").is_file() else []
    s = json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else {}
    col = lambda k: [r.get(k) for r in rows]  # noqa: E731
    par = all(r.get("parity/fp_ok") for r in rows) and all(r.get("parity/bitexact_ok", True) for r in rows)
    rw = col("reward/mean")
    lines.append(f"| {d.name} | {len(rows)} | {s.get('stop_reason', 'partial')} | {fmt(mean(col('gap/token/g_abs')))} | "
                 f"{fmt(mean(col('gap/max_abs')))} | {fmt(mean(col('shadow_gap/token/g_abs')))} | {fmt(mean(col('clip/frac')))} | "
                 f"{fmt(rw[0] if rw else None)} -> {fmt(rw[-1] if rw else None)} | "
                 f"{fmt(ev[0].get('eval/accuracy') if ev else None)} -> {fmt(ev[-1].get('eval/accuracy') if ev else None)} | "
                 f"{par} | {fmt(mean(col('rollout/tokens_per_s')))} |")
(out / "grpo_summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
fi
echo "gpu_grpo: done in $(( $(date +%s) - START )) s (exit $RC); files:" | tee -a "$OUT/grpo.log"
ls -la "$OUT" "$OUT/grpo" 2>&1 | tee -a "$OUT/grpo.log"
exit "$RC"
