#!/usr/bin/env bash
# Old path of `bash scripts/gpu.sh grpo-long` (scripts/gpu/grpo_long.sh; scripts/README.md).
exec bash "$(pwd)/scripts/gpu.sh" grpo-long "$@"
