"""Checks of a command's inputs that run before any heavy work (model load, capture, training).

Every ``qpass`` subcommand validates what it was given — the recipe, the model reference, the
output paths, CLI values and their combinations, counts against the data that exists — before it
loads a model, so bad input fails in well under a second with exit status 2 and a message naming
the flag, file or recipe line (the error contract of :mod:`qpass.apps.cliutil`). The checks are
small functions here, called by the commands' entry points; the recipe itself is validated by
:mod:`qpass.compiler.recipe`, output directories by :func:`qpass.atomic.check_output_path`.

Raises (every function): :class:`qpass.errors.QpassError` (or :class:`~qpass.errors.RecipeError`)
naming the culprit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from qpass.errors import QpassError

__all__ = ["BUILTIN_MODELS", "GRPO_FLAGS", "LOSS_FLAGS", "check_export_recipe", "check_grpo_args", "check_model_ref",
           "check_probe_count", "check_report_fields", "check_study_args", "flag_message"]

BUILTIN_MODELS = ("default", "moe-default")
_HEAD_SUFFIXES = ("ForCausalLM", "LMHeadModel")
_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.pt", "*.pth")


# ----------------------------------------------------------------------------- models and data


def check_model_ref(ref: str, flag: str = "--model") -> None:
    """A model reference :func:`qpass.graph.model.load_model` can load, checked without loading it.

    ``default`` / ``moe-default`` pass; a path must be a ``.gguf`` file that starts with the GGUF
    magic, or a directory whose ``config.json`` is a UTF-8 JSON object with a ``model_type``,
    whose ``architectures`` (when listed) name a causal-LM class (``*ForCausalLM`` /
    ``*LMHeadModel``: qpass captures decoder LMs), and which holds weight files.

    Raises:
        QpassError: ``{flag} REF: ...`` naming the path and what is wrong.
    """
    if ref in BUILTIN_MODELS:
        return
    p = Path(ref).expanduser()
    hint = "(use --model default, a Hugging Face model directory or a .gguf file)"
    if not p.exists():
        raise QpassError(f"{flag} {ref!r} does not exist {hint}")
    if p.is_file():
        if p.suffix != ".gguf":
            raise QpassError(f"{flag} {ref!r} is a file but not a .gguf file {hint}")
        try:
            with open(p, "rb") as f:
                magic = f.read(4)
        except OSError as exc:
            raise QpassError(f"{flag} {ref!r}: cannot read the file: {exc.strerror or exc}") from None
        if magic != b"GGUF":
            raise QpassError(f"{flag} {ref!r} is not a GGUF file: it starts with {magic!r}, a GGUF file with b'GGUF'")
        return
    cfg = p / "config.json"
    if not cfg.is_file():
        raise QpassError(f"{flag} {ref!r} is a directory without config.json, not a Hugging Face model directory {hint}")
    try:
        data = json.loads(cfg.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise QpassError(f"{flag}: {cfg} is not a readable JSON config ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise QpassError(f"{flag}: {cfg} is not a model config (a JSON object with a string 'model_type')")
    archs = data.get("architectures")
    if archs is not None:
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise QpassError(f"{flag}: {cfg}: 'architectures' must be a list of class names, got {archs!r}")
        if archs and not any(a.endswith(_HEAD_SUFFIXES) for a in archs):
            raise QpassError(f"{flag} {ref!r}: the model is {', '.join(archs)} ({data['model_type']}), not a causal LM; "
                             "qpass captures decoder language models (architectures *ForCausalLM)")
    if not any(next(p.glob(g), None) is not None for g in _WEIGHT_GLOBS):
        raise QpassError(f"{flag} {ref!r}: {p} holds no weight files ({', '.join(_WEIGHT_GLOBS)})")


def check_probe_count(n: int | None, flag: str) -> None:
    """``n`` probe prompts exist in the built-in probe set (:func:`qpass.prompts.probe_prompts`).

    Raises:
        QpassError: ``{flag} N: the built-in probe set has 24 prompts``.
    """
    from qpass.prompts import probe_set_size

    if n is not None and n > (size := probe_set_size()):
        raise QpassError(f"{flag} {n}: the built-in probe set has {size} prompts")


def check_export_recipe(recipe_ref: str | None, fmt: str) -> Any:
    """Load and validate ``--recipe`` of ``qpass export`` before the model load; refuse rollout
    passes no checkpoint format carries (FP8 / MXFP4 lowering). Returns the recipe (or None).

    Raises:
        RecipeError: invalid recipe. QpassError: a rollout pass qpass export cannot write, naming
            its recipe line.
    """
    if recipe_ref is None:
        return None
    from qpass.compiler.recipe import load_recipe

    recipe = load_recipe(recipe_ref)
    if fmt != "plain":
        for p in recipe.rollout:
            if p.name in ("fp8_lower", "mxfp4_lower"):
                raise QpassError(f"{recipe.path}:{p.line or '?'}: rollout pass {p.name!r}: qpass export writes NVFP4 "
                                 f"checkpoints only (--format {fmt}); use an NVFP4 recipe or --format plain")
    return recipe


def check_report_fields(rep: Any, where: str) -> None:
    """The fields of an apply ``report.json`` that ``qpass check`` uses before its model load have
    the types it needs (a string recipe text and model reference, positive integer probe sizes,
    objects where objects belong), so a hand-edited report is exit 2 here, not a crash later.

    Raises:
        QpassError: ``{where}: FIELD must be ..., got VALUE``.
    """
    def need(ok: bool, field: str, rule: str, value: Any) -> None:
        if not ok:
            raise QpassError(f"{where}: {field} must be {rule}, got {value!r:.80}")

    need(isinstance(rep, dict), "the report", "a JSON object", rep)
    for key in ("recipe", "parity"):
        need(isinstance(rep.get(key), dict), key, "an object", rep.get(key))
    need(isinstance(rep["recipe"].get("text"), str), "recipe.text", "the recipe's YAML text", rep["recipe"].get("text"))
    probe = rep["parity"].get("probe")
    need(isinstance(probe, dict), "parity.probe", "an object", probe)
    for key in ("rollout_batch", "max_len"):
        v = probe.get(key)
        need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"parity.probe.{key}", "a positive integer", v)
    for key in ("model", "artifacts"):
        need(rep.get(key) is None or isinstance(rep[key], dict), key, "an object", rep.get(key))
    ref = (rep.get("model") or {}).get("ref")
    need(ref is None or isinstance(ref, str), "model.ref", "a model reference (a string)", ref)
    arts = rep.get("artifacts") or {}
    need(arts.get("rollout") is None or isinstance(arts["rollout"], dict), "artifacts.rollout", "an object", arts.get("rollout"))
    sums = arts.get("sha256")
    need(sums is None or isinstance(sums, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in sums.items()),
         "artifacts.sha256", "an object of file name -> sha256 hex digest", sums)


# ----------------------------------------------------------------------------- flag messages

#: Field of GRPOConfig / LossConfig / Correction -> its ``qpass grpo`` flag.
GRPO_FLAGS = {
    "steps": "--steps", "prompts_per_step": "--prompts-per-step", "group_size": "--group-size",
    "max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p", "lr": "--lr",
    "weight_decay": "--weight-decay", "grad_clip": "--grad-clip", "ppo_epochs": "--ppo-epochs",
    "minibatches": "--minibatches", "micro_batch_size": "--micro-batch-size", "seed": "--seed",
    "bitexact_every": "--bitexact-every", "diag_every": "--diag-every", "eval_every": "--eval-every",
    "eval_prompts": "--eval-prompts", "eval_max_new_tokens": "--eval-max-new-tokens",
    "eval_temperature": "--eval-temperature", "ess_cap": "--ess-cap", "max_time_s": "--max-time-s",
}
#: Leading words of LossConfig / Correction errors -> the flags they are about.
LOSS_FLAGS = {
    "eps_low": "--eps-low", "eps_high": "--eps-high", "beta": "--beta", "agg": "--agg",
    "Correction.kind": "--correction", "Correction.cap": "--tis-cap", "Correction bounds": "--mis-lo/--mis-hi",
}


def flag_message(exc: Exception, flags: dict[str, str] = GRPO_FLAGS) -> str:
    """A config error as ``--flag VALUE: rule`` (pydantic ValidationError) or ``--flag: message``
    (a ValueError whose text starts with a known field)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        parts = []
        for e in errors():
            field = str(e["loc"][0]) if e.get("loc") else "?"
            parts.append(f"{flags.get(field, field)} {e.get('input')!r}: {e['msg']}")
        return "; ".join(parts)
    text = str(exc)
    for lead, flag in LOSS_FLAGS.items():
        if text.startswith(lead):
            return f"{flag}: {text}"
    return text


# ----------------------------------------------------------------------------- commands


def check_grpo_args(a: Any) -> None:
    """Combinations of ``qpass grpo`` flags refused before the model load (values are checked by
    argparse types and by building the GRPOConfig).

    Raises:
        QpassError: an option that needs another (``--checkpoint-every`` / ``--segment-steps`` /
            ``--resume`` without ``--checkpoint-dir``), a ``--checkpoint-dir`` that is a file,
            ``--max-len`` with no room for ``--max-new-tokens``, ``--prompts-per-step`` above
            ``--n-train``, ``--minibatches`` above the number of micro-batches of a step, a bad
            ``--model``.
    """
    check_model_ref(a.model)
    for flag, value in (("--checkpoint-every", a.checkpoint_every), ("--segment-steps", a.segment_steps),
                        ("--resume", a.resume)):
        if value and a.checkpoint_dir is None:
            what = "writes checkpoints" if flag == "--checkpoint-every" else \
                "stops early so a later --resume continues" if flag == "--segment-steps" else "reads a checkpoint"
            raise QpassError(f"{flag} {what}: it needs --checkpoint-dir DIR")
    if a.checkpoint_dir is not None:
        from qpass.atomic import check_output_location

        check_output_location(a.checkpoint_dir, "--checkpoint-dir")
    if a.max_len is not None and a.max_len <= max(a.max_new_tokens, a.eval_max_new_tokens or 0):
        raise QpassError(f"--max-len {a.max_len} leaves no room for a prompt: it must exceed --max-new-tokens "
                         f"{a.max_new_tokens}" + (f" and --eval-max-new-tokens {a.eval_max_new_tokens}" if a.eval_max_new_tokens else ""))
    if a.prompts_per_step > a.n_train:
        raise QpassError(f"--prompts-per-step {a.prompts_per_step} exceeds the --n-train {a.n_train} training problems")
    rows = a.prompts_per_step * a.group_size
    batch = a.batch_size or min(rows, 64)
    micro = a.micro_batch_size or batch
    n_micro = math.ceil(rows / micro)
    if a.minibatches > n_micro:
        raise QpassError(f"--minibatches {a.minibatches} exceeds the {n_micro} micro-batches of a step "
                         f"({rows} rows = --prompts-per-step x --group-size, {micro} rows per micro-batch)")


def check_study_args(cfg: Any) -> None:
    """``qpass study`` options against the data that exists, before the model load.

    Raises:
        QpassError: ``--prompts`` above the probe set, a bad ``--model``.
    """
    check_model_ref(cfg.model)
    check_probe_count(cfg.prompts, "--prompts")
