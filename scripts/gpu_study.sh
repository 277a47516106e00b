#!/usr/bin/env bash
# Old path of `bash scripts/gpu.sh study` (scripts/gpu/study.sh; scripts/README.md).
exec bash "$(pwd)/scripts/gpu.sh" study "$@"
