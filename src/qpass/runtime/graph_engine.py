"""The built-in engines (name ``"qpass"``): qpass's own pass-rewritten graphs behind the engine protocols.

* :class:`GraphRolloutEngine`: the rollout step graph (static KV cache) as a
  :class:`qpass.runtime.engine.RolloutEngine`; weight updates re-quantize from master weights with
  :func:`qpass.runtime.sync.sync_weights`, the served bytes are read from the graph's constants.
* :class:`GraphLearnerEngine`: the learner scoring graph as a
  :class:`qpass.runtime.engine.LearnerEngine`; its parameters are the master weights.

Graph attribute paths carry the capture wrapper's prefix (``model.model.layers.0...``); the
engines translate to and from Hugging Face names (``model.layers.0...``) at the seam.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from qpass.errors import QpassError
from qpass.graph.capture import attr_of, site_of
from qpass.graph.qgraph import QGraph
from qpass.runtime.learner import TorchLearner
from qpass.runtime.rollout import TorchRollout
from qpass.runtime.served import ServedSite
from qpass.runtime.sync import SyncReport, sync_weights

__all__ = ["GraphLearnerEngine", "GraphRolloutEngine", "graph_weights"]


def graph_weights(qg: QGraph) -> dict[str, torch.Tensor]:
    """A graph's parameters by Hugging Face name (detached; tied weights under every name)."""
    return {site_of(path): p.detach() for path, p in qg.gm.named_parameters(remove_duplicate=False)}


class GraphRolloutEngine(TorchRollout):
    """The rollout step graph as a rollout engine (``make_rollout_engine("qpass", qg=..., ...)``).

    Args:
        qg: rollout-side :class:`QGraph` of kind ``step``.
        pad_token_id, eos_token_id: tokenizer ids.
        cuda_graphs: ``"off"`` (default) | ``"auto"`` | ``"on"``: the decode step under CUDA graphs
            (:mod:`qpass.runtime.cuda_graph`; eager on CPU).
    Raises:
        ValueError: ``qg`` is not a step graph. QpassError: bad ``cuda_graphs``, or ``"on"`` off CUDA.
    """

    name = "qpass"

    def __init__(self, qg: QGraph, *, pad_token_id: int, eos_token_id: int | Sequence[int], cuda_graphs: str = "off") -> None:
        super().__init__(qg, pad_token_id=pad_token_id, eos_token_id=eos_token_id, cuda_graphs=cuda_graphs)

    @property
    def device(self) -> torch.device:
        return self._device()

    @property
    def pad_token_id(self) -> int:
        return self.pad

    @property
    def eos_token_ids(self) -> list[int]:
        return [int(e) for e in self.eos.tolist()]

    def score(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, temperature: float = 1.0,
        top_p: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced ``log q`` (:meth:`TorchRollout.replay`: the generate schedule, bit for bit)."""
        return self.replay(prompts, responses, temperature=temperature, top_p=top_p)

    def update_weights(self, weights: Mapping[str, torch.Tensor]) -> SyncReport:
        """Re-quantize every rollout constant from ``weights`` (HF names) and copy the rest, in place.

        Raises:
            QpassError: a parameter or quantized site of the rollout graph has no weight in ``weights``
                (the first missing names are listed).
        """
        state = {attr_of(name): t for name, t in weights.items()}
        need = [p for p, _ in self.qg.gm.named_parameters(remove_duplicate=False)]
        need += [rec.weight for rec in self.qg.quant.values()]
        missing = sorted({site_of(p) for p in need if p not in state})
        if missing:
            raise QpassError(f"rollout weight update: {len(missing)} weight(s) missing from the update, e.g. {missing[:5]}")
        return sync_weights(state, self.qg)

    def sync_from(self, learner: "GraphLearnerEngine") -> SyncReport:
        """:meth:`update_weights` from a learner engine's :meth:`~GraphLearnerEngine.export_weights`."""
        return self.update_weights(learner.export_weights())

    def served_weights(self) -> dict[str, ServedSite]:
        """The constants the step graph computes with, per quantized site (the live buffers, not copies)."""
        from qpass.tables import entry

        buf = self.qg.gm.get_buffer
        out: dict[str, ServedSite] = {}
        for sid, rec in self.qg.quant.items():
            if not rec.lowered:
                continue
            lo = entry("rollout_lower", rec.spec)  # the op's tensor constants, in ServedSite order
            parts = [buf(rec.constants[c]) for c in lo.constant_args]
            out[sid] = ServedSite(sid, lo.served_format, *parts, group=rec.group if rec.spec.has_global_scale else sid)
        return out


class GraphLearnerEngine(TorchLearner):
    """The learner scoring graph as a learner engine (``make_learner_engine("qpass", qg=...)``).

    ``parameters()`` are the BF16 master weights; weight QDQ nodes inside the graph apply the STE.

    Raises:
        ValueError: ``qg`` is not a scoring graph.
    """

    name = "qpass"

    def __init__(self, qg: QGraph) -> None:
        super().__init__(qg)

    @property
    def device(self) -> torch.device:
        for t in self.gm.parameters():
            return t.device
        for t in self.gm.buffers():
            return t.device
        return torch.device("cpu")

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Master weights by Hugging Face name (detached views, model dtype)."""
        return graph_weights(self.qg)
