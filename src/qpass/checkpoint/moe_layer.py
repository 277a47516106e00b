"""What an engine's ``qpass_nvfp4`` FusedMoE method does, engine-free: the fused expert parameters, the
checks after loading, and the forward with qpass's per-expert numerics.

The vLLM plugin (:mod:`qpass.backends.vllm.plugin`, ``QpassNvfp4FusedMoEMethod``) registers the
parameters of :func:`moe_param_specs` on vLLM's ``RoutedExperts`` layer (ModelOpt's FusedMoE names,
the layout of :mod:`qpass.moe.export`), lets vLLM's FusedMoE weight loader put every checkpoint
expert's gate (``w1``), up (``w3``) and down (``w2``) tensors in place, then calls
:func:`finish_moe_loading` and, per forward, :func:`served_moe`:

=======================  ==============  ==================  =============================================
parameter                dtype           shape               meaning
=======================  ==============  ==================  =============================================
``w13_weight``           uint8           ``[E, 2I, H/2]``    rows ``[0, I)`` gate (w1), ``[I, 2I)`` up (w3)
``w13_weight_scale``     float8_e4m3fn   ``[E, 2I, H/16]``   E4M3 block scales (NaN sentinel until loaded)
``w13_weight_scale_2``   float32         ``[E, 2]``          ``S_dec`` of gate, up (must be bit-identical)
``w2_weight``            uint8           ``[E, H, I/2]``     down
``w2_weight_scale``      float8_e4m3fn   ``[E, H, I/16]``
``w2_weight_scale_2``    float32         ``[E]``
``w13_input_scale``      float32         ``[E]``             accepted (ModelOpt/qpass export), never read
``w2_input_scale``       float32         ``[E]``             accepted, never read
=======================  ==============  ==================  =============================================

The forward is :class:`qpass.moe.experts.SiteExperts`' (what qpass's rollout graph computes with
every expert linear lowered to ``qpass::nvfp4_linear``): for expert ``e`` in increasing order, its
routed tokens ``torch.where(topk_ids == e)`` (token-major), ``y = down(silu(gate(x)) * up(x)) * w``
accumulated with ``index_add_`` into zeros of the activation dtype; each of gate, up and down is
:func:`qpass.checkpoint.linear.served_linear` on *that expert's tokens* — the dynamic NVFP4
activation global scale and RAC's channel ranking are per expert, as in the rollout op (W4A16 when
the checkpoint's ``qpass_act`` is ``none``); float32 accumulation, one rounding to the activation
dtype per linear.
"""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence

import torch

from qpass.checkpoint.linear import bind_buffer, finish_loading, served_linear
from qpass.checkpoint.params import NVFP4_BLOCK, ParamSpec
from qpass.checkpoint.qconfig import METHOD_NAME
from qpass.errors import QuantizationError
from qpass.quant.rac import RACConfig

__all__ = ["MOE_CHECKED", "check_moe_loaded", "finish_moe_loading", "moe_param_specs", "served_moe"]

# (parameter, shard ids) that every (re)load must write for every expert
MOE_CHECKED: dict[str, tuple[str, ...]] = {
    "w13_weight": ("w1", "w3"), "w13_weight_scale": ("w1", "w3"), "w13_weight_scale_2": ("w1", "w3"),
    "w2_weight": ("w2",), "w2_weight_scale": ("w2",), "w2_weight_scale_2": ("w2",),
}
ROLE = {"w1": "gate", "w3": "up", "w2": "down"}


def moe_param_specs(num_experts: int, hidden: int, inter: int, *, prefix: str = "") -> list[ParamSpec]:
    """The fused NVFP4 expert parameters of one MoE layer (module table).

    ``ParamSpec.kind`` is the vLLM parameter class; ``input_dim``/``output_dim`` are not used by the
    FusedMoE loader (it shards by shard id).

    Raises:
        QuantizationError: ``hidden`` or ``inter`` not a multiple of 16 (naming ``prefix``).
    """
    e, h, i = int(num_experts), int(hidden), int(inter)
    if h % NVFP4_BLOCK or i % NVFP4_BLOCK:
        raise QuantizationError(f"NVFP4 MoE layer {prefix or '<unnamed>'}: hidden {h} and intermediate {i} per partition "
                                "must be multiples of 16 (whole 1x16 blocks)")
    return [
        ParamSpec("w13_weight", "ModelWeightParameter", torch.uint8, (e, 2 * i, h // 2), 1, 2),
        ParamSpec("w13_weight_scale", "ModelWeightParameter", torch.float8_e4m3fn, (e, 2 * i, h // NVFP4_BLOCK), 1, 2, "unloaded"),
        ParamSpec("w13_weight_scale_2", "PerTensorScaleParameter", torch.float32, (e, 2), None, None, "unloaded"),
        ParamSpec("w2_weight", "ModelWeightParameter", torch.uint8, (e, h, i // 2), 1, 2),
        ParamSpec("w2_weight_scale", "ModelWeightParameter", torch.float8_e4m3fn, (e, h, i // NVFP4_BLOCK), 1, 2, "unloaded"),
        ParamSpec("w2_weight_scale_2", "PerTensorScaleParameter", torch.float32, (e,), None, None, "unloaded"),
        ParamSpec("w13_input_scale", "PerTensorScaleParameter", torch.float32, (e,), None, None, "ones"),
        ParamSpec("w2_input_scale", "PerTensorScaleParameter", torch.float32, (e,), None, None, "ones"),
    ]


def check_moe_loaded(loaded: set[tuple[str, int, str]], num_experts: int, prefix: str, ckpt_names: Mapping[str, str]) -> None:
    """Every parameter of :data:`MOE_CHECKED` was written for every expert and shard in this (re)load.

    Args:
        loaded: ``(parameter, expert, shard id)`` triples the weight loader recorded.
        ckpt_names: shard id -> checkpoint projection name (``w1`` -> ``gate_proj`` or ``w1``), for messages.
    Raises:
        QuantizationError: names the layer, the expert and the missing checkpoint tensors.
    """
    suffix = {"w13_weight": "weight", "w13_weight_scale": "weight_scale", "w13_weight_scale_2": "weight_scale_2",
              "w2_weight": "weight", "w2_weight_scale": "weight_scale", "w2_weight_scale_2": "weight_scale_2"}
    for e in range(num_experts):
        missing = [f"{prefix}.{e}.{ckpt_names.get(s, s)}.{suffix[p]}" for p, shards in MOE_CHECKED.items() for s in shards
                   if (p, e, s) not in loaded]
        if missing:
            raise QuantizationError(f"{METHOD_NAME}: MoE layer {prefix}, expert {e}: {', '.join(missing)} not loaded (missing from "
                                    "the checkpoint or weight update); refusing to serve")


def _expert_view(codes: torch.Tensor, scales: torch.Tensor, gs: torch.Tensor) -> torch.nn.Module:
    m = torch.nn.Module()
    m.register_buffer("weight", codes, persistent=False)
    m.register_buffer("weight_scale", scales, persistent=False)
    m.register_buffer("weight_scale_2", gs.reshape(-1), persistent=False)
    return m


def finish_moe_loading(layer: torch.nn.Module, prefix: str, *, decode_cache: bool = True) -> None:
    """After loading: check every expert as a dense qpass layer (:func:`qpass.checkpoint.linear.finish_loading`:
    W13 = the fused gate/up group of one expert, W2 alone) and bind the decode globals
    ``layer.qpass_w13_s_dec`` / ``qpass_w2_s_dec`` float32 ``[E]`` and, with ``decode_cache``, the
    GEMM operands ``qpass_w13_w_b`` ``[E, 2I, H]`` / ``qpass_w2_w_b`` ``[E, H, I]`` (``B_W =
    nvfp4_operand(w)``, SPEC §3.1, stored in bf16: exact; the reference op reads it as float32).

    Raises:
        QuantizationError: names the layer and the expert: a scale never loaded or NaN (block or
            global), a non-positive global, or gate and up (w1/w3) of one expert with different
            ``weight_scale_2`` (qpass quantizes them as one group and serves one global; vLLM's
            ModelOpt path would take gate's for both and only warn: vLLM #54974).
    """
    n = layer.w13_weight.shape[0]
    s13, s2, w13, w2 = [], [], [], []
    for e in range(n):
        for name, stem in (("W13 (gate w1 + up w3)", "w13"), ("W2 (down)", "w2")):
            v = _expert_view(getattr(layer, f"{stem}_weight").data[e], getattr(layer, f"{stem}_weight_scale").data[e],
                             getattr(layer, f"{stem}_weight_scale_2").data[e])
            finish_loading(v, f"{prefix} expert {e} {name}", decode_cache=decode_cache)
            (s13 if stem == "w13" else s2).append(v.qpass_s_dec)
            if decode_cache:
                (w13 if stem == "w13" else w2).append(v.qpass_w_b.to(torch.bfloat16))
    _bind(layer, "qpass_w13_s_dec", torch.stack(s13))
    _bind(layer, "qpass_w2_s_dec", torch.stack(s2))
    if decode_cache:
        _bind(layer, "qpass_w13_w_b", torch.stack(w13))
        _bind(layer, "qpass_w2_w_b", torch.stack(w2))


def _bind(layer: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """:func:`qpass.checkpoint.linear.bind_buffer`, persistent: vLLM's layer-wise reload copies only
    persistent buffers back."""
    bind_buffer(layer, name, value, persistent=True)


def _linear(codes: torch.Tensor, scales: torch.Tensor, s_dec: torch.Tensor, b_w: torch.Tensor | None, x: torch.Tensor, *,
            act: str, rac: RACConfig | None, site: str) -> torch.Tensor:
    view = types.SimpleNamespace(weight=codes, weight_scale=scales, qpass_s_dec=s_dec, qpass_k_sharded=False, qpass_w_b=b_w)
    return served_linear(view, x, None, site=site, act=act, rac=rac)


def served_moe(layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, act: str,
               rac13: Sequence[RACConfig | None], rac2: Sequence[RACConfig | None], site: str,
               activation: str = "silu") -> torch.Tensor:
    """The routed-experts forward of a served ``qpass_nvfp4`` MoE layer: ``x [T, H] -> [T, H]`` in ``x.dtype``
    (module docstring). ``topk_ids`` int ``[T, k]`` (global expert ids, no expert parallelism),
    ``topk_weights`` ``[T, k]``; ``rac13[e]`` / ``rac2[e]`` the RAC of expert ``e``'s W13 / W2 input.

    Raises:
        QuantizationError: an activation other than SiLU-and-mul; NaN/inf activations (naming the expert).
    """
    if activation != "silu":
        raise QuantizationError(f"{METHOD_NAME}: MoE layer {site}: activation {activation!r}; qpass serves SiLU-and-mul experts only")
    n, two_i = layer.w13_weight.shape[0], layer.w13_weight.shape[1]
    inter = two_i // 2
    w13h = getattr(layer, "qpass_w13_w_b", None)
    w2h = getattr(layer, "qpass_w2_w_b", None)
    out = torch.zeros_like(x)
    ids = topk_ids.to(torch.int64)
    for e in range(n):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        c13, b13, g13 = layer.w13_weight[e], layer.w13_weight_scale[e], layer.qpass_w13_s_dec[e]
        gate = _linear(c13[:inter], b13[:inter], g13, None if w13h is None else w13h[e, :inter], xe, act=act, rac=rac13[e],
                       site=f"{site}.{e}.w1")
        up = _linear(c13[inter:], b13[inter:], g13, None if w13h is None else w13h[e, inter:], xe, act=act, rac=rac13[e],
                     site=f"{site}.{e}.w3")
        h = torch.nn.functional.silu(gate) * up
        y = _linear(layer.w2_weight[e], layer.w2_weight_scale[e], layer.qpass_w2_s_dec[e], None if w2h is None else w2h[e], h,
                    act=act, rac=rac2[e], site=f"{site}.{e}.w2")
        y = y * topk_weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out
