#!/usr/bin/env bash
# Old path of `bash scripts/gpu.sh long-jobs` (scripts/gpu/long_jobs.sh; scripts/README.md).
exec bash "$(pwd)/scripts/gpu.sh" long-jobs "$@"
