"""Host side of the NVFP4 tensor-core kernel ``kernels/nvfp4_mma.cu`` (small M, SPEC §3.1).

:func:`nvfp4_mma_linear` computes, for activations ``x [M, K]`` already in the operand dtype (bf16 or
fp16: the W4A16 input as given, or the exact W4A4 operand ``B_X = e2m1·s_b`` of an activation
quantizer)::

    Y = fl( acc(x · B_W^T) · alpha ) (+ fl( acc(x2 · B_W^T) · alpha2 )) (+ bias)
    alpha  = S_dec_W                  (no s_dec_x: W4A16)
           = fl(S_dec_X · S_dec_W)    (s_dec_x: one element, or one per row with per_token)
    alpha2 = fl(S_dec_X2 · S_dec_W)   (x2: the RAC compensation operand B_R, same rows as x)

with float32 accumulation on the tensor cores. The kernel configuration (token tiles ``NT``, warps
``NW``) is a fixed function of the shape (:func:`choose_config`), never timed, so a run's numerics do
not depend on an autotuner.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Sequence

import torch

from qpass.errors import QuantizationError
from qpass.backends.cuda import runtime

MAX_TOKEN_SLOTS = 32  # NT <= 4 n8 tiles (x rows, plus as many x2 rows)
MAX_SEGS = 4  # weights sharing one activation in one launch (kernels/nvfp4_mma.cu)


class _Seg(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("s_dec_w", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("n", ctypes.c_int32), ("g0", ctypes.c_int32), ("col0", ctypes.c_int32),
                ("pad", ctypes.c_int32)]


class _Segs(ctypes.Structure):
    _fields_ = [("s", _Seg * MAX_SEGS), ("count", ctypes.c_int32)]


@dataclasses.dataclass(frozen=True)
class WeightParts:
    """One NVFP4 weight as the kernel reads it: codes uint8 [N, K/2], E4M3 scale bytes [N, K/16],
    float32 S_dec_W (one element), optional bias [N]."""

    codes: torch.Tensor
    scales: torch.Tensor
    s_dec: torch.Tensor
    bias: torch.Tensor | None = None
_OUT_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


@dataclasses.dataclass(frozen=True)
class MMAConfig:
    """``nt``: n8 token tiles; ``nw``: warps per CTA (they split K)."""

    nt: int
    nw: int


def choose_config(token_slots: int, n: int, k: int, sms: int = 132) -> MMAConfig:
    """Deterministic kernel configuration for ``token_slots`` tokens (x rows + x2 rows) and an
    ``[n, k]`` weight: enough warps per CTA that the grid (one CTA per 16 rows) holds ~16 warps per
    SM, each warp keeping at least two 128-wide K chunks."""
    nt = max(1, -(-token_slots // 8))
    ctas = -(-n // 16)
    want = max(1, (16 * sms) // ctas)
    nw = 1
    while nw * 2 <= min(16, want) and nw * 2 <= max(1, (k // 128) // 2):
        nw *= 2
    return MMAConfig(nt, nw)


def supported(x: torch.Tensor, codes: torch.Tensor, x2: torch.Tensor | None = None) -> bool:
    """Whether this call can run on the kernel (CUDA, bf16/fp16 rows aligned to 16 bytes, K % 32 == 0,
    at most ``MAX_TOKEN_SLOTS`` token slots)."""
    if not (x.is_cuda and runtime.available()) or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    m, k = x.shape
    slots = m * (2 if x2 is not None else 1)
    ok = (k % 32 == 0 and 0 < slots <= MAX_TOKEN_SLOTS and x.stride(1) == 1 and x.stride(0) % 8 == 0
          and x.data_ptr() % 16 == 0 and codes.is_contiguous() and codes.data_ptr() % 16 == 0)
    if x2 is not None:
        ok = ok and x2.shape == x.shape and x2.dtype == x.dtype and x2.stride(1) == 1 and x2.stride(0) % 8 == 0 \
            and x2.data_ptr() % 16 == 0
    return bool(ok)


def nvfp4_mma_linear(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, s_dec_w: torch.Tensor, *,
    s_dec_x: torch.Tensor | None = None, per_token: bool = False, x2: torch.Tensor | None = None,
    s_dec_x2: torch.Tensor | None = None, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
    config: MMAConfig | None = None, site: str | None = None, act_quant: bool = False,
    amax_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Y [M, N]`` of the module docstring on the tensor-core kernel.

    Args:
        x: bf16 or fp16 ``[M, K]`` operand rows (W4A16 activations, or ``B_X``), ``K % 32 == 0``.
        codes: uint8 ``[N, K/2]`` (low nibble = even k); scales: E4M3 bytes ``[N, K/16]`` (uint8 or
            float8_e4m3fn); s_dec_w: float32 one element.
        s_dec_x: float32 ``[1]`` (per tensor) or ``[M]`` (``per_token``): the activation decode scale.
        x2, s_dec_x2: the RAC compensation operand (same shape and dtype as x) and its decode scale.
        bias: ``[N]`` in the output dtype (float32 for float32 output).
        out_dtype: bf16 / fp16 / fp32 (default ``x.dtype``).
        config: force a kernel configuration (benchmarks); default :func:`choose_config`.
        act_quant: x is the raw activation; the kernel quantizes it (W4A4, :func:`nvfp4_mma_multi`).
        amax_out: with ``act_quant``, int32 ``[1]`` / ``[M]`` that receives the activation amax bits.
    Raises:
        QuantizationError: shapes/dtypes the kernel does not take (names ``site``).
    """
    return nvfp4_mma_multi(x, [WeightParts(codes, scales, s_dec_w, bias)], s_dec_x=s_dec_x, per_token=per_token,
                           x2=x2, s_dec_x2=s_dec_x2, out_dtype=out_dtype, config=config, site=site,
                           act_quant=act_quant, amax_out=amax_out)


QX_SMEM_MAX = 64 * 1024  # B_X rows a quantizing launch keeps per CTA (M * K * 2 bytes)


def quantizes_in_kernel(m: int, k: int, n: int | None = None) -> bool:
    """Whether a W4A4 call of ``m`` rows (no RAC) can take the one-launch kernel that quantizes its own
    activations (``act_quant``): its B_X rows fit ``QX_SMEM_MAX`` bytes of shared memory per CTA. With
    ``n`` (the weight's rows): whether it should — every CTA quantizes all of x, which pays only while
    each thread quantizes at most one 16-element block (run 4, H100: 1x4096x4096 13.7 µs one launch
    vs 15.3 µs two; 1x14336x4096, 4 blocks per thread, 33.3 vs 28.5; M = 16 on the SmolLM2 shapes,
    9 per thread, 17.7 vs 13.2)."""
    if m * k * 2 > QX_SMEM_MAX:
        return False
    return n is None or m * (k // 16) <= 32 * choose_config(m, n, k).nw


def nvfp4_mma_multi(
    x: torch.Tensor, weights: Sequence[WeightParts], *, s_dec_x: torch.Tensor | None = None, per_token: bool = False,
    x2: torch.Tensor | None = None, s_dec_x2: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
    config: MMAConfig | None = None, site: str | None = None, act_quant: bool = False,
    amax_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Several weights times the same activations in one launch: ``Y [M, sum N_i]``, weight ``i``'s
    output in columns ``[sum_{j<i} N_j, ...)`` (sibling linears such as q/k/v; each weight keeps its
    own S_dec_W and bias). Arguments as :func:`nvfp4_mma_linear`; with ``act_quant`` x is the raw
    activation (bf16/fp16) and the kernel quantizes it itself (SPEC §3 rule 5, dynamic per-tensor or,
    with ``per_token``, per-row scale; the bits of :func:`qpass.backends.cuda.act.act_operands`), so
    W4A4 without RAC is one launch; ``amax_out`` (int32 ``[1]`` or ``[M]``) receives the amax bits.

    Raises:
        QuantizationError: shapes/dtypes the kernel does not take, ``act_quant`` with ``x2`` or
            ``s_dec_x``, or B_X rows over ``QX_SMEM_MAX`` (names ``site``).
    """
    if act_quant and (x2 is not None or s_dec_x is not None or not quantizes_in_kernel(*x.shape)):
        raise QuantizationError(f"act_quant takes x [M, K] with M*K*2 <= {QX_SMEM_MAX} and no x2 / s_dec_x "
                                f"(got {tuple(x.shape)}) at site {site}")
    if not weights or len(weights) > MAX_SEGS:
        raise QuantizationError(f"nvfp4_mma_multi takes 1..{MAX_SEGS} weights, got {len(weights)} at site {site}")
    if not supported(x, weights[0].codes, x2) or not all(w.codes.is_contiguous() and w.codes.data_ptr() % 16 == 0
                                                          for w in weights):
        raise QuantizationError(f"nvfp4_mma_linear cannot take x {tuple(x.shape)} {x.dtype} at site {site}")
    m, k = x.shape
    out_dtype = out_dtype or x.dtype
    segs = _Segs()
    keep = []
    g0 = col0 = 0
    has_bias = weights[0].bias is not None
    for i, w in enumerate(weights):
        n = w.codes.shape[0]
        if w.codes.shape[1] * 2 != k or tuple(w.scales.shape) != (n, k // 16):
            raise QuantizationError(f"weight parts {tuple(w.codes.shape)} / {tuple(w.scales.shape)} do not match "
                                    f"K={k} at site {site}")
        if (w.bias is not None) != has_bias:
            raise QuantizationError(f"nvfp4_mma_multi: every weight needs a bias or none does (site {site})")
        sc = (w.scales.view(torch.uint8) if w.scales.dtype != torch.uint8 else w.scales).contiguous()
        sd = w.s_dec.to(torch.float32).contiguous()
        b = None if w.bias is None else w.bias.to(out_dtype).contiguous()
        keep += [sc, sd, b]
        segs.s[i] = _Seg(w.codes.data_ptr(), sc.data_ptr(), sd.data_ptr(), 0 if b is None else b.data_ptr(), n, g0, col0, 0)
        g0 += -(-n // 16)
        col0 += n
    segs.count = len(weights)
    cfg = config or choose_config(m * (2 if x2 is not None else 1), col0, k)
    alpha_kind = 0 if s_dec_x is None and not act_quant else (2 if per_token else 1)
    defines = dict(NT=cfg.nt, NW=cfg.nw, XH=int(x.dtype == torch.float16), OUT_KIND=_OUT_KIND[out_dtype],
                   HAS_X2=int(x2 is not None), HAS_BIAS=int(has_bias), ALPHA_KIND=alpha_kind)
    if act_quant:  # the operand is bf16 B_X whatever the input dtype (as act_operands hands it)
        defines.update(QX=1, X_KIND=int(x.dtype == torch.float16), XH=0)
    kern = runtime.get_kernel("nvfp4_mma", "nvfp4_mma_gemm", defines, x.device.index or 0)
    out = torch.empty(m, col0, dtype=out_dtype, device=x.device)
    f32 = torch.float32
    sdx = None if s_dec_x is None else s_dec_x.to(f32).contiguous()
    sdx2 = None if s_dec_x2 is None else s_dec_x2.to(f32).contiguous()
    args = [x, x2, segs, sdx, sdx2, out, m, k, x.stride(0), 0 if x2 is None else x2.stride(0), out.stride(0), amax_out]
    runtime.launch(kern, (g0, 1, 1), (cfg.nw * 32, 1, 1), args, "ppsppp" + "iiiii" + "p",
                   shared_bytes=m * k * 2 if act_quant else 0)
    del keep
    return out
