"""Checkpoint and resume of a GRPO run (issue 13: long runs chained over several commands).

A checkpoint holds everything the next step depends on, so a resumed run continues **bit for
bit** on CPU (tested: 2 steps + save + a fresh trainer + load + 2 steps == 4 steps):

* the learner's trainable parameters (model dtype) and the optimizer's master copies (FP32), the
  AdamW state (``torch.optim.Optimizer.state_dict``), the reference weights when ``beta > 0``;
* the step index; problem order and every sampling seed are functions of ``(seed, step)`` only
  (:func:`qpass.apps.grpo.grpo._seed`), so the problem stream is restored by drawing ``step``
  batches; torch's global CPU (and CUDA) RNG state besides, for any op that uses it;
* the reward wrapper's failure counters, the metric / eval / layer-wise rows so far and the
  initial checks, so the resumed run's files and summary cover the whole run;
* the config (:meth:`GRPOConfig.to_dict`): a resume with a different config is refused, except for
  the keys in :data:`RESUMABLE_KEYS` (the run length, the time budget, CUDA graphs).

**Format** (:data:`FORMAT`): a directory ``DIR/<recipe>.ckpt/`` (:func:`checkpoint_path`), written
atomically (:func:`qpass.atomic.atomic_dir`: a new checkpoint replaces the previous one whole):

===========================  ==============================================================
``manifest.json``            ``{"format", "files": {name: sha256}}``: every other file's digest
``state.json``               the metadata (schema :class:`StateFile`, ``extra="forbid"``): format,
                             recipe, step, config, reward counters, history rows, initial checks,
                             the optimizer's non-tensor state; tensors appear as ``{"$tensor": "file:key"}``
``params.safetensors``       trainable parameters, keys ``00000``, ``00001``, ... (optimizer order)
``masters.safetensors``      FP32 master copies, same keys
``optimizer.safetensors``    AdamW state tensors (``exp_avg``, ``exp_avg_sq``, ``step`` per parameter)
``rng.safetensors``          torch's CPU (and CUDA) RNG states (uint8)
``ref.safetensors``          reference weights (``beta > 0`` only)
===========================  ==============================================================

Loading executes no code from the files: JSON (strict: no NaN tokens; non-finite floats, tuples and
non-string keys are tagged values) and safetensors only. :func:`load_checkpoint` first compares every
file with the manifest (a changed byte anywhere: :class:`qpass.errors.IntegrityError`, exit 1, naming
the file), then validates the metadata against the schema and every tensor's name, shape and dtype
against the trainer (malformed: :class:`qpass.errors.QpassError`, exit 2), and only then touches the
trainer. The checkpoints of older qpass versions (``<recipe>.pt``, a pickle: loading one can run
code) are refused; :func:`convert_legacy_checkpoint` (``python -m qpass.apps.grpo.checkpoint convert
OLD.pt``) rewrites one with ``torch.load(weights_only=True)``, which refuses pickled code.

The rollout engine is not saved: after loading, it is re-synced from the restored master weights
(``update_weights`` re-quantizes with fresh amax, deterministic), which is what the last step's sync
had produced.
"""

from __future__ import annotations

import argparse

from qpass.apps.cliutil import Parser
import hashlib
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qpass.atomic import atomic_dir
from qpass.errors import IntegrityError, QpassError

__all__ = ["FORMAT", "LEGACY_FORMAT", "MANIFEST", "RESUMABLE_KEYS", "StateFile", "checkpoint_path", "convert_legacy_checkpoint",
           "load_checkpoint", "save_checkpoint"]

FORMAT = "qpass-grpo-checkpoint/2"
LEGACY_FORMAT = "qpass-grpo-checkpoint/1"
MANIFEST = "manifest.json"
STATE = "state.json"
SUFFIX = ".ckpt"
#: The tensor files of a checkpoint (``ref`` only when the run has a reference policy).
TENSOR_FILES = ("params", "masters", "optimizer", "rng", "ref")
#: Config keys a resumed run may change.
RESUMABLE_KEYS = frozenset({"steps", "max_time_s", "cuda_graphs"})
_REWARD_COUNTERS = ("n_calls", "n_exceptions", "n_nonfinite", "n_bad_type", "n_empty")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def checkpoint_path(directory: str | Path, recipe: str) -> Path:
    """Where ``qpass grpo --checkpoint-dir DIR`` keeps the checkpoint of ``recipe``: ``DIR/<recipe>.ckpt``."""
    return Path(directory) / f"{recipe}{SUFFIX}"


def legacy_path(path: str | Path) -> Path:
    """The ``<recipe>.pt`` file an older qpass wrote in place of ``<recipe>.ckpt``."""
    path = Path(path)
    return path.with_suffix(".pt") if path.suffix == SUFFIX else path


# ----------------------------------------------------------------------------- schema


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Manifest(_Strict):
    """``manifest.json``: the checkpoint format and the sha256 (hex) of every other file."""

    format: Literal["qpass-grpo-checkpoint/2"]
    files: dict[str, str]


class RewardCounters(_Strict):
    n_calls: int = Field(ge=0)
    n_exceptions: int = Field(ge=0)
    n_nonfinite: int = Field(ge=0)
    n_bad_type: int = Field(ge=0)
    n_empty: int = Field(ge=0)


class StateFile(_Strict):
    """``state.json`` (values of ``config`` / ``history`` / ``initial`` / ``adam`` / tensor fields in the
    tagged encoding of the module docstring; decoded and type-checked after validation)."""

    format: Literal["qpass-grpo-checkpoint/2"]
    recipe: str | None
    step: int = Field(ge=0)
    config: dict[str, Any]
    reward: RewardCounters
    history: dict[str, list[dict[str, Any]]]
    initial: Any
    params: list[dict[str, str]]
    masters: list[dict[str, str]]
    ref: list[dict[str, str]] | None
    adam: dict[str, Any]
    rng_cpu: dict[str, str]
    rng_cuda: list[dict[str, str]] | None


# ----------------------------------------------------------------------------- tagged JSON codec


class _Encoder:
    """Python state -> JSON: tensors go to per-file dicts (``{"$tensor": "file:key"}`` in their place)."""

    def __init__(self) -> None:
        self.files: dict[str, dict[str, torch.Tensor]] = {f: {} for f in TENSOR_FILES}

    def tensor(self, file: str, key: str, t: torch.Tensor) -> dict[str, str]:
        self.files[file][key] = t.detach().to("cpu", copy=True).contiguous()
        return {"$tensor": f"{file}:{key}"}

    def __call__(self, v: Any, file: str, path: str) -> Any:
        if v is None or isinstance(v, (bool, str, int)):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else {"$float": "nan" if v != v else ("inf" if v > 0 else "-inf")}
        if isinstance(v, torch.Tensor):
            return self.tensor(file, path or "value", v)
        if isinstance(v, tuple):
            return {"$tuple": [self(x, file, f"{path}.{i}") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [self(x, file, f"{path}.{i}") for i, x in enumerate(v)]
        if isinstance(v, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in v):
                return {k: self(x, file, f"{path}.{k}" if path else k) for k, x in v.items()}
            return {"$items": [[self(k, file, f"{path}.key{i}"), self(x, file, f"{path}.{k}")] for i, (k, x) in enumerate(v.items())]}
        if callable(getattr(v, "item", None)) and getattr(v, "ndim", None) == 0:  # a numpy scalar: its exact Python value
            return self(v.item(), file, path)
        raise TypeError(f"GRPO checkpoint: cannot store a {type(v).__name__} at {path or '(top level)'}")


class _Decoder:
    """JSON -> Python state, resolving tensor references against the loaded files (each used once)."""

    def __init__(self, files: dict[str, dict[str, torch.Tensor]], where: Path) -> None:
        self.files, self.where, self.used = files, where, set()

    def bad(self, path: str, why: str) -> QpassError:
        return QpassError(f"{self.where / STATE}: {path or '(top level)'}: {why}")

    def __call__(self, v: Any, path: str = "") -> Any:
        if v is None or isinstance(v, (bool, str, int, float)):
            return v
        if isinstance(v, list):
            return [self(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if not isinstance(v, dict):
            raise self.bad(path, f"unexpected {type(v).__name__}")
        tags = [k for k in v if k.startswith("$")]
        if not tags:
            return {k: self(x, f"{path}.{k}" if path else k) for k, x in v.items()}
        if len(v) != 1:
            raise self.bad(path, f"a tagged value has one key, got {sorted(v)}")
        tag, x = tags[0], v[tags[0]]
        if tag == "$float":
            if x not in ("nan", "inf", "-inf"):
                raise self.bad(path, f"$float must be nan, inf or -inf, got {x!r}")
            return float(x)
        if tag == "$tuple" and isinstance(x, list):
            return tuple(self(y, f"{path}[{i}]") for i, y in enumerate(x))
        if tag == "$items" and isinstance(x, list) and all(isinstance(p, list) and len(p) == 2 for p in x):
            return {self(k, f"{path}.key"): self(y, f"{path}[{i}]") for i, (k, y) in enumerate(x)}
        if tag == "$tensor" and isinstance(x, str):
            return self.tensor_ref(x, path)
        raise self.bad(path, f"unknown or malformed tagged value {tag}")

    def tensor_ref(self, ref: str, path: str) -> torch.Tensor:
        file, _, key = ref.partition(":")
        if file not in self.files or key not in self.files[file]:
            raise self.bad(path, f"refers to tensor {key!r} of {file}.safetensors, which is not in the checkpoint")
        if (file, key) in self.used:
            raise self.bad(path, f"tensor {ref} is referred to twice")
        self.used.add((file, key))
        return self.files[file][key]

    def tensors(self, refs: list[dict[str, str]] | None, path: str) -> list[torch.Tensor] | None:
        if refs is None:
            return None
        out = [self(r, f"{path}[{i}]") for i, r in enumerate(refs)]
        if not all(isinstance(t, torch.Tensor) for t in out):
            raise self.bad(path, "expected a list of tensor references")
        return out

    def unused(self) -> list[str]:
        return sorted(f"{f}.safetensors:{k}" for f, ts in self.files.items() for k in ts if (f, k) not in self.used)


# ----------------------------------------------------------------------------- save


def _state_of(trainer: Any) -> dict[str, Any]:
    """Everything :func:`load_checkpoint` restores, as Python values (tensors still live)."""
    opt = trainer.opt
    return {
        "format": FORMAT,
        "recipe": trainer.recipe_name,
        "config": trainer.cfg.to_dict(),
        "step": trainer.step_idx,
        "params": list(opt.params),
        "masters": list(opt.master),
        "adam": opt.opt.state_dict(),
        "ref": [p for p in trainer.ref.parameters()] if trainer.ref is not None else None,
        "reward": {k: getattr(trainer.reward, k) for k in _REWARD_COUNTERS},
        "history": trainer.history,
        "initial": trainer.initial,
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def _write_state(state: dict[str, Any], directory: Path) -> None:
    """Write ``state`` (a :func:`_state_of` dict) as the files of the module table into ``directory``."""
    from safetensors.torch import save_file

    from qpass.apps.artifacts import sha256_file
    from qpass.jsonio import write_json

    enc = _Encoder()
    meta = {
        "format": FORMAT,
        "recipe": state["recipe"],
        "step": int(state["step"]),
        "config": enc(state["config"], "optimizer", "config"),
        "reward": {k: int(state["reward"][k]) for k in _REWARD_COUNTERS},
        "history": enc(state["history"], "optimizer", "history"),
        "initial": enc(state["initial"], "optimizer", "initial"),
        "params": [enc.tensor("params", f"{i:05d}", t) for i, t in enumerate(state["params"])],
        "masters": [enc.tensor("masters", f"{i:05d}", t) for i, t in enumerate(state["masters"])],
        "ref": None if state["ref"] is None else [enc.tensor("ref", f"{i:05d}", t) for i, t in enumerate(state["ref"])],
        "adam": enc(state["adam"], "optimizer", ""),
        "rng_cpu": enc.tensor("rng", "cpu", state["rng_cpu"]),
        "rng_cuda": None if state["rng_cuda"] is None else [enc.tensor("rng", f"cuda{i}", t) for i, t in enumerate(state["rng_cuda"])],
    }
    StateFile.model_validate(meta)  # what the loader will require
    write_json(directory / STATE, meta)
    files = [STATE]
    for name, tensors in enc.files.items():
        if tensors or name in ("params", "masters", "optimizer", "rng"):
            save_file(tensors, str(directory / f"{name}.safetensors"), metadata={"format": FORMAT})
            files.append(f"{name}.safetensors")
    write_json(directory / MANIFEST, {"format": FORMAT, "files": {f: sha256_file(directory / f) for f in files}})


def save_checkpoint(trainer: Any, path: str | Path) -> Path:
    """Write ``trainer``'s (a :class:`qpass.apps.grpo.grpo.GRPOTrainer`) state after its last completed
    step as the checkpoint directory ``path`` (module docstring), replacing a previous checkpoint
    there as a whole (atomically).

    Returns:
        ``path``.
    Raises:
        QpassError: ``path`` exists and is not a checkpoint directory (see :func:`qpass.atomic.atomic_dir`).
    """
    path = Path(path)
    with atomic_dir(path, force=True, marker=MANIFEST) as tmp:
        _write_state(_state_of(trainer), tmp)
    return path


# ----------------------------------------------------------------------------- load


def _read_strict_json(path: Path, what: str) -> Any:
    def no_constant(name: str) -> Any:
        raise ValueError(f"non-standard JSON constant {name}")

    try:
        return json.loads(path.read_bytes().decode("utf-8"), parse_constant=no_constant)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise QpassError(f"{path}: not a readable {what} (strict UTF-8 JSON): {type(exc).__name__}: {exc}") from exc


def _schema_error(path: Path, exc: ValidationError) -> QpassError:
    errs = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(top level)'}: {e['msg']}" for e in exc.errors()[:4])
    return QpassError(f"{path}: does not match the GRPO checkpoint schema ({errs})")


def verify_checkpoint(path: str | Path) -> Manifest:
    """Compare every file of the checkpoint directory ``path`` with its manifest (no tensor loaded).

    Raises:
        QpassError: not a checkpoint directory (a legacy ``.pt`` pickle is named as such), an unreadable
            or malformed manifest, a file name the format does not have.
        IntegrityError: a file is missing, changed (sha256) or not listed.
    """
    from qpass.apps.artifacts import sha256_file

    path = Path(path)
    if path.is_file():
        raise QpassError(f"{path} is a file, not a {FORMAT} checkpoint directory; if an older qpass wrote it ({LEGACY_FORMAT}, "
                         f"a pickle, which qpass does not load: it can run code), convert it with "
                         f"`python -m qpass.apps.grpo.checkpoint convert {path}`, or delete it to start over")
    if not (path / MANIFEST).is_file():
        raise QpassError(f"{path} is not a GRPO checkpoint directory (no {MANIFEST})")
    try:
        man = Manifest.model_validate(_read_strict_json(path / MANIFEST, "checkpoint manifest"))
    except ValidationError as exc:
        raise _schema_error(path / MANIFEST, exc) from exc
    allowed = {STATE, *(f"{n}.safetensors" for n in TENSOR_FILES)}
    bad = sorted(set(man.files) - allowed) + sorted(k for k, v in man.files.items() if not _HEX64.fullmatch(v))
    if bad or STATE not in man.files:
        raise QpassError(f"{path / MANIFEST}: lists {bad or 'no ' + STATE}; a checkpoint holds {sorted(allowed)} with sha256 hex digests")
    problems = []
    for name, want in sorted(man.files.items()):
        f = path / name
        if not f.is_file():
            problems.append(f"{f}: listed in {MANIFEST} but missing")
        elif sha256_file(f) != want:
            problems.append(f"{f}: sha256 differs from {MANIFEST} (the file changed after the checkpoint was written)")
    extra = sorted(p.name for p in path.iterdir() if p.name != MANIFEST and p.name not in man.files)
    problems += [f"{path / n}: not listed in {MANIFEST}" for n in extra]
    if problems:
        raise IntegrityError(f"GRPO checkpoint {path} failed verification; nothing was loaded: " + "; ".join(problems))
    return man


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The verified, decoded state of the checkpoint directory ``path`` (a :func:`_state_of`-shaped dict).

    Raises:
        QpassError, IntegrityError: see :func:`verify_checkpoint`; a ``state.json`` that does not match
            :class:`StateFile`, an unreadable tensor file, a tensor reference that resolves to nothing
            (or a tensor nothing refers to), a value of the wrong type (all exit 2).
    """
    from safetensors.torch import load_file

    path = Path(path)
    man = verify_checkpoint(path)
    try:
        meta = StateFile.model_validate(_read_strict_json(path / STATE, "checkpoint state"))
    except ValidationError as exc:
        raise _schema_error(path / STATE, exc) from exc
    files: dict[str, dict[str, torch.Tensor]] = {}
    for name in TENSOR_FILES:
        f = f"{name}.safetensors"
        if f in man.files:
            try:
                files[name] = load_file(str(path / f))
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
                raise QpassError(f"{path / f}: not a readable safetensors file: {exc}") from exc
    dec = _Decoder(files, path)
    state = {
        "format": meta.format, "recipe": meta.recipe, "step": meta.step, "config": dec(meta.config, "config"),
        "reward": meta.reward.model_dump(), "history": dec(meta.history, "history"), "initial": dec(meta.initial, "initial"),
        "params": dec.tensors(meta.params, "params"), "masters": dec.tensors(meta.masters, "masters"),
        "ref": dec.tensors(meta.ref, "ref"), "adam": dec(meta.adam, "adam"),
        "rng_cpu": dec(meta.rng_cpu, "rng_cpu"), "rng_cuda": dec.tensors(meta.rng_cuda, "rng_cuda"),
    }
    if dec.unused():
        raise QpassError(f"{path}: tensors no field of {STATE} refers to: {', '.join(dec.unused()[:5])}")
    if not isinstance(state["rng_cpu"], torch.Tensor) or state["rng_cpu"].dtype != torch.uint8:
        raise dec.bad("rng_cpu", "expected a uint8 tensor (torch.get_rng_state())")
    return state


def _check_config(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    diff = sorted(k for k in set(saved) | set(current) if k not in RESUMABLE_KEYS and saved.get(k) != current.get(k))
    if diff:
        detail = "; ".join(f"{k}: checkpoint {saved.get(k)!r}, now {current.get(k)!r}" for k in diff[:4])
        raise QpassError(f"{where}: the run's config differs from the checkpoint's ({detail}); resume with the same flags")


def _check_tensors(where: Path, name: str, saved: list[torch.Tensor], live: list[torch.Tensor]) -> None:
    """Same count, shapes and dtypes (a copy would cast silently)."""
    if len(saved) != len(live):
        raise QpassError(f"{where}: {name}: {len(saved)} saved vs {len(live)} live tensors (another model?)")
    for i, (s, t) in enumerate(zip(saved, live)):
        if s.shape != t.shape or s.dtype != t.dtype:
            raise QpassError(f"{where}: {name}[{i}] is {s.dtype}{tuple(s.shape)}, this run has {t.dtype}{tuple(t.shape)}")


def _check_adam(where: Path, adam: Any, masters: list[torch.Tensor]) -> None:
    """The AdamW state dict matches the masters (``load_state_dict`` checks group sizes only)."""
    if not isinstance(adam, dict) or set(adam) != {"state", "param_groups"} or not isinstance(adam["state"], dict):
        raise QpassError(f"{where}: adam: not an optimizer state dict (keys state, param_groups)")
    for idx, st in adam["state"].items():
        if not isinstance(idx, int) or not 0 <= idx < len(masters) or not isinstance(st, dict):
            raise QpassError(f"{where}: adam.state: entry {idx!r} is not the state of one of the {len(masters)} parameters")
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() and (v.shape != masters[idx].shape or v.dtype != masters[idx].dtype):
                raise QpassError(f"{where}: adam.state[{idx}].{k} is {v.dtype}{tuple(v.shape)}, its parameter "
                                 f"{masters[idx].dtype}{tuple(masters[idx].shape)}")


def _check_groups(where: Path, adam: dict[str, Any], live: torch.optim.Optimizer) -> None:
    """What ``Optimizer.load_state_dict`` would refuse (checked before the live optimizer is touched)."""
    groups, want = adam["param_groups"], live.param_groups
    ok = isinstance(groups, list) and len(groups) == len(want) and all(
        isinstance(g, dict) and isinstance(g.get("params"), list) and len(g["params"]) == len(w["params"])
        for g, w in zip(groups, want))
    if not ok:
        raise QpassError(f"{where}: adam.param_groups do not fit this run's optimizer "
                         f"({len(want)} group(s) of {[len(w['params']) for w in want]} parameters)")


@torch.no_grad()
def load_checkpoint(trainer: Any, path: str | Path) -> int:
    """Restore ``trainer`` (built with the same model, recipe and config) from the checkpoint directory ``path``.

    Every file is verified (manifest sha256, schema, tensor names / shapes / dtypes) before anything
    is changed. Also rewrites the trainer's JSONL files from the saved rows and re-syncs the rollout engine.

    Returns:
        the restored step index.
    Raises:
        IntegrityError: a file differs from the manifest (named; exit 1).
        QpassError: not a checkpoint of this format (a legacy pickle, garbage), another recipe, a
            different config (outside :data:`RESUMABLE_KEYS`), tensors of other shapes or dtypes
            (exit 2); the trainer is unchanged then.
    """
    from qpass.apps.grpo.jsonl import append_jsonl
    from qpass.apps.grpo.weights import snapshot_rollout_constants

    path = Path(path)
    state = read_checkpoint(path)
    if state["recipe"] != trainer.recipe_name:
        raise QpassError(f"{path}: checkpoint of recipe {state['recipe']!r}, this run is {trainer.recipe_name!r}")
    _check_config(state["config"], trainer.cfg.to_dict(), str(path))
    opt = trainer.opt
    _check_tensors(path, "params", state["params"], opt.params)
    _check_tensors(path, "masters", state["masters"], opt.master)
    _check_adam(path, state["adam"], opt.master)
    ref_live = list(trainer.ref.parameters()) if trainer.ref is not None else None
    if (ref_live is None) != (state["ref"] is None):
        raise QpassError(f"{path}: the checkpoint {'has' if state['ref'] is not None else 'has no'} reference weights, this run "
                         f"{'has none' if ref_live is None else 'has a reference policy'}")
    if ref_live is not None:
        _check_tensors(path, "ref", state["ref"], ref_live)
    if not isinstance(state["history"], dict) or not all(isinstance(v, list) for v in state["history"].values()):
        raise QpassError(f"{path}: history: expected lists of rows")
    _check_groups(path, state["adam"], opt.opt)
    for saved, live in zip(state["params"], opt.params):
        live.copy_(saved)
    for saved, live in zip(state["masters"], opt.master):
        live.copy_(saved)
    opt.opt.load_state_dict(state["adam"])
    if ref_live is not None:
        for saved, live in zip(state["ref"], ref_live):
            live.copy_(saved)
    for k, v in state["reward"].items():
        setattr(trainer.reward, k, v)
    step = int(state["step"])
    for _ in range(step):  # the problem stream: one batch per completed step
        next(trainer.batches)
    trainer.step_idx = step
    trainer.initial = state["initial"]
    trainer.history = {k: list(v) for k, v in state["history"].items()}
    for key, rows in trainer.history.items():
        p = trainer.paths.get(key)
        if p is not None:
            p.unlink(missing_ok=True)
            for row in rows:
                append_jsonl(p, row, fsync=False)
    torch.set_rng_state(state["rng_cpu"])
    if state["rng_cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])
    trainer.ro.update_weights(trainer.le.export_weights())
    trainer.snapshot = snapshot_rollout_constants(trainer.rollout_qg)
    return step


# ----------------------------------------------------------------------------- legacy checkpoints


def convert_legacy_checkpoint(old: str | Path, new: str | Path | None = None) -> Path:
    """Rewrite an older qpass's ``<recipe>.pt`` (:data:`LEGACY_FORMAT`, a ``torch.save`` pickle) as a
    checkpoint directory (default: ``<recipe>.ckpt`` beside it). The pickle is read with
    ``torch.load(weights_only=True)``: tensors and plain containers only, so a crafted file cannot run code.

    Raises:
        QpassError: unreadable, not a legacy GRPO checkpoint, or holding anything but plain data.
    """
    old = Path(old)
    new = Path(new) if new is not None else old.with_suffix(SUFFIX)
    try:
        state = torch.load(old, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, RuntimeError, EOFError ...: all bad input here
        raise QpassError(f"{old}: not a readable {LEGACY_FORMAT} file (read with weights_only=True: plain data only): "
                         f"{type(exc).__name__}: {exc}") from exc
    keys = {"format", "recipe", "config", "step", "params", "masters", "adam", "ref", "reward", "history", "initial", "rng_cpu", "rng_cuda"}
    if not isinstance(state, dict) or state.get("format") != LEGACY_FORMAT or set(state) != keys:
        raise QpassError(f"{old}: not a {LEGACY_FORMAT} file")
    with atomic_dir(new, force=False, marker=MANIFEST) as tmp:
        _write_state(state, tmp)
    return new


def main(argv: list[str] | None = None) -> int:
    """``python -m qpass.apps.grpo.checkpoint convert OLD.pt [--out NEW.ckpt]`` / ``verify CKPT``."""
    from qpass.apps.cliutil import exit_status

    ap = Parser(prog="python -m qpass.apps.grpo.checkpoint", description="GRPO checkpoints: convert or verify")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="rewrite an older qpass's <recipe>.pt pickle as a <recipe>.ckpt directory")
    c.add_argument("old", type=Path)
    c.add_argument("--out", type=Path, help="the new checkpoint directory (default: OLD with the suffix .ckpt)")
    v = sub.add_parser("verify", help="compare a checkpoint directory with its manifest and schema")
    v.add_argument("path", type=Path)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "convert":
            print(f"wrote {convert_legacy_checkpoint(a.old, a.out)}")
        else:
            st = read_checkpoint(a.path)
            print(f"{a.path}: ok ({FORMAT}, recipe {st['recipe']}, step {st['step']})")
    except QpassError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_status(exc)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
