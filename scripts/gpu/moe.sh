#!/usr/bin/env bash
# Body of `bash scripts/gpu.sh moe` (old path: see scripts/README.md): sourced by scripts/gpu.sh, which defines
# gpu_open / gpu_setup / gpu_import_or_setup; not run alone.
# Provenance (lab launcher for the GPU box; scripts/README.md): produced `docs/results/moe/h200/`
# (docs/results/moe.md and docs/DESIGN.md, MoE).
# GPU run of the grouped NVFP4 experts GEMM (issue 15): bit-identity checks, then timing at
# QUADS-like expert shapes (H 2048, I 1024, E 64 local experts, top-8, T in {16, 512, 4096}).
#
# Run from the repository root on the GPU box (python3 with torch + triton; qpass need not be
# installed; no model, no transformers needed). Writes to $OUT (default ./gpu_out):
#   env.txt  moe_check.log  moe_check.json  summary.md
# Wall time < 5 min by construction: checks then timing, the timing loop stops starting new shapes
# 220 s after the start (--budget-s, checks included) and the whole command is killed at 285 s.
# Look for: every line PASS (operands bit-exact vs the reference quantizer, grouped == each expert
# alone in bits, rel_fro < 1e-5), and in the timing table grouped_gemm_rac_operands_ready /
# grouped_w4a4_rac_end_to_end vs per_expert_w4a4_rac_loop and bf16_per_expert_mm_loop.
gpu_open
gpu_setup
unset TRITON_INTERPRET
{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  python3 -c "import platform, torch, triton; print('python', platform.python_version(), 'torch', torch.__version__, 'triton', triton.__version__)" 2>&1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
echo "=== grouped experts GEMM: checks + timing ==="
timeout -k 10 285 python3 -m qpass.backends.triton.moe_check --out "$OUT/moe_check.json" --budget-s 220 2>&1 | tee "$OUT/moe_check.log"
RC=$?
[ $RC -ne 0 ] && echo "!!! MOE CHECK FAILED OR TIMED OUT (rc=$RC) -- see moe_check.log" | tee -a "$OUT/moe_check.log"
python3 "$REPO/scripts/gpu_summary.py" moe "$OUT" "$RC" "$START" 2>&1 | tee "$OUT/summary.md"
[ $RC -eq 0 ]
