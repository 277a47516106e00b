"""Host wrappers of the NVFP4 quantization kernels: :func:`nvfp4_quantize_triton` and amax helpers.

Bit-identical to :func:`qpass.quant.nvfp4.nvfp4_quantize` (SPEC §3): same arithmetic, same op
order, IEEE division (``tl.div_rn``), no FMA contraction. The kernels run compiled on CUDA tensors
and under the Triton interpreter on CPU tensors.
"""

from __future__ import annotations

import torch

from qpass.errors import QuantizationError
from qpass.formats.spec import NVFP4_ACT_PER_TOKEN, NVFP4_WEIGHT, NVFP4Spec
from qpass.quant.checks import check_float_input, describe
from qpass.quant.nvfp4 import BLOCK, NVFP4Tensor
from qpass.backends.triton._loader import kernel_lib

_NONFINITE_BITS = 0x7F800000  # bits(|x|) >= this <=> |x| is inf or NaN


def check_shape(x: torch.Tensor, op: str, multiple_of: int | None, name: str | None, site: str | None) -> None:
    """Shape/dtype validation that needs no device sync (finiteness is checked through amax bits).

    Raises:
        QuantizationError: as :func:`qpass.quant.checks.check_float_input` with ``finite=False``.
    """
    check_float_input(x, op=op, multiple_of=multiple_of, name=name, site=site, finite=False)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` -> ``[R, K]`` with unit column stride (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def amax_bits_tensor(x2: torch.Tensor) -> torch.Tensor:
    """int32 ``[1]``: bits of ``max|x2|`` over the whole ``[R, K]`` tensor (float32 via ``.view``)."""
    lib = kernel_lib(x2.device)
    alloc = torch.zeros if lib.amax.needs_zeroed_output(x2) else torch.empty
    out = alloc(1, dtype=torch.int32, device=x2.device)
    lib.amax.launch_amax_tensor(x2, out)
    return out


def amax_rows(x2: torch.Tensor, need_global: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rows float32 [R], global_bits int32 [1] or None)``: ``max|x2|`` per row and over everything.

    ``need_global=False`` skips the global maximum (and its zero-fill launch); the second item is
    then None. Non-finite rows still show up as bits >= 0x7F800000 in ``rows.view(int32)``.
    """
    rows = torch.empty(x2.shape[0], dtype=torch.float32, device=x2.device)
    gbits = torch.zeros(1, dtype=torch.int32, device=x2.device) if need_global else None
    kernel_lib(x2.device).amax.launch_amax_rows(x2, rows, gbits)
    return rows, gbits


def amax_and_bits(x2: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax float32, bits int32)`` of ``x2 [R, K]``, one view of the other: per row (``[R]``) or
    over the whole tensor (``[1]``). Non-finite input shows as bits >= 0x7F800000."""
    if per_row:
        amax, _ = amax_rows(x2, need_global=False)
        return amax, amax.view(torch.int32)
    gbits = amax_bits_tensor(x2)
    return gbits.view(torch.float32), gbits


def raise_if_nonfinite(bits: torch.Tensor, x: torch.Tensor, op: str, name: str | None, site: str | None) -> None:
    """Raise :class:`QuantizationError` if an amax bit pattern says the input held NaN/inf (syncs)."""
    if bool((bits >= _NONFINITE_BITS).any()):
        finite = torch.isfinite(x)
        bad = (~finite).nonzero()
        first = tuple(int(i) for i in bad[0])
        raise QuantizationError(
            f"{op}: {bad.shape[0]} non-finite value(s) in {describe(name, site)}, first at index {first} = "
            f"{x[first].item()} (NaN/inf has no NVFP4/FP8 code; qpass refuses instead of emitting a silent code)"
        )


def _resolve_spec(per_token: bool, spec: NVFP4Spec | None) -> NVFP4Spec:
    if spec is not None and spec.arithmetic != "te_reference":
        raise QuantizationError(f"the Triton NVFP4 quantizers implement the te_reference arithmetic only, not {spec.key} "
                                "(use the reference quantizer)")
    if spec is None:
        return NVFP4_ACT_PER_TOKEN if per_token else NVFP4_WEIGHT
    if (spec.global_scope == "per_token") != bool(per_token) and per_token:
        raise QuantizationError(f"per_token=True contradicts spec {spec.key}")
    return spec


def nvfp4_quantize_triton(
    x: torch.Tensor,
    amax: torch.Tensor | float | None = None,
    per_token: bool = False,
    *,
    spec: NVFP4Spec | None = None,
    check: bool = True,
    name: str | None = None,
    site: str | None = None,
) -> NVFP4Tensor:
    """Quantize to NVFP4 with the Triton kernels; bytes equal :func:`qpass.quant.nvfp4.nvfp4_quantize`.

    Args:
        x: bf16/fp16/fp32 ``[..., K]`` (at least 2 dims), ``K % 16 == 0``, finite. CUDA tensors run
            compiled, CPU tensors under the Triton interpreter.
        amax: float32 global amax (a max-abs value, not a scale): 0-dim (per tensor) or
            ``x.shape[:-1] + (1,)`` (per token). ``None``: computed by the amax kernel.
        per_token: one global scale per row (activation spec ``nvfp4.activation.per_token``).
        spec: the :class:`NVFP4Spec` to stamp on the result; default ``NVFP4_WEIGHT`` (or the
            per-token activation spec when ``per_token``). ``spec.global_scope`` decides per-token.
        check: raise on NaN/inf input and on a stale given amax (``amax < max|x|``). Costs one
            device->host sync; pass False on a CUDA-graph / no-sync path (a NaN input then gives a
            NaN ``s_dec`` instead of an error).
        name, site: how errors name the tensor.
    Returns:
        :class:`NVFP4Tensor`: codes uint8 ``[..., K/2]`` (low nibble = even k), scales e4m3
        ``[..., K/16]`` (linear layout), ``s_dec``/``s_enc``/``amax`` float32 of shape ``()`` or
        ``[..., 1]``.
    Raises:
        QuantizationError: bad dtype/shape, ``K % 16 != 0``, and (with ``check``) NaN/inf or a stale amax.
    Source: SPEC.md §3; kernel ``kernels/nvfp4_quant.py``.
    """
    spec = _resolve_spec(per_token, spec)
    per_row = spec.global_scope == "per_token"
    check_shape(x, "nvfp4_quantize", BLOCK, name, site)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = as_rows(x)
    r = x2.shape[0]
    dev = x2.device
    lib = kernel_lib(dev)
    if amax is None:
        amax_k, gbits = amax_and_bits(x2, per_row)
        if check:
            raise_if_nonfinite(gbits, x, "nvfp4_quantize", name, site)
    else:
        amax_t = torch.as_tensor(amax, dtype=torch.float32, device=dev)
        if not per_row and amax_t.numel() == 1:
            amax_t = amax_t.reshape(())  # a [1]-shaped amax (checkpoint convention) is a scalar
        expected = tuple(lead) + (1,) if per_row else ()
        if amax_t.dim() != 0 and tuple(amax_t.shape) != expected:
            raise QuantizationError(f"amax shape {tuple(amax_t.shape)} does not match {expected} for {describe(name, site)}")
        amax_k = (amax_t.expand(*lead, 1) if per_row else amax_t).reshape(-1).contiguous()
        if check:
            if not bool(torch.isfinite(amax_t).all()) or bool((amax_t < 0).any()):
                raise QuantizationError(f"amax must be finite and >= 0, got {amax_t.flatten()[:4].tolist()} for {describe(name, site)}")
            actual, gbits = amax_and_bits(x2, per_row)
            raise_if_nonfinite(gbits, x, "nvfp4_quantize", name, site)
            if bool((amax_k < actual).any()):
                raise QuantizationError(
                    f"stale amax for {describe(name, site)}: given amax={float(amax_k.max()):.9g} < current "
                    f"max|x|={float(actual.max()):.9g}; block scales would exceed 448 and saturate (SPEC §3 rule 2)"
                )
    codes = torch.empty(r, k // 2, dtype=torch.uint8, device=dev)
    scales = torch.empty(r, k // BLOCK, dtype=torch.uint8, device=dev)
    n_glob = r if per_row else 1
    s_enc = torch.empty(n_glob, dtype=torch.float32, device=dev)
    s_dec = torch.empty(n_glob, dtype=torch.float32, device=dev)
    lib.nvfp4_quant.launch_nvfp4_quant(x2, amax_k, per_row, codes=codes, scales=scales, s_enc=s_enc, s_dec=s_dec)
    gshape = tuple(lead) + (1,) if per_row else ()
    if amax is not None and per_row and amax_t.dim() == 0:  # one amax broadcast to every row: scalar globals
        gshape = ()
        s_enc, s_dec, amax_k = s_enc[:1], s_dec[:1], amax_k[:1]
    return NVFP4Tensor(
        codes=codes.reshape(*lead, k // 2),
        scales=scales.view(torch.float8_e4m3fn).reshape(*lead, k // BLOCK),
        s_dec=s_dec.reshape(gshape),
        s_enc=s_enc.reshape(gshape),
        amax=amax_k.reshape(gshape).clone() if amax is None and not per_row else amax_k.reshape(gshape),
        shape=x.shape,
        orig_dtype=x.dtype,
        spec=spec,
    )


def fp8_quantize_triton(
    x: torch.Tensor,
    granularity: str | None = None,
    *,
    spec=None,
    check: bool = True,
    name: str | None = None,
    site: str | None = None,
):
    """FP8 E4M3 quantization with the Triton kernel; bytes/scales equal :func:`qpass.quant.fp8.fp8_quantize`.

    Args:
        x: bf16/fp16/fp32 ``[..., K]`` (exactly 2-D for ``block_128x128``), finite.
        granularity / spec: as the reference (``per_tensor``, ``per_token``, ``block_1x128``,
            ``block_128x128``; ``spec`` wins).
        check: raise on NaN/inf (one device->host sync).
    Returns:
        :class:`qpass.quant.fp8.FP8Tensor` (data ``float8_e4m3fn`` same shape as x, float32 decode scales).
    Raises:
        QuantizationError: as the reference.
    """
    from qpass.formats.spec import FP8Spec, Granularity
    from qpass.quant.fp8 import FP8Tensor

    spec = spec or FP8Spec(granularity=Granularity(granularity or "per_tensor"))
    check_shape(x, "fp8_quantize", None, name, site)
    g = spec.granularity
    if g == Granularity.BLOCK_128X128 and x.dim() != 2:
        raise QuantizationError(f"block_128x128 FP8 needs a 2-D weight, got shape={tuple(x.shape)} ({name or site or 'input'})")
    x2 = as_rows(x)
    r, k = x2.shape
    dev = x2.device
    lib = kernel_lib(dev)
    data = torch.empty(r, k, dtype=torch.uint8, device=dev)
    kb = -(-k // 128)
    if g == Granularity.PER_TENSOR:
        gbits = amax_bits_tensor(x2)
        amax, scale, gran, br = gbits.view(torch.float32), torch.empty((), dtype=torch.float32, device=dev), 0, 1
    elif g == Granularity.PER_TOKEN:
        amax, _ = amax_rows(x2, need_global=False)
        gbits = amax.view(torch.int32)
        scale, gran, br = torch.empty(r, 1, dtype=torch.float32, device=dev), 1, 1
    elif g == Granularity.BLOCK_1X128:
        gbits = amax_bits_tensor(x2) if check else None
        amax, scale, gran, br = None, torch.empty(r, kb, dtype=torch.float32, device=dev), 2, 1
    else:
        gbits = amax_bits_tensor(x2) if check else None
        amax, scale, gran, br = None, torch.empty(-(-r // 128), kb, dtype=torch.float32, device=dev), 2, 128
    if check:
        raise_if_nonfinite(gbits, x, "fp8_quantize", name, site)
    lib.fp8.launch_fp8_quant(x2, amax, spec.zero_amax_scale, data, scale, gran, br)
    return FP8Tensor(data=data.view(torch.float8_e4m3fn).reshape(x.shape), scale=scale, shape=x.shape,
                     orig_dtype=x.dtype, spec=spec)


def mxfp4_quantize_triton(x: torch.Tensor, *, check: bool = True, name: str | None = None, site: str | None = None):
    """MXFP4 quantization with the Triton kernel; bytes equal :func:`qpass.quant.mxfp4.mxfp4_quantize`.

    Args:
        x: bf16/fp16/fp32 ``[..., K]``, ``K % 32 == 0``, finite.
    Returns:
        :class:`qpass.quant.mxfp4.MXFP4Tensor` (codes uint8 ``[..., K/2]``, E8M0 bytes ``[..., K/32]``).
    """
    from qpass.quant.mxfp4 import BLOCK as MX_BLOCK
    from qpass.quant.mxfp4 import MXFP4Tensor

    check_shape(x, "mxfp4_quantize", MX_BLOCK, name, site)
    x2 = as_rows(x)
    r, k = x2.shape
    if check:
        raise_if_nonfinite(amax_bits_tensor(x2), x, "mxfp4_quantize", name, site)
    codes = torch.empty(r, k // 2, dtype=torch.uint8, device=x2.device)
    scales = torch.empty(r, k // MX_BLOCK, dtype=torch.uint8, device=x2.device)
    kernel_lib(x2.device).mxfp4.launch_mxfp4_quant(x2, codes, scales)
    lead = x.shape[:-1]
    return MXFP4Tensor(codes=codes.reshape(*lead, k // 2), scales=scales.reshape(*lead, k // MX_BLOCK), shape=x.shape,
                       orig_dtype=x.dtype)
