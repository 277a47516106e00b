"""The SGLang classes (built on first use, so importing qpass never needs SGLang).

* ``QpassNvfp4Config(QuantizationConfig)``: name ``qpass_nvfp4``; ``from_config`` parses the
  checkpoint's quantization config (:class:`qpass.checkpoint.qconfig.QpassQuantOptions`); ``get_quant_method``
  returns :class:`QpassNvfp4LinearMethod` for quantized linear layers and SGLang's
  ``UnquantizedLinearMethod`` for excluded ones (lm_head, embeddings, routers).
* ``QpassNvfp4LinearMethod(LinearMethodBase)``:

  - ``create_weights``: the ``modelopt_fp4`` parameters of :mod:`.contract` (same names, dtypes,
    shapes and SGLang parameter classes), so ModelOpt and qpass checkpoints load through SGLang's
    own loaders (including TP sharding of the packed tensors and per-shard global scales); each
    loader is wrapped (:func:`qpass.checkpoint.validate.checked_loader`, the vLLM plugin's too):
    dtype / shape checked, every (parameter, shard) loaded recorded;
  - ``process_weights_after_loading``: :func:`qpass.checkpoint.validate.check_all_loaded` (a load
    or update that brought some parameters must bring ``weight``, ``weight_scale`` and
    ``weight_scale_2`` of every shard: new codes without their scales are refused; a repeat call
    with nothing loaded passes), then :func:`finish_loading`: refuses, naming the layer, a scale
    that was never loaded (the scales start as a NaN sentinel), the scale bytes
    :mod:`qpass.checkpoint.validate` refuses (NaN, sign bit, not fitting their codes, a global
    scale not finite / not > 0 / too large) and fused shards whose ``weight_scale_2`` differ
    (qpass shares one global scale per group); binds the decode global ``layer.qpass_s_dec``. It
    never repacks, so it is idempotent;
    ``restore_weights_before_loading`` (:func:`begin_loading`, the start of an RL weight-update
    session) re-poisons the scales, so an update that carries codes without scales is refused
    rather than served with stale scales;
  - ``apply``: ``torch.ops.qpass.nvfp4_linear`` — qpass's own op (reference or Triton kernel), so
    the rollout math is qpass's: W4A16, or W4A4 with a dynamic per-tensor / per-token activation
    global scale and optional residual compensation. On a row-parallel layer with TP > 1 the
    activation is K-sharded: its amax is all-reduced with MAX over the TP group first (SPEC §3
    rule 1), so every rank quantizes its slice exactly like the unsharded activation; RAC's
    channel ranking would need the whole K and is refused there.

Source: prior-art/backends.md §1 and Appendix A (sglang 0.5.23 plugin API).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from qpass.checkpoint.linear import activation_for_row_parallel, begin_loading, finish_loading, served_linear
from qpass.checkpoint.method import (
    LinearMethodFields,
    engine_importable,
    register_linear_params,
    row_parallel_rac_error,
    set_layer_sizes,
)
from qpass.checkpoint.params import NVFP4_BLOCK, linear_param_specs
from qpass.checkpoint.qconfig import METHOD_NAME, QpassQuantOptions
from qpass.checkpoint.validate import check_all_loaded, init_load_record
from qpass.errors import QuantizationError


def sglang_available() -> bool:
    """True if ``sglang`` (its quantization base classes) can be imported."""
    return engine_importable("sglang.srt.layers.quantization.base_config")


def _linear_method_class(linear_method_base: type, param_classes: dict[str, type]) -> type:
    """``QpassNvfp4LinearMethod`` (module docstring) on SGLang's ``LinearMethodBase``."""

    class QpassNvfp4LinearMethod(LinearMethodFields, linear_method_base):
        """qpass NVFP4 linear (see module docstring)."""

        def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                           input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
            init_load_record(layer, self.prefix, output_partition_sizes, k_sharded=input_size_per_partition != input_size)
            register_linear_params(layer, linear_param_specs(input_size_per_partition, output_partition_sizes, prefix=self.prefix),
                                   param_classes, extra_weight_attrs.get("weight_loader"), scalar_to_array=True)
            layer.quant_config = self.quant_config
            set_layer_sizes(layer, params_dtype, input_size_per_partition, output_partition_sizes)
            if layer.qpass_k_sharded and self.rac is not None:
                raise row_parallel_rac_error(self.prefix, input_size, input_size_per_partition, NotImplementedError)

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            # a (re)load must bring every parameter of every shard (a partial update with codes but no
            # scales is refused, as in the vLLM plugin); a repeat call with nothing loaded is idempotent
            check_all_loaded(layer, self.prefix, idle_ok=True)
            finish_loading(layer, self.prefix)

        def restore_weights_before_loading(self, layer: torch.nn.Module) -> None:
            """A weight update begins: mark the scales unloaded (nothing else to undo: no repacking)."""
            begin_loading(layer)

        def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            group = _tp_group(layer) if self.act != "none" and getattr(layer, "qpass_k_sharded", False) else None
            return served_linear(layer, x, bias, site=self.prefix, act=self.act, rac=self.rac, process_group=group)

    return QpassNvfp4LinearMethod


def _config_class(quantization_config: type, linear_base: type, unquantized_method: type, linear: type) -> type:
    """``QpassNvfp4Config`` on SGLang's ``QuantizationConfig``: ``linear`` methods for quantized
    ``linear_base`` layers, ``unquantized_method`` for excluded ones."""

    class QpassNvfp4Config(quantization_config):
        """``--quantization qpass_nvfp4`` (or ``quant_method: qpass_nvfp4`` in a checkpoint)."""

        def __init__(self, options: QpassQuantOptions | None = None) -> None:
            super().__init__()
            self.options = options or QpassQuantOptions()
            if self.options.weight == "none":
                raise QuantizationError(f"{METHOD_NAME}: quantization_config.qpass_weight 'none' (activation-only, W16A4) is served "
                                        "by the vLLM plugin only; the SGLang plugin serves NVFP4 weights")
            if getattr(self, "packed_modules_mapping", None) is None:
                self.packed_modules_mapping = {}  # SGLang's is_layer_skipped crashes on None

        def __repr__(self) -> str:
            return f"QpassNvfp4Config({self.options})"

        @classmethod
        def get_name(cls) -> str:
            return METHOD_NAME

        @classmethod
        def get_supported_act_dtypes(cls) -> list[torch.dtype]:
            return [torch.bfloat16, torch.float16]

        @classmethod
        def get_min_capability(cls) -> int:
            return 80  # the reference op runs anywhere; qpass's Triton kernels target sm_90

        @staticmethod
        def get_config_filenames() -> list[str]:
            return ["hf_quant_config.json"]

        @classmethod
        def from_config(cls, config: dict[str, Any]) -> "QpassNvfp4Config":
            return cls(QpassQuantOptions.from_config(config))

        @classmethod
        def override_quantization_method(cls, hf_quant_cfg: Any, user_quant: Any) -> str | None:
            q = (hf_quant_cfg or {}).get("quantization", hf_quant_cfg or {})
            producer = ((hf_quant_cfg or {}).get("producer") or {}).get("name")
            if q.get("quant_method") == METHOD_NAME or (producer == "qpass" and user_quant in (None, METHOD_NAME)):
                return METHOD_NAME
            return None

        def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Any:
            if isinstance(layer, linear_base):
                if self.options.is_excluded(prefix, self.packed_modules_mapping):
                    return unquantized_method()
                return linear(self, prefix)
            return None

        def get_scaled_act_names(self) -> list[str]:
            return []

    return QpassNvfp4Config


@functools.lru_cache(maxsize=1)
def plugin_classes() -> tuple[type, type]:
    """``(QpassNvfp4Config, QpassNvfp4LinearMethod)`` subclassing SGLang's bases.

    Raises:
        ImportError: SGLang is not installed.
    """
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.parameter import ModelWeightParameter, PerTensorScaleParameter
    from sglang.srt.layers.quantization.base_config import LinearMethodBase, QuantizationConfig
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    from qpass import ops as _ops  # noqa: F401 - registers torch.ops.qpass.nvfp4_linear

    param_classes = {"ModelWeightParameter": ModelWeightParameter, "PerTensorScaleParameter": PerTensorScaleParameter}
    linear = _linear_method_class(LinearMethodBase, param_classes)
    return _config_class(QuantizationConfig, LinearBase, UnquantizedLinearMethod, linear), linear


def _tp_group(layer: torch.nn.Module) -> object | None:
    """The torch.distributed group of the layer's tensor-parallel ranks (None when TP = 1)."""
    for attr in ("tp_group", "tp_process_group"):
        g = getattr(layer, attr, None)
        if g is not None:
            return getattr(g, "device_group", g)
    from sglang.srt.distributed import get_tp_group

    return get_tp_group().device_group


__all__ = ["NVFP4_BLOCK", "activation_for_row_parallel", "begin_loading", "finish_loading", "plugin_classes", "sglang_available"]
