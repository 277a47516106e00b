"""A learner engine over the Hugging Face model's own forward: a *different engine* from qpass's graphs.

qpass's learner (the exported scoring graph) and rollout (the exported step graph with a static KV
cache) run the same torch ops, so their BF16 log-prob gap (the engine-drift floor) is close to 0
(0.0019-0.012 nats on the H200). A real RL stack scores with a training framework and samples with
a serving engine. :class:`HFLearnerEngine` scores with ``transformers``' module forward instead,
with the attention implementation named (``eager``: matmul + softmax in the model dtype;
``sdpa``: ``scaled_dot_product_attention``), so a study's floor pairs two engines
(``qpass study --learner-engine hf-eager``).

Learner-side quantization of a qpass learner graph is carried over op for op, with the ops and
argument rules of the ``learner_qdq`` spec table (:class:`qpass.tables.LearnerQDQ`), the ones
``weight_qdq`` / ``act_qdq`` put into the learner graph:

* weight QDQ sites (``SiteQuant.spec`` set, ``weight_qdq``): the module's forward is, for the call,
  the spec's ``linear`` op (NVFP4: ``qpass::nvfp4_qdq_linear(x, W, qpass::group_amax(member
  weights), bias, site[, arithmetic])``, the factored decode of SPEC §3.1; FP8 / MXFP4:
  ``qpass::qdq_linear``), the group amax computed once per call from the current weights;
* activation QDQ sites (``SiteQuant.act_spec``, ``act_qdq``): a forward pre-hook applies the spec's
  ``activation`` op (NVFP4: ``qpass::nvfp4_act_qdq(x, site, per_token)``) to the module's input.

The weights are read when :meth:`HFLearnerEngine.token_logprobs` runs (no copies kept); the engine
does not train (``parameters()`` are the HF model's, for the protocol). The model's attention
implementation is switched for the call and restored.

Sources: transformers ``PreTrainedModel.set_attn_implementation``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from qpass.errors import QpassError
from qpass.formats.spec import QuantSpec
from qpass.graph.qgraph import QGraph
from qpass.sampling import positions_from_mask, sampling_logprobs

__all__ = ["ATTN_IMPLEMENTATIONS", "HFLearnerEngine"]

#: Attention implementations :class:`HFLearnerEngine` accepts.
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")


class HFLearnerEngine:
    """``log p`` from ``model``'s Hugging Face forward, with a qpass learner graph's QDQ applied.

    Args:
        model: the loaded HF causal LM (``LoadedModel.model``); its parameters are the master weights.
        attn: ``"eager"`` or ``"sdpa"``.
        learner: a learner-side :class:`QGraph` whose ``quant`` records name the QDQ to apply
            (None: plain BF16).
    Raises:
        QpassError: unknown ``attn``, a quantized site that is not a module of ``model``, or a spec
            whose ``learner_qdq`` entry has no linear / activation op rule.
    """

    name = "hf"

    def __init__(self, model: torch.nn.Module, *, attn: str = "eager", learner: QGraph | None = None) -> None:
        if attn not in ATTN_IMPLEMENTATIONS:
            raise QpassError(f"HF learner engine: attention implementation must be one of {ATTN_IMPLEMENTATIONS}, got {attn!r}")
        self.model = model
        self.attn = attn
        from qpass.quant import qdq  # noqa: F401 - registers the learner ops
        from qpass.tables import entry

        #: site -> (fused-group members, weight spec): the module's forward becomes the spec's linear op
        self.weight_sites: dict[str, tuple[tuple[str, ...], QuantSpec]] = {}
        #: site -> activation spec: a pre-hook applies the spec's activation op to the module's input
        self.act_sites: dict[str, QuantSpec] = {}
        modules = dict(model.named_modules())
        for sid, rec in (learner.quant.items() if learner is not None else ()):
            if sid not in modules:
                raise QpassError(f"HF learner engine: quantized site {sid} is not a module of {type(model).__name__}")
            for spec, rule in ((rec.spec, "linear_args"), (rec.act_spec, "act_args")):
                if spec is not None and getattr(entry("learner_qdq", spec), rule) is None:
                    raise QpassError(f"HF learner engine: site {sid}: the learner_qdq entry of {spec.key} has no {rule} rule")
            if rec.spec is not None:
                self.weight_sites[sid] = (tuple(rec.members), rec.spec)
            if rec.act_spec is not None:
                self.act_sites[sid] = rec.act_spec
        self._modules = modules

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def parameters(self) -> Iterable[torch.nn.Parameter]:
        return self.model.parameters()

    def export_weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters(remove_duplicate=False)}

    @contextlib.contextmanager
    def _quantized(self) -> Iterator[None]:
        """For the call: weight-QDQ sites run the spec's ``linear`` op (group amax of the current weights,
        once per group), activation-QDQ sites get the spec's ``activation`` op as a forward pre-hook."""
        from qpass.tables import entry

        handles, replaced = [], []
        try:
            for sid, spec in self.act_sites.items():
                lq = entry("learner_qdq", spec)

                def pre(_mod: torch.nn.Module, args: tuple, sid: str = sid, spec: QuantSpec = spec, lq: Any = lq) -> tuple:
                    return (lq.overload("activation")(*lq.act_args(spec, args[0], sid)), *args[1:])

                handles.append(self._modules[sid].register_forward_pre_hook(pre))
            amax: dict[tuple[str, ...], torch.Tensor | None] = {}
            for sid, (members, spec) in self.weight_sites.items():
                if members not in amax:  # one fresh amax per fused group (SPEC §3 rules 1, 2), as the graph's group_amax
                    amax[members] = (torch.ops.qpass.group_amax.default([self._modules[m].weight for m in members])
                                     if spec.has_global_scale else None)
                mod, lq = self._modules[sid], entry("learner_qdq", spec)

                def forward(x: torch.Tensor, mod: torch.nn.Module = mod, sid: str = sid, spec: QuantSpec = spec, lq: Any = lq,
                            a: torch.Tensor | None = amax[members]) -> torch.Tensor:
                    return lq.overload("linear")(*lq.linear_args(spec, x, mod.weight, a, mod.bias, sid))

                mod.forward = forward  # an instance attribute: nn.Module.__call__ runs it after the pre-hooks
                replaced.append(mod)
            yield
        finally:
            for h in handles:
                h.remove()
            for mod in replaced:
                del mod.forward

    @contextlib.contextmanager
    def _attention(self) -> Iterator[None]:
        prev = getattr(self.model.config, "_attn_implementation", None)
        if prev != self.attn:
            self.model.set_attn_implementation(self.attn)
        try:
            yield
        finally:
            if prev is not None and prev != self.attn:
                self.model.set_attn_implementation(prev)

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B, T, V]`` logits of the HF forward (position ids from the mask, as qpass's graphs use)."""
        kw = dict(input_ids=input_ids, attention_mask=attention_mask.long(), position_ids=positions_from_mask(attention_mask),
                  use_cache=False)
        with self._attention(), self._quantized():
            return self.model(**kw).logits

    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float = 1.0,
                       top_p: float = 1.0) -> torch.Tensor:
        """float32 ``[B, T - 1]``: log-prob of token ``t + 1`` under the sampling distribution."""
        logits = self.logits(input_ids, attention_mask)[:, :-1]
        lp = sampling_logprobs(logits, temperature, top_p)
        return lp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
