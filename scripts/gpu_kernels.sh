#!/usr/bin/env bash
# Old path of `bash scripts/gpu.sh kernels` (scripts/gpu/kernels.sh; scripts/README.md).
exec bash "$(pwd)/scripts/gpu.sh" kernels "$@"
