"""A verifiable-reward arithmetic task, generated locally (no dataset download).

Problems are integer expressions such as ``47 - 8 * 3`` over ``+``, ``-``, ``*`` with the usual
precedence (``*`` before ``+``/``-``, left to right otherwise); the answer is an exact Python
integer. Generation is seeded and deterministic. Difficulty is set by the number of operands,
the digit count of each operand and the operator set (:class:`ArithmeticConfig`,
:func:`difficulty_preset`). Two simpler problem kinds share the machinery (:data:`KINDS`,
:data:`TASK_PRESETS`, :func:`task_preset`, ``qpass grpo --task``): ``successor`` ("What number comes
after 389?", answer 390) and ``larger`` ("Which is larger, 47 or 52?", answer 52); ``chain``
(preset ``chain``, ``chain_long``) is a multi-step ``+``/``-`` expression answered with worked
intermediate sums ("12 + 7 = 19. 19 - 5 = 14. ... Answer: 34", template ``chain_fewshot``), so a
response runs to tens of tokens and one wrong partial sum spoils the answer.

The evaluation split is drawn first, then the training split, both from one seeded stream of
*unique* expressions, so (a) the two splits share no expression and therefore no prompt, and
(b) the evaluation split does not change when ``n_train`` changes.

Rewards are plug-ins: any callable ``(prompt_meta, response_text) -> float`` (:class:`RewardFn`).
The default :class:`ExactAnswerReward` parses the last integer of the response
(``first_answer_reward``: the first one) and gives 1.0 iff it equals the ground-truth answer. Wrap every reward
function with :func:`safe_reward` before its output reaches the advantages: exceptions, non-numeric
and non-finite returns become reward 0 and are counted and logged, never NaN.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import re
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "DEFAULT_TEMPLATE",
    "TEMPLATES",
    "ArithmeticConfig",
    "ArithmeticProblem",
    "ArithmeticTask",
    "ExactAnswerReward",
    "KINDS",
    "ProblemKind",
    "TASK_PRESETS",
    "RewardFn",
    "SafeReward",
    "difficulty_preset",
    "evaluate_expression",
    "ANSWER_PARSERS",
    "REWARDS",
    "answer_tag_reward",
    "exact_answer_reward",
    "first_answer_reward",
    "parse_answer_tag",
    "format_prompt",
    "parse_first_integer",
    "parse_last_integer",
    "safe_reward",
    "task_preset",
]

log = logging.getLogger(__name__)

OPERATORS = ("+", "-", "*")

#: Default user-message template; ``{expression}`` is replaced by the problem's expression.
DEFAULT_TEMPLATE = (
    "Compute {expression}.\n"
    "Think briefly, then give the final answer as an integer on the last line in the form\n"
    "Answer: <integer>"
)

#: Prompt templates by name (``qpass grpo --template``): ``default`` asks for brief reasoning and an
#: ``Answer:`` line; ``terse`` asks for the integer alone (short responses, so a weak or heavily
#: quantized policy ends on its answer more often; a calibration knob of the task, issue 13).
TEMPLATES: dict[str, str] = {
    "default": DEFAULT_TEMPLATE,
    "terse": "Compute {expression}. Reply with the integer only.",
    # two worked addition examples in Q/A form, the problem's "A:" left open (issue 13 calibration)
    "fewshot": "Reply with the integer only.\nQ: 12 + 7\nA: 19\nQ: 30 + 45\nA: 75\nQ: {expression}\nA:",
    "equation": "Complete the equation with one integer: {expression} =",
    # the non-arithmetic kinds (KINDS): {expression} is "389" / "47 or 52"
    "successor": "What number comes after {expression}? Reply with the integer only.",
    "larger": "Which is larger, {expression}? Reply with the larger number only.",
    "larger_fewshot": "Reply with the larger number only.\nQ: Which is larger, 31 or 17?\nA: 31\n"
                      "Q: Which is larger, 58 or 64?\nA: 64\nQ: Which is larger, {expression}?\nA:",
    # issue 32: worked partial sums (a long, compounding response), the answer on an "Answer:" tag
    "chain_fewshot": "Add and subtract from left to right. Write each step, then the result as Answer: <integer>.\n"
                     "Q: 12 + 7 - 5 + 20\nA: 12 + 7 = 19. 19 - 5 = 14. 14 + 20 = 34. Answer: 34\n"
                     "Q: 30 - 8 + 15 - 6 + 4\nA: 30 - 8 = 22. 22 + 15 = 37. 37 - 6 = 31. 31 + 4 = 35. Answer: 35\n"
                     "Q: {expression}\nA:",
}


# --------------------------------------------------------------------------- problems


@dataclasses.dataclass(frozen=True)
class ArithmeticConfig:
    """Task generation options.

    Attributes:
        n_operands: inclusive range ``(lo, hi)`` of operand counts per problem, ``2 <= lo <= hi``.
        digits: inclusive range ``(lo, hi)`` of decimal digits per operand, ``1 <= lo <= hi``
            (1 digit: 0-9; ``d >= 2`` digits: ``10^(d-1)`` to ``10^d - 1``).
        operators: non-empty subset of ``("+", "-", "*")``.
        n_train, n_eval: split sizes (``n_eval`` may be 0).
        seed: generation seed.
        kind: problem kind, a key of :data:`KINDS`: ``"arithmetic"`` (an expression over
            ``operators``), ``"chain"`` (the same expressions, answered with worked steps: template
            ``chain_fewshot``), ``"successor"`` (one operand ``n``, answer ``n + 1``) or ``"larger"``
            (two different operands, answer the larger). The last two use ``digits`` only
            (``n_operands`` and ``operators`` are ignored).
    """

    n_operands: tuple[int, int] = (2, 3)
    digits: tuple[int, int] = (1, 2)
    operators: tuple[str, ...] = OPERATORS
    n_train: int = 2000
    n_eval: int = 200
    seed: int = 0
    kind: str = "arithmetic"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {sorted(KINDS)}, got {self.kind!r}")
        lo, hi = self.n_operands
        if not (2 <= lo <= hi):
            raise ValueError(f"n_operands must be (lo, hi) with 2 <= lo <= hi, got {self.n_operands}")
        dlo, dhi = self.digits
        if not (1 <= dlo <= dhi <= 18):
            raise ValueError(f"digits must be (lo, hi) with 1 <= lo <= hi <= 18, got {self.digits}")
        if not self.operators or any(op not in OPERATORS for op in self.operators):
            raise ValueError(f"operators must be a non-empty subset of {OPERATORS}, got {self.operators}")
        if self.n_train < 0 or self.n_eval < 0:
            raise ValueError(f"n_train and n_eval must be >= 0, got {self.n_train}, {self.n_eval}")

    def n_distinct(self) -> int:
        """How many distinct problems (expression texts) this config can produce: ``v`` operand
        values (10 for one digit, ``9 * 10^(d-1)`` for ``d >= 2``, summed over ``digits``), then
        ``sum_n v^n |ops|^(n-1)`` expressions (arithmetic), ``v`` (successor) or ``v (v - 1)``
        ordered pairs of different operands (larger)."""
        v = sum(10 if d == 1 else 9 * 10 ** (d - 1) for d in range(self.digits[0], self.digits[1] + 1))
        if self.kind == "successor":
            return v
        if self.kind == "larger":
            return v * (v - 1)
        ops = len(set(self.operators))
        return sum(v**n * ops ** (n - 1) for n in range(self.n_operands[0], self.n_operands[1] + 1))


def difficulty_preset(level: int, **overrides: Any) -> ArithmeticConfig:
    """A config for difficulty ``level`` 1-4 (``overrides`` replace fields, e.g. ``seed=3``).

    1: two 1-digit operands, ``+``. 2: two 1-2-digit operands, ``+ -``. 3: two or three 1-2-digit
    operands, ``+ - *``. 4: three or four 2-3-digit operands, ``+ - *``.

    Raises:
        ValueError: unknown level.
    """
    presets = {
        1: dict(n_operands=(2, 2), digits=(1, 1), operators=("+",)),
        2: dict(n_operands=(2, 2), digits=(1, 2), operators=("+", "-")),
        3: dict(n_operands=(2, 3), digits=(1, 2), operators=OPERATORS),
        4: dict(n_operands=(3, 4), digits=(2, 3), operators=OPERATORS),
    }
    if level not in presets:
        raise ValueError(f"difficulty level must be one of {sorted(presets)}, got {level}")
    return ArithmeticConfig(**{**presets[level], **overrides})


#: Presets of the non-arithmetic kinds by name (``qpass grpo --task``; ``arithmetic`` takes
#: ``--difficulty`` instead): ``successor`` "What number comes after 389?" over the 900 3-digit
#: numbers; ``larger`` "Which is larger, 47 or 52?" over the 8010 ordered pairs of different
#: 2-digit numbers.
TASK_PRESETS: dict[str, dict[str, Any]] = {
    "successor": dict(kind="successor", digits=(3, 3)),
    "larger": dict(kind="larger", digits=(2, 2)),
    # issue 32: 4-5 operands of 1-2 digits with + and - (3-4 worked steps, ~40-60 response tokens of the
    # default model's tokenizer); chain_long: 6-7 operands (5-6 steps)
    "chain": dict(kind="chain", n_operands=(4, 5), digits=(1, 2), operators=("+", "-")),
    "chain_long": dict(kind="chain", n_operands=(6, 7), digits=(1, 2), operators=("+", "-")),
    # one-digit operands, + only: partial sums below 50 (the default model's per-step arithmetic is weak)
    "chain1": dict(kind="chain", n_operands=(4, 5), digits=(1, 1), operators=("+",)),
    "chain_short": dict(kind="chain", n_operands=(3, 4), digits=(1, 1), operators=("+",)),
}


def task_preset(name: str, *, level: int = 2, **overrides: Any) -> ArithmeticConfig:
    """The config of task ``name``: ``"arithmetic"`` is :func:`difficulty_preset` ``(level)``, any
    other name a key of :data:`TASK_PRESETS` (``level`` ignored). ``overrides`` replace fields.

    Raises:
        ValueError: unknown name or level.
    """
    if name == "arithmetic":
        return difficulty_preset(level, **overrides)
    if name not in TASK_PRESETS:
        raise ValueError(f"task must be one of {['arithmetic', *TASK_PRESETS]}, got {name!r}")
    return ArithmeticConfig(**{**TASK_PRESETS[name], **overrides})


def evaluate_expression(operands: tuple[int, ...], operators: tuple[str, ...]) -> int:
    """Exact integer value of ``operands[0] op0 operands[1] op1 ...`` with ``*`` binding tighter.

    Raises:
        ValueError: ``len(operators) != len(operands) - 1`` or an unknown operator.
    """
    if len(operators) != len(operands) - 1:
        raise ValueError(f"need len(operands) - 1 operators, got {len(operands)} operands and {len(operators)} operators")
    terms: list[int] = [operands[0]]
    signs: list[int] = [1]
    for op, v in zip(operators, operands[1:]):
        if op == "*":
            terms[-1] *= v
        elif op in ("+", "-"):
            terms.append(v)
            signs.append(1 if op == "+" else -1)
        else:
            raise ValueError(f"unknown operator {op!r}")
    return sum(s * t for s, t in zip(signs, terms))


@dataclasses.dataclass(frozen=True)
class ArithmeticProblem:
    """One problem.

    Attributes:
        id: stable id ``"{split}-{index}"``.
        split: ``"train"`` or ``"eval"``.
        operands, operators: the expression's parts.
        expression: canonical text, e.g. ``"47 - 8 * 3"`` (unique within a task).
        answer: exact integer value.
    """

    id: str
    split: str
    operands: tuple[int, ...]
    operators: tuple[str, ...]
    expression: str
    answer: int

    @property
    def meta(self) -> dict[str, Any]:
        """The ``prompt_meta`` mapping reward functions receive (``answer`` is the ground truth)."""
        return {
            "id": self.id,
            "split": self.split,
            "expression": self.expression,
            "answer": self.answer,
            "n_operands": len(self.operands),
        }


def format_prompt(problem: ArithmeticProblem, template: str = DEFAULT_TEMPLATE) -> str:
    """Plain-text user message for a chat model (the caller applies the chat template).

    Raises:
        ValueError: ``template`` lacks ``{expression}``.
    """
    if "{expression}" not in template:
        raise ValueError("template must contain '{expression}'")
    return template.replace("{expression}", problem.expression)


def _operand(rng: random.Random, cfg: ArithmeticConfig) -> int:
    d = rng.randint(*cfg.digits)
    lo = 0 if d == 1 else 10 ** (d - 1)
    return rng.randint(lo, 10**d - 1)


def _draw(rng: random.Random, cfg: ArithmeticConfig) -> tuple[tuple[int, ...], tuple[str, ...]]:
    n = rng.randint(*cfg.n_operands)
    operands = [_operand(rng, cfg) for _ in range(n)]
    ops = tuple(rng.choice(cfg.operators) for _ in range(n - 1))
    return tuple(operands), ops


def _draw_successor(rng: random.Random, cfg: ArithmeticConfig) -> tuple[tuple[int, ...], tuple[str, ...]]:
    return (_operand(rng, cfg),), ()


def _draw_larger(rng: random.Random, cfg: ArithmeticConfig) -> tuple[tuple[int, ...], tuple[str, ...]]:
    a = _operand(rng, cfg)
    b = _operand(rng, cfg)
    while b == a:  # digits (1, 1) still leaves 10 values, so this ends
        b = _operand(rng, cfg)
    return (a, b), ()


def _expression_text(operands: tuple[int, ...], ops: tuple[str, ...]) -> str:
    parts = [str(operands[0])]
    for op, v in zip(ops, operands[1:]):
        parts += [op, str(v)]
    return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class ProblemKind:
    """One kind of problem: how it is drawn, written into the prompt and answered.

    Attributes:
        draw: ``(rng, cfg) -> (operands, operators)``.
        text: ``(operands, operators) -> str``, the problem's ``expression`` (what a template's
            ``{expression}`` becomes; unique within a task).
        answer: ``(operands, operators) -> int``, the exact answer.
        template: the :data:`TEMPLATES` key used when none is given.
    """

    draw: Any
    text: Any
    answer: Any
    template: str


#: Problem kinds by name (:attr:`ArithmeticConfig.kind`).
KINDS: dict[str, ProblemKind] = {
    "arithmetic": ProblemKind(_draw, _expression_text, evaluate_expression, "default"),
    "chain": ProblemKind(_draw, _expression_text, evaluate_expression, "chain_fewshot"),
    "successor": ProblemKind(_draw_successor, lambda o, _: str(o[0]), lambda o, _: o[0] + 1, "successor"),
    "larger": ProblemKind(_draw_larger, lambda o, _: f"{o[0]} or {o[1]}", lambda o, _: max(o), "larger"),
}


class ArithmeticTask:
    """Seeded train / eval splits of unique arithmetic problems.

    Args:
        cfg: :class:`ArithmeticConfig`.
        max_attempts_factor: draws allowed per requested problem before giving up.
    Raises:
        ValueError: the configuration cannot produce ``n_train + n_eval`` unique expressions
            (e.g. two 1-digit operands with ``+`` give only 100).
    """

    def __init__(self, cfg: ArithmeticConfig | None = None, *, max_attempts_factor: int = 50) -> None:
        self.cfg = cfg or ArithmeticConfig()
        need = self.cfg.n_eval + self.cfg.n_train
        if need > (space := self.cfg.n_distinct()):  # refused at once, not after max_attempts_factor * need draws
            raise ValueError(f"could only draw {space} unique problems of the {need} requested (n_eval={self.cfg.n_eval} + "
                             f"n_train={self.cfg.n_train}): {self.cfg} has only {space} distinct ones; widen "
                             "digits/n_operands/operators or ask for fewer")
        rng = random.Random(self.cfg.seed)
        kind = KINDS[self.cfg.kind]
        seen: set[str] = set()
        drawn: list[tuple[tuple[int, ...], tuple[str, ...], str]] = []
        attempts = 0
        while len(drawn) < need:
            attempts += 1
            if attempts > max_attempts_factor * max(need, 1):
                raise ValueError(
                    f"could only draw {len(drawn)} unique problems of the {need} requested "
                    f"(n_eval={self.cfg.n_eval} + n_train={self.cfg.n_train}) from {self.cfg}; "
                    "widen digits/n_operands/operators or ask for fewer"
                )
            operands, ops = kind.draw(rng, self.cfg)
            expr = kind.text(operands, ops)
            if expr in seen:
                continue
            seen.add(expr)
            drawn.append((operands, ops, expr))

        def make(split: str, i: int, item: tuple[tuple[int, ...], tuple[str, ...], str]) -> ArithmeticProblem:
            operands, ops, expr = item
            return ArithmeticProblem(f"{split}-{i}", split, operands, ops, expr, int(kind.answer(operands, ops)))

        n_eval = self.cfg.n_eval
        self.eval: list[ArithmeticProblem] = [make("eval", i, it) for i, it in enumerate(drawn[:n_eval])]
        self.train: list[ArithmeticProblem] = [make("train", i, it) for i, it in enumerate(drawn[n_eval:])]

    def prompt(self, problem: ArithmeticProblem, template: str = DEFAULT_TEMPLATE) -> str:
        """:func:`format_prompt` of ``problem``."""
        return format_prompt(problem, template)

    def train_batches(self, batch_size: int, *, seed: int | None = None) -> Iterator[list[ArithmeticProblem]]:
        """Endless batches of training problems: each epoch is a seeded reshuffle of the train split.

        Batches never straddle epochs (a short final batch of an epoch is dropped unless the split
        is smaller than ``batch_size``, in which case each batch is the whole shuffled split).

        Args:
            batch_size: problems per batch (>= 1).
            seed: shuffling seed (default: ``cfg.seed + 1``).
        Raises:
            ValueError: ``batch_size < 1`` or an empty train split.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not self.train:
            raise ValueError("the train split is empty (n_train=0)")
        rng = random.Random(self.cfg.seed + 1 if seed is None else seed)
        while True:
            order = list(self.train)
            rng.shuffle(order)
            if len(order) <= batch_size:
                yield order
                continue
            for i in range(0, len(order) - batch_size + 1, batch_size):
                yield order[i : i + batch_size]


# --------------------------------------------------------------------------- rewards


@runtime_checkable
class RewardFn(Protocol):
    """A reward plug-in: ``(prompt_meta, response_text) -> float``.

    ``prompt_meta`` is :attr:`ArithmeticProblem.meta` (or any mapping another task provides);
    ``response_text`` is the decoded response (may be empty). Return a finite float.
    """

    def __call__(self, prompt_meta: Mapping[str, Any], response_text: str) -> float: ...


# sign only when not directly after a digit or ')', so "10-3" reads as 10 and 3; thousands
# separators "1,234" and an integral fraction "12.0" are accepted as one integer.
_INT_RE = re.compile(r"(?<![\d)])([-\u2212])?(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?")
_ANSWER_LINE_RE = re.compile(r"^\s*\**\s*answer\s*\**\s*[:=]\s*\**\s*[-\u2212]?[\d,]+(?:\.0+)?\s*\**\s*\.?\s*$", re.IGNORECASE)


def parse_last_integer(text: str | None) -> int | None:
    """The last integer written in ``text``, or None.

    Accepts a leading ``-`` or Unicode minus (not when it directly follows a digit or ``)``),
    thousands separators (``1,234``) and a zero fraction (``12.0``); a number with a non-zero
    fraction (``2.5``) is not an integer and yields None if it is the last number.
    """
    if not text:
        return None
    matches = list(_INT_RE.finditer(text))
    return _match_int(matches[-1]) if matches else None


def parse_first_integer(text: str | None) -> int | None:
    """The first integer written in ``text``, or None (same number syntax as :func:`parse_last_integer`).

    A first number with a non-zero fraction (``2.5``) yields None; later numbers are not looked at.
    """
    if not text:
        return None
    m = _INT_RE.search(text)
    return _match_int(m) if m else None


def _match_int(m: re.Match[str]) -> int | None:
    sign, digits, frac = m.group(1), m.group(2), m.group(3)
    if frac is not None and frac.strip("0"):
        return None
    value = int(digits.replace(",", ""))
    return -value if sign else value


_ANSWER_TAG_RE = re.compile(r"answer(?:\s*[:=]|\s+is)\s*", re.IGNORECASE)


def parse_answer_tag(text: str | None) -> int | None:
    """The integer right after the first answer tag, else the last integer of ``text``, else None.

    Tags (case-insensitive): ``Answer:``, ``Answer =``, ``answer is`` (the chat model's own "The
    answer is 19."). Same number syntax as :func:`parse_last_integer`; a tag followed by anything
    but a number yields None (no fallback then). Text after the tagged number (a new ``Q:`` line of
    a few-shot continuation) is not looked at; without any tag the last integer is the answer.
    """
    if not text:
        return None
    tag = _ANSWER_TAG_RE.search(text)
    if tag is None:
        return parse_last_integer(text)
    m = _INT_RE.match(text, tag.end())
    return _match_int(m) if m else None


#: Integer extractors of :class:`ExactAnswerReward` by name (``qpass grpo --reward exact|first|answer``).
ANSWER_PARSERS = {"last": parse_last_integer, "first": parse_first_integer, "answer": parse_answer_tag}


@dataclasses.dataclass(frozen=True)
class ExactAnswerReward:
    """Default reward: 1.0 if the last integer of the response equals ``prompt_meta["answer"]``.

    Attributes:
        position: which integer of the response is the answer: ``"last"`` (default,
            :func:`parse_last_integer`), ``"first"`` (:func:`parse_first_integer`) or ``"answer"``
            (the integer after the first ``Answer:`` tag, :func:`parse_answer_tag`). Either way the
            reward is exact match of that one integer; every other number in the response is ignored.
        format_weight: reward in [0, 1) for a *wrong* answer whose last non-empty line has the
            requested form ``Answer: <integer>`` (0.0 default: no format reward). A correct answer
            always gets 1.0.
    Raises (on call):
        KeyError: ``prompt_meta`` has no ``"answer"`` (:func:`safe_reward` turns it into 0 + a
            counted failure).
    """

    format_weight: float = 0.0
    position: str = "last"

    def __post_init__(self) -> None:
        if not 0.0 <= self.format_weight < 1.0:
            raise ValueError(f"format_weight must be in [0, 1), got {self.format_weight}")
        if self.position not in ANSWER_PARSERS:
            raise ValueError(f"position must be one of {sorted(ANSWER_PARSERS)}, got {self.position!r}")

    def __call__(self, prompt_meta: Mapping[str, Any], response_text: str) -> float:
        answer = int(prompt_meta["answer"])
        if ANSWER_PARSERS[self.position](response_text) == answer:
            return 1.0
        if self.format_weight and response_text:
            lines = [ln for ln in response_text.strip().splitlines() if ln.strip()]
            if lines and _ANSWER_LINE_RE.match(lines[-1]):
                return float(self.format_weight)
        return 0.0


#: The default reward instance (exact answer, no format reward).
exact_answer_reward = ExactAnswerReward()
#: Exact answer on the *first* integer of the response (``qpass grpo --reward first``): for terse /
#: few-shot templates where the model states the answer and may then ramble on with more numbers.
first_answer_reward = ExactAnswerReward(position="first")
#: Exact answer on the integer after the first ``Answer:`` tag (``qpass grpo --reward answer``): for
#: worked-step templates (``chain_fewshot``), whose steps are full of other numbers.
answer_tag_reward = ExactAnswerReward(position="answer")
#: The built-in rewards by ``qpass grpo --reward`` name; each is also the correctness function of the
#: held-out eval and ``reward/correct_frac`` (one parser for both).
REWARDS: dict[str, ExactAnswerReward] = {"exact": exact_answer_reward, "first": first_answer_reward,
                                         "answer": answer_tag_reward}


class SafeReward:
    """A reward function that never returns NaN/inf and never raises (see :func:`safe_reward`).

    Attributes:
        fn: the wrapped function.
        default: reward given on failure.
        n_calls, n_exceptions, n_nonfinite, n_bad_type, n_empty: counters (``n_empty``: responses
            that were None or whitespace only; those are still scored by ``fn``, as ``""`` for None).
    """

    def __init__(self, fn: RewardFn, *, default: float = 0.0, max_warnings: int = 10) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        if not math.isfinite(default):
            raise ValueError(f"default must be finite, got {default}")
        self.fn = fn
        self.default = float(default)
        self.max_warnings = max_warnings
        self.n_calls = self.n_exceptions = self.n_nonfinite = self.n_bad_type = self.n_empty = 0

    @property
    def n_failures(self) -> int:
        """Calls that returned ``default`` because ``fn`` failed (raised, non-numeric, non-finite)."""
        return self.n_exceptions + self.n_nonfinite + self.n_bad_type

    def stats(self) -> dict[str, float]:
        """Counters as floats, for logging."""
        return {
            "reward/n_calls": float(self.n_calls),
            "reward/n_failures": float(self.n_failures),
            "reward/n_exceptions": float(self.n_exceptions),
            "reward/n_nonfinite": float(self.n_nonfinite),
            "reward/n_bad_type": float(self.n_bad_type),
            "reward/n_empty": float(self.n_empty),
        }

    def _warn(self, msg: str, *args: Any) -> None:
        """Log a failure: WARNING for the first ``max_warnings``, DEBUG afterwards."""
        msg += "; reward %s"
        args += (self.default,)
        if self.n_failures < self.max_warnings:
            log.warning(msg, *args)
        elif self.n_failures == self.max_warnings:
            log.warning(msg + " (further reward failures are logged at DEBUG)", *args)
        else:
            log.debug(msg, *args)

    def __call__(self, prompt_meta: Mapping[str, Any], response_text: str | None) -> float:
        self.n_calls += 1
        text = "" if response_text is None else response_text
        if not isinstance(text, str):
            self.n_bad_type += 1
            self._warn("reward: response_text is %s, not str (id=%s)", type(text).__name__, _pid(prompt_meta))
            return self.default
        if not text.strip():
            self.n_empty += 1
        try:
            value = self.fn(prompt_meta, text)
        except Exception as exc:  # noqa: BLE001 - a plug-in may raise anything; KeyboardInterrupt still propagates
            self.n_exceptions += 1
            self._warn("reward function %r raised %s: %s (id=%s)", self.fn, type(exc).__name__, exc, _pid(prompt_meta))
            return self.default
        v: float | None = None
        if value is not None and not isinstance(value, (str, bytes)):
            try:
                v = float(value)  # bool, int, float, numpy scalars, one-element tensors
            except Exception:  # noqa: BLE001 - e.g. a multi-element tensor
                v = None
        if v is None:
            self.n_bad_type += 1
            self._warn("reward function %r returned %s, not a number (id=%s)", self.fn, type(value).__name__, _pid(prompt_meta))
            return self.default
        if not math.isfinite(v):
            self.n_nonfinite += 1
            self._warn("reward function %r returned %s (id=%s)", self.fn, v, _pid(prompt_meta))
            return self.default
        return v


def _pid(meta: Any) -> Any:
    try:
        return meta.get("id")
    except Exception:  # noqa: BLE001
        return None


def safe_reward(fn: RewardFn, *, default: float = 0.0, max_warnings: int = 10) -> SafeReward:
    """Wrap a reward function so its output is always a finite float.

    A call that raises (any ``Exception``), returns something that is not a real number (None, a
    string, a multi-element tensor), or returns NaN/inf yields ``default`` (0.0), increments a
    counter (:class:`SafeReward`) and logs a warning on the ``qpass.rl.task`` logger (the first
    ``max_warnings`` failures; later ones at DEBUG). A None response is scored as ``""``; empty or
    whitespace responses are counted in ``n_empty`` and scored normally (the default reward gives
    them 0).

    Args:
        fn: a :class:`RewardFn`.
        default: finite reward on failure.
        max_warnings: failures logged at WARNING before switching to DEBUG.
    Returns:
        :class:`SafeReward` (itself a :class:`RewardFn`).
    Raises:
        TypeError: ``fn`` not callable. ValueError: non-finite ``default``.
    """
    return SafeReward(fn, default=default, max_warnings=max_warnings)
