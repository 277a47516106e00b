#!/usr/bin/env bash
# Body of `bash scripts/gpu.sh vllm-linear` (old path: see scripts/README.md): sourced by scripts/gpu.sh, which defines
# gpu_open / gpu_setup / gpu_import_or_setup; not run alone.
# Provenance (lab launcher for the GPU box; scripts/README.md): produced
# `docs/results/vllm/h200/vllm_linear.json` (docs/results/engines.md and README, vLLM linear method on CUDA).
# GPU check of the vLLM plugin's linear method WITHOUT vLLM (vLLM cannot be installed on the GPU box):
# the parts of qpass.backends.vllm.plugin that run inside vLLM's layers are qpass functions
# (qpass.checkpoint.linear.finish_loading / served_linear, plugin.check_all_loaded / _checked_loader),
# so they run here on CUDA tensors with qpass's Triton kernels, exactly as the plugin's apply() calls them
# (use_kernels("triton") on CUDA), and are compared with the reference op.
#
# Run from the repository root on the GPU box:  OUT=/some/dir bash scripts/gpu.sh vllm-linear
# Writes $OUT/vllm_linear.json and $OUT/vllm_linear.log (< 2 min). What to look for (summary line last):
#   * "onehot_bitexact": true for every case — one-hot activation rows make each output one decoded
#     weight (x = e_k), so the Triton path and the CPU reference must agree bit for bit;
#   * "plumbing_bitexact": true — served_linear on CUDA == torch.ops.qpass.nvfp4_linear with the Triton
#     kernels called directly (the plugin adds nothing to the numbers);
#   * "rel_err" of random activations (float summation order differs: not bit-exact, expect ~1e-3 or less);
#   * "load_checks": the refusals (missing shard, NaN scale, mixed fused globals, wrong dtype/shape) raised.
gpu_open
gpu_setup
unset TRITON_INTERPRET
timeout -k 10 300 python3 - "$OUT/vllm_linear.json" <<'PY' 2>&1 | tee "$OUT/vllm_linear.log"
import json, sys, time
import torch
from qpass.backends.catalog import TRITON
from qpass.backends.vllm.plugin import _checked_loader, check_all_loaded
from qpass.checkpoint.linear import finish_loading, served_linear
from qpass.checkpoint.params import linear_param_specs, make_tensor
from qpass.errors import QuantizationError
from qpass.formats.spec import NVFP4_WEIGHT
from qpass.ops import use_kernels
from qpass.quant.nvfp4 import nvfp4_quantize
from qpass.quant.rac import RACConfig

assert torch.cuda.is_available(), "needs CUDA"
TRITON.register()
out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cases": [], "load_checks": {}}
t0 = time.time()

def layer(n, k, shards, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    q = nvfp4_quantize(w, spec=NVFP4_WEIGHT)
    m = torch.nn.Module()
    m.weight = torch.nn.Parameter(q.codes.to(dev), requires_grad=False)
    m.weight_scale = torch.nn.Parameter(q.scales.to(dev), requires_grad=False)
    m.weight_scale_2 = torch.nn.Parameter(q.s_dec.float().reshape(1).repeat(shards).to(dev), requires_grad=False)
    m.qpass_k_sharded = False
    return m

CASES = [("none", None), ("nvfp4", None), ("nvfp4_per_token", None)] + [
    ("nvfp4", RACConfig(0.5, m, s)) for m in ("masked", "gathered") for s in ("batch", "token", "static")]
N, K, M = 1536, 2048, 64  # a fused qkv-like layer (3 shards), K = 2048
for act, rac in CASES:
    name = f"{act}" + (f"-rac-{rac.mode}-{rac.selection}" if rac else "")
    rec = {"case": name}
    try:
        cpu, gpu = layer(N, K, 3, "cpu"), layer(N, K, 3, "cuda")
        ch = torch.arange(rac.num_channels(K), dtype=torch.int64) * 2 if rac is not None and rac.selection == "static" else None
        if ch is not None:
            cpu.rac_channels, gpu.rac_channels = ch, ch.cuda()
        finish_loading(cpu, name, persistent=True, decode_cache=True)   # what the plugin does on CPU
        finish_loading(gpu, name, persistent=True, decode_cache=False)  # ... and on CUDA (Triton decodes in-kernel)
        x = (torch.randn(M, K, generator=torch.Generator().manual_seed(1)) * 2).to(torch.bfloat16)
        x[:, 7] *= 40
        with use_kernels("triton"):
            y_gpu = served_linear(gpu, x.cuda(), None, site=name, act=act, rac=rac)
            y_direct = torch.ops.qpass.nvfp4_linear(x.cuda(), gpu.weight, gpu.weight_scale, gpu.qpass_s_dec, None, name, act,
                                                    float(rac.ratio) if rac else 0.0, rac.mode if rac else "masked",
                                                    rac.selection if rac else "batch", gpu.rac_channels if ch is not None else None)
        y_ref = served_linear(cpu, x, None, site=name, act=act, rac=rac)
        rec["plumbing_bitexact"] = bool(torch.equal(y_gpu, y_direct))
        d = (y_gpu.float().cpu() - y_ref.float())
        rec["rel_err"] = float(d.norm() / y_ref.float().norm())
        rec["max_abs"] = float(d.abs().max())
        # one-hot rows: x = e_k (k < 256), W4A16 output = decoded weight column k exactly; W4A4 quantizes
        # a one-hot row exactly (the single non-zero is the block amax), so the same holds
        eye = torch.zeros(256, K, dtype=torch.bfloat16)
        eye[torch.arange(256), torch.arange(256) * (K // 256)] = 1.0
        r1 = rac if rac is None or rac.selection != "static" else None  # static channels are not one-hot safe
        with use_kernels("triton"):
            o_gpu = served_linear(gpu, eye.cuda(), None, site=name, act=act, rac=r1).float().cpu()
        o_ref = served_linear(cpu, eye, None, site=name, act=act, rac=r1).float()
        rec["onehot_bitexact"] = bool(torch.equal(o_gpu, o_ref))
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {e}"
    out["cases"].append(rec)
    print(json.dumps(rec), flush=True)

# load checks of the plugin on CUDA tensors (no vLLM: a plain loader stands in for vLLM's weight_loader_v2)
def fresh(dev="cuda"):
    m = torch.nn.Module()
    m.qpass_site, m.qpass_k_sharded, m.qpass_loaded, m.logical_widths, m.tp_size = "L.qkv_proj", False, set(), [64, 32, 32], 1
    for p in linear_param_specs(128, [64, 32, 32], prefix="L"):
        m.register_parameter(p.name, torch.nn.Parameter(make_tensor(p, dev), requires_grad=False))
    return m

def plain_loader(param, w, shard=None):
    i = {"q": 0, "k": 1, "v": 2}[shard]
    if param.dim() == 1:
        param.data[i] = w.to(param.device)
    else:
        off = [0, 64, 96][i]
        param.data[off:off + w.shape[0]] = w.to(param.device)

def load(m, skip=(), scale_mul=None, bad_scale=False):
    for i, s in enumerate("qkv"):
        rows = [64, 32, 32][i]
        q = nvfp4_quantize((torch.randn(rows, 128) * 0.05).to(torch.bfloat16), spec=NVFP4_WEIGHT)
        t = {"weight": q.codes, "weight_scale": q.scales, "weight_scale_2": torch.tensor(1.0 / 1024 * (scale_mul if (scale_mul and i == 1) else 1.0))}
        if bad_scale and i == 2:
            t["weight_scale"] = t["weight_scale"].clone(); t["weight_scale"].view(torch.uint8)[0, 0] = 0x7F
        for name, v in t.items():
            if (name, s) in skip:
                continue
            _checked_loader(m, name, plain_loader)(getattr(m, name), v, s)

for case, kw in {"ok": {}, "missing_shard_scale": {"skip": {("weight_scale", "k")}}, "mixed_globals": {"scale_mul": 2.0},
                 "nan_block_scale": {"bad_scale": True}}.items():
    m = fresh()
    try:
        load(m, **kw)
        check_all_loaded(m, "L.qkv_proj")
        finish_loading(m, "L.qkv_proj", persistent=True)
        out["load_checks"][case] = "accepted"
    except QuantizationError as e:
        out["load_checks"][case] = f"refused: {e}"
m = fresh()
try:
    _checked_loader(m, "weight_scale", plain_loader)(m.weight_scale, torch.zeros(64, 4, dtype=torch.float8_e4m3fn, device="cuda"), "q")
    out["load_checks"]["wrong_shape"] = "accepted"
except QuantizationError as e:
    out["load_checks"]["wrong_shape"] = f"refused: {e}"
out["wall_s"] = time.time() - t0
ok = (all(c.get("onehot_bitexact") and c.get("plumbing_bitexact") for c in out["cases"])
      and out["load_checks"].get("ok") == "accepted"
      and all(v.startswith("refused") for k, v in out["load_checks"].items() if k != "ok"))
out["ok"] = ok
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(json.dumps(out["load_checks"], indent=1))
print(f"SUMMARY gpu_vllm_linear: {'PASS' if ok else 'FAIL'} ({len(out['cases'])} compute cases, {time.time() - t0:.0f} s)")
sys.exit(0 if ok else 1)
PY
