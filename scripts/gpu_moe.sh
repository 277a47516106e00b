#!/usr/bin/env bash
# Old path of `bash scripts/gpu.sh moe` (scripts/gpu/moe.sh; scripts/README.md).
exec bash "$(pwd)/scripts/gpu.sh" moe "$@"
