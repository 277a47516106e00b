"""Behavioural parity: sample from the rollout graph, score with the learner graph (SPEC §4).

``d_t = log p(a_t|h_t) - log q(a_t|h_t)`` on valid sampled tokens, with ``q`` recorded by the
rollout at sampling time and ``p`` from the learner's full-sequence scoring, both under the same
sampling distribution (temperature, top-p). For the ``bf16`` recipe this is the engine-drift floor:
decode with a static KV cache versus full-sequence scoring with identical weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from qpass.diagnostics.metrics import MismatchMetrics, mismatch_metrics
from qpass.graph.qgraph import QGraph
from qpass.runtime.engine import LearnerEngine, RolloutEngine, as_learner_engine, as_rollout_engine


@dataclasses.dataclass
class GapResult:
    """Log-prob gap of one learner/rollout pair on one probe set.

    Attributes:
        metrics: SPEC §4 metrics (token and response means).
        d: float32 ``d_t`` of every valid token (for histograms).
        batches: the sampled :class:`qpass.runtime.RolloutBatch` es (for replay / diagnostics).
        tokens_per_s: sampled valid tokens per second of rollout wall time.
    """

    metrics: MismatchMetrics
    d: torch.Tensor
    batches: list
    tokens_per_s: float

    def summary(self) -> dict[str, float]:
        """The report keys: mean_abs, max_abs, k1, k3, tokens (token-mean reduction)."""
        m = self.metrics
        return {"mean_abs": m.token.g_abs, "max_abs": m.max_abs, "k1": m.token.k1, "k3": m.token.k3,
                "tokens": m.n_tokens, "response_mean_abs": m.response.g_abs, "ess": m.token.ess_raw}


@torch.no_grad()
def logprob_gap(
    learner: LearnerEngine | QGraph,
    rollout: RolloutEngine | QGraph,
    prompts: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    eos_token_id: int,
    max_new_tokens: int = 24,
    samples_per_prompt: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> GapResult:
    """Sample ``samples_per_prompt`` responses per prompt from ``rollout`` and score them with ``learner``.

    Prompts are processed in chunks of the rollout engine's batch size; chunk ``i`` uses seed
    ``seed + i``. ``learner`` / ``rollout`` are engines (:mod:`qpass.runtime.engine`) or graphs,
    which run on the built-in ``"qpass"`` engines.
    """
    import time

    ro = as_rollout_engine(rollout, pad_token_id=pad_token_id, eos_token_id=eos_token_id)
    le = as_learner_engine(learner)
    rows = [p for p in prompts for _ in range(samples_per_prompt)]
    logp_all, logq_all, mask_all, batches = [], [], [], []
    wall, ntok = 0.0, 0
    for i in range(0, len(rows), ro.batch_size):
        chunk = rows[i:i + ro.batch_size]
        t0 = time.perf_counter()
        b = ro.generate(chunk, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed + i)
        wall += time.perf_counter() - t0
        lp = le.token_logprobs(b.input_ids, b.attention_mask, temperature=temperature, top_p=top_p)[:, b.prompt_len - 1:]
        valid = b.response_mask.clone()
        valid[b.n_real:] = False
        ntok += int(valid.sum())
        r = max_new_tokens
        pad = lambda t, v: torch.nn.functional.pad(t, (0, r - t.shape[1]), value=v)  # noqa: E731
        logp_all.append(pad(lp.float().cpu(), 0.0))
        logq_all.append(pad(b.logq.cpu(), 0.0))
        mask_all.append(pad(valid.cpu(), False))
        batches.append(b)
    logp, logq, mask = torch.cat(logp_all), torch.cat(logq_all), torch.cat(mask_all)
    metrics = mismatch_metrics(logp, logq, mask)
    d = (logp - logq)[mask]
    return GapResult(metrics, d, batches, ntok / wall if wall > 0 else float("nan"))
