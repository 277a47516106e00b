"""Mismatch diagnostics (SPEC §4) against hand-computed values.

Every expected number is derived in the comment next to it from the definitions:
d = log p - log q, w = e^d, G_abs = mean|d|, K1 = -mean d, K3 = mean(e^d - d - 1),
ESS = (sum w)^2 / (n sum w^2).
"""

from __future__ import annotations

import math

import pytest
import torch

from qpass.diagnostics import (
    CLIPPED_HIGH,
    CLIPPED_LOW,
    UNCLIPPED,
    clip_branch_disagreement,
    layerwise_mismatch,
    mismatch_metrics,
    normalized_ess,
    ppo_clip_branch,
    residual_channel_map,
    update_visibility,
    update_visibility_groups,
)
from qpass.formats.spec import NVFP4_ACT_PER_TOKEN
from qpass.quant.nvfp4 import nvfp4_quantize

NAN, INF = float("nan"), float("inf")
LN2 = math.log(2.0)


# --------------------------------------------------------------------------- ESS


def test_ess_reference_example():
    # w = [1, 1, 1, 4]: sum w = 7, sum w^2 = 1 + 1 + 1 + 16 = 19, ESS = 49 / (4 * 19) = 0.6447
    assert normalized_ess(torch.tensor([1.0, 1.0, 1.0, 4.0])) == pytest.approx(49 / 76, abs=1e-12)
    assert round(49 / 76, 3) == 0.645
    # the same weights through mismatch_metrics: logq = 0, logp = log w
    logp = torch.log(torch.tensor([[1.0, 1.0, 1.0, 4.0]], dtype=torch.float64))
    m = mismatch_metrics(logp, torch.zeros_like(logp), torch.ones(1, 4), ess_cap=2.0)
    assert m.token.ess_raw == pytest.approx(49 / 76, abs=1e-12)
    assert m.response.ess_raw == pytest.approx(49 / 76, abs=1e-12)  # one response: same pool
    # truncated at C = 2: w_bar = [1, 1, 1, 2]: 5^2 / (4 * 7) = 25/28
    assert m.token.ess_trunc == pytest.approx(25 / 28, abs=1e-12)
    # verl-style two-sided clamp [1/C, C] = [0.5, 2] does not move these weights
    m2 = mismatch_metrics(logp, torch.zeros_like(logp), torch.ones(1, 4), ess_cap=2.0, ess_cap_low=0.5)
    assert m2.token.ess_trunc == pytest.approx(25 / 28, abs=1e-12)


def test_ess_limits_and_overflow():
    # equal weights -> 1; one weight +inf among 4 -> the infinite weight dominates: 1/4
    assert normalized_ess(torch.tensor([3.0, 3.0])) == pytest.approx(1.0)
    assert normalized_ess(torch.tensor([1.0, 1.0, 1.0, INF])) == pytest.approx(0.25)
    # two infinite weights among 4 -> 2/4; all zero -> 0 (no token carries weight)
    assert normalized_ess(torch.tensor([INF, 1.0, INF, 0.0])) == pytest.approx(0.5)
    assert normalized_ess(torch.tensor([0.0, 0.0])) == 0.0
    # finite d = 800 would overflow e^d in float64; rescaling by e^-800 gives w = [1, ~0]:
    # ESS = 1^2 / (2 * 1) = 0.5, no inf/NaN
    logp = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    logq = torch.tensor([[-800.0, 0.0]], dtype=torch.float64)
    m = mismatch_metrics(logp, logq, torch.ones(1, 2))
    assert m.token.ess_raw == pytest.approx(0.5)
    # truncated at 2: w_bar = [2, 1]: 9 / (2 * 5) = 0.9
    assert m.token.ess_trunc == pytest.approx(0.9)
    # K3 of d = 800 overflows float64 (unclamped estimator) ...
    assert m.token.k3 == INF
    # ... and with the optional clamp at 20: (e^20 - 20 - 1 + 0) / 2
    mc = mismatch_metrics(logp, logq, torch.ones(1, 2), k3_log_ratio_clamp=20.0)
    assert mc.token.k3 == pytest.approx((math.exp(20) - 21) / 2, rel=1e-12)
    assert mc.token.g_abs == pytest.approx(400.0)  # clamp applies to K3 only: (800 + 0) / 2
    with pytest.raises(ValueError, match="weights"):
        normalized_ess(torch.tensor([1.0, -1.0]))


# --------------------------------------------------------------------------- basic metrics

# Row 0: logp = [-0.5, -1.5, -1.0], logq = [-1, -1, -2] -> d = [0.5, -0.5, 1.0]
# Row 1: logp = [-0.8, pad, pad],   logq = [-1, pad, pad] -> d = [0.2]
# Row 2: fully masked (an empty response)
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


def _basic(pad_p: float, pad_q: float) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.tensor([[-0.5, -1.5, -1.0], [-0.8, pad_p, pad_p], [pad_p, pad_p, pad_p]], dtype=torch.float64)
    logq = torch.tensor([[-1.0, -1.0, -2.0], [-1.0, pad_q, pad_q], [pad_q, pad_q, pad_q]], dtype=torch.float64)
    return logp, logq


# per-token k3 = e^d - d - 1:
K3_05 = math.exp(0.5) - 1.5  # 0.1487212707
K3_M05 = math.exp(-0.5) - 0.5  # 0.1065306597
K3_1 = math.exp(1.0) - 2.0  # 0.7182818285
K3_02 = math.exp(0.2) - 1.2  # 0.0214027582


def test_mismatch_metrics_hand_computed():
    m = mismatch_metrics(*_basic(1e9, NAN), MASK)
    assert (m.n_tokens, m.n_finite, m.n_nonfinite) == (4, 4, 0)
    assert (m.n_responses, m.n_empty_responses, m.n_responses_used) == (3, 1, 2)
    # token mean over N = 4: |d| = 0.5 + 0.5 + 1.0 + 0.2 = 2.2 -> 0.55
    assert m.token.g_abs == pytest.approx(0.55, abs=1e-12)
    # K1 = -(0.5 - 0.5 + 1.0 + 0.2) / 4 = -0.3
    assert m.token.k1 == pytest.approx(-0.3, abs=1e-12)
    # K3 = (0.1487212707 + 0.1065306597 + 0.7182818285 + 0.0214027582) / 4 = 0.2487341293
    assert m.token.k3 == pytest.approx((K3_05 + K3_M05 + K3_1 + K3_02) / 4, abs=1e-12)
    assert m.token.k3 == pytest.approx(0.2487341293, abs=1e-9)
    assert m.max_abs == pytest.approx(1.0)
    # ESS pool: w = [e^.5, e^-.5, e^1, e^.2]: sum w = 6.1949365170, sum w^2 = e + e^-1 + e^2 + e^.4
    # = 11.9670420662 -> 6.1949365170^2 / (4 * 11.9670420662) = 0.8017277419
    assert m.token.ess_raw == pytest.approx(0.8017277419, abs=1e-9)
    # truncated at C = 2: w_bar = [e^.5, e^-.5, 2, e^.2]: sum = 5.4766546885, sum sq = e + e^-1 + 4 + e^.4
    s1 = math.exp(0.5) + math.exp(-0.5) + 2 + math.exp(0.2)
    s2 = math.e + math.exp(-1) + 4 + math.exp(0.4)
    assert m.token.ess_trunc == pytest.approx(s1 * s1 / (4 * s2), abs=1e-12)
    # response mean over the two non-empty responses:
    # G_abs: row0 2/3, row1 0.2 -> (0.6666667 + 0.2) / 2 = 0.4333333
    assert m.response.g_abs == pytest.approx((2 / 3 + 0.2) / 2, abs=1e-12)
    # K1: row0 -(1.0)/3, row1 -0.2 -> -0.2666667
    assert m.response.k1 == pytest.approx((-1 / 3 - 0.2) / 2, abs=1e-12)
    # K3: row0 (K3_05 + K3_M05 + K3_1)/3 = 0.3245112530, row1 0.0214027582 -> 0.1729570056
    assert m.response.k3 == pytest.approx(((K3_05 + K3_M05 + K3_1) / 3 + K3_02) / 2, abs=1e-12)
    assert m.response.k3 == pytest.approx(0.1729570056, abs=1e-9)
    # ESS: row0 = 0.7871288706 (its own three weights), row1 = 1 (a single token) -> 0.8935644353
    assert m.response.ess_raw == pytest.approx((0.7871288706 + 1.0) / 2, abs=1e-9)
    assert m.token.count == 4 and m.response.count == 2
    d = m.to_dict("mm/")
    assert d["mm/token/g_abs"] == pytest.approx(0.55) and d["mm/n_empty_responses"] == 1.0


@pytest.mark.parametrize("pad_p,pad_q", [(0.0, 0.0), (-1e9, 1e9), (NAN, NAN), (-INF, INF), (INF, -INF)])
def test_padding_never_counts(pad_p, pad_q):
    ref = mismatch_metrics(*_basic(1e9, NAN), MASK)
    got = mismatch_metrics(*_basic(pad_p, pad_q), MASK)
    assert got == ref  # every field, exactly


def test_float_mask_and_validation():
    logp, logq = _basic(0.0, 0.0)
    assert mismatch_metrics(logp, logq, MASK.float()) == mismatch_metrics(logp, logq, MASK.bool())
    with pytest.raises(ValueError, match="mask must be bool or 0/1"):
        mismatch_metrics(logp, logq, MASK * 0.5)
    with pytest.raises(ValueError, match="mask has shape"):
        mismatch_metrics(logp, logq, MASK[:, :2])
    with pytest.raises(ValueError, match="logq has shape"):
        mismatch_metrics(logp, logq[:, :2], MASK)
    with pytest.raises(ValueError, match=r"logp must be \[B, T\]"):
        mismatch_metrics(logp[0], logq[0], MASK[0])
    with pytest.raises(TypeError, match="logp must be a floating"):
        mismatch_metrics(logp.long(), logq, MASK)
    with pytest.raises(ValueError, match="ess_cap"):
        mismatch_metrics(logp, logq, MASK, ess_cap=0.0)


def test_all_masked_batch_is_nan_no_data():
    logp, logq = _basic(1.0, 2.0)
    m = mismatch_metrics(logp, logq, torch.zeros(3, 3, dtype=torch.bool))
    assert (m.n_tokens, m.n_finite, m.n_responses_used, m.n_empty_responses) == (0, 0, 0, 3)
    for red in (m.token, m.response):
        assert all(math.isnan(v) for v in (red.g_abs, red.k1, red.k3, red.ess_raw, red.ess_trunc))
    assert math.isnan(m.max_abs)


# --------------------------------------------------------------------------- non-finite d


@pytest.mark.parametrize("shape", [(0, 0), (0, 5), (3, 0)])
def test_empty_batch_is_defined_no_exception(shape):
    """Old code: amax() of an empty token dimension raised IndexError (the docstring promises no exception)."""
    import json

    from qpass.jsonio import dumps

    z = torch.zeros(shape)
    m = mismatch_metrics(z, z, torch.zeros(shape, dtype=torch.bool))
    assert (m.n_tokens, m.n_finite, m.n_responses, m.token.count, m.response.count) == (0, 0, shape[0], 0, 0)
    assert all(math.isnan(v) for v in (m.token.g_abs, m.token.k1, m.token.k3, m.token.ess_raw, m.max_abs, m.response.g_abs))
    row = json.loads(dumps(m.to_dict("gap/")))  # written as null + reason, never NaN
    assert row["gap/max_abs"] is None and row["gap/max_abs_reason"] == "non-finite: nan"


def test_nonfinite_policy():
    # row0: d = [0, +inf]  (logq = -inf: the rollout gave the sampled token probability 0)
    # row1: d = [-inf, ln2] (logp = -inf: the learner gives it probability 0)
    # row2: d = [NaN, 0]   (both -inf)
    logp = torch.tensor([[-1.0, -1.0], [-INF, LN2 - 1.0], [-INF, -2.0]], dtype=torch.float64)
    logq = torch.tensor([[-1.0, -INF], [-1.0, -1.0], [-INF, -2.0]], dtype=torch.float64)
    m = mismatch_metrics(logp, logq, torch.ones(3, 2), ess_cap=2.0)
    assert (m.n_tokens, m.n_posinf, m.n_neginf, m.n_nan, m.n_finite) == (6, 1, 1, 1, 3)
    assert m.n_nonfinite == 3
    # G_abs, K1, K3 over the finite tokens d = [0, ln2, 0]:
    assert m.token.g_abs == pytest.approx(LN2 / 3, abs=1e-12)  # 0.2310490602
    assert m.token.k1 == pytest.approx(-LN2 / 3, abs=1e-12)
    assert m.token.k3 == pytest.approx((1 - LN2) / 3, abs=1e-12)  # e^ln2 - ln2 - 1 = 0.3068528194
    assert m.max_abs == pytest.approx(LN2, abs=1e-12)
    # raw ESS over the 5 non-NaN tokens; one infinite weight dominates -> 1/5
    assert m.token.ess_raw == pytest.approx(0.2)
    # truncated: +inf -> C = 2, -inf -> 0: w_bar = [1, 2, 0, 2, 1]: 6^2 / (5 * 10) = 0.72
    assert m.token.ess_trunc == pytest.approx(0.72, abs=1e-12)
    # response means: row0 finite [0]; row1 finite [ln2]; row2 finite [0]
    assert m.response.g_abs == pytest.approx((0 + LN2 + 0) / 3, abs=1e-12)
    assert m.response.k3 == pytest.approx((0 + (1 - LN2) + 0) / 3, abs=1e-12)
    # ESS raw per row: row0 [1, inf] -> 1/2; row1 [0, 2] -> 4/(2*4) = 0.5; row2 [1] -> 1
    assert m.response.ess_raw == pytest.approx((0.5 + 0.5 + 1.0) / 3, abs=1e-12)
    # ESS trunc per row: row0 [1, 2] -> 9/(2*5) = 0.9; row1 [0, 2] -> 0.5; row2 -> 1
    assert m.response.ess_trunc == pytest.approx((0.9 + 0.5 + 1.0) / 3, abs=1e-12)
    assert all(math.isfinite(v) for v in m.to_dict().values())


def test_nonfinite_whole_response():
    # a response whose only valid tokens are d = -inf: no finite token (excluded from the
    # response mean of G/K1/K3); ESS of all-zero weights is 0 (no token carries weight)
    logp = torch.tensor([[-INF, -INF], [-1.0, -1.0]], dtype=torch.float64)
    logq = torch.tensor([[-1.0, -1.0], [-1.5, -1.0]], dtype=torch.float64)
    m = mismatch_metrics(logp, logq, torch.ones(2, 2))
    assert m.n_responses_used == 1 and m.n_neginf == 2
    assert m.response.g_abs == pytest.approx(0.25)  # only row1: (0.5 + 0) / 2
    # row0 ESS 0, row1 w = [e^.5, 1]: (e^.5 + 1)^2 / (2 (e + 1))
    row1 = (math.exp(0.5) + 1) ** 2 / (2 * (math.e + 1))
    assert m.response.ess_raw == pytest.approx((0.0 + row1) / 2, abs=1e-12)


# --------------------------------------------------------------------------- clip branches


def test_ppo_clip_branch_is_sign_aware():
    r = torch.tensor([[0.5, 1.5, 0.5, 1.5, 1.5]], dtype=torch.float64)
    a = torch.tensor([[1.0, 1.0, -1.0, -1.0, 0.0]], dtype=torch.float64)
    b = ppo_clip_branch(r, a, 0.2, 0.2)
    # A>0: r=0.5 -> min(0.5A, 0.8A) = r A (unclipped); r=1.5 -> 1.2A (clipped high)
    # A<0: r=0.5 -> min(-0.5, -0.8) = -0.8 (clipped low); r=1.5 -> -1.5 (unclipped); A=0 -> none
    assert b.tolist() == [[UNCLIPPED, CLIPPED_HIGH, CLIPPED_LOW, UNCLIPPED, UNCLIPPED]]


def test_clip_branch_disagreement_constructed():
    eps_low, eps_high = 0.2, 0.3  # clip range [0.8, 1.3]
    # token:       t1    t2    t3    t4    t5    t6    t7    t8    t9    pad
    rq = [1.40, 0.70, 1.50, 1.30, 0.70, 1.50, 0.75, 1.50, 1.00, NAN]
    rs = [1.20, 1.00, 1.31, 1.35, 0.90, 1.00, 0.79, 1.00, 1.10, 1e9]
    adv = [1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 0.0, 0.0, 5.0]
    mask = [1, 1, 1, 1, 1, 1, 1, 1, 1, 0]
    # A>0: t1 q high / s unclipped -> differ; t2 both unclipped (0.7 < 0.8 is not clipped for A>0);
    #      t3 both high; t4 q at the bound 1.3 exactly (unclipped) vs s 1.35 high -> differ
    # A<0: t5 q low (0.7 < 0.8) / s unclipped -> differ; t6 both unclipped (1.5 is not clipped for
    #      A<0); t7 both low
    # A=0: t8 regions above/inside -> region differs; t9 inside/inside
    t = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    res = clip_branch_disagreement(t(rq), t(rs), t(adv), torch.tensor([mask]), eps_low, eps_high)
    assert (res.n_tokens, res.n_pos, res.n_neg, res.n_zero, res.n_nan) == (9, 4, 3, 2, 0)
    assert (res.n_disagree_pos, res.n_disagree_neg, res.n_disagree_zero_region) == (2, 1, 1)
    assert res.frac == pytest.approx(3 / 9)
    assert res.frac_pos == pytest.approx(2 / 4)
    assert res.frac_neg == pytest.approx(1 / 3)
    assert res.frac_zero_region == pytest.approx(1 / 2)
    # q clipped: t1, t3, t5, t7 -> 4/9; shadow clipped: t3, t4, t7 -> 3/9
    assert res.clip_frac_q == pytest.approx(4 / 9)
    assert res.clip_frac_shadow == pytest.approx(3 / 9)
    assert res.q_clipped_shadow_not == pytest.approx(2 / 9)  # t1, t5
    assert res.shadow_clipped_q_not == pytest.approx(1 / 9)  # t4
    # advantages given per response ([B]) are broadcast over tokens
    one = torch.tensor([1.0], dtype=torch.float64)
    res_b = clip_branch_disagreement(t(rq[:4]), t(rs[:4]), one, torch.ones(1, 4), eps_low, eps_high)
    assert res_b.frac_pos == pytest.approx(0.5) and math.isnan(res_b.frac_neg)


def test_clip_branch_disagreement_nonfinite_ratios():
    # +inf ratio: clipped high for A>0 (vs shadow 1.0 unclipped -> differ), unclipped for A<0 (agree)
    # NaN ratio on a valid token: excluded and counted
    rq = torch.tensor([[INF, INF, NAN]])
    rs = torch.tensor([[1.0, 1.0, 1.0]])
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    res = clip_branch_disagreement(rq, rs, adv, torch.ones(1, 3), 0.2, 0.2)
    assert (res.n_tokens, res.n_nan, res.n_disagree_pos, res.n_disagree_neg) == (2, 1, 1, 0)
    assert res.frac == pytest.approx(0.5)
    with pytest.raises(ValueError, match="adv must have shape"):
        clip_branch_disagreement(rq, rs, torch.ones(3, 1), torch.ones(1, 3), 0.2, 0.2)
    with pytest.raises(ValueError, match="eps_low"):
        clip_branch_disagreement(rq, rs, adv, torch.ones(1, 3), 1.0, 0.2)


# --------------------------------------------------------------------------- update visibility


def _weight() -> torch.Tensor:
    # 2 rows x 32 (2 blocks per row). amax = 6 -> S_enc = 448, every block with max 6 has
    # s_b = e4m3(6 * 448/6) = 448 and element multiplier 1, so values on the E2M1 grid encode as
    # themselves.
    w = torch.zeros(2, 32)
    w[0, :4] = torch.tensor([6.0, 1.0, 0.5, -2.0])
    w[0, 16:18] = torch.tensor([6.0, 3.0])
    w[1, :2] = torch.tensor([-6.0, 4.0])
    w[1, 16:18] = torch.tensor([6.0, 1.5])
    return w


def test_update_visibility_counts():
    w = _weight()
    q0 = nvfp4_quantize(w)
    # identical re-quantization: nothing visible
    v = update_visibility(q0, nvfp4_quantize(w.clone()))
    assert (v.n_codes, v.n_scales, v.n_global) == (64, 4, 1)
    assert (v.n_codes_changed, v.n_scales_changed, v.n_values_changed, v.n_global_changed) == (0, 0, 0, 0)
    # one grid element 1.0 -> 1.5 in a block whose max stays 6: 1 code, 0 scales, 1 value
    w1 = w.clone()
    w1[0, 1] = 1.5
    v = update_visibility(q0, nvfp4_quantize(w1), name="w")
    assert (v.n_codes_changed, v.n_scales_changed, v.n_values_changed) == (1, 0, 1)
    assert v.code_frac == pytest.approx(1 / 64) and v.scale_frac == 0.0 and not v.global_changed
    # an RL-sized update (~1e-6) to a non-max element is invisible after quantization (QuRL)
    w2 = w.clone()
    w2[0, 1] += 1e-6
    v = update_visibility(q0, nvfp4_quantize(w2))
    assert (v.n_codes_changed, v.n_scales_changed, v.n_values_changed, v.n_global_changed) == (0, 0, 0, 0)
    # scaling everything by (1 + 1e-6) moves amax, so the fp32 global scale bits change, but no
    # code, no scale byte and no bf16 decoded value does
    v = update_visibility(q0, nvfp4_quantize(w * (1 + 1e-6)))
    assert (v.n_codes_changed, v.n_scales_changed, v.n_values_changed, v.n_global_changed) == (0, 0, 0, 1)
    # doubling the tensor doubles amax: same codes and scale bytes, new global scale, every
    # non-zero value changes: 4 + 2 in row 0 and 2 + 2 in row 1 = 10 non-zero elements
    v = update_visibility(q0, nvfp4_quantize(w * 2))
    assert (v.n_codes_changed, v.n_scales_changed, v.n_global_changed, v.n_values_changed) == (0, 0, 1, 10)


def test_update_visibility_canonical_zero():
    # a weight moving from +0.1 to -0.1 (both round to zero at this scale) changes the raw code
    # from 0x0 to 0x8 (-0): not a visible change (SPEC §3 rule 4 canonicalises -0 to 0)
    w = _weight()
    w[0, 5] = 0.1
    wneg = w.clone()
    wneg[0, 5] = -0.1
    qa, qb = nvfp4_quantize(w), nvfp4_quantize(wneg)
    assert not torch.equal(qa.codes, qb.codes)  # the raw bytes do differ
    v = update_visibility(qa, qb)
    assert (v.n_codes_changed, v.n_values_changed) == (0, 0)


def test_update_visibility_groups_and_errors():
    w = _weight()
    w1 = w.clone()
    w1[1, 17] = 2.0  # 1.5 -> 2.0: one code
    before = {"q": nvfp4_quantize(w), "k": nvfp4_quantize(w[:1])}
    after = {"q": nvfp4_quantize(w1), "k": nvfp4_quantize(w[:1])}
    g = update_visibility_groups(before, after)
    assert list(g.per_group) == ["q", "k"]
    assert g.per_group["q"].n_codes_changed == 1 and g.per_group["k"].n_codes_changed == 0
    # pooled: 1 changed code of 64 + 32 elements
    assert (g.total.n_codes, g.total.n_codes_changed) == (96, 1)
    assert g.total.code_frac == pytest.approx(1 / 96)
    with pytest.raises(ValueError, match=r"only in before: \['k'\]"):
        update_visibility_groups(before, {"q": after["q"]})
    with pytest.raises(ValueError, match="shapes differ"):
        update_visibility(before["q"], before["k"])
    with pytest.raises(TypeError, match="after must be an NVFP4Tensor"):
        update_visibility(before["q"], w)


# --------------------------------------------------------------------------- layer-wise


def test_layerwise_mismatch_valid_tokens_only():
    # [B=2, T=2, C=2]; learner all ones; rollout differs by (0.3, 0.4) at token (0, 0) and by
    # garbage 1e9 at the padded token (1, 1).
    xl = torch.ones(2, 2, 2)
    xr = xl.clone()
    xr[0, 0] += torch.tensor([0.3, 0.4])
    xr[1, 1] = 1e9
    mask = torch.tensor([[1, 1], [1, 0]])
    out = layerwise_mismatch({"s": xl}, {"s": xr}, mask)
    s = out["s"]
    # ||delta||_F = sqrt(0.09 + 0.16) = 0.5 (float32 inputs: 0.3/0.4 are rounded, so 1e-6)
    assert s.fro == pytest.approx(0.5, abs=1e-6)
    # ||X_learn||_F over 3 valid tokens x 2 channels = sqrt(6): rel = 0.5 / sqrt(6) = 0.2041241
    assert s.rel == pytest.approx(0.5 / math.sqrt(6), abs=1e-6)
    assert s.max_abs == pytest.approx(0.4, abs=1e-6)
    assert s.rms == pytest.approx(0.5 / math.sqrt(6), abs=1e-6)
    assert (s.n_tokens, s.numel) == (3, 6)
    with pytest.raises(ValueError, match=r"only in rollout: \['t'\]"):
        layerwise_mismatch({"s": xl}, {"s": xr, "t": xr}, mask)
    assert list(layerwise_mismatch({"s": xl}, {"s": xr, "t": xr}, mask, strict=False)) == ["s"]
    bad = xr.clone()
    bad[0, 1, 0] = NAN
    with pytest.raises(ValueError, match="non-finite rollout activation.*site 's'"):
        layerwise_mismatch({"s": xl}, {"s": bad}, mask)
    # zero learner activations: rel = 0 if identical, inf otherwise
    z = torch.zeros(1, 2)
    assert layerwise_mismatch({"z": z}, {"z": z})["z"].rel == 0.0
    assert layerwise_mismatch({"z": z}, {"z": z + 1})["z"].rel == INF


def test_residual_channel_map_hand_computed():
    # per-tensor activation scale over the 3 valid rows: amax = 6 -> S_enc = 448; each row's
    # single block has max 6 -> s_b = 448, element multiplier 1, so x -> E2M1(x):
    #   row0: 6 -> 6, 0.1 -> 0 (R = 0.1), 1.2 -> 1.0 (R = 0.2)
    #   row1: 6 -> 6, 0.3 -> 0.5 (past the 0.25 midpoint, R = -0.2), 1.0 -> 1.0 (R = 0)
    #   row2: -6 -> -6, 0 -> 0, 2.6 -> 3 (R = -0.4)
    # the padded row 3 holds 1e9: if it counted it would set amax and wreck every block.
    x = torch.zeros(4, 16)
    x[0, :3] = torch.tensor([6.0, 0.1, 1.2])
    x[1, :3] = torch.tensor([6.0, 0.3, 1.0])
    x[2, :3] = torch.tensor([-6.0, 0.0, 2.6])
    x[3] = 1e9
    m = residual_channel_map(x, torch.tensor([1, 1, 1, 0]), site="layers.0.mlp")
    assert m.n_tokens == 3 and m.spec_key == "nvfp4.activation.per_tensor"
    # mean |R|: ch1 (0.1 + 0.2 + 0) / 3 = 0.1; ch2 (0.2 + 0 + 0.4) / 3 = 0.2 (float32 inputs: 1e-6)
    torch.testing.assert_close(m.mean_abs[:3], torch.tensor([0.0, 0.1, 0.2]), atol=1e-6, rtol=0)
    torch.testing.assert_close(m.max_abs[:3], torch.tensor([0.0, 0.2, 0.4]), atol=1e-6, rtol=0)
    # ||R[:, j]||_2: ch1 sqrt(0.01 + 0.04) = 0.2236068; ch2 sqrt(0.04 + 0.16) = 0.4472136
    torch.testing.assert_close(m.l2[:3], torch.tensor([0.0, math.sqrt(0.05), math.sqrt(0.2)]), atol=1e-6, rtol=0)
    assert torch.equal(m.mean_abs[3:], torch.zeros(13))
    # identical to quantizing only the valid rows; the [B, T, K] form with a [B, T] mask agrees
    ref = residual_channel_map(x[:3])
    assert torch.equal(ref.mean_abs, m.mean_abs) and torch.equal(ref.max_abs, m.max_abs)
    m3 = residual_channel_map(x.reshape(2, 2, 16), torch.tensor([[1, 1], [1, 0]]))
    assert torch.equal(m3.l2, m.l2)
    # per-token spec is accepted; an all-masked input gives NaN maps, not an exception
    assert residual_channel_map(x[:3], spec=NVFP4_ACT_PER_TOKEN).spec_key == "nvfp4.activation.per_token"
    empty = residual_channel_map(x, torch.zeros(4))
    assert empty.n_tokens == 0 and bool(torch.isnan(empty.mean_abs).all())


def test_residual_channel_map_names_bad_site():
    from qpass.errors import QuantizationError

    x = torch.zeros(2, 16)
    x[0, 0] = NAN
    with pytest.raises(QuantizationError, match="layers.3"):
        residual_channel_map(x, site="layers.3")
    # the same NaN in a padded row is never read
    assert residual_channel_map(x, torch.tensor([0, 1]), site="layers.3").n_tokens == 1
