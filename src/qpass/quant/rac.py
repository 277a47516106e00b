"""Residual activation compensation (RAC), reference semantics (SPEC §2, QUADS Eq. 21).

For the GEMM input ``X`` ([M, K], one row per token of the current forward batch):

    X_hat = DQ(Q_A(X))                         bf16 (SPEC §3 dequant; the GEMM multiplies B_X, SPEC §3.1)
    R     = fl(float(X) - float(X_hat))        float32 residual
    score: channel j's residual energy, computed *exactly* (see :func:`channel_scores`)
    S     = the k = floor(ratio * K) channels with the largest score; ties -> lower channel index
    masked:   R_hat = M_S * DQ(Q_R(R))          Q_R quantizes all of R in 1x16 blocks, then mask
    gathered: G = R[:, sorted(S)] zero-padded to K' = ceil16(k); R_hat_g = DQ(Q_R(G)) [M, K']
    GEMM input: X_tilde = X_hat + R_hat        (kept as two bf16 operands: two fp32 accumulations)

``Q_R`` is an NVFP4 quantizer with its own dynamic global scale from ``amax`` of the tensor it
quantizes (all of R in masked mode, the gathered G in gathered mode), per tensor or per token like
the activation quantizer.

**Exact scores.** Top-k selection must be identical in every implementation (else the residual
bytes differ), and a float sum of squares depends on summation order. qpass therefore scores a
channel by a fixed-point integer sum: ``t_ij = floor(fl(R_ij^2) * 2^shift)`` as int64 and
``score_j = sum_i t_ij`` (integer addition is associative, so any order, blocking or atomics give
the same bits). ``shift = clamp(61 - ceil(log2 M) - 2*e_a, -100, 100)`` where
``amax(X) = f * 2^e_a`` (frexp); since ``|R| <= |X| (1 + 2^-7)`` every term is
``< 2^(62 - ceil(log2 M))`` and the sum cannot overflow. The ranking equals the L2-norm ranking
up to the fixed-point resolution (~2^-50 of the largest term). ``selection: token`` ranks each row
by ``|R_ij|`` (exact, no sum). ``selection: static`` takes calibrated channels: those of
:func:`static_channels`, the ``batch`` selection applied once to all calibration tokens (the one
function ``qpass calibrate``, the ``residual_compensation`` pass and ``qpass apply``'s residual
map use).

With a static (calibrated) activation scale (``act_spec.global_source == 'static'``), ``Q_A``
uses the calibrated amax (:func:`qpass.quant.nvfp4.nvfp4_quantize_static`) and the score shift
the current ``max|X|`` (for dynamic scales the two are the same bits); ``Q_R`` keeps its dynamic
scale.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction
from typing import Literal

import torch

from qpass.errors import QuantizationError
from qpass.quant.checks import sync_checks_enabled
from qpass.formats.spec import NVFP4_ACT, NVFP4Spec
from qpass.quant.groups import tensor_amax
from qpass.quant.nvfp4 import (BLOCK, NVFP4Tensor, nvfp4_act_operand, nvfp4_act_quantize, nvfp4_dequantize, nvfp4_operand,
                               nvfp4_quantize)

RACMode = Literal["masked", "gathered"]
RACSelection = Literal["batch", "token", "static"]


@dataclasses.dataclass(frozen=True)
class RACConfig:
    """Options of one RAC site (recipe keys of the ``residual_compensation`` pass).

    Attributes:
        ratio: fraction of the K input channels compensated, in [0, 1] (QUADS: 0.5).
        mode: ``masked`` (quantize all of R, then mask) or ``gathered`` (quantize the selected
            channels as their own blocks; compensation GEMM costs ~K').
        selection: ``batch`` (top-k over the whole forward batch), ``token`` (per row,
            batch-invariant selection) or ``static`` (calibrated channels).
    """

    ratio: float
    mode: RACMode = "masked"
    selection: RACSelection = "batch"

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.ratio) <= 1.0:
            raise ValueError(f"RAC ratio must be in [0, 1], got {self.ratio}")
        if self.mode not in ("masked", "gathered"):
            raise ValueError(f"RAC mode must be 'masked' or 'gathered', got {self.mode!r}")
        if self.selection not in ("batch", "token", "static"):
            raise ValueError(f"RAC selection must be 'batch', 'token' or 'static', got {self.selection!r}")

    def num_channels(self, in_features: int) -> int:
        """``k``: the number of compensated channels of a site with ``in_features`` input channels,
        ``floor(ratio * K)`` with ``ratio`` read as the decimal it was written as (0.3 * 10 = 3).

        The one place a ratio becomes ``k``: the op's typed call (:class:`qpass.ops.calls.NVFP4LinearCall`)
        asks once and hands ``k`` to the kernels; passes and exports ask here too.
        """
        return rac_num_channels(in_features, self.ratio)


@functools.lru_cache(maxsize=4096)
def rac_num_channels(k: int, ratio: float) -> int:
    """``floor(ratio * K)`` with ``ratio`` read as the decimal it was written as (0.3 * 10 = 3).

    Use :meth:`RACConfig.num_channels` (this is its arithmetic)."""
    return min(k, math.floor(Fraction(repr(float(ratio))) * k))


def ceil16(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def score_shift(amax_x: torch.Tensor, rows: int) -> int:
    """The fixed-point exponent of :func:`channel_scores` (see module docstring)."""
    a = float(amax_x)
    if a == 0.0:
        return 0
    _, e_a = math.frexp(a)
    c = max(0, math.ceil(math.log2(rows))) if rows > 1 else 0
    return max(-100, min(100, 61 - c - 2 * e_a))


def score_shift_tensor(amax_x: torch.Tensor, rows: int) -> torch.Tensor:
    """:func:`score_shift` computed on ``amax_x``'s device: an int32 scalar tensor, no host sync.

    Same value as ``score_shift(amax_x, rows)`` for every finite float32 amax (``torch.frexp`` gives
    ``math.frexp``'s exponent); the decode step uses this form so that it can be captured as a CUDA
    graph (a ``float(amax)`` would synchronise with the host).
    """
    a = amax_x.detach().float().reshape(())
    _, e_a = torch.frexp(a)
    c = max(0, math.ceil(math.log2(rows))) if rows > 1 else 0
    shift = torch.clamp(61 - c - 2 * e_a.to(torch.int32), -100, 100)
    return torch.where(a == 0, torch.zeros_like(shift), shift)


def residual_terms(r: torch.Tensor, shift: int | torch.Tensor) -> torch.Tensor:
    """int64 ``floor(fl(r*r) * 2^shift)`` elementwise (r float32; ``shift`` an int or int32 scalar tensor)."""
    sq = r * r
    if not isinstance(shift, torch.Tensor):
        shift = torch.tensor(shift, dtype=torch.int32, device=r.device)
    scaled = torch.ldexp(sq, shift.to(device=r.device, dtype=torch.int32))
    return torch.floor(scaled).to(torch.int64)


def channel_scores(r: torch.Tensor, amax_x: torch.Tensor) -> torch.Tensor:
    """Exact per-channel residual energy of ``r`` [M, K] (float32) -> int64 [K] (no host sync)."""
    return residual_terms(r, score_shift_tensor(amax_x, r.shape[0])).sum(dim=0)


def topk_channels(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest scores along the last dim, ties to the lower index, sorted ascending."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.sort(order, dim=-1).values


def activation_residual(x: torch.Tensor, act_spec: NVFP4Spec, *, act_amax: torch.Tensor | None = None,
                        site: str | None = None) -> tuple[NVFP4Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(Q_A(X), X_hat, R, score amax)`` of an activation ``x`` [M, K]: the first lines of the module formula.

    ``X_hat`` = the SPEC §3 dequant rounded to bf16 (satfinite at the bf16 max only),
    ``R = fl(float(X) - float(X_hat))`` float32; the score amax is ``max|X|`` (float32 0-d; ``Q_A``'s
    own amax for dynamic scales: the same bits).
    """
    qa = nvfp4_act_quantize(x, act_spec, act_amax=act_amax, site=site)
    # the GEMMs multiply the exact B_X, so no fp16-range clamp here (a clamped x_hat would compensate a
    # residual the first accumulation never had: x = 65504 in fp16 would come out as 65504 + 224 = inf)
    x_hat = nvfp4_act_operand(qa, torch.bfloat16)
    r = x.float() - x_hat.float()
    score_amax = tensor_amax(x) if act_spec.global_source == "static" else qa.amax.amax()
    return qa, x_hat, r, score_amax


def static_channel_scores(x: torch.Tensor, *, act_spec: NVFP4Spec = NVFP4_ACT, act_amax: torch.Tensor | None = None,
                          site: str | None = None) -> torch.Tensor:
    """int64 ``[K]``: the exact residual energy per channel of calibration activations ``x`` [M, K]
    (:func:`channel_scores` of ``R = X - DQ(Q_A(X))`` over all M rows, shift from ``max|X|``)."""
    if x.dim() != 2:
        raise QuantizationError(f"static RAC calibration expects [M, K], got shape={tuple(x.shape)} at site {site}")
    _, _, r, score_amax = activation_residual(x, act_spec, act_amax=act_amax, site=site)
    return channel_scores(r, score_amax)


def static_channels(x: torch.Tensor, ratio: float, *, act_spec: NVFP4Spec = NVFP4_ACT, act_amax: torch.Tensor | None = None,
                    site: str | None = None) -> torch.Tensor:
    """Calibrated (static) RAC channels of calibration activations ``x`` [M, K]: the ``batch`` selection
    applied once to every calibration token.

    ``S = TopK_k(s)`` with ``s_j`` the exact integer residual energy of channel j
    (:func:`static_channel_scores`) of ``R = X - DQ(Q_A(X))`` over all M rows, ``k = floor(ratio * K)``
    (:func:`rac_num_channels`), ties toward the lower channel index (:func:`topk_channels`).

    Args:
        x: bf16/fp16/fp32 ``[M, K]``, every calibration token of one site (rows in any order: integer
            sums do not depend on it), K % 16 == 0, finite.
        ratio: RAC ratio in [0, 1].
        act_spec: the site's activation spec (per-tensor / per-token dynamic, or static).
        act_amax: the calibrated amax for a static ``act_spec``.
    Returns:
        int64 ``[k]`` channel ids, sorted ascending.
    Raises:
        QuantizationError: bad ``x`` (as :func:`qpass.quant.nvfp4.nvfp4_quantize`).
    Source: SPEC §2 (score, top-k, ties toward the lower channel index).
    """
    scores = static_channel_scores(x, act_spec=act_spec, act_amax=act_amax, site=site)
    return topk_channels(scores, rac_num_channels(x.shape[-1], ratio))


@dataclasses.dataclass(frozen=True)
class RACResult:
    """Everything the two GEMM accumulations need, plus what diagnostics read.

    Attributes:
        x_hat: bf16 [M, K] = DQ(Q_A(X)) (SPEC §3 dequant, bf16; the residual is ``X - x_hat``).
        comp: bf16 compensation operand: [M, K] (masked, zeros outside S) or [M, K'] (gathered).
        channels: int64 selected channels: [k] (batch/static) or [M, k] (token), sorted ascending.
        gather_index: gathered mode only: int64 [K'] or [M, K'] channel index per compensation
            column, -1 for zero padding; None in masked mode.
        qa, qr: the activation and residual quantizations (for parity tests and kernels).
        residual: float32 R [M, K].
    """

    x_hat: torch.Tensor
    comp: torch.Tensor
    channels: torch.Tensor
    gather_index: torch.Tensor | None
    qa: NVFP4Tensor
    qr: NVFP4Tensor
    residual: torch.Tensor


def rac_reference(
    x: torch.Tensor,
    cfg: RACConfig,
    act_spec: NVFP4Spec,
    *,
    static_channels: torch.Tensor | None = None,
    act_amax: torch.Tensor | None = None,
    site: str | None = None,
    k: int | None = None,
) -> RACResult:
    """Quantize an activation with residual compensation (reference, plain torch).

    Args:
        x: bf16/fp16/fp32 [M, K], K % 16 == 0, finite.
        cfg: ratio / mode / selection.
        act_spec: activation NVFP4 spec (per-tensor or per-token dynamic global scale); Q_R uses
            the same global scope.
        static_channels: int64 [k] channel ids, required for ``selection='static'``.
        act_amax: float32 calibrated amax, required for a static ``act_spec`` (``Q_A`` only).
        site: names the site in errors.
        k: channels to compensate, as the op's call derived it (``NVFP4LinearCall.rac_k``);
            default ``cfg.num_channels(K)``.
    Returns:
        :class:`RACResult`.
    Raises:
        QuantizationError: bad input (see :func:`nvfp4_quantize`), or static selection without
            channels / with out-of-range channels.
    """
    if x.dim() != 2:
        raise QuantizationError(f"rac_reference expects [M, K], got shape={tuple(x.shape)} at site {site}")
    m, k_dim = x.shape
    qa, x_hat, r, score_amax = activation_residual(x, act_spec, act_amax=act_amax, site=site)
    res_spec = NVFP4_ACT if act_spec.global_source == "static" else act_spec  # Q_R: its own dynamic scale
    k = cfg.num_channels(k_dim) if k is None else k
    if cfg.selection == "static":
        if static_channels is None:
            raise QuantizationError(f"RAC selection 'static' needs calibrated channels at site {site}")
        ch = torch.sort(static_channels.to(torch.int64).to(x.device)).values
        if ch.numel() and sync_checks_enabled(x.device) and (int(ch.min()) < 0 or int(ch.max()) >= k_dim):
            raise QuantizationError(f"static RAC channels out of range [0, {k_dim}) at site {site}")
    elif cfg.selection == "batch":
        ch = topk_channels(channel_scores(r, score_amax), k)
    else:  # token: rank each row by |R_ij| (exact)
        ch = topk_channels(r.abs(), k)
    if cfg.mode == "masked":
        qr = nvfp4_quantize(r, spec=res_spec, name="residual", site=site)
        r_hat = nvfp4_dequantize(qr, torch.float32)
        mask = channel_mask(ch, m, k_dim)
        comp = torch.where(mask, r_hat, torch.zeros_like(r_hat)).to(torch.bfloat16)
        return RACResult(x_hat, comp, ch, None, qa, qr, r)
    kp = max(ceil16(ch.shape[-1]), BLOCK)
    if ch.dim() == 1:
        index = torch.full((kp,), -1, dtype=torch.int64, device=x.device)
        index[: ch.numel()] = ch
        g = torch.zeros(m, kp, dtype=torch.float32, device=x.device)
        g[:, : ch.numel()] = r[:, ch]
    else:
        index = torch.full((m, kp), -1, dtype=torch.int64, device=x.device)
        index[:, : ch.shape[1]] = ch
        g = torch.zeros(m, kp, dtype=torch.float32, device=x.device)
        g[:, : ch.shape[1]] = torch.gather(r, 1, ch)
    qr = nvfp4_quantize(g, spec=res_spec, name="residual", site=site)  # Q_R follows act_spec's global scope
    comp = nvfp4_dequantize(qr, torch.bfloat16)
    return RACResult(x_hat, comp, ch, index, qa, qr, r)


def channel_mask(channels: torch.Tensor, m: int, k_dim: int) -> torch.Tensor:
    """bool ``[M, K]`` mask ``M_S`` of the selected channels (``[k]`` for every row, or ``[M, k]`` per row)."""
    mask = torch.zeros(m, k_dim, dtype=torch.bool, device=channels.device)
    if channels.dim() == 1:
        mask.index_fill_(1, channels, True)  # not mask[:, ch] = True: its scalar is a host tensor (no H2D copy under capture)
    else:
        mask.scatter_(1, channels, True)
    return mask


def residual_operand(res: RACResult) -> torch.Tensor:
    """``B_R``: the compensation GEMM's operand (SPEC §3.1), float32, in the layout of ``res.comp``.

    ``e2m1(Q_R) * s_b`` without the residual's global scale ``S_dec_R`` (which goes to the second
    accumulation's ``alpha_R = fl(S_dec_R * S_dec_W)``): masked mode ``[M, K]`` with ``M_S`` applied
    (zeros outside the selected channels), gathered mode ``[M, K']`` (the padding columns are 0).
    Exact (see :func:`qpass.quant.nvfp4.nvfp4_operand`).
    """
    b = nvfp4_operand(res.qr)
    if res.gather_index is not None:
        return b
    return torch.where(channel_mask(res.channels, b.shape[0], b.shape[1]), b, torch.zeros_like(b))


def scatter_gathered(comp: torch.Tensor, index: torch.Tensor, k_dim: int) -> torch.Tensor:
    """Dense [M, K] float32 compensation from a gathered operand ([M, K'] + index [K'] or [M, K'])."""
    m = comp.shape[0]
    dense = torch.zeros(m, k_dim + 1, dtype=torch.float32, device=comp.device)  # column K = padding sink
    idx = index.clamp(min=-1) % (k_dim + 1)  # -1 -> K
    if idx.dim() == 1:
        idx = idx.unsqueeze(0).expand(m, -1)
    dense.scatter_add_(1, idx, comp.float())
    return dense[:, :k_dim]
