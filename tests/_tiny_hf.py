"""A tiny random Llama as a Hugging Face model directory with a character-level tokenizer.

For tests that start ``qpass grpo`` as a subprocess (``qpass grpo-sweep``): ``--model DIR`` loads it
through the same path as any HF directory, in a second or two, without the default model.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

SPECIALS = ["<pad>", "<eos>", "<unk>", "<bos>"]
CHARS = list(string.digits + string.ascii_letters + string.punctuation + " \n")
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'][:24] }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '\n' }}{% endif %}")


def write_tiny_hf_model(out: Path, *, seed: int = 0) -> Path:
    """Write ``config.json``, ``model.safetensors`` and the tokenizer into ``out`` (created). Returns ``out``.

    The chat template keeps the first 24 characters of the user message, so prompts stay short.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                  bos_token="<bos>")
    tok.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, vocab_size=128, max_position_embeddings=256, tie_word_embeddings=False,
                      pad_token_id=0, eos_token_id=1, bos_token_id=3)
    m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    m.save_pretrained(out)
    tok.save_pretrained(out)
    return out
