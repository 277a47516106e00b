#!/usr/bin/env bash
# Old path of `bash scripts/gpu.sh bf16-gap` (scripts/gpu/bf16_gap.sh; scripts/README.md).
exec bash "$(pwd)/scripts/gpu.sh" bf16-gap "$@"
