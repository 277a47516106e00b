"""Prompt encoding (chat template) and the built-in probe set used by the behavioural checks."""

from __future__ import annotations

import importlib.resources
import json
from collections.abc import Sequence


def probe_set_size() -> int:
    """How many prompts the built-in probe set holds (the most any ``--prompts`` may ask for)."""
    return len(probe_prompts())


def probe_prompts(n: int | None = None) -> list[str]:
    """The first ``n`` built-in probe prompts (all if None).

    Raises:
        ValueError: ``n`` is larger than the probe set.
    """
    data = json.loads(importlib.resources.files("qpass").joinpath("data/probe_prompts.json").read_text())
    prompts = data["prompts"]
    if n is not None and n > len(prompts):
        raise ValueError(f"the probe set has {len(prompts)} prompts, asked for {n}")
    return prompts[:n] if n is not None else prompts


def encode_chat(tokenizer: object, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text as a single user turn with the generation prompt appended."""
    out = []
    for text in texts:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc
        out.append([int(i) for i in ids])
    return out
