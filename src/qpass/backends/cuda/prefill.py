"""Large-M NVFP4 linears on cuBLAS over exact operands (SPEC §3.1), with a per-weight-version cache.

``B_W = e2m1·s_b`` is exact in bf16 (and fp16), so cuBLAS multiplying ``B_X`` (or bf16 activations)
by a dense ``B_W`` computes exactly the products SPEC §3.1 asks for; the float32 accumulator comes
back through ``torch.mm(..., out_dtype=torch.float32)`` and the ``nvfp4_epilogue`` kernel applies
``alpha`` (and the RAC second accumulation, and the bias) with the reference's roundings.

Memory: the cache holds one bf16 ``B_W`` per NVFP4 weight it has served, 2 bytes per weight (as much
as the BF16 model's weights, on top of the 0.5625 bytes of the NVFP4 bytes); it is filled lazily, by
the first large-M call of a weight version, and keyed on the weight tensors' identity and in-place
versions (a weight sync that writes the buffers in place invalidates it). ``QPASS_BW_CACHE_MAX``
bounds the number of entries (LRU).
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict

import torch

from qpass.backends.cuda import runtime
from qpass.backends.cuda.linear import _OUT_KIND

_CACHE: "OrderedDict[tuple, tuple]" = OrderedDict()


def _max_entries() -> int:
    return int(os.environ.get("QPASS_BW_CACHE_MAX", "4096"))


def decode_operand(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``B_W [N, K] = e2m1(code) · s_b`` in ``dtype`` (exact in bf16/fp16)."""
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       device=codes.device)
    n, kh = codes.shape
    vals = lut[torch.stack([codes & 15, codes >> 4], -1).reshape(n, 2 * kh).long()]
    sc = (scales.view(torch.float8_e4m3fn) if scales.dtype == torch.uint8 else scales).float()
    return (vals.reshape(n, kh // 8, 16) * sc.unsqueeze(-1)).reshape(n, 2 * kh).to(dtype)


def cached_operand(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    key = (codes.data_ptr(), scales.data_ptr(), dtype)
    vers = (codes._version, scales._version)
    hit = _CACHE.get(key)
    if hit is not None:
        refs, v, val = hit
        if v == vers and refs[0]() is codes and refs[1]() is scales:
            _CACHE.move_to_end(key)
            return val
    val = decode_operand(codes, scales, dtype)
    _CACHE[key] = ((weakref.ref(codes), weakref.ref(scales)), vers, val)
    while len(_CACHE) > _max_entries():
        _CACHE.popitem(last=False)
    return val


def cache_bytes() -> int:
    """Bytes held by the B_W cache (the memory cost of this path)."""
    return sum(v[2].numel() * v[2].element_size() for v in _CACHE.values())


def prefill_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, s_dec_w: torch.Tensor, *,
                   s_dec_x: torch.Tensor | None = None, per_token: bool = False, x2: torch.Tensor | None = None,
                   s_dec_x2: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Same contract as :func:`qpass.backends.cuda.linear.nvfp4_mma_linear`, any M, on cuBLAS."""
    out_dtype = out_dtype or x.dtype
    bw = cached_operand(codes, scales, x.dtype)
    acc = torch.mm(x, bw.t(), out_dtype=torch.float32)
    acc2 = torch.mm(x2, bw.t(), out_dtype=torch.float32) if x2 is not None else None
    m, n = acc.shape
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    defines = dict(NT=1, NW=1, XH=0, OUT_KIND=_OUT_KIND[out_dtype], HAS_X2=int(x2 is not None),
                   HAS_BIAS=int(bias is not None), ALPHA_KIND=0 if s_dec_x is None else (2 if per_token else 1))
    kern = runtime.get_kernel("nvfp4_mma", "nvfp4_epilogue", defines, x.device.index or 0)
    f32 = torch.float32
    grid = max(1, min(4 * torch.cuda.get_device_properties(x.device).multi_processor_count, -(-(m * n) // 256)))
    runtime.launch(kern, (grid, 1, 1), (256, 1, 1),
                   [acc, acc2, s_dec_w.to(f32).contiguous(), None if s_dec_x is None else s_dec_x.to(f32).contiguous(),
                    None if s_dec_x2 is None else s_dec_x2.to(f32).contiguous(),
                    None if bias is None else bias.to(out_dtype).contiguous(), out, m, n, out.stride(0)], "pppppppiii")
    return out
