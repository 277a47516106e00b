"""RL: GRPO loss with decoupled importance correction (SPEC §5) and the arithmetic task."""

from qpass.rl.loss import Correction, LossConfig, LossOutput, correction_affected_frac, correction_weights, group_advantages, grpo_loss
from qpass.rl.task import (
    DEFAULT_TEMPLATE,
    ArithmeticConfig,
    ArithmeticProblem,
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

__all__ = [
    "DEFAULT_TEMPLATE",
    "ArithmeticConfig",
    "ArithmeticProblem",
    "ArithmeticTask",
    "Correction",
    "ExactAnswerReward",
    "LossConfig",
    "LossOutput",
    "RewardFn",
    "SafeReward",
    "correction_affected_frac",
    "correction_weights",
    "difficulty_preset",
    "evaluate_expression",
    "exact_answer_reward",
    "format_prompt",
    "group_advantages",
    "grpo_loss",
    "parse_last_integer",
    "safe_reward",
]
