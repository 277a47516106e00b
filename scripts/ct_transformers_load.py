"""Load a compressed-tensors export in transformers (run_compressed=False: decompressed weights) and count the
bf16 weights that differ from qpass.nvfp4_dequantize of a qpass/modelopt export of the same rollout.

    PYTHONPATH=src python scripts/ct_transformers_load.py CT_DIR QPASS_OR_MODELOPT_DIR

Provenance (lab file; scripts/README.md): produced
`docs/results/export/default_compressed_tensors_transformers_load.txt`, cited in docs/results/export.md.
"""
import sys, torch
from transformers import AutoModelForCausalLM
from transformers.utils.quantization_config import CompressedTensorsConfig
from safetensors.torch import load_file
from qpass.checkpoint.hfdir import read_hf_tensors
from qpass.quant.nvfp4 import NVFP4Tensor, nvfp4_dequantize
d, ref = sys.argv[1], sys.argv[2]  # CT export, qpass export of the same rollout
m = AutoModelForCausalLM.from_pretrained(d, quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
print(type(m).__name__, m.dtype)
sd = m.state_dict()
q = read_hf_tensors(ref)
sites = sorted(k[:-len(".weight_scale_2")] for k in q if k.endswith(".weight_scale_2"))
tot = bad = 0
for s in sites:
    w = sd[f"{s}.weight"]
    codes, sc, sdec = q[f"{s}.weight"], q[f"{s}.weight_scale"], q[f"{s}.weight_scale_2"]
    mine = nvfp4_dequantize(NVFP4Tensor.from_parts(codes, sc, sdec), torch.bfloat16)
    diff = (w.view(torch.int16) != mine.view(torch.int16))
    tot += diff.numel(); bad += int(diff.sum())
print("sites", len(sites), "elements", tot, "differ", bad)
