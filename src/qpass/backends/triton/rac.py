"""Fused NVFP4 activation quantization with residual activation compensation (SPEC §2), Triton.

Pipeline for ``x [M, K]`` (every step on the device, no host sync when checks are off; the
number of channels ``k = floor(ratio*K)`` is static, so shapes never depend on data):

1. amax kernel: ``max|x|`` (per tensor, or per row + global for per-token activations).
2. one fused pass (``kernels/nvfp4_quant.py``): activation codes/scales, ``x_hat`` (bf16),
   and from ``R = x - x_hat`` the exact int64 channel scores (batch selection), ``|R|``
   (token selection) and ``max|R|`` per channel / per row (the residual's global amax).
3. selection: ``torch.sort`` (stable, descending; ties to the lower index) of the exact scores,
   the same call as ``qpass.quant.rac.topk_channels``.
4. residual pass (``kernels/rac.py``): masked (all of R, then mask) or gathered (selected
   channels as their own blocks).

For the GEMM the kernels write the operands of SPEC §3.1, ``B_X`` and ``B_R`` (``e2m1 * s_b``, exact
in bf16) with their global scales ``S_dec_X`` / ``S_dec_R`` (the GEMM's ``alpha`` and ``alpha_R``);
for parity the dense views ``x_hat`` / ``comp`` of the reference.

Bytes (``qa``, ``qr``), selected channels and operands equal :func:`qpass.quant.rac.rac_reference`.
"""

from __future__ import annotations

import dataclasses

import torch

from qpass.errors import QuantizationError
from qpass.formats.spec import NVFP4Spec
from qpass.quant.nvfp4 import BLOCK, NVFP4Tensor, act_operand_limit
from qpass.quant.rac import RACConfig, RACResult, ceil16, topk_channels
from qpass.backends.triton._config import sync_checks_enabled
from qpass.backends.triton._loader import kernel_lib
from qpass.backends.triton.quantize import amax_and_bits, amax_rows, as_rows, check_shape, raise_if_nonfinite


@dataclasses.dataclass(frozen=True)
class RACOperands:
    """What the W4A4+RAC GEMM consumes (SPEC §3.1: two accumulations, each with its own alpha), or
    the parity views.

    Attributes:
        b_x: bf16 ``[M, K]`` = ``B_X = e2m1 * s_b`` of ``Q_A(X)`` (exact); None in parity/bytes mode.
        s_dec_x: float32 ``[1]`` (per tensor) or ``[M]`` (per token): ``S_dec_X``.
        b_r: bf16 compensation operand ``B_R``: ``[M, K]`` (masked: ``M_S`` applied, or per-token
            gathered scattered back to dense) or ``[M, K']`` (batch/static gathered); None in
            parity/bytes mode.
        s_dec_r: float32 ``[1]`` or ``[M]``: ``S_dec_R``, the residual quantization's global scale.
        gather_idx: int32 ``[K']`` channel per compensation column (-1 = padding) when ``b_r`` is
            ``[M, K']``; None when it is dense.
        result: the :class:`~qpass.quant.rac.RACResult` (parity / bytes mode) or None.
    """

    b_x: torch.Tensor | None
    s_dec_x: torch.Tensor
    b_r: torch.Tensor | None
    s_dec_r: torch.Tensor
    gather_idx: torch.Tensor | None
    result: RACResult | None


def _log2_ceil(m: int) -> int:
    return (m - 1).bit_length() if m > 1 else 0


def _nvt(codes, scales, s_enc, s_dec, amax, shape, dtype, spec, per_row) -> NVFP4Tensor:
    gshape = (shape[0], 1) if per_row else ()
    return NVFP4Tensor(
        codes=codes, scales=scales.view(torch.float8_e4m3fn), s_dec=s_dec.reshape(gshape), s_enc=s_enc.reshape(gshape),
        amax=None if amax is None else amax.reshape(gshape), shape=torch.Size(shape), orig_dtype=dtype, spec=spec,
    )


def _channels_and_count(cfg: RACConfig, kd: int, dev: torch.device, static_channels: torch.Tensor | None, k: int | None,
                        checks: bool, site: str | None) -> tuple[torch.Tensor | None, int]:
    """``(sorted static channels int64 or None, channel count k)``; ``k`` defaults to ``cfg.num_channels(kd)``.

    Raises:
        QuantizationError: static selection without channels, static channels out of ``[0, kd)``
            (with ``checks``), or ``k == 0``.
    """
    ch = None
    if cfg.selection == "static":
        if static_channels is None:
            raise QuantizationError(f"RAC selection 'static' needs calibrated channels at site {site}")
        ch = torch.sort(static_channels.to(device=dev, dtype=torch.int64)).values
        if checks and ch.numel() and (int(ch.min()) < 0 or int(ch.max()) >= kd):
            raise QuantizationError(f"static RAC channels out of range [0, {kd}) at site {site}")
        k = ch.numel()
    elif k is None:
        k = cfg.num_channels(kd)
    if k == 0:
        raise QuantizationError(f"RAC with 0 channels at site {site}: use plain W4A4")
    return ch, k


@dataclasses.dataclass(frozen=True)
class _Run:
    """What one :func:`rac_run` call fixed before its residual pass (``x2 [M, K]``, the outputs it wants)."""

    x2: torch.Tensor
    act_spec: NVFP4Spec
    per_row: bool
    parity: bool
    want_bytes: bool
    want_ops: bool
    lim: float
    lib: object

    def empty(self, *shape: int, dtype: torch.dtype, want: bool = True) -> torch.Tensor | None:
        """An uninitialized buffer on the input's device (None when not ``want``)."""
        return torch.empty(*shape, dtype=dtype, device=self.x2.device) if want else None


def _residual_masked(r: _Run, ch: torch.Tensor, amax_x: torch.Tensor, rcolmax: torch.Tensor | None,
                     rrowmax: torch.Tensor | None) -> tuple:
    """Masked residual pass (all of ``R``, then the channel mask): ``(qr or None, comp, B_R, None, S_dec_R)``."""
    (m, kd), dev, per_row, n_glob = r.x2.shape, r.x2.device, r.per_row, r.x2.shape[0] if r.per_row else 1
    if ch.dim() == 1:
        mask = torch.zeros(kd, dtype=torch.int8, device=dev).index_fill_(0, ch, 1)
    else:
        mask = torch.zeros(m, kd, dtype=torch.int8, device=dev).scatter_(1, ch, 1)
    amax_r = rrowmax.view(torch.float32) if per_row else rcolmax.amax().reshape(1).view(torch.float32)
    comp = r.empty(m, kd, dtype=torch.bfloat16, want=r.want_ops)
    qr_codes = r.empty(m, kd // 2, dtype=torch.uint8, want=r.want_bytes)
    qr_scales = r.empty(m, kd // BLOCK, dtype=torch.uint8, want=r.want_bytes)
    qr_senc = r.empty(n_glob, dtype=torch.float32)
    qr_sdec = r.empty(n_glob, dtype=torch.float32)
    r.lib.rac.launch_residual_masked(
        r.x2, amax_x, amax_r, per_row, mask, codes=qr_codes, scales=qr_scales, comp=comp, s_enc=qr_senc, s_dec=qr_sdec,
        xhat_lim=r.lim, operand=not r.parity,
    )
    qr = None
    if r.want_bytes:
        qr = _nvt(qr_codes, qr_scales, qr_senc, qr_sdec, amax_r.clone(), (m, kd), torch.float32, r.act_spec, per_row)
    return qr, comp, comp, None, qr_sdec


def _residual_gathered(r: _Run, ch: torch.Tensor, k: int, qa_codes: torch.Tensor, qa_scales: torch.Tensor,
                       qa_sdec: torch.Tensor, rcolmax: torch.Tensor | None, rabs: torch.Tensor | None) -> tuple:
    """Gathered residual pass (the selected channels as their own blocks): ``(qr or None, comp, B_R,
    gather index int32 or None (B_R dense), S_dec_R, gather index int64)``."""
    (m, kd), dev, per_row, n_glob = r.x2.shape, r.x2.device, r.per_row, r.x2.shape[0] if r.per_row else 1
    kp = max(ceil16(k), BLOCK)
    idx = torch.full((*ch.shape[:-1], kp), -1, dtype=torch.int32, device=dev)
    idx[..., :k] = ch
    if per_row:
        amax_g = None  # the kernel sweeps each row's own channels first
    elif ch.dim() == 1:
        amax_g = rcolmax.view(torch.float32).index_select(0, ch).amax().reshape(1)
    else:  # token selection, per-tensor residual scale: max |R| over each row's own channels
        amax_g = torch.gather(rabs, 1, ch).amax().reshape(1)
    comp_g = r.empty(m, kp, dtype=torch.bfloat16, want=r.want_ops)
    dense = torch.zeros(m, kd, dtype=torch.bfloat16, device=dev) if ch.dim() == 2 and r.want_ops else None
    qr_codes = r.empty(m, kp // 2, dtype=torch.uint8, want=r.want_bytes)
    qr_scales = r.empty(m, kp // BLOCK, dtype=torch.uint8, want=r.want_bytes)
    qr_senc = r.empty(n_glob, dtype=torch.float32)
    qr_sdec = r.empty(n_glob, dtype=torch.float32)
    r.lib.rac.launch_residual_gathered(
        r.x2, qa_codes, qa_scales, qa_sdec, idx, amax_g, per_row,
        codes=qr_codes, scales=qr_scales, comp=comp_g, dense=dense, s_enc=qr_senc, s_dec=qr_sdec, xhat_lim=r.lim,
        operand=not r.parity,
    )
    gemm_comp, gidx = (dense, None) if dense is not None else (comp_g, idx)
    qr = None
    if r.want_bytes:
        qr = _nvt(qr_codes, qr_scales, qr_senc, qr_sdec, None if amax_g is None else amax_g.clone(), (m, kp),
                  torch.float32, r.act_spec, per_row)
    return qr, comp_g, gemm_comp, gidx, qr_sdec, idx.to(torch.int64)


def rac_run(
    x: torch.Tensor,
    cfg: RACConfig,
    act_spec: NVFP4Spec,
    *,
    static_channels: torch.Tensor | None = None,
    site: str | None = None,
    outputs: str = "parity",
    k: int | None = None,
) -> RACOperands:
    """Run the RAC pipeline on ``x [M, K]`` (bf16/fp16/fp32, ``K % 16 == 0``).

    Args:
        x, cfg, act_spec, static_channels, site: as :func:`qpass.quant.rac.rac_reference`.
        outputs: ``"parity"``: everything the reference returns (``qa``/``qr`` bytes, ``x_hat``,
            ``comp``, channels, gather index, and ``residual`` formed in torch) as a
            :class:`RACResult`; ``"gemm"``: only the GEMM operands (``B_X``, ``B_R``, their
            ``S_dec``, index);
            ``"bytes"``: only the quantized bytes (``qa``, ``qr``, channels, index) in a
            :class:`RACResult` whose ``x_hat``/``comp``/``residual`` are None.
        k: channels to compensate as the op's call derived them (``NVFP4LinearCall.rac_k``);
            default ``cfg.num_channels(K)`` (static selection: the number of calibrated channels).
    Raises:
        QuantizationError: bad shape/dtype; with sync checks on: NaN/inf input, out-of-range
            static channels; ``k == 0`` (callers use plain W4A4 then).
    """
    if x.dim() != 2:
        raise QuantizationError(f"RAC expects [M, K], got shape={tuple(x.shape)} at site {site}")
    if outputs not in ("parity", "gemm", "bytes"):
        raise ValueError(f"outputs must be 'parity', 'gemm' or 'bytes', got {outputs!r}")
    parity = outputs == "parity"
    want_bytes = outputs in ("parity", "bytes")
    want_ops = outputs in ("parity", "gemm")
    check_shape(x, "nvfp4_quantize", BLOCK, "activation", site)
    x2 = as_rows(x)
    m, kd = x2.shape
    dev = x2.device
    lib = kernel_lib(dev)
    checks = sync_checks_enabled(dev)
    per_row = act_spec.global_scope == "per_token"
    lim = act_operand_limit(torch.bfloat16)  # x_hat = the bf16 dequant (rac_reference: no fp16-range clamp)
    sel = cfg.selection
    gathered = cfg.mode == "gathered"

    ch, k = _channels_and_count(cfg, kd, dev, static_channels, k, checks, site)

    # 1. amax
    amax_x, gbits = amax_rows(x2) if per_row else amax_and_bits(x2, False)
    if checks:
        raise_if_nonfinite(gbits, x, "nvfp4_quantize", "activation", site)

    # 2. fused activation quantization + residual statistics
    n_glob = m if per_row else 1
    write_qa = want_bytes or gathered
    qa_codes = torch.empty(m, kd // 2, dtype=torch.uint8, device=dev) if write_qa else None
    qa_scales = torch.empty(m, kd // BLOCK, dtype=torch.uint8, device=dev) if write_qa else None
    qa_senc = torch.empty(n_glob, dtype=torch.float32, device=dev)
    qa_sdec = torch.empty(n_glob, dtype=torch.float32, device=dev)
    x_hat = torch.empty(m, kd, dtype=torch.bfloat16, device=dev) if parity else None  # the dense view
    b_x = torch.empty(m, kd, dtype=torch.bfloat16, device=dev) if want_ops and not parity else None  # B_X
    need_rstats = not (gathered and per_row)
    # the atomically accumulated statistics share one zero-filled buffer (one memset launch)
    n_sc = kd if sel == "batch" else 0
    n_st = (kd + m) if need_rstats else 0
    stats = torch.zeros(8 * n_sc + 4 * n_st, dtype=torch.uint8, device=dev)
    scores = stats[: 8 * n_sc].view(torch.int64) if n_sc else None
    rcolmax = stats[8 * n_sc: 8 * n_sc + 4 * kd].view(torch.int32) if need_rstats else None
    rrowmax = stats[8 * n_sc + 4 * kd:].view(torch.int32) if need_rstats else None
    rabs = torch.empty(m, kd, dtype=torch.float32, device=dev) if sel == "token" else None
    lib.nvfp4_quant.launch_nvfp4_quant(
        x2, amax_x, per_row, codes=qa_codes, scales=qa_scales, xhat=x_hat, bx=b_x, s_enc=qa_senc, s_dec=qa_sdec,
        gamax_bits=gbits, log2m=_log2_ceil(m), scores=scores, rcolmax=rcolmax, rrowmax=rrowmax, rabs=rabs,
        xhat_lim=lim,
    )

    # 3. selection (exact keys; stable sort: ties -> lower channel index)
    if sel == "batch":
        ch = topk_channels(scores, k)
    elif sel == "token":
        ch = topk_channels(rabs, k)

    # 4. residual quantization
    r = _Run(x2, act_spec, per_row, parity, want_bytes, want_ops, lim, lib)
    if not gathered:
        qr, comp, gemm_comp, gidx, qr_sdec = _residual_masked(r, ch, amax_x, rcolmax, rrowmax)
        gather_index = None
    else:
        qr, comp, gemm_comp, gidx, qr_sdec, gather_index = _residual_gathered(r, ch, k, qa_codes, qa_scales, qa_sdec,
                                                                              rcolmax, rabs)

    result = None
    if want_bytes:
        amax_qa = amax_x.reshape(m, 1) if per_row else amax_x.clone().reshape(())
        qa = _nvt(qa_codes, qa_scales, qa_senc, qa_sdec, amax_qa, (m, kd), x.dtype, act_spec, per_row)
        residual = x2.float() - x_hat.float() if parity else None
        result = RACResult(x_hat, comp, ch, gather_index, qa, qr, residual)
    gemm = want_ops and not parity
    return RACOperands(b_x=b_x, s_dec_x=qa_sdec, b_r=gemm_comp if gemm else None, s_dec_r=qr_sdec,
                       gather_idx=gidx if gemm else None, result=result)


def rac_triton(
    x: torch.Tensor,
    cfg: RACConfig,
    act_spec: NVFP4Spec,
    *,
    static_channels: torch.Tensor | None = None,
    site: str | None = None,
) -> RACResult:
    """Triton twin of :func:`qpass.quant.rac.rac_reference` (same fields, same bytes).

    ``residual`` is formed on request here (``x - x_hat`` in float32) for parity; the kernels never
    store it. Raises as :func:`rac_run`.
    """
    return rac_run(x, cfg, act_spec, static_channels=static_channels, site=site, outputs="parity").result
