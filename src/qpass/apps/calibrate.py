"""``qpass calibrate RECIPE --out CAL``: static RAC channels and static activation scales from prompts.

    qpass calibrate quads_static.yaml --model default --out cal/            # the packaged probe prompts
    qpass calibrate quads_static.yaml --prompts my_prompts.jsonl --out cal/
    qpass apply quads_static.yaml --calibration cal/ --out run/              # apply / check / export / grpo use it

What it computes (:func:`qpass.calibration.run.calibrate`): the input amax of every linear site of
the unquantized model over the calibration prompts (chat-templated, one forward each) and the
fused groups' SPEC §3 input scales; and, for the recipe's ``residual_compensation`` sites with
``selection: static``, their channels (the pass's own static pick). ``CAL`` is written atomically
(:mod:`qpass.calibration.record`: ``calibration.json`` + ``calibration.safetensors`` with sha256
of both, prompt source and sha256, token counts, model weights' sha256, recipe name/sha256/text).

Prompt files (``--prompts``): ``.json`` — a list of strings, or ``{"prompts": [...]}`` (the packaged
probe file's layout); ``.jsonl`` — one prompt per line, a JSON string or an object with a
``"prompt"`` string. Blank lines are skipped; anything else is exit 2 naming ``file:line``.

A subcommand (not a flag of apply/export/grpo) because its output is shared: one calibration serves
apply, check, export and grpo alike, each of which verifies it (checksums, model weights, the
recipe's requests) before use.
"""

from __future__ import annotations

import argparse

from qpass.apps.cliutil import Parser
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from qpass.errors import QpassError

__all__ = ["add_calibration_arg", "build_calibrate_parser", "load_for_model", "main_calibrate", "read_prompts", "run_calibrate"]

JSON_NAME = "calibration.json"


def _json_value(text: str, where: str, hint: str, key: str) -> object:
    """``json.loads(text)``, a dict replaced by its ``key`` entry (None when absent).

    Raises:
        QpassError: ``"<where>: not JSON (<reason>)<hint>"``.
    """
    try:
        v = json.loads(text)
    except ValueError as exc:
        raise QpassError(f"{where}: not JSON ({exc}){hint}") from exc
    return v.get(key) if isinstance(v, dict) else v


def read_prompts(path: Path) -> tuple[list[str], str]:
    """The prompt texts of a ``--prompts`` file and the file's sha256 (module docstring for the layouts).

    Raises:
        QpassError: missing / unreadable / non-UTF-8 file, bad JSON, a non-string prompt, no prompt
            (names ``file:line`` for JSONL).
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise QpassError(f"--prompts {path}: cannot read: {exc.strerror or exc}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise QpassError(f"--prompts {path}: not UTF-8 (byte offset {exc.start})") from exc
    texts: list[str] = []
    if path.suffix == ".jsonl":
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            v = _json_value(line, f"--prompts {path}:{i}", "", "prompt")
            if not isinstance(v, str) or not v.strip():
                raise QpassError(f"--prompts {path}:{i}: expected a non-empty string or {{\"prompt\": string}}")
            texts.append(v)
    else:
        v = _json_value(text, f"--prompts {path}", "; use .json (a list of strings) or .jsonl (one per line)", "prompts")
        if not isinstance(v, list) or not all(isinstance(x, str) and x.strip() for x in v):
            raise QpassError(f"--prompts {path}: expected a list of non-empty strings (or {{\"prompts\": [...]}})")
        texts = list(v)
    if not texts:
        raise QpassError(f"--prompts {path}: no prompt in the file")
    return texts, hashlib.sha256(raw).hexdigest()


def _prompt_texts(prompts: Path | None, num: int | None) -> tuple[list[str], dict[str, Any]]:
    from qpass.calibration.run import prompts_sha256
    from qpass.prompts import probe_prompts

    if prompts is None:
        texts, data = probe_prompts(), {"source": "qpass probe prompts (qpass/data/probe_prompts.json)", "file": None, "file_sha256": None}
    else:
        texts, sha = read_prompts(prompts)
        data = {"source": f"prompt file {prompts}", "file": str(prompts), "file_sha256": sha}
    if num is not None:
        if num > len(texts):
            raise QpassError(f"--num-prompts {num}: the prompt source has {len(texts)} prompts")
        texts = texts[:num]
    return texts, data | {"prompts_sha256": prompts_sha256(texts), "chat_template": True}


def run_calibrate(recipe_ref: str, out: Path, *, model: str = "default", dtype: str = "bf16", device: str = "cpu",
                  prompts: Path | None = None, num_prompts: int | None = None, force: bool = False,
                  pipeline: Any = None) -> dict[str, Any]:
    """``qpass calibrate`` (module docstring). Returns ``calibration.json``'s content.

    Args:
        pipeline: reuse a captured :class:`qpass.compiler.pipeline.Pipeline` (tests); its model is calibrated.
    Raises:
        QpassError: bad recipe / prompts / output path (before the model loads), a model without a
            chat tokenizer, and the calibration's own errors (:class:`~qpass.calibration.source.CalibrationError`).
    """
    from qpass import __version__
    from qpass.atomic import atomic_dir, check_output_path
    from qpass.calibration.run import calibrate
    from qpass.prompts import encode_chat
    from qpass.compiler.recipe import load_recipe

    recipe = load_recipe(recipe_ref)
    texts, data = _prompt_texts(prompts, num_prompts)
    check_output_path(out, force=force, marker=JSON_NAME)
    if pipeline is None:
        from qpass.apps.validate import check_model_ref

        check_model_ref(model)  # without loading it (the error contract: bad input before any model load)
    t0 = time.perf_counter()
    if pipeline is None:
        from qpass.graph.model import load_model
        from qpass.compiler.pipeline import DTYPES, Pipeline

        if dtype not in DTYPES:
            raise QpassError(f"--dtype must be one of bf16, fp16, fp32; got {dtype!r}")
        from qpass.progress import phase

        with phase(f"load the model ({model})"):
            lm = load_model(model, dtype=DTYPES[dtype], device=device)
        pipeline = Pipeline.prepare(loaded=lm, batch_size=1, max_len=8)  # phase: capture
    tok = pipeline.tokenizer
    if tok is None or not hasattr(tok, "apply_chat_template"):
        raise QpassError(f"model {model}: no chat tokenizer to encode the calibration prompts with")
    try:
        ids = encode_chat(tok, texts)
    except Exception as exc:  # noqa: BLE001 - tokenizers raise many types
        raise QpassError(f"model {model}: encoding the calibration prompts failed: {type(exc).__name__}: {exc}") from exc
    cal = calibrate(pipeline, recipe, ids, data=data, model_ref=model, qpass_version=__version__)
    with atomic_dir(out, force=force, marker=JSON_NAME) as tmp:
        doc = cal.write(tmp)
    doc["_elapsed_s"] = time.perf_counter() - t0
    return doc


def load_for_model(path: Path, model: Any, flag: str = "--calibration") -> Any:
    """Load and verify a calibration (:func:`qpass.calibration.record.load_calibration`) and that it was
    computed on ``model``'s weights. Raises CalibrationError (exit 2) naming ``flag`` and the file."""
    from qpass.calibration.record import load_calibration
    from qpass.calibration.source import CalibrationError

    try:
        cal = load_calibration(path)
        if model is not None:
            cal.check_model(model)
    except CalibrationError as exc:
        raise CalibrationError(f"{flag}: {exc}") from None
    return cal


def add_calibration_arg(ap: argparse.ArgumentParser, help_extra: str = "") -> None:
    """``--calibration CAL`` (the directory ``qpass calibrate --out`` wrote)."""
    ap.add_argument("--calibration", type=Path, default=None, metavar="CAL",
                    help="a `qpass calibrate` output: static RAC channels and activation scales for static recipes"
                         + (f"; {help_extra}" if help_extra else "") + " (default: none)")


def build_calibrate_parser(prog: str = "qpass calibrate") -> argparse.ArgumentParser:
    """The ``qpass calibrate`` argument parser."""
    from qpass.apps.cliutil import DefaultsHelpFormatter, add_dtype, add_force, add_threads, add_verbose, pos_int

    ap = Parser(prog=prog, description="Calibrate static RAC channels and static activation scales "
                                 "(input_scale) of a recipe's rollout on prompts", formatter_class=DefaultsHelpFormatter)
    ap.add_argument("recipe", help="recipe name or YAML path (its static passes say what to calibrate)")
    ap.add_argument("--out", required=True, type=Path, help="calibration directory to create (written atomically)")
    ap.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), an HF model dir or a .gguf (default: default)")
    ap.add_argument("--prompts", type=Path, default=None,
                    help="calibration prompts: .json list of strings or .jsonl (default: the packaged probe prompts)")
    ap.add_argument("--num-prompts", type=pos_int, default=None, help="use the first N prompts (default: all)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs")
    add_dtype(ap)
    add_force(ap, JSON_NAME)
    add_threads(ap)
    add_verbose(ap)
    return ap


def main_calibrate(argv: list[str] | None = None) -> int:
    a = build_calibrate_parser().parse_args(argv)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    from qpass.apps.progress import command_progress

    with command_progress():
        doc = run_calibrate(a.recipe, a.out, model=a.model, dtype=a.dtype, device=a.device, prompts=a.prompts,
                            num_prompts=a.num_prompts, force=a.force)
    d = doc["data"]
    print(f"qpass calibrate: {a.out}: {len(doc['sites'])} sites' input scales, {len(doc['rac'])} static RAC sites, "
          f"from {d['prompts']} prompts / {d['tokens']} tokens ({d['source']}) in {doc['_elapsed_s']:.1f}s", file=sys.stderr)
    print(f"  use it: qpass apply {a.recipe} --calibration {a.out} --out DIR   (also check / export / grpo --calibration)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main_calibrate())
