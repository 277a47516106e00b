"""Torch eager learner: the pass-rewritten scoring graph as a trainable module.

The graph's parameters are the BF16 master weights; weight QDQ nodes inside it apply the STE, so
``loss.backward()`` followed by an optimizer step updates the master weights (QUADS learner side).
"""

from __future__ import annotations

import torch

from qpass.graph.qgraph import QGraph
from qpass.sampling import positions_from_mask, sampling_logprobs


class TorchLearner(torch.nn.Module):
    """Learner policy p over the (rewritten) scoring graph.

    Args:
        qg: learner-side :class:`QGraph` of kind ``scoring``.
    """

    def __init__(self, qg: QGraph) -> None:
        super().__init__()
        if qg.kind != "scoring":
            raise ValueError(f"TorchLearner needs a scoring graph, got kind={qg.kind!r}")
        self.qg = qg
        self.gm = qg.gm

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` (model dtype) for ``input_ids`` [B, T] with a 0/1 mask [B, T]."""
        return self.gm(input_ids, attention_mask.long(), positions_from_mask(attention_mask))

    def token_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
    ) -> torch.Tensor:
        """``log p(x_t | x_<t)`` under the sampling distribution, float32 ``[B, T-1]`` (entry t is token t+1)."""
        logits = self(input_ids, attention_mask)[:, :-1]
        lp = sampling_logprobs(logits, temperature, top_p)
        return lp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)

    def master_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Trainable BF16 master weights by graph attribute path."""
        return dict(self.gm.named_parameters())
