"""Hugging Face Llama config -> the Megatron-core ``GPTModel`` it maps onto (plain Python; no
megatron import, so a config Megatron cannot express is rejected before any process starts).

Mapping (HF ``LlamaConfig`` field -> ``TransformerConfig`` / ``GPTModel`` argument):

==========================  =====================================================================
``num_hidden_layers``       ``num_layers``
``hidden_size``             ``hidden_size``
``intermediate_size``       ``ffn_hidden_size`` (SwiGLU: ``gated_linear_unit=True``, ``silu``)
``num_attention_heads``     ``num_attention_heads``
``num_key_value_heads``     ``num_query_groups`` (GQA)
``head_dim``                ``kv_channels``
``rms_norm_eps``            ``layernorm_epsilon`` (``normalization="RMSNorm"``)
``rope_theta``              ``rotary_base`` (``position_embedding_type="rope"``, not interleaved)
``tie_word_embeddings``     ``share_embeddings_and_output_weights``
``vocab_size``              ``vocab_size`` padded up to a multiple of ``128 * TP`` (Megatron-LM's
                            ``make_vocab_size_divisible_by``); padded rows are zero and the logits
                            are cut back to ``vocab_size`` before any softmax
==========================  =====================================================================

Refused (:class:`MegatronConfigError`, naming the field): biases on attention or MLP projections,
an MLP activation other than SiLU (SwiGLU), RoPE scaling other than the default, a model type
that is not Llama-architecture, and a TP size that does not divide the attention heads or the KV
heads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from qpass.errors import QpassError

__all__ = ["LlamaLayout", "MegatronConfigError", "VOCAB_DIVISOR", "layout_from_hf"]

VOCAB_DIVISOR = 128  # Megatron-LM's default make_vocab_size_divisible_by (times TP)
_LLAMA_TYPES = ("llama", "mistral")  # same decoder; Mistral's sliding window is refused below


class MegatronConfigError(QpassError, ValueError):
    """A Hugging Face config the Megatron-core ``GPTModel`` cannot express (the field is named)."""


@dataclasses.dataclass(frozen=True)
class LlamaLayout:
    """The shapes a Llama checkpoint and its Megatron-core model share.

    Attributes:
        num_layers, hidden, ffn: decoder layers, model width, MLP width (SwiGLU).
        heads, kv_heads, head_dim: query heads, KV heads (query groups), channels per head.
        vocab: the checkpoint's vocabulary; ``padded_vocab`` its Megatron size (multiple of
            ``128 * tp``).
        eps: RMSNorm epsilon; ``rope_base``: RoPE theta; ``max_positions``: longest sequence.
        tied: input embedding and LM head share one matrix.
        tp: tensor-parallel size the layout was checked for.
    """

    num_layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    padded_vocab: int
    eps: float
    rope_base: float
    max_positions: int
    tied: bool
    tp: int

    @property
    def q_per_group(self) -> int:
        """Query heads per KV head (GQA ratio)."""
        return self.heads // self.kv_heads


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return getattr(cfg, name, default)


def _rope(cfg: Any) -> float:
    params = _get(cfg, "rope_parameters") or {}
    scaling = _get(cfg, "rope_scaling")
    kind = (params.get("rope_type") if isinstance(params, dict) else None) or (
        scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None) or "default"
    if kind != "default":
        raise MegatronConfigError(f"rope_type {kind!r}: only the default RoPE maps onto GPTModel here (rope_scaling unsupported)")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    theta = theta if theta is not None else _get(cfg, "rope_theta", 10000.0)
    return float(theta)


def layout_from_hf(cfg: Any, *, tp: int = 1) -> LlamaLayout:
    """Check an HF config against what ``GPTModel`` (local spec) expresses and return its layout.

    Args:
        cfg: a ``transformers`` ``PretrainedConfig`` (``LlamaConfig``) or any object with its fields.
        tp: tensor-parallel size (>= 1).
    Returns:
        :class:`LlamaLayout`.
    Raises:
        MegatronConfigError: the config cannot be expressed (field named), or ``tp`` does not divide
            the heads / KV heads.
    """
    mt = _get(cfg, "model_type", "llama")
    if mt not in _LLAMA_TYPES:
        raise MegatronConfigError(f"model_type {mt!r}: only Llama-architecture configs ({', '.join(_LLAMA_TYPES)}) map onto GPTModel")
    if _get(cfg, "attention_bias", False):
        raise MegatronConfigError("attention_bias=True: the q/k/v/o projections have biases; the Megatron Llama mapping has none "
                                  "(add_bias_linear=False)")
    if _get(cfg, "mlp_bias", False):
        raise MegatronConfigError("mlp_bias=True: the MLP projections have biases; the Megatron Llama mapping has none")
    act = _get(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise MegatronConfigError(f"hidden_act {act!r}: only a SwiGLU MLP (silu gate) maps onto linear_fc1/linear_fc2")
    if _get(cfg, "sliding_window") not in (None, 0):
        raise MegatronConfigError(f"sliding_window={_get(cfg, 'sliding_window')}: windowed attention is not mapped")
    if not isinstance(tp, int) or tp < 1:
        raise MegatronConfigError(f"tensor-parallel size must be an integer >= 1, got {tp!r}")
    heads = int(cfg.num_attention_heads)
    kv = int(_get(cfg, "num_key_value_heads", None) or heads)
    hidden = int(cfg.hidden_size)
    head_dim = int(_get(cfg, "head_dim", None) or hidden // heads)
    if heads % kv:
        raise MegatronConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    if kv % tp:
        raise MegatronConfigError(f"TP={tp} does not divide num_key_value_heads={kv} (each rank needs whole query groups)")
    if heads % tp:
        raise MegatronConfigError(f"TP={tp} does not divide num_attention_heads={heads}")
    ffn = int(cfg.intermediate_size)
    if ffn % tp:
        raise MegatronConfigError(f"TP={tp} does not divide intermediate_size={ffn}")
    vocab = int(cfg.vocab_size)
    div = VOCAB_DIVISOR * tp
    return LlamaLayout(
        num_layers=int(cfg.num_hidden_layers), hidden=hidden, ffn=ffn, heads=heads, kv_heads=kv, head_dim=head_dim,
        vocab=vocab, padded_vocab=-(-vocab // div) * div, eps=float(_get(cfg, "rms_norm_eps", 1e-6)), rope_base=_rope(cfg),
        max_positions=int(_get(cfg, "max_position_embeddings", 4096)), tied=bool(_get(cfg, "tie_word_embeddings", False)), tp=tp,
    )
