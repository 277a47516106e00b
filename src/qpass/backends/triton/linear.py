"""Host wrappers of the rollout linears (semantics: :mod:`qpass.quant.linear`).

* :func:`w4a16_linear_triton`: NVFP4 weights, activations as given (bf16 on the tensor cores;
  fp16/fp32 input multiplies exact float32 copies).
* :func:`w4a4_linear_triton`: activations quantized to NVFP4 on the fly (dynamic per-tensor or
  per-token global scale); the quantization kernel hands the GEMM ``B_X = e2m1 * s_b`` and
  ``S_dec_X``, the GEMM applies ``alpha = fl(S_dec_X * S_dec_W)`` once (SPEC §3.1); optional RAC
  (a second accumulation over the same weight bytes with its own ``alpha_R``: dense for masked mode,
  gathered columns for gathered mode).
* :func:`fp8_linear_triton`: FP8 W8A8: activations quantized by the Triton kernel, GEMM by
  ``torch._scaled_mm`` where its block-scale layout is supported (1x128 x 128x128 on sm_90, bf16
  output), otherwise by the Triton block-scaled kernel.

Outputs equal the reference up to the order of float32 summation (SPEC §3.1's accumulation bound).
"""

from __future__ import annotations

import os

import torch

from qpass.errors import QuantizationError
from qpass.formats.spec import FP8Spec, Granularity, NVFP4Spec
from qpass.quant.nvfp4 import BLOCK, act_operand_limit
from qpass.quant.rac import RACConfig
from qpass.backends.triton._config import sync_checks_enabled
from qpass.backends.triton._loader import kernel_lib, wants_interpreter
from qpass.backends.triton.quantize import amax_and_bits, as_rows, check_shape, fp8_quantize_triton, raise_if_nonfinite
from qpass.backends.triton.rac import rac_run


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def _weight_parts(w_codes: torch.Tensor, w_scales: torch.Tensor, w_s_dec: torch.Tensor, k: int, site: str | None):
    if w_codes.dtype != torch.uint8:
        raise QuantizationError(f"packed NVFP4 weight codes must be uint8, got {w_codes.dtype} at site {site}")
    if w_codes.dim() != 2 or w_codes.shape[1] * 2 != k:
        raise QuantizationError(f"input has K={k} but the weight codes are {tuple(w_codes.shape)} at site {site}")
    sc = w_scales.view(torch.uint8) if w_scales.dtype != torch.uint8 else w_scales
    if tuple(sc.shape) != (w_codes.shape[0], k // BLOCK):
        raise QuantizationError(f"weight scales {tuple(sc.shape)} do not match codes {tuple(w_codes.shape)} at site {site}")
    sdec = w_s_dec.to(device=w_codes.device, dtype=torch.float32).reshape(-1)
    if sdec.numel() != 1:
        raise QuantizationError(f"NVFP4 weights need one per-tensor s_dec, got shape {tuple(w_s_dec.shape)} at site {site}")
    return w_codes.contiguous(), sc.contiguous(), sdec.contiguous()


GEMV_MODES = ("auto", "on", "off")


def default_gemv() -> str:
    """Small-M GEMV routing: ``QPASS_NVFP4_GEMV`` = ``auto`` (default: the GEMV on CUDA for M <= 4, or
    M <= 2 for weights above 4M elements: ``kernels.nvfp4_gemv.gemv_auto_max_m``),
    ``on`` (also under the CPU interpreter) or ``off`` (always the tensor-core GEMM)."""
    name = os.environ.get("QPASS_NVFP4_GEMV", "auto")
    if name not in GEMV_MODES:
        raise ValueError(f"QPASS_NVFP4_GEMV must be one of {GEMV_MODES}, got {name!r}")
    return name


def _use_gemv(lib, a, w_codes, a2, gemv: bool | None, accumulation: str | None) -> bool:
    """Whether this call runs the GEMV (:mod:`...kernels.nvfp4_gemv`) instead of the GEMM.

    ``gemv`` True / False forces it (True still needs a call the GEMV serves: no RAC second segment,
    M <= 4, aligned code rows); None follows :func:`default_gemv`, where ``auto`` takes it on CUDA
    unless the accumulation asked for is ``mma`` (a property of the tensor-core GEMM only).
    """
    if a2 is not None or not lib.nvfp4_gemv.gemv_supported(a, w_codes):
        return False
    if gemv is not None:
        return bool(gemv)
    mode = default_gemv()
    if mode == "off":
        return False
    if (accumulation or lib.nvfp4_gemm.default_accumulation()) == "mma":
        return False
    if mode == "on":
        return True
    # auto: CUDA only, and for large weights only up to gemv_auto_max_m rows (measured crossover)
    n, k = w_codes.shape[0], a.shape[1]
    return (a.device.type == "cuda" and not wants_interpreter(a.device)
            and a.shape[0] <= lib.nvfp4_gemv.gemv_auto_max_m(n, k))


def _gemm(a, w_codes, w_scales, sdec, bias, out_dtype, *, xs=None, a2=None, rs=None, gidx=None, decode=None,
          accumulation=None, gemv=None):
    """``fl(acc(a B_W^T) * alpha) (+ fl(acc(a2 B_W^T) * alpha_R)) (+ bias)`` (SPEC §3.1): ``xs`` / ``rs``
    the activation / residual ``S_dec`` (None: W4A16, ``alpha = S_dec_W``)."""
    m = a.shape[0]
    out = torch.empty(m, w_codes.shape[0], dtype=out_dtype, device=a.device)
    b = None if bias is None else bias.contiguous()
    lib = kernel_lib(a.device)
    if _use_gemv(lib, a, w_codes, a2, gemv, accumulation):
        lib.nvfp4_gemv.launch_nvfp4_gemv(a, w_codes, w_scales, sdec, out, bias=b, num_sms=_num_sms(a.device),
                                         decode=decode or lib.nvfp4_gemm.default_decode(), xs=xs)
        return out
    lib.nvfp4_gemm.launch_nvfp4_gemm(
        a, w_codes, w_scales, sdec, out, bias=b, a2=a2, gidx=gidx, num_sms=_num_sms(a.device), decode=decode,
        accumulation=accumulation, xs=xs, rs=rs,
    )
    return out


def _call(x, w_codes, w_scales, w_s_dec, bias, act_spec, rac, static_channels, site, out_dtype):
    from qpass.ops.calls import NVFP4LinearCall
    from qpass.quant.nvfp4 import NVFP4Tensor

    k = x.shape[-1]
    codes, scales, sdec = _weight_parts(w_codes, w_scales, w_s_dec, k, site)
    return NVFP4LinearCall(x=x, weight=NVFP4Tensor.from_parts(codes, scales, sdec.reshape(())), bias=bias, act=act_spec,
                           rac=rac, rac_channels=static_channels, site=site or "", out_dtype=out_dtype or x.dtype)


def nvfp4_linear_triton(call, *, decode: str | None = None, accumulation: str | None = None,
                        gemv: bool | None = None) -> torch.Tensor:
    """The Triton kernel of ``qpass::nvfp4_linear``: W4A16, W4A4 or W4A4 + RAC as the call says.

    Args:
        call: the op's typed call (:class:`qpass.ops.calls.NVFP4LinearCall`).
        decode: in-register weight decode, ``"ref"`` (float arithmetic) or ``"lut"`` (per-block
            table + byte permutes; GPU only, same bits); default ``QPASS_NVFP4_DECODE`` or ``"ref"``.
        accumulation: ``"two_level"`` (each K tile summed on the tensor cores, then added to the
            float32 accumulator with IEEE round-to-nearest) or ``"mma"`` (the whole K sum in the
            tensor-core accumulator); default ``QPASS_GEMM_ACCUMULATION`` or ``"two_level"``.
            Does not apply to the GEMV, which sums in IEEE float32 FMAs.
        gemv: True / False forces / forbids the small-M GEMV (M <= 4 rows, CUDA-core FMAs; same
            error contract as the GEMM, see ``kernels/nvfp4_gemv.py``); None: ``QPASS_NVFP4_GEMV``
            (``auto``: the GEMV for M <= 4 on CUDA unless ``accumulation`` is ``"mma"``). RAC needs
            the GEMM's second segment, so it never takes the GEMV.
    Returns:
        ``[..., N]`` in ``call.out_dtype``.
    Raises:
        KernelMissingError: a static (calibrated) activation scale (``call.static_act``): this kernel
            computes the activation amax of each input; the reference kernel serves static scales.
    Source: ``qpass.quant.linear.nvfp4_linear_reference``.
    """
    if call.static_act:
        from qpass.ops.linear import static_act_kernel_check

        static_act_kernel_check("triton", call.site)
    x, w = call.x, call.weight
    k = x.shape[-1]
    codes, scales, sdec = _weight_parts(w.codes, w.scales, w.s_dec, k, call.site)
    x2 = as_rows(x)
    if call.act is None:
        y = _gemm(x2, codes, scales, sdec, call.bias, call.out_dtype, decode=decode, accumulation=accumulation, gemv=gemv)
    else:
        check_shape(x, "nvfp4_quantize", BLOCK, "activation", call.site)
        if call.rac is None:  # the reference's plain-W4A4 rule (the call derived rac_k == 0)
            b_x, s_x = _act_quant_operand(x2, call.act, call.site)
            y = _gemm(b_x, codes, scales, sdec, call.bias, call.out_dtype, xs=s_x, decode=decode,
                      accumulation=accumulation, gemv=gemv)
        else:
            ops = rac_run(x2, call.rac, call.act, static_channels=call.rac_channels, site=call.site, outputs="gemm",
                          k=call.rac_k)
            y = _gemm(ops.b_x, codes, scales, sdec, call.bias, call.out_dtype, xs=ops.s_dec_x, a2=ops.b_r,
                      rs=ops.s_dec_r, gidx=ops.gather_idx, decode=decode, accumulation=accumulation)
    return y.reshape(*x.shape[:-1], codes.shape[0])


def w4a16_linear_triton(
    x: torch.Tensor, w_codes: torch.Tensor, w_scales: torch.Tensor, w_s_dec: torch.Tensor,
    bias: torch.Tensor | None = None, *, site: str | None = None, out_dtype: torch.dtype | None = None,
    decode: str | None = None, accumulation: str | None = None, gemv: bool | None = None,
) -> torch.Tensor:
    """NVFP4-weight, bf16-activation linear ``x [..., K] -> [..., N]`` in ``out_dtype or x.dtype``
    (:func:`nvfp4_linear_triton` of the W4A16 call).

    Args:
        x: bf16 (tensor cores) or fp16/fp32 (exact float32 products) ``[..., K]``.
        w_codes: uint8 ``[N, K/2]``; w_scales: e4m3 (or uint8 bytes) ``[N, K/16]``; w_s_dec: float32
            decode global scale (one element).
        bias: optional ``[N]``.
        out_dtype: output dtype (default ``x.dtype``; float32 exposes the float32 accumulator).
        decode, accumulation, gemv: as :func:`nvfp4_linear_triton`.
    Source: ``qpass.quant.linear.w4a16_linear_reference``.
    """
    call = _call(x, w_codes, w_scales, w_s_dec, bias, None, None, None, site, out_dtype)
    return nvfp4_linear_triton(call, decode=decode, accumulation=accumulation, gemv=gemv)


def _act_quant_operand(x2: torch.Tensor, act_spec: NVFP4Spec, site: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B_X, S_dec_X)`` of ``Q_A(x2)`` (SPEC §3.1): bf16 ``[M, K]`` ``e2m1 * s_b`` (exact) and float32
    ``[1]`` (per tensor) or ``[M]`` (per token), from one amax pass and one fused quantize pass."""
    per_row = act_spec.global_scope == "per_token"
    amax, gbits = amax_and_bits(x2, per_row)
    if sync_checks_enabled(x2.device):
        raise_if_nonfinite(gbits, x2, "nvfp4_quantize", "activation", site)
    b_x = torch.empty(x2.shape, dtype=torch.bfloat16, device=x2.device)
    s_enc = torch.empty(x2.shape[0] if per_row else 1, dtype=torch.float32, device=x2.device)
    s_dec = torch.empty_like(s_enc)
    kernel_lib(x2.device).nvfp4_quant.launch_nvfp4_quant(x2, amax, per_row, bx=b_x, s_enc=s_enc, s_dec=s_dec,
                                                         xhat_lim=act_operand_limit(x2.dtype))
    return b_x, s_dec


def w4a4_linear_triton(
    x: torch.Tensor, w_codes: torch.Tensor, w_scales: torch.Tensor, w_s_dec: torch.Tensor,
    bias: torch.Tensor | None = None, *, act_spec: NVFP4Spec, rac: RACConfig | None = None,
    static_channels: torch.Tensor | None = None, site: str | None = None, out_dtype: torch.dtype | None = None,
    decode: str | None = None, accumulation: str | None = None, gemv: bool | None = None,
) -> torch.Tensor:
    """W4A4 linear with dynamic NVFP4 activation quantization and optional RAC
    (:func:`nvfp4_linear_triton` of the W4A4 call).

    Args:
        x: bf16/fp16/fp32 ``[..., K]`` (all leading dims are one forward batch), ``K % 16 == 0``.
        w_codes, w_scales, w_s_dec, bias: as :func:`w4a16_linear_triton`.
        act_spec: activation spec (per-tensor or per-token dynamic global scale).
        rac: residual compensation options (None or 0 channels: plain W4A4).
        static_channels: calibrated channels for ``rac.selection == 'static'``.
        out_dtype: output dtype (default ``x.dtype``).
        decode, accumulation, gemv: as :func:`nvfp4_linear_triton`.
    Returns:
        ``[..., N]`` in ``out_dtype or x.dtype``.
    Source: ``qpass.quant.linear.w4a4_linear_reference``.
    """
    call = _call(x, w_codes, w_scales, w_s_dec, bias, act_spec, rac, static_channels, site, out_dtype)
    return nvfp4_linear_triton(call, decode=decode, accumulation=accumulation, gemv=gemv)


# ---------------------------------------------------------------------------------------------
# FP8 W8A8

_SCALED_MM_OK: dict[tuple, bool] = {}


def _scaled_mm_blockwise(xq, xs, wq, ws, bias, out_dtype):
    """``torch._scaled_mm`` with 1x128 activation and 128x128 weight scales (sm_90, bf16 out).

    cuBLASLt wants both scale tensors "outer-dim-major" with 16-byte aligned leading dimensions:
    ``scale_a [M, K/128]`` with strides ``(1, Mp)`` and ``scale_b [K/128, N/128]`` with strides
    ``(1, KBp)`` (``Mp``, ``KBp`` multiples of 4).
    """
    m = xq.shape[0]
    kb = xs.shape[1]
    mp = -(-m // 4) * 4
    kbp = -(-kb // 4) * 4
    sa_buf = torch.zeros(kb, mp, dtype=torch.float32, device=xq.device)
    sa_buf[:, :m] = xs.t()
    sb_buf = torch.zeros(ws.shape[0], kbp, dtype=torch.float32, device=xq.device)
    sb_buf[:, :kb] = ws
    return torch._scaled_mm(
        xq, wq.t(), scale_a=sa_buf[:, :m].t(), scale_b=sb_buf[:, :kb].t(), bias=bias, out_dtype=out_dtype,
        use_fast_accum=False,
    )


def fp8_linear_triton(
    x: torch.Tensor, w_data: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, *,
    act_spec: FP8Spec, w_spec: FP8Spec, site: str | None = None, backend: str | None = None,
) -> torch.Tensor:
    """FP8 E4M3 W8A8 linear ``x [..., K] -> [..., N]`` in ``x.dtype`` (:func:`fp8_linear_triton_call`
    of the call).

    Args:
        x: bf16/fp16/fp32 ``[..., K]``.
        w_data: ``float8_e4m3fn`` ``[N, K]``; w_scale: float32 decode scales of ``w_spec``'s granularity.
        act_spec / w_spec: FP8 specs (activation quantized here with the Triton kernel).
        backend: as :func:`fp8_linear_triton_call`.
    Source: ``qpass.quant.linear.fp8_linear_reference``.
    """
    from qpass.ops.calls import FP8LinearCall
    from qpass.quant.fp8 import FP8Tensor

    w = FP8Tensor(data=w_data, scale=w_scale, shape=w_data.shape, orig_dtype=torch.bfloat16, spec=w_spec)
    call = FP8LinearCall(x=x, weight=w, bias=bias, act=act_spec, site=site or "", out_dtype=x.dtype)
    return fp8_linear_triton_call(call, backend=backend)


def fp8_linear_triton_call(call, *, backend: str | None = None) -> torch.Tensor:
    """The Triton kernel of ``qpass::fp8_linear`` (:class:`qpass.ops.calls.FP8LinearCall`).

    Args:
        call: the op's typed call.
        backend: ``"scaled_mm"``, ``"triton"`` (bf16-upcast tensor-core dot, fp32 accumulation),
            ``"triton_fp8"`` (FP8 tensor cores) or None (``QPASS_FP8_GEMM`` env, default: scaled_mm
            when supported, else triton).
    Source: ``qpass.quant.linear.fp8_linear_reference``.
    """
    x, bias, site = call.x, call.bias, call.site
    w_data, w_scale, act_spec, w_spec = call.weight.data, call.weight.scale, call.act, call.weight.spec
    k = x.shape[-1]
    x2 = as_rows(x)
    xq = fp8_quantize_triton(x2, spec=act_spec, check=sync_checks_enabled(x2.device), name="activation", site=site)
    wq = w_data.contiguous()
    backend = backend or os.environ.get("QPASS_FP8_GEMM") or "auto"
    g_a, g_w = act_spec.granularity, w_spec.granularity
    out = None
    if backend in ("auto", "scaled_mm") and x2.is_cuda and g_a == Granularity.BLOCK_1X128 and g_w == Granularity.BLOCK_128X128 \
            and x.dtype == torch.bfloat16 and k % 128 == 0 and wq.shape[0] % 128 == 0:
        key = (x2.device.index, bias is not None)
        if _SCALED_MM_OK.get(key, True):
            try:
                b = None if bias is None else bias.to(torch.bfloat16)
                out = _scaled_mm_blockwise(xq.data, xq.scale, wq, w_scale, b, torch.bfloat16)
                _SCALED_MM_OK[key] = True
            except (RuntimeError, TypeError, ValueError):
                if backend == "scaled_mm":
                    raise
                _SCALED_MM_OK[key] = False
    if out is None:
        out = torch.empty(x2.shape[0], wq.shape[0], dtype=x.dtype, device=x2.device)
        a_br = (act_spec.block_shape or (1, 1))[0]
        w_br = (w_spec.block_shape or (1, 1))[0]
        kernel_lib(x2.device).fp8.launch_fp8_gemm(
            xq.data.view(torch.uint8).reshape(x2.shape), xq.scale, a_br, wq.view(torch.uint8), w_scale, w_br, out,
            bias=None if bias is None else bias.contiguous(), dot_fp8=backend == "triton_fp8",
        )
    return out.reshape(*x.shape[:-1], wq.shape[0])
