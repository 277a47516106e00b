"""Build a real NVIDIA ModelOpt NVFP4 export of an HF Llama directory on CPU and write its listing.

Runs in a separate venv with ``nvidia-modelopt`` (it is not a qpass dependency)::

    python3.11 -m venv /work/venv-modelopt && . /work/venv-modelopt/bin/activate
    pip install torch==2.13.0 && pip install nvidia-modelopt==0.47.0 transformers safetensors accelerate requests
    PYTHONPATH=src python scripts/modelopt_reference.py --model HF_DIR --cfg NVFP4_DEFAULT_CFG \
        --prompts 8 --out /tmp/mo_export --listing tests/data/modelopt_nvfp4_tiny_llama.json

Calibration uses the same token ids as ``qpass export`` (the first ``--prompts`` qpass probe
prompts through the tokenizer's chat template, one sequence at a time), so the ``input_scale``
bytes are comparable. The listing is :func:`qpass.checkpoint.hfdir.checkpoint_listing` plus the
versions used.

Provenance (lab file; scripts/README.md): produced `tests/data/modelopt_tiny_llama_NVFP4_DEFAULT_CFG.json` /
`tests/data/modelopt_tiny_llama_W4A16_NVFP4_CFG.json` (read by tests/test_export.py and
qpass.checkpoint.formats) and `docs/results/export/modelopt_0.47_nvfp4_default_model_listing.json`
(docs/results/export.md). Needs nvidia-modelopt, which is not a qpass dependency.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--cfg", default="NVFP4_DEFAULT_CFG", help="a modelopt.torch.quantization config name")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument("--listing", required=True)
    a = ap.parse_args()

    import modelopt
    import modelopt.torch.quantization as mtq
    import transformers
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qpass.checkpoint.hfdir import checkpoint_listing
    from qpass.prompts import encode_chat, probe_prompts

    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(a.model)
    ids = encode_chat(tok, probe_prompts(a.prompts))

    def forward_loop(m):
        with torch.no_grad():
            for i in ids:
                m(input_ids=torch.tensor([i]))

    t0 = time.perf_counter()
    model = mtq.quantize(model, getattr(mtq, a.cfg), forward_loop)
    export_hf_checkpoint(model, export_dir=a.out)
    tok.save_pretrained(a.out)
    listing = checkpoint_listing(a.out)
    listing["built_with"] = {"modelopt": modelopt.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                             "cfg": a.cfg, "calibration": f"{a.prompts} qpass probe prompts (chat template)",
                             "seconds": round(time.perf_counter() - t0, 1), "device": "cpu"}
    with open(a.listing, "w") as f:
        json.dump(listing, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {a.listing}: {len(listing['tensors'])} tensors")


if __name__ == "__main__":
    main()
