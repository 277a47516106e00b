"""The checkpoint contract every engine plugin shares (pure python, no engine import).

* :mod:`qpass.checkpoint.params` — the parameters an NVFP4 linear registers in an engine
  (names, dtypes, shapes, sharded dims, "never loaded" sentinels) and the per-site tensor checks.
  The SGLang and vLLM plugins build their parameters from this one table.
* :mod:`qpass.checkpoint.qconfig` — the ``qpass_nvfp4`` ``quantization_config`` block
  (activation mode, RAC per site, excluded modules, global-scale convention) that selects a
  plugin from a checkpoint's ``config.json`` and tells it how to compute.
* :mod:`qpass.checkpoint.tensors` — master weights (HF names) -> checkpoint tensors with qpass's
  quantizer (one amax per fused group), rollout outputs -> named tensors, fused-group and TP-shard
  checks: what an initial load, a live weight update and ``qpass export`` all write.
* :mod:`qpass.checkpoint.formats` — the checkpoint formats (``plain``, ``qpass`` ...) as registered
  functions: tensors + ``config.json`` ``quantization_config`` + extra files.
* :mod:`qpass.checkpoint.hfdir` — writing / reading a Hugging Face checkpoint directory (config,
  generation config, tokenizer, ``model.safetensors`` or shards + index).
* :mod:`qpass.checkpoint.calibrate` — static W4A4 ``input_scale`` calibrated on prompts.
* :mod:`qpass.checkpoint.export` — :func:`write_checkpoint`: model + rollout sites -> a checkpoint
  directory (``qpass export`` and engines that start from a checkpoint).
"""

from qpass.checkpoint.params import ParamSpec, check_site_tensors, linear_param_specs, make_tensor, mark_unloaded, nan_scale_bytes
from qpass.checkpoint.tensors import check_fused_global_scales, named_tensors_from_rollout, quantize_state_dict, tp_shard
from qpass.checkpoint.qconfig import METHOD_NAME, PACKED_MODULES, QpassQuantOptions, checkpoint_quant_config

__all__ = [
    "METHOD_NAME",
    "PACKED_MODULES",
    "ParamSpec",
    "QpassQuantOptions",
    "check_fused_global_scales",
    "check_site_tensors",
    "checkpoint_quant_config",
    "linear_param_specs",
    "make_tensor",
    "mark_unloaded",
    "nan_scale_bytes",
    "named_tensors_from_rollout",
    "quantize_state_dict",
    "tp_shard",
]
