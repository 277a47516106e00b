"""Cross-check: checkpoint bytes vs qpass's own quantizer (run with /work/main/.venv, PYTHONPATH=/work/main/src, -B)."""
import sys, torch
from safetensors.torch import load_file
from qpass.quant.nvfp4 import nvfp4_quantize
src = load_file("/work/vllm_proto/models/smollm2_bf16/model.safetensors")
q = load_file("/work/vllm_proto/models/smollm2_qpass_nvfp4/model.safetensors")
n = bad = 0
for i in (0, 10, 29):
    for group in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)), ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",))):
        sub, names = group
        ws = [src[f"model.layers.{i}.{sub}.{s}.weight"] for s in names]
        amax = torch.stack([w.float().abs().max() for w in ws]).max()
        for s, w in zip(names, ws):
            t = nvfp4_quantize(w, amax=amax)
            b = f"model.layers.{i}.{sub}.{s}"
            ok = (torch.equal(t.codes.view(torch.uint8), q[b + ".weight"]) and
                  torch.equal(t.scales.view(torch.uint8), q[b + ".weight_scale"].view(torch.uint8)) and
                  torch.equal(t.s_dec.reshape(()).view(torch.int32), q[b + ".weight_scale_2"].view(torch.int32)))
            n += 1; bad += (not ok)
            if not ok: print("MISMATCH", b, t.codes.shape, t.codes.dtype, t.scales.dtype)
print(f"qpass quantizer vs prototype checkpoint: {n - bad}/{n} sites byte-identical")
