#!/usr/bin/env bash
# Role (scripts/README.md): the ONE entry point of the GPU-box launchers; produces no result itself.
#
#   [KNOB=value ...] bash scripts/gpu.sh SUBCOMMAND [ARGS]    # from the repository root, on the GPU box
#   bash scripts/gpu.sh --help                                # the subcommands (runs nothing, needs no GPU)
#
# A subcommand is one body file, scripts/gpu/<body>.sh, sourced here (with ARGS as its positional
# parameters) after the helpers below are defined; the body's header gives its knobs (environment
# variables), what it writes under $OUT and its wall time, and names the result it produced
# (Provenance). The device runner sources scripts/gpu_setup.sh first; the bodies source it again
# (gpu_setup / gpu_import_or_setup) exactly where the old gpu_*.sh launchers did. The old launcher
# paths (scripts/gpu_kernels.sh, ...) are one-line wrappers around this file.
# Exit status: the body's; 2 for a missing or unknown subcommand (message on stderr).

# name|body|what it runs (qpass modules: python -m or imported by its inline code; scripts/ files)|what it does
GPU_SUBCOMMANDS=(
  "kernels|kernels|qpass.backends.triton.selfcheck qpass.apps.cli scripts/gpu_summary.py|Triton selfcheck + qpass bench (docs/results/h200/bench.json, docs/results/h200_peers/)"
  "gemv|gemv|qpass.backends.triton.selfcheck qpass.apps.cli|small-M GEMV selfcheck rows + decode grid; PART=selfcheck|bench|all (docs/results/h200/gemv/)"
  "moe|moe|qpass.backends.triton.moe_check scripts/gpu_summary.py|grouped experts GEMM check and timing (docs/results/moe/h200/)"
  "grpo|grpo|qpass.apps.grpo.cli|GRPO arms in one process (docs/results/h200/grpo/)"
  "grpo-long|grpo_long|qpass.apps.grpo.cli scripts/grpo_long_summary.py|long GRPO runs over several calls; ARGS: speed|long|all (docs/results/h200/grpo_long_attempt1/)"
  "long-jobs|long_jobs|scripts/gpu.sh scripts/moe_study.py|background jobs across calls; ARGS: start|status|collect (docs/results/h100/grpo_long_larger/)"
  "megatron|megatron|scripts/megatron_parity.py qpass.apps.cli|Megatron learner TP=1 on CUDA (docs/results/h200/megatron/)"
  "study|study|qpass.apps.study|the QUADS study on CUDA (docs/results/h200/study.json)"
  "vllm-linear|vllm_linear|qpass.backends.vllm.plugin qpass.checkpoint.linear|the vLLM plugin's linear method on CUDA without vLLM (docs/results/vllm/h200/vllm_linear.json)"
  "cuda|cuda|qpass.apps.bench.cuda_check qpass.apps.bench.triton_selfcheck qpass.apps.bench.cuda_tables|cuda kernel backend: act checks, then (if they pass) the same-run table and the Triton selfcheck, one call (docs/results/cuda_kernels/)"
  "bf16-gap|bf16_gap|qpass.apps.grpo.cli|why the bf16 GRPO gap differs between runs; ARMSET=1|2 (docs/results/h200/bf16_gap_probe/)"
)

gpu_usage() {
  local row name body mods what
  echo "usage: [KNOB=value ...] bash scripts/gpu.sh SUBCOMMAND [ARGS]   (repository root, GPU box)"
  echo "       bash scripts/gpu.sh --help"
  echo
  echo "subcommands (knobs, outputs and wall time: the header of scripts/gpu/<body>.sh):"
  for row in "${GPU_SUBCOMMANDS[@]}"; do
    IFS='|' read -r name body mods what <<<"$row"
    what="${row#*|*|*|}"
    printf '  %-12s %s  [scripts/gpu/%s.sh; %s]\n' "$name" "$what" "$body" "$mods"
  done
}

# --- helpers the bodies call (what the old launchers repeated at their top)

# gpu_open [OUT_DEFAULT_NAME]: strict mode (unset variables and failing pipeline stages are errors),
# REPO = the repository root (the cwd), OUT (default $REPO/gpu_out) created, START = the start time
# (epoch seconds) the budgets count from. Was scripts/gpu_common.sh.
gpu_open() {
  set -u
  set -o pipefail
  REPO="$(pwd)"
  OUT="${OUT:-$REPO/${1:-gpu_out}}"
  mkdir -p "$OUT"
  START=$(date +%s)
}

# gpu_setup: the GPU box's environment (scripts/gpu_setup.sh: PYTHONPATH, carried wheels and model parts).
gpu_setup() {
  # shellcheck disable=SC1091
  source "$REPO/scripts/gpu_setup.sh"
}

# gpu_import_or_setup MODULE: gpu_setup only if MODULE is not importable yet (the device runner may have
# sourced it already), then exit 2 with a FAIL line if MODULE is still not importable.
gpu_import_or_setup() {
  if ! python3 -c "import $1" >/dev/null 2>&1; then
    [ -f "$REPO/scripts/gpu_setup.sh" ] && gpu_setup
  fi
  python3 -c "import $1" || { echo "FAIL: $1 is not importable (PYTHONPATH=${PYTHONPATH:-})"; exit 2; }
}

gpu_main() {
  local sub="${1:-}" row name body
  case "$sub" in
    -h|--help|help) gpu_usage; return 0 ;;
    "") gpu_usage >&2; echo "gpu.sh: missing SUBCOMMAND" >&2; return 2 ;;
  esac
  for row in "${GPU_SUBCOMMANDS[@]}"; do
    IFS='|' read -r name body _ <<<"$row"
    if [ "$name" = "$sub" ]; then
      GPU_BODY="$(pwd)/scripts/gpu/$body.sh"
      return 0
    fi
  done
  echo "gpu.sh: unknown subcommand '$sub' (one of: $(for row in "${GPU_SUBCOMMANDS[@]}"; do printf '%s ' "${row%%|*}"; done| sed 's/ $//'))" >&2
  echo "run 'bash scripts/gpu.sh --help' for what each does" >&2
  return 2
}

GPU_BODY=""
gpu_main "$@" || exit $?
[ -n "$GPU_BODY" ] || exit 0
shift
# shellcheck disable=SC1090
source "$GPU_BODY" "$@"
