"""Rewards and group advantages of one batch of sampled responses, and their row keys.

:func:`score_responses` asks a :class:`qpass.rl.task.SafeReward` for every response (failures are
0 and counted by the wrapper), normalizes per group (:func:`qpass.rl.loss.group_advantages`: an
all-equal group gets exactly 0) and records correctness with a separate ``answer_fn``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from qpass.rl.loss import group_advantages

__all__ = ["FAILURE_KEYS", "ScoredResponses", "score_responses"]

#: the :meth:`SafeReward.stats` counters reported per step (``<key>_step``).
FAILURE_KEYS = ("reward/n_failures", "reward/n_exceptions", "reward/n_nonfinite", "reward/n_bad_type", "reward/n_empty")


@dataclasses.dataclass(frozen=True)
class ScoredResponses:
    """Rewards of ``N = n_groups * group_size`` responses (group-major order).

    Attributes:
        rewards: float64 [N] (CPU).
        advantages: float64 [N] group-normalized (CPU).
        correct: N bools (``answer_fn(meta, text) >= 1``).
        failures: ``{FAILURE_KEYS[i] + "_step": count}`` of this batch.
        group_size: G.
    """

    rewards: torch.Tensor
    advantages: torch.Tensor
    correct: list[bool]
    failures: dict[str, int]
    group_size: int

    @property
    def zero_groups(self) -> int:
        """Groups whose rewards are all equal (advantages exactly 0)."""
        r = self.rewards.view(-1, self.group_size)
        return int((r.amax(-1) == r.amin(-1)).sum())

    def row(self) -> dict[str, Any]:
        """The ``reward/...`` and ``adv/...`` keys of a GRPO row."""
        r, n_groups = self.rewards, self.rewards.numel() // self.group_size
        zg = self.zero_groups
        return {
            "reward/mean": float(r.mean()), "reward/std": float(r.std()) if len(r) > 1 else 0.0,
            "reward/max": float(r.max()), "reward/correct_frac": sum(self.correct) / len(self.correct),
            **self.failures,
            "adv/zero_groups": zg, "adv/zero_group_frac": zg / n_groups,
            "adv/abs_mean": float(self.advantages.abs().mean()),
        }


def score_responses(reward: Any, answer_fn: Callable[[dict, str], float], metas: Sequence[dict], texts: Sequence[str],
                    group_size: int) -> ScoredResponses:
    """Rewards, advantages and correctness of ``texts`` (one per ``metas`` entry, group-major).

    Args:
        reward: a :class:`qpass.rl.task.SafeReward` (``reward(meta, text) -> float``, ``stats()``).
        answer_fn: correctness (``>= 1.0``: correct).
        metas, texts: N problem metadata / response texts, ``N % group_size == 0``.
        group_size: G >= 1.
    Raises:
        ValueError: from :func:`group_advantages` (N not a multiple of G).
    """
    before = reward.stats()
    rewards = torch.tensor([reward(m, x) for m, x in zip(metas, texts)], dtype=torch.float64)
    after = reward.stats()
    adv = group_advantages(rewards, group_size=group_size)
    correct = [answer_fn(m, x) >= 1.0 for m, x in zip(metas, texts)]
    return ScoredResponses(rewards, adv, correct, {k + "_step": after[k] - before[k] for k in FAILURE_KEYS}, group_size)
