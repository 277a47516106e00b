"""Weights between Hugging Face Llama names and Megatron-core ``GPTModel`` tensor-parallel shards
(plain torch; bit-exact both ways: only slicing, concatenation and zero padding).

The per-parameter rules are the table :data:`RULES` (``{layer}`` is the layer index):

* ``copy``: one HF tensor, replicated on every TP rank (RMSNorm weights);
* ``rows`` / ``cols``: one HF tensor split along dim 0 (column-parallel, vocab-parallel) or dim 1
  (row-parallel) into ``tp`` contiguous shards; embeddings and the LM head are first zero-padded
  to ``padded_vocab`` rows;
* ``qkv``: ``q_proj``/``k_proj``/``v_proj`` interleaved per query group into ``linear_qkv``
  (group ``g``: its ``heads/kv_heads`` q heads, then its k head, then its v head), then split by
  rows (each rank holds ``kv_heads/tp`` whole groups);
* ``fc1``: ``gate_proj``/``up_proj`` into ``linear_fc1``; rank ``r`` holds ``[gate_r; up_r]``
  (Megatron's gated-MLP shard layout).

The inverse (:func:`mcore_to_hf`) concatenates the shards and undoes the interleave with
:func:`qpass.backends.megatron.fake_quant.split_megatron_qkv` / ``split_megatron_fc1``, the same
functions that split quantized bytes, so weights and their NVFP4 codes follow one row mapping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from qpass.backends.megatron.config import LlamaLayout
from qpass.backends.megatron.fake_quant import split_megatron_fc1, split_megatron_qkv
from qpass.errors import QpassError

__all__ = ["RULES", "Rule", "hf_site_groups", "hf_to_mcore", "mcore_to_hf", "merge_rows", "partition_dims"]


@dataclasses.dataclass(frozen=True)
class Rule:
    """One Megatron parameter and the HF tensors it is made of.

    Attributes:
        mcore: Megatron-core parameter name (``{layer}`` placeholder for decoder layers).
        hf: HF parameter names, in fused order.
        kind: ``copy``, ``rows``, ``cols``, ``qkv``, ``fc1``.
        vocab: zero-pad dim 0 to the padded vocabulary first.
    """

    mcore: str
    hf: tuple[str, ...]
    kind: str
    vocab: bool = False

    @property
    def partition_dim(self) -> int | None:
        """The TP split dim of the Megatron tensor (None: replicated)."""
        return {"copy": None, "cols": 1}.get(self.kind, 0)


_L, _M = "decoder.layers.{layer}.", "model.layers.{layer}."
RULES: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "rows", vocab=True),
    Rule(_L + "input_layernorm.weight", (_M + "input_layernorm.weight",), "copy"),
    Rule(_L + "self_attention.linear_qkv.weight",
         tuple(_M + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
    Rule(_L + "self_attention.linear_proj.weight", (_M + "self_attn.o_proj.weight",), "cols"),
    Rule(_L + "pre_mlp_layernorm.weight", (_M + "post_attention_layernorm.weight",), "copy"),
    Rule(_L + "mlp.linear_fc1.weight", (_M + "mlp.gate_proj.weight", _M + "mlp.up_proj.weight"), "fc1"),
    Rule(_L + "mlp.linear_fc2.weight", (_M + "mlp.down_proj.weight",), "cols"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"),
    Rule("output_layer.weight", ("lm_head.weight",), "rows", vocab=True),
)


def _rules(layout: LlamaLayout) -> list[tuple[Rule, str, tuple[str, ...]]]:
    """``(rule, mcore name, hf names)`` for every parameter of ``layout`` (tied: no output layer)."""
    out = []
    for r in RULES:
        if r.mcore == "output_layer.weight" and layout.tied:
            continue
        layers = range(layout.num_layers) if "{layer}" in r.mcore else [None]
        for i in layers:
            out.append((r, r.mcore.format(layer=i), tuple(h.format(layer=i) for h in r.hf)))
    return out


def _interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: LlamaLayout) -> torch.Tensor:
    g, hd, qpg = layout.kv_heads, layout.head_dim, layout.q_per_group
    rest = q.shape[1:]
    parts = (q.reshape(g, qpg * hd, *rest), k.reshape(g, hd, *rest), v.reshape(g, hd, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def hf_to_mcore(hf: Mapping[str, torch.Tensor], layout: LlamaLayout, *, rank: int = 0) -> dict[str, torch.Tensor]:
    """TP rank ``rank``'s shard of every Megatron parameter, from HF weights.

    Args:
        hf: HF state dict (``model.layers.0.self_attn.q_proj.weight`` ... ; ``lm_head.weight`` may be
            missing when the embeddings are tied).
        layout: :func:`qpass.backends.megatron.config.layout_from_hf` of the model (its ``tp``).
        rank: tensor-parallel rank, ``0 <= rank < layout.tp``.
    Returns:
        ``{mcore name: tensor}`` (contiguous clones, the HF dtype).
    Raises:
        QpassError: an HF tensor is missing or has the wrong shape (named).
    """
    tp = layout.tp
    out: dict[str, torch.Tensor] = {}
    for rule, name, hf_names in _rules(layout):
        missing = [h for h in hf_names if h not in hf]
        if missing:
            raise QpassError(f"HF -> Megatron: {missing[0]} is missing (needed for {name})")
        ts = [hf[h].detach() for h in hf_names]
        if rule.vocab:
            t = ts[0]
            if t.shape[0] != layout.vocab:
                raise QpassError(f"HF -> Megatron: {hf_names[0]} has {t.shape[0]} rows, the config's vocab_size is {layout.vocab}")
            ts = [torch.cat([t, t.new_zeros(layout.padded_vocab - layout.vocab, *t.shape[1:])])]
        if rule.kind == "qkv":
            full = _interleave_qkv(*ts, layout)
        elif rule.kind == "fc1":
            gate, up = (t.chunk(tp, dim=0)[rank] for t in ts)
            out[name] = torch.cat([gate, up]).contiguous().clone()
            continue
        else:
            full = ts[0]
        dim = rule.partition_dim
        shard = full if dim is None else full.chunk(tp, dim=dim)[rank]
        out[name] = shard.contiguous().clone()
    return out


def merge_rows(rule_kind: str, shards: Sequence[torch.Tensor], layout: LlamaLayout) -> tuple[torch.Tensor, ...]:
    """Undo one fused parameter's TP split and interleave: shards (dim 0 = output rows; weights,
    NVFP4 codes or scale bytes alike) -> the HF tensors in fused order."""
    full = torch.cat(list(shards), dim=0)
    if rule_kind == "qkv":
        return split_megatron_qkv(full, num_attention_heads=layout.heads, num_query_groups=layout.kv_heads,
                                  head_dim=layout.head_dim)
    if rule_kind == "fc1":
        return split_megatron_fc1(full, tp_size=len(shards))
    return (full,)


def mcore_to_hf(shards: Sequence[Mapping[str, torch.Tensor]], layout: LlamaLayout) -> dict[str, torch.Tensor]:
    """HF weights from every TP rank's Megatron shards (rank order); the inverse of :func:`hf_to_mcore`.

    Returns:
        ``{hf name: tensor}``; tied embeddings appear under both ``model.embed_tokens.weight`` and
        ``lm_head.weight`` (the same tensor).
    Raises:
        QpassError: a rank lacks a parameter (named) or the shard count is not ``layout.tp``.
    """
    if len(shards) != layout.tp:
        raise QpassError(f"Megatron -> HF: {len(shards)} shard dicts for TP={layout.tp}")
    out: dict[str, torch.Tensor] = {}
    for rule, name, hf_names in _rules(layout):
        for r, s in enumerate(shards):
            if name not in s:
                raise QpassError(f"Megatron -> HF: TP rank {r} has no {name}")
        parts = [s[name] for s in shards]
        if rule.kind == "copy":
            tensors: tuple[torch.Tensor, ...] = (parts[0],)
        elif rule.kind == "cols":
            tensors = (torch.cat(parts, dim=1),)
        else:
            tensors = merge_rows(rule.kind, parts, layout)
        if rule.vocab:
            tensors = (tensors[0][: layout.vocab],)
        for h, t in zip(hf_names, tensors):
            out[h] = t.contiguous()
    if layout.tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def partition_dims(layout: LlamaLayout) -> dict[str, int | None]:
    """``{mcore parameter name: TP split dim}`` (None: replicated on every rank)."""
    return {name: rule.partition_dim for rule, name, _ in _rules(layout)}


def hf_site_groups(layout: LlamaLayout) -> dict[str, tuple[str, tuple[str, ...]]]:
    """``{mcore linear module: (rule kind, HF site ids in fused order)}`` of the decoder linears
    (the sites qpass's learner recipe fake-quantizes: 7 per layer)."""
    out = {}
    for rule, name, hf_names in _rules(layout):
        if rule.kind in ("qkv", "fc1", "cols"):
            out[name[: -len(".weight")]] = (rule.kind, tuple(h[: -len(".weight")] for h in hf_names))
    return out
