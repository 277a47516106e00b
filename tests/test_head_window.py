"""The learner's logits at the response positions only (qpass.runtime.head_window, issue 31 item 7).

``response_logprobs`` on a :class:`TorchLearner` must never materialise logits at every position
(the output projection runs on the ``N * R`` response rows only), and the log-probs it returns must be
those of the full computation at those positions, bit for bit; gradients reach the parameters
through those rows only, as through the slice of the full logits.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qpass.recipe import load_recipe
from qpass.rl.experience import Experience, WindowScorer, response_logprobs
from qpass.runtime import TorchLearner
from qpass.runtime.head_window import split_at_head

V, H = 256, 64  # tiny_llama's vocabulary and hidden size


class _VocabRows(TorchDispatchMode):
    """Records the row count (numel / V) of every op output whose last dimension is V, except the
    output projection's transposed weight ``[H, V]`` (and its gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == V and tuple(t.shape) != (H, V):
                self.rows.append(t.numel() // V)
        return out


def _experience(n: int = 3, p: int = 7, r: int = 4) -> Experience:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, V, (n, p + r), generator=g)
    am = torch.ones_like(ids)
    am[0, :2] = 0  # left padding
    mask = torch.ones(n, r, dtype=torch.bool)
    mask[1, 2:] = False
    return Experience(ids, am, p, mask, mask.clone(), torch.zeros(n, r), torch.zeros(n, dtype=torch.bool))


@pytest.fixture
def learner(tiny_pipeline):
    lq, _ = tiny_pipeline.build(load_recipe("quads_nvfp4"))
    return TorchLearner(lq)


def test_response_logprobs_never_materialises_all_positions(learner):
    exp = _experience()
    assert isinstance(learner, WindowScorer)
    with _VocabRows() as seen:
        logp, _ = response_logprobs(learner, exp)
        logp.sum().backward()
    assert seen.rows and max(seen.rows) == exp.n * exp.response_width  # 12 rows, never 3 * 11 = 33
    with _VocabRows() as full:
        learner(exp.input_ids, exp.attention_mask)
    assert max(full.rows) == exp.n * exp.input_ids.shape[1]  # the hook does see the full computation


def test_window_logprobs_equal_the_full_computation_bit_for_bit(learner):
    exp = _experience()
    p, r = exp.prompt_len, exp.response_width
    with torch.no_grad():
        full_logits = learner(exp.input_ids, exp.attention_mask)
        win = learner.window_logits(exp.input_ids, exp.attention_mask, p - 1, p - 1 + r)
        full_lp = learner.token_logprobs(exp.input_ids, exp.attention_mask, temperature=0.5, top_p=0.9)[:, p - 1:]
        lp, _ = response_logprobs(learner, exp, temperature=0.5, top_p=0.9)
    assert win.shape == (exp.n, r, V) and win.dtype == torch.bfloat16
    assert torch.equal(win, full_logits[:, p - 1:p - 1 + r])
    assert torch.equal(lp, full_lp)


def test_gradient_flows_through_the_used_rows_as_through_the_full_slice(learner):
    exp = _experience()
    p, r = exp.prompt_len, exp.response_width
    w = torch.linspace(-1.0, 1.0, exp.n * r).reshape(exp.n, r) * exp.response_mask

    def grads(logp: torch.Tensor) -> dict[str, torch.Tensor]:
        learner.zero_grad(set_to_none=True)
        (logp * w).sum().backward()
        return {k: v.grad.clone() for k, v in learner.master_parameters().items() if v.grad is not None}

    win = grads(response_logprobs(learner, exp)[0])
    full = grads(learner.token_logprobs(exp.input_ids, exp.attention_mask)[:, p - 1:])
    assert sorted(win) == sorted(full) and len(win) > 0
    for k in full:  # one GEMM over 12 rows instead of 33 (21 of them zero): the same up to summation order
        torch.testing.assert_close(win[k], full[k], rtol=1e-2, atol=1e-5, msg=k)


def test_split_follows_a_replaced_parameter_and_registers_nothing(learner):
    exp = _experience()
    p, r = exp.prompt_len, exp.response_width
    keys = list(learner.state_dict())
    learner.window_logits(exp.input_ids, exp.attention_mask, p - 1, p - 1 + r)
    assert list(learner.state_dict()) == keys  # the trunk is not a submodule
    split = learner._split
    assert split is not None and split.current(learner.gm)
    head = learner.gm.model.lm_head
    head.weight = torch.nn.Parameter(head.weight.detach() * 2)
    assert not split.current(learner.gm)
    with torch.no_grad():
        win = learner.window_logits(exp.input_ids, exp.attention_mask, p - 1, p - 1 + r)
        full = learner(exp.input_ids, exp.attention_mask)[:, p - 1:p - 1 + r]
    assert torch.equal(win, full) and learner._split is not split


def test_window_outside_the_sequence_is_refused(learner):
    exp = _experience()
    with pytest.raises(ValueError, match=r"window \[5, 12\) is outside the sequence of length 11"):
        learner.window_logits(exp.input_ids, exp.attention_mask, 5, 12)


def test_a_head_that_is_not_row_wise_is_not_split():
    class Soft(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(self.lin(x), dim=1)  # mixes rows

    gm = torch.export.export(Soft(), (torch.randn(2, 3, 4),)).module()
    assert split_at_head(gm) is None
