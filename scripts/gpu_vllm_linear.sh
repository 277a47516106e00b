#!/usr/bin/env bash
# Old path of `bash scripts/gpu.sh vllm-linear` (scripts/gpu/vllm_linear.sh; scripts/README.md).
exec bash "$(pwd)/scripts/gpu.sh" vllm-linear "$@"
