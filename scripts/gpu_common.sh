#!/usr/bin/env bash
# Role (scripts/README.md): the opening lines of the gpu_*.sh launchers, sourced first (from the
# repository root); produces no result. Strict mode (unset variables and failing pipeline stages
# are errors), REPO = the repository root, OUT (default $REPO/gpu_out) created, START = the start
# time (epoch seconds) the launchers' budgets count from.
set -u
set -o pipefail
REPO="$(pwd)"
OUT="${OUT:-$REPO/gpu_out}"
mkdir -p "$OUT"
START=$(date +%s)
