"""Checkpoint formats ``qpass export`` writes: tensors + ``config.json`` + extra files, per format.

A format is a function registered by name with :func:`checkpoint_format`; it turns the plain model
(HF config dict, every tensor in the model dtype under HF names), the quantized rollout sites
(:class:`RolloutSite`) and their NVFP4 tensors into a :class:`CheckpointContent` that
:func:`qpass.checkpoint.hfdir.write_hf_dir` writes. Formats:

* ``plain`` — the model unquantized (the ``bf16`` recipe's export): no ``quantization_config``.
* ``qpass`` — per quantized site ``P`` (HF module path): ``P.weight`` uint8 ``[N, K/2]`` (low
  nibble = even k), ``P.weight_scale`` float8_e4m3fn ``[N, K/16]`` (linear layout),
  ``P.weight_scale_2`` float32 ``[]`` = ``S_dec`` (decode multiplier, bit-identical within a fused
  group), ``P.input_scale`` float32 ``[]`` for W4A4 sites only (static decode scale of the fused group's
  calibrated input amax, :func:`input_scale_rule`: ``S_dec = fl(1/fl(2688/group_amax))`` (SPEC §3);
  qpass's own plugins quantize activations dynamically and ignore it); every other tensor in the model dtype. ``config.json``
  ``quantization_config`` = :meth:`qpass.checkpoint.qconfig.QpassQuantOptions.to_config`
  (``quant_method: qpass_nvfp4``, act mode, RAC per site, excluded modules, weight arithmetic).
  Activation-only sites (the W16A4 rollout of the ``act_qdq`` pass: :attr:`RolloutSite.weight` ``none``)
  keep ``P.weight`` as the plain tensor in the model dtype, with no scale tensors and no ``input_scale``
  (``quantization_config.qpass_weight: "none"``, ``quant_algo: "W16A4_NVFP4"``); ``modelopt`` and
  ``compressed-tensors`` have no such mode and refuse them. Static-RAC sites (``selection: static``)
  add ``P.rac_channels`` int64 ``[k]`` (the calibrated channels, sorted; ``quantization_config.rac``
  says ``selection: static``; the engine plugins do not serve static RAC yet and refuse such a
  config). A rollout with a static activation scale (``nvfp4_static``) is refused: the
  ``qpass_nvfp4`` plugins quantize activations dynamically; ``modelopt`` carries its ``input_scale``.

Source: the checkpoint contract (:mod:`qpass.checkpoint`), prior-art/backends.md §1.3 (the
``modelopt_fp4`` tensor names shared by vLLM and SGLang).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from qpass.checkpoint.calibrate import input_global_scale, input_scale
from qpass.checkpoint.params import check_site_tensors
from qpass.checkpoint.qconfig import QpassQuantOptions
from qpass.checkpoint.tensors import check_fused_global_scales
from qpass.errors import QpassError
from qpass.formats.spec import NVFP4_ACT_PER_TOKEN, NVFP4OpActMode, nvfp4_act_mode
from qpass.quant.rac import RACConfig

ActMode = NVFP4OpActMode  # the op's modes: a rollout's static (calibrated) scale is ``nvfp4_static``
WeightMode = Literal["nvfp4", "none"]
SITE_SUFFIXES = ("weight", "weight_scale", "weight_scale_2")


@dataclasses.dataclass(frozen=True)
class RolloutSite:
    """One NVFP4-quantized linear of the rollout, as a checkpoint needs it.

    Attributes:
        site: HF module path (``model.layers.0.mlp.gate_proj``).
        group: fused-group id (members share the weight amax and, for W4A4, the input scale).
        act: ``nvfp4`` (W4A4, dynamic per-tensor), ``nvfp4_per_token``, ``nvfp4_static`` (W4A4 with the
            calibrated per-tensor input scale the rollout graph used) or ``none`` (W4A16).
        rac: residual activation compensation of the site, or None.
        arithmetic: the weight quantizer arithmetic its bytes follow (``NVFP4Spec.arithmetic``).
        weight: ``nvfp4`` (the site's weight is NVFP4 bytes) or ``none`` (activation-only: the
            weight stays in the model dtype, only the input gets ``qpass::nvfp4_act_qdq``).
    """

    site: str
    group: str
    act: ActMode
    rac: RACConfig | None = None
    arithmetic: Literal["te_reference", "modelopt"] = "te_reference"
    weight: WeightMode = "nvfp4"

    @property
    def needs_input_scale(self) -> bool:
        """A W4A4 site: NVFP4 weight and quantized activations (the checkpoint carries a calibrated ``input_scale``)."""
        return self.weight == "nvfp4" and self.act != "none"


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
        input_amax: ``{site: float32 0-d}`` the fused group's calibrated input amax, for the W4A4
            sites (None: not calibrated); for ``nvfp4_static`` sites the amax the rollout graph used.
        weight_arithmetic: the quantizer arithmetic the weight bytes follow (``te_reference`` | ``modelopt``).
    """

    config: Mapping[str, Any]
    state: Mapping[str, torch.Tensor]
    sites: Mapping[str, RolloutSite]
    site_tensors: Mapping[str, torch.Tensor]
    input_amax: Mapping[str, torch.Tensor] | None = None
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
    """Every tensor but the master weights of NVFP4-weight sites (an activation-only site's weight is
    kept: it is what the checkpoint serves).

    Raises:
        QpassError: a quantized site whose master ``<site>.weight`` is not a tensor of the model.
    """
    missing = sorted({f"{s}.weight" for s in inputs.sites} - set(inputs.state))
    if missing:
        raise QpassError(f"quantized site(s) without a model weight: {missing[:5]} (the rollout is not of this model?)")
    masters = {f"{s}.weight" for s, r in inputs.sites.items() if r.weight == "nvfp4"}
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
    for s in sorted(x for x, r in inputs.sites.items() if r.weight == "nvfp4"):
        missing = [f"{s}.{x}" for x in SITE_SUFFIXES if f"{s}.{x}" not in inputs.site_tensors]
        if missing:
            raise QpassError(f"quantized site {s}: missing {', '.join(missing)}")
        w, ws, ws2 = (inputs.site_tensors[f"{s}.{x}"] for x in SITE_SUFFIXES)
        check_site_tensors(s, w, ws, ws2)
        out[f"{s}.weight"], out[f"{s}.weight_scale"] = w.contiguous(), ws.contiguous()
        out[f"{s}.weight_scale_2"] = ws2.detach().float().reshape(-1)[:1].reshape(()).clone()
    check_fused_global_scales(out)
    return out


def static_rac_tensors(inputs: ExportInputs) -> dict[str, torch.Tensor]:
    """``{<site>.rac_channels: int64 [k]}`` of the static-RAC sites (from the rollout's tensors).

    Raises:
        QpassError: a static-RAC site whose channels are missing or not ``k`` sorted distinct ids in range.
    """
    from qpass.quant.rac import rac_num_channels

    out = {}
    for s, r in sorted(inputs.sites.items()):
        if r.rac is None or r.rac.selection != "static":
            continue
        ch = inputs.site_tensors.get(f"{s}.rac_channels")
        k_dim = int(inputs.site_tensors[f"{s}.weight"].shape[-1]) * 2 if f"{s}.weight" in inputs.site_tensors else None
        if ch is None:
            raise QpassError(f"static RAC site {s}: no {s}.rac_channels among the rollout tensors")
        ch = ch.detach().to(torch.int64).reshape(-1).contiguous()
        k = rac_num_channels(k_dim, r.rac.ratio) if k_dim is not None else ch.numel()
        if ch.numel() != k or bool((ch[1:] <= ch[:-1]).any()) or (k and (int(ch[0]) < 0 or (k_dim is not None and int(ch[-1]) >= k_dim))):
            raise QpassError(f"static RAC site {s}: {s}.rac_channels must be {k} sorted distinct channel ids in [0, {k_dim})")
        out[f"{s}.rac_channels"] = ch.clone()
    return out


def input_scale_rule(site: RolloutSite) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ``input_scale`` (decode multiplier) of a W4A4 site's group amax: ``S_dec = fl(1/fl(2688/amax))``
    (SPEC §3, the global scale a static activation quantizer uses, and ``weight_scale_2``'s convention
    for ``te_reference`` bytes); ModelOpt's own ``fl(amax/2688)`` for a dynamic-activation site whose
    weight bytes follow the ``modelopt`` arithmetic (so such an export stays byte-identical to ModelOpt's)."""
    if site.arithmetic == "modelopt" and site.act != "nvfp4_static":
        from qpass.checkpoint.calibrate import NVFP4_ACT_MAXBOUND

        return lambda a: a.float() / torch.full_like(a.float(), NVFP4_ACT_MAXBOUND)
    return input_scale


def w4a4_input_scales(inputs: ExportInputs, rule: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      suffix: str = "input_scale") -> dict[str, torch.Tensor]:
    """``{<site>.<suffix>: rule(group amax)}`` float32 0-d for the W4A4 sites (bit-identical per fused
    group); default the ``input_scale`` slot, :func:`input_scale_rule` per site.

    Raises:
        QpassError: W4A4 sites but no calibrated scales, a site without one, or two scales in one group.
    """
    w4a4 = sorted(s for s, r in inputs.sites.items() if r.needs_input_scale)
    if not w4a4:
        return {}
    if inputs.input_amax is None:
        raise QpassError(f"{len(w4a4)} W4A4 site(s) need a calibrated input_scale (e.g. {w4a4[0]}); none was computed")
    out, by_group = {}, {}
    for s in w4a4:
        a = inputs.input_amax.get(s)
        if a is None:
            raise QpassError(f"W4A4 site {s}: no calibrated input amax")
        t = (rule or input_scale_rule(inputs.sites[s]))(a.detach().float().reshape(()))
        bits = int(t.view(torch.int32))
        g = inputs.sites[s].group
        if by_group.setdefault(g, bits) != bits:
            raise QpassError(f"fused group {g}: input_scale differs between members (site {s}); one GEMM input needs one scale")
        out[f"{s}.{suffix}"] = t.clone()
    return out


def weight_arithmetic(sites: Mapping[str, RolloutSite]) -> str:
    """The one weight arithmetic of the quantized sites (``te_reference`` when there are none).

    Raises:
        QpassError: sites quantized with different arithmetics.
    """
    found = {r.arithmetic for r in sites.values()} or {"te_reference"}
    if len(found) > 1:
        by = {a: sorted(s for s, r in sites.items() if r.arithmetic == a)[0] for a in found}
        raise QpassError(f"the rollout mixes weight arithmetics {by} (arithmetic: example site); a checkpoint records one")
    return found.pop()


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


def weight_mode(inputs: ExportInputs) -> WeightMode:
    """The one weight mode of the quantized sites (``nvfp4``, or ``none`` for activation-only sites).

    Raises:
        QpassError: sites with different modes (``quantization_config.qpass_weight`` holds one).
    """
    modes = {r.weight for r in inputs.sites.values()}
    if len(modes) > 1:
        by = {m: sorted(s for s, r in inputs.sites.items() if r.weight == m)[0] for m in modes}
        raise QpassError(f"the rollout mixes NVFP4-weight and activation-only sites {by} (qpass_weight: example site); "
                         "a checkpoint's quantization_config holds one qpass_weight")
    return modes.pop()


def act_only_tensors_checked(inputs: ExportInputs) -> None:
    """Every activation-only site's weight is servable (:func:`qpass.checkpoint.params.check_act_only_site`).

    Raises:
        QuantizationError: names the site.
    """
    from qpass.checkpoint.params import check_act_only_site

    for s in sorted(x for x, r in inputs.sites.items() if r.weight == "none"):
        check_act_only_site(s, inputs.state[f"{s}.weight"])


def refuse_act_only(inputs: ExportInputs, fmt: str) -> None:
    """Formats without an activation-only NVFP4 mode refuse such sites.

    Raises:
        QpassError: names the format and a site.
    """
    act_only = sorted(s for s, r in inputs.sites.items() if r.weight == "none")
    if act_only:
        raise QpassError(f"--format {fmt} has no activation-only NVFP4 mode (BF16 weight, NVFP4 activations: site {act_only[0]}, "
                         f"{len(act_only)} in all); use --format qpass")


# ----------------------------------------------------------------------------- formats


def nvfp4_weight_format_act(inputs: ExportInputs, fmt: str, no_per_token: str) -> ActMode:
    """The activation mode of ``inputs`` for a format that stores NVFP4 weights and per-tensor
    activation scales only (``modelopt``, ``compressed-tensors``), after the checks they share.

    Raises:
        QpassError: no quantized site; activation-only sites (:func:`refuse_act_only`); per-token
            activations (``no_per_token`` says why the format cannot hold them).
    """
    if not inputs.sites:
        raise QpassError(f"--format {fmt} needs NVFP4-quantized sites; this rollout has none (use --format plain)")
    refuse_act_only(inputs, fmt)
    act = act_mode(inputs)
    if act == nvfp4_act_mode(NVFP4_ACT_PER_TOKEN):
        raise QpassError(f"{no_per_token} (act: {act}); use --format qpass")
    return act


@checkpoint_format("plain")
def plain_format(inputs: ExportInputs) -> CheckpointContent:
    """The unquantized model (master weights in the model dtype); ``config.json`` without quantization."""
    return CheckpointContent(dict(inputs.config), dict(inputs.state), summary={"quantized_sites": 0})


@checkpoint_format("qpass")
def qpass_format(inputs: ExportInputs) -> CheckpointContent:
    """The ``qpass`` format (module docstring); with no quantized site it equals ``plain``.

    Raises:
        QpassError: see :func:`site_tensors_checked`, :func:`w4a4_input_scales`, :func:`act_mode`,
            :func:`static_rac_tensors`; a static activation scale (``nvfp4_static``).
    """
    if not inputs.sites:
        return plain_format(inputs)
    if act_mode(inputs) == "nvfp4_static":
        site = sorted(s for s, r in inputs.sites.items() if r.act == "nvfp4_static")[0]
        raise QpassError(f"--format qpass: site {site} quantizes activations with a static (calibrated) input scale, but the "
                         "qpass_nvfp4 engine plugins quantize activations dynamically; use --format modelopt (it carries input_scale)")
    opts = QpassQuantOptions(act=act_mode(inputs), rac={s: r.rac for s, r in inputs.sites.items() if r.rac is not None},
                             exclude=tuple(excluded_modules(inputs)), weight_arithmetic=inputs.weight_arithmetic,
                             weight=weight_mode(inputs))
    act_only_tensors_checked(inputs)
    tensors = unquantized_tensors(inputs) | site_tensors_checked(inputs) | w4a4_input_scales(inputs) | static_rac_tensors(inputs)
    config = dict(inputs.config) | {"quantization_config": opts.to_config()}
    return CheckpointContent(config, dict(sorted(tensors.items())),
                             summary={"quantized_sites": len(inputs.sites), "act": opts.act, "weight": opts.weight,
                                      "rac_sites": len(opts.rac),
                                      "static_rac_sites": sum(c.selection == "static" for c in opts.rac.values())})


MODELOPT_VERSION = "0.47.0"  # the ModelOpt release whose export_hf_checkpoint layout this format reproduces
NVFP4_ARGS = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}


@checkpoint_format("modelopt")
def modelopt_format(inputs: ExportInputs) -> CheckpointContent:
    """What ModelOpt's ``export_hf_checkpoint`` writes for NVFP4 (``NVFP4_DEFAULT_CFG``: W4A4 with
    static ``input_scale``; ``W4A16_NVFP4_CFG``: weight-only), so vLLM's and SGLang's native
    ``modelopt_fp4`` loaders take it.

    Tensors: the ``qpass`` format's (``weight`` / ``weight_scale`` / ``weight_scale_2`` 0-d /
    ``input_scale`` 0-d for W4A4). Files: ``hf_quant_config.json`` ``{"producer": {"name":
    "modelopt", "version"}, "quantization": {"quant_algo": "NVFP4" | "W4A16_NVFP4",
    "kv_cache_quant_algo": null, "group_size": 16, "exclude_modules": [...]}}`` plus a top-level
    ``"qpass"`` block (which arithmetic the bytes follow; what the format cannot carry: RAC, dynamic
    activation scales), and ``config.json`` ``quantization_config`` as ModelOpt writes it
    (``config_groups.group_0`` ``weights`` / ``input_activations`` / ``targets: ["Linear"]``, ``ignore``,
    ``quant_algo``, ``producer``, ``quant_method: "modelopt"``).

    Source: a real ModelOpt 0.47.0 export of the tiny Llama on CPU (``scripts/modelopt_reference.py``,
    listings in ``tests/data/modelopt_tiny_llama_*.json``).

    Raises:
        QpassError: nothing quantized; per-token activations (ModelOpt has no such mode); see
            :func:`site_tensors_checked` / :func:`w4a4_input_scales`.
    """
    act = nvfp4_weight_format_act(inputs, "modelopt", "ModelOpt NVFP4 has no per-token activation scale")
    w4a4 = act in ("nvfp4", "nvfp4_static")  # static: the calibrated scales the rollout graph used
    algo = "NVFP4" if w4a4 else "W4A16_NVFP4"
    exclude = excluded_modules(inputs)
    producer = {"name": "modelopt", "version": MODELOPT_VERSION}
    tensors = unquantized_tensors(inputs) | site_tensors_checked(inputs) | (w4a4_input_scales(inputs) if w4a4 else {})
    group = ({"input_activations": dict(NVFP4_ARGS)} if w4a4 else {}) | {"weights": dict(NVFP4_ARGS), "targets": ["Linear"]}
    qconfig = {"config_groups": {"group_0": group}, "ignore": exclude, "quant_algo": algo, "producer": producer, "quant_method": "modelopt"}
    rac = sorted(s for s, r in inputs.sites.items() if r.rac is not None)
    hf_quant = {
        "producer": producer,
        "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": exclude},
        "qpass": {"writer": "qpass export", "weight_arithmetic": inputs.weight_arithmetic,
                  "weight_scale_2": GLOBAL_SCALE_RULES[inputs.weight_arithmetic],
                  "input_scale": (("static, calibrated: fl(group_amax/2688) (ModelOpt's)" if inputs.weight_arithmetic == "modelopt"
                                   and act == "nvfp4" else "static, calibrated: S_dec = fl(1/fl(2688/group_amax)) (SPEC §3)")
                                  if w4a4 else None),
                  "not_represented": {"rac_sites": rac, "dynamic_activation_scales": act == "nvfp4"}},
    }
    return CheckpointContent(dict(inputs.config) | {"quantization_config": qconfig}, dict(sorted(tensors.items())),
                             {"hf_quant_config.json": hf_quant},
                             summary={"quantized_sites": len(inputs.sites), "act": act, "quant_algo": algo, "rac_sites_not_represented": len(rac)})


GLOBAL_SCALE_RULES = {
    "te_reference": "S_dec = fl(1/fl(2688/amax)) (qpass / TransformerEngine reference; ModelOpt writes fl(amax/2688), "
                    "which differs by one ulp for some amax)",
    "modelopt": "fl(amax/2688) (ModelOpt 0.47's arithmetic; codes and block scales too)",
}


@checkpoint_format("compressed-tensors")
def compressed_tensors_format(inputs: ExportInputs) -> CheckpointContent:
    """The ``nvfp4-pack-quantized`` layout llm-compressor writes (compressed-tensors' ``NVFP4`` /
    ``NVFP4A16`` presets), loadable by transformers + compressed-tensors and vLLM's
    ``compressed-tensors`` method.

    Per quantized site ``P``: ``P.weight_packed`` uint8 ``[N, K/2]`` (low nibble = even k, as
    ``unpack_fp4_from_uint8``), ``P.weight_scale`` float8_e4m3fn ``[N, K/16]``,
    ``P.weight_global_scale`` float32 ``[1]`` = ``S_enc = fl(2688/amax)`` (an encode **divisor**:
    compressed-tensors decodes ``code * fl(s_b / weight_global_scale)``), and for W4A4
    ``P.input_global_scale`` float32 ``[1]`` = ``fl(2688 / group_amax)`` of the calibration
    activations (the ``input_activations`` preset has ``dynamic: "local"``: static global, dynamic
    block scales). ``config.json`` ``quantization_config``: compressed-tensors' own
    ``QuantizationConfig`` (``config_groups.group_0`` = the preset with ``targets: ["Linear"]``,
    ``ignore``, ``format``, ``quantization_status: "compressed"``) plus ``version``,
    ``quant_method: "compressed-tensors"``, as ``ModelCompressor.update_config`` writes it.

    Source: compressed-tensors 0.20.1 ``compressors/nvfp4/base.py`` (``compression_param_names``,
    ``decompress``), ``quantization/quant_scheme.py`` (``NVFP4``), ``lifecycle/initialize.py``
    (``*_global_scale`` shape ``[1]``), ``model_compressors/model_compressor.py`` (``update_config``).

    Raises:
        MissingDependencyError: compressed-tensors is not installed.
        QpassError: nothing quantized; per-token activations (no such preset); as :func:`site_tensors_checked`.
    """
    from qpass.errors import MissingDependencyError

    try:
        import compressed_tensors
        from compressed_tensors.config import CompressionFormat
        from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
        from compressed_tensors.quantization.quant_scheme import NVFP4, NVFP4A16
    except ImportError as exc:
        raise MissingDependencyError(f"--format compressed-tensors needs the compressed-tensors package: pip install compressed-tensors ({exc})") from exc
    act = nvfp4_weight_format_act(inputs, "compressed-tensors", "compressed-tensors' NVFP4 preset has no per-token activation global scale")
    fmt = CompressionFormat.nvfp4_pack_quantized.value
    exclude = excluded_modules(inputs)
    qc = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], format=fmt, **(NVFP4 if act in ("nvfp4", "nvfp4_static") else NVFP4A16))},
                            ignore=exclude, format=fmt, quantization_status="compressed")
    qconfig = {"version": compressed_tensors.__version__, "quant_method": "compressed-tensors", "sparsity_config": {}, "transform_config": {},
               **qc.model_dump(exclude=["quant_method"])}
    tensors = unquantized_tensors(inputs)
    checked = site_tensors_checked(inputs)
    groups: dict[str, list[str]] = {}
    for site in sorted(inputs.sites):
        tensors[f"{site}.weight_packed"] = checked[f"{site}.weight"]
        tensors[f"{site}.weight_scale"] = checked[f"{site}.weight_scale"]
        groups.setdefault(inputs.sites[site].group, []).append(site)
    moved, inexact = 0, []
    for gid, members in sorted(groups.items()):
        enc = inputs.site_tensors.get(f"{members[0]}.weight_global_scale")
        if enc is None:
            raise QpassError(f"quantized site {members[0]}: no {members[0]}.weight_global_scale (S_enc) among the rollout tensors")
        gs, off = decode_exact_global_scale([checked[f"{m}.weight_scale"] for m in members], checked[f"{members[0]}.weight_scale_2"],
                                            enc.detach().float().reshape(()))
        moved += off is not None and off != 0
        if off is None:
            inexact.append(gid)
        for m in members:
            tensors[f"{m}.weight_global_scale"] = gs.reshape(1).clone()
    if act in ("nvfp4", "nvfp4_static"):
        tensors |= {k: v.reshape(1) for k, v in w4a4_input_scales(inputs, input_global_scale, "input_global_scale").items()}
    return CheckpointContent(dict(inputs.config) | {"quantization_config": qconfig}, dict(sorted(tensors.items())),
                             summary={"quantized_sites": len(inputs.sites), "act": act, "weight_global_scale": {
                                 "rule": "S_enc, or the nearest float32 (<= 8 ulp) with which compressed-tensors' decode "
                                         "bf16(code * fl(s_b / gs)) equals qpass's bf16(fl(code * s_b) * S_dec) for every code and block scale",
                                 "groups_moved_off_s_enc": moved, "groups_not_decode_exact": inexact}})


E2M1_MAGNITUDES = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def decode_exact_global_scale(scales: list[torch.Tensor], s_dec: torch.Tensor, s_enc: torch.Tensor,
                              max_ulps: int = 8) -> tuple[torch.Tensor, int | None]:
    """The ``weight_global_scale`` under which compressed-tensors decodes a fused group exactly as qpass does.

    compressed-tensors decodes ``bf16(fl(code * fl(bf16(s_b) / gs)))`` (``NVFP4PackedCompressor.decompress``
    -> ``_dequantize``: ``scale / global_scale`` then ``x_q * scale``), qpass ``bf16(fl(fl(code * s_b) * S_dec))``
    (:func:`qpass.quant.nvfp4.nvfp4_dequantize`). With ``gs = S_enc`` the two differ by one bf16 ulp on
    some (code, block scale) pairs; this tries ``S_enc``, then ``fl(1/S_dec)`` and its float32 neighbours
    up to ``max_ulps`` away, and returns the first ``gs`` for which every E2M1 magnitude times every
    block-scale value present in the group decodes identically (a superset of the pairs in the tensor).

    Args:
        scales: float8_e4m3fn block scales of every member of the group.
        s_dec, s_enc: float32 0-d global scales of the group.
    Returns:
        ``(gs float32 0-d, ulps from S_enc)`` (0: ``S_enc`` itself); ``(S_enc, None)`` when no exact value
        exists within ``max_ulps`` (the decode then differs by one bf16 ulp somewhere).
    """
    sb = torch.cat([t.float().reshape(-1) for t in scales]).unique()
    mags = torch.tensor(E2M1_MAGNITUDES)
    c, b = mags.repeat(len(sb)), sb.repeat_interleave(len(mags))
    want = ((c * b) * s_dec.float()).to(torch.bfloat16).view(torch.int16)
    b16 = b.to(torch.bfloat16).float()

    def exact(gs: torch.Tensor) -> bool:
        return bool(torch.equal((c * (b16 / gs)).to(torch.bfloat16).view(torch.int16), want))

    if exact(s_enc):
        return s_enc, 0
    base = int((torch.ones(()) / s_dec.float()).view(torch.int32))
    for off in [x for i in range(0, max_ulps + 1) for x in ((i,) if i == 0 else (i, -i))]:
        gs = torch.tensor(base + off, dtype=torch.int32).view(torch.float32)
        if exact(gs):
            return gs, int(gs.view(torch.int32)) - int(s_enc.float().view(torch.int32))
    return s_enc, None
