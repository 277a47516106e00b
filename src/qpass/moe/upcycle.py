"""Sparse upcycling: a dense Llama-style causal LM becomes a Mixtral MoE with real weights.

Each MLP becomes ``E`` experts initialised from the dense MLP plus small noise
(``W_e = W + noise · std(W) · N(0, 1)``, independently per expert and matrix, bf16-rounded), and a
router with random weights ``N(0, router_std²)`` picks the top-k (Komatsuzaki et al., "Sparse
Upcycling", 2022; experts copied, router new). Attention, norms, embeddings and the head are copied.
Mixtral is the target class because its attention is Llama's (no q/k norm, unlike Qwen3-MoE and
OLMoE), so at ``noise = 0`` the upcycled model computes the dense model's function exactly (the
top-k weights are renormalised to sum to 1 and every expert is the dense MLP).

``--model moe-default`` is the upcycling of the default model (SmolLM2-135M-Instruct, 30 layers,
E = 8, top-2, noise 0.01, seed 0), built on first use into the cache directory
``$QPASS_CACHE_DIR/moe-default`` (default ``~/.cache/qpass/moe-default``) through
:func:`qpass.atomic.atomic_dir` (the directory is complete or absent), then loaded like any Hugging
Face MoE directory.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import torch

from qpass.atomic import atomic_dir
from qpass.errors import CaptureError
from qpass.jsonio import write_json

log = logging.getLogger(__name__)

UPCYCLE_INFO = "qpass_upcycle.json"


@dataclasses.dataclass(frozen=True)
class UpcycleConfig:
    """Sparse-upcycling settings.

    Attributes:
        num_experts: experts per MoE block (``E``).
        top_k: experts per token.
        noise: expert perturbation, a multiplier of each dense matrix's standard deviation.
        router_std: standard deviation of the random router weights.
        seed: seed of the one ``torch.Generator`` drawing noise and router weights.
    """

    num_experts: int = 8
    top_k: int = 2
    noise: float = 0.01
    router_std: float = 0.02
    seed: int = 0


def cache_root() -> Path:
    """``$QPASS_CACHE_DIR`` or ``~/.cache/qpass``."""
    return Path(os.environ.get("QPASS_CACHE_DIR") or Path.home() / ".cache" / "qpass")


def mixtral_config(dense_cfg, cfg: UpcycleConfig):  # noqa: ANN001, ANN201
    """The ``MixtralConfig`` of the upcycled model of a dense ``LlamaConfig``-like config."""
    from transformers import MixtralConfig

    head_dim = getattr(dense_cfg, "head_dim", None) or dense_cfg.hidden_size // dense_cfg.num_attention_heads
    if getattr(dense_cfg, "attention_bias", False) or getattr(dense_cfg, "mlp_bias", False):
        raise CaptureError("sparse upcycling needs a dense model without attention/MLP biases (Mixtral has none)")
    kw = dict(
        vocab_size=dense_cfg.vocab_size, hidden_size=dense_cfg.hidden_size, intermediate_size=dense_cfg.intermediate_size,
        num_hidden_layers=dense_cfg.num_hidden_layers, num_attention_heads=dense_cfg.num_attention_heads,
        num_key_value_heads=dense_cfg.num_key_value_heads, head_dim=head_dim, hidden_act=dense_cfg.hidden_act,
        max_position_embeddings=dense_cfg.max_position_embeddings, rms_norm_eps=dense_cfg.rms_norm_eps,
        tie_word_embeddings=bool(getattr(dense_cfg, "tie_word_embeddings", False)), sliding_window=None,
        num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k, router_jitter_noise=0.0,
        bos_token_id=dense_cfg.bos_token_id, eos_token_id=dense_cfg.eos_token_id, pad_token_id=dense_cfg.pad_token_id,
        rope_parameters=dict(getattr(dense_cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": dense_cfg.rope_theta}),
    )
    return MixtralConfig(**kw)


@torch.no_grad()
def upcycle(dense: torch.nn.Module, cfg: UpcycleConfig = UpcycleConfig()) -> torch.nn.Module:
    """A ``MixtralForCausalLM`` (dtype of ``dense``) upcycled from a dense Llama-style causal LM.

    Args:
        dense: e.g. ``LlamaForCausalLM``: ``model.layers[i].mlp.{gate,up,down}_proj`` ``nn.Linear``
            without bias, the attention in Llama layout.
    Returns:
        the MoE model in eval mode, fused transformers experts (``gate_up_proj [E, 2I, H]``).
    Raises:
        CaptureError: the dense model is not Llama-shaped (names the missing parameter).
    """
    from transformers import MixtralForCausalLM

    mcfg = mixtral_config(dense.config, cfg)
    param = next(dense.parameters())
    moe = MixtralForCausalLM(mcfg).to(param.dtype).eval()
    src = dense.state_dict()
    gen = torch.Generator().manual_seed(cfg.seed)

    def noisy(w: torch.Tensor) -> torch.Tensor:
        w32 = w.float()
        std = w32.std()
        return (w32 + cfg.noise * std * torch.randn(w32.shape, generator=gen)).to(w.dtype)

    dst = moe.state_dict()
    for name, t in dst.items():
        if ".mlp." in name:
            continue
        if name not in src:
            raise CaptureError(f"sparse upcycling: the dense model has no parameter {name}")
        t.copy_(src[name])
    for i, layer in enumerate(moe.model.layers):
        pre = f"model.layers.{i}.mlp."
        try:
            g, u, d = (src[pre + f"{p}_proj.weight"] for p in ("gate", "up", "down"))
        except KeyError as exc:
            raise CaptureError(f"sparse upcycling: the dense model has no {exc.args[0]}") from exc
        ex = layer.mlp.experts
        for e in range(cfg.num_experts):
            ex.gate_up_proj[e].copy_(torch.cat([noisy(g), noisy(u)]))
            ex.down_proj[e].copy_(noisy(d))
        w = layer.mlp.gate.weight
        w.copy_((cfg.router_std * torch.randn(w.shape, generator=gen)).to(w.dtype))
    if mcfg.tie_word_embeddings:
        moe.tie_weights()
    return moe


def build_dir(dense_dir: Path, gguf: str | None, out: Path, cfg: UpcycleConfig = UpcycleConfig(), *,
              dtype: torch.dtype = torch.bfloat16) -> Path:
    """Upcycle the model in ``dense_dir`` (a GGUF file in it, or an HF directory) into the Hugging
    Face directory ``out`` (config, safetensors, tokenizer, ``qpass_upcycle.json``), atomically.

    Raises:
        CaptureError: the dense model cannot be read or upcycled.
        QpassError / OutputBusy: ``out`` exists or another process is building it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf} if gguf else {}
    try:
        tok = AutoTokenizer.from_pretrained(str(dense_dir), **kw)
        dense = AutoModelForCausalLM.from_pretrained(str(dense_dir), dtype=dtype, **kw).eval()
    except Exception as exc:  # noqa: BLE001
        raise CaptureError(f"sparse upcycling: could not load the dense model from {dense_dir}: {exc}") from exc
    moe = upcycle(dense, cfg)
    del dense
    with atomic_dir(out, marker="config.json") as tmp:
        moe.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        write_json(Path(tmp) / UPCYCLE_INFO, {"source": str(Path(dense_dir) / gguf) if gguf else str(dense_dir),
                                               "class": type(moe).__name__, **dataclasses.asdict(cfg)})
    log.info("upcycled %s into %s", dense_dir, out)
    return out


def moe_default_dir(dense_gguf: Path) -> Path:
    """The ``moe-default`` directory, built from the default model's GGUF on first use (minutes)."""
    out = cache_root() / "moe-default"
    if (out / "config.json").is_file() and (out / UPCYCLE_INFO).is_file():
        return out
    log.warning("building moe-default (sparse upcycling of the default model) into %s", out)
    return build_dir(dense_gguf.parent, dense_gguf.name, out)
