"""Typed per-site quantization records: what a pass recorded about a quantized site.

``QGraph.quant[site_id]`` is a :class:`SiteQuant`. Passes create or replace records
(``dataclasses.replace``); readers (weight sync, parity checker, artifacts, exports) read fields,
never string kinds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from qpass.formats.spec import NVFP4Spec, QuantSpec, nvfp4_act_mode
from qpass.quant.rac import RACConfig


@dataclasses.dataclass(frozen=True)
class SiteQuant:
    """What one quantized site carries.

    Attributes:
        site: site id (``model.layers.0.self_attn.q_proj``).
        weight: graph attribute path of the source (master) weight, e.g. ``model.<site>.weight``.
        group: fused-group id (shared amax) or the site id.
        members: site ids of the group quantized together (this one included), in order.
        spec: the weight spec, or None when only activations are quantized.
        act_spec: the activation spec, or None.
        op: the op that carries the site (``qpass::nvfp4_qdq_linear`` on the learner,
            ``qpass::nvfp4_linear`` ... on the rollout, ``qpass::nvfp4_act_qdq`` for activations only).
        constants: rollout only: constant name (``codes``, ``scales``, ``s_dec``, ``s_enc``, ``data``,
            ``scale``) -> buffer attribute of the graph module.
        rac: residual activation compensation config, or None.
        flushed_blocks: non-zero weight blocks whose block scale underflowed to 0 at the last
            quantization (they decode to 0; SPEC §3 keep-zero rule).
    """

    site: str
    weight: str
    group: str
    members: tuple[str, ...]
    spec: QuantSpec | None = None
    act_spec: QuantSpec | None = None
    op: str | None = None
    constants: Mapping[str, str] = dataclasses.field(default_factory=dict)
    rac: RACConfig | None = None
    flushed_blocks: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(self.members))
        object.__setattr__(self, "constants", dict(self.constants))

    @property
    def lowered(self) -> bool:
        """The weight lives as quantized constants of a rollout op."""
        return bool(self.constants)

    @property
    def weight_fake_quant(self) -> bool:
        """Learner: the weight is fake-quantized in place (``weight_qdq``)."""
        return self.spec is not None and not self.constants

    def lowered_as(self, spec_type: type) -> bool:
        """The weight lives as quantized constants of a rollout op and its spec is a ``spec_type``
        (``NVFP4Spec``, ``FP8Spec``, ``MXFP4Spec``)."""
        return self.lowered and isinstance(self.spec, spec_type)

    @property
    def activation_only(self) -> bool:
        """Only the input is quantized (the ``act_qdq`` pass): no weight spec, an activation spec."""
        return self.spec is None and self.act_spec is not None

    @property
    def w4a4(self) -> bool:
        """An NVFP4-lowered site whose activations are quantized too."""
        return self.lowered_as(NVFP4Spec) and self.act_spec is not None

    def nvfp4_act_mode(self) -> str | None:
        """The NVFP4 activation mode of the site (``qpass.formats.spec.NVFP4_ACT_MODES``: ``none`` when
        activations stay unquantized), or None when its activation spec is not NVFP4."""
        try:
            return nvfp4_act_mode(self.act_spec)
        except ValueError:
            return None

    @property
    def kind(self) -> str:
        """Short label for reports (never compared by readers: ask :meth:`lowered_as` and the other
        predicates): the op name without namespace, or ``weight_qdq`` / ``act_qdq``."""
        if self.lowered:
            return (self.op or "").split("::")[-1]
        return "weight_qdq" if self.spec is not None else "act_qdq"

    def describe(self) -> dict[str, Any]:
        """JSON-able summary (spec keys, not objects)."""
        return {
            "kind": self.kind, "op": self.op, "weight_spec": self.spec.key if self.spec else None,
            "act_spec": self.act_spec.key if self.act_spec else None, "group": self.group,
            "members": list(self.members), "weight": self.weight,
            **({"rac": dataclasses.asdict(self.rac)} if self.rac else {}),
            **({"flushed_blocks": self.flushed_blocks} if self.flushed_blocks else {}),
        }
