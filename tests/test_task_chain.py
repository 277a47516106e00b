"""The worked-step ``chain`` task (issue 32: responses long enough for the mismatch to compound) and
its answer-tag reward."""

from __future__ import annotations

import pytest

from qpass.rl.task import (
    KINDS,
    REWARDS,
    TASK_PRESETS,
    TEMPLATES,
    ArithmeticTask,
    answer_tag_reward,
    format_prompt,
    parse_answer_tag,
    task_preset,
)


def test_chain_presets_draw_what_they_say():
    for name, (lo, hi), digits, ops in (("chain", (4, 5), (1, 2), ("+", "-")), ("chain_long", (6, 7), (1, 2), ("+", "-")),
                                        ("chain1", (4, 5), (1, 1), ("+",)), ("chain_short", (3, 4), (1, 1), ("+",))):
        t = ArithmeticTask(task_preset(name, n_train=300, n_eval=200))
        assert t.cfg.kind == "chain" and KINDS["chain"].template == "chain_fewshot"
        for p in t.train[:50] + t.eval[:50]:
            assert lo <= len(p.operands) <= hi and set(p.operators) <= set(ops)
            assert all(0 <= v < 10 ** digits[1] for v in p.operands)
            tot = p.operands[0]
            for op, v in zip(p.operators, p.operands[1:]):
                tot = tot + v if op == "+" else tot - v
            assert p.answer == tot  # left to right
        assert not {p.expression for p in t.train} & {p.expression for p in t.eval}
    assert set(TASK_PRESETS) >= {"chain", "chain_long", "chain1", "chain_short"}


def test_chain_template_worked_examples_are_right():
    text = format_prompt(ArithmeticTask(task_preset("chain1", n_train=10, n_eval=0)).train[0], TEMPLATES["chain_fewshot"])
    assert text.endswith("\nA:") and text.count("Answer: ") == 2 + 1  # the instruction and the two examples
    for line in TEMPLATES["chain_fewshot"].splitlines():
        if line.startswith("A: "):  # every worked step of the examples is correct arithmetic
            steps = [s for s in line[3:].split(". ") if "=" in s]
            for st in steps:
                lhs, rhs = st.split(" = ")
                a, op, b = lhs.split(" ")
                assert (int(a) + int(b) if op == "+" else int(a) - int(b)) == int(rhs), st
            assert parse_answer_tag(line) == int(steps[-1].split(" = ")[1])


@pytest.mark.parametrize("text, value", [
    ("9 + 6 = 15. 15 + 9 = 24. Answer: 24\nQ: 1 + 2\nA: Answer: 3", 24),  # the first tag wins, later text ignored
    ("The answer is 19.", 19),
    ("So the ANSWER = -5.0 and more 7", -5),
    ("4 + 0 = 4. 4 + 6 = 10", 10),  # no tag: the last integer
    ("Answer: two, 3", None),  # a tag without a number: no answer, no fallback
    ("", None),
])
def test_answer_tag_parser(text, value):
    assert parse_answer_tag(text) == value


def test_answer_reward_is_the_cli_reward_and_the_eval_judge():
    from qpass.apps.grpo.cli import _load_reward

    assert REWARDS["answer"] is answer_tag_reward and _load_reward("answer", 0.1) is answer_tag_reward
    assert answer_tag_reward({"answer": 24}, "15 + 9 = 24. Answer: 24\nQ: 3 + 4\nA: 7") == 1.0
    assert answer_tag_reward({"answer": 7}, "15 + 9 = 24. Answer: 24\nQ: 3 + 4\nA: 7") == 0.0
    assert REWARDS["exact"]({"answer": 7}, "15 + 9 = 24. Answer: 24\nQ: 3 + 4\nA: 7") == 1.0  # why chain needs 'answer'
