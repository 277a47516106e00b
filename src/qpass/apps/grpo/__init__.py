"""``qpass grpo``: the GRPO trainer (rollout, scoring, loss, weight sync, diagnostics) and its CLI."""
