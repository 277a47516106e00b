"""The one capture-and-compare of linear inputs (qpass.diagnostics.capture) used by apply, the GRPO
layer-wise probe and the study: hand-made captures with exact values, and the tiny Llama."""

from __future__ import annotations

import math

import pytest
import torch

from qpass.diagnostics.capture import capture_learner, capture_linear_inputs, compare_captures, compare_graph_inputs
from qpass.diagnostics.layerwise import layerwise_mismatch


def _acts(**sites):
    return {s: (x, x) for s, x in sites.items()}


def test_compare_captures_exact_values_order_and_skips():
    xl = torch.tensor([[[3.0, 0.0], [9.0, 9.0]]])  # [B=1, T=2, K=2]; token 1 is padding
    xr = torch.tensor([[[3.0, 4.0], [0.0, 0.0]]])
    moe = torch.ones(3, 2)  # 3 routed rows: not one row per token
    mask = torch.tensor([[True, False]])
    cmp = compare_captures(_acts(b=xl, a=xl, e=moe), _acts(a=xr, b=xl, e=moe[:1]), mask)
    assert list(cmp.per_site) == ["b", "a"] and cmp.skipped == ["e"]  # the learner's order
    a = cmp.per_site["a"]["pre"]
    assert (a.fro, a.rel, a.max_abs, a.n_tokens, a.numel) == (4.0, 4.0 / 3.0, 4.0, 1, 2)
    assert cmp.per_site["b"]["pre"].rel == 0.0 and cmp.rel() == {"b": 0.0, "a": 4.0 / 3.0}
    assert torch.equal(cmp.rollout_rows["a"], torch.tensor([[3.0, 4.0]]))
    assert list(compare_captures(_acts(a=xl, b=xl), _acts(b=xl, a=xr), mask, order=["a", "b"]).per_site) == ["a", "b"]
    # same numbers as layerwise_mismatch with the mask
    ref = layerwise_mismatch({"a": xl}, {"a": xr}, mask)["a"]
    assert a == ref


def test_compare_captures_strict_nonfinite_and_bad_arguments():
    x = torch.ones(1, 1, 16)
    mask = torch.ones(1, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"only in learner: \['a'\], only in rollout: \['b'\]"):
        compare_captures(_acts(a=x), _acts(b=x), mask, strict=True)
    bad = x.clone()
    bad[0, 0, 3] = math.nan
    with pytest.raises(ValueError, match="non-finite rollout activation"):
        compare_captures(_acts(a=x), _acts(a=bad), mask)
    m = compare_captures(_acts(a=x), _acts(a=bad), mask, nonfinite="nan").per_site["a"]["pre"]
    assert math.isnan(m.rel) and math.isnan(m.fro) and m.n_tokens == 1
    with pytest.raises(ValueError, match="nonfinite must be"):
        compare_captures(_acts(a=x), _acts(a=x), mask, nonfinite="zero")


def test_learner_capture_looks_through_act_qdq_and_both_capture_forms_agree(tiny_pipeline):
    """w4a4_qat's learner quantizes activations in front of its linears: the recorded input is X (the
    act_qdq's input, kept when it runs: before, a freed input made the capture fail with a KeyError)."""
    from qpass.recipe import load_recipe

    learner, rollout = tiny_pipeline.build(load_recipe("w4a4_qat"))
    ids = torch.tensor([[0, 3, 11, 12], [3, 15, 16, 17], [0, 0, 3, 4], [3, 5, 6, 7]])
    am = (ids != 0).long()
    acts = capture_learner(learner, ids, am, effective=True)
    q0 = "model.layers.0.self_attn.q_proj"
    pre, eff = acts[q0]
    assert pre.shape == (4, 4, 64) and not torch.equal(pre, eff)  # eff = DQ(Q_A(X))
    from qpass.sampling import positions_from_mask

    flat = capture_linear_inputs(learner.gm, (ids, am, positions_from_mask(am)))
    assert flat.keys() == acts.keys()
    assert all(torch.equal(flat[s], acts[s][0].reshape(-1, acts[s][0].shape[-1])) for s in flat)
    cmp = compare_graph_inputs(learner, rollout, ids, am)
    assert cmp.skipped == [] and len(cmp.per_site) == 15
    assert cmp.per_site[q0]["pre"].rel == 0.0  # layer 0's q_proj input precedes every quantized op
    assert cmp.per_site[q0]["pre"].n_tokens == int(am.sum())
