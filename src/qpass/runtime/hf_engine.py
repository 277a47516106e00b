"""A learner engine over the Hugging Face model's own forward: a *different engine* from qpass's graphs.

qpass's learner (the exported scoring graph) and rollout (the exported step graph with a static KV
cache) run the same torch ops, so their BF16 log-prob gap (the engine-drift floor) is close to 0
(0.0019-0.012 nats on the H200). A real RL stack scores with a training framework and samples with
a serving engine. :class:`HFLearnerEngine` scores with ``transformers``' module forward instead,
with the attention implementation named (``eager``: matmul + softmax in the model dtype;
``sdpa``: ``scaled_dot_product_attention``), so a study's floor pairs two engines
(``qpass study --learner-engine hf-eager``).

Learner-side quantization of a qpass learner graph is carried over op for op, with qpass's own ops:

* weight QDQ sites (``SiteQuant.spec`` set, ``weight_qdq``): the site's weight is replaced for the
  forward by ``qpass::nvfp4_qdq(W, qpass::group_amax(member weights), site[, arithmetic])``;
* activation QDQ sites (``SiteQuant.act_spec``, ``act_qdq``): a forward pre-hook applies
  ``qpass::nvfp4_act_qdq(x, site, per_token)`` to the module's input.

The weights are read when :meth:`HFLearnerEngine.token_logprobs` runs (no copies kept); the engine
does not train (``parameters()`` are the HF model's, for the protocol). The model's attention
implementation is switched for the call and restored.

Sources: transformers ``PreTrainedModel.set_attn_implementation``; ``torch.func.functional_call``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from qpass.errors import QpassError
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
        QpassError: unknown ``attn``, or a quantized site that is not a module of ``model``.
    """

    name = "hf"

    def __init__(self, model: torch.nn.Module, *, attn: str = "eager", learner: QGraph | None = None) -> None:
        if attn not in ATTN_IMPLEMENTATIONS:
            raise QpassError(f"HF learner engine: attention implementation must be one of {ATTN_IMPLEMENTATIONS}, got {attn!r}")
        self.model = model
        self.attn = attn
        self.weight_sites: dict[str, tuple[tuple[str, ...], tuple[Any, ...]]] = {}
        self.act_sites: dict[str, bool] = {}
        modules = dict(model.named_modules())
        for sid, rec in (learner.quant.items() if learner is not None else ()):
            if sid not in modules:
                raise QpassError(f"HF learner engine: quantized site {sid} is not a module of {type(model).__name__}")
            if rec.spec is not None:
                arith = getattr(rec.spec, "arithmetic", "te_reference")
                self.weight_sites[sid] = (tuple(rec.members), () if arith == "te_reference" else (arith,))
            if rec.act_spec is not None:
                self.act_sites[sid] = getattr(rec.act_spec, "global_scope", "per_tensor") == "per_token"
        self._modules = modules

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def parameters(self) -> Iterable[torch.nn.Parameter]:
        return self.model.parameters()

    def export_weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters(remove_duplicate=False)}

    def _qdq_weights(self) -> dict[str, torch.Tensor]:
        ops = torch.ops.qpass
        out: dict[str, torch.Tensor] = {}
        amax_cache: dict[tuple[str, ...], torch.Tensor] = {}
        for sid, (members, extra) in self.weight_sites.items():
            if members not in amax_cache:
                amax_cache[members] = ops.group_amax.default([self._modules[m].weight for m in members])
            out[f"{sid}.weight"] = ops.nvfp4_qdq.default(self._modules[sid].weight, amax_cache[members], sid, *extra)
        return out

    @contextlib.contextmanager
    def _hooks(self) -> Iterator[None]:
        handles = []
        for sid, per_token in self.act_sites.items():
            def pre(_mod: torch.nn.Module, args: tuple, sid: str = sid, per_token: bool = per_token) -> tuple:
                return (torch.ops.qpass.nvfp4_act_qdq.default(args[0], sid, per_token), *args[1:])

            handles.append(self._modules[sid].register_forward_pre_hook(pre))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

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
        with self._attention(), self._hooks():
            w = self._qdq_weights()
            if w:
                return torch.func.functional_call(self.model, w, args=(), kwargs=kw, strict=False).logits
            return self.model(**kw).logits

    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float = 1.0,
                       top_p: float = 1.0) -> torch.Tensor:
        """float32 ``[B, T - 1]``: log-prob of token ``t + 1`` under the sampling distribution."""
        logits = self.logits(input_ids, attention_mask)[:, :-1]
        lp = sampling_logprobs(logits, temperature, top_p)
        return lp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
