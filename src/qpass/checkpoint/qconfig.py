"""``qpass_nvfp4`` quantization options, read from / written to a checkpoint's quantization config.

Pure python (no engine import): the one schema of the ``qpass_nvfp4`` method. The SGLang
``QuantizationConfig`` (:mod:`qpass.backends.sglang.plugin`) and the vLLM one wrap
:class:`QpassQuantOptions`; ``qpass export --format qpass`` writes :meth:`QpassQuantOptions.to_config`.

Config layouts accepted by :meth:`QpassQuantOptions.from_config` (SGLang passes the dict it found):

* qpass's ``hf_quant_config.json`` (``qpass apply`` writes it next to ``weights.safetensors``):
  ``{"producer": {"name": "qpass"}, "quantization": {"quant_algo": "NVFP4",
  "input_activations": {"dynamic": true, "per_token": false}, "exclude_modules": [...],
  "rac": {"<site>": {"ratio": 0.5, "mode": "masked", "selection": "batch"}}, "qpass_act": ...}}``
* a flat ``config.json`` ``quantization_config`` with ``"quant_method": "qpass_nvfp4"`` and the
  same keys at top level (what :func:`checkpoint_quant_config` writes), so SGLang selects the
  plugin from the checkpoint alone.

``quant_algo: "W4A16_NVFP4"`` (ModelOpt's weight-only name) or ``qpass_act: "none"`` selects
W4A16; otherwise activations are quantized dynamically (per tensor, or per token).

``qpass_weight`` says what the checkpoint holds for every quantized (non-excluded) linear:
``"nvfp4"`` (default; ``weight`` / ``weight_scale`` / ``weight_scale_2``, the table of
:mod:`qpass.checkpoint.params`) or ``"none"``: the **activation-only** mode (W16A4, the study's
``w16a4_qdq`` rollout: the ``act_qdq`` pass), where ``<site>.weight`` is the plain weight ``[N, K]`` in
the model dtype (no scale tensors, no ``input_scale``) and the engine computes
``F.linear(qpass::nvfp4_act_qdq(x), W)`` (:func:`qpass.checkpoint.linear.served_act_linear`).
:meth:`QpassQuantOptions.to_config` writes ``quant_algo: "W16A4_NVFP4"`` for it (a qpass name: no
ModelOpt / compressed-tensors consumer has this mode); it needs quantized activations and no RAC.
``weight_arithmetic`` names how the stored bytes were computed (``te_reference``: SPEC §3,
``weight_scale_2 = S_dec = fl(1/fl(2688/amax))``; ``modelopt``: ``weight_scale_2 = fl(amax/2688)``,
ModelOpt's arithmetic); an engine serving the bytes decodes both the same way (codes x block scale
x ``weight_scale_2``), so the field matters to whoever re-quantizes master weights for a sync.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from qpass.errors import QpassError
from qpass.formats.spec import NVFP4_ACT, NVFP4_ACT_MODES, NVFP4_ACT_PER_TOKEN, NVFP4ActMode, NVFP4Spec, nvfp4_act_mode
from qpass.quant.rac import RACConfig

METHOD_NAME = "qpass_nvfp4"
ACT_MODES = tuple(NVFP4_ACT_MODES)  # the op's NVFP4 activation modes (``qpass_act``)
WEIGHT_MODES = ("nvfp4", "none")  # ``qpass_weight``: NVFP4 weight bytes, or the weight unquantized (activation-only sites)
QUANT_ALGOS = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "W16A4_NVFP4": "none"}  # quant_algo -> the qpass_weight it implies
WEIGHT_ARITHMETIC = ("te_reference", "modelopt")
DEFAULT_EXCLUDE = ("lm_head", "*embed_tokens", "*.mlp.gate")  # routers stay bf16
# SGLang's stacked (fused) modules and the checkpoint projections they hold, in shard order.
PACKED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


@dataclasses.dataclass(frozen=True)
class QpassQuantOptions:
    """What an engine plugin (SGLang, vLLM) needs to reproduce a qpass rollout.

    Attributes:
        act: ``nvfp4`` (W4A4, dynamic per-tensor activation global scale), ``nvfp4_per_token``
            or ``none`` (W4A16).
        rac: per checkpoint site (HF name, e.g. ``model.layers.0.mlp.gate_proj``) its residual
            compensation. ``selection: static``: the checkpoint carries the calibrated channels as
            ``<site>.rac_channels`` (``qpass export --format qpass``); :meth:`from_config` (what the
            engine plugins call) refuses it: they do not serve static RAC yet.
        exclude: modules left unquantized (glob on the module prefix, or an exact suffix).
        weight_arithmetic: the quantizer arithmetic the weight bytes follow (module docstring);
            a sync must re-quantize master weights with the same one (``NVFP4Spec.arithmetic``).
        weight: ``nvfp4`` (NVFP4 weight bytes) or ``none`` (activation-only sites: the weight stays
            in the model dtype, activations get ``qpass::nvfp4_act_qdq``; config field ``qpass_weight``).
    """

    act: NVFP4ActMode = "nvfp4"
    rac: Mapping[str, RACConfig] = dataclasses.field(default_factory=dict)
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    weight_arithmetic: Literal["te_reference", "modelopt"] = "te_reference"
    weight: Literal["nvfp4", "none"] = "nvfp4"

    def __post_init__(self) -> None:
        if self.act not in ACT_MODES:
            raise QpassError(f"{METHOD_NAME}: act must be one of {ACT_MODES}, got {self.act!r}")
        if self.weight not in WEIGHT_MODES:
            raise QpassError(f"{METHOD_NAME}: qpass_weight must be one of {WEIGHT_MODES}, got {self.weight!r}")
        if self.weight == "none" and self.act == "none":
            raise QpassError(f"{METHOD_NAME}: qpass_weight 'none' with qpass_act 'none' quantizes nothing; "
                             "write an unquantized checkpoint (qpass export --format plain) instead")
        if self.weight == "none" and self.rac:
            raise QpassError(f"{METHOD_NAME}: site {sorted(self.rac)[0]} has RAC, but qpass_weight is 'none' "
                             "(activation-only sites have no residual-compensation path)")
        if self.weight_arithmetic not in WEIGHT_ARITHMETIC:
            raise QpassError(f"{METHOD_NAME}: weight_arithmetic must be one of {WEIGHT_ARITHMETIC}, got {self.weight_arithmetic!r}")
        for site, cfg in self.rac.items():
            if self.act == "none":
                raise QpassError(f"{METHOD_NAME}: site {site} has RAC but activations are not quantized (act='none')")

    @property
    def act_spec(self) -> NVFP4Spec | None:
        """The activation spec of :attr:`act` (None: W4A16)."""
        return NVFP4_ACT_MODES[self.act]

    # ------------------------------------------------------------------ config dicts
    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "QpassQuantOptions":
        """Parse either layout of the module docstring.

        Raises:
            QpassError: a quant_algo other than NVFP4 / W4A16_NVFP4 / W16A4_NVFP4, a ``qpass_weight``
                that is unknown or contradicts ``quant_algo``, or bad fields (the message names the field).
        """
        q = config.get("quantization", config)
        algo = q.get("quant_algo", "NVFP4")
        if algo not in QUANT_ALGOS:
            raise QpassError(f"{METHOD_NAME}: quant_algo {algo!r} is not one of {sorted(QUANT_ALGOS)} (use SGLang's own method for it)")
        weight = q.get("qpass_weight", QUANT_ALGOS[algo])
        if weight in WEIGHT_MODES and "quant_algo" in q and weight != QUANT_ALGOS[algo]:
            raise QpassError(f"{METHOD_NAME}: qpass_weight {weight!r} contradicts quant_algo {algo!r} "
                             f"(W16A4_NVFP4 <-> qpass_weight 'none'; NVFP4 / W4A16_NVFP4 <-> 'nvfp4')")
        if q.get("group_size", 16) not in (16, None):
            raise QpassError(f"{METHOD_NAME}: NVFP4 group_size must be 16, got {q.get('group_size')}")
        act = q.get("qpass_act")
        if act is None:
            ia = q.get("input_activations") or {}
            act = nvfp4_act_mode(None if algo == "W4A16_NVFP4" else (NVFP4_ACT_PER_TOKEN if ia.get("per_token") else NVFP4_ACT))
        rac = {}
        for site, r in (q.get("rac") or {}).items():
            rac[site] = RACConfig(float(r["ratio"]), r.get("mode", "masked"), r.get("selection", "batch"))
            if rac[site].selection == "static":
                raise QpassError(f"{METHOD_NAME}: site {site} uses static RAC (calibrated channels {site}.rac_channels); "
                                 "the qpass engine plugins do not serve static RAC yet (use selection batch or token)")
        excl = q.get("exclude_modules") or q.get("ignore") or q.get("modules_to_not_convert")
        arith = q.get("weight_arithmetic", "te_reference")
        return cls(act=act, rac=rac, exclude=tuple(excl) if excl is not None else DEFAULT_EXCLUDE, weight_arithmetic=arith,
                   weight=weight)

    def to_config(self) -> dict[str, Any]:
        """Flat ``quantization_config`` for a checkpoint's ``config.json`` (selects the plugin)."""
        act_only = self.weight == "none"
        return {
            "quant_method": METHOD_NAME,
            "quant_algo": "W16A4_NVFP4" if act_only else ("W4A16_NVFP4" if self.act == "none" else "NVFP4"),
            "group_size": 16,
            "qpass_act": self.act,
            "qpass_weight": self.weight,
            "input_activations": None if self.act_spec is None else {"dynamic": True, "per_token": self.act_spec.global_scope == "per_token"},
            "weight_global_scale_convention": None if act_only else "weight_scale_2 = S_dec (decode multiplier)",
            "weight_arithmetic": self.weight_arithmetic,
            "exclude_modules": list(self.exclude),
            "rac": {s: dataclasses.asdict(c) for s, c in sorted(self.rac.items())},
        }

    # ------------------------------------------------------------------ per layer
    def members(self, prefix: str, packed_modules_mapping: Mapping[str, Sequence[str]] | None = None) -> list[str]:
        """Checkpoint sites an SGLang layer ``prefix`` computes (``...qkv_proj`` -> q, k, v)."""
        parent, _, leaf = prefix.rpartition(".")
        mapping = {**PACKED_MODULES, **(packed_modules_mapping or {})}
        if leaf in mapping:
            return [f"{parent}.{m}" if parent else m for m in mapping[leaf]]
        return [prefix]

    def is_excluded(self, prefix: str, packed_modules_mapping: Mapping[str, Sequence[str]] | None = None) -> bool:
        """Whether layer ``prefix`` stays unquantized.

        Raises:
            QpassError: a fused layer with some members excluded and some not (one GEMM cannot
                be half quantized).
        """
        flags = [any(_match(m, pat) for pat in self.exclude) for m in self.members(prefix, packed_modules_mapping)]
        if any(flags) and not all(flags):
            raise QpassError(f"{METHOD_NAME}: fused layer {prefix} has members both excluded and quantized ({self.members(prefix, packed_modules_mapping)})")
        return all(flags)

    def rac_for(self, prefix: str, packed_modules_mapping: Mapping[str, Sequence[str]] | None = None) -> RACConfig | None:
        """The RAC of layer ``prefix`` (all fused members must agree: they share one input).

        Raises:
            QpassError: fused members with different RAC settings.
        """
        cfgs = {self.rac.get(m) for m in self.members(prefix, packed_modules_mapping)}
        if len(cfgs) > 1:
            raise QpassError(f"{METHOD_NAME}: fused layer {prefix} has members with different RAC settings {cfgs}; they share one input and one GEMM")
        return cfgs.pop()


def _match(site: str, pattern: str) -> bool:
    """Glob on the full module path, or a plain name that equals the path or its dotted suffix."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(site, pattern)
    return site == pattern or site.endswith("." + pattern)


def checkpoint_quant_config(options: QpassQuantOptions) -> dict[str, Any]:
    """``{"quantization_config": ...}`` to merge into a checkpoint's ``config.json``."""
    return {"quantization_config": options.to_config()}
