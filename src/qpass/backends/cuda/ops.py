"""The ``cuda`` kernel backend's entry for ``qpass::nvfp4_linear`` (a typed ``NVFP4LinearCall``).

Routes (SPEC §3.1 operands everywhere; a call no route takes returns None and the caller runs the
Triton kernel instead, so the backend never changes what a call computes, only which exact-operand
kernel computes it):

* W4A16, bf16/fp16 activations: ``M <= 32`` rows -> the tensor-core kernel on the NVFP4 bytes
  (:mod:`.linear`); more rows -> cuBLAS on the cached exact ``B_W`` (:mod:`.prefill`).
* W4A4 (per-tensor or per-token dynamic scale), optional RAC in ``masked`` mode with ``batch`` or
  ``static`` selection: the activation kernels (:mod:`.act`) give ``B_X`` (and ``B_R``), then the
  same two GEMM routes with ``alpha = S_dec_X · S_dec_W`` (and the second accumulation's
  ``S_dec_R · S_dec_W``). Without RAC, at decode sizes (``M <= 32`` and ``M·K·2`` bytes of B_X per
  CTA, :func:`.linear.quantizes_in_kernel`), one launch of the tensor-core kernel quantizes x itself
  (``ROUTES["act_quant_in_gemm"]``; the same B_X and S_dec_X bits as :mod:`.act`).

Not routed (Triton runs them): fp32 activations, ``gathered`` RAC, ``token`` selection, K not a
multiple of 32, misaligned inputs, a static (calibrated) activation scale (which the Triton kernel
refuses by name).
"""

from __future__ import annotations

import weakref

import torch

from qpass.backends.cuda import act as ca
from qpass.backends.cuda import linear as cl
from qpass.backends.cuda import prefill as cp
from qpass.backends.cuda import runtime

_MASKS: dict[int, tuple] = {}
# Which routes may serve a call (benchmarks switch one off to time the alternative in the same run; an
# engine captures the route at CUDA-graph capture time, so switch before building one).
ROUTES = {"act_quant_in_gemm": True}
# The last activation quantized, for sibling linears of one input (q/k/v, gate/up): the graph hands them
# the very same tensor object, so the operands are computed once (a common-subexpression elimination at
# run time; the key holds the object's identity, in-place version, layout and the quantizer options).
_LAST: dict[str, tuple] = {}


def _act_key(x: torch.Tensor, call) -> tuple:
    rac = call.rac
    ch = call.rac_channels
    return (x.data_ptr(), x._version, tuple(x.shape), tuple(x.stride()), x.dtype, call.per_token, call.rac_k,
            None if rac is None else (rac.mode, rac.selection),
            None if ch is None else (ch.data_ptr(), ch._version))


def _act_operands_once(x: torch.Tensor, call, mask, check: bool) -> "ca.ActOperands":
    """``act_operands`` of the rows ``x`` of ``call.x``, reused when the previous call had the same
    ``call.x`` object (same version, layout and options)."""
    key = _act_key(call.x, call)
    hit = _LAST.get("act")
    if hit is not None and hit[0] == key and hit[1]() is call.x:
        return hit[2]
    ops = ca.act_operands(x, per_token=call.per_token, rac_k=call.rac_k or None, static_mask=mask, check=check,
                          site=call.site)
    _LAST["act"] = (key, weakref.ref(call.x), ops)
    return ops


def _static_mask(channels: torch.Tensor, k: int) -> torch.Tensor:
    key = channels.data_ptr()
    hit = _MASKS.get(key)
    if hit is not None and hit[0]() is channels and hit[1] == channels._version:
        return hit[2]
    m = ca.channel_mask(channels, k)
    _MASKS[key] = (weakref.ref(channels), channels._version, m)
    return m


def routable(call) -> bool:
    """Whether :func:`nvfp4_linear` takes this call (see the module docstring)."""
    x = call.x
    if not (x.is_cuda and runtime.available()) or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    k = call.in_features
    if k % 32 or x.stride(-1) != 1:
        return False
    if call.rac is not None and (call.rac.mode != "masked" or call.rac.selection == "token" or k > ca.MAX_RAC_K):
        return False
    if call.static_act:  # a calibrated activation scale: the activation kernels compute the input's amax
        return False
    return True


def nvfp4_linear(call) -> torch.Tensor | None:
    """``qpass::nvfp4_linear`` on the CUDA kernels, or None when no route takes the call."""
    if not routable(call):
        return None
    k = call.in_features
    x2 = call.x.reshape(-1, k)
    if x2.data_ptr() % 64 or x2.stride(0) % 16:
        x2 = x2.contiguous()
        if x2.data_ptr() % 64:
            return None
    m = x2.shape[0]
    w = call.weight
    from qpass.sync_checks import sync_checks_enabled

    if call.w4a16:
        a, s_dec_x, br, s_dec_r = x2, None, None, None
    elif call.rac is None and ROUTES["act_quant_in_gemm"] and m <= cl.MAX_TOKEN_SLOTS and cl.quantizes_in_kernel(m, k, w.codes.shape[0]) \
            and cl.supported(x2, w.codes):
        # W4A4 without RAC at decode sizes: one launch that quantizes x itself (same B_X and S_dec_X bits)
        check = sync_checks_enabled(x2.device)
        amax = torch.empty(m if call.per_token else 1, dtype=torch.int32, device=x2.device) if check else None
        y = cl.nvfp4_mma_linear(x2, w.codes, w.scales, w.s_dec, per_token=call.per_token, bias=call.bias,
                                out_dtype=call.out_dtype, site=call.site, act_quant=True, amax_out=amax)
        if check:
            ca.raise_if_not_finite(amax, call.site)
        return y.reshape(*call.x.shape[:-1], y.shape[-1])
    else:
        mask = _static_mask(call.rac_channels, k) if call.rac is not None and call.rac.selection == "static" else None
        ops = _act_operands_once(x2, call, mask, sync_checks_enabled(x2.device))
        a, s_dec_x, br, s_dec_r = ops.bx, ops.s_dec_x, ops.br, ops.s_dec_r
        if x2.dtype != torch.bfloat16:  # B_X is bf16 whatever the input dtype (exact)
            pass
    slots = m * (2 if br is not None else 1)
    if slots <= cl.MAX_TOKEN_SLOTS and cl.supported(a, w.codes, br):
        y = cl.nvfp4_mma_linear(a, w.codes, w.scales, w.s_dec, s_dec_x=s_dec_x, per_token=call.per_token, x2=br,
                                s_dec_x2=s_dec_r, bias=call.bias, out_dtype=call.out_dtype, site=call.site)
    else:
        y = cp.prefill_linear(a, w.codes, w.scales, w.s_dec, s_dec_x=s_dec_x, per_token=call.per_token, x2=br,
                              s_dec_x2=s_dec_r, bias=call.bias, out_dtype=call.out_dtype)
    return y.reshape(*call.x.shape[:-1], y.shape[-1])
