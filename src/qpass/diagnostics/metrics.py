"""Training-rollout mismatch metrics over sampled tokens (SPEC §4).

Notation (SPEC §1, §4): for a sampled token ``a_t`` after prefix ``h_t``, ``p`` is the learner
policy and ``q`` the behavior (rollout) policy, ``d_t = log p(a_t|h_t) - log q(a_t|h_t)`` and
``w_t = e^{d_t} = p/q`` (the importance weight of a sample drawn from ``q``). Only *valid*
tokens count (mask True: sampled response tokens in the loss); prompt, padding and loss-masked
positions are never read arithmetically, so garbage there cannot move any number.

Metrics (``N`` = number of valid tokens with finite ``d``, see the non-finite policy below):

* ``G_abs = (1/N) sum |d_t|`` and ``max |d_t|``.
* ``K1 = -(1/N) sum d_t`` and ``K3 = (1/N) sum (e^{d_t} - d_t - 1)``: both estimate KL(q || p)
  from samples of ``q`` (``E_q[e^d] = 1``); K1 can be negative, K3 >= 0 per token.
* normalized ESS ``(sum w)^2 / (n sum w^2)`` in (0, 1], raw (``w``) and truncated
  (``w_bar = min(w, C)``, upper cap only by default; ``ess_cap_low`` adds verl's lower clamp).

Each is reported in two reductions, separately:

* **token mean**: one pool of all valid tokens of the batch (ESS over that pool);
* **response mean**: the metric per response over its own valid tokens, then the unweighted mean
  over responses. Responses with no usable token are excluded (and counted), never given a
  phantom denominator of 1.

Correspondence with RL systems (``prior-art/rl_systems.md`` §2.5-2.7; their ``lp_old`` is our
``log p`` and ``lp_roll`` our ``log q``):

* ``G_abs`` response mean = Miles/slime ``train_rollout_logprob_abs_diff`` (``sum_of_sample_mean``);
  token mean = TRL ``sampling/sampling_logp_difference/mean`` on one process (TRL then averages
  per-process means, unweighted). verl's ``rollout_probs_diff`` is on probabilities: not this.
* ``K1`` token mean = verl ``rollout_corr/kl`` and OpenRLHF ``vllm_kl`` (``mean(lp_roll - lp_old)``);
  AReaL's ``kl_k1``/``behave_approx_kl`` has the opposite sign.
* ``K3`` = verl/Miles ``mis.py`` ``k3_kl`` (unclamped) and NeMo-RL ``gen_kl_error`` (K3 of
  KL(gen || policy), unclamped); Miles ``train_rollout_kl`` is the response mean with ``d``
  clamped to +-20 and the output to [-10, 10] (``k3_log_ratio_clamp=20`` reproduces the input clamp).
* ESS token mean = verl ``rollout_is_eff_sample_size`` (``1/mean((w/mean w)^2)``, the same
  quantity) when ``ess_cap=C, ess_cap_low=1/C``; Miles ``ess_ratio`` is a response mean of the
  same formula but over the *policy-update* ratio ``p_theta/p_old``, not the rollout mismatch.

**Non-finite policy.** ``d`` is computed in float64 on valid tokens. Tokens are classified:

* ``+inf`` (``log q = -inf``: the rollout recorded probability 0 for a token it sampled),
* ``-inf`` (``log p = -inf``: the learner gives the sampled token probability 0),
* ``NaN`` (both sides ``-inf``, or a NaN input).

``n_posinf``, ``n_neginf``, ``n_nan`` are reported. ``G_abs``, ``max|d|``, ``K1`` and ``K3``
average over the *finite* tokens only (their value for any non-finite token would be +-inf and
would erase the rest of the batch); ``N`` (``n_finite``) is their denominator. ESS uses every
non-NaN token, taking the limits the formula has: a ``-inf`` token has weight 0; if any token
has weight ``+inf``, the infinite weights (all taken equal) dominate and ESS =
``n_posinf / n`` (n = non-NaN tokens); if every weight is 0, ESS = 0 (no token carries weight).
Truncated ESS maps ``+inf`` to the cap ``C`` first, so it is ordinary. Finite ``d`` never
overflows in ESS (weights are rescaled by ``e^{-max d}``; ESS is scale-invariant), and the means of
huge finite values stay finite (terms rescaled by a power of two before summing:
:mod:`qpass.diagnostics.robust`). K3 of a finite ``d > ~709`` overflows float64 to ``inf``;
``k3_log_ratio_clamp`` bounds it. Finite ``logp`` and ``logq`` whose difference overflows float64
are not log-probabilities: ``ValueError`` (naming the position), not an ``inf`` read as "probability
0". A reduction with no usable token at all is ``nan`` ("no data"; the counts say why).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from qpass.diagnostics.masks import as_bool_mask, broadcast_advantages, check_token_tensor
from qpass.diagnostics.robust import stable_mean, stable_row_mean

__all__ = [
    "CLIPPED_HIGH",
    "CLIPPED_LOW",
    "UNCLIPPED",
    "BranchDisagreement",
    "MismatchMetrics",
    "MismatchReduction",
    "clip_branch_disagreement",
    "mismatch_metrics",
    "normalized_ess",
    "ppo_clip_branch",
]

_NAN = float("nan")


@dataclasses.dataclass(frozen=True)
class MismatchReduction:
    """One reduction (token mean or response mean) of the mismatch metrics.

    Attributes:
        g_abs: mean ``|d|`` (nats).
        k1: ``-mean(d)`` (nats); estimates KL(q || p).
        k3: ``mean(e^d - d - 1)`` (nats); estimates KL(q || p).
        ess_raw: normalized ESS of ``w = e^d`` in [0, 1].
        ess_trunc: normalized ESS of the truncated weights ``clamp(w, ess_cap_low, ess_cap)``.
        count: tokens (token mean) or responses (response mean) averaged over for g_abs/k1/k3.
    """

    g_abs: float
    k1: float
    k3: float
    ess_raw: float
    ess_trunc: float
    count: int


@dataclasses.dataclass(frozen=True)
class MismatchMetrics:
    """Result of :func:`mismatch_metrics`.

    Attributes:
        token: token-mean reduction (all valid tokens of the batch pooled).
        response: response-mean reduction (mean over responses of per-response values).
        max_abs: ``max |d|`` over finite valid tokens (nats).
        n_tokens: valid tokens (mask True), including non-finite ones.
        n_finite: valid tokens with finite ``d`` (the token-mean denominator of g_abs/k1/k3).
        n_posinf, n_neginf, n_nan: valid tokens with ``d = +inf`` / ``-inf`` / NaN.
        n_responses: rows ``B``.
        n_empty_responses: responses with no valid token (excluded from the response mean).
        n_responses_used: responses with at least one finite valid token (the response-mean
            denominator of g_abs/k1/k3; response-mean ESS uses responses with a non-NaN token).
        ess_cap, ess_cap_low: truncation bounds used for ``ess_trunc``.
        k3_log_ratio_clamp: the clamp applied to ``d`` inside K3 only, or None.
    """

    token: MismatchReduction
    response: MismatchReduction
    max_abs: float
    n_tokens: int
    n_finite: int
    n_posinf: int
    n_neginf: int
    n_nan: int
    n_responses: int
    n_empty_responses: int
    n_responses_used: int
    ess_cap: float
    ess_cap_low: float | None
    k3_log_ratio_clamp: float | None

    @property
    def n_nonfinite(self) -> int:
        """Valid tokens with non-finite ``d`` (``n_posinf + n_neginf + n_nan``)."""
        return self.n_posinf + self.n_neginf + self.n_nan

    def to_dict(self, prefix: str = "") -> dict[str, float]:
        """Flat ``{name: float}`` for logging, e.g. ``{prefix}token/g_abs``, ``{prefix}resp/k3``."""
        out: dict[str, float] = {}
        for tag, red in (("token", self.token), ("resp", self.response)):
            for f in ("g_abs", "k1", "k3", "ess_raw", "ess_trunc"):
                out[f"{prefix}{tag}/{f}"] = float(getattr(red, f))
        out[f"{prefix}max_abs"] = self.max_abs
        for f in ("n_tokens", "n_finite", "n_posinf", "n_neginf", "n_nan", "n_responses", "n_empty_responses", "n_responses_used"):
            out[f"{prefix}{f}"] = float(getattr(self, f))
        out[f"{prefix}nonfinite_frac"] = self.n_nonfinite / self.n_tokens if self.n_tokens else 0.0
        return out


def _ess_rows(d: torch.Tensor, sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row normalized ESS of ``w = e^d`` over ``sel`` (float64 ``d`` [R, T], no NaN where sel).

    Returns ``(ess [R] float64, n [R] int64)``; rows with ``n == 0`` hold an arbitrary value.
    """
    if d.shape[-1] == 0:  # no token column at all (an empty batch): every row has n == 0
        return torch.zeros(d.shape[:-1], dtype=d.dtype, device=d.device), torch.zeros(d.shape[:-1], dtype=torch.int64, device=d.device)
    pos = sel & (d == math.inf)
    fin = sel & torch.isfinite(d)
    n = sel.sum(-1)
    npos = pos.sum(-1)
    m = torch.where(fin, d, torch.full_like(d, -math.inf)).amax(-1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(torch.where(fin, d - m.unsqueeze(-1), torch.full_like(d, -math.inf)))  # 0 off fin
    s1 = w.sum(-1)
    s2 = (w * w).sum(-1)
    nf = n.clamp(min=1).to(d.dtype)
    ordinary = s1 * s1 / (nf * torch.where(s2 > 0, s2, torch.ones_like(s2)))
    ess = torch.where(s2 > 0, ordinary, torch.zeros_like(ordinary))
    ess = torch.where(npos > 0, npos.to(d.dtype) / nf, ess)
    return ess, n


def normalized_ess(weights: torch.Tensor) -> float:
    """Normalized effective sample size ``(sum w)^2 / (n sum w^2)`` of a 1-D weight vector.

    Convenience for tests and one-off checks (no mask; ``w >= 0``, ``+inf`` and 0 follow the
    module's limit rules). Example: ``w = [1, 1, 1, 4]`` gives ``49 / 76 = 0.6447``.

    Raises:
        ValueError: not 1-D, empty, negative or NaN weights.
    """
    w = weights.detach().to(torch.float64)
    if w.dim() != 1 or w.numel() == 0:
        raise ValueError(f"weights must be a non-empty 1-D tensor, got shape {tuple(w.shape)}")
    if bool(torch.isnan(w).any()) or bool((w < 0).any()):
        raise ValueError("weights must be >= 0 and not NaN")
    ess, _ = _ess_rows(torch.log(w).unsqueeze(0), torch.ones_like(w, dtype=torch.bool).unsqueeze(0))
    return float(ess[0])


def _mean_or_nan(values: torch.Tensor, count: int) -> float:
    """``sum(values) / count`` (NaN for no data), rescaled so huge finite values give a finite mean
    (:func:`qpass.diagnostics.robust.stable_mean`; bit-identical to the plain sum otherwise)."""
    return stable_mean(values, count)


def _token_mean(d: torch.Tensor, dt: torch.Tensor, usable: torch.Tensor, absd: torch.Tensor, df: torch.Tensor,
                k3_tok: torch.Tensor, n_fin: int) -> MismatchReduction:
    """The token-mean reduction of :func:`mismatch_metrics` (all tokens of the batch as one sample).

    ``d``/``dt``: float64 ``[B, T]`` log-ratios, raw and ESS-truncated; ``absd``/``df``/``k3_tok``:
    ``|d|``, ``d`` and the K3 term on finite tokens (0 elsewhere); ``n_fin``: the finite-token count.
    """
    tok_ess_raw, tok_n = _ess_rows(d.reshape(1, -1), usable.reshape(1, -1))
    tok_ess_tr, _ = _ess_rows(dt.reshape(1, -1), usable.reshape(1, -1))
    has_tok = int(tok_n[0]) > 0
    return MismatchReduction(
        g_abs=_mean_or_nan(absd, n_fin),
        k1=-_mean_or_nan(df, n_fin),
        k3=_mean_or_nan(k3_tok, n_fin),
        ess_raw=float(tok_ess_raw[0]) if has_tok else _NAN,
        ess_trunc=float(tok_ess_tr[0]) if has_tok else _NAN,
        count=n_fin,
    )


def _response_mean(d: torch.Tensor, dt: torch.Tensor, usable: torch.Tensor, absd: torch.Tensor, df: torch.Tensor,
                   k3_tok: torch.Tensor, n_fin_row: torch.Tensor, zero: torch.Tensor) -> MismatchReduction:
    """The response-mean reduction of :func:`mismatch_metrics` (mean over responses of each response's
    token mean; responses without a finite token left out). Arguments as :func:`_token_mean`;
    ``n_fin_row``: int ``[B]`` finite tokens per response; ``zero``: float64 0-dim."""
    rows = n_fin_row > 0
    n_rows = int(rows.sum())
    denom = n_fin_row.clamp(min=1).double()

    def resp_mean(per_token: torch.Tensor) -> float:
        per_row = stable_row_mean(per_token, denom)
        return _mean_or_nan(torch.where(rows, per_row, torch.zeros_like(per_row)), n_rows)

    r_ess_raw, r_n = _ess_rows(d, usable)
    r_ess_tr, _ = _ess_rows(dt, usable)
    ess_rows = r_n > 0
    n_ess_rows = int(ess_rows.sum())
    return MismatchReduction(
        g_abs=resp_mean(absd),
        k1=-resp_mean(df),
        k3=resp_mean(k3_tok),
        ess_raw=_mean_or_nan(torch.where(ess_rows, r_ess_raw, zero), n_ess_rows),
        ess_trunc=_mean_or_nan(torch.where(ess_rows, r_ess_tr, zero), n_ess_rows),
        count=n_rows,
    )


def mismatch_metrics(
    logp: torch.Tensor,
    logq: torch.Tensor,
    mask: torch.Tensor,
    *,
    ess_cap: float = 2.0,
    ess_cap_low: float | None = None,
    k3_log_ratio_clamp: float | None = None,
) -> MismatchMetrics:
    """Mismatch metrics between a learner and a behavior policy on sampled tokens (SPEC §4).

    Args:
        logp: float tensor ``[B, T]``: ``log p(a_t|h_t)`` of the learner (e.g. BF16 recompute,
            or the proximal policy), nats, after the same temperature/truncation as sampling.
        logq: float tensor ``[B, T]``: ``log q(a_t|h_t)`` recorded by the rollout engine.
        mask: bool or 0/1 ``[B, T]``: True on valid (sampled, loss-bearing) tokens.
        ess_cap: upper truncation ``C`` for ``ess_trunc`` (``w_bar = min(w, C)``); 2.0 matches the
            TIS cap of Miles/slime/verl. Must be > 0.
        ess_cap_low: optional lower clamp of ``w_bar`` (verl uses ``1/C``); None = no lower clamp.
        k3_log_ratio_clamp: optional ``c > 0``: K3 uses ``clamp(d, -c, c)`` (Miles / NeMo-RL use
            20). None (default) = the unclamped estimator. Other metrics never clamp.
    Returns:
        :class:`MismatchMetrics` (Python floats/ints; computed in float64, no autograd).
    Raises:
        TypeError, ValueError: bad tensors (named), or ``ess_cap``/``ess_cap_low``/
            ``k3_log_ratio_clamp`` not positive (or ``ess_cap_low > ess_cap``).
    Source: SPEC §4; module docstring lists the equivalent metric in each RL system.
    """
    check_token_tensor(logp, "logp")
    check_token_tensor(logq, "logq", logp.shape)
    valid = as_bool_mask(mask, logp.shape).to(logp.device)
    if not ess_cap > 0:
        raise ValueError(f"ess_cap must be > 0, got {ess_cap}")
    if ess_cap_low is not None and not 0 < ess_cap_low <= ess_cap:
        raise ValueError(f"ess_cap_low must be in (0, ess_cap={ess_cap}], got {ess_cap_low}")
    if k3_log_ratio_clamp is not None and not k3_log_ratio_clamp > 0:
        raise ValueError(f"k3_log_ratio_clamp must be > 0, got {k3_log_ratio_clamp}")

    with torch.no_grad():
        zero = torch.zeros((), dtype=torch.float64, device=logp.device)
        lp64, lq64 = logp.detach().double(), logq.detach().double().to(logp.device)
        d = torch.where(valid, lp64 - lq64, zero)
        over = valid & torch.isfinite(lp64) & torch.isfinite(lq64) & ~torch.isfinite(d)
        if bool(over.any()):  # else +-inf would be read as "probability 0" and NaN could follow
            b, t = (int(i) for i in over.nonzero()[0])
            raise ValueError(f"logp - logq overflows float64 at [{b}, {t}] (logp={float(lp64[b, t])!r}, logq={float(lq64[b, t])!r}): "
                             "finite inputs of this size are not log-probabilities")
        isnan = valid & torch.isnan(d)
        posinf = valid & (d == math.inf)
        neginf = valid & (d == -math.inf)
        fin = valid & torch.isfinite(d)
        usable = valid & ~isnan
        df = torch.where(fin, d, zero)  # finite-only values, 0 elsewhere
        dk = df if k3_log_ratio_clamp is None else df.clamp(-k3_log_ratio_clamp, k3_log_ratio_clamp)
        k3_tok = torch.where(fin, torch.expm1(dk) - dk, zero)  # e^d - 1 - d (expm1: exact near 0)
        absd = df.abs()

        n_fin_row = fin.sum(-1)
        n_fin = int(n_fin_row.sum())
        n_valid_row = valid.sum(-1)

        dt = d.clamp(max=math.log(ess_cap)) if ess_cap_low is None else d.clamp(math.log(ess_cap_low), math.log(ess_cap))
        token = _token_mean(d, dt, usable, absd, df, k3_tok, n_fin)
        response = _response_mean(d, dt, usable, absd, df, k3_tok, n_fin_row, zero)
        n_rows = response.count

        return MismatchMetrics(
            token=token,
            response=response,
            max_abs=float(absd.max()) if n_fin else _NAN,
            n_tokens=int(valid.sum()),
            n_finite=n_fin,
            n_posinf=int(posinf.sum()),
            n_neginf=int(neginf.sum()),
            n_nan=int(isnan.sum()),
            n_responses=int(logp.shape[0]),
            n_empty_responses=int((n_valid_row == 0).sum()),
            n_responses_used=n_rows,
            ess_cap=float(ess_cap),
            ess_cap_low=None if ess_cap_low is None else float(ess_cap_low),
            k3_log_ratio_clamp=None if k3_log_ratio_clamp is None else float(k3_log_ratio_clamp),
        )


# --------------------------------------------------------------------------- clip branches

#: Branch codes of :func:`ppo_clip_branch`.
UNCLIPPED, CLIPPED_LOW, CLIPPED_HIGH = 0, 1, 2


def ppo_clip_branch(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """Which term ``min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` selects, per token.

    * ``A > 0``: ``min`` picks the clipped term iff ``r > 1 + eps_high`` -> ``CLIPPED_HIGH``
      (zero gradient); ``r < 1 - eps_low`` stays ``UNCLIPPED`` (``r A < (1-eps_low) A``).
    * ``A < 0``: picks the clipped term iff ``r < 1 - eps_low`` -> ``CLIPPED_LOW``;
      ``r > 1 + eps_high`` stays ``UNCLIPPED``.
    * ``A == 0``: both terms are 0; reported as ``UNCLIPPED``.
    At ``r`` exactly on a bound both terms are equal and the gradient flows: ``UNCLIPPED``.
    The sign-aware definition matches TRL's ``clip_ratio/low_mean`` / ``high_mean``.

    Args:
        ratio: float ``[B, T]`` (``+inf`` allowed; NaN gives ``UNCLIPPED``, callers exclude it).
        adv: float ``[B, T]``.
    Returns:
        int64 ``[B, T]`` with values in {UNCLIPPED, CLIPPED_LOW, CLIPPED_HIGH}.
    """
    high = (adv > 0) & (ratio > 1.0 + eps_high)
    low = (adv < 0) & (ratio < 1.0 - eps_low)
    out = torch.full(ratio.shape, UNCLIPPED, dtype=torch.int64, device=ratio.device)
    out = torch.where(high, torch.full_like(out, CLIPPED_HIGH), out)
    return torch.where(low, torch.full_like(out, CLIPPED_LOW), out)


def _clip_region(ratio: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """Sign-agnostic region of ``r``: -1 below ``1-eps_low``, +1 above ``1+eps_high``, else 0."""
    return (ratio > 1.0 + eps_high).to(torch.int64) - (ratio < 1.0 - eps_low).to(torch.int64)


@dataclasses.dataclass(frozen=True)
class BranchDisagreement:
    """Result of :func:`clip_branch_disagreement`.

    Attributes:
        frac: disagreeing tokens / ``n_tokens`` (all valid, non-NaN tokens; ``A == 0`` tokens have
            no active branch and count as agreeing here).
        frac_pos, frac_neg: disagreement among ``A > 0`` / ``A < 0`` tokens (nan if none).
        frac_zero_region: among ``A == 0`` tokens, the fraction whose clip *region* of ``r``
            (below / inside / above) differs: no gradient depends on it, so it is reported apart.
        n_tokens, n_pos, n_neg, n_zero: token counts; n_nan: valid tokens with a NaN ratio or
            advantage (excluded everywhere).
        n_disagree_pos, n_disagree_neg, n_disagree_zero_region: numerators.
        clip_frac_q, clip_frac_shadow: fraction of ``n_tokens`` whose active branch is clipped,
            under each ratio.
        q_clipped_shadow_not, shadow_clipped_q_not: fractions of ``n_tokens`` for the two
            directions of disagreement.
    """

    frac: float
    frac_pos: float
    frac_neg: float
    frac_zero_region: float
    n_tokens: int
    n_pos: int
    n_neg: int
    n_zero: int
    n_nan: int
    n_disagree_pos: int
    n_disagree_neg: int
    n_disagree_zero_region: int
    clip_frac_q: float
    clip_frac_shadow: float
    q_clipped_shadow_not: float
    shadow_clipped_q_not: float

    def to_dict(self, prefix: str = "") -> dict[str, float]:
        """Flat ``{name: float}`` for logging."""
        return {f"{prefix}{k}": float(v) for k, v in dataclasses.asdict(self).items()}


def clip_branch_disagreement(
    ratio_q: torch.Tensor,
    ratio_shadow: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> BranchDisagreement:
    """Fraction of valid tokens whose active PPO clip branch differs between two ratios (SPEC §4).

    The branch is that of ``min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` (:func:`ppo_clip_branch`):
    unclipped, clipped-low (``A < 0``, ``r < 1-eps_low``) or clipped-high (``A > 0``,
    ``r > 1+eps_high``). The two ratios share the numerator and differ in the denominator, e.g.
    ``ratio_q = p_theta / q`` (quantized rollout log-probs) and ``ratio_shadow = p_theta / p_bf16``
    (a BF16 shadow recompute of the same tokens). No RL system computes this; its parts are TRL's
    sign-aware clip fractions (``prior-art/rl_systems.md`` §2.8).

    Args:
        ratio_q, ratio_shadow: float ``[B, T]`` ratios (not log-ratios), ``>= 0``; ``+inf`` is a
            legal ratio (clipped-high for ``A > 0``, unclipped for ``A < 0``); a token where
            either ratio or the advantage is NaN is excluded and counted in ``n_nan``.
        adv: float ``[B]``, ``[B, 1]`` or ``[B, T]`` advantages.
        mask: bool or 0/1 ``[B, T]``, True on valid tokens.
        eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]``; ``0 <= eps_low < 1``,
            ``eps_high >= 0``.
    Returns:
        :class:`BranchDisagreement` (Python floats; fractions with an empty denominator are nan).
    Raises:
        TypeError, ValueError: bad tensors (named) or epsilons out of range.
    """
    check_token_tensor(ratio_q, "ratio_q")
    check_token_tensor(ratio_shadow, "ratio_shadow", ratio_q.shape)
    a = broadcast_advantages(adv, ratio_q.shape)
    valid = as_bool_mask(mask, ratio_q.shape)
    if not 0 <= eps_low < 1:
        raise ValueError(f"eps_low must be in [0, 1), got {eps_low}")
    if not eps_high >= 0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high}")
    with torch.no_grad():
        rq, rs, a = ratio_q.detach().double(), ratio_shadow.detach().double(), a.detach().double()
        nan = valid & (torch.isnan(rq) | torch.isnan(rs) | torch.isnan(a))
        ok = valid & ~nan
        bq = ppo_clip_branch(rq, a, eps_low, eps_high)
        bs = ppo_clip_branch(rs, a, eps_low, eps_high)
        differ = ok & (bq != bs)
        pos, neg, zer = ok & (a > 0), ok & (a < 0), ok & (a == 0)
        region_differ = zer & (_clip_region(rq, eps_low, eps_high) != _clip_region(rs, eps_low, eps_high))
        n = int(ok.sum())
        n_pos, n_neg, n_zero = int(pos.sum()), int(neg.sum()), int(zer.sum())
        dp, dn, dz = int((differ & pos).sum()), int((differ & neg).sum()), int(region_differ.sum())
        cq, cs = ok & (bq != UNCLIPPED), ok & (bs != UNCLIPPED)

        def frac(num: int | torch.Tensor, den: int) -> float:
            return int(num) / den if den else _NAN

        return BranchDisagreement(
            frac=frac(dp + dn, n),
            frac_pos=frac(dp, n_pos),
            frac_neg=frac(dn, n_neg),
            frac_zero_region=frac(dz, n_zero),
            n_tokens=n,
            n_pos=n_pos,
            n_neg=n_neg,
            n_zero=n_zero,
            n_nan=int(nan.sum()),
            n_disagree_pos=dp,
            n_disagree_neg=dn,
            n_disagree_zero_region=dz,
            clip_frac_q=frac(cq.sum(), n),
            clip_frac_shadow=frac(cs.sum(), n),
            q_clipped_shadow_not=frac((cq & ~cs).sum(), n),
            shadow_clipped_q_not=frac((cs & ~cq).sum(), n),
        )
