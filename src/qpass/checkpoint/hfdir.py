"""A standalone Hugging Face checkpoint directory (what ``transformers``, vLLM and SGLang load).

Files written by :func:`write_hf_dir` into a directory (the caller makes it atomic, e.g. with
:func:`qpass.atomic.atomic_dir`):

* ``config.json`` — the model's HF config as ``save_pretrained`` writes it (fields that differ from
  the class defaults: ``architectures``, the architecture fields, ``dtype``; plus ``torch_dtype``, the
  pre-transformers-5 name of ``dtype``, for older readers), plus ``quantization_config`` when the weights are quantized; a GGUF-loaded
  model's ``quantization_config`` (the GGUF marker) is dropped: the tensors are written de-quantized.
* ``generation_config.json`` — the model's generation config, when it has one.
* tokenizer files — whatever ``tokenizer.save_pretrained`` writes (tokenizer.json,
  tokenizer_config.json, chat template ...), when a tokenizer is given.
* ``model.safetensors`` holding every tensor, or — when the tensors exceed ``max_shard_size`` —
  ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``
  (``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``), split by
  ``huggingface_hub.split_torch_state_dict_into_shards`` (the convention of transformers'
  ``save_pretrained(max_shard_size=...)``); safetensors metadata ``{"format": "pt"}``.
* any extra JSON files (``hf_quant_config.json`` for ModelOpt-style checkpoints).

:func:`plain_state` / :func:`plain_config` read an HF ``PreTrainedModel`` (also one loaded from
GGUF, whose ``save_pretrained`` refuses: docs/engines/vllm_cpu_prototype.md §2) without writing it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from qpass.errors import QpassError
from qpass.jsonio import write_json

SAFETENSORS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def plain_config(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, Any]:
    """The HF config of ``model`` as a dict for ``config.json`` (no quantization, ``dtype`` set).

    Raises:
        QpassError: ``model`` has no HF config, or ``dtype`` is not bf16/fp16/fp32.
    """
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        raise QpassError(f"{type(model).__name__} has no Hugging Face config; export needs a transformers model")
    if dtype not in DTYPE_NAMES:
        raise QpassError(f"export dtype must be one of {list(DTYPE_NAMES.values())}, got {dtype}")
    d = cfg.to_diff_dict()  # what save_pretrained writes: fields that differ from the class defaults
    d.pop("quantization_config", None)  # GGUF marker: the tensors are de-quantized
    d.pop("_name_or_path", None)  # a local path of the machine that exported
    d["architectures"] = [type(model).__name__]
    d["dtype"] = d["torch_dtype"] = DTYPE_NAMES[dtype]
    return d


def plain_state(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every persistent tensor of ``model`` under its HF name, floating tensors cast to ``dtype``.

    With ``tie_word_embeddings`` the output head is not written (``lm_head.weight`` is the embedding;
    the loader ties it). Tensors are detached CPU copies.
    """
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    out = {}
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        t = t.detach().cpu()
        out[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    return out


def write_hf_dir(
    directory: str | Path,
    *,
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    tokenizer: Any = None,
    generation_config: Any = None,
    extra_json: Mapping[str, Mapping[str, Any]] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> dict[str, Any]:
    """Write a checkpoint into the existing directory ``directory`` (see the module docstring).

    Args:
        config: ``config.json`` content.
        tensors: ``{HF name: tensor}``; every tensor the checkpoint holds.
        tokenizer: an HF tokenizer (``save_pretrained``), or None.
        generation_config: an HF ``GenerationConfig``, or None.
        extra_json: ``{file name: content}`` written next to ``config.json``.
        max_shard_size: bytes (int) or a size string (``"5GB"``, ``"200MB"``).
    Returns:
        ``{"files": [...], "sharded": bool, "tensors": count, "total_size": bytes}``.
    Raises:
        QpassError: ``directory`` is missing; a tensor name collides with an index/other file.
    """
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    d = Path(directory)
    if not d.is_dir():
        raise QpassError(f"checkpoint directory {d} does not exist")
    files: list[str] = []
    write_json(d / "config.json", dict(config))
    files.append("config.json")
    if generation_config is not None:
        write_json(d / "generation_config.json", generation_config.to_diff_dict())
        files.append("generation_config.json")
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        before = {p.name for p in d.iterdir()}
        tokenizer.save_pretrained(str(d))
        files += sorted({p.name for p in d.iterdir()} - before)
    for name, content in (extra_json or {}).items():
        write_json(d / name, dict(content))
        files.append(name)
    state = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    split = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size)
    total = sum(t.numel() * t.element_size() for t in state.values())
    for fname, names in split.filename_to_tensors.items():
        save_file({n: state[n] for n in names}, str(d / fname), metadata={"format": "pt"})
        files.append(fname)
    if split.is_sharded:
        write_json(d / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": dict(sorted(split.tensor_to_filename.items()))})
        files.append(INDEX_NAME)
    return {"files": sorted(files), "sharded": bool(split.is_sharded), "tensors": len(state), "total_size": total}


def read_hf_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (``model.safetensors`` or the shards its index names).

    Raises:
        QpassError: no ``model.safetensors`` / index, or a file that is missing or not readable
            (truncated, bad header): the message names the file.
    """
    import json

    from safetensors.torch import load_file

    d = Path(directory)
    index = d / INDEX_NAME
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as exc:
            raise QpassError(f"{index}: not a safetensors index (weight_map): {exc}") from exc
    elif (d / SAFETENSORS_NAME).is_file():
        files = [SAFETENSORS_NAME]
    else:
        raise QpassError(f"{d}: no {SAFETENSORS_NAME} or {INDEX_NAME}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out.update(load_file(str(d / f)))
        except Exception as exc:  # noqa: BLE001 - safetensors raises bare errors without the path
            raise QpassError(f"{d / f}: not a readable safetensors file (missing, truncated or corrupt?): {exc}") from exc
    return out


def checkpoint_listing(directory: str | Path, *, digests: bool = True) -> dict[str, Any]:
    """What a checkpoint directory holds, as JSON-able data (to compare two exporters' outputs).

    Returns ``{"files": [names], "tensors": {name: {"dtype": safetensors dtype ("U8", "F8_E4M3",
    "F32", "BF16" ...), "shape": [...], "sha256": hex of the raw bytes (with ``digests``)}},
    "config": config.json without ``quantization_config``, "quantization_config": ...,
    "hf_quant_config": hf_quant_config.json or None}``.

    Raises:
        QpassError: see :func:`read_hf_tensors`; an unreadable ``config.json``.
    """
    import hashlib
    import json

    from safetensors import safe_open

    d = Path(directory)
    tensors = read_hf_tensors(d)
    dtypes: dict[str, str] = {}
    for f in sorted(p for p in d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            dtypes.update({k: h.get_slice(k).get_dtype() for k in h.keys()})
    out: dict[str, Any] = {"files": sorted(p.name for p in d.iterdir() if p.is_file()), "tensors": {}}
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        row: dict[str, Any] = {"dtype": dtypes[name], "shape": list(t.shape)}
        if digests:
            row["sha256"] = hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        out["tensors"][name] = row
    try:
        config = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise QpassError(f"{d / 'config.json'}: not readable JSON: {exc}") from exc
    out["quantization_config"] = config.pop("quantization_config", None)
    out["config"] = config
    hq = d / "hf_quant_config.json"
    out["hf_quant_config"] = json.loads(hq.read_text()) if hq.is_file() else None
    return out
