#!/usr/bin/env bash
# Body of `bash scripts/gpu.sh long-jobs` (old path: see scripts/README.md): sourced by scripts/gpu.sh, which defines
# gpu_open / gpu_setup / gpu_import_or_setup; not run alone.
# Provenance (lab launcher for the GPU box; scripts/README.md): ran the background jobs behind
# `docs/results/h100/grpo_long_larger/` and `docs/results/h100/weight_qdq_speed.json` (docs/results/grpo.md,
# long jobs).
# Long jobs on the GPU box that outlive one device call (each call <= 10 min): started in their own
# process session (setsid), so they keep running between the calls of one warm lease, and collected
# by a later call into one archive under $OUT (a call brings back at most 8 files).
#
#   bash scripts/gpu.sh long-jobs start      # launch the jobs below in the background, return at once
#   bash scripts/gpu.sh long-jobs status     # one line per job: running / exit code, last log line
#   bash scripts/gpu.sh long-jobs collect    # status, then $OUT/long_jobs.tgz (logs, run dirs; no checkpoints)
#
# Jobs (JOBS, comma list; default grpo,moe):
#   grpo  gpu.sh grpo-long long with RECIPES (default qat_only,quads_nvfp4,naive_nvfp4), STEPS
#         (150), SEG_S (900: training seconds), HARD_S (SEG_S + 60), one process per recipe; the
#         other knobs as that script's header (task, seed, minibatches ... unchanged)
#   moe   scripts/moe_study.py on moe-default, all 30 layers quantized, --device cuda --kernels triton,
#         MOE_PROMPTS (4) x MOE_SAMPLES (2) x MOE_NEW (16) tokens: the probe of the layers-0-5 CPU study
# State: $BG (default /tmp/qp_bg): <job>.log, <job>.rc (exit code once finished), grpo/ and moe/ outputs.
set -u
MODE="${1:-status}"
REPO="$(pwd)"
BG="${BG:-/tmp/qp_bg}"
JOBS="${JOBS:-grpo,moe}"
mkdir -p "$BG"
gpu_setup > "$BG/setup_$(date +%s).log" 2>&1
unset TRITON_INTERPRET

launch() {  # launch NAME CMD...: NAME.log, NAME.rc written when it ends
  local name="$1"; shift
  if [ -f "$BG/$name.pid" ] && kill -0 "$(cat "$BG/$name.pid")" 2>/dev/null; then
    echo "gpu_long_jobs: $name already running (pid $(cat "$BG/$name.pid"))"; return
  fi
  rm -f "$BG/$name.rc"
  setsid nohup bash -c '"$@" > "'"$BG/$name.log"'" 2>&1; echo $? > "'"$BG/$name.rc"'"' _ "$@" < /dev/null > /dev/null 2>&1 &
  echo $! > "$BG/$name.pid"
  echo "gpu_long_jobs: started $name (pid $!): $*"
}

status() {
  local j
  for j in ${JOBS//,/ }; do
    if [ -f "$BG/$j.rc" ]; then echo "$j: finished, exit $(cat "$BG/$j.rc")"
    elif [ -f "$BG/$j.pid" ]; then echo "$j: running (pid $(cat "$BG/$j.pid"))"
    else echo "$j: not started"; fi
    [ -f "$BG/$j.log" ] && tail -n 2 "$BG/$j.log" | cut -c1-240
  done
}

case "$MODE" in
  start)
    [ -n "${QPASS_DEFAULT_GGUF:-}" ] || { echo "gpu_long_jobs: the default GGUF is not complete on this machine yet (carry the model parts)"; exit 2; }
    SEG_S="${SEG_S:-900}"
    for j in ${JOBS//,/ }; do
      case "$j" in
        grpo) launch grpo env OUT="$BG/grpo" CKPT_DIR="$BG/grpo_ckpt" STEPS="${STEPS:-150}" SEG_S="$SEG_S" \
                HARD_S="${HARD_S:-$((SEG_S + 60))}" RECIPES="${RECIPES:-qat_only,quads_nvfp4,naive_nvfp4}" PARALLEL=1 \
                bash "$REPO/scripts/gpu.sh" grpo-long long ;;
        moe) launch moe python3 "$REPO/scripts/moe_study.py" --out "$BG/moe" --device cuda --kernels triton \
               --prompts "${MOE_PROMPTS:-4}" --samples "${MOE_SAMPLES:-2}" --max-new-tokens "${MOE_NEW:-16}" ;;
        *) echo "gpu_long_jobs: unknown job $j"; exit 2 ;;
      esac
    done ;;
  status) status ;;
  collect)
    status
    OUT="${OUT:-$REPO/gpu_out}"; mkdir -p "$OUT"
    tar czf "$OUT/long_jobs.tgz" -C "$BG" --exclude='grpo_ckpt' --exclude='*.pt' . && ls -la "$OUT/long_jobs.tgz" ;;
  *) echo "usage: bash scripts/gpu.sh long-jobs start|status|collect"; exit 2 ;;
esac
