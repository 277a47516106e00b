"""Host side of ``kernels/nvfp4_act.cu``: NVFP4 activation operands for the rollout GEMMs.

:func:`act_operands` quantizes one forward batch ``x [M, K]`` (SPEC §3 with a dynamic per-tensor or
per-token global scale) and returns the exact GEMM operand ``B_X = e2m1·s_b`` (bf16) with ``S_dec_X``;
with RAC (SPEC §2, ``mode: masked``, ``selection: batch`` or ``static``) also the compensation operand
``B_R = M_S ⊙ (e2m1_R·s_b,R)`` with ``S_dec_R`` (SPEC §3.1: two accumulations, two alphas). Launches:
``act_amax`` + ``act_quant`` (+ ``rac_select`` + ``rac_residual`` with RAC), all on torch's stream,
no host synchronisation unless value checks are on (then non-finite inputs raise, naming the site).
"""

from __future__ import annotations

import dataclasses

import torch

from qpass.errors import QuantizationError
from qpass.backends.cuda import runtime

_X_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
THREADS = 256
SELECT_THREADS = 1024
# stage 1 of the one-CTA radix select (nvfp4_act.cu SEL_AGG): 0 plain shared atomics, 1 ballot-grouped,
# 2 __match_any_sync-grouped; cuda_check's select_variants checks and times each
SELECT_AGG = 0
# one CTA runs the whole chain (act_fused) up to this many elements / rows / channels: the decode
# batches; larger batches take the multi-CTA kernels
FUSED_MAX_ELEMS = 16384
FUSED_MAX_ROWS = 128
FUSED_MAX_K = 16384
# dynamic shared memory a one-CTA RAC launch may take (H100/H200 allow 227 KiB per block; the static
# arrays of act_fused take ~5 KiB): the K scores always fit (8 * FUSED_MAX_K = 128 KiB)
SMEM_BUDGET = 200 * 1024
SCORE_BYTES = 8  # one channel score (u64) in shared memory: act_fused's and rac_select's keys
# RAC's K bound: it came from run 3's u16 candidate list (removed in run 4); kept unchanged until a GPU run checks
# the select above K = 14336, the largest K cuda_check's activation checks take
MAX_RAC_K = 65535


@dataclasses.dataclass(frozen=True)
class ActOperands:
    """``bx`` bf16 [M, K] = e2m1·s_b of Q_A(x); ``s_dec_x`` float32 [1] or [M]; with RAC ``br`` bf16
    [M, K] (zero outside the selected channels) and ``s_dec_r``; ``mask`` int32 bitmap [ceil(K/32)]."""

    bx: torch.Tensor
    s_dec_x: torch.Tensor
    br: torch.Tensor | None = None
    s_dec_r: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    amax_bits: torch.Tensor | None = None


def _sms(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


def supported(x: torch.Tensor) -> bool:
    return (x.is_cuda and runtime.available() and x.dim() == 2 and x.dtype in _X_KIND and x.shape[1] % 16 == 0
            and x.stride(1) == 1 and x.stride(0) % 16 == 0 and x.data_ptr() % 64 == 0)


def channel_mask(channels: torch.Tensor, k_dim: int) -> torch.Tensor:
    """int32 bitmap [ceil(K/32)] with bit ``j`` set for each channel ``j`` (static RAC channels)."""
    words = torch.zeros((k_dim + 31) // 32, dtype=torch.int64, device=channels.device)
    ch = channels.to(torch.int64)
    words.scatter_add_(0, ch // 32, torch.ones_like(ch) << (ch % 32))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, as int32


def fused_smem_bytes(m: int, k: int, *, rac: bool) -> tuple[int, bool]:
    """Dynamic shared memory of one ``act_fused`` launch and whether it keeps the residual there:
    the K channel scores (8 bytes each; reserved also with static channels), then R (4 bytes per
    element) when both fit in ``SMEM_BUDGET`` bytes."""
    if not rac:
        return 0, False
    base = SCORE_BYTES * k
    with_r = base + 4 * m * k
    return (with_r, True) if with_r <= SMEM_BUDGET else (base, False)


def one_cta(m: int, k: int) -> bool:
    """Whether ``act_operands`` gives a batch of ``m`` rows x ``k`` channels to the one-CTA kernel by
    default (run 4's sweep: the faster RAC path at all 16 measured points)."""
    return m * k <= FUSED_MAX_ELEMS and m <= FUSED_MAX_ROWS and k <= FUSED_MAX_K


def raise_if_not_finite(amax_bits: torch.Tensor, site: str | None) -> None:
    """QuantizationError when an amax (float bits) is NaN or inf (synchronises with the host)."""
    if bool((amax_bits.view(torch.int32) >= 0x7F800000).any()):
        raise QuantizationError(f"activation at site {site} has NaN or inf values (nvfp4_quantize)")


def _fused(x, base, *, per_token, rac_k, static_mask, lim, check, site, profile=None) -> ActOperands:
    """The one-CTA chain (``act_fused``): same outputs as the multi-CTA kernels. ``profile``: an int64
    [12] CUDA tensor that receives (clock64, globaltimer ns) after each phase (``phase_profile``)."""
    m, k = x.shape
    dev = x.device
    rac = bool(rac_k)
    n_r = m if per_token else 1
    bx = torch.empty(m, k, dtype=torch.bfloat16, device=dev)
    s_dec_x = torch.empty(n_r, dtype=torch.float32, device=dev)
    amax_bits = torch.empty(n_r, dtype=torch.int32, device=dev)
    mask = torch.empty((k + 31) // 32, dtype=torch.int32, device=dev) if rac else None
    br = torch.empty(m, k, dtype=torch.bfloat16, device=dev) if rac else None
    s_dec_r = torch.empty(n_r, dtype=torch.float32, device=dev) if rac else None
    smem, keep_r = fused_smem_bytes(m, k, rac=rac)
    kern = runtime.get_kernel("nvfp4_act", "act_fused", dict(base, RAC=int(rac), THREADS=SELECT_THREADS, SEL_AGG=SELECT_AGG), dev.index or 0)
    runtime.launch(kern, (1, 1, 1), (SELECT_THREADS, 1, 1),
                   [x, m, k, x.stride(0), bx, bx.stride(0), s_dec_x, lim, amax_bits, int(rac_k or 0),
                    static_mask, mask, br, 0 if br is None else br.stride(0), s_dec_r, int(keep_r), profile],
                   "piiipipfpipppipip", shared_bytes=smem)
    if check:
        raise_if_not_finite(amax_bits, site)
    return ActOperands(bx, s_dec_x, br, s_dec_r, mask, amax_bits=amax_bits)


def act_operands(x: torch.Tensor, *, per_token: bool = False, rac_k: int | None = None,
                 static_mask: torch.Tensor | None = None, lim: float | None = None, check: bool = False,
                 site: str | None = None, fused: bool | None = None,
                 profile: torch.Tensor | None = None) -> ActOperands:
    """Quantize ``x [M, K]`` to the W4A4 operands (module docstring).

    Args:
        x: bf16/fp16/fp32 ``[M, K]`` on CUDA, ``K % 16 == 0``, rows 16-element aligned.
        per_token: one global scale per row (else one per tensor).
        rac_k: number of compensated channels (None or 0: no RAC). With ``static_mask`` (an int32
            bitmap, :func:`channel_mask`) the channels are given; otherwise the batch top-k by the
            exact scores of ``qpass.quant.rac``.
        lim: the saturation bound of the residual's ``x_hat`` (default: the bf16 max, as
            ``qpass.quant.rac.activation_residual``: no fp16-range clamp, the GEMM multiplies ``B_X``).
        check: raise on NaN/inf input (synchronises with the host).
        fused: force (True) or forbid (False) the one-CTA kernel; default: by size.
        profile: int64 [12] CUDA tensor for the one-CTA kernel's phase clocks (benchmarks only).
    Raises:
        QuantizationError: a shape the kernels do not take, or (``check``) a non-finite input.
    """
    if not supported(x) or (rac_k and x.shape[1] > MAX_RAC_K):
        raise QuantizationError(f"act_operands cannot take x {tuple(x.shape)} {x.dtype} at site {site}"
                                + (f" (RAC needs K <= {MAX_RAC_K})" if rac_k and x.shape[1] > MAX_RAC_K else ""))
    from qpass.quant.nvfp4 import act_operand_limit

    m, k = x.shape
    dev = x.device
    di = dev.index or 0
    lim = act_operand_limit(torch.bfloat16) if lim is None else lim
    rac = bool(rac_k)
    base = dict(X_KIND=_X_KIND[x.dtype], PER_TOKEN=int(per_token), THREADS=THREADS)
    if fused or (fused is None and one_cta(m, k)):
        return _fused(x, base, per_token=per_token, rac_k=rac_k, static_mask=static_mask, lim=lim, check=check, site=site,
                      profile=profile)
    blocks = m * (k // 16)
    grid = max(1, min(4 * _sms(dev), -(-blocks // THREADS)))
    p = m if per_token else max(1, min(2 * _sms(dev), -(-blocks // THREADS)))
    partial = torch.empty(p, dtype=torch.int32, device=dev)
    n_r = m if per_token else 1
    scratch = torch.empty(2 * k + n_r if rac else 2, dtype=torch.int32, device=dev)
    ka = runtime.get_kernel("nvfp4_act", "act_amax", base, di)
    runtime.launch(ka, (p, 1, 1), (THREADS, 1, 1), [x, m, k, x.stride(0), partial, scratch, scratch.numel()], "piiippi")
    bx = torch.empty(m, k, dtype=torch.bfloat16, device=dev)
    s_dec_x = torch.empty(n_r, dtype=torch.float32, device=dev)
    scores = scratch[: 2 * k].view(torch.int64) if rac and static_mask is None else None
    ramax = scratch[2 * k:] if rac else None
    kq = runtime.get_kernel("nvfp4_act", "act_quant", dict(base, RAC=int(rac)), di)
    qgrid = max(1, min(k // 16, 4 * _sms(dev))) if rac else grid  # RAC: one CTA per 16-channel column block
    runtime.launch(kq, (qgrid, 1, 1), (THREADS, 1, 1),
                   [x, m, k, x.stride(0), partial, p, bx, bx.stride(0), s_dec_x, lim, scores, ramax], "piiipipipfpp")
    if check:
        raise_if_not_finite(partial, site)
    if not rac:
        return ActOperands(bx, s_dec_x, amax_bits=partial)
    if static_mask is None:
        mask = torch.empty((k + 31) // 32, dtype=torch.int32, device=dev)
        ks = runtime.get_kernel("nvfp4_act", "rac_select", dict(base, THREADS=SELECT_THREADS, SEL_AGG=SELECT_AGG), di)
        smem_keys = SCORE_BYTES * k <= SMEM_BUDGET  # the keys in shared memory: the select passes read it, not L2
        runtime.launch(ks, (1, 1, 1), (SELECT_THREADS, 1, 1), [scores, k, int(rac_k), mask, int(smem_keys)], "piipi",
                       shared_bytes=SCORE_BYTES * k if smem_keys else 0)
    else:
        mask = static_mask
    br = torch.empty(m, k, dtype=torch.bfloat16, device=dev)
    s_dec_r = torch.empty(n_r, dtype=torch.float32, device=dev)
    kr = runtime.get_kernel("nvfp4_act", "rac_residual", base, di)
    runtime.launch(kr, (grid, 1, 1), (THREADS, 1, 1),
                   [x, m, k, x.stride(0), partial, p, ramax, mask, br, br.stride(0), s_dec_r, lim], "piiipipppipf")
    return ActOperands(bx, s_dec_x, br, s_dec_r, mask, amax_bits=partial)
