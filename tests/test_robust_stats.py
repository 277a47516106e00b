"""Statistics on huge but finite inputs (issue 31): rescaled before summing, never a NaN or a wrong inf,
and bit-identical to the plain sums on ordinary inputs (:mod:`qpass.diagnostics.robust`)."""

from __future__ import annotations

import math

import pytest
import torch

from qpass.diagnostics.layerwise import layerwise_mismatch
from qpass.diagnostics.metrics import mismatch_metrics
from qpass.rl.loss import group_advantages

H = 1.5e308  # finite float64; twice it is not


def test_mismatch_means_of_huge_finite_gaps_are_finite():
    """Old code: G_abs = inf and K1 = inf for 32 tokens at d = -1.5e308 and 32 at +1.5e308 (true: 1.5e308 and 0)."""
    lp = torch.cat([torch.full((1, 32), -H, dtype=torch.float64), torch.zeros(1, 32, dtype=torch.float64)], 1)
    lq = torch.cat([torch.zeros(1, 32, dtype=torch.float64), torch.full((1, 32), -H, dtype=torch.float64)], 1)
    m = mismatch_metrics(lp, lq, torch.ones(1, 64, dtype=torch.bool))
    assert m.token.g_abs == H and m.token.k1 == 0.0 and m.max_abs == H
    assert m.response.g_abs == H and m.response.k1 == 0.0
    assert m.token.k3 == math.inf  # e^d of d = 1.5e308 is inf: the estimator is +inf, as documented (not NaN)
    assert m.n_finite == 64 and m.n_posinf == 0


def test_finite_log_probs_whose_difference_overflows_are_an_error_not_a_probability_zero():
    """Old code: logp = 1e308, logq = -1e308 counted as a +inf token (the rollout's probability 0)."""
    lp = torch.tensor([[1e308, -1.0]], dtype=torch.float64)
    lq = torch.tensor([[-1e308, -1.5]], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"logp - logq overflows float64 at \[0, 0\] \(logp=1e\+308, logq=-1e\+308\)"):
        mismatch_metrics(lp, lq, torch.ones(1, 2, dtype=torch.bool))


def test_ordinary_inputs_give_the_plain_sums_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    lp, lq = -torch.rand(4, 9, generator=g, dtype=torch.float64) * 5, -torch.rand(4, 9, generator=g, dtype=torch.float64) * 5
    mask = torch.rand(4, 9, generator=g) < 0.7
    m = mismatch_metrics(lp, lq, mask)
    d = torch.where(mask, lp - lq, torch.zeros(()))
    n = int(mask.sum())
    assert m.token.g_abs == float(d.abs().sum()) / n and m.token.k1 == float(-d.sum()) / n
    assert m.token.k3 == float(torch.where(mask, torch.expm1(d) - d, torch.zeros(())).sum()) / n


def test_layerwise_mismatch_of_huge_finite_activations():
    """Old code: rel = nan (inf / inf), fro = rms = inf for float64 activations at 1e300."""
    x = torch.full((4, 16), 1e300, dtype=torch.float64)
    m = layerwise_mismatch({"a": x}, {"a": x * 0.5})["a"]
    assert m.rel == 0.5 and m.max_abs == 5e299
    assert m.rms == pytest.approx(5e299, rel=1e-15) and m.fro == pytest.approx(5e299 * 8, rel=1e-15)
    y = torch.randn(3, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    plain = layerwise_mismatch({"a": y}, {"a": y * 1.25})["a"]  # ordinary values: the unscaled path
    assert plain.rel == float(torch.linalg.vector_norm(y * 1.25 - y)) / float(torch.linalg.vector_norm(y))


def test_group_advantages_of_huge_finite_rewards():
    """Old code: a group [1.5e308, 1.6e308] gave NaN (its sum overflowed), [1e308, -1e308] gave 0 (the
    squares overflowed: std = inf)."""
    adv = group_advantages(torch.tensor([1.5e308, 1.6e308, 1e308, -1e308, 0.0, 5.0], dtype=torch.float64), 2)
    r = 2 ** -0.5  # sample std of two values: |R - mean| / std = 1/sqrt(2) (eps is negligible at this scale)
    small = 2.5 / (math.sqrt(12.5) + 1e-6)
    assert torch.allclose(adv, torch.tensor([-r, r, r, -r, -small, small], dtype=torch.float64), rtol=1e-13, atol=0)
    g = torch.Generator().manual_seed(2)
    ordinary = torch.rand(12, generator=g)  # float32 rewards never take the rescaled path: the plain formula, bit for bit
    r64 = ordinary.double().reshape(3, 4)
    c = r64 - r64.mean(-1, keepdim=True)
    plain = c / (torch.sqrt((c * c).sum(-1, keepdim=True) / 3) + 1e-6)
    assert torch.equal(group_advantages(ordinary, 4), plain.reshape(-1).float())
