"""Shared fixtures: a tiny random Llama (fast graph tests) and the real default model (slow tier).

Session-scoped so the default model (~25 s to load, ~15 s to capture both graphs) is loaded once per
pytest run however many modules use it.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(autouse=True, scope="session")
def _reproducers_in_tmp(tmp_path_factory):
    """Pass-failure reproducers written by tests go to pytest's temp dir, not the shared /tmp."""
    os.environ["QPASS_REPRODUCER_DIR"] = str(tmp_path_factory.mktemp("reproducers"))
    yield
    os.environ.pop("QPASS_REPRODUCER_DIR", None)


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A 2-layer Llama with random weights (hidden 64, MLP 128, 4 heads / 2 KV heads, vocab 256)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
                      tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # give one input channel a real outlier, as in real LLM activations
        for layer in m.model.layers:
            layer.post_attention_layernorm.weight[5] = 20.0
    for p in m.parameters():
        p.requires_grad_(False)
    return m


@pytest.fixture(scope="session")
def tiny_pipeline():
    from qpass.graph.model import LoadedModel
    from qpass.pipeline import Pipeline

    m = tiny_llama()
    return Pipeline.prepare(loaded=LoadedModel(model=m, tokenizer=None, name="tiny-llama", source="random"),
                            batch_size=4, max_len=32)


@pytest.fixture(scope="session")
def default_loaded():
    from qpass.graph.model import load_model

    return load_model("default")


@pytest.fixture(scope="session")
def default_pipeline(default_loaded):
    """The default model captured with a 4-row rollout batch and a 64-slot KV cache."""
    from qpass.pipeline import Pipeline

    return Pipeline.prepare(loaded=default_loaded, batch_size=4, max_len=64)
