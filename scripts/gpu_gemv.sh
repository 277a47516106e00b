#!/usr/bin/env bash
# Old path of `bash scripts/gpu.sh gemv` (scripts/gpu/gemv.sh; scripts/README.md).
exec bash "$(pwd)/scripts/gpu.sh" gemv "$@"
