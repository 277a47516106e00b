"""Checkpoint formats ``qpass export`` writes: tensors + ``config.json`` + extra files, per format.

A format is a function registered by name with :func:`checkpoint_format`; it turns the plain model
(HF config dict, every tensor in the model dtype under HF names), the quantized rollout sites
(:class:`RolloutSite`) and their NVFP4 tensors into a :class:`CheckpointContent` that
:func:`qpass.checkpoint.hfdir.write_hf_dir` writes. Formats:

* ``plain`` — the model unquantized (the ``bf16`` recipe's export): no ``quantization_config``.
* ``qpass`` — per quantized site ``P`` (HF module path): ``P.weight`` uint8 ``[N, K/2]`` (low
  nibble = even k), ``P.weight_scale`` float8_e4m3fn ``[N, K/16]`` (linear layout),
  ``P.weight_scale_2`` float32 ``[]`` = ``S_dec`` (decode multiplier, bit-identical within a fused
  group), ``P.input_scale`` float32 ``[]`` for W4A4 sites only (static decode scale
  ``fl(group_amax / 2688)`` calibrated on prompts; qpass's own plugins quantize activations
  dynamically and ignore it); every other tensor in the model dtype. ``config.json``
  ``quantization_config`` = :meth:`qpass.checkpoint.qconfig.QpassQuantOptions.to_config`
  (``quant_method: qpass_nvfp4``, act mode, RAC per site, excluded modules, weight arithmetic).

Source: the checkpoint contract (:mod:`qpass.checkpoint`), prior-art/backends.md §1.3 (the
``modelopt_fp4`` tensor names shared by vLLM and SGLang).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from qpass.checkpoint.params import check_site_tensors
from qpass.checkpoint.qconfig import QpassQuantOptions
from qpass.checkpoint.tensors import check_fused_global_scales
from qpass.errors import QpassError
from qpass.quant.rac import RACConfig

ActMode = Literal["nvfp4", "nvfp4_per_token", "none"]
SITE_SUFFIXES = ("weight", "weight_scale", "weight_scale_2")


@dataclasses.dataclass(frozen=True)
class RolloutSite:
    """One NVFP4-quantized linear of the rollout, as a checkpoint needs it.

    Attributes:
        site: HF module path (``model.layers.0.mlp.gate_proj``).
        group: fused-group id (members share the weight amax and, for W4A4, the input scale).
        act: ``nvfp4`` (W4A4, dynamic per-tensor), ``nvfp4_per_token`` or ``none`` (W4A16).
        rac: residual activation compensation of the site, or None.
    """

    site: str
    group: str
    act: ActMode
    rac: RACConfig | None = None


@dataclasses.dataclass
class CheckpointContent:
    """What one format writes: ``config.json``, every tensor, extra JSON files, and a summary for the record."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    extra_json: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ExportInputs:
    """The inputs every format reads.

    Attributes:
        config: the plain HF config dict (:func:`qpass.checkpoint.hfdir.plain_config`).
        state: every model tensor under HF names in the model dtype (masters of quantized sites included).
        sites: ``{site: RolloutSite}`` of the NVFP4-quantized linears (empty: nothing quantized).
        site_tensors: ``{<site>.weight|weight_scale|weight_scale_2: tensor}`` — the rollout's bytes.
        input_scales: ``{site: float32 0-d}`` for the W4A4 sites (None: not calibrated).
        weight_arithmetic: the quantizer arithmetic the weight bytes follow (``te_reference`` | ``modelopt``).
    """

    config: Mapping[str, Any]
    state: Mapping[str, torch.Tensor]
    sites: Mapping[str, RolloutSite]
    site_tensors: Mapping[str, torch.Tensor]
    input_scales: Mapping[str, torch.Tensor] | None = None
    weight_arithmetic: str = "te_reference"


FormatFn = Callable[[ExportInputs], CheckpointContent]
CHECKPOINT_FORMATS: dict[str, FormatFn] = {}


def checkpoint_format(name: str) -> Callable[[FormatFn], FormatFn]:
    """Register a checkpoint format under ``name`` (``qpass export --format NAME``)."""

    def deco(fn: FormatFn) -> FormatFn:
        if name in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint format {name!r} registered twice")
        CHECKPOINT_FORMATS[name] = fn
        return fn

    return deco


def build_checkpoint(fmt: str, inputs: ExportInputs) -> CheckpointContent:
    """The checkpoint content of format ``fmt``.

    Raises:
        QpassError: unknown format (the message lists the known ones); see each format.
    """
    fn = CHECKPOINT_FORMATS.get(fmt)
    if fn is None:
        raise QpassError(f"unknown checkpoint format {fmt!r}; known: {sorted(CHECKPOINT_FORMATS)}")
    return fn(inputs)


# ----------------------------------------------------------------------------- shared pieces


def unquantized_tensors(inputs: ExportInputs) -> dict[str, torch.Tensor]:
    """Every tensor but the master weights of quantized sites.

    Raises:
        QpassError: a quantized site whose master ``<site>.weight`` is not a tensor of the model.
    """
    masters = {f"{s}.weight" for s in inputs.sites}
    missing = sorted(masters - set(inputs.state))
    if missing:
        raise QpassError(f"quantized site(s) without a model weight: {missing[:5]} (the rollout is not of this model?)")
    return {k: v for k, v in inputs.state.items() if k not in masters}


def excluded_modules(inputs: ExportInputs) -> list[str]:
    """Modules a consumer must leave unquantized: every 2-D ``<module>.weight`` that is not a
    quantized site (embeddings, ``lm_head``, unquantized linears), plus ``lm_head`` when tied."""
    out = {k[: -len(".weight")] for k, t in inputs.state.items()
           if k.endswith(".weight") and t.dim() == 2 and k[: -len(".weight")] not in inputs.sites}
    if inputs.config.get("tie_word_embeddings"):
        out.add("lm_head")
    return sorted(out)


def site_tensors_checked(inputs: ExportInputs, suffixes: tuple[str, ...] = SITE_SUFFIXES) -> dict[str, torch.Tensor]:
    """The NVFP4 tensors of every quantized site, validated (:func:`qpass.checkpoint.params.check_site_tensors`,
    one global per fused group); ``weight_scale_2`` as a float32 0-d tensor.

    Raises:
        QpassError / QuantizationError: a missing tensor, wrong dtype/shape, NaN scale, or a fused
            group with two globals (naming the site).
    """
    out: dict[str, torch.Tensor] = {}
    for s in sorted(inputs.sites):
        missing = [f"{s}.{x}" for x in SITE_SUFFIXES if f"{s}.{x}" not in inputs.site_tensors]
        if missing:
            raise QpassError(f"quantized site {s}: missing {', '.join(missing)}")
        w, ws, ws2 = (inputs.site_tensors[f"{s}.{x}"] for x in SITE_SUFFIXES)
        check_site_tensors(s, w, ws, ws2)
        out[f"{s}.weight"], out[f"{s}.weight_scale"] = w.contiguous(), ws.contiguous()
        out[f"{s}.weight_scale_2"] = ws2.detach().float().reshape(-1)[:1].reshape(()).clone()
    check_fused_global_scales(out)
    return out


def w4a4_input_scales(inputs: ExportInputs) -> dict[str, torch.Tensor]:
    """``{<site>.input_scale: float32 0-d}`` for the W4A4 sites (bit-identical per fused group).

    Raises:
        QpassError: W4A4 sites but no calibrated scales, a site without one, or two scales in one group.
    """
    w4a4 = sorted(s for s, r in inputs.sites.items() if r.act != "none")
    if not w4a4:
        return {}
    if inputs.input_scales is None:
        raise QpassError(f"{len(w4a4)} W4A4 site(s) need a calibrated input_scale (e.g. {w4a4[0]}); none was computed")
    out, by_group = {}, {}
    for s in w4a4:
        t = inputs.input_scales.get(s)
        if t is None:
            raise QpassError(f"W4A4 site {s}: no calibrated input_scale")
        t = t.detach().float().reshape(())
        bits = int(t.view(torch.int32))
        g = inputs.sites[s].group
        if by_group.setdefault(g, bits) != bits:
            raise QpassError(f"fused group {g}: input_scale differs between members (site {s}); one GEMM input needs one scale")
        out[f"{s}.input_scale"] = t.clone()
    return out


def act_mode(inputs: ExportInputs) -> ActMode:
    """The one activation mode of the quantized sites.

    Raises:
        QpassError: sites with different modes (a checkpoint's quantization config holds one).
    """
    modes = {r.act for r in inputs.sites.values()}
    if len(modes) > 1:
        by = {m: sorted(s for s, r in inputs.sites.items() if r.act == m)[0] for m in modes}
        raise QpassError(f"the rollout mixes activation modes {by} (mode: example site); a checkpoint's quantization_config holds one")
    return modes.pop()


# ----------------------------------------------------------------------------- formats


@checkpoint_format("plain")
def plain_format(inputs: ExportInputs) -> CheckpointContent:
    """The unquantized model (master weights in the model dtype); ``config.json`` without quantization."""
    return CheckpointContent(dict(inputs.config), dict(inputs.state), summary={"quantized_sites": 0})


@checkpoint_format("qpass")
def qpass_format(inputs: ExportInputs) -> CheckpointContent:
    """The ``qpass`` format (module docstring); with no quantized site it equals ``plain``.

    Raises:
        QpassError: see :func:`site_tensors_checked`, :func:`w4a4_input_scales`, :func:`act_mode`;
            static RAC (its calibrated channels are not part of the ``qpass_nvfp4`` schema yet).
    """
    if not inputs.sites:
        return plain_format(inputs)
    opts = QpassQuantOptions(act=act_mode(inputs), rac={s: r.rac for s, r in inputs.sites.items() if r.rac is not None},
                             exclude=tuple(excluded_modules(inputs)), weight_arithmetic=inputs.weight_arithmetic)
    tensors = unquantized_tensors(inputs) | site_tensors_checked(inputs) | w4a4_input_scales(inputs)
    config = dict(inputs.config) | {"quantization_config": opts.to_config()}
    return CheckpointContent(config, dict(sorted(tensors.items())),
                             summary={"quantized_sites": len(inputs.sites), "act": opts.act, "rac_sites": len(opts.rac)})
