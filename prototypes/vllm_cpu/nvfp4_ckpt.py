"""Minimal NVFP4 quantizer (SPEC §3) + writer of a vLLM-servable `qpass_nvfp4` checkpoint.

Standalone on purpose (no qpass import). Every op is a separately rounded fp32 torch op on CPU
(no FMA contraction in eager elementwise kernels).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from collections import OrderedDict

import torch
from safetensors.torch import load_file, save_file

FLT_MAX = torch.finfo(torch.float32).max
INV6 = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(6.0, dtype=torch.float32)  # 0x3E2AAAAB
E2M1_LUT = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                         -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)
SITES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def f32(v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def global_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """S_enc = min(fl(2688/amax), FLT_MAX) (1 if amax==0 or S_enc==0); S_dec = fl(1/S_enc)."""
    amax = amax.to(torch.float32)
    if amax.item() == 0.0:
        s_enc = f32(1.0)
    else:
        s_enc = torch.clamp(f32(2688.0) / amax, max=FLT_MAX)
        if s_enc.item() == 0.0:
            s_enc = f32(1.0)
    s_dec = f32(1.0) / s_enc
    return s_enc, s_dec


def e2m1_rne(y: torch.Tensor) -> torch.Tensor:
    """fp32 in [-6, 6] -> uint8 code; ties .25->0 .75->1 1.25->1 1.75->2 2.5->2 3.5->4 5->4."""
    a = y.abs()
    # code = number of rounding boundaries passed; '>' at ties that go down (to the even code),
    # '>=' at ties that go up: .25->0 .75->1.0 1.25->1.0 1.75->2 2.5->2 3.5->4 5->4
    mag = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
           + (a > 2.5) + (a >= 3.5) + (a > 5.0)).to(torch.uint8)
    sign = (y < 0).to(torch.uint8) << 3   # tiny negative -> 0x8; -0.0 -> 0x0 (as qpass)
    return mag | sign


def quantize_nvfp4(x: torch.Tensor, s_enc: torch.Tensor, s_dec: torch.Tensor):
    """x [R, K] -> (codes uint8 [R, K/2], scales float8_e4m3fn [R, K/16])."""
    R, K = x.shape
    if K % 16:
        raise ValueError(f"K={K} is not a multiple of 16")
    if not torch.isfinite(x).all():
        raise ValueError("NaN/inf in weight")
    xb = x.to(torch.float32).reshape(R, K // 16, 16)
    mult = s_enc * INV6
    vmax = xb.abs().amax(dim=-1)                                  # [R, K/16]
    sb = torch.clamp(vmax * mult, max=448.0).to(torch.float8_e4m3fn)  # RNE, subnormals kept
    enc = torch.clamp(f32(1.0) / (sb.to(torch.float32) * s_dec), max=FLT_MAX)  # 1/0 -> inf -> FLT_MAX
    y = torch.clamp(xb * enc.unsqueeze(-1), -6.0, 6.0)
    q = e2m1_rne(y).reshape(R, K)
    codes = q[:, 0::2] | (q[:, 1::2] << 4)
    return codes.contiguous(), sb.contiguous()


def dequant_nvfp4(codes, scales, s_dec) -> torch.Tensor:
    """w_hat = to_bf16( fl( fl(e2m1(q) * float(s_b)) * S_dec ) )."""
    lo = E2M1_LUT[(codes & 0xF).long()]
    hi = E2M1_LUT[(codes >> 4).long()]
    v = torch.stack((lo, hi), -1).reshape(codes.shape[0], -1)
    s = scales.to(torch.float32).repeat_interleave(16, dim=1)
    return ((v * s) * s_dec).to(torch.bfloat16)


def quantize_state_dict(sd: dict[str, torch.Tensor], store_s_enc: bool = True,
                        perturb: float = 0.0, seed: int = 0):
    """Quantize every decoder linear (q,k,v,o,gate,up,down) with shared amax per fused group.

    perturb > 0 adds seeded noise (relative) to the master weights first (to make a
    'different checkpoint' for the live-update test). Returns (out_sd, n_sites).
    """
    out = OrderedDict()
    layer_ids = sorted({int(m.group(1)) for k in sd for m in [re.match(r"model\.layers\.(\d+)\.", k)] if m})
    g = torch.Generator().manual_seed(seed)
    quantized = set()
    for i in layer_ids:
        for group in GROUPS:
            names = []
            for s in group:
                sub = "self_attn" if s in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                names.append(f"model.layers.{i}.{sub}.{s}")
            ws = []
            for n in names:
                w = sd[n + ".weight"].to(torch.float32)
                if perturb:
                    w = (w + perturb * w.abs().mean() * torch.randn(w.shape, generator=g)).to(sd[n + ".weight"].dtype).to(torch.float32)
                ws.append(w)
            amax = torch.stack([w.abs().max() for w in ws]).max()   # group amax (exact)
            s_enc, s_dec = global_scales(amax)
            for n, w in zip(names, ws):
                codes, scales = quantize_nvfp4(w, s_enc, s_dec)
                out[n + ".weight"] = codes
                out[n + ".weight_scale"] = scales
                out[n + ".weight_scale_2"] = s_dec.clone()          # 0-dim fp32, S_dec
                if store_s_enc:
                    out[n + ".weight_global_scale"] = s_enc.clone()  # 0-dim fp32, S_enc
                quantized.add(n + ".weight")
    for k, v in sd.items():
        if k not in quantized:
            out[k] = v
    return out, len(quantized)


def write_checkpoint(src_dir: str, dst_dir: str, store_s_enc: bool = True, perturb: float = 0.0,
                     seed: int = 0, other_dtype: torch.dtype | None = None,
                     weights_only: bool = False) -> dict:
    """src_dir: plain HF dir. dst_dir: HF dir with quantization_config.quant_method=qpass_nvfp4.

    weights_only=True writes just model.safetensors (for reload_weights into a live engine).
    """
    sd = load_file(os.path.join(src_dir, "model.safetensors"))
    if other_dtype is not None:
        sd = {k: v.to(other_dtype) for k, v in sd.items()}
    qsd, n = quantize_state_dict(sd, store_s_enc=store_s_enc, perturb=perturb, seed=seed)
    os.makedirs(dst_dir, exist_ok=True)
    tmp = os.path.join(dst_dir, ".model.safetensors.tmp")
    save_file({k: v.contiguous() for k, v in qsd.items()}, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(dst_dir, "model.safetensors"))
    if not weights_only:
        for f in os.listdir(src_dir):
            if f != "model.safetensors" and not f.startswith("."):
                shutil.copy(os.path.join(src_dir, f), os.path.join(dst_dir, f))
        cfg = json.load(open(os.path.join(src_dir, "config.json")))
        cfg["quantization_config"] = {
            "quant_method": "qpass_nvfp4",
            "format": "nvfp4", "group_size": 16, "scale_layout": "linear",
            "weight_scale_2": "S_dec (decode multiplier)",
            "store_s_enc": store_s_enc,
            "compute": "w4a16: bf16 dequant, fp32 matmul",
            "ignore": ["lm_head"],
            "fused_groups_share_amax": [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]],
        }
        json.dump(cfg, open(os.path.join(dst_dir, "config.json"), "w"), indent=2)
    return {"sites": n, "tensors": len(qsd), "dir": dst_dir}


if __name__ == "__main__":
    import sys, time
    t = time.time()
    print(write_checkpoint(sys.argv[1], sys.argv[2]), f"{time.time()-t:.1f}s")


def modify_checkpoint(src_qdir: str, dst_dir: str, frac_scales: float = 0.1,
                      frac_codes: float = 0.005, seed: int = 1) -> dict:
    """Fast 'new rollout weights' for the live-update test: edit quantized bytes directly.

    Bumps a fraction of E4M3 block-scale bytes by one code (0x7E/0x7F/0xFE/0xFF = 448/NaN are
    left alone) and flips the sign bit of the low-nibble element in a fraction of code bytes.
    Writes only model.safetensors (what reload_weights needs).
    """
    sd = load_file(os.path.join(src_qdir, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    n_s = n_c = 0
    for k in list(sd):
        if k.endswith(".weight_scale"):
            b = sd[k].view(torch.uint8).clone()
            m = (torch.rand(b.shape, generator=g) < frac_scales) & ((b & 0x7F) < 0x7E)
            b[m] += 1
            n_s += int(m.sum())
            sd[k] = b.view(torch.float8_e4m3fn)
        elif k.endswith(".weight") and sd[k].dtype == torch.uint8:
            c = sd[k].clone()
            m = torch.rand(c.shape, generator=g) < frac_codes
            c[m] ^= 0x08
            n_c += int(m.sum())
            sd[k] = c
    os.makedirs(dst_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(dst_dir, "model.safetensors"),
              metadata={"format": "pt"})
    return {"scale_bytes_changed": n_s, "code_bytes_changed": n_c}
