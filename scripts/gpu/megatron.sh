#!/usr/bin/env bash
# Body of `bash scripts/gpu.sh megatron` (old path: see scripts/README.md): sourced by scripts/gpu.sh, which defines
# gpu_open / gpu_setup / gpu_import_or_setup; not run alone.
# Provenance (lab launcher for the GPU box; scripts/README.md): produced `docs/results/h200/megatron/`
# (docs/results/megatron.md, Megatron learner on the H200).
# The Megatron-core learner on the H200 (issue 12), TP=1 with CUDA, one call, < 8 min:
#   1. logits of the Megatron GPTModel vs the HF model (fp32 and bf16), fake-quant W_hat / NVFP4
#      bytes per site vs qpass's learner QDQ (quads_nvfp4, 210 sites)  -> $OUT/megatron/parity_cuda.json
#   2. qpass grpo --learner megatron --tp 1 --device cuda: GRPO steps with the loss, backward and
#      optimizer step in Megatron, weights synced into the qpass rollout graph, bit-level parity
#      (served bytes vs exported weights and vs the learner's own fake-quant bytes) every step
#                                                                     -> $OUT/megatron/grpo/
#   $OUT/megatron/summary.txt: the numbers to look at.
#
# megatron-core is not installed on the GPU box. It travels as a wheel in .whl/ (scripts/gpu_setup.sh
# installs every .whl/*.whl into /tmp/site with --no-deps; its dependencies torch, numpy and
# packaging are there). Fetch it once on a CPU machine, in the repository root:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       megatron-core==0.16.1 -d .whl/
# (-> .whl/megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl, 2.6 MB)
# and carry ".whl" (and ".model" for the GGUF parts, as for the other gpu_*.sh scripts).
#
# Knobs (environment): STEPS (2) PROMPTS (4) GROUP (4) MAX_NEW (24) PARITY_S (270) GRPO_S (170)
#   DEVICE (cuda; "cpu" for a dry run of the same steps)
gpu_open
mkdir -p "$OUT/megatron"
if ! python3 -c "import qpass, megatron.core" >/dev/null 2>&1; then
  [ -f "$REPO/scripts/gpu_setup.sh" ] && gpu_setup
fi
python3 -c "import megatron.core; print('megatron-core', megatron.core.__version__)" 2>&1 | tee "$OUT/megatron/env.txt" \
  || { echo "FAIL: megatron.core is not importable: put the cp312 megatron_core-0.16.1 wheel in .whl/ (see the header)"; exit 2; }
MODEL="${QPASS_MODEL:-default}"
DEVICE="${DEVICE:-cuda}" STEPS="${STEPS:-2}" PROMPTS="${PROMPTS:-4}" GROUP="${GROUP:-4}" MAX_NEW="${MAX_NEW:-24}"

echo "== 1. parity (TP=1, $DEVICE)"
timeout "${PARITY_S:-270}" python3 "$REPO/scripts/megatron_parity.py" --model "$MODEL" --device "$DEVICE" --tp 1 \
  --out "$OUT/megatron" 2>&1 | grep -v -i "warn" | tee "$OUT/megatron/parity.log"
echo "parity exit: ${PIPESTATUS[0]}" | tee -a "$OUT/megatron/parity.log"

echo "== 2. qpass grpo --learner megatron --tp 1 --device $DEVICE"
timeout "${GRPO_S:-170}" python3 -m qpass.apps.cli grpo --recipe quads_nvfp4 --model "$MODEL" --device "$DEVICE" \
  --learner megatron --tp 1 --steps "$STEPS" --prompts-per-step "$PROMPTS" --group-size "$GROUP" \
  --max-new-tokens "$MAX_NEW" --eval-every 0 --diag-every 0 --bitexact-every 1 --no-progress --no-plots \
  --out "$OUT/megatron/grpo" --overwrite 2>&1 | grep -v -i "warn" | tee "$OUT/megatron/grpo.log"
echo "grpo exit: ${PIPESTATUS[0]}" | tee -a "$OUT/megatron/grpo.log"

python3 - "$OUT/megatron" "$DEVICE" <<'PY' | tee "$OUT/megatron/summary.txt"
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
p = d / f"parity_{sys.argv[2]}.json"
if p.is_file():
    r = json.loads(p.read_text())
    for dt, per in r["logits"].items():
        print(f"logits {dt}: max|dlogit| mcore vs HF (TP=1, {sys.argv[2]}) = {per['tp1_vs_hf']['max_abs']:.3g} "
              f"(mean {per['tp1_vs_hf']['mean_abs']:.3g})")
    fq = r.get("fake_quant", {})
    print(f"fake-quant sites identical (of {fq.get('sites')}): {fq.get('identical')}")
    print(f"fake-quant logits mcore vs qpass learner graph (bf16): {fq.get('tp1_vs_qpass_learner_graph', {}).get('max_abs')}")
else:
    print(f"no {p.name}")
m = d / "grpo" / "metrics.jsonl"
if m.is_file():
    for line in m.read_text().splitlines():
        row = json.loads(line)
        print(f"grpo step {row['step']}: served_ok={row.get('parity/served_ok')} ({row.get('parity/served_checked')} sites) "
              f"learner_bytes_ok={row.get('parity/learner_bytes_ok')} ({row.get('parity/learner_bytes_checked')}) "
              f"fp_ok={row.get('parity/fp_ok')} bitexact_ok={row.get('parity/bitexact_ok')} "
              f"loss={row.get('loss/loss')} grad_norm={row.get('opt/grad_norm')} G_abs={row.get('gap/token/g_abs')}")
    s = json.loads((d / "grpo" / "summary.json").read_text())
    print("grpo parity_all_steps_ok:", s.get("parity_all_steps_ok"), "steps:", s.get("steps_done"))
else:
    print("no grpo metrics (see grpo.log)")
PY
