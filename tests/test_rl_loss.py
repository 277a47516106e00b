"""GRPO advantages, corrections and the decoupled clipped loss (SPEC §5) against hand-computed values.

L = -(1/N) sum_t sg(c_bar_t) min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) + beta KL,
c = p_prox / q, r = p_theta / p_prox, N = valid tokens before any correction masking.
"""

from __future__ import annotations

import math

import pytest
import torch

from qpass.rl.loss import Correction, LossConfig, correction_weights, group_advantages, grpo_loss

NAN, INF = float("nan"), float("inf")
F64 = torch.float64


# --------------------------------------------------------------------------- advantages


def test_advantages_sample_and_population_std():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=F64)
    # mean 0.5, centered [.5, -.5, -.5, .5], sum of squares 1.0
    # sample std = sqrt(1/3) = 0.5773502692 -> A = 0.5 / (0.5773502692 + 1e-6) = 0.8660239
    a = group_advantages(r, 4)
    s = math.sqrt(1 / 3)
    torch.testing.assert_close(a, torch.tensor([1, -1, -1, 1], dtype=F64) * 0.5 / (s + 1e-6), rtol=0, atol=1e-15)
    assert a[0].item() == pytest.approx(0.8660239, abs=1e-7)
    # population std = sqrt(1/4) = 0.5 -> A = 0.5 / 0.500001 = 0.999998
    p = group_advantages(r, 4, std="population")
    assert p[0].item() == pytest.approx(0.5 / 0.500001, abs=1e-15)
    # centering only
    assert group_advantages(r, 4, scale=False).tolist() == [0.5, -0.5, -0.5, 0.5]


def test_advantages_all_equal_group_is_exactly_zero():
    # naive arithmetic leaves residue: mean([0.1]*3) - 0.1 = 1.39e-17 and std = 1.7e-17, so
    # (R - mean)/(std + 1e-6) would be ~1e-11, not 0; the max == min rule gives exactly 0.
    r = torch.tensor([0.1, 0.1, 0.1], dtype=F64)
    assert (r.mean() - 0.1).item() != 0.0 and r.std().item() != 0.0
    assert torch.equal(group_advantages(r, 3), torch.zeros(3, dtype=F64))
    assert torch.equal(group_advantages(r, 3, std="population"), torch.zeros(3, dtype=F64))
    # mixed: group 0 all-equal -> 0; group 1 [0, 1] sample std = sqrt(0.5) -> +-0.5/(0.7071068+1e-6)
    r2 = torch.tensor([0.7, 0.7, 0.7, 0.0, 1.0])
    a2 = group_advantages(r2, group_ids=[0, 0, 0, 1, 1])
    assert a2.dtype == torch.float32
    assert a2[:3].tolist() == [0.0, 0.0, 0.0]
    assert a2[4].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6), abs=1e-7)
    assert a2[3].item() == pytest.approx(-0.5 / (math.sqrt(0.5) + 1e-6), abs=1e-7)


def test_advantages_single_sample_groups():
    # a singleton group has no baseline information: advantage exactly 0 (sample std would be 0/0)
    assert group_advantages([5.0, -3.0], 1).tolist() == [0.0, 0.0]
    # groups of unequal size via ids: {0: [1, 0]}, {7: [5]}
    a = group_advantages(torch.tensor([1.0, 5.0, 0.0], dtype=F64), group_ids=torch.tensor([0, 7, 0]))
    # group 0: mean 0.5, sample std sqrt(0.25 + 0.25) / 1 -> sqrt(0.5) = 0.7071068
    assert a[1].item() == 0.0
    assert a[0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6), abs=1e-15)
    assert a[2].item() == pytest.approx(-0.5 / (math.sqrt(0.5) + 1e-6), abs=1e-15)
    # integer rewards are accepted (float32 result)
    assert group_advantages(torch.tensor([1, 1, 0, 0]), 2).tolist() == [0.0, 0.0, 0.0, 0.0]


def test_advantages_errors():
    with pytest.raises(ValueError, match=r"rewards\[1\] = nan"):
        group_advantages([1.0, NAN], 2)
    with pytest.raises(ValueError, match="exactly one"):
        group_advantages([1.0, 0.0], 2, group_ids=[0, 0])
    with pytest.raises(ValueError, match="exactly one"):
        group_advantages([1.0, 0.0])
    with pytest.raises(ValueError, match="divide"):
        group_advantages([1.0, 0.0, 1.0], 2)
    with pytest.raises(ValueError, match="group_ids must have shape"):
        group_advantages([1.0, 0.0], group_ids=[0])
    with pytest.raises(ValueError, match="std must be"):
        group_advantages([1.0, 0.0], 2, std="unbiased")


# --------------------------------------------------------------------------- corrections


def test_correction_weights():
    c = torch.tensor([0.25, 0.5, 1.0, 2.0, 3.0, INF], dtype=F64)
    cb, aff = correction_weights(c, Correction("tis", cap=2.0))
    # TIS: min(c, 2); +inf -> 2; truncated where c > 2
    assert cb.tolist() == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]
    assert aff.tolist() == [False, False, False, False, True, True]
    cb, aff = correction_weights(c, Correction("mis", lo=0.5, hi=2.0))
    # MIS: c * 1[0.5 <= c <= 2], bounds inclusive; +inf is outside
    assert cb.tolist() == [0.0, 0.5, 1.0, 2.0, 0.0, 0.0]
    assert aff.tolist() == [True, False, False, False, True, True]
    cb, aff = correction_weights(c, Correction("is"))
    assert torch.equal(cb, c) and not aff.any()
    # none: no importance correction at all, every weight 1; "affected" marks c != 1
    cb, aff = correction_weights(c, Correction("none"))
    assert cb.tolist() == [1.0] * 6
    assert aff.tolist() == [True, True, False, True, True, True]
    with pytest.raises(ValueError, match="lo <= hi"):
        Correction("mis", lo=2.0, hi=1.0)
    with pytest.raises(ValueError, match="cap"):
        Correction("tis", cap=0.0)
    with pytest.raises(ValueError, match="kind"):
        Correction("icepop")


# --------------------------------------------------------------------------- loss: denominators

# B = 3, T = 3. Valid: row0 all 3 tokens, row1 its first token, row2 nothing (N = 4).
# On-policy ratio r = 1 (logp_prox = logp); c = p_prox / q per valid token:
#   row0: c = [1, 3, 0.5], A = +1;   row1: c = [1.5], A = -2;   row2: A = 7 (never read).
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
LOGP = [[-1.0, -2.0, -0.5], [-1.5, None, None], [None, None, None]]
C = [[1.0, 3.0, 0.5], [1.5, None, None], [None, None, None]]
ADV = torch.tensor([1.0, -2.0, 7.0], dtype=F64)


def _inputs(pad: float = 1e9, pad_q: float = NAN):
    lp = torch.tensor([[pad if v is None else v for v in row] for row in LOGP], dtype=F64)
    logc = torch.tensor([[0.0 if v is None else math.log(v) for v in row] for row in C], dtype=F64)
    lq = torch.where(MASK.bool(), lp - logc, torch.full_like(lp, pad_q))
    return lp.clone().requires_grad_(True), lq


IS = LossConfig(correction=Correction("is"))


def test_loss_none_means_no_importance_weight():
    lp, lq = _inputs()
    loss, st = grpo_loss(lp, lp.detach(), lq, ADV, MASK)  # default correction: none
    # c never enters: -(1/4) [1 + 1 + 1 + (-2)] = -0.25
    assert loss.item() == pytest.approx(-0.25, abs=1e-12)
    assert st["cbar_mean"] == 1.0 and st["c_mean"] == pytest.approx(1.5, abs=1e-12)
    loss.backward()
    # dL/dlogp_t = -A r / N: [-1/4] * 3, [+2/4]
    expect = torch.tensor([[-0.25, -0.25, -0.25], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(lp.grad, expect, rtol=0, atol=1e-12)


def test_loss_untruncated_is_token_mean_and_grad():
    lp, lq = _inputs()
    loss, st = grpo_loss(lp, lp.detach(), lq, ADV, MASK, IS)
    # -(1/4) [1*1 + 3*1 + 0.5*1 + 1.5*(-2)] = -(4.5 - 3)/4 = -0.375
    assert loss.item() == pytest.approx(-0.375, abs=1e-12)
    assert (st["n_tokens"], st["n_seqs"], st["n_dropped"]) == (4.0, 2.0, 0.0)
    assert st["c_mean"] == pytest.approx((1 + 3 + 0.5 + 1.5) / 4, abs=1e-12)
    assert st["cbar_mean"] == pytest.approx(1.5, abs=1e-12)
    loss.backward()
    # dL/dlogp_t = -c_t A r / N (unclipped, r = 1): [-1/4, -3/4, -0.5/4], [1.5*2/4]
    expect = torch.tensor([[-0.25, -0.75, -0.125], [0.75, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(lp.grad, expect, rtol=0, atol=1e-12)
    # logp_prox=None means p_prox = p_theta (single update per batch): identical
    lp2, lq2 = _inputs()
    assert grpo_loss(lp2, None, lq2, ADV, MASK, IS).loss.item() == pytest.approx(-0.375, abs=1e-12)


def test_loss_tis():
    lp, lq = _inputs()
    cfg = LossConfig(correction=Correction("tis", cap=2.0))
    loss, st = grpo_loss(lp, lp.detach(), lq, ADV, MASK, cfg)
    # c_bar = [1, min(3, 2) = 2, 0.5], [1.5]: -(1 + 2 + 0.5 - 3)/4 = -0.125
    assert loss.item() == pytest.approx(-0.125, abs=1e-12)
    assert st["tis_truncated_frac"] == pytest.approx(1 / 4)  # only c = 3
    assert st["c_max"] == pytest.approx(3.0, abs=1e-12)  # raw c is reported before truncation
    assert st["cbar_mean"] == pytest.approx((1 + 2 + 0.5 + 1.5) / 4, abs=1e-12)


def test_loss_mis_keeps_dropped_tokens_in_denominator():
    lp, lq = _inputs()
    cfg = LossConfig(correction=Correction("mis", lo=0.75, hi=2.5))
    loss, st = grpo_loss(lp, lp.detach(), lq, ADV, MASK, cfg)
    # c_bar = [1, 0 (3 > 2.5), 0 (0.5 < 0.75)], [1.5]: sum = 1 - 3 = -2
    # N = 4 (before masking): L = 2/4 = 0.5   (a kept-token denominator would give 2/2 = 1.0)
    assert loss.item() == pytest.approx(0.5, abs=1e-12)
    assert st["mis_masked_frac"] == pytest.approx(2 / 4)
    assert st["n_tokens"] == 4.0
    assert st["cbar_mean"] == pytest.approx((1 + 0 + 0 + 1.5) / 4, abs=1e-12)
    loss.backward()
    # masked tokens get no gradient
    assert lp.grad[0, 1].item() == 0.0 and lp.grad[0, 2].item() == 0.0
    assert lp.grad[0, 0].item() == pytest.approx(-0.25, abs=1e-12)


def test_loss_seq_mean():
    lp, lq = _inputs()
    loss, _ = grpo_loss(lp, lp.detach(), lq, ADV, MASK, LossConfig(agg="seq_mean", correction=Correction("is")))
    # row0: (1 + 3 + 0.5)/3 = 1.5; row1: 1.5 * (-2) / 1 = -3; row2 empty: excluded
    # L = -(1.5 - 3)/2 = 0.75
    assert loss.item() == pytest.approx(0.75, abs=1e-12)
    loss.backward()
    # dL/dlogp(0,0) = -(1/2)(1/3)(1)(1) = -1/6;  dL/dlogp(1,0) = -(1/2)(1/1)(1.5)(-2) = 1.5
    assert lp.grad[0, 0].item() == pytest.approx(-1 / 6, abs=1e-12)
    assert lp.grad[1, 0].item() == pytest.approx(1.5, abs=1e-12)
    # MIS with seq_mean: row0 (1 + 0 + 0)/3 = 1/3 (denominator 3 before masking); row1 -3
    # L = -(1/3 - 3)/2 = 4/3
    lp2, lq2 = _inputs()
    cfg = LossConfig(agg="seq_mean", correction=Correction("mis", lo=0.75, hi=2.5))
    assert grpo_loss(lp2, lp2.detach(), lq2, ADV, MASK, cfg).loss.item() == pytest.approx(4 / 3, abs=1e-12)


def test_loss_normalizer_override():
    lp, lq = _inputs()
    # global token count 8 (e.g. two micro-batches): -(1.5)/8 = -0.1875
    assert grpo_loss(lp, None, lq, ADV, MASK, IS, normalizer=8).loss.item() == pytest.approx(-0.1875, abs=1e-12)
    # seq_mean with 4 responses globally: -(1.5 - 3)/4 = 0.375
    cfg = LossConfig(agg="seq_mean", correction=Correction("is"))
    assert grpo_loss(lp, None, lq, ADV, MASK, cfg, normalizer=4).loss.item() == pytest.approx(0.375, abs=1e-12)
    with pytest.raises(ValueError, match="normalizer"):
        grpo_loss(lp, None, lq, ADV, MASK, normalizer=0)


@pytest.mark.parametrize("pad,pad_q", [(0.0, 0.0), (-INF, INF), (NAN, NAN), (1e30, -1e30)])
def test_loss_padding_never_counts(pad, pad_q):
    lp0, lq0 = _inputs()
    ref = grpo_loss(lp0, None, lq0, ADV, MASK, LossConfig(correction=Correction("tis")))
    ref.loss.backward()
    lp, lq = _inputs(pad, pad_q)
    prox = lp.detach().clone()
    adv_tok = ADV.unsqueeze(-1).expand(3, 3).clone()
    adv_tok[~MASK.bool()] = pad  # garbage advantages at invalid positions are never read either
    got = grpo_loss(lp, prox, lq, adv_tok, MASK, LossConfig(correction=Correction("tis")))
    got.loss.backward()
    assert got.loss.item() == ref.loss.item()
    assert torch.equal(lp.grad, lp0.grad)
    assert got.stats == ref.stats


def test_loss_all_masked_is_zero_with_finite_grad():
    lp, lq = _inputs()
    loss, st = grpo_loss(lp, None, lq, ADV, torch.zeros(3, 3))
    assert loss.item() == 0.0 and st["n_tokens"] == 0.0
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros(3, 3, dtype=F64))


# --------------------------------------------------------------------------- loss: clipping


def test_loss_asymmetric_clip():
    # eps_low = 0.2, eps_high = 0.28: clip range [0.8, 1.28]; c = 1 (logq = logp_prox = 0)
    r = torch.tensor([[1.5, 0.5, 0.5, 1.5]], dtype=F64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=F64)
    lp = torch.log(r).requires_grad_(True)
    zeros = torch.zeros(1, 4, dtype=F64)
    cfg = LossConfig(eps_low=0.2, eps_high=0.28)
    loss, st = grpo_loss(lp, zeros, zeros, adv, torch.ones(1, 4), cfg)
    # A=+1, r=1.5: min(1.5, 1.28) = 1.28 (clipped high)   A=+1, r=0.5: min(0.5, 0.8) = 0.5
    # A=-1, r=0.5: min(-0.5, -0.8) = -0.8 (clipped low)   A=-1, r=1.5: min(-1.5, -1.28) = -1.5
    # L = -(1.28 + 0.5 - 0.8 - 1.5)/4 = 0.52/4 = 0.13
    assert loss.item() == pytest.approx(0.13, abs=1e-12)
    assert st["clip_high_frac"] == pytest.approx(0.25) and st["clip_low_frac"] == pytest.approx(0.25)
    assert st["clip_frac"] == pytest.approx(0.5)
    assert st["ratio_mean"] == pytest.approx(1.0, abs=1e-12)
    loss.backward()
    # clipped tokens: no gradient; unclipped: dL/dlogp = -A r / N: -0.5/4 = -0.125, +1.5/4 = 0.375
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.125, 0.0, 0.375]], dtype=F64), rtol=0, atol=1e-12)


def test_loss_coupled_ratio_against_rollout_logprobs():
    # p_theta = 0.5 on 3 tokens, q = [0.25, 0.5, 0.8], p_prox = p_theta, A = +1, clip [0.8, 1.28]
    lp = torch.log(torch.tensor([[0.5, 0.5, 0.5]], dtype=F64)).requires_grad_(True)
    lq = torch.log(torch.tensor([[0.25, 0.5, 0.8]], dtype=F64))
    adv, mask = torch.ones(1, dtype=F64), torch.ones(1, 3)
    coupled = LossConfig(ratio="coupled")
    loss, st = grpo_loss(lp, lp.detach(), lq, adv, mask, coupled)
    # r = p_theta / q = [2, 1, 0.625]: min(2, 1.28) = 1.28 (clipped high), 1, min(0.625, 0.8) = 0.625
    # L = -(1.28 + 1 + 0.625)/3 = -0.9683333...
    assert loss.item() == pytest.approx(-(1.28 + 1 + 0.625) / 3, abs=1e-12)
    assert st["ratio_max"] == pytest.approx(2.0, abs=1e-12) and st["cbar_mean"] == 1.0
    assert (st["n_pos"], st["n_clip_pos"], st["n_coupled_clip_pos"]) == (3.0, 1.0, 1.0)
    assert st["clip_pos_frac"] == pytest.approx(1 / 3) and math.isnan(st["clip_neg_frac"])
    loss.backward()
    # clipped token: 0; others -A r / N = -1/3, -0.625/3
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -1 / 3, -0.625 / 3]], dtype=F64), rtol=0, atol=1e-12)
    # decoupled on the same tokens: r = p_theta / p_prox = 1 (nothing clipped), the coupled ratio is only logged
    lp.grad = None
    loss, st = grpo_loss(lp, lp.detach(), lq, adv, mask)
    assert loss.item() == pytest.approx(-1.0, abs=1e-12)  # none: -(1 + 1 + 1)/3
    assert (st["n_clip_pos"], st["n_coupled_clip_pos"]) == (0.0, 1.0)
    loss, _ = grpo_loss(lp, lp.detach(), lq, adv, mask, IS)
    assert loss.item() == pytest.approx(-(2 + 1 + 0.625) / 3, abs=1e-12)  # c = [2, 1, 0.625]
    with pytest.raises(ValueError, match="coupled.*no importance correction"):
        LossConfig(ratio="coupled", correction=Correction("tis"))
    assert LossConfig().eps_high == 0.28 and LossConfig().eps_low == 0.2


# --------------------------------------------------------------------------- loss: non-finite


def test_loss_nonfinite_log_ratios_are_dropped_but_counted():
    # all A = 1, N = 4:
    #   t0: c = 1, r = 1 -> contributes 1
    #   t1: logq = -inf          -> log c = +inf       -> dropped
    #   t2: logp = logp_prox = -inf -> log c = -inf, log r = NaN -> dropped
    #   t3: logp = -inf only     -> log r = -inf       -> dropped
    # L = -(1 + 0 + 0 + 0)/4 = -0.25. (AReaL's log-ratio -> 0 would keep t1..t3 with weight 1:
    # -(4)/4 = -1; verl/Miles TIS would weight t1 by C.)
    lp = torch.tensor([[-1.0, -1.0, -INF, -INF]], dtype=F64, requires_grad=True)
    prox = torch.tensor([[-1.0, -1.0, -INF, -1.0]], dtype=F64)
    lq = torch.tensor([[-1.0, -INF, -1.0, -1.0]], dtype=F64)
    for corr in (Correction("none"), Correction("is"), Correction("tis"), Correction("mis")):
        lp.grad = None
        loss, st = grpo_loss(lp, prox, lq, torch.ones(1, dtype=F64), torch.ones(1, 4), LossConfig(correction=corr))
        assert loss.item() == pytest.approx(-0.25, abs=1e-12), corr
        assert st["n_dropped"] == 3.0 and st["dropped_frac"] == 0.75 and st["n_tokens"] == 4.0
        loss.backward()
        assert torch.equal(lp.grad, torch.tensor([[-0.25, 0.0, 0.0, 0.0]], dtype=F64))
        assert all(math.isfinite(v) for k, v in st.items() if k != "clip_neg_frac")  # no A < 0 token: nan
        assert math.isnan(st["clip_neg_frac"])
    with pytest.raises(ValueError, match=r"3 valid token\(s\).*first at \[0, 1\]"):
        grpo_loss(lp, prox, lq, torch.ones(1, dtype=F64), torch.ones(1, 4), LossConfig(nonfinite="raise"))


def test_loss_overflow_float32():
    # float32: c = e^100 overflows to inf. With untruncated IS the token is dropped (still in N);
    # under TIS it is a legitimate c > C and is truncated to 2; under none c never enters.
    lp = torch.zeros(1, 2, requires_grad=True)
    lq = torch.tensor([[0.0, -100.0]])
    adv = torch.ones(1)
    loss, st = grpo_loss(lp, None, lq, adv, torch.ones(1, 2), IS)
    # -(1*1 + 0)/2 = -0.5
    assert loss.item() == pytest.approx(-0.5) and st["n_dropped"] == 1.0
    loss, st = grpo_loss(lp, None, lq, adv, torch.ones(1, 2))
    # -(1 + 1)/2 = -1
    assert loss.item() == pytest.approx(-1.0) and st["n_dropped"] == 0.0
    loss, st = grpo_loss(lp, None, lq, adv, torch.ones(1, 2), LossConfig(correction=Correction("tis", cap=2.0)))
    # -(1 + 2)/2 = -1.5
    assert loss.item() == pytest.approx(-1.5) and st["n_dropped"] == 0.0 and st["tis_truncated_frac"] == 0.5
    assert loss.dtype == torch.float32


# --------------------------------------------------------------------------- loss: KL


def test_loss_k3_kl_term():
    # A = 0 (policy term 0); u = log p_ref - log p = [ln 2, 0]:
    # k3 = [e^ln2 - ln2 - 1, 0] = [0.3068528194, 0]; token mean 0.1534264097; beta = 0.1
    lp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    ref = lp.detach() + torch.tensor([[math.log(2.0), 0.0]], dtype=F64)
    cfg = LossConfig(beta=0.1)
    loss, st = grpo_loss(lp, None, lp.detach(), torch.zeros(1, dtype=F64), torch.ones(1, 2), cfg, logp_ref=ref)
    k3 = 1 - math.log(2.0)
    assert st["kl"] == pytest.approx(k3 / 2, abs=1e-12)
    assert loss.item() == pytest.approx(0.1 * k3 / 2, abs=1e-12)
    assert st["kl_loss"] == pytest.approx(0.1 * k3 / 2, abs=1e-12)
    loss.backward()
    # d/dlogp [beta/N (e^u - u - 1)] = -(beta/N)(e^u - 1): token0 -(0.1/2)(2 - 1) = -0.05, token1 0
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.05, 0.0]], dtype=F64), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="needs logp_ref"):
        grpo_loss(lp, None, lp.detach(), torch.zeros(1, dtype=F64), torch.ones(1, 2), cfg)
    # without beta the KL is only logged
    loss0, st0 = grpo_loss(lp, None, lp.detach(), torch.zeros(1, dtype=F64), torch.ones(1, 2), logp_ref=ref)
    assert loss0.item() == 0.0 and st0["kl"] == pytest.approx(k3 / 2, abs=1e-12) and st0["kl_loss"] == 0.0


# --------------------------------------------------------------------------- validation


def test_loss_argument_errors():
    lp, lq = _inputs()
    with pytest.raises(ValueError, match="adv must have shape"):
        grpo_loss(lp, None, lq, ADV.unsqueeze(0), MASK)
    with pytest.raises(ValueError, match="adv must be finite on valid tokens"):
        grpo_loss(lp, None, lq, torch.tensor([1.0, NAN, 0.0], dtype=F64), MASK)
    with pytest.raises(ValueError, match="logq has shape"):
        grpo_loss(lp, None, lq[:, :2], ADV, MASK)
    with pytest.raises(ValueError, match="mask must be bool or 0/1"):
        grpo_loss(lp, None, lq, ADV, MASK * 2)
    with pytest.raises(ValueError, match="eps_low"):
        LossConfig(eps_low=1.0)
    with pytest.raises(ValueError, match="agg"):
        LossConfig(agg="sum")
    # [B] and [B, 1] and [B, T] advantages agree
    a1 = grpo_loss(lp, None, lq, ADV, MASK).loss
    a2 = grpo_loss(lp, None, lq, ADV.unsqueeze(-1), MASK).loss
    a3 = grpo_loss(lp, None, lq, ADV.unsqueeze(-1).expand(3, 3), MASK).loss
    assert a1.item() == a2.item() == a3.item()
