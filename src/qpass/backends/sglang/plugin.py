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

from qpass.checkpoint.qconfig import METHOD_NAME, QpassQuantOptions
from qpass.checkpoint.linear import activation_for_row_parallel, begin_loading, finish_loading, served_linear
from qpass.checkpoint.params import NVFP4_BLOCK, linear_param_specs, make_tensor
from qpass.checkpoint.validate import check_all_loaded, checked_loader, init_load_record
from qpass.errors import QuantizationError


def sglang_available() -> bool:
    """True if ``sglang`` (its quantization base classes) can be imported."""
    try:
        import sglang.srt.layers.quantization.base_config  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


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

    class QpassNvfp4LinearMethod(LinearMethodBase):
        """qpass NVFP4 linear (see module docstring)."""

        def __init__(self, quant_config: "QpassNvfp4Config", prefix: str = "") -> None:
            self.quant_config = quant_config
            self.prefix = prefix
            self.act = quant_config.options.act
            self.rac = quant_config.options.rac_for(prefix, quant_config.packed_modules_mapping)

        def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                           input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
            weight_loader = extra_weight_attrs.get("weight_loader")
            init_load_record(layer, self.prefix, output_partition_sizes, k_sharded=input_size_per_partition != input_size)
            for p in linear_param_specs(input_size_per_partition, output_partition_sizes, prefix=self.prefix):
                cls = param_classes[p.kind]
                kw: dict[str, Any] = {"data": make_tensor(p), "weight_loader": checked_loader(layer, p.name, weight_loader)}
                if p.kind == "ModelWeightParameter":
                    kw.update(input_dim=p.input_dim, output_dim=p.output_dim)
                param = cls(**kw)
                if p.scalar_to_array:
                    param.needs_scalar_to_array = True
                layer.register_parameter(p.name, param)
            layer.params_dtype = params_dtype
            layer.quant_config = self.quant_config
            layer.input_size_per_partition = input_size_per_partition
            layer.output_size_per_partition = sum(output_partition_sizes)
            if layer.qpass_k_sharded and self.rac is not None:
                raise NotImplementedError(
                    f"{METHOD_NAME}: layer {self.prefix} is row-parallel (K split {input_size} -> {input_size_per_partition}) "
                    "and has residual compensation, whose channel ranking needs the whole K; use TP=1 for it or drop RAC there"
                )

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

    class QpassNvfp4Config(QuantizationConfig):
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
            if isinstance(layer, LinearBase):
                if self.options.is_excluded(prefix, self.packed_modules_mapping):
                    return UnquantizedLinearMethod()
                return QpassNvfp4LinearMethod(self, prefix)
            return None

        def get_scaled_act_names(self) -> list[str]:
            return []

    return QpassNvfp4Config, QpassNvfp4LinearMethod


def _tp_group(layer: torch.nn.Module) -> object | None:
    """The torch.distributed group of the layer's tensor-parallel ranks (None when TP = 1)."""
    for attr in ("tp_group", "tp_process_group"):
        g = getattr(layer, attr, None)
        if g is not None:
            return getattr(g, "device_group", g)
    from sglang.srt.distributed import get_tp_group

    return get_tp_group().device_group


__all__ = ["NVFP4_BLOCK", "activation_for_row_parallel", "begin_loading", "finish_loading", "plugin_classes", "sglang_available"]
