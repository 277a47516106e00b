"""``--rollout-engine {qpass,vllm}``: which engine samples for ``apply``, ``check --behavioral``, ``study`` and ``grpo``.

``qpass`` (default) is qpass's own rollout graph. ``vllm`` exports the model with the recipe's rollout
side (:func:`qpass.checkpoint.export.write_checkpoint`, format ``qpass``; ``plain`` when nothing is
quantized, e.g. the BF16 floor) into a temporary directory under ``/dev/shm``, starts
:class:`qpass.backends.vllm.engine.VLLMRolloutEngine` on it (registered by the ``vllm`` backend) and
removes both afterwards. The learner stays qpass's; what changes is who samples and whose bytes the
bit-level check reads (the engine's own parameters).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from qpass.apps.cliutil import ROLLOUT_ENGINES

VLLM_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
KV_CACHE_BYTES = 512 << 20  # explicit: vLLM-CPU's automatic size reads the NUMA node (prototype §2)

__all__ = ["ROLLOUT_ENGINES", "vllm_rollout"]


@contextlib.contextmanager
def vllm_rollout(model: torch.nn.Module, tokenizer: Any, dtype: torch.dtype, *, rollout: Any = None,
                 calibration_ids: Sequence[Sequence[int]] | None = None, batch_size: int, max_len: int, seed: int = 0,
                 eos_token_id: int | Sequence[int] | None = None) -> Iterator[Any]:
    """A live vLLM rollout engine serving ``model`` with ``rollout``'s quantization (None: unquantized).

    Args:
        model: the HF model whose current weights are exported (the learner's master weights).
        tokenizer: written with the checkpoint; its pad/eos ids are the engine's.
        dtype: model dtype (vLLM ``dtype`` and the unquantized tensors' dtype).
        rollout: the rollout ``QGraph`` whose NVFP4 sites and bytes the checkpoint carries.
        calibration_ids: prompts for the W4A4 ``input_scale`` (unused by qpass's dynamic activations).
        batch_size, max_len: engine rows per call and tokens per row.
    Raises:
        BackendUnavailable: vLLM is not installed (with the install hint).
    """
    from qpass.apps.plugins import load_backends
    from qpass.checkpoint.export import sites_from_rollout, write_checkpoint
    from qpass.checkpoint.tensors import named_tensors_from_rollout
    from qpass.runtime.engine import make_rollout_engine

    load_backends(["vllm"])
    sites = sites_from_rollout(rollout) if rollout is not None else {}
    root = "/dev/shm" if Path("/dev/shm").is_dir() else None
    d = Path(tempfile.mkdtemp(prefix="qpass-vllm-ckpt-", dir=root))
    eng = None
    try:
        write_checkpoint(d, "qpass" if sites else "plain", model=model, dtype=dtype, tokenizer=tokenizer, sites=sites,
                         site_tensors=dict(named_tensors_from_rollout(rollout)) if sites else None,
                         calibration_ids=calibration_ids if any(s.needs_input_scale for s in sites.values()) else None)
        eos = eos_token_id if eos_token_id is not None else tokenizer.eos_token_id
        eng = make_rollout_engine("vllm", model=d, dtype=VLLM_DTYPES[dtype], batch_size=batch_size, max_model_len=max_len,
                                  kv_cache_bytes=KV_CACHE_BYTES, seed=seed, pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
        yield eng
    finally:
        if eng is not None:
            eng.close()
        shutil.rmtree(d, ignore_errors=True)
