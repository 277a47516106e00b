"""The vLLM classes of the ``qpass_nvfp4`` quantization method (built on first use: importing qpass
never needs vLLM).

* ``QpassNvfp4Config(QuantizationConfig)`` (vLLM name ``qpass_nvfp4``, selected by
  ``config.json["quantization_config"]["quant_method"]``): wraps
  :class:`qpass.checkpoint.qconfig.QpassQuantOptions`; ``get_quant_method`` returns
  ``QpassNvfp4LinearMethod`` for quantized linear layers and vLLM's ``UnquantizedLinearMethod`` for
  excluded ones (lm_head, embeddings, routers); with ``qpass_weight: "none"`` (activation-only
  checkpoints, the W16A4 rollout) ``QpassNvfp4ActLinearMethod`` for every non-excluded linear.
* ``QpassNvfp4LinearMethod(LinearMethodBase)`` (registered for vLLM's v2 weight loaders):

  - ``create_weights``: the parameters of :func:`qpass.checkpoint.params.linear_param_specs` (the
    table the SGLang plugin uses) as vLLM ``ModelWeightParameter`` / ``PerTensorScaleParameter``,
    so ``qpass``/``modelopt`` checkpoints load through vLLM's own fused-shard loaders (q/k/v ->
    ``qkv_proj``, gate/up -> ``gate_up_proj``, one ``weight_scale_2`` slot per shard). Each
    parameter's loader is wrapped (:func:`qpass.checkpoint.validate.checked_loader`, shared with the
    SGLang plugin): a checkpoint tensor of the wrong dtype or shape is refused naming the layer, and
    every (parameter, shard) loaded is recorded;
  - ``process_weights_after_loading``: refuses a parameter shard that was not loaded in this
    (re)load (:func:`qpass.checkpoint.validate.check_all_loaded`; vLLM's in-place reload re-allocates
    parameters uninitialised, so the NaN sentinel alone cannot see it), then
    :func:`qpass.checkpoint.linear.finish_loading` (the scale-byte checks of
    :mod:`qpass.checkpoint.validate`) binds ``qpass_s_dec`` and, on CPU, the decoded
    operand ``qpass_w_b`` (``B_W``, SPEC §3.1) as persistent buffers (vLLM's reload copies them back in place);
  - ``apply``: :func:`qpass.checkpoint.linear.served_linear` — qpass's ops (W4A16, W4A4 per
    tensor / per token, RAC), the reference functions on CPU, ``torch.ops.qpass.nvfp4_linear`` with
    the Triton kernels on CUDA when qpass's Triton backend is installed. A row-parallel layer with
    TP > 1 all-reduces the activation amax (MAX) over vLLM's TP group first, like the SGLang plugin.

* ``QpassNvfp4ActLinearMethod(LinearMethodBase)`` (activation-only sites): ``create_weights`` builds
  the unquantized ``weight`` ``[N, K]`` in the model dtype from
  :func:`qpass.checkpoint.params.act_only_param_specs` as a ``ModelWeightParameter`` (what vLLM's
  ``UnquantizedLinearMethod`` creates, so vLLM's own v2 loaders fill it, fused q/k/v and gate/up
  shards included; the loader is wrapped as above); ``process_weights_after_loading`` refuses a shard
  not loaded in this (re)load and a non-finite weight, and keeps the weight as it is (vLLM-CPU's
  unquantized method would repack it into a oneDNN handle and drop ``weight``: no read-back, other
  GEMM numerics); ``apply`` = :func:`qpass.checkpoint.linear.served_act_linear`
  (``F.linear(qpass::nvfp4_act_qdq(x), W)``: the ops of qpass's ``act_qdq`` rollout graph).

Source: vllm-cpu 0.32.0 (``vllm/model_executor/layers/quantization/base_config.py``,
``layers/linear.py`` ``weight_loader_v2``, ``parameter.py``, ``model_loader/reload/layerwise.py``);
docs/engines/vllm_cpu_prototype.md §3-5.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from qpass.checkpoint.linear import finish_act_only_loading, finish_loading, served_act_linear, served_linear
from qpass.checkpoint.method import (
    LinearMethodFields,
    engine_importable,
    register_linear_params,
    register_plugin,
    row_parallel_rac_error,
    set_layer_sizes,
)
from qpass.checkpoint.params import act_only_param_specs, linear_param_specs, make_tensor
from qpass.checkpoint.qconfig import METHOD_NAME, QpassQuantOptions
from qpass.checkpoint.validate import ACT_ONLY_CHECKED, CHECKED, check_all_loaded, init_load_record
from qpass.errors import QuantizationError

log = logging.getLogger(__name__)


def _checked_moe_loader(layer: torch.nn.Module, name: str, loader: Any) -> Any:
    """Wrap vLLM's FusedMoE weight loader: refuse a checkpoint tensor of the wrong dtype (naming the
    layer, expert and shard), and record ``(name, expert, shard)`` in ``layer.qpass_loaded`` when
    the loader reports success."""

    @functools.wraps(loader)
    def qpass_checked_moe_loader(param: torch.Tensor, loaded_weight: torch.Tensor, weight_name: str = "", shard_id: str = "",
                                 expert_id: int = 0, return_success: bool = False) -> Any:
        if loaded_weight.dtype != param.dtype and not name.endswith("_input_scale"):
            raise QuantizationError(f"{METHOD_NAME}: MoE layer {layer.qpass_site}, expert {expert_id}: checkpoint tensor {weight_name} "
                                    f"(shard {shard_id}) has dtype {loaded_weight.dtype}, expected {param.dtype}")
        if name.endswith("_input_scale"):
            loaded_weight = loaded_weight.to(param.dtype)
        ok = loader(param=param, loaded_weight=loaded_weight, weight_name=weight_name, shard_id=shard_id, expert_id=expert_id,
                    return_success=True)
        if ok:
            layer.qpass_loaded.add((name, int(expert_id), str(shard_id)))
        return ok if return_success else None

    return qpass_checked_moe_loader


def _vllm_bases() -> Any:
    """The vLLM classes the plugin subclasses or builds (imported on first use).

    Raises:
        ImportError: vLLM is not installed.
    """
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.fused_moe.routed_experts import FusedMoeWeightScaleSupported
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod, register_weight_loader_v2_supported_method
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
    from vllm.model_executor.parameter import ModelWeightParameter, PerTensorScaleParameter

    return SimpleNamespace(
        RoutedExperts=RoutedExperts, FusedMoEMethodBase=FusedMoEMethodBase, FusedMoeWeightScaleSupported=FusedMoeWeightScaleSupported,
        UnquantizedFusedMoEMethod=UnquantizedFusedMoEMethod, LinearBase=LinearBase, LinearMethodBase=LinearMethodBase,
        UnquantizedLinearMethod=UnquantizedLinearMethod, register_v2=register_weight_loader_v2_supported_method,
        QuantizationConfig=QuantizationConfig,
        param_classes={"ModelWeightParameter": ModelWeightParameter, "PerTensorScaleParameter": PerTensorScaleParameter},
    )


def _tp_device_group() -> Any:
    """vLLM's tensor-parallel device group (a row-parallel layer all-reduces its activation amax over it)."""
    from vllm.distributed import get_tp_group

    return get_tp_group().device_group


def _linear_method_class(v: Any) -> type:
    """``QpassNvfp4LinearMethod`` (module docstring) on vLLM's bases ``v`` (:func:`_vllm_bases`)."""

    @v.register_v2
    class QpassNvfp4LinearMethod(LinearMethodFields, v.LinearMethodBase):
        """qpass NVFP4 linear for vLLM (module docstring)."""

        def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                           input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
            init_load_record(layer, self.prefix, output_partition_sizes, k_sharded=input_size_per_partition != input_size)
            if layer.qpass_k_sharded and self.rac is not None and self.act != "none":
                raise row_parallel_rac_error(self.prefix, input_size, input_size_per_partition, QuantizationError)
            register_linear_params(layer, linear_param_specs(input_size_per_partition, output_partition_sizes, prefix=self.prefix),
                                   v.param_classes, extra_weight_attrs.get("weight_loader"))
            set_layer_sizes(layer, params_dtype, input_size_per_partition, output_partition_sizes)

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            check_all_loaded(layer, self.prefix)
            finish_loading(layer, self.prefix, persistent=True, decode_cache=layer.weight.device.type == "cpu")

        def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            group = _tp_device_group() if self.act != "none" and layer.qpass_k_sharded else None
            if x.device.type == "cuda" and _triton_ready():
                from qpass.ops import use_kernels

                with use_kernels("triton"):
                    return served_linear(layer, x, bias, site=self.prefix, act=self.act, rac=self.rac, process_group=group)
            return served_linear(layer, x, bias, site=self.prefix, act=self.act, rac=self.rac, process_group=group)

    return QpassNvfp4LinearMethod


def _act_method_class(v: Any) -> type:
    """``QpassNvfp4ActLinearMethod`` (activation-only sites, module docstring) on vLLM's bases ``v``."""

    @v.register_v2
    class QpassNvfp4ActLinearMethod(LinearMethodFields, v.LinearMethodBase):
        """qpass activation-only linear (W16A4) for vLLM (module docstring)."""

        uses_rac = False

        def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                           input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
            init_load_record(layer, self.prefix, output_partition_sizes, k_sharded=input_size_per_partition != input_size)
            layer.qpass_act_only = True
            register_linear_params(layer, act_only_param_specs(input_size_per_partition, output_partition_sizes, params_dtype,
                                                               prefix=self.prefix),
                                   v.param_classes, extra_weight_attrs.get("weight_loader"))
            set_layer_sizes(layer, params_dtype, input_size_per_partition, output_partition_sizes)

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            check_all_loaded(layer, self.prefix, ACT_ONLY_CHECKED)
            finish_act_only_loading(layer, self.prefix)

        def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            group = _tp_device_group() if layer.qpass_k_sharded else None
            return served_act_linear(layer, x, bias, site=self.prefix, act=self.act, process_group=group)

    return QpassNvfp4ActLinearMethod


def _expert_racs(options: QpassQuantOptions, prefix: str, num_experts: int, ckpt_names: dict[str, str]) -> tuple[list[Any], list[Any]]:
    """Per-expert RAC of the fused gate/up input (``rac13``) and of ``down`` (``rac2``); None where off.

    Raises:
        QuantizationError: an expert's gate and up have different RAC settings (they share one input).
    """
    rac = options.rac
    rac13, rac2 = [], []
    for e in range(num_experts):
        g, u = rac.get(f"{prefix}.{e}.{ckpt_names['w1']}"), rac.get(f"{prefix}.{e}.{ckpt_names['w3']}")
        if g != u:
            raise QuantizationError(f"{METHOD_NAME}: MoE layer {prefix}, expert {e}: gate and up have different RAC "
                                    f"settings ({g} vs {u}); they share one input")
        rac13.append(g if g is not None and g.ratio > 0 else None)
        r2 = rac.get(f"{prefix}.{e}.{ckpt_names['w2']}")
        rac2.append(r2 if r2 is not None and r2.ratio > 0 else None)
    return rac13, rac2


def _moe_method_class(v: Any) -> type:
    """``QpassNvfp4FusedMoEMethod`` (routed experts, :mod:`qpass.checkpoint.moe_layer`) on vLLM's bases ``v``."""

    class QpassNvfp4FusedMoEMethod(v.FusedMoEMethodBase):
        """qpass NVFP4 routed experts for vLLM (:mod:`qpass.checkpoint.moe_layer`; module docstring)."""

        def __init__(self, quant_config: "QpassNvfp4Config", layer: torch.nn.Module, prefix: str) -> None:
            super().__init__(layer.moe_config)
            self.quant_config = quant_config
            self.prefix = prefix
            self.act = quant_config.options.act
            self.ckpt_names = {"w1": layer.ckpt_gate_proj_name, "w3": layer.ckpt_up_proj_name, "w2": layer.ckpt_down_proj_name}
            self.rac13, self.rac2 = _expert_racs(quant_config.options, prefix, int(layer.moe_config.num_experts), self.ckpt_names)

        @property
        def is_monolithic(self) -> bool:
            return False

        def uses_weight_scale_2_pattern(self) -> bool:
            return True

        def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                           params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
            from vllm.model_executor.utils import set_weight_attrs

            from qpass.checkpoint.moe_layer import moe_param_specs

            if int(getattr(layer.moe_config, "tp_size", 1) or 1) > 1 or getattr(layer.moe_config, "use_ep", False):
                raise QuantizationError(f"{METHOD_NAME}: MoE layer {self.prefix}: tensor/expert parallel MoE is not supported "
                                        "(RAC ranks channels over the whole K); serve with TP=1")
            if num_experts != self.moe.num_experts:
                raise QuantizationError(f"{METHOD_NAME}: MoE layer {self.prefix}: {num_experts} local of {self.moe.num_experts} experts")
            weight_loader = extra_weight_attrs.get("weight_loader")
            layer.qpass_site = self.prefix
            layer.qpass_loaded = set()
            layer.qpass_ckpt_names = dict(self.ckpt_names)
            layer.num_experts = num_experts
            layer.params_dtype = params_dtype
            for p in moe_param_specs(num_experts, hidden_size, intermediate_size_per_partition, prefix=self.prefix):
                param = torch.nn.Parameter(make_tensor(p), requires_grad=False)
                layer.register_parameter(p.name, param)
                kind = (v.FusedMoeWeightScaleSupported.TENSOR if p.name.endswith(("_scale_2", "_input_scale"))
                        else v.FusedMoeWeightScaleSupported.BLOCK)
                set_weight_attrs(param, {**extra_weight_attrs, "quant_method": kind.value,
                                         "weight_loader": _checked_moe_loader(layer, p.name, weight_loader)})

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            from qpass.checkpoint.moe_layer import check_moe_loaded, finish_moe_loading

            got = set(layer.qpass_loaded)
            layer.qpass_loaded.clear()
            check_moe_loaded(got, layer.w13_weight.shape[0], self.prefix, self.ckpt_names)
            finish_moe_loading(layer, self.prefix, decode_cache=layer.w13_weight.device.type == "cpu")

        def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> Any:
            return None  # apply() never reaches vLLM's modular kernels

        def apply(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  shared_experts: Any = None, shared_experts_input: torch.Tensor | None = None) -> torch.Tensor:
            from qpass.checkpoint.moe_layer import served_moe

            if shared_experts is not None:
                raise QuantizationError(f"{METHOD_NAME}: MoE layer {self.prefix}: shared experts are not supported")
            if getattr(layer, "apply_router_weight_on_input", False):
                raise QuantizationError(f"{METHOD_NAME}: MoE layer {self.prefix}: apply_router_weight_on_input is not supported")
            act = getattr(layer.activation, "value", str(layer.activation))
            act = "silu" if act in ("silu", "silu_and_mul") else act
            return served_moe(layer, x, topk_weights, topk_ids, act=self.act, rac13=self.rac13, rac2=self.rac2, site=self.prefix,
                              activation=act)

    return QpassNvfp4FusedMoEMethod


def _config_class(v: Any, linear: type, act_only: type, moe: type) -> type:
    """``QpassNvfp4Config`` on vLLM's bases ``v``; ``get_quant_method`` hands out ``linear``,
    ``act_only`` (``qpass_weight: "none"``) or ``moe`` methods, vLLM's unquantized ones for excluded layers."""

    class QpassNvfp4Config(v.QuantizationConfig):
        """``quant_method: qpass_nvfp4`` in a checkpoint's ``quantization_config``."""

        def __init__(self, options: QpassQuantOptions | None = None) -> None:
            super().__init__()
            self.options = options or QpassQuantOptions()

        def __repr__(self) -> str:
            return f"QpassNvfp4Config({self.options})"

        def get_name(self) -> str:
            return METHOD_NAME

        def get_supported_act_dtypes(self) -> list[torch.dtype]:
            return [torch.bfloat16, torch.float16, torch.float32]

        @classmethod
        def get_min_capability(cls) -> int:
            return 70  # the reference op runs anywhere; qpass's Triton kernels target sm_90

        @staticmethod
        def get_config_filenames() -> list[str]:
            return []

        @classmethod
        def from_config(cls, config: dict[str, Any]) -> "QpassNvfp4Config":
            return cls(QpassQuantOptions.from_config(config))

        def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Any:
            if isinstance(layer, v.LinearBase):
                if self.options.is_excluded(prefix, self.packed_modules_mapping):
                    return v.UnquantizedLinearMethod()
                if self.options.weight == "none":
                    return act_only(self, prefix)
                return linear(self, prefix)
            if isinstance(layer, v.RoutedExperts):
                names = [f"{prefix}.0.{n}" for n in (layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name)]
                flags = [self.options.is_excluded(n) for n in names]
                if all(flags):
                    return v.UnquantizedFusedMoEMethod(layer.moe_config)
                if self.options.weight == "none":
                    raise QuantizationError(f"{METHOD_NAME}: MoE layer {prefix}: qpass_weight 'none' (activation-only) has no "
                                            "FusedMoE method; exclude the experts or quantize their weights")
                if any(flags):
                    raise QuantizationError(f"{METHOD_NAME}: MoE layer {prefix}: some expert projections excluded and some "
                                            f"quantized ({names}); FusedMoE holds one format")
                return moe(self, layer, prefix)
            return None

    return QpassNvfp4Config


@functools.lru_cache(maxsize=1)
def plugin_classes() -> tuple[type, type]:
    """``(QpassNvfp4Config, QpassNvfp4LinearMethod)`` subclassing vLLM's bases.

    Raises:
        ImportError: vLLM is not installed.
    """
    v = _vllm_bases()
    linear, act_only, moe = _linear_method_class(v), _act_method_class(v), _moe_method_class(v)
    config = _config_class(v, linear, act_only, moe)
    # Picklable by reference: vLLM's engine core runs in a spawned process (the default outside
    # ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and pickles the config; the child resolves
    # ``qpass.backends.vllm.plugin.QpassNvfp4Config`` through the module ``__getattr__`` below.
    for c in (config, linear, moe, act_only):
        c.__module__, c.__qualname__ = __name__, c.__name__
    _MOE_CLASS.append(moe)
    _ACT_CLASS.append(act_only)
    return config, linear


_MOE_CLASS: list[type] = []
_ACT_CLASS: list[type] = []


def act_method_class() -> type:
    """``QpassNvfp4ActLinearMethod`` (activation-only linears; builds the classes on first use)."""
    plugin_classes()
    return _ACT_CLASS[0]


def moe_method_class() -> type:
    """``QpassNvfp4FusedMoEMethod`` (vLLM's ``FusedMoEMethodBase`` subclass; builds the classes on first use)."""
    plugin_classes()
    return _MOE_CLASS[0]


def __getattr__(name: str) -> type:
    """``QpassNvfp4Config`` / ``QpassNvfp4LinearMethod`` as module attributes (built on first access:
    vLLM is imported only then), so pickle can find the classes by name.

    Raises:
        AttributeError: any other name.
    """
    if name == "QpassNvfp4FusedMoEMethod":
        return moe_method_class()
    if name == "QpassNvfp4ActLinearMethod":
        return act_method_class()
    if name in ("QpassNvfp4Config", "QpassNvfp4LinearMethod"):
        cfg, method = plugin_classes()
        return cfg if name == "QpassNvfp4Config" else method
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def vllm_available() -> bool:
    """True if vLLM's quantization base classes import here."""
    return engine_importable("vllm.model_executor.layers.quantization.base_config")


def register() -> bool:
    """Register ``qpass_nvfp4`` with vLLM (entry-point target; idempotent; never raises).

    Returns:
        True if registered, False if vLLM is not installed or registration failed (logged).
    """
    return register_plugin("vLLM", vllm_available, _install, log)


def _install() -> None:
    from vllm.model_executor.layers.quantization import register_quantization_config

    cfg_cls, _ = plugin_classes()
    register_quantization_config(METHOD_NAME)(cfg_cls)


@functools.lru_cache(maxsize=1)
def _triton_ready() -> bool:
    """qpass's Triton kernels are importable here (registers them once)."""
    from qpass.backends.catalog import TRITON

    if not TRITON.available():
        return False
    TRITON.register()
    return True


__all__ = ["ACT_ONLY_CHECKED", "CHECKED", "act_method_class", "check_all_loaded", "moe_method_class", "plugin_classes", "register", "vllm_available"]
