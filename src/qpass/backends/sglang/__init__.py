"""SGLang rollout plugin: qpass NVFP4 (W4A4 with dynamic activation scales and RAC, or W4A16).

Out-of-tree SGLang quantization method ``qpass_nvfp4``, registered by the ``sglang.srt.plugins``
entry point (``pyproject.toml``: ``qpass_nvfp4 = "qpass.backends.sglang:register"``), which SGLang
runs in the launcher and in every scheduler/worker process (prior-art/backends.md §1.2). Importing
this package never imports SGLang: the SGLang subclasses are built on first use
(:func:`~qpass.backends.sglang.plugin.plugin_classes`).

Pieces that do not need SGLang (tested on CI):

* :mod:`.contract`: the ``modelopt_fp4`` parameters ``create_weights`` registers;
* :mod:`.config`: options parsed from the checkpoint's quantization config, exclusions, fused
  layers' members and RAC;
* :mod:`.weights`: checkpoint-format named tensors for ``update_weights_from_tensor`` (from a
  rollout graph / ``qpass apply`` directory, or quantized from learner weights), fused-group
  global-scale check, TP shard arithmetic.
"""

from __future__ import annotations

import logging

from qpass.checkpoint.method import register_plugin
from qpass.checkpoint.qconfig import METHOD_NAME, QpassQuantOptions, checkpoint_quant_config
from qpass.checkpoint.params import ParamSpec, linear_param_specs
from qpass.backends.sglang.plugin import plugin_classes, sglang_available
from qpass.checkpoint.tensors import check_fused_global_scales, named_tensors_from_rollout, quantize_state_dict, tp_shard

log = logging.getLogger(__name__)


def register() -> bool:
    """Register ``qpass_nvfp4`` with SGLang (entry-point target; idempotent; never raises).

    Adds the config class to SGLang's ``QUANTIZATION_METHODS``, the CLI choice list, and the
    method class to ``WEIGHT_LOADER_V2_SUPPORTED`` (its parameters use SGLang's v2 loaders).

    Returns:
        True if registered, False if SGLang is not installed or registration failed (logged).
    """
    return register_plugin("SGLang", sglang_available, _install, log)


def _install() -> None:
    import sglang.srt.layers.quantization as Q
    from sglang.srt.layers.linear import WEIGHT_LOADER_V2_SUPPORTED

    cfg_cls, method_cls = plugin_classes()
    Q.QUANTIZATION_METHODS[METHOD_NAME] = cfg_cls
    if method_cls.__name__ not in WEIGHT_LOADER_V2_SUPPORTED:
        WEIGHT_LOADER_V2_SUPPORTED.append(method_cls.__name__)
    try:
        from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES, add_quantization_method_choices

        if METHOD_NAME not in QUANTIZATION_CHOICES:
            add_quantization_method_choices([METHOD_NAME])
    except ImportError:  # older SGLang: no CLI extension point; checkpoint-driven selection still works
        log.info("sglang has no add_quantization_method_choices; --quantization %s will not parse", METHOD_NAME)


__all__ = [
    "METHOD_NAME",
    "ParamSpec",
    "QpassQuantOptions",
    "check_fused_global_scales",
    "checkpoint_quant_config",
    "linear_param_specs",
    "named_tensors_from_rollout",
    "plugin_classes",
    "quantize_state_dict",
    "register",
    "sglang_available",
    "tp_shard",
]
