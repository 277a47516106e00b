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

The rollout engine is not saved: after loading, it is re-synced from the restored master weights
(``update_weights`` re-quantizes with fresh amax, deterministic), which is what the last step's sync
had produced. Files are written atomically (:func:`qpass.atomic.write_atomic`); the format tag
is :data:`FORMAT`.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

from qpass.atomic import write_atomic
from qpass.errors import QpassError

__all__ = ["FORMAT", "RESUMABLE_KEYS", "load_checkpoint", "save_checkpoint"]

FORMAT = "qpass-grpo-checkpoint/1"
#: Config keys a resumed run may change.
RESUMABLE_KEYS = frozenset({"steps", "max_time_s", "cuda_graphs"})
_REWARD_COUNTERS = ("n_calls", "n_exceptions", "n_nonfinite", "n_bad_type", "n_empty")


def _cpu(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().to("cpu", copy=True) for t in ts]


def save_checkpoint(trainer: Any, path: str | Path) -> Path:
    """Write ``trainer``'s (a :class:`qpass.apps.grpo.grpo.GRPOTrainer`) state after its last completed step to ``path`` (atomically).

    Returns:
        ``path``.
    """
    opt = trainer.opt
    state: dict[str, Any] = {
        "format": FORMAT,
        "recipe": trainer.recipe_name,
        "config": trainer.cfg.to_dict(),
        "step": trainer.step_idx,
        "params": _cpu(opt.params),
        "masters": _cpu(opt.master),
        "adam": opt.opt.state_dict(),
        "ref": _cpu([p for p in trainer.ref.parameters()]) if trainer.ref is not None else None,
        "reward": {k: getattr(trainer.reward, k) for k in _REWARD_COUNTERS},
        "history": trainer.history,
        "initial": trainer.initial,
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    path = Path(path)
    write_atomic(path, buf.getvalue())
    return path


def _check_config(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    diff = sorted(k for k in set(saved) | set(current) if k not in RESUMABLE_KEYS and saved.get(k) != current.get(k))
    if diff:
        detail = "; ".join(f"{k}: checkpoint {saved.get(k)!r}, now {current.get(k)!r}" for k in diff[:4])
        raise QpassError(f"{where}: the run's config differs from the checkpoint's ({detail}); resume with the same flags")


@torch.no_grad()
def load_checkpoint(trainer: Any, path: str | Path) -> int:
    """Restore ``trainer`` (built with the same model, recipe and config) from ``path``.

    Also rewrites the trainer's JSONL files from the saved rows and re-syncs the rollout engine.

    Returns:
        the restored step index.
    Raises:
        QpassError: not a checkpoint of this format, another recipe, a different config (outside
            :data:`RESUMABLE_KEYS`), or parameters of other shapes; the trainer is unchanged then.
    """
    from qpass.apps.grpo.jsonl import append_jsonl
    from qpass.apps.grpo.weights import snapshot_rollout_constants

    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:  # garbage or truncated bytes
        raise QpassError(f"{path}: cannot read the GRPO checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise QpassError(f"{path}: not a {FORMAT} file")
    if state["recipe"] != trainer.recipe_name:
        raise QpassError(f"{path}: checkpoint of recipe {state['recipe']!r}, this run is {trainer.recipe_name!r}")
    _check_config(state["config"], trainer.cfg.to_dict(), str(path))
    opt = trainer.opt
    for name, saved, live in (("params", state["params"], opt.params), ("masters", state["masters"], opt.master)):
        shapes = [tuple(t.shape) for t in saved], [tuple(t.shape) for t in live]
        if shapes[0] != shapes[1]:
            raise QpassError(f"{path}: {name} do not match this model ({len(shapes[0])} saved vs {len(shapes[1])} live tensors, "
                             "or different shapes)")
    for saved, live in zip(state["params"], opt.params):
        live.copy_(saved)
    for saved, live in zip(state["masters"], opt.master):
        live.copy_(saved)
    opt.opt.load_state_dict(state["adam"])
    if trainer.ref is not None and state["ref"] is not None:
        for saved, live in zip(state["ref"], trainer.ref.parameters()):
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
