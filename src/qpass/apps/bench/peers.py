"""Other libraries' 4-bit weight-only GEMMs, timed by ``qpass bench`` beside qpass's kernels.

These are *peers*, not qpass kernels: they use a different format (asymmetric INT4 with one bf16
scale and zero per 128 weights along K, the common "W4A16 int4 g128" recipe of GPTQ/HQQ/torchao),
so they answer "how fast is the best 4-bit weight-only GEMM on this GPU" — the bar issue 14 sets
for qpass's NVFP4 W4A16 kernel — not "is the NVFP4 result the same".

One quantization feeds every peer (:func:`int4_g128_quantize`, plain torch, RNE rounding):

    per group g of ``group_size`` consecutive k of row n:
        lo = min w, hi = max w;   scale = max((hi - lo) / 15, 1e-6)          (bf16 -> fp32 math)
        q  = clamp(round((w - lo) / scale), 0, 15)                             uint8 in [0, 15]
        w_hat = q * scale + lo      ( = (q - 8) * scale + (lo + 8 * scale) )

Peers:

* ``int4 tinygemm`` — torch's own ``aten._weight_int4pack_mm`` (the "tinygemm" kernel torchao's
  ``Int4WeightOnlyConfig`` uses on CUDA): weights repacked by ``aten._convert_weight_to_int4pack``
  (``inner_k_tiles=8``), scales/zeros as ``[K/g, N, 2]`` bf16 with ``zero = lo + 8·scale``
  (tinygemm dequantizes ``(q - 8)·scale + zero``). On CPU the ``*_for_cpu`` twins run the same math.
* ``gemlite A16W4 int4`` — GemLite's Triton kernels (``gemlite.helper.A16Wn(...).from_weights``,
  HQQ-style ``(q - z)·scale`` with ``z = -lo/scale``), only when ``gemlite`` is importable (it is
  pure Python + Triton; ``scripts/gpu_kernels.sh`` carries its source to the GPU box).

Each builder returns ``(fn, state)`` where ``fn(x, *state) -> y bf16 [M, N]``; the bench times
``fn`` and records the peer's relative error against ``x @ w_hat^T`` (fp64), so a packing mistake
shows up as an error column, not as a fast wrong kernel.

Source: torch ``aten/src/ATen/native/cuda/int4mm.cu`` (tinygemm layouts), torchao
``quantization/utils.py`` (scales-and-zeros packing), GemLite 0.6 ``helper.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

import qpass.backends.triton  # noqa: F401 - needs triton; registers its kernels (as when this module lived there)

GROUP = 128


@dataclasses.dataclass(frozen=True)
class Int4G128:
    """Asymmetric INT4 weight with one scale/min per ``group_size`` along K.

    Attributes:
        q: uint8 ``[N, K]`` codes in ``[0, 15]`` (unpacked).
        scale: fp32 ``[N, K/g]`` step (a multiplier).
        lo: fp32 ``[N, K/g]`` group minimum (the value of code 0).
        group_size: weights per group along K.
    """

    q: torch.Tensor
    scale: torch.Tensor
    lo: torch.Tensor
    group_size: int = GROUP

    def dequantize(self) -> torch.Tensor:
        """``w_hat = q·scale + lo`` in bf16, ``[N, K]``."""
        n, k = self.q.shape
        qg = self.q.float().reshape(n, k // self.group_size, self.group_size)
        return (qg * self.scale[..., None] + self.lo[..., None]).reshape(n, k).to(torch.bfloat16)


def int4_g128_quantize(w: torch.Tensor, group_size: int = GROUP) -> Int4G128:
    """Min/max INT4 quantization of ``w`` [N, K] (bf16/fp32), ``K % group_size == 0``.

    Raises:
        ValueError: ``w`` not 2-D or K not a multiple of ``group_size``.
    """
    if w.dim() != 2 or w.shape[1] % group_size:
        raise ValueError(f"int4 g{group_size}: expected [N, K] with K % {group_size} == 0, got {tuple(w.shape)}")
    n, k = w.shape
    wg = w.float().reshape(n, k // group_size, group_size)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-6)
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, k)
    return Int4G128(q, scale, lo, group_size)


def tinygemm(wq: Int4G128, inner_k_tiles: int = 8) -> tuple[Callable[..., torch.Tensor], tuple]:
    """torch's tinygemm int4 GEMM on ``wq`` (CUDA kernel, or its CPU twin on a CPU tensor)."""
    n, k = wq.q.shape
    zero = wq.lo + 8 * wq.scale
    sz = torch.stack([wq.scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [K/g, N, 2]
    g = wq.group_size
    if wq.q.is_cuda:
        packed_u8 = ((wq.q[:, ::2] << 4) | wq.q[:, 1::2]).to(torch.uint8)  # even k in the high nibble
        packed = torch._convert_weight_to_int4pack(packed_u8, inner_k_tiles)
        return (lambda x, p, s: torch._weight_int4pack_mm(x, p, g, s)), (packed, sz)
    packed = torch._convert_weight_to_int4pack_for_cpu(wq.q.to(torch.int32), inner_k_tiles)
    return (lambda x, p, s: torch._weight_int4pack_mm_for_cpu(x, p, g, s)), (packed, sz)


def gemlite_available() -> bool:
    """Whether GemLite imports (and so can be timed)."""
    try:
        import gemlite.helper  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or a Triton/driver mismatch: either way not timed
        return False
    return True


def gemlite_a16w4(wq: Int4G128) -> tuple[Callable[..., torch.Tensor], tuple]:
    """GemLite's A16W4 INT4 Triton GEMM on ``wq`` (CUDA only).

    Raises:
        ImportError: GemLite is not installed.
    """
    from gemlite.helper import A16Wn

    zeros = -wq.lo / wq.scale  # (q - z)·scale = q·scale + lo
    layer = A16Wn(device=str(wq.q.device), dtype=torch.bfloat16).from_weights(
        wq.q, wq.scale.to(torch.bfloat16), zeros.to(torch.bfloat16), W_nbits=4, group_size=wq.group_size)
    return (lambda x, lin: lin(x)), (layer,)


PEERS: dict[str, Callable[[Int4G128], tuple[Callable[..., torch.Tensor], tuple]]] = {
    "int4 tinygemm (torch _weight_int4pack_mm, g128)": tinygemm,
    "gemlite A16W4 int4 (g128)": gemlite_a16w4,
}
