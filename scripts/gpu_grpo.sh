#!/usr/bin/env bash
# Old path of `bash scripts/gpu.sh grpo` (scripts/gpu/grpo.sh; scripts/README.md).
exec bash "$(pwd)/scripts/gpu.sh" grpo "$@"
