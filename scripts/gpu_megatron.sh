#!/usr/bin/env bash
# Old path of `bash scripts/gpu.sh megatron` (scripts/gpu/megatron.sh; scripts/README.md).
exec bash "$(pwd)/scripts/gpu.sh" megatron "$@"
