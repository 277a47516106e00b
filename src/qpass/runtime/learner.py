"""Torch eager learner: the pass-rewritten scoring graph as a trainable module.

The graph's parameters are the BF16 master weights; weight QDQ nodes inside it apply the STE, so
``loss.backward()`` followed by an optimizer step updates the master weights (QUADS learner side).
"""

from __future__ import annotations

import torch

from qpass.graph.qgraph import QGraph
from qpass.runtime.head_window import HeadSplit, split_at_head
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
        # the graph split at its head, built on first use for the graph id(gm) (plain attributes, not submodules)
        self._split: HeadSplit | None = None
        self._split_key: int | None = None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` (model dtype) for ``input_ids`` [B, T] with a 0/1 mask [B, T]."""
        return self.gm(input_ids, attention_mask.long(), positions_from_mask(attention_mask))

    def window_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Logits ``[B, stop - start, V]`` (model dtype) of positions ``start .. stop - 1`` only.

        The output projection runs on those rows alone (:mod:`qpass.runtime.head_window`); a graph
        whose head cannot be split computes ``self(input_ids, attention_mask)[:, start:stop]``.

        Raises:
            ValueError: the window is outside ``[0, T]``.
        """
        if self._split_key != id(self.gm) or (self._split is not None and not self._split.current(self.gm)):
            self._split, self._split_key = split_at_head(self.gm), id(self.gm)
        if self._split is None:
            t = int(input_ids.shape[1])
            if not 0 <= start <= stop <= t:
                raise ValueError(f"window [{start}, {stop}) is outside the sequence of length {t}")
            return self(input_ids, attention_mask)[:, start:stop]
        return self._split.window_logits(input_ids, attention_mask.long(), positions_from_mask(attention_mask), start, stop)

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
