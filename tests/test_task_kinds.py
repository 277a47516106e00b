"""Issue 13 calibration variants of the task: the successor / larger kinds, their presets and
templates, the few-shot templates and the first-integer reward (hand-computed expectations)."""

from __future__ import annotations

import pytest

from qpass.rl.task import (
    KINDS,
    TASK_PRESETS,
    TEMPLATES,
    ArithmeticConfig,
    ArithmeticProblem,
    ArithmeticTask,
    ExactAnswerReward,
    exact_answer_reward,
    first_answer_reward,
    format_prompt,
    parse_first_integer,
    task_preset,
)


def test_successor_problems_prompt_and_answer():
    t = ArithmeticTask(task_preset("successor", n_train=400, n_eval=400, seed=0))
    for p in t.train + t.eval:
        (n,) = p.operands
        assert 100 <= n <= 999 and p.operators == () and p.expression == str(n) and p.answer == n + 1
    # 400 + 400 distinct problems (of the 900 3-digit numbers), splits disjoint
    assert len({p.expression for p in t.train}) == 400 and len({p.expression for p in t.eval}) == 400
    assert not {p.expression for p in t.train} & {p.expression for p in t.eval}
    p = ArithmeticProblem("eval-0", "eval", (389,), (), "389", 390)
    assert format_prompt(p, TEMPLATES[KINDS["successor"].template]) == (
        "What number comes after 389? Reply with the integer only.")
    with pytest.raises(ValueError, match="could only draw 900 unique"):
        ArithmeticTask(task_preset("successor", n_train=501, n_eval=400))


def test_larger_problems_prompt_and_answer():
    t = ArithmeticTask(task_preset("larger", n_train=400, n_eval=400, seed=3))
    for p in t.train + t.eval:
        a, b = p.operands
        assert a != b and 10 <= min(a, b) and max(a, b) <= 99
        assert p.expression == f"{a} or {b}" and p.answer == max(a, b)
    assert len({p.expression for p in t.train + t.eval}) == 800
    # the larger number comes first about half the time (no position shortcut)
    first = sum(p.operands[0] > p.operands[1] for p in t.train)
    assert 160 <= first <= 240
    p = ArithmeticProblem("eval-0", "eval", (47, 52), (), "47 or 52", 52)
    assert format_prompt(p, TEMPLATES["larger"]) == "Which is larger, 47 or 52? Reply with the larger number only."
    assert format_prompt(p, TEMPLATES["larger_fewshot"]) == (
        "Reply with the larger number only.\nQ: Which is larger, 31 or 17?\nA: 31\n"
        "Q: Which is larger, 58 or 64?\nA: 64\nQ: Which is larger, 47 or 52?\nA:")


def test_larger_with_one_digit_operands_still_draws_distinct_pairs():
    t = ArithmeticTask(ArithmeticConfig(kind="larger", digits=(1, 1), n_train=80, n_eval=10, seed=1))
    assert len({p.expression for p in t.train + t.eval}) == 90  # all 10 * 9 ordered pairs


def test_kinds_are_seeded_and_presets_validated():
    for name in TASK_PRESETS:
        a = ArithmeticTask(task_preset(name, n_train=50, n_eval=20, seed=5))
        b = ArithmeticTask(task_preset(name, n_train=50, n_eval=20, seed=5))
        c = ArithmeticTask(task_preset(name, n_train=50, n_eval=20, seed=6))
        assert a.train == b.train and a.eval == b.eval
        assert [p.expression for p in a.eval] != [p.expression for p in c.eval]
    # arithmetic is the difficulty preset; unchanged problems for the default kind
    assert task_preset("arithmetic", level=1, n_train=5, n_eval=5) == ArithmeticConfig(
        n_operands=(2, 2), digits=(1, 1), operators=("+",), n_train=5, n_eval=5)
    with pytest.raises(ValueError, match="task must be one of"):
        task_preset("division")
    with pytest.raises(ValueError, match="kind must be one of"):
        ArithmeticConfig(kind="division")
    assert all(k.template in TEMPLATES for k in KINDS.values())


def test_fewshot_and_equation_templates():
    p = ArithmeticProblem("train-0", "train", (9, 36), ("+",), "9 + 36", 45)
    assert format_prompt(p, TEMPLATES["fewshot"]) == (
        "Reply with the integer only.\nQ: 12 + 7\nA: 19\nQ: 30 + 45\nA: 75\nQ: 9 + 36\nA:")
    assert format_prompt(p, TEMPLATES["equation"]) == "Complete the equation with one integer: 9 + 36 ="


@pytest.mark.parametrize(
    "text,value",
    [
        ("390", 390),
        ("390. It comes after 389.", 390),
        ("The number after 389 is 390", 389),
        ("-17, so", -17),
        ("1,234 and 5", 1234),
        ("12.0 then 13", 12),
        ("2.5 then 3", None),  # the first number is not an integer: no answer
        ("", None),
        (None, None),
        ("none", None),
    ],
)
def test_parse_first_integer(text, value):
    assert parse_first_integer(text) == value


def test_first_answer_reward():
    meta = {"id": "train-0", "answer": 390}
    assert first_answer_reward(meta, "390") == 1.0
    assert first_answer_reward(meta, "390 comes after 389.") == 1.0
    assert exact_answer_reward(meta, "390 comes after 389.") == 0.0  # last integer is 389
    assert first_answer_reward(meta, "After 389 comes 390.") == 0.0  # first integer is 389
    assert exact_answer_reward(meta, "After 389 comes 390.") == 1.0
    assert first_answer_reward(meta, "") == 0.0
    assert ExactAnswerReward(position="first") == first_answer_reward
    with pytest.raises(ValueError, match="position"):
        ExactAnswerReward(position="middle")


def test_grpo_cli_task_choices_and_errors(tmp_path, capsys):
    from qpass.apps.grpo.cli import build_grpo_parser, grpo_main

    ap = build_grpo_parser()
    task = next(x for x in ap._actions if x.dest == "task")
    template = next(x for x in ap._actions if x.dest == "template")
    assert task.choices == ["arithmetic", *TASK_PRESETS] and template.choices == list(TEMPLATES)
    a = ap.parse_args(["--recipe", "bf16", "--out", str(tmp_path / "x"), "--task", "successor"])
    assert a.task == "successor" and a.template is None  # resolved to the kind's own template at run time
    with pytest.raises(SystemExit):
        ap.parse_args(["--recipe", "bf16", "--out", str(tmp_path / "x"), "--task", "division"])
    assert "invalid choice: 'division'" in capsys.readouterr().err
    assert grpo_main(["--recipe", "bf16", "--out", str(tmp_path / "y"), "--task", "larger", "--operators", "+"]) == 2
    assert "--operators applies to --task arithmetic only" in capsys.readouterr().err
