"""The local arithmetic task: generation, splits, prompts, rewards and the safe-reward wrapper."""

from __future__ import annotations

import itertools
import logging
import math

import pytest
import torch

from qpass.rl.loss import group_advantages
from qpass.rl.task import (
    ArithmeticConfig,
    ArithmeticTask,
    ExactAnswerReward,
    RewardFn,
    SafeReward,
    difficulty_preset,
    evaluate_expression,
    exact_answer_reward,
    format_prompt,
    parse_last_integer,
    safe_reward,
)


def test_evaluate_expression_precedence():
    assert evaluate_expression((2, 3, 4), ("+", "*")) == 14  # 2 + 12
    assert evaluate_expression((10, 2, 3, 1), ("-", "*", "-")) == 3  # 10 - 6 - 1
    assert evaluate_expression((2, 3, 4, 5), ("*", "*", "-")) == 19  # 24 - 5
    assert evaluate_expression((7, 9), ("-",)) == -2
    with pytest.raises(ValueError, match="operators"):
        evaluate_expression((1, 2), ())
    with pytest.raises(ValueError, match="unknown operator"):
        evaluate_expression((1, 2), ("/",))


def test_generation_is_seeded_and_answers_are_exact():
    cfg = ArithmeticConfig(n_train=300, n_eval=50, seed=7)
    a, b = ArithmeticTask(cfg), ArithmeticTask(cfg)
    assert a.train == b.train and a.eval == b.eval
    c = ArithmeticTask(ArithmeticConfig(n_train=300, n_eval=50, seed=8))
    assert [p.expression for p in c.eval] != [p.expression for p in a.eval]
    for p in a.train + a.eval:
        # our own generated strings only contain digits, spaces and + - *: Python's eval is a
        # fine independent oracle here
        assert p.answer == eval(p.expression)  # noqa: S307
        assert 2 <= len(p.operands) <= 3 and all(0 <= v <= 99 for v in p.operands)
        assert p.meta["answer"] == p.answer and p.meta["id"] == p.id


def test_splits_are_disjoint_and_eval_is_stable():
    t = ArithmeticTask(ArithmeticConfig(n_train=500, n_eval=100, seed=1))
    train = {p.expression for p in t.train}
    evals = {p.expression for p in t.eval}
    assert len(train) == 500 and len(evals) == 100 and not train & evals
    assert not {t.prompt(p) for p in t.train} & {t.prompt(p) for p in t.eval}
    assert all(p.split == "train" for p in t.train) and all(p.split == "eval" for p in t.eval)
    # the eval split does not depend on n_train
    t2 = ArithmeticTask(ArithmeticConfig(n_train=20, n_eval=100, seed=1))
    assert t2.eval == t.eval


def test_difficulty_and_config_validation():
    p1 = ArithmeticTask(difficulty_preset(1, n_train=30, n_eval=10))
    assert all(len(p.operands) == 2 and p.operators == ("+",) and max(p.operands) <= 9 for p in p1.train)
    p4 = ArithmeticTask(difficulty_preset(4, n_train=30, n_eval=0, seed=3))
    assert all(3 <= len(p.operands) <= 4 and all(10 <= v <= 999 for v in p.operands) for p in p4.train)
    assert p4.eval == []
    custom = ArithmeticTask(ArithmeticConfig(n_operands=(4, 4), digits=(3, 3), operators=("*",), n_train=5, n_eval=5))
    assert all(len(p.operands) == 4 and set(p.operators) == {"*"} for p in custom.train)
    with pytest.raises(ValueError, match="n_operands"):
        ArithmeticConfig(n_operands=(1, 2))
    with pytest.raises(ValueError, match="digits"):
        ArithmeticConfig(digits=(0, 2))
    with pytest.raises(ValueError, match="operators"):
        ArithmeticConfig(operators=("/",))
    with pytest.raises(ValueError, match="difficulty level"):
        difficulty_preset(9)
    # two 1-digit operands with '+' give only 10 * 10 = 100 distinct expressions
    with pytest.raises(ValueError, match="could only draw 100 unique problems of the 150"):
        ArithmeticTask(difficulty_preset(1, n_train=120, n_eval=30), max_attempts_factor=20)


def test_prompt_formatting():
    t = ArithmeticTask(ArithmeticConfig(n_train=3, n_eval=1))
    p = t.train[0]
    text = format_prompt(p)
    assert text.startswith(f"Compute {p.expression}.") and "Answer: <integer>" in text
    assert format_prompt(p, "Q: {expression} =") == f"Q: {p.expression} ="
    with pytest.raises(ValueError, match="expression"):
        format_prompt(p, "no placeholder")


def test_train_batches():
    t = ArithmeticTask(ArithmeticConfig(n_train=10, n_eval=0))
    batches = list(itertools.islice(t.train_batches(4, seed=0), 4))
    # 10 problems, batches of 4: two full batches per epoch (the short remainder is dropped)
    assert [len(b) for b in batches] == [4, 4, 4, 4]
    assert len({p.id for p in batches[0] + batches[1]}) == 8  # no repeats within an epoch
    again = list(itertools.islice(t.train_batches(4, seed=0), 4))
    assert batches == again
    assert len(next(t.train_batches(64))) == 10  # split smaller than a batch: the whole split
    with pytest.raises(ValueError, match="batch_size"):
        next(t.train_batches(0))


@pytest.mark.parametrize(
    "text,value",
    [
        ("Answer: 42", 42),
        ("first 3 then 5, so Answer: -17", -17),
        ("The answer is 1,234.", 1234),
        ("so it is 12.0", 12),
        ("x = 2.5", None),
        ("10-3", 3),  # a '-' right after a digit is an operator, not a sign
        ("\u22125", -5),  # Unicode minus
        ("", None),
        (None, None),
        ("no digits here", None),
    ],
)
def test_parse_last_integer(text, value):
    assert parse_last_integer(text) == value


def test_exact_answer_reward():
    meta = {"id": "train-0", "answer": -17}
    assert isinstance(exact_answer_reward, RewardFn)
    assert exact_answer_reward(meta, "8 - 25 = -17\nAnswer: -17") == 1.0
    assert exact_answer_reward(meta, "Answer: -17 because 3 + 4 = 7") == 0.0  # last integer is 7
    assert exact_answer_reward(meta, "Answer: 17") == 0.0
    assert exact_answer_reward(meta, "") == 0.0
    fmt = ExactAnswerReward(format_weight=0.1)
    assert fmt(meta, "work...\nAnswer: 16") == 0.1  # wrong but well-formatted
    assert fmt(meta, "I think 16") == 0.0
    assert fmt(meta, "Answer: -17") == 1.0
    with pytest.raises(ValueError, match="format_weight"):
        ExactAnswerReward(format_weight=1.0)


def test_safe_reward_failures_are_zero_and_counted(caplog):
    def boom(meta, text):
        raise RuntimeError("judge offline")

    meta = {"id": "train-3", "answer": 5}
    with caplog.at_level(logging.WARNING, logger="qpass.rl.task"):
        s = safe_reward(boom)
        assert s(meta, "5") == 0.0
    assert s.n_exceptions == 1 and s.n_failures == 1
    assert "judge offline" in caplog.text and "train-3" in caplog.text

    outs = iter([math.nan, math.inf, None, "1.0", torch.tensor([1.0, 2.0]), torch.tensor(0.5), True, 3])
    s2 = safe_reward(lambda m, t: next(outs))
    got = [s2(meta, "x") for _ in range(8)]
    # NaN, inf -> 0 (non-finite); None, "1.0", a 2-element tensor -> 0 (not a number);
    # 0-dim tensor 0.5, True -> 1.0, int 3 -> 3.0 are numbers
    assert got == [0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 1.0, 3.0]
    assert (s2.n_nonfinite, s2.n_bad_type, s2.n_exceptions, s2.n_calls) == (2, 3, 0, 8)
    assert s2.stats()["reward/n_failures"] == 5.0

    # empty responses: counted and scored normally (the default reward gives 0)
    s3 = SafeReward(exact_answer_reward)
    assert s3(meta, "") == 0.0 and s3(meta, None) == 0.0 and s3(meta, "  \n") == 0.0
    assert s3(meta, "Answer: 5") == 1.0
    assert (s3.n_empty, s3.n_failures) == (3, 0)
    # a reward function reading a missing key is a failure, not a crash
    assert s3({"id": "x"}, "5") == 0.0 and s3.n_exceptions == 1
    with pytest.raises(ValueError, match="default"):
        safe_reward(boom, default=math.nan)


def test_rewards_to_advantages_never_nan():
    # a group where the reward plug-in fails on every response yields rewards [0, 0, 0, 0] and
    # advantages exactly 0; a mixed group gives finite advantages
    flaky = safe_reward(lambda m, t: math.nan if "?" in t else exact_answer_reward(m, t))
    meta = {"id": "p", "answer": 4}
    rewards = [flaky(meta, t) for t in ["?", "?", "?", "?", "Answer: 4", "4?", "", "Answer: 3"]]
    assert rewards == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    adv = group_advantages(torch.tensor(rewards), 4)
    assert bool(torch.isfinite(adv).all())
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    # group 2: [1, 0, 0, 0]: mean 0.25, sample std sqrt(0.75/3) = 0.5 -> A0 = 0.75/0.500001
    assert adv[4].item() == pytest.approx(0.75 / 0.500001, abs=1e-6)


def test_safe_reward_warning_throttle(caplog):
    s = safe_reward(lambda m, t: math.nan, max_warnings=2)
    with caplog.at_level(logging.DEBUG, logger="qpass.rl.task"):
        for _ in range(4):
            assert s({"id": "q"}, "x") == 0.0
    levels = [r.levelno for r in caplog.records if r.name == "qpass.rl.task"]
    assert levels == [logging.WARNING, logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert "logged at DEBUG" in caplog.records[1].getMessage()
    assert s.n_nonfinite == 4
