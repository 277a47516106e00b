"""The parameters a qpass NVFP4 linear registers in an engine: the ``modelopt_fp4`` checkpoint contract.

Pure python (no engine import), so the contract is testable everywhere; the SGLang and vLLM plugins'
``create_weights`` build their parameters from this very table (both engines share the parameter
classes named below: ``sglang.srt.layers.parameter`` / ``vllm.model_executor.parameter``).

Per linear layer partition (``K = input_size_per_partition``, ``N = sum(output_partition_sizes)``,
``S = len(output_partition_sizes)``: 3 for QKV, 2 for gate/up, 1 otherwise):

=================  =======================  ==============  ===========================  =========
name               engine parameter class   dtype           shape                        meaning
=================  =======================  ==============  ===========================  =========
``weight``         ModelWeightParameter     uint8           ``[N, K/2]``  (in 1, out 0)  two E2M1 codes per byte, low nibble = even k
``weight_scale``   ModelWeightParameter     float8_e4m3fn   ``[N, K/16]`` (in 1, out 0)  E4M3 block scale (relative to the global)
``weight_scale_2`` PerTensorScaleParameter  float32         ``[S]``                      ``S_dec`` per shard (a decode multiplier)
``input_scale``    PerTensorScaleParameter  float32         ``[S]``                      accepted for ModelOpt checkpoints; unused
=================  =======================  ==============  ===========================  =========

An **activation-only** site (``quantization_config.qpass_weight: "none"``, the W16A4 rollout of the
``act_qdq`` pass) registers one parameter, :func:`act_only_param_specs`:

=================  =======================  ==============  ===========================  =========
``weight``         ModelWeightParameter     model dtype     ``[N, K]``    (in 1, out 0)  the weight, unquantized (what vLLM's ``UnquantizedLinearMethod`` creates)
=================  =======================  ==============  ===========================  =========

Source: ``prior-art/backends.md`` §1.3 (sglang 0.5.23 ``ModelOptFp4LinearMethod.create_weights``,
identical in vLLM's ``modelopt_fp4``). qpass activations are dynamic (SPEC §3 rule 5), so
``input_scale`` is loaded only to accept ModelOpt-format checkpoints and never read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import torch

from qpass.errors import QuantizationError

NVFP4_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter a linear layer registers.

    Attributes:
        name: attribute name on the layer (and checkpoint tensor suffix).
        kind: engine parameter class (same name in ``sglang.srt.layers.parameter`` and ``vllm.model_executor.parameter``).
        dtype, shape: storage.
        input_dim, output_dim: which dims the engine loaders shard (None for per-shard scalars).
        fill: initial content: ``empty``, ``ones``, or ``unloaded`` (NaN in every element: the
            sentinel :func:`check_site_tensors` and the plugin refuse, so a scale the checkpoint or
            weight update never wrote cannot be served).
        scalar_to_array: SGLang's ``needs_scalar_to_array`` attribute: a 0-d checkpoint scalar
            loads into this shard's slot of the ``[S]`` tensor.
    """

    name: str
    kind: Literal["ModelWeightParameter", "PerTensorScaleParameter"]
    dtype: torch.dtype
    shape: tuple[int, ...]
    input_dim: int | None
    output_dim: int | None
    fill: Literal["empty", "ones", "unloaded"] = "empty"
    scalar_to_array: bool = False


def linear_param_specs(input_size_per_partition: int, output_partition_sizes: Sequence[int], *, prefix: str = "") -> list[ParamSpec]:
    """The parameters of one NVFP4 linear partition (see the module table).

    Raises:
        QuantizationError: ``input_size_per_partition`` not a multiple of 16 (the message names
            ``prefix``; under TP the per-rank K must hold whole 1x16 blocks), or no output partition.
    """
    k, sizes = int(input_size_per_partition), [int(s) for s in output_partition_sizes]
    if k % NVFP4_BLOCK:
        raise QuantizationError(
            f"NVFP4 layer {prefix or '<unnamed>'}: input_size_per_partition={k} is not a multiple of 16 "
            "(each tensor-parallel rank must hold whole 1x16 blocks along K)"
        )
    if not sizes or min(sizes) <= 0:
        raise QuantizationError(f"NVFP4 layer {prefix or '<unnamed>'}: bad output_partition_sizes={sizes}")
    n, s = sum(sizes), len(sizes)
    return [
        ParamSpec("weight", "ModelWeightParameter", torch.uint8, (n, k // 2), 1, 0),
        ParamSpec("weight_scale", "ModelWeightParameter", torch.float8_e4m3fn, (n, k // NVFP4_BLOCK), 1, 0, "unloaded"),
        ParamSpec("weight_scale_2", "PerTensorScaleParameter", torch.float32, (s,), None, None, "unloaded", True),
        ParamSpec("input_scale", "PerTensorScaleParameter", torch.float32, (s,), None, None, "ones", True),
    ]


def act_only_param_specs(input_size_per_partition: int, output_partition_sizes: Sequence[int], params_dtype: torch.dtype, *,
                         prefix: str = "") -> list[ParamSpec]:
    """The parameters of one activation-only partition (module docstring): ``weight`` ``[N, K]`` in
    ``params_dtype``, sharded like vLLM's unquantized weight (input dim 1, output dim 0), so the
    engine's own loaders fill it, fused q/k/v and gate/up shards included.

    Raises:
        QuantizationError: ``input_size_per_partition`` not a multiple of 16 (the activation's 1x16
            blocks along K; the message names ``prefix``), no output partition, or a non-floating dtype.
    """
    if not params_dtype.is_floating_point:
        raise QuantizationError(f"activation-only layer {prefix or '<unnamed>'}: params_dtype {params_dtype} is not a floating dtype")
    nvfp4 = linear_param_specs(input_size_per_partition, output_partition_sizes, prefix=prefix)  # same K / partition checks
    n, k = nvfp4[0].shape[0], int(input_size_per_partition)
    return [ParamSpec("weight", "ModelWeightParameter", params_dtype, (n, k), 1, 0)]


def check_act_only_site(site: str, weight: torch.Tensor, *, dtype: torch.dtype | None = None, source: str = "") -> None:
    """One activation-only site's checkpoint tensor is servable: ``weight`` floating ``[N, K]`` with
    ``K % 16 == 0`` (the activation's 1x16 blocks), in ``dtype`` when given (the model dtype), finite.

    Raises:
        QuantizationError: names ``source`` (file or origin), the site and what is wrong.
    """
    where = f"{source}: " if source else ""
    if not weight.is_floating_point() or weight.dim() != 2 or weight.dtype == torch.float8_e4m3fn:
        raise QuantizationError(f"{where}{site}.weight: an activation-only site needs a floating [N, K] weight, "
                                f"got {weight.dtype} {tuple(weight.shape)}")
    if weight.shape[1] % NVFP4_BLOCK:
        raise QuantizationError(f"{where}{site}.weight: K={weight.shape[1]} is not a multiple of 16 (NVFP4 activation blocks)")
    if dtype is not None and weight.dtype != dtype:
        raise QuantizationError(f"{where}{site}.weight: dtype {weight.dtype}, expected the model dtype {dtype}")
    if not bool(torch.isfinite(weight).all()):
        raise QuantizationError(f"{where}{site}.weight: non-finite values")


def make_tensor(p: ParamSpec, device: torch.device | str | None = None) -> torch.Tensor:
    """Storage for ``p`` (``torch.empty``, ``torch.ones``, or the NaN ``unloaded`` sentinel)."""
    if p.fill == "unloaded":
        t = torch.empty(p.shape, dtype=p.dtype, device=device)
        mark_unloaded(t)
        return t
    fn = torch.ones if p.fill == "ones" else torch.empty
    return fn(p.shape, dtype=p.dtype, device=device)


def mark_unloaded(t: torch.Tensor) -> None:
    """Fill a scale tensor with NaN in place (E4M3 byte ``0x7F``; float32 NaN): "never loaded"."""
    with torch.no_grad():
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).fill_(0x7F)
        else:
            t.fill_(float("nan"))


def nan_scale_bytes(scales: torch.Tensor) -> int:
    """Number of NaN E4M3 block scales (bytes ``0x7F`` / ``0xFF``)."""
    return int(((scales.view(torch.uint8) & 0x7F) == 0x7F).sum())


def check_site_tensors(site: str, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                       *, source: str = "") -> None:
    """One site's checkpoint tensors are what a ``qpass_nvfp4`` layer can serve (module table): the
    checks of :func:`qpass.checkpoint.validate.check_nvfp4_tensors` (the ones the engine plugins run
    after loading): ``weight`` uint8 ``[N, K/2]``; ``weight_scale`` float8_e4m3fn ``[N, K/16]``, bytes
    a quantizer produces (no NaN, no sign bit) that fit their codes; ``weight_scale_2`` float32 with
    one element (or one per fused shard), all bit-identical, finite, in ``(0, FLT_MAX/2688]``.

    Raises:
        QuantizationError: names ``source`` (file or origin), the site and what is wrong.
    """
    from qpass.checkpoint.validate import check_nvfp4_tensors

    check_nvfp4_tensors(weight, weight_scale, weight_scale_2, f"{source}: {site}" if source else site)
