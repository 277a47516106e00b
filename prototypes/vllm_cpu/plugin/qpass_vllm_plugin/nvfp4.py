"""`qpass_nvfp4` quantization method for vLLM: NVFP4 weights (ModelOpt tensor naming),
W4A16 compute (decode to bf16 per SPEC §3, matmul in fp32).

Checkpoint tensors per quantized linear site (HF names, unfused: q_proj, k_proj, ...):
  <site>.weight          uint8 [N, K/2]    packed E2M1, low nibble = even k
  <site>.weight_scale    float8_e4m3fn [N, K/16]  block scales (linear layout)
  <site>.weight_scale_2  float32 []        S_dec (decode multiplier, ModelOpt naming)
  <site>.weight_global_scale float32 []    S_enc (optional, config "store_s_enc": true)

vLLM fuses q/k/v -> qkv_proj and gate/up -> gate_up_proj; the per-shard scalars land in a
PerTensorScaleParameter of shape [num_shards] (one slot per shard, kept as loaded).
"""
from __future__ import annotations

import fnmatch
import os
from typing import Any

import torch
from torch.nn import Parameter

from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.parameter import ModelWeightParameter, PerTensorScaleParameter

GROUP = 16
# E2M1 code -> value; bit 3 is the sign (0x8 is -0.0).
_E2M1_LUT = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)


# byte -> (value of low nibble, value of high nibble): one gather decodes two elements.
_BYTE_LUT = torch.stack((_E2M1_LUT[torch.arange(256) & 0x0F], _E2M1_LUT[torch.arange(256) >> 4]), -1)


def unpack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> float32 [N, K]; byte j holds k=2j (low nibble) and k=2j+1 (high)."""
    lut = _BYTE_LUT.to(codes.device)
    return lut[codes.long()].reshape(codes.shape[0], codes.shape[1] * 2)


def dequant_nvfp4(codes, scales_e4m3, s_dec_rows) -> torch.Tensor:
    """SPEC §3: w_hat = to_bf16_rne( fl( fl(e2m1(q) * float(s_b)) * S_dec ) ).

    s_dec_rows: float32 [N, 1] (per output row; fused layers carry one S_dec per shard).
    Returns bf16 [N, K]. Each op is a separately rounded fp32 op (no FMA in eager torch).
    """
    N, K = codes.shape[0], codes.shape[1] * 2
    v = unpack_e2m1(codes).view(N, K // GROUP, GROUP)                 # fp32
    s = scales_e4m3.to(torch.float32).unsqueeze(-1)                   # [N, K/16, 1]
    return ((v * s) * s_dec_rows.view(-1, 1, 1)).to(torch.bfloat16).view(N, K)


@register_quantization_config("qpass_nvfp4")
class QpassNvfp4Config(QuantizationConfig):
    def __init__(self, group_size: int = 16, ignore: list[str] | None = None,
                 store_s_enc: bool = False, cache: str = "float32") -> None:
        super().__init__()
        if group_size != GROUP:
            raise ValueError(f"qpass_nvfp4: group_size must be 16, got {group_size}")
        self.group_size = group_size
        self.ignore = list(ignore or [])
        self.store_s_enc = bool(store_s_enc)
        # cache: "float32" | "bfloat16" | "none" (decode on every forward).
        self.cache = os.environ.get("QPASS_VLLM_CACHE", cache)

    def get_name(self) -> str:
        return "qpass_nvfp4"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # read from config.json "quantization_config"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "QpassNvfp4Config":
        return cls(
            group_size=int(config.get("group_size", 16)),
            ignore=config.get("ignore", []),
            store_s_enc=bool(config.get("store_s_enc", False)),
            cache=str(config.get("cache", "float32")),
        )

    def _ignored(self, prefix: str) -> bool:
        return any(fnmatch.fnmatch(prefix, pat) or prefix == pat for pat in self.ignore)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, LinearBase):
            if self._ignored(prefix):
                return UnquantizedLinearMethod()
            return QpassNvfp4LinearMethod(self)
        return None  # embeddings, lm_head (ParallelLMHead), attention: unquantized


@register_weight_loader_v2_supported_method
class QpassNvfp4LinearMethod(LinearMethodBase):
    """W4A16: weights stay NVFP4 bytes; apply() uses the SPEC §3 bf16 dequant + fp32 matmul."""

    def __init__(self, cfg: QpassNvfp4Config) -> None:
        self.cfg = cfg

    def create_weights(self, layer, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        del input_size, output_size, params_dtype
        K = input_size_per_partition
        N = sum(output_partition_sizes)
        if K % GROUP:
            raise ValueError(f"qpass_nvfp4: K={K} not a multiple of {GROUP}")
        wl = extra_weight_attrs.get("weight_loader")
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition = K
        layer.output_size_per_partition = N
        layer.register_parameter("weight", ModelWeightParameter(
            data=torch.empty(N, K // 2, dtype=torch.uint8),
            input_dim=1, output_dim=0, weight_loader=wl))
        ws = ModelWeightParameter(
            data=torch.empty(N, K // GROUP, dtype=torch.float8_e4m3fn),
            input_dim=1, output_dim=0, weight_loader=wl)
        ws.data.fill_(float("nan"))  # sentinel: detect a never-loaded scale
        layer.register_parameter("weight_scale", ws)
        s2 = PerTensorScaleParameter(
            data=torch.full((len(output_partition_sizes),), float("nan"), dtype=torch.float32),
            weight_loader=wl)
        layer.register_parameter("weight_scale_2", s2)
        if self.cfg.store_s_enc:
            layer.register_parameter("weight_global_scale", PerTensorScaleParameter(
                data=torch.full((len(output_partition_sizes),), float("nan"),
                                dtype=torch.float32), weight_loader=wl))

    def _row_s_dec(self, layer) -> torch.Tensor:
        s2 = layer.weight_scale_2.detach().to(torch.float32)
        widths = torch.tensor(layer.logical_widths, device=s2.device)
        return torch.repeat_interleave(s2, widths).unsqueeze(1)  # [N, 1]

    def process_weights_after_loading(self, layer) -> None:
        name = getattr(layer, "prefix", repr(type(layer)))
        if torch.isnan(layer.weight_scale.to(torch.float32)).any():
            raise RuntimeError(f"qpass_nvfp4: weight_scale of {name} was never loaded")
        if torch.isnan(layer.weight_scale_2).any():
            raise RuntimeError(f"qpass_nvfp4: weight_scale_2 of {name} was never loaded")
        if self.cfg.store_s_enc:
            s_enc = layer.weight_global_scale.detach()
            if not torch.equal(torch.reciprocal(s_enc), layer.weight_scale_2.detach()):
                raise RuntimeError(f"qpass_nvfp4: {name}: weight_scale_2 != fl(1/S_enc)")
        if self.cfg.cache != "none":
            dt = torch.float32 if self.cfg.cache == "float32" else torch.bfloat16
            w = dequant_nvfp4(layer.weight.detach(), layer.weight_scale.detach(),
                              self._row_s_dec(layer)).to(dt)
            # Persistent buffer on purpose: vLLM's in-place reload
            # (model_loader/reload/layerwise.py _copy_and_restore_kernel_tensors) skips
            # non-persistent buffers, which would leave a stale decode after reload_weights.
            layer.register_buffer("qpass_w_dec", w, persistent=True)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        w = getattr(layer, "qpass_w_dec", None)
        if w is None:
            w = dequant_nvfp4(layer.weight, layer.weight_scale, self._row_s_dec(layer))
        y = torch.nn.functional.linear(x.to(torch.float32), w.to(torch.float32),
                                       None if bias is None else bias.to(torch.float32))
        return y.to(x.dtype)
