"""What an engine's ``qpass_nvfp4`` linear method does, engine-free: check what was loaded, then compute.

The SGLang and vLLM plugins (:mod:`qpass.backends.sglang`, :mod:`qpass.backends.vllm`) register the
parameters of :func:`qpass.checkpoint.params.linear_param_specs`, let their engine's loaders fill
them, and then call the functions here, so the numerics of a served NVFP4 linear are qpass's and
are testable without any engine installed (``scripts/gpu_vllm_linear.sh`` runs them on CUDA):

* :func:`begin_loading` — a (re)load starts: poison the scales with the NaN "unloaded" sentinel;
* :func:`finish_loading` — after loading: refuse (naming the layer) what
  :mod:`qpass.checkpoint.validate` refuses (a scale never loaded, NaN or negative block scale bytes,
  block scales that do not fit their codes, an invalid global scale, fused shards with different
  globals); bind the decode
  global ``layer.qpass_s_dec`` (and, with ``decode_cache``, the GEMM operand ``layer.qpass_w_b``);
* :func:`served_linear` — the forward: ``torch.ops.qpass.nvfp4_linear`` (qpass's op: the reference
  kernel, or the Triton kernel on CUDA when that backend is selected), or on the reference path the
  same :mod:`qpass.quant.linear` function that op calls, with the layer's ``B_W`` (SPEC §3.1);
* :func:`row_parallel_activation` — the W4A4 activation of a K-sharded (row-parallel) layer quantized
  with its global amax all-reduced (MAX) over the tensor-parallel group (SPEC §3 rule 1);
  :func:`activation_for_row_parallel` its dense fake-quant.

Layer attributes read: ``weight`` uint8 ``[N, K/2]``, ``weight_scale`` float8_e4m3fn ``[N, K/16]``,
``weight_scale_2`` float32 ``[S]`` (per fused shard), optional ``bias``, ``qpass_k_sharded`` (bool),
``rac_channels`` int64 ``[n]`` (static RAC only). Source: SPEC §3 (dequant, shared global per fused
group), prior-art/backends.md §1 (SGLang), docs/engines/vllm_cpu_prototype.md §3-5 (vLLM).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from qpass.checkpoint.params import mark_unloaded
from qpass.checkpoint.validate import check_nvfp4_tensors, layer_holds_whole_group
from qpass.checkpoint.qconfig import METHOD_NAME
from qpass.errors import QuantizationError
from qpass.formats.spec import NVFP4Spec
from qpass.quant.rac import RACConfig

if TYPE_CHECKING:
    from qpass.quant.nvfp4 import NVFP4Tensor

__all__ = ["activation_for_row_parallel", "begin_loading", "finish_act_only_loading", "finish_loading", "row_parallel_activation",
           "served_act_linear", "served_linear"]


def activation_for_row_parallel(x: torch.Tensor, act: NVFP4Spec | str, process_group: object | None, site: str) -> torch.Tensor:
    """The dense fake-quantized activation ``bf16(DQ(Q_A(x)))`` of a K-sharded slice, the global amax
    all-reduced (MAX) over ``process_group``: the slice of the unsharded fake-quant (a dense tensor,
    named so: the served layer multiplies ``B_X`` and applies ``S_dec_X`` in ``alpha`` instead,
    :func:`served_linear`).

    Args:
        x: ``[..., K/tp]`` bf16/fp16/fp32 activation slice.
        act: the activation spec (``NVFP4_ACT``: one global per tensor, ``NVFP4_ACT_PER_TOKEN``: one
            per row) or its mode string (``qpass.formats.spec.NVFP4_ACT_MODES``).
    Returns:
        bf16 for bf16 ``x``; otherwise float32 holding the same bf16 values exactly, saturated to
        the range of ``x.dtype`` (``nvfp4_act_operand``: an fp16 activation at 65504 gives 65280, not
        65536 = inf in fp16).
    """
    from qpass.formats.spec import nvfp4_act_spec_of
    from qpass.quant.nvfp4 import nvfp4_act_operand

    spec = nvfp4_act_spec_of(act, site) if isinstance(act, str) else act
    q = row_parallel_activation(x, spec, process_group, site)
    x_hat = nvfp4_act_operand(q).reshape(x.shape)
    return x_hat if x.dtype == torch.bfloat16 else x_hat.float()


def row_parallel_activation(x: torch.Tensor, act: NVFP4Spec, process_group: object | None, site: str) -> "NVFP4Tensor":
    """``Q_A(x)`` of a K-sharded activation slice ``x [..., K/tp]`` with the global amax all-reduced
    (MAX) over ``process_group`` (SPEC §3 rule 1): its bytes are the slice of the unsharded
    quantization. Returns the :class:`~qpass.quant.nvfp4.NVFP4Tensor` of ``x`` as ``[R, K/tp]`` rows."""
    from qpass.quant.nvfp4 import nvfp4_quantize

    return nvfp4_quantize(x.reshape(-1, x.shape[-1]), spec=act, process_group=process_group, name="activation", site=site)


def begin_loading(layer: torch.nn.Module) -> None:
    """Before a (re)load: poison ``weight_scale`` / ``weight_scale_2`` with the NaN sentinel, so an
    update that carries codes without their scales is refused by :func:`finish_loading` instead of
    serving new codes with stale (or never-written) scales; clears the load record of
    :func:`qpass.checkpoint.validate.checked_loader` (the session's loads are recorded afresh)."""
    mark_unloaded(layer.weight_scale.data)
    mark_unloaded(layer.weight_scale_2.data)
    if isinstance(getattr(layer, "qpass_loaded", None), set):
        layer.qpass_loaded.clear()


def bind_buffer(layer: torch.nn.Module, name: str, value: torch.Tensor, persistent: bool) -> None:
    """``layer.<name> = value`` as a buffer, copied in place when one of that shape already exists
    (keeps the tensor's identity: CUDA graphs, and vLLM's reload copies into the original storage)."""
    cur = getattr(layer, name, None)
    if isinstance(cur, torch.Tensor) and cur.shape == value.shape and cur.dtype == value.dtype and cur.device == value.device:
        with torch.no_grad():
            cur.copy_(value)
        return
    if name in layer._buffers:
        del layer._buffers[name]
    layer.register_buffer(name, value, persistent=persistent)


def finish_loading(layer: torch.nn.Module, prefix: str, *, persistent: bool = False, decode_cache: bool = False) -> None:
    """After loading: check what the layer will serve and bind ``layer.qpass_s_dec`` (idempotent).

    Args:
        layer: holds ``weight``, ``weight_scale``, ``weight_scale_2`` (module docstring).
        prefix: the layer's name in the engine (for messages).
        persistent: register the bound buffers as persistent (vLLM's in-place reload copies only
            persistent buffers back into the served storage).
        decode_cache: also bind ``layer.qpass_w_b`` float32 ``[N, K]`` = ``nvfp4_operand(w)`` (``B_W``,
            SPEC §3.1: the reference path's operand, decoded once per load instead of per forward).
    Raises:
        QuantizationError: names the layer (:func:`qpass.checkpoint.validate.check_nvfp4_tensors`, the
            checks the file readers run too): a scale never loaded (the NaN sentinel survived: the
            checkpoint or update did not carry it), NaN block-scale bytes or bytes with the sign bit,
            codes that do not fit their block scales, block scales that do not fit the global scale
            (a layer holding its whole fused group: TP = 1), a global scale that is not
            finite, not > 0 or above FLT_MAX/2688, or different global scales per fused shard.
    """
    check_nvfp4_tensors(layer.weight.data, layer.weight_scale.data, layer.weight_scale_2.data, f"{METHOD_NAME}: layer {prefix}",
                        whole_group=layer_holds_whole_group(layer))
    from qpass.ops.linear import forget_weight

    forget_weight(layer.weight, layer.weight_scale)  # a loader writing through .data bumps no version
    gs = layer.weight_scale_2.data.detach().float().reshape(-1)
    s_dec = gs[0].reshape(()).clone()
    bind_buffer(layer, "qpass_s_dec", s_dec, persistent)
    if decode_cache:
        from qpass.quant.nvfp4 import NVFP4Tensor, nvfp4_operand

        w = NVFP4Tensor.from_parts(layer.weight.data, layer.weight_scale.data, s_dec)
        bind_buffer(layer, "qpass_w_b", nvfp4_operand(w), persistent)


def served_linear(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None, *, site: str, act: str,
                  rac: RACConfig | None, process_group: object | None = None) -> torch.Tensor:
    """The forward of a served ``qpass_nvfp4`` layer: ``x [..., K] -> [..., N]`` in ``x.dtype``.

    ``act``: an NVFP4 activation mode (``qpass.formats.spec.NVFP4_ACT_MODES``: ``none`` W4A16,
    ``nvfp4`` / ``nvfp4_per_token`` W4A4 with a dynamic activation global scale per tensor / per
    token); ``rac``: residual compensation (any mode and selection; static reads
    ``layer.rac_channels``); ``bias`` ``[N]`` or None (the engine passes it: a row-parallel rank
    other than 0 passes None).

    The layer becomes one typed call (:class:`qpass.ops.calls.NVFP4LinearCall`). If
    :func:`finish_loading` bound ``qpass_w_b`` and the current kernel backend runs the reference ops
    on ``x.device``, the reference kernel runs with that operand (bit-identical to the op);
    otherwise the call goes through ``qpass::nvfp4_linear`` (e.g. the Triton kernel on CUDA).

    A K-sharded layer (``layer.qpass_k_sharded``, W4A4) quantizes its activation slice with the
    amax all-reduced over ``process_group`` (:func:`row_parallel_activation`) and runs the W4A16 call
    on ``B_X`` (exact) with ``alpha = fl(S_dec_X * S_dec_W)`` as the weight's global scale: the
    factored W4A4 product of its slice (SPEC §3.1), summed by the row-parallel all-reduce. Per-token
    scales cannot ride in one ``alpha``: there the slice is ``fl(fl(acc * S_dec_W) * S_dec_X[row])``.

    Raises:
        QuantizationError: unknown ``act``, NaN/inf activations, K mismatch (naming ``site``).
    """
    from qpass.formats.spec import nvfp4_act_spec_of
    from qpass.ops import NVFP4_LINEAR, NVFP4LinearCall, current_backend, effective_backend
    from qpass.quant.nvfp4 import NVFP4Tensor, nvfp4_operand

    try:
        act_spec = nvfp4_act_spec_of(act, f"{METHOD_NAME}: layer {site}")
    except ValueError as exc:
        raise QuantizationError(str(exc)) from None
    out_dtype = x.dtype
    w = NVFP4Tensor.from_parts(layer.weight, layer.weight_scale, layer.qpass_s_dec)
    row_scale = None
    if act_spec is not None and getattr(layer, "qpass_k_sharded", False):
        if rac is not None:
            raise QuantizationError(f"{METHOD_NAME}: layer {site} is row-parallel and has residual compensation, "
                                    "whose channel ranking needs the whole K")
        qa = row_parallel_activation(x, act_spec, process_group, site)
        if act_spec.global_scope == "per_token":
            row_scale = qa.s_dec.reshape(*x.shape[:-1], 1)
        else:
            w = dataclasses.replace(w, s_dec=qa.s_dec.reshape(()) * w.s_dec.float())
        x, act_spec = nvfp4_operand(qa, torch.bfloat16).reshape(x.shape), None
    channels = getattr(layer, "rac_channels", None) if rac is not None and rac.selection == "static" else None
    call = NVFP4LinearCall(x=x, weight=w, bias=bias if row_scale is None else None, act=act_spec,
                           rac=rac if rac is not None and rac.ratio > 0 else None, rac_channels=channels, site=site,
                           out_dtype=out_dtype if row_scale is None else torch.float32)
    b_w = getattr(layer, "qpass_w_b", None)
    if b_w is not None and effective_backend(current_backend(), x.device) == "reference":
        from qpass.quant.linear import nvfp4_linear_reference

        y = nvfp4_linear_reference(call, b_w=b_w)
    else:
        y = NVFP4_LINEAR(call)
    if row_scale is not None:
        y = y.float() * row_scale
        if bias is not None:
            y = y + bias.float()
    return y.to(out_dtype)


def finish_act_only_loading(layer: torch.nn.Module, prefix: str) -> None:
    """After loading an activation-only layer (``qpass_weight: "none"``): the weight it will serve is
    floating ``[N, K]``, ``K % 16 == 0`` and finite (:func:`qpass.checkpoint.params.check_act_only_site`).

    Raises:
        QuantizationError: names the layer.
    """
    from qpass.checkpoint.params import check_act_only_site

    check_act_only_site(f"{METHOD_NAME}: layer {prefix}", layer.weight.data)


def served_act_linear(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None, *, site: str, act: str,
                      process_group: object | None = None) -> torch.Tensor:
    """The forward of a served activation-only layer (W16A4): ``x [..., K] -> [..., N]`` in ``x.dtype``.

    ``F.linear(qpass::nvfp4_act_qdq(x, site, per_token), layer.weight, bias)``: the very ops the
    ``act_qdq`` pass puts in qpass's rollout graph (``aten.linear(nvfp4_act_qdq(x), w)``), so on the
    same ``x`` and weight the output is bit-identical to that graph's at the site. ``layer.weight``:
    ``[N, K]`` in the model dtype (``x.dtype``); ``bias`` ``[N]`` or None.

    ``act``: ``nvfp4`` (one dynamic global scale per tensor) or ``nvfp4_per_token`` (one per row). A
    K-sharded (row-parallel, TP > 1) layer quantizes its slice with the global amax all-reduced (MAX)
    over ``process_group``, which equals the slice of the unsharded QDQ (then summed by the
    row-parallel all-reduce: equal up to float32 summation order).

    Raises:
        QuantizationError: ``act`` is ``none`` (nothing quantized: serve it unquantized), NaN/inf
            activations, K not a multiple of 16 (naming ``site``).
    """
    from qpass.quant import qdq  # noqa: F401 - registers torch.ops.qpass.nvfp4_act_qdq

    from qpass.formats.spec import NVFP4_ACT_MODES

    spec = NVFP4_ACT_MODES.get(act) if isinstance(act, str) else None
    if spec is None:
        quantized = [m for m, s in NVFP4_ACT_MODES.items() if s is not None]
        raise QuantizationError(f"{METHOD_NAME}: activation-only layer {site}: act must be {' or '.join(quantized)}, got {act!r}")
    per_token = spec.global_scope == "per_token"
    if getattr(layer, "qpass_k_sharded", False) and process_group is not None and x.numel():
        from qpass.quant.nvfp4 import nvfp4_dequantize, nvfp4_quantize

        q = nvfp4_quantize(x, spec=spec, process_group=process_group, name="activation", site=site)
        x_q = nvfp4_dequantize(q, x.dtype)
    else:
        x_q = torch.ops.qpass.nvfp4_act_qdq(x, site, per_token)
    return torch.nn.functional.linear(x_q, layer.weight, bias)
