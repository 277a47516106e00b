"""Step-graph prefill arguments: the one place that turns sequences into a step-graph call.

The step graph (:mod:`qpass.graph.capture`) has the signature ``(input_ids [B, T], position_ids
[B, T], cache_position [T], attention_mask [B, L])`` with a static batch ``B`` and KV cache ``L``.
The rollout's prefill, the GRPO BF16 shadow, ``apply``'s activation capture and the study's
prefill capture all build these arguments here, so they agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qpass.sampling import positions_from_mask


def step_prefill_args(input_ids: torch.Tensor, attention_mask: torch.Tensor, *, batch_size: int, max_len: int) -> tuple:
    """Arguments of a step graph (static batch ``B``, cache ``L``) that prefill whole sequences.

    Rows beyond ``n`` are filled with copies of the last row (the caller ignores their logits),
    exactly as the rollout fills a partial chunk.

    Args:
        input_ids, attention_mask: int ``[n, T]`` with ``1 <= n <= B`` and ``T <= L``.
    Returns:
        ``(input_ids [B, T], position_ids [B, T], cache_position [T], attention_mask [B, L])``, int64
        (the mask is a fresh tensor the caller may update in place for decode steps).
    Raises:
        ValueError: ``n`` or ``T`` out of range.
    """
    n, t = input_ids.shape
    if not 1 <= n <= batch_size:
        raise ValueError(f"step_prefill_args: {n} rows, the step graph takes 1..{batch_size}")
    if t > max_len:
        raise ValueError(f"step_prefill_args: sequence length {t} exceeds the KV cache ({max_len})")
    if n < batch_size:
        fill = batch_size - n
        input_ids = torch.cat([input_ids, input_ids[-1:].expand(fill, t)])
        attention_mask = torch.cat([attention_mask, attention_mask[-1:].expand(fill, t)])
    am = attention_mask.long()
    pos = positions_from_mask(am)
    mask_l = torch.zeros(batch_size, max_len, dtype=torch.long, device=am.device)
    mask_l[:, :t] = am
    return input_ids, pos, torch.arange(t, device=am.device), mask_l


def left_pad(prompts: Sequence[Sequence[int]], *, pad_token_id: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists to one width: ``(input_ids, attention_mask)``, int64 ``[n, P]``.

    Raises:
        ValueError: no rows.
    """
    if not prompts:
        raise ValueError("left_pad: no rows")
    p = max(len(x) for x in prompts)
    ids = torch.full((len(prompts), p), int(pad_token_id), dtype=torch.long)
    am = torch.zeros(len(prompts), p, dtype=torch.long)
    for i, r in enumerate(prompts):
        if len(r):
            ids[i, p - len(r):] = torch.tensor([int(t) for t in r], dtype=torch.long)
            am[i, p - len(r):] = 1
    return ids.to(device), am.to(device)
