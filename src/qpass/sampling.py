"""The sampling distribution both sides use: temperature, then top-p truncation, in float32.

SPEC §4: probabilities on both sides are those of the sampling distribution actually used (after
temperature and any truncation), so the rollout records ``log q`` with this function at sampling
time and the learner scores ``log p`` with the same function on its own logits.
"""

from __future__ import annotations

import torch


def sampling_logprobs(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """Log-probabilities of the sampling distribution.

    Args:
        logits: ``[..., V]`` any float dtype (computed in float32).
        temperature: > 0; logits are divided by it.
        top_p: in (0, 1]; keep the smallest set of most-likely tokens whose probability mass
            reaches ``top_p`` (the token that crosses the threshold is kept), renormalise, and give
            every other token ``-inf``.
    Returns:
        float32 ``[..., V]`` log-probabilities.
    Raises:
        ValueError: temperature <= 0 or top_p outside (0, 1].
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return lp
    sorted_lp, order = torch.sort(lp, dim=-1, descending=True)
    cum = sorted_lp.exp().cumsum(dim=-1)
    drop_sorted = (cum - sorted_lp.exp()) >= top_p  # mass *before* this token already reaches top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return torch.log_softmax(lp.masked_fill(drop, float("-inf")), dim=-1)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left-padded batches: ``cumsum(mask) - 1`` clamped at 0 (HF ``generate`` rule)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
