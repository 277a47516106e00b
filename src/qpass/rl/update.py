"""The policy update of one GRPO step: PPO epochs x minibatches of :func:`qpass.rl.loss.grpo_loss`.

:func:`ppo_update` runs ``epochs`` passes over fixed micro-batches (their *compositions* never
change within a step; epoch 0 takes them in order, later epochs in a seeded random order), split
into ``minibatches`` contiguous groups, one optimizer step per non-empty group with gradient
accumulation over its micro-batches. The loss's outer denominator is the group's valid-token count
(``agg="token_mean"``) or its number of non-empty responses (``seq_mean``). A micro-batch without a
loss token, or whose advantages are all exactly 0 under ``beta == 0``, contributes exactly 0 loss
and gradient and is skipped (counted). :class:`LossStats` aggregates the loss statistics into the
``loss/`` and ``opt/`` keys of a GRPO row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from qpass.quant.reuse import ReuseStore, reuse_weight_quantization
from qpass.rl.experience import Experience, response_logprobs
from qpass.rl.loss import LossConfig, grpo_loss

__all__ = ["LossStats", "UpdateOutcome", "UpdateSchedule", "minibatch_sizes", "ppo_update"]

_COUNTS = ("n_dropped", "n_kl_dropped", "n_pos", "n_neg", "n_clip_pos", "n_clip_neg", "n_coupled_clip_pos", "n_coupled_clip_neg")
_WEIGHTED = ("clip_frac", "clip_low_frac", "clip_high_frac")


class LossStats:
    """Aggregates :func:`grpo_loss` stats over the micro-batches and optimizer steps of one update."""

    def __init__(self) -> None:
        self.tokens = 0.0
        self.counts = dict.fromkeys(_COUNTS, 0.0)
        self.weighted = dict.fromkeys(_WEIGHTED, 0.0)
        self.mb_losses: list[float] = []
        self.mb_pg: list[float] = []
        self.mb_kl: list[float] = []
        self.ratio_min, self.ratio_max = math.inf, -math.inf
        self.micro_done = self.micro_skipped = self.minibatch_empty = 0
        self.opt: list[dict[str, float]] = []
        self._cur = [0.0, 0.0, 0.0]

    def start_minibatch(self) -> None:
        self._cur = [0.0, 0.0, 0.0]

    def add(self, stats: dict[str, float]) -> None:
        """One micro-batch's ``grpo_loss(...).stats``."""
        n = stats["n_tokens"]
        self.tokens += n
        for k in self.counts:
            self.counts[k] += stats[k]
        for k in self.weighted:
            self.weighted[k] += stats[k] * n
        if math.isfinite(stats["ratio_min"]):
            self.ratio_min = min(self.ratio_min, stats["ratio_min"])
            self.ratio_max = max(self.ratio_max, stats["ratio_max"])
        self._cur[0] += stats["loss"]
        self._cur[1] += stats["pg_loss"]
        self._cur[2] += stats.get("kl", 0.0)
        self.micro_done += 1

    def end_minibatch(self) -> None:
        self.mb_losses.append(self._cur[0])
        self.mb_pg.append(self._cur[1])
        self.mb_kl.append(self._cur[2])

    def result(self) -> dict[str, float]:
        """The ``loss/...`` and ``opt/...`` keys (NaN where nothing was measured)."""
        nan = float("nan")
        mean = (lambda xs: sum(xs) / len(xs) if xs else nan)  # noqa: E731
        out = {
            "loss/loss": mean(self.mb_losses),
            "loss/pg_loss": mean(self.mb_pg),
            "loss/kl": mean(self.mb_kl),
            "loss/tokens_processed": self.tokens,
            "loss/ratio_min": self.ratio_min if self.tokens else nan,
            "loss/ratio_max": self.ratio_max if self.tokens else nan,
            "loss/micro_done": float(self.micro_done),
            "loss/micro_skipped_zero_adv": float(self.micro_skipped),
            "loss/minibatch_empty": float(self.minibatch_empty),
        }
        for k, v in self.counts.items():
            out[f"loss/{k}"] = v
        c = self.counts
        # per advantage sign, over every update forward: the loss's own ratio and the coupled p_theta / q
        out["loss/clip_pos_frac"] = c["n_clip_pos"] / c["n_pos"] if c["n_pos"] else nan
        out["loss/clip_neg_frac"] = c["n_clip_neg"] / c["n_neg"] if c["n_neg"] else nan
        out["loss/coupled_clip_pos_frac"] = c["n_coupled_clip_pos"] / c["n_pos"] if c["n_pos"] else nan
        out["loss/coupled_clip_neg_frac"] = c["n_coupled_clip_neg"] / c["n_neg"] if c["n_neg"] else nan
        for k, v in self.weighted.items():
            out[f"loss/{k}"] = v / self.tokens if self.tokens else nan
        steps = [o for o in self.opt if not o["skipped"]]
        out["opt/steps"] = float(len(steps))
        out["opt/skipped"] = float(len(self.opt) - len(steps))
        out["opt/grad_norm"] = mean([o["grad_norm"] for o in self.opt])
        out["opt/grad_norm_max"] = max((o["grad_norm"] for o in self.opt), default=nan)
        out["opt/n_changed"] = sum(o["n_changed"] for o in self.opt)
        out["opt/changed_frac"] = mean([o["changed_frac"] for o in steps])
        return out


@dataclasses.dataclass(frozen=True)
class UpdateSchedule:
    """How one update walks its micro-batches.

    Attributes:
        epochs: passes over all micro-batches (>= 1).
        minibatches: optimizer steps per epoch (>= 1, <= number of micro-batches).
        shuffle_seed: seeds the ``torch.Generator`` that orders epochs 1.. (63-bit int).
        grad_clip: gradient-norm clip handed to ``opt.step``.
        temperature, top_p: the sampling distribution the log-probs are taken under (SPEC §4).
    """

    epochs: int
    minibatches: int
    shuffle_seed: int
    grad_clip: float
    temperature: float = 1.0
    top_p: float = 1.0


@dataclasses.dataclass(frozen=True)
class UpdateOutcome:
    """What :func:`ppo_update` did.

    Attributes:
        stats: ``loss/...``, ``opt/...`` (:meth:`LossStats.result`) plus
            ``check/first_minibatch_ratio_maxdev`` (max ``|log p_theta - log p_prox|`` over the loss
            tokens of epoch 0's first minibatch; NaN when it had none) and
            ``check/first_minibatch_ratio_exact`` (that max is exactly 0; None when not measured).
        forwards: ``(row indices int64 [n], detached log p_theta float32 [n, R])`` of every update
            forward, in order (a row appears once per forward it took part in).
    """

    stats: dict[str, Any]
    forwards: list[tuple[torch.Tensor, torch.Tensor]]


def minibatch_sizes(n_micro: int, minibatches: int) -> list[int]:
    """Sizes of ``minibatches`` contiguous groups of ``n_micro`` micro-batches (the first ones one larger)."""
    return [n_micro // minibatches + (1 if i < n_micro % minibatches else 0) for i in range(minibatches)]


def _normalizer(valid: torch.Tensor, agg: str) -> float:
    return float(valid.sum()) if agg == "token_mean" else float((valid.sum(-1) > 0).sum())


def ppo_update(policy: Any, opt: Any, exp: Experience, adv: torch.Tensor, lprox: torch.Tensor, lref: torch.Tensor | None,
               micro: Sequence[torch.Tensor], loss_cfg: LossConfig, schedule: UpdateSchedule, *,
               route_scope: Callable[[torch.Tensor], Any] | None = None, reuse: ReuseStore | None = None) -> UpdateOutcome:
    """PPO epochs x minibatches of :func:`grpo_loss` over fixed micro-batches (module docstring).

    Args:
        policy: the learner (``policy(input_ids, attention_mask) -> logits``, trained in place).
        opt: ``zero_grad()`` and ``step(grad_clip) -> {"skipped", "grad_norm", "n_changed", "changed_frac"}``
            (:class:`qpass.apps.grpo.weights.MasterOptimizer`).
        exp: the sampled rows; ``exp.response_mask`` [N, R] bool selects loss tokens, ``exp.logq`` [N, R].
        adv: float32 [N] advantages on ``exp``'s device.
        lprox, lref: float32 [N, R] proximal / reference log-probs (``lref`` None when ``beta == 0``).
        micro: int64 index blocks over ``range(N)`` (:func:`qpass.rl.experience.micro_batches`).
        loss_cfg: the loss (``agg``, ``beta``, clip, correction).
        schedule: :class:`UpdateSchedule`.
        route_scope: ``idx -> context manager`` around each forward (MoE routing replay); None: none.
        reuse: the weight-quantization store a minibatch's micro-batches share (``opt.step`` bumps
            the parameter versions, so a new minibatch quantizes the new weights); None: a fresh one.
    Returns:
        :class:`UpdateOutcome`.
    """
    agg = LossStats()
    forwards: list[tuple[torch.Tensor, torch.Tensor]] = []
    gen = torch.Generator().manual_seed(schedule.shuffle_seed)
    n_mb, mask = len(micro), exp.response_mask
    store = reuse if reuse is not None else ReuseStore()
    scope = route_scope or (lambda idx: contextlib.nullcontext(None))
    first_dev = None
    for epoch in range(schedule.epochs):
        order = list(range(n_mb)) if epoch == 0 else torch.randperm(n_mb, generator=gen).tolist()
        start = 0
        for g, size in enumerate(minibatch_sizes(n_mb, schedule.minibatches)):
            group = order[start:start + size]
            start += size
            rows = torch.cat([micro[j] for j in group])
            norm = _normalizer(mask[rows.to(mask.device)], loss_cfg.agg)
            if norm == 0:
                agg.minibatch_empty += 1
                continue
            opt.zero_grad()
            agg.start_minibatch()
            did = False
            # the first minibatch reuses the proximal pass's QDQ, later micro-batches of a minibatch the first one's
            with reuse_weight_quantization(store):
                for j in group:
                    idx = micro[j].to(mask.device)
                    sub = exp.select(idx)
                    if not bool(sub.response_mask.any()) or (loss_cfg.beta == 0 and not bool((adv[idx] != 0).any())):
                        agg.micro_skipped += 1
                        continue
                    with scope(idx):
                        logp, _ = response_logprobs(policy, sub, temperature=schedule.temperature, top_p=schedule.top_p)
                    out = grpo_loss(logp, lprox[idx], sub.logq, adv[idx], sub.response_mask, loss_cfg,
                                    logp_ref=None if lref is None else lref[idx], normalizer=norm)
                    out.loss.backward()
                    did = True
                    agg.add(out.stats)
                    forwards.append((idx, logp.detach()))
                    if epoch == 0 and g == 0:
                        first_dev = max(first_dev or 0.0, _max_logp_dev(logp.detach(), lprox[idx], sub.response_mask))
            if did:
                agg.end_minibatch()
                agg.opt.append(opt.step(schedule.grad_clip))
    res: dict[str, Any] = agg.result()
    res["check/first_minibatch_ratio_maxdev"] = first_dev if first_dev is not None else float("nan")
    res["check/first_minibatch_ratio_exact"] = (first_dev == 0.0) if first_dev is not None else None
    return UpdateOutcome(res, forwards)


@torch.no_grad()
def _max_logp_dev(logp: torch.Tensor, lprox: torch.Tensor, mask: torch.Tensor) -> float:
    """max ``|logp - lprox|`` over ``mask`` (NaN counts as inf; 0 on no token)."""
    d = torch.where(mask, (logp - lprox).abs(), torch.zeros_like(logp))
    return float(torch.nan_to_num(d, nan=math.inf).max())
