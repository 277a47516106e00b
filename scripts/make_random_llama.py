"""Write a random-weight Llama as a Hugging Face model directory with the default model's tokenizer.

    python scripts/make_random_llama.py --out /tmp/llama-tp2 [--hidden 256 --layers 4 --heads 8 --kv-heads 4 --ffn 512]

Used for runs whose TP the default model cannot take (SmolLM2-135M: 9 heads / 3 KV heads, so only
TP 1 or 3), e.g. ``qpass grpo --model /tmp/llama-tp2 --learner megatron --tp 2``. bf16, tied
embeddings, seed 0; the directory holds ``config.json``, ``model.safetensors`` and the tokenizer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    from qpass.graph.model import load_model

    tok = load_model("default").tokenizer
    torch.manual_seed(a.seed)
    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                      num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads, vocab_size=len(tok),
                      max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    a.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(a.out)
    tok.save_pretrained(a.out)
    print(f"wrote {a.out}: {sum(p.numel() for p in model.parameters())} parameters, vocab {len(tok)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
