"""A Megatron-core ``GPTModel`` (TE-free local spec) for a Hugging Face Llama, on one TP rank.

Needs ``megatron.core`` with ``torch.distributed`` and Megatron's model-parallel state initialized
(:mod:`qpass.backends.megatron.dist` does both). The forward follows the HF Llama the qpass learner
graph captures: position ids ``cumsum(mask) - 1`` (left padding), causal attention that never
attends to padded keys, logits gathered over TP and cut back to the real vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from qpass.backends.megatron.config import LlamaLayout
from qpass.backends.megatron.convert import hf_to_mcore, partition_dims
from qpass.errors import QpassError
from qpass.sampling import positions_from_mask

__all__ = ["build_gpt_model", "check_left_padded", "gpt_logits", "load_hf_shard", "transformer_config"]


def transformer_config(layout: LlamaLayout, *, dtype: torch.dtype, use_cpu_initialization: bool = True):  # noqa: ANN201
    """``megatron.core.transformer.TransformerConfig`` of ``layout`` (see the table in
    :mod:`qpass.backends.megatron.config`); every fusion that needs CUDA kernels is off."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=layout.num_layers, hidden_size=layout.hidden, ffn_hidden_size=layout.ffn,
        num_attention_heads=layout.heads, num_query_groups=layout.kv_heads, kv_channels=layout.head_dim,
        normalization="RMSNorm", layernorm_epsilon=layout.eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        sequence_parallel=False, tensor_model_parallel_size=layout.tp, use_cpu_initialization=use_cpu_initialization,
        perform_initialization=False, params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        attention_softmax_in_fp32=True,
    )


def build_gpt_model(layout: LlamaLayout, *, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.nn.Module:
    """An uninitialized ``GPTModel`` for this rank (weights come from :func:`load_hf_shard`).

    Raises:
        QpassError: Megatron's model-parallel state is not initialized with TP = ``layout.tp``.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() != layout.tp:
        raise QpassError(f"Megatron model-parallel state is not initialized for TP={layout.tp}")
    dev = torch.device(device)
    cfg = transformer_config(layout, dtype=dtype, use_cpu_initialization=dev.type == "cpu")
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=layout.padded_vocab,
                     max_sequence_length=layout.max_positions, share_embeddings_and_output_weights=layout.tied,
                     position_embedding_type="rope", rotary_base=layout.rope_base, parallel_output=True)
    model = model.to(device=dev, dtype=dtype)  # as Megatron-LM's Float16Module: norms too (torch.nn.RMSNorm is built in fp32)
    if dev.type == "cpu":
        _rope_on_cpu(model.rotary_pos_emb)
        _memory_buffer_on_cpu()
        _rng_tracker_on_cpu()
    else:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

        if "model-parallel-rng" not in get_cuda_rng_tracker().get_states():
            model_parallel_cuda_manual_seed(1234)  # no dropout draws from it (all dropout is 0)
    return model


def _rng_tracker_on_cpu() -> None:
    """Megatron forks a CUDA RNG state around attention dropout; with every dropout 0 nothing is
    drawn, so on CPU the fork is a no-op context."""
    import contextlib
    import types

    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    tracker.fork = types.MethodType(lambda self, name=None: contextlib.nullcontext(), tracker)  # noqa: ARG005


class _CpuMemoryBuffer:
    """Stands in for Megatron's ``GlobalMemoryBuffer`` (which allocates on
    ``torch.cuda.current_device()``): a fresh CPU tensor per request. Its only user on the local
    spec is ``DotProductAttention``'s ``baddbmm(..., beta=0)``, which ignores the buffer's values."""

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):  # noqa: ANN001, ANN201, ARG002
        return torch.empty(tuple(tensor_shape), dtype=dtype)


def _memory_buffer_on_cpu() -> None:
    from megatron.core import parallel_state as ps

    ps._GLOBAL_MEMORY_BUFFER = _CpuMemoryBuffer()  # noqa: SLF001 - Megatron has no CPU allocator hook


def _rope_on_cpu(rope: torch.nn.Module) -> None:
    """Megatron 0.16.1's ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to
    ``torch.cuda.current_device()`` on first use; on CPU the same embedding is computed in place
    (``rotary_interleaved=False``: ``[freqs, freqs]``, shape ``[S, 1, 1, D]``)."""
    import types

    if rope.rotary_interleaved:
        raise QpassError("interleaved RoPE is not mapped (HF Llama rotates halves)")

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]

    rope.get_emb = types.MethodType(get_emb, rope)


@torch.no_grad()
def load_hf_shard(model: torch.nn.Module, hf: Mapping[str, torch.Tensor], layout: LlamaLayout, *, rank: int) -> int:
    """Copy this TP rank's shard of the HF weights into ``model``; returns the tensors copied.

    Also stamps Megatron's tensor-parallel attributes (``tensor_model_parallel``, ``partition_dim``,
    ``partition_stride``) from the mapping table: Megatron sets them only in its own weight
    initialization, which is skipped here (``perform_initialization=False``).

    Raises:
        QpassError: a parameter of the model has no converted weight or the shapes differ (named).
    """
    shard = hf_to_mcore(hf, layout, rank=rank)
    dims = partition_dims(layout)
    params = dict(model.named_parameters())
    for name, p in params.items():
        if name not in shard:
            raise QpassError(f"Megatron parameter {name} has no HF weight (mapping incomplete)")
        if tuple(shard[name].shape) != tuple(p.shape):
            raise QpassError(f"{name}: converted shape {tuple(shard[name].shape)} != Megatron shape {tuple(p.shape)}")
        p.copy_(shard[name].to(p.dtype))
        dim = dims[name]
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = dim is not None, 0 if dim is None else dim, 1
    extra = sorted(set(shard) - set(params))
    if extra:
        raise QpassError(f"converted weights without a Megatron parameter: {extra[:3]}")
    return len(params)


class _GatherVocab(torch.autograd.Function):
    """All-gather vocab-parallel logits along the last dim; backward keeps this rank's slice (every
    rank receives the same upstream gradient). Megatron's own gather allocates on CUDA."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
        ctx.rank, ctx.width = dist.get_rank(group), x.shape[-1]
        bufs = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(bufs, x.contiguous(), group=group)
        return torch.cat(bufs, dim=-1)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return g[..., ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width].contiguous()


def _gather_vocab(logits: torch.Tensor, tp: int) -> torch.Tensor:
    return logits if tp == 1 else _GatherVocab.apply(logits)


def _attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """bool ``[B, 1, T, T]``, True = masked: future keys and padded keys."""
    t = attention_mask.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).triu(1)
    pad = attention_mask.eq(0)[:, None, None, :]
    return causal[None, None] | pad


def check_left_padded(attention_mask: torch.Tensor) -> torch.Tensor:
    """Leading pads per row (int64 ``[B]``) of a 0/1 ``[B, T]`` mask.

    Raises:
        QpassError: a row has padding between real tokens (Megatron's positions would differ from HF's).
    """
    mask = attention_mask.long()
    t = mask.shape[-1]
    lead = (mask.cumsum(-1) == 0).sum(-1)
    ar = torch.arange(t, device=mask.device)
    if bool((mask.bool() & (positions_from_mask(mask) != (ar - lead[:, None]))).any()):
        raise QpassError("Megatron learner: attention_mask has padding between real tokens; only left padding "
                         "(and padding after the last real token) is supported")
    return lead


def gpt_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, layout: LlamaLayout) -> torch.Tensor:
    """Logits ``[B, T, vocab]`` (model dtype; TP-gathered, padded vocabulary rows cut) of int64
    ``input_ids`` ``[B, T]`` with a 0/1 ``attention_mask`` ``[B, T]`` (left padding allowed).

    Megatron's RoPE rotates by the sequence index, HF's by the position id ``cumsum(mask) - 1``;
    the two agree once each row is shifted left by its leading padding, so rows are rolled to start
    at their first real token, run with a causal + key-padding mask, and rolled back (the values at
    padded positions are meaningless, as in HF).

    Raises:
        QpassError: a row has padding between real tokens (positions would differ from HF's).
    """
    b, t = input_ids.shape
    mask = attention_mask.long()
    lead = check_left_padded(mask)
    ar = torch.arange(t, device=input_ids.device)
    src = (ar[None, :] + lead[:, None]) % t  # rolled row: token j of the shifted row is token j + lead
    ids = input_ids.gather(1, src)
    m = mask.gather(1, src)
    logits = _gather_vocab(model(ids, ar.expand(b, t), _attention_mask(m)), layout.tp)[..., : layout.vocab]
    back = (ar[None, :] - lead[:, None]) % t  # position j of the original row is j - lead of the shifted one
    return logits.gather(1, back[:, :, None].expand(b, t, logits.shape[-1]))
