"""Megatron-core learner backend: the learner as a Megatron-core ``GPTModel`` (``MegatronLearner``,
learner-engine name ``"megatron"``, registered by :func:`register`), with NVFP4 weight fake-quant
with STE on its Column/RowParallelLinear layers.

Modules: ``config`` (HF Llama config -> GPTModel, refusals), ``convert`` (weights HF <-> TP shards),
``model`` (build, load, forward), ``plan`` (qpass's learner recipe -> patched modules), ``fake_quant``
(the hooks), ``dist`` (TP process layout), ``learner`` (the engine).

The global amax is recomputed every forward and all-reduced with MAX over the tensor-parallel
group (and covers a fused layer's q/k/v or gate/up shards), so every rank quantizes its shard
exactly as the slice of qpass's quantization of the unsharded weight, and the exported weights are
byte-identical to ``qpass.nvfp4_quantize`` of the gathered weight (SPEC §3 rule 1).
Needs ``megatron-core`` (0.16.1 on Python 3.11) only when a function touches its classes; the
fused-layout helpers are plain torch.
"""

from qpass.backends.megatron.fake_quant import (
    NVFP4WeightQuant,
    enable_nvfp4_weight_fake_quant,
    enable_on_model,
    export_nvfp4_weight,
    fake_quant_weight,
    group_amax_of,
    split_megatron_fc1,
    split_megatron_qkv,
)


def register() -> None:
    """Register :class:`~qpass.backends.megatron.learner.MegatronLearner` as learner engine
    ``"megatron"`` (idempotent; called by ``qpass.apps.plugins.load_backends(["megatron"])``)."""
    from qpass.backends.megatron.learner import MegatronLearner
    from qpass.runtime.engine import register_learner_engine

    register_learner_engine("megatron")(MegatronLearner)


def megatron_available() -> bool:
    """True if ``megatron.core`` is importable."""
    import importlib.util

    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


__all__ = [
    "NVFP4WeightQuant",
    "enable_nvfp4_weight_fake_quant",
    "enable_on_model",
    "export_nvfp4_weight",
    "fake_quant_weight",
    "group_amax_of",
    "megatron_available",
    "register",
    "split_megatron_fc1",
    "split_megatron_qkv",
]
