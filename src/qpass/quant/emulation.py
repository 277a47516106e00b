"""Other libraries' NVFP4 arithmetic, emulated bit for bit in plain torch (named modes).

Every mode is a pure function ``mode(x, amax=None) -> NVFP4Tensor`` with the reference container
(:class:`qpass.quant.nvfp4.NVFP4Tensor`), so its bytes compare directly with the reference
quantizer's (SPEC §3). The modes differ only where the libraries differ (see
``prior-art/nvfp4_semantics.md`` §4 and §8, D1/D2/D4/D5):

::

    mode                     global scale (fp32)          block scale before E4M3       zero/tiny scale     element op
    te_reference             S_enc = fl(2688/amax)        fl(vmax*fl(S_enc*fl(1/6)))    0 kept, enc=FLT_MAX x*fl(1/fl(s*S_dec))
    vllm_sglang              gs = fl(2688/amax)           fl(gs*fl(vmax*fl(1/6)))       0 kept, enc=0       x*fl(1/fl(s*fl(1/gs)))
    torchao                  pts = fl(amax/2688)          fl(fl(vmax/6)/pts)            clamp [2^-6, 448]   x*fl(fl(1/pts)/s)
    torchao_cuda             pts = fl(amax*fl(1/2688))    fl(fl(vmax*fl(1/6))/pts)      clamp [2^-6, 448]   x*fl(fl(1/pts)/s)
    modelopt_export          w2 = fl(amax/2688)           fl(vmax/fl(6*w2))             exact 0 -> 1.0      x/fl(s*w2)
    modelopt_export_cuda     w2 = fl(amax*fl(1/2688))     fl(vmax/fl(6*w2))             exact 0 -> 1.0      x/fl(s*w2)
    compressed_tensors       gs = fl(fl(1/amax)*2688)     fl(gs*fl(vmax/6))             E4M3 0 -> 0.125     x/fl(s/gs)
    compressed_tensors_cuda  gs = fl(fl(1/amax)*2688)     fl(gs*fl(vmax*fl(1/6)))       E4M3 0 -> 0.125     x/fl(s/gs)

All modes: E4M3 cast round-to-nearest-even, saturating at 448; E2M1 round-to-nearest-even with the
same saturation at +-6; element ``2j`` in the low nibble; ``fl`` = one IEEE float32 rounding.

**Which global bits a mode reports.** Each returned tensor carries both conventions so that
:func:`qpass.parity.identify.identify` can match a foreign global scale stored either way:
``s_dec`` is the decode multiplier the library stores or applies (``value = code * s_b * s_dec``)
and ``s_enc`` the encode scale it stores or passes to its kernel. Where a library only has one of
the two, the other is the reciprocal its consumers compute (documented per mode).

**What a GEMM does with a mode's bytes** (SPEC §3.1): the same as with qpass's own. The rollout ops
multiply ``B = e2m1 * s_b`` of the codes and block-scale bytes and put the stored decode multiplier
``s_dec`` into the epilogue ``alpha``, whichever convention produced it; for ModelOpt's
(``weight_scale_2 = fl(amax / 2688)``) that is its ``S_dec`` as stored, never a value recomputed
from ``S_enc`` (``tests/test_factored_decode.py``, the ``modelopt`` arithmetic through the rollout op
and the learner op).

**CPU vs CUDA eager PyTorch.** ``tensor / python_scalar`` is an IEEE division on CPU but
``tensor * fl(1/scalar)`` on CUDA, where a CPU-scalar divisor is turned into a multiplication by its
reciprocal (``aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu``, ``div_true_kernel_cuda``).
Python-level quantizers (torchao, ModelOpt, compressed-tensors) therefore produce different bytes on
a GPU than on a CPU; the ``*_cuda`` modes emulate the GPU lowering. They are derived from the
PyTorch source and were not measured on a GPU here. ``python_scalar / tensor`` is
``tensor.reciprocal() * scalar`` on every device (``torch/_tensor.py``, ``Tensor.__rtruediv__``).

Note on compressed-tensors: ``prior-art/nvfp4_semantics.md`` §8/§9 evaluate its arithmetic with
``gs = fl(2688/amax)``; the library's ``448*6 / amax`` on a tensor is two roundings, which moves
``gs`` by an ulp for many amax values and flips its D1 and D2 examples (see ``tests/test_emulation.py``).

Not emulated: the ``rcp.approx.ftz.f32`` of the vLLM/SGLang/FlashInfer-default CUDA kernels (D3).
It is off by one ulp from the IEEE reciprocal on ~13 % of inputs and no CPU reference reproduces
it; ``vllm_sglang`` uses exact reciprocals (= vLLM's own torch test reference), so on real kernel
output it may miss by neighbour codes at E2M1 ties.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import torch

from qpass.errors import QuantizationError
from qpass.formats.e4m3 import E4M3_MIN_NORMAL, e4m3_round_magnitude
from qpass.formats.fp32 import FLT_MAX, FP4_E2M1_MAX, FP8_E4M3_MAX, NVFP4_GLOBAL_NUMERATOR
from qpass.formats.spec import NVFP4_WEIGHT
from qpass.quant.checks import check_float_input
from qpass.quant.nvfp4 import BLOCK, ONE_SIXTH, NVFP4Tensor, blocks_and_vmax, encode_scaled, global_scales, quantize_with_amax

EmulationFn = Callable[..., NVFP4Tensor]

EMULATIONS: dict[str, EmulationFn] = {}
"""Registered emulation modes, name -> ``fn(x, amax=None) -> NVFP4Tensor`` (registration order)."""


@dataclasses.dataclass(frozen=True)
class EmulationInfo:
    """What a mode emulates.

    Attributes:
        name: registry key.
        native_global: how the library stores its global scale: ``decode`` (a multiplier,
            ``amax/2688``-like: torchao, ModelOpt) or ``encode`` (``2688/amax``-like: TE's
            quantizer, vLLM/SGLang kernels, compressed-tensors).
        source: the library file/function the arithmetic was read from.
    """

    name: str
    native_global: Literal["decode", "encode"]
    source: str


EMULATION_INFO: dict[str, EmulationInfo] = {}


def register_emulation(
    name: str, *, native_global: Literal["decode", "encode"], source: str
) -> Callable[[EmulationFn], EmulationFn]:
    """Decorator: add ``fn`` to :data:`EMULATIONS` under ``name``.

    Raises:
        ValueError: ``name`` already registered.
    """

    def deco(fn: EmulationFn) -> EmulationFn:
        if name in EMULATIONS:
            raise ValueError(f"emulation mode {name!r} is already registered")
        EMULATIONS[name] = fn
        EMULATION_INFO[name] = EmulationInfo(name=name, native_global=native_global, source=source)
        return fn

    return deco


def emulate(mode: str, x: torch.Tensor, amax: torch.Tensor | float | None = None) -> NVFP4Tensor:
    """Run emulation ``mode`` on ``x``.

    Raises:
        KeyError: unknown mode (the message lists the registered ones).
        QuantizationError: as the mode itself.
    """
    if mode not in EMULATIONS:
        raise KeyError(f"unknown NVFP4 emulation mode {mode!r}; known: {list(EMULATIONS)}")
    return EMULATIONS[mode](x, amax)


# ------------------------------------------------------------------------------------------------
# shared pieces


def _c(t: torch.Tensor, value: float) -> torch.Tensor:
    """float32 constant ``fl(value)`` shaped like ``t``."""
    return torch.full_like(t, value, dtype=torch.float32)


def _div_by_python_scalar(t: torch.Tensor, c: float, lowering: Literal["cpu", "cuda"]) -> torch.Tensor:
    """Eager ``t / c`` for float32 ``t`` and a python float ``c`` as PyTorch lowers it.

    CPU: IEEE ``fl(t / fl(c))``. CUDA: ``fl(t * fl(1/fl(c)))`` (``div_true_kernel_cuda``).
    """
    if lowering == "cpu":
        return t / _c(t, c)
    inv = _c(t, 1.0) / _c(t, c)
    return t * inv


def _prepare(
    x: torch.Tensor, amax: torch.Tensor | float | None, mode: str, *, zero_amax_why: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate ``x`` and ``amax``; return ``(blocks fp32 [..., K/16, 16], vmax [..., K/16], amax fp32)``.

    ``amax`` may be ``()`` or ``x.shape[:-1] + (1,)`` (per row); ``None`` = ``max|x|``. A stale
    amax (smaller than ``max|x|``) is accepted on purpose: libraries that do not check it (D7) are
    emulated as they behave. ``zero_amax_why``: the library has no bytes for ``amax == 0`` (the
    reason, for the error), checked last.
    """
    check_float_input(x, op=f"nvfp4 emulation {mode!r}", multiple_of=BLOCK)
    xb, vmax = blocks_and_vmax(x)
    if amax is None:
        amax_t = x.detach().abs().amax().float()
    else:
        lead = x.shape[:-1]
        amax_t = torch.as_tensor(amax, dtype=torch.float32, device=x.device)
        if amax_t.numel() == 1:
            amax_t = amax_t.reshape(())
        if not bool(torch.isfinite(amax_t).all()) or bool((amax_t < 0).any()):
            raise QuantizationError(f"nvfp4 emulation {mode!r}: amax must be finite and >= 0, got {amax_t.flatten()[:4].tolist()}")
        if amax_t.dim() != 0 and tuple(amax_t.shape) != tuple(lead) + (1,):
            raise QuantizationError(f"nvfp4 emulation {mode!r}: amax shape {tuple(amax_t.shape)} fits neither () nor {tuple(lead) + (1,)}")
    if zero_amax_why is not None and bool((amax_t == 0).any()):
        raise QuantizationError(f"nvfp4 emulation {mode!r}: amax == 0 has no defined bytes in this library ({zero_amax_why})")
    return xb, vmax, amax_t


def _finish(
    x: torch.Tensor, y: torch.Tensor, s_b: torch.Tensor, s_dec: torch.Tensor, s_enc: torch.Tensor, amax: torch.Tensor
) -> NVFP4Tensor:
    """Encode already-scaled ``y`` (fp32 blocks, NaN -> +6 as a searchsorted/clamp chain would give)
    and wrap everything in an :class:`NVFP4Tensor`."""
    y = torch.where(torch.isnan(y), _c(y, FP4_E2M1_MAX), y)
    y = torch.clamp(y, -FP4_E2M1_MAX, FP4_E2M1_MAX)
    return encode_scaled(x, y, s_b, s_dec=s_dec, s_enc=s_enc, amax=amax, spec=NVFP4_WEIGHT)


def _usable_global(g: torch.Tensor, mode: str, name: str) -> None:
    """Reject a derived global scale that is 0 or not finite (a tiny/huge amax under/overflowed it)."""
    if not bool(torch.isfinite(g).all()) or bool((g == 0).any()):
        raise QuantizationError(
            f"nvfp4 emulation {mode!r}: {name} = {g.flatten()[:4].tolist()} (amax under/overflowed it); "
            "the library would produce NaN scales here"
        )


# ------------------------------------------------------------------------------------------------
# modes


@register_emulation(
    "te_reference",
    native_global="encode",
    source="TransformerEngine transformer_engine/pytorch/custom_recipes/reference_nvfp4.py (and "
    "common/cast/nvfp4/core_nvfp4.cuh); = qpass.quant.nvfp4.nvfp4_quantize (SPEC §3)",
)
def te_reference(x: torch.Tensor, amax: torch.Tensor | float | None = None) -> NVFP4Tensor:
    """The qpass reference recipe (SPEC §3 = TransformerEngine reference = FlashInfer exact mode).

    Same arithmetic as :func:`qpass.quant.nvfp4.nvfp4_quantize` (it calls the same
    :func:`~qpass.quant.nvfp4.quantize_with_amax`), minus the stale-amax check.

    Args:
        x: bf16/fp16/fp32 ``(..., K)``, ``K % 16 == 0``, finite.
        amax: float32 max-abs value (``()`` or per row ``(..., 1)``), default ``max|x|``.
    Returns:
        NVFP4Tensor; ``s_enc = fl(2688/amax)`` (divisor), ``s_dec = fl(1/s_enc)`` (multiplier).
    Raises:
        QuantizationError: bad input (see :func:`qpass.quant.checks.check_float_input`).
    Source: TE ``reference_nvfp4.py`` (``prior-art/nvfp4_semantics.md`` §4, §10).
    """
    _, _, amax_t = _prepare(x, amax, "te_reference")
    return quantize_with_amax(x, amax_t)


@register_emulation(
    "vllm_sglang",
    native_global="encode",
    source="vLLM csrc/quantization/fp4/nvfp4_utils.cuh cvt_warp_fp16_to_fp4 + nvfp4_quant_kernels.cu "
    "(scaled_fp4_quant); sgl-kernel csrc/gemm/nvfp4_quant.cuh; vLLM tests/kernels/quantization/"
    "test_nvfp4_quant.py ref_nvfp4_quant",
)
def vllm_sglang(x: torch.Tensor, amax: torch.Tensor | float | None = None) -> NVFP4Tensor:
    """vLLM / SGLang CUDA ``scaled_fp4_quant`` order, with exact (IEEE) reciprocals.

    ``gs`` (the kernel's ``SFScale``, an **encode** scale supplied by the caller) is taken as
    ``fl(2688/amax)`` (1 for amax 0), the reference S_enc.

        s_b = e4m3_satfinite(fl(gs * fl(vmax * fl(1/6))))        # different association from TE (D1)
        enc = s_b != 0 ? fl(1 / fl(s_b * fl(1/gs))) : 0           # kernel: rcp.approx.ftz twice
        q   = e2m1_rne(clamp(fl(x * enc), -6, 6))

    The kernel computes both reciprocals with ``rcp.approx.ftz.f32``, which is 1 ulp off the IEEE
    value on ~13 % of inputs; that cannot be emulated exactly on a CPU, so this mode uses exact
    reciprocals (as vLLM's own torch test reference ``ref_nvfp4_quant`` does) and differs from real
    kernel output by neighbour codes at E2M1 ties (D3). A zero scale gives multiplier 0 (codes 0,
    value 0; the reference gives saturated codes with a 0 scale: equal after canonicalisation).

    Args / Returns / Raises: as :func:`te_reference`; ``s_enc = gs``, ``s_dec = fl(1/gs)`` (the
    alpha factor vLLM applies).
    Source: vLLM ``nvfp4_utils.cuh:cvt_warp_fp16_to_fp4``, ``test_nvfp4_quant.py:ref_nvfp4_quant``;
    SGLang ``sgl-kernel/csrc/gemm/nvfp4_quant.cuh`` (``prior-art/nvfp4_semantics.md`` §4, D1, D3).
    """
    xb, vmax, amax_t = _prepare(x, amax, "vllm_sglang")
    gs, s_dec = global_scales(amax_t)
    sf = gs * (vmax * _c(vmax, ONE_SIXTH))
    s_b = e4m3_round_magnitude(sf)  # satfinite: clamps at 448 (inf -> 448)
    denom = s_b * s_dec  # s_dec = fl(1/gs)
    enc = torch.where(s_b != 0, _c(denom, 1.0) / denom, torch.zeros_like(denom))
    y = xb * enc.unsqueeze(-1)
    return _finish(x, y, s_b, s_dec, gs, amax_t)


Lowering = Literal["cpu", "cuda"]
LoweredFn = Callable[[torch.Tensor, "torch.Tensor | float | None", Lowering, str], NVFP4Tensor]


def _register_cpu_and_cuda(
    name: str, *, native_global: Literal["decode", "encode"], source: str, cuda_source: str, cuda_doc: str
) -> Callable[[LoweredFn], tuple[EmulationFn, EmulationFn]]:
    """Decorator on one library's arithmetic ``impl(x, amax, lowering, mode)``: register its two
    modes, ``name`` (CPU eager, ``impl.__doc__``) and ``name + "_cuda"`` (the same python code as
    CUDA eager PyTorch lowers it, ``cuda_doc``), and return ``(cpu_fn, cuda_fn)``.

    Raises:
        ValueError: a name already registered.
    """

    def mode_fn(impl: LoweredFn, lowering: Lowering, mode: str, doc: str | None) -> EmulationFn:
        def fn(x: torch.Tensor, amax: torch.Tensor | float | None = None) -> NVFP4Tensor:
            return impl(x, amax, lowering, mode)

        fn.__name__ = fn.__qualname__ = mode
        fn.__doc__ = doc
        return fn

    def deco(impl: LoweredFn) -> tuple[EmulationFn, EmulationFn]:
        cpu = register_emulation(name, native_global=native_global, source=source)(mode_fn(impl, "cpu", name, impl.__doc__))
        cuda_name = f"{name}_cuda"
        cuda = register_emulation(cuda_name, native_global=native_global, source=cuda_source)(
            mode_fn(impl, "cuda", cuda_name, cuda_doc))
        return cpu, cuda

    return deco


@_register_cpu_and_cuda(
    "torchao",
    native_global="decode",
    source="torchao 0.18 torchao/prototype/mx_formats/nvfp4_tensor.py nvfp4_quantize (two-level "
    "branch) and per_tensor_amax_to_scale; CPU eager",
    cuda_source="torchao 0.18 nvfp4_tensor.py nvfp4_quantize run in CUDA eager (div by python scalar = "
    "multiply by its float32 reciprocal, PyTorch div_true_kernel_cuda)",
    cuda_doc="""torchao 0.18 python ``nvfp4_quantize`` as CUDA eager PyTorch lowers it (not GPU-measured).

    Same as :func:`torchao` except the two divisions by python constants become multiplications by
    float32 reciprocals: ``pts = fl(amax * fl(1/2688))`` and ``block_scale = fl(vmax * fl(1/6))``.

    Source: as :func:`torchao`, plus PyTorch ``aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu``.
    """,
)
def _torchao(x: torch.Tensor, amax: torch.Tensor | float | None, lowering: Lowering, mode: str) -> NVFP4Tensor:
    """torchao 0.18 python ``nvfp4_quantize`` with ``per_tensor_scale = amax/2688`` (CPU eager).

        pts = fl(amax / 2688)                                       # decode global scale
        s_b = e4m3(clamp(fl(fl(vmax / 6) / pts), 2^-6, 448))        # never 0, never subnormal (D5)
        q   = e2m1_rne(clamp(fl(x * fl(fl(1/pts) / s_b)), -6, 6))    # since torchao 5c0c8148 (D19)

    ``2^-6`` is ``torch.finfo(torch.float8_e4m3fn).tiny`` (``E4M3_EPS``, the smallest *normal*
    E4M3). torchao's E2M1 cast (``f32_to_f4_unpacked``) is round-to-nearest-even.

    Args:
        x: bf16/fp16/fp32 ``(..., K)``, ``K % 16 == 0``, finite (torchao itself takes bf16/fp32, 2-D).
        amax: float32 max-abs value, default ``max|x|``.
    Returns:
        NVFP4Tensor; ``s_dec = pts`` (torchao's ``per_tensor_scale``, a decode multiplier),
        ``s_enc = fl(1/pts)`` (what torchao hands the MSLK kernel).
    Raises:
        QuantizationError: bad input; ``amax == 0`` (torchao computes 0/0 = NaN scales).
    Source: torchao 0.18 ``prototype/mx_formats/nvfp4_tensor.py``: ``per_tensor_amax_to_scale``,
    ``nvfp4_quantize`` (two-level branch).
    """
    xb, vmax, amax_t = _prepare(x, amax, mode, zero_amax_why="per_tensor_scale = amax/2688 = 0 and block_scale/0 = NaN")
    pts = _div_by_python_scalar(amax_t, NVFP4_GLOBAL_NUMERATOR, lowering)  # per_tensor_amax_to_scale
    _usable_global(pts, mode, "per_tensor_scale")
    block_scale = _div_by_python_scalar(vmax, FP4_E2M1_MAX, lowering)  # max_abs / F4_E2M1_MAX
    scaled = block_scale / pts
    s_b = e4m3_round_magnitude(torch.clamp(scaled, min=E4M3_MIN_NORMAL, max=FP8_E4M3_MAX))
    inv_pts = _c(pts, 1.0) / pts  # (1.0 / per_tensor_scale) = pts.reciprocal() * 1.0
    _usable_global(inv_pts, mode, "1/per_tensor_scale")
    recip = inv_pts / s_b
    y = xb * recip.unsqueeze(-1)
    return _finish(x, y, s_b, pts, inv_pts, amax_t)


torchao, torchao_cuda = _torchao


@_register_cpu_and_cuda(
    "modelopt_export",
    native_global="decode",
    source="NVIDIA Model-Optimizer modelopt/torch/quantization/qtensor/nvfp4_tensor.py "
    "NVFP4QTensor.get_weights_scaling_factor(_2) + quantize (snapshot 5a4242fa); CPU eager",
    cuda_source="Model-Optimizer qtensor/nvfp4_tensor.py export run in CUDA eager (amax/(6*448) lowered to "
    "amax*fl(1/2688))",
    cuda_doc=""":func:`modelopt_export` as CUDA eager lowers it: ``wsf2 = fl(amax * fl(1/2688))`` (not GPU-measured).""",
)
def _modelopt(x: torch.Tensor, amax: torch.Tensor | float | None, lowering: Lowering, mode: str) -> NVFP4Tensor:
    """ModelOpt NVFP4 export (``NVFP4QTensor.quantize``), CPU eager.

        wsf2 = fl(amax / 2688)                         # weight_scale_2, decode
        sf   = fl(vmax / fl(6 * wsf2));  sf == 0 -> 1.0
        s_b  = e4m3(sf)                                # no clamp before the cast; saturating cast
        q    = e2m1_rne(fl(x / fl(s_b * wsf2)))         # searchsorted on the bounds = RNE, sat. at 6

    A nonzero ``sf`` that rounds to E4M3 0 gives ``x/0 = +-inf`` (codes +-6, value 0) and ``0/0``
    NaN (code 6 via ``searchsorted``): those blocks decode to 0 either way. Newer ModelOpt clamps
    ``sf`` at ``2^-9`` before the cast ("so tiny-amax blocks don't underflow to 0"); that version
    differs from this mode only on blocks whose scale would underflow. The E4M3 cast saturates from
    torch 2.12 on (eager torch <= 2.11 gave NaN for ``sf >= 464``, D7/D8).

    Args:
        x: bf16/fp16/fp32 ``(..., K)``, ``K % 16 == 0``, finite.
        amax: float32 max-abs value (ModelOpt: the calibrated ``_amax``), default ``max|x|``.
    Returns:
        NVFP4Tensor; ``s_dec = wsf2`` (stored ``weight_scale_2``), ``s_enc = fl(1/wsf2)`` (not
        stored by ModelOpt: the inverse a loader computes).
    Raises:
        QuantizationError: bad input; ``amax == 0`` (ModelOpt computes 0/0 = NaN block scales).
    Source: Model-Optimizer ``qtensor/nvfp4_tensor.py``: ``get_weights_scaling_factor_2``,
    ``get_weights_scaling_factor``, ``quantize``, ``_cast_fp4``.
    """
    xb, vmax, amax_t = _prepare(x, amax, mode, zero_amax_why="weights_scaling_factor_2 = 0 and vmax/0 = NaN block scales")
    wsf2 = _div_by_python_scalar(amax_t, NVFP4_GLOBAL_NUMERATOR, lowering)  # amax.float() / (6.0*448.0)
    _usable_global(_c(wsf2, FP4_E2M1_MAX) * wsf2, mode, "6 * weights_scaling_factor_2")
    per_block = vmax / (_c(wsf2, FP4_E2M1_MAX) * wsf2)
    per_block = torch.where(per_block == 0, torch.ones_like(per_block), per_block)
    # no clamp at 448: torch >= 2.12 eager saturates the cast (older torch gives NaN, D7/D8)
    s_b = e4m3_round_magnitude(torch.clamp(per_block, max=FLT_MAX))
    denom = s_b * wsf2
    y = xb / denom.unsqueeze(-1)  # s_b == 0 (underflow) -> +-inf -> code +-6, 0/0 -> NaN -> code 6
    return _finish(x, y, s_b, wsf2, _c(wsf2, 1.0) / wsf2, amax_t)


modelopt_export, modelopt_export_cuda = _modelopt


@_register_cpu_and_cuda(
    "compressed_tensors",
    native_global="encode",
    source="compressed-tensors quantization/utils/helpers.py generate_gparam + calculate_qparams, "
    "quantization/lifecycle/forward.py _quantize (snapshot 52792be0); CPU eager",
    cuda_source="compressed-tensors helpers.py calculate_qparams run in CUDA eager (max_val_pos/6.0 lowered "
    "to max_val_pos*fl(1/6))",
    cuda_doc=""":func:`compressed_tensors` as CUDA eager lowers it: ``sf = fl(gs * fl(vmax * fl(1/6)))`` (not GPU-measured).""",
)
def _compressed_tensors(x: torch.Tensor, amax: torch.Tensor | float | None, lowering: Lowering, mode: str) -> NVFP4Tensor:
    """compressed-tensors / llm-compressor NVFP4 (``weight_global_scale`` checkpoints), CPU eager.

        gs  = fl(fl(1/amax) * 2688)                    # `448*6 / amax` is Tensor.__rtruediv__ = reciprocal()*2688
        sf  = fl(gs * fl(vmax / 6))
        s_b = e4m3(clamp(sf, -448, 448));  s_b == 0 -> 0.125
        q   = e2m1_rne(clamp(fl(x / fl(s_b / gs)), -6, 6))

    Note the global scale is **not** ``fl(2688/amax)``: Python evaluates ``448*6 / t`` as
    ``t.reciprocal() * 2688`` (two roundings). This assumes the observer's amax is float32 (a
    bf16 observer value makes the reciprocal a bf16 rounding).

    Args:
        x: bf16/fp16/fp32 ``(..., K)``, ``K % 16 == 0``, finite.
        amax: float32 max-abs value (the observer's), default ``max|x|``.
    Returns:
        NVFP4Tensor; ``s_enc = gs`` (stored ``weight_global_scale``, an encode scale),
        ``s_dec = fl(1/gs)`` (what vLLM's compressed-tensors loader computes).
    Raises:
        QuantizationError: bad input; ``amax == 0`` (``gs = inf``, NaN scales).
    Source: compressed-tensors ``quantization/utils/helpers.py``: ``generate_gparam``,
    ``calculate_qparams``; ``quantization/lifecycle/forward.py``: ``_quantize``.
    """
    xb, vmax, amax_t = _prepare(x, amax, mode, zero_amax_why="global_scale = 2688/0 = inf and inf*0 = NaN block scales")
    gs = (_c(amax_t, 1.0) / amax_t) * _c(amax_t, NVFP4_GLOBAL_NUMERATOR)  # 2688 / t == t.reciprocal()*2688
    _usable_global(gs, mode, "global_scale")
    sf = gs * _div_by_python_scalar(vmax, FP4_E2M1_MAX, lowering)
    s_b = e4m3_round_magnitude(torch.clamp(sf, max=FP8_E4M3_MAX))
    s_b = torch.where(s_b == 0, _c(s_b, 0.125), s_b)
    denom = s_b / gs
    y = xb / denom.unsqueeze(-1)
    return _finish(x, y, s_b, _c(gs, 1.0) / gs, gs, amax_t)


compressed_tensors, compressed_tensors_cuda = _compressed_tensors


def describe_modes() -> str:
    """One line per registered mode: ``name (native global): source``."""
    return "\n".join(f"{i.name} ({i.native_global}): {i.source}" for i in EMULATION_INFO.values())


__all__ = [
    "EMULATIONS",
    "EMULATION_INFO",
    "EmulationInfo",
    "compressed_tensors",
    "compressed_tensors_cuda",
    "describe_modes",
    "emulate",
    "modelopt_export",
    "modelopt_export_cuda",
    "register_emulation",
    "te_reference",
    "torchao",
    "torchao_cuda",
    "vllm_sglang",
]
