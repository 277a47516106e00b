"""FusedMoE layout of the moe-default rollout checkpoint written by qpass apply (output: fused_moe_export_check.txt).

    python docs/results/moe/fused_moe_export_check.py out/moe_apply/rollout/weights.safetensors
"""
import sys

import torch
from safetensors.torch import load_file

from qpass.moe.export import fused_moe_params, unfuse_moe_params

t = load_file(sys.argv[1])
f = fused_moe_params(t)
layers = sorted({k.rsplit(".experts.", 1)[0] for k in f})
g = torch.stack([f[l + ".experts.w13_weight_scale_2"] for l in layers])  # [L, E, 2]
same = torch.equal(g[..., 0].view(torch.int32), g[..., 1].view(torch.int32))
back = unfuse_moe_params(f)
keys = [k for k in t if ".experts." in k and not k.endswith("weight_global_scale")]
rt = all(torch.equal(t[k].reshape(-1).view(torch.uint8), back[k].reshape(-1).view(torch.uint8)) for k in keys)
p = layers[0] + ".experts."
print("source: qpass apply recipes/quads_nvfp4_moe.yaml --model moe-default (rollout/weights.safetensors)")
print("moe layers:", len(layers), "experts per layer:", g.shape[1])
print("shapes:", {n: tuple(f[p + n].shape) for n in ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight", "w2_weight_scale", "w2_weight_scale_2")})
print("w13_weight_scale_2[:, 0] == [:, 1] (bits) for all", g.shape[0] * g.shape[1], "experts:", same)
print("per-expert tensors round-trip bit-exact through the fused layout:", rt, f"({len(keys)} tensors)")
