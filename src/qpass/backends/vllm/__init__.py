"""vLLM backend: the ``qpass_nvfp4`` quantization method inside vLLM, and vLLM as a qpass rollout engine.

Two registrations:

* :func:`register` — the ``vllm.general_plugins`` entry point (``pyproject.toml``:
  ``qpass_nvfp4 = "qpass.backends.vllm:register"``), which vLLM runs in its front end and in every
  engine-core / worker process: registers the ``qpass_nvfp4`` :class:`QuantizationConfig`
  (:mod:`.plugin`), found from a checkpoint's ``config.json`` ``quantization_config``.
* :func:`register_engine` — the qpass side (the catalog's ``vllm`` backend hook, run by
  :func:`qpass.apps.plugins.load_backends`): registers :class:`.engine.VLLMRolloutEngine` as rollout
  engine ``"vllm"`` (``make_rollout_engine("vllm", model=CKPT_DIR, ...)``).

Importing this package never imports vLLM; the engine-free parts (:mod:`.worker`'s
``assemble_served``, :mod:`qpass.checkpoint.linear`'s numerics) are tested without it.
"""

from __future__ import annotations

from qpass.backends.vllm.plugin import register, vllm_available


def register_engine() -> None:
    """Register rollout engine ``"vllm"`` (cheap: vLLM itself is imported when an engine starts)."""
    from qpass.backends.vllm.engine import VLLMRolloutEngine
    from qpass.runtime.engine import register_rollout_engine

    register_rollout_engine("vllm")(VLLMRolloutEngine)


__all__ = ["register", "register_engine", "vllm_available"]
