"""Tiny checkpoints for the vLLM tests: a random 2-layer Llama (tests/conftest.py ``tiny_llama``) saved as
a plain HF directory and as a ``qpass_nvfp4`` checkpoint (config.json ``quantization_config`` +
``model.safetensors`` with qpass's quantizer: :func:`qpass.checkpoint.tensors.quantize_state_dict`).

The checkpoint layout is the contract of /work/wt/CKPT_CONTRACT.md (what ``qpass export --format qpass``
writes); these tests build it directly so the engine tests need no exporter and no real model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qpass.checkpoint.qconfig import QpassQuantOptions
from qpass.checkpoint.tensors import quantize_state_dict

PAD, EOS = 0, 1


def tiny_llama_vllm(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A 2-layer random Llama vLLM-CPU can run (its CPU attention needs head_dim 32/64/...; conftest's
    ``tiny_llama`` has 16): hidden 128, MLP 256, 2 heads / 1 KV head of 64, vocab 256, untied lm_head,
    one input channel with a real outlier (as in LLM activations, so RAC has something to select)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=64, vocab_size=256, max_position_embeddings=256,
                      tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.post_attention_layernorm.weight[5] = 20.0
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def save_plain(model: torch.nn.Module, out: Path) -> Path:
    """``model`` (transformers) as a plain HF directory (config.json, generation_config.json, model.safetensors)."""
    model.config.pad_token_id, model.config.eos_token_id, model.config.bos_token_id = PAD, EOS, 2
    model.save_pretrained(out, safe_serialization=True)
    return out


def save_qpass(model: torch.nn.Module, out: Path, options: QpassQuantOptions) -> Path:
    """``model`` as a ``qpass_nvfp4`` checkpoint: every linear but lm_head quantized (shared amax per
    fused group), other tensors unchanged, ``quantization_config = options.to_config()``."""
    from safetensors.torch import save_file

    save_plain(model, out)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    named = dict(quantize_state_dict(state, targets=("*",), exclude=options.exclude))
    save_file({k: v.contiguous() for k, v in named.items()}, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = options.to_config()
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def master_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF-named master weights (what ``LearnerEngine.export_weights`` hands over)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
