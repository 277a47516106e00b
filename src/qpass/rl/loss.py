"""GRPO objective with decoupled importance correction (SPEC §5).

Three policies score each sampled token (SPEC §5): the behavior policy ``q`` (rollout engine, the
one that sampled), the proximal policy ``p_prox`` (learner weights at the rollout snapshot,
recomputed by the learner) and the current learner ``p_theta``.

    A_i   = (R_i - mean_G R) / (std_G R + 1e-6)                (group-normalized advantage)
    c_t   = p_prox / q                                        (mismatch ratio, no gradient)
    r_t   = p_theta / p_prox                                  (PPO ratio, gradient through p_theta)
    L     = -(1/N) sum_t sg(c_bar_t) * min(r_t A, clip(r_t, 1-eps_low, 1+eps_high) A) + beta * KL
    none: c_bar = 1   is: c_bar = c   TIS: c_bar = min(c, C)   MIS: c_bar = c * 1[lo <= c <= hi]

Two ratio modes (:attr:`LossConfig.ratio`):

* ``"decoupled"`` (above; AReaL decoupled PPO, Miles decoupled TIS): the trust region is around
  the proximal policy, the rollout mismatch enters only through ``c_bar``;
* ``"coupled"``: ``r_t = p_theta / q`` with ``c_bar = 1`` (classic PPO with the behaviour
  log-probs as "old"): the rollout mismatch sits *inside* the clipped ratio, which is the setting
  in which a naive W4A4 rollout lets ratios leave the trust region (QUADS §3). ``correction`` must
  be ``none`` there (there is no ``p_prox`` to correct against).

Whatever the mode, the stats also report the clip branches of the *other* ratio's counterpart:
``coupled_clip_{pos,neg}_frac`` are the clip fractions of ``p_theta / q`` per advantage sign, so a
decoupled run logs how often a coupled PPO would have clipped on the same tokens.

Conventions chosen here (each is a documented, tested decision):

* **std**: the *sample* standard deviation (Bessel, ``n - 1``) by default, as verl, Miles/slime,
  TRL, OpenRLHF and AReaL use (``prior-art/rl_systems.md`` §2.1), so advantages are comparable to
  published runs; ``std="population"`` is available. A group whose rewards are all *exactly*
  equal (including a single-response group) gets advantage exactly 0: the test is
  ``max == min`` on the rewards, not ``std < tol``, so floating-point residue in the mean
  (``[0.1]*3`` has ``mean - 0.1 = 1.4e-17``) cannot produce a non-zero advantage. Means and
  standard deviations are two-pass in float64.
* **N** counts valid tokens *before* any correction masking: MIS-masked and non-finite-dropped
  tokens contribute 0 to the sum and stay in the denominator (NeMo-RL, OpenRLHF, AReaL #1088,
  Miles/slime after #1931; not slime #657). ``agg="seq_mean"`` averages per response over its
  valid tokens (same before-masking count) and then over responses that have at least one valid
  token; a response with none is excluded, not given a phantom count of 1 (miles #2796).
  ``normalizer`` overrides the outer denominator (global token or response count under gradient
  accumulation / data parallelism).
* **Non-finite log-ratios** (``prior-art/rl_systems.md`` §2.9): a valid token whose ``log c`` or
  ``log r`` is NaN or +-inf (e.g. ``log q = -inf`` for a token the rollout sampled), or whose
  per-token term ``c_bar * min(r A, clip(r) A)`` overflows the compute dtype (``c`` or ``r``
  beyond ~3e38 in float32), is **dropped**: ``c_bar = 0``, no gradient, still counted in ``N``,
  counted in ``stats["n_dropped"]``. This is NeMo-RL's
  choice (``nan_to_num(posinf=0)``) and TRL's ``*_mask`` modes; it differs from AReaL (log-ratio
  -> 0, weight 1: pretends there is no mismatch), verl (clamp the log-ratio to 20, then truncate
  to C) and Miles TIS (weight C): those give the most broken token the full or maximal weight.
  An infinite ``c`` lies outside every MIS interval, so dropping is what MIS would do anyway.
  ``nonfinite="raise"`` turns any such token into a ``ValueError`` instead. Values at invalid
  positions are never read (garbage, NaN or 1e9 there is harmless).
* **KL** (optional, ``beta > 0``): the k3 estimator ``e^u - u - 1`` with ``u = log p_ref -
  log p_theta`` per valid token (DeepSeekMath GRPO), *not* importance-weighted, aggregated like
  the policy term; non-finite ``u`` follow the drop policy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch

from qpass.diagnostics.masks import as_bool_mask, broadcast_advantages, check_token_tensor
from qpass.diagnostics.metrics import CLIPPED_HIGH, CLIPPED_LOW, ppo_clip_branch
from qpass.diagnostics.robust import pow2_exponent, stable_mean

__all__ = [
    "Correction",
    "LossConfig",
    "LossOutput",
    "correction_affected_frac",
    "correction_weights",
    "group_advantages",
    "grpo_loss",
]

ADV_EPS = 1e-6
_HUGE_REWARD = 2.0 ** 500  # above: a group's float64 sums of squares could overflow (group_advantages rescales)
#: Correction kinds of :class:`Correction` (the CLI's ``--correction`` choices).
CORRECTIONS = ("none", "is", "tis", "mis")
#: Ratio modes of :class:`LossConfig` (the CLI's ``--ratio`` choices).
RATIO_MODES = ("decoupled", "coupled")


# --------------------------------------------------------------------------- advantages


def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_size: int | None = None,
    *,
    group_ids: torch.Tensor | Sequence[int] | None = None,
    eps: float = ADV_EPS,
    std: Literal["sample", "population"] = "sample",
    scale: bool = True,
) -> torch.Tensor:
    """Group-normalized GRPO advantages ``A_i = (R_i - mean_G R) / (std_G R + eps)`` (SPEC §5).

    Args:
        rewards: 1-D ``[n]`` float rewards (a tensor or a sequence), finite.
        group_size: ``G`` when groups are contiguous: responses ``[g*G, (g+1)*G)`` share a prompt;
            ``n % G == 0``. Give exactly one of ``group_size`` and ``group_ids``.
        group_ids: int ``[n]`` group label per response (any labels; groups may have different
            sizes, including 1).
        eps: added to the std (1e-6 per SPEC §5; verl/Miles use 1e-6, TRL 1e-4, AReaL 1e-5).
        std: ``"sample"`` (Bessel, ``n_G - 1``; default, as verl/Miles/TRL/OpenRLHF/AReaL) or
            ``"population"`` (``n_G``).
        scale: False returns ``R_i - mean_G R`` (centering only: Dr. GRPO / Miles
            ``--disable-grpo-std-normalization``). All-equal groups are still exactly 0.
    Returns:
        ``[n]`` advantages, dtype of ``rewards`` if floating else float32. A group whose rewards
        are all exactly equal (any singleton group) gets exactly 0.
    Raises:
        ValueError: not 1-D, a non-finite reward (index named), both/neither of group_size and
            group_ids, ``n % group_size != 0``, bad ``group_ids`` length, bad ``std`` or ``eps``.
    """
    r = torch.as_tensor(rewards)
    out_dtype = r.dtype if r.is_floating_point() else torch.float32
    if r.dim() != 1:
        raise ValueError(f"rewards must be 1-D [n], got shape {tuple(r.shape)}")
    r64 = r.detach().to(torch.float64)
    bad = ~torch.isfinite(r64)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"rewards must be finite; rewards[{i}] = {float(r64[i])} (wrap reward functions with safe_reward)")
    if std not in ("sample", "population"):
        raise ValueError(f"std must be 'sample' or 'population', got {std!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    n = r64.shape[0]
    if (group_size is None) == (group_ids is None):
        raise ValueError("give exactly one of group_size and group_ids")
    if group_size is not None:
        if int(group_size) < 1 or n % int(group_size):
            raise ValueError(f"group_size={group_size} must be >= 1 and divide len(rewards)={n}")
        inv = torch.arange(n, device=r64.device) // int(group_size)
    else:
        ids = torch.as_tensor(group_ids, device=r64.device)
        if tuple(ids.shape) != (n,):
            raise ValueError(f"group_ids must have shape ({n},), got {tuple(ids.shape)}")
        _, inv = torch.unique(ids, return_inverse=True)
    if n == 0:
        return torch.zeros(0, dtype=out_dtype, device=r.device)
    n_groups = int(inv.max()) + 1
    counts = torch.bincount(inv, minlength=n_groups).to(torch.float64)
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=r64.device)
    gmax = zeros.scatter_reduce(0, inv, r64, reduce="amax", include_self=False)
    gmin = zeros.scatter_reduce(0, inv, r64, reduce="amin", include_self=False)
    equal = (gmax == gmin)[inv]
    # Huge finite rewards (|R| > 2^500): the group sums, R - mean and the squares would overflow float64
    # (inf / inf = NaN, or a silent 0); such groups are computed on R * 2^-e (exact), with eps scaled
    # alike, which gives the same advantages. Other groups (every float32 reward) are not touched.
    gabs = torch.maximum(gmax.abs(), gmin.abs())
    big = gabs > _HUGE_REWARD
    unit = torch.ones_like(gabs)
    if bool(big.any()):
        expo = torch.frexp(torch.where(big, gabs, unit)).exponent.to(torch.float64) - 2
        unit = torch.where(big, torch.exp2(-expo), unit)
        r64 = r64 * unit[inv]
    mean = zeros.index_add(0, inv, r64) / counts
    centered = r64 - mean[inv]
    if scale:
        ss = zeros.index_add(0, inv, centered * centered)
        dof = counts - 1 if std == "sample" else counts
        sd = torch.sqrt(ss / dof.clamp(min=1))  # singleton groups: never used (equal -> 0)
        adv = centered / (sd[inv] + eps * unit[inv]) if bool(big.any()) else centered / (sd[inv] + eps)
    else:
        adv = centered / unit[inv] if bool(big.any()) else centered
    adv = torch.where(equal, torch.zeros_like(adv), adv)
    return adv.to(out_dtype).to(r.device)


# --------------------------------------------------------------------------- corrections


@dataclasses.dataclass(frozen=True)
class Correction:
    """Importance correction of the mismatch ratio ``c = p_prox / q`` (SPEC §5, B1).

    Attributes:
        kind: ``"none"`` (``c_bar = 1``: no importance correction at all), ``"is"`` (``c_bar = c``:
            untruncated importance weights), ``"tis"`` (``c_bar = min(c, cap)``) or ``"mis"``
            (``c_bar = c * 1[lo <= c <= hi]``, bounds inclusive).
        cap: TIS cap ``C`` (Miles/slime/verl default 2.0; TRL 3.0). Must be > 0.
        lo, hi: MIS bounds (Miles mis.yaml 0.5/2.0; NeMo-RL/OpenRLHF 0.5/5.0). ``0 <= lo <= hi``.
    """

    kind: Literal["none", "is", "tis", "mis"] = "none"
    cap: float = 2.0
    lo: float = 0.5
    hi: float = 2.0

    def __post_init__(self) -> None:
        if self.kind not in CORRECTIONS:
            raise ValueError(f"Correction.kind must be one of {list(CORRECTIONS)}, got {self.kind!r}")
        if not (self.cap > 0 and math.isfinite(self.cap)):
            raise ValueError(f"Correction.cap must be finite and > 0, got {self.cap}")
        if not (0 <= self.lo <= self.hi and math.isfinite(self.hi)):
            raise ValueError(f"Correction bounds must satisfy 0 <= lo <= hi < inf, got lo={self.lo}, hi={self.hi}")


def correction_weights(c: torch.Tensor, correction: Correction) -> tuple[torch.Tensor, torch.Tensor]:
    """Corrected weights ``c_bar`` and the tokens the correction changed.

    Args:
        c: float tensor of ratios ``p_prox / q`` (``>= 0``; ``+inf`` allowed; no NaN).
        correction: :class:`Correction`.
    Returns:
        ``(c_bar, affected)``: ``c_bar`` same shape/dtype (all 1 under none, ``c`` under is,
        ``+inf`` -> ``cap`` under TIS, -> 0 under MIS); ``affected`` bool: ``c > cap`` (TIS),
        ``c`` outside ``[lo, hi]`` (MIS), ``c != 1`` (none: every token whose weight the
        correction would have changed is ignored), all False (is).
    """
    if correction.kind == "none":
        return torch.ones_like(c), c != 1
    if correction.kind == "tis":
        cap = torch.full_like(c, correction.cap)
        return torch.minimum(c, cap), c > cap
    if correction.kind == "mis":
        keep = (c >= correction.lo) & (c <= correction.hi)
        return torch.where(keep, c, torch.zeros_like(c)), ~keep
    return c, torch.zeros_like(c, dtype=torch.bool)


@torch.no_grad()
def correction_affected_frac(logp_prox: torch.Tensor, logq: torch.Tensor, mask: torch.Tensor, correction: Correction) -> float:
    """Fraction of the loss tokens whose weight ``correction`` changes (``corr/affected_frac``).

    Args:
        logp_prox, logq: float [N, R] proximal / behaviour log-probs (ratio ``c = exp(logp_prox - logq)``
            in float64).
        mask: bool [N, R] loss tokens.
        correction: :class:`Correction` (:func:`correction_weights` says which tokens count as changed).
    Returns:
        affected tokens / tokens of ``mask``; NaN when ``mask`` selects none.
    """
    n_valid = int(mask.sum())
    c = torch.exp(torch.where(mask, logp_prox.double() - logq.double(), torch.zeros_like(logp_prox, dtype=torch.float64)))
    _, affected = correction_weights(c, correction)
    return float((affected & mask).sum()) / n_valid if n_valid else float("nan")


# --------------------------------------------------------------------------- loss


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Options of :func:`grpo_loss`.

    Attributes:
        eps_low, eps_high: asymmetric clip range ``[1 - eps_low, 1 + eps_high]`` (default DAPO's
            0.2 / 0.28). ``0 <= eps_low < 1``, ``eps_high >= 0``.
        ratio: ``"decoupled"`` (``r = p_theta / p_prox`` times ``c_bar``) or ``"coupled"``
            (``r = p_theta / q``, ``c_bar = 1``; needs ``correction.kind == "none"``).
        correction: :class:`Correction` of ``c = p_prox / q``.
        agg: ``"token_mean"`` (SPEC §5 ``-(1/N) sum_t``) or ``"seq_mean"``.
        beta: KL coefficient (0 = no KL term).
        kl_log_ratio_clamp: optional ``c > 0`` clamping ``u = log p_ref - log p_theta`` to
            ``[-c, c]`` inside k3 (NeMo-RL/Miles use 20); None = unclamped.
        nonfinite: ``"drop"`` (default; see module docstring) or ``"raise"``.
    """

    eps_low: float = 0.2
    eps_high: float = 0.28
    ratio: Literal["decoupled", "coupled"] = "decoupled"
    correction: Correction = dataclasses.field(default_factory=Correction)
    agg: Literal["token_mean", "seq_mean"] = "token_mean"
    beta: float = 0.0
    kl_log_ratio_clamp: float | None = None
    nonfinite: Literal["drop", "raise"] = "drop"

    def __post_init__(self) -> None:
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low}")
        if not self.eps_high >= 0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
        if self.agg not in ("token_mean", "seq_mean"):
            raise ValueError(f"agg must be 'token_mean' or 'seq_mean', got {self.agg!r}")
        if not (self.beta >= 0 and math.isfinite(self.beta)):
            raise ValueError(f"beta must be finite and >= 0, got {self.beta}")
        if self.kl_log_ratio_clamp is not None and not self.kl_log_ratio_clamp > 0:
            raise ValueError(f"kl_log_ratio_clamp must be > 0 or None, got {self.kl_log_ratio_clamp}")
        if self.nonfinite not in ("drop", "raise"):
            raise ValueError(f"nonfinite must be 'drop' or 'raise', got {self.nonfinite!r}")
        if not isinstance(self.correction, Correction):
            raise TypeError(f"correction must be a Correction, got {type(self.correction).__name__}")
        if self.ratio not in RATIO_MODES:
            raise ValueError(f"ratio must be one of {list(RATIO_MODES)}, got {self.ratio!r}")
        if self.ratio == "coupled" and self.correction.kind != "none":
            raise ValueError(f"ratio='coupled' (r = p_theta / q) takes no importance correction; got correction "
                             f"{self.correction.kind!r} (use ratio='decoupled' for is/tis/mis)")


class LossOutput(NamedTuple):
    """``(loss, stats)``: scalar loss tensor (differentiable w.r.t. ``logp``) and float stats."""

    loss: torch.Tensor
    stats: dict[str, float]


def _aggregate(per_tok: torch.Tensor, valid: torch.Tensor, agg: str, normalizer: float | None) -> torch.Tensor:
    """Token-mean or sequence-mean of ``per_tok`` (exactly 0 off ``valid``), denominators before masking."""
    if agg == "token_mean":
        den = float(valid.sum()) if normalizer is None else float(normalizer)
        return per_tok.sum() / max(den, 1.0)  # den == 0 only when the sum is exactly 0
    n_i = valid.sum(-1)
    per_row = per_tok.sum(-1) / n_i.clamp(min=1).to(per_tok.dtype)
    den = float((n_i > 0).sum()) if normalizer is None else float(normalizer)
    return per_row.sum() / max(den, 1.0)


def _masked_stat(x: torch.Tensor, sel: torch.Tensor, how: str) -> float:
    if not bool(sel.any()):
        return float("nan")
    v = x[sel]
    if how == "mean" and pow2_exponent(float(v.abs().max()), v.numel()):  # huge finite values: rescaled sum
        return stable_mean(v, v.numel())
    return float({"mean": v.mean, "min": v.min, "max": v.max}[how]())


def _k3_kl(lp: torch.Tensor, lref: torch.Tensor, valid: torch.Tensor, cfg: LossConfig,
           normalizer: float | None) -> tuple[torch.Tensor, int]:
    """The aggregated k3 estimator of ``KL(p_theta || p_ref)`` (gradient through ``lp``) and the number of
    valid tokens dropped for a non-finite ``log p_ref - log p_theta`` (ValueError under ``nonfinite='raise'``)."""
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    with torch.no_grad():
        u0 = torch.where(valid, lref - lp.detach(), zero)
        if cfg.kl_log_ratio_clamp is not None:
            u0 = u0.clamp(-cfg.kl_log_ratio_clamp, cfg.kl_log_ratio_clamp)
        kl_ok = valid & torch.isfinite(u0) & torch.isfinite(torch.expm1(torch.where(torch.isfinite(u0), u0, zero)))
        n_kl_dropped = int((valid & ~kl_ok).sum())
        if cfg.nonfinite == "raise" and n_kl_dropped:
            raise ValueError(f"{n_kl_dropped} valid token(s) with a non-finite log p_ref - log p_theta; cfg.nonfinite='raise'")
    u = torch.where(kl_ok, lref - lp, zero)
    if cfg.kl_log_ratio_clamp is not None:
        u = u.clamp(-cfg.kl_log_ratio_clamp, cfg.kl_log_ratio_clamp)
    k3 = torch.expm1(u) - u  # e^u - u - 1, exactly 0 off kl_ok
    return _aggregate(k3, valid, cfg.agg, normalizer), n_kl_dropped


def _loss_stats(cfg: LossConfig, loss: torch.Tensor, pg_loss: torch.Tensor, kl_loss: torch.Tensor, kl_val: torch.Tensor | None,
                n_kl_dropped: int, valid: torch.Tensor, ok: torch.Tensor, drop: torch.Tensor, affected: torch.Tensor,
                r: torch.Tensor, a: torch.Tensor, lp: torch.Tensor, lq: torch.Tensor, c_raw: torch.Tensor,
                c_bar: torch.Tensor) -> dict[str, float]:
    """The ``stats`` of :func:`grpo_loss` (its docstring lists the keys)."""
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    with torch.no_grad():
        n_tok = int(valid.sum())
        den = max(n_tok, 1)
        branch = ppo_clip_branch(r.detach(), a, cfg.eps_low, cfg.eps_high)
        c_low = int((ok & (branch == CLIPPED_LOW)).sum())
        c_high = int((ok & (branch == CLIPPED_HIGH)).sum())
        pos, neg = ok & (a > 0), ok & (a < 0)
        # the coupled ratio p_theta / q on the same tokens, whatever ratio the loss uses
        log_rc = torch.where(ok, lp.detach() - lq, zero)
        branch_c = ppo_clip_branch(torch.exp(log_rc), a, cfg.eps_low, cfg.eps_high)
        n_pos, n_neg = int(pos.sum()), int(neg.sum())
        c64 = c_raw.double()
        stats = {
            "loss": float(loss.detach()),
            "pg_loss": float(pg_loss.detach()),
            "kl_loss": float(kl_loss.detach()) if cfg.beta > 0 else 0.0,
            "n_tokens": float(n_tok),
            "n_seqs": float((valid.sum(-1) > 0).sum()),
            "n_dropped": float(drop.sum()),
            "dropped_frac": float(drop.sum()) / den,
            "n_kl_dropped": float(n_kl_dropped),
            "clip_frac": (c_low + c_high) / den,
            "clip_low_frac": c_low / den,
            "clip_high_frac": c_high / den,
            "n_pos": float(n_pos),
            "n_neg": float(n_neg),
            "n_clip_pos": float(c_high),
            "n_clip_neg": float(c_low),
            "clip_pos_frac": c_high / n_pos if n_pos else float("nan"),
            "clip_neg_frac": c_low / n_neg if n_neg else float("nan"),
            "n_coupled_clip_pos": float(int((pos & (branch_c == CLIPPED_HIGH)).sum())),
            "n_coupled_clip_neg": float(int((neg & (branch_c == CLIPPED_LOW)).sum())),
            "ratio_mean": _masked_stat(r.detach().double(), ok, "mean"),
            "ratio_min": _masked_stat(r.detach().double(), ok, "min"),
            "ratio_max": _masked_stat(r.detach().double(), ok, "max"),
            "c_mean": _masked_stat(c64, ok, "mean"),
            "c_min": _masked_stat(c64, ok, "min"),
            "c_max": _masked_stat(c64, ok, "max"),
            "cbar_mean": stable_mean(c_bar.double(), den),
            "tis_truncated_frac": float((ok & affected).sum()) / den if cfg.correction.kind == "tis" else 0.0,
            "mis_masked_frac": float((ok & affected).sum()) / den if cfg.correction.kind == "mis" else 0.0,
        }
        if kl_val is not None:
            stats["kl"] = float(kl_val.detach())
    return stats


def _check_loss_inputs(logp: torch.Tensor, logp_prox: torch.Tensor | None, logq: torch.Tensor,
                       logp_ref: torch.Tensor | None, cfg: LossConfig, normalizer: float | None) -> None:
    """The argument checks of :func:`grpo_loss` (its Raises: bad tensors, beta without ``logp_ref``, bad normalizer)."""
    check_token_tensor(logp, "logp")
    shape = logp.shape
    if logp_prox is not None:
        check_token_tensor(logp_prox, "logp_prox", shape)
    check_token_tensor(logq, "logq", shape)
    if logp_ref is not None:
        check_token_tensor(logp_ref, "logp_ref", shape)
    if cfg.beta > 0 and logp_ref is None:
        raise ValueError(f"cfg.beta={cfg.beta} > 0 needs logp_ref")
    if normalizer is not None and not (float(normalizer) > 0 and math.isfinite(float(normalizer))):
        raise ValueError(f"normalizer must be finite and > 0, got {normalizer}")


@torch.no_grad()
def _correction_and_drops(lp: torch.Tensor, lprox: torch.Tensor, lq: torch.Tensor, anchor: torch.Tensor, a: torch.Tensor,
                          valid: torch.Tensor, cfg: LossConfig, zero: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(c_raw, c_bar, affected, drop, ok)`` of :func:`grpo_loss`, without gradient: the raw and corrected
    importance weights ``c = p_prox / q`` (``c_bar`` 0 off ``ok``), the tokens the correction changed, the
    valid tokens dropped (non-finite log-ratio, or an overflowing surrogate term) and the kept ones.

    Raises:
        ValueError: a dropped token under ``cfg.nonfinite == "raise"`` (names the first).
    """
    log_c = torch.where(valid, lprox - lq, zero)
    log_r0 = torch.where(valid, lp.detach() - anchor, zero)
    nonfinite = valid & (~torch.isfinite(log_c) | ~torch.isfinite(log_r0))
    c_raw = torch.exp(torch.where(nonfinite, zero, log_c))
    c_bar, affected = correction_weights(c_raw, cfg.correction)
    r0 = torch.exp(torch.where(nonfinite, zero, log_r0))
    term0 = c_bar * torch.minimum(r0 * a, torch.clamp(r0, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * a)
    overflow = valid & ~nonfinite & ~torch.isfinite(term0)  # e.g. c or r beyond the dtype's range
    drop = nonfinite | overflow
    if cfg.nonfinite == "raise" and bool(drop.any()):
        idx = tuple(int(i) for i in drop.nonzero()[0])
        raise ValueError(
            f"{int(drop.sum())} valid token(s) with a non-finite log-ratio or overflowing ratio "
            f"(first at {list(idx)}: log c = {float(log_c[idx])}, log r = {float(log_r0[idx])}); "
            "cfg.nonfinite='raise'"
        )
    ok = valid & ~drop
    c_bar = torch.where(ok, c_bar, zero)
    return c_raw, c_bar, affected, drop, ok


def grpo_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor | None,
    logq: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig | None = None,
    *,
    logp_ref: torch.Tensor | None = None,
    normalizer: float | None = None,
) -> LossOutput:
    """Decoupled (or coupled) clipped GRPO surrogate with IS/TIS/MIS correction and optional k3 KL (SPEC §5).

    Args:
        logp: float ``[B, T]``: ``log p_theta(a_t|h_t)`` of the current learner (requires grad).
        logp_prox: float ``[B, T]``: ``log p_prox`` (learner at the rollout snapshot; detached
            here), or None for the single-update case where ``p_prox = p_theta`` (``r = 1``;
            under ``ratio="coupled"`` it is only used for the ``c_*`` stats).
            Bypass mode (no separate recompute) is ``logp_prox=logq``, which makes ``c = 1``.
        logq: float ``[B, T]``: ``log q`` recorded by the rollout engine (detached here).
        adv: float ``[B]``, ``[B, 1]`` or ``[B, T]`` advantages (from :func:`group_advantages`),
            finite on valid tokens.
        mask: bool or 0/1 ``[B, T]``: True on valid tokens (response tokens in the loss).
        cfg: :class:`LossConfig` (default: eps 0.2/0.2, no correction, token mean, no KL).
        logp_ref: float ``[B, T]`` reference-policy log-probs; required when ``cfg.beta > 0``,
            else only logged (``stats["kl"]``).
        normalizer: optional outer denominator replacing ``N`` (token_mean) or the number of
            non-empty responses (seq_mean), e.g. the global count across micro-batches. > 0.
    Returns:
        :class:`LossOutput` ``(loss, stats)``. ``loss``: 0-dim tensor in
        ``promote(logp.dtype, float32)``. ``stats`` (Python floats; fractions over ``N``, the
        valid-token count before masking): ``loss``, ``pg_loss``, ``kl_loss`` (``beta * kl``),
        ``kl`` (k3 aggregated like the loss; only with ``logp_ref``), ``n_tokens``, ``n_seqs``, ``n_dropped``
        (non-finite policy), ``dropped_frac``, ``n_kl_dropped``, ``clip_frac``,
        ``clip_low_frac`` (A<0, r<1-eps_low), ``clip_high_frac`` (A>0, r>1+eps_high),
        ``clip_pos_frac`` / ``clip_neg_frac`` (the same numerators over the A>0 / A<0 token counts
        ``n_pos`` / ``n_neg``; numerators ``n_clip_pos`` / ``n_clip_neg``),
        ``n_coupled_clip_pos`` / ``n_coupled_clip_neg`` (clipped tokens of the coupled ratio
        ``p_theta / q`` per sign, in either mode),
        ``ratio_mean/min/max`` (r over kept tokens), ``c_mean/min/max`` (raw ``c`` before
        correction, over kept tokens), ``cbar_mean`` (``sum c_bar / N``: the average gradient
        weight, dropped/masked tokens as 0), ``tis_truncated_frac``, ``mis_masked_frac``.
    Raises:
        TypeError, ValueError: bad tensors (named), non-finite advantages on valid tokens,
            ``beta > 0`` without ``logp_ref``, bad ``normalizer``, or a non-finite log-ratio with
            ``cfg.nonfinite == "raise"``.
    Source: SPEC §5; decoupled PPO as in AReaL ``ppo_actor_loss_fn`` / Miles decoupled TIS.
    """
    cfg = cfg or LossConfig()
    _check_loss_inputs(logp, logp_prox, logq, logp_ref, cfg, normalizer)
    shape = logp.shape
    valid = as_bool_mask(mask, shape).to(logp.device)
    dtype = torch.promote_types(logp.dtype, torch.float32)
    dev = logp.device
    zero = torch.zeros((), dtype=dtype, device=dev)

    lp = logp.to(dtype)
    lprox = lp.detach() if logp_prox is None else logp_prox.detach().to(dev, dtype)
    lq = logq.detach().to(dev, dtype)
    a = broadcast_advantages(adv, shape).detach().to(dev, dtype)
    bad_adv = valid & ~torch.isfinite(a)
    if bool(bad_adv.any()):
        idx = tuple(int(i) for i in bad_adv.nonzero()[0])
        raise ValueError(f"adv must be finite on valid tokens; adv{list(idx)} = {float(a[idx])}")
    a = torch.where(valid, a, zero)

    anchor = lq if cfg.ratio == "coupled" else lprox  # the "old" policy of the PPO ratio
    c_raw, c_bar, affected, drop, ok = _correction_and_drops(lp, lprox, lq, anchor, a, valid, cfg, zero)

    log_r = torch.where(ok, lp - anchor, zero)  # gradient flows through lp on kept tokens only
    r = torch.exp(log_r)
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    surr = torch.minimum(r * a, torch.clamp(r, lo, hi) * a)
    per_tok = -(c_bar * surr)  # exactly 0 off ok (c_bar = 0, surr finite)
    pg_loss = _aggregate(per_tok, valid, cfg.agg, normalizer)

    kl_val, n_kl_dropped = zero, 0
    if logp_ref is not None:
        kl_val, n_kl_dropped = _k3_kl(lp, logp_ref.detach().to(dev, dtype), valid, cfg, normalizer)
    kl_loss = cfg.beta * kl_val if cfg.beta > 0 else zero
    loss = pg_loss + kl_loss

    stats = _loss_stats(cfg, loss, pg_loss, kl_loss, kl_val if logp_ref is not None else None, n_kl_dropped, valid, ok,
                        drop, affected, r, a, lp, lq, c_raw, c_bar)
    return LossOutput(loss, stats)
