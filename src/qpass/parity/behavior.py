"""Behavioural parity: sample from the rollout graph, score with the learner graph (SPEC §4).

``d_t = log p(a_t|h_t) - log q(a_t|h_t)`` on valid sampled tokens, with ``q`` recorded by the
rollout at sampling time and ``p`` from the learner's full-sequence scoring, both under the same
sampling distribution (temperature, top-p). For the ``bf16`` recipe this is the engine-drift floor:
decode with a static KV cache versus full-sequence scoring with identical weights.

MoE models (``routing=True``): the rollout's top-k routes are recorded while it samples
(:mod:`qpass.moe.routing`), the learner scores once with its own routes (recorded too: the
per-layer routing mismatch, the fraction of valid tokens whose top-k set differs) and once replaying
the rollout's routes (routing replay), so the gap is reported with and without replay.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from qpass.diagnostics.metrics import MismatchMetrics, mismatch_metrics
from qpass.graph.qgraph import QGraph
from qpass.progress import phase, track
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
    replay: "GapResult | None" = None
    routing_mismatch: dict | None = None

    def summary(self) -> dict[str, float]:
        """The report keys: mean_abs, max_abs, k1, k3, tokens (token-mean reduction)."""
        m = self.metrics
        out = {"mean_abs": m.token.g_abs, "max_abs": m.max_abs, "k1": m.token.k1, "k3": m.token.k3,
               "tokens": m.n_tokens, "response_mean_abs": m.response.g_abs, "ess": m.token.ess_raw}
        if self.replay is not None:
            out["routing_replay"] = self.replay.summary()
        if self.routing_mismatch is not None:
            out["routing_mismatch"] = self.routing_mismatch
        return out


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
    routing: bool = False,
    progress: str = "sample from the rollout, score with the learner",
) -> GapResult:
    """Sample ``samples_per_prompt`` responses per prompt from ``rollout`` and score them with ``learner``.

    Prompts are processed in chunks of the rollout engine's batch size; chunk ``i`` uses seed
    ``seed + i``. ``learner`` / ``rollout`` are engines (:mod:`qpass.runtime.engine`) or graphs,
    which run on the built-in ``"qpass"`` engines.

    With ``routing`` (MoE), also: the learner's score replaying the rollout's routes
    (``GapResult.replay``) and the per-layer routing mismatch between the rollout's and the
    learner's own routes over valid tokens of real rows (``GapResult.routing_mismatch``:
    ``{layer: {"mismatch": fraction, "tokens": n}}`` plus ``"mean"`` over layers).

    ``progress`` names the phase (:mod:`qpass.progress`; one unit per batch of the rollout engine).

    Raises:
        RoutingError: (``routing``) the rollout recorded no routes (an engine that does not run
            qpass's graph) or a recording of unexpected shape.
    """
    import time

    ro = as_rollout_engine(rollout, pad_token_id=pad_token_id, eos_token_id=eos_token_id)
    le = as_learner_engine(learner)
    rows = [p for p in prompts for _ in range(samples_per_prompt)]
    logp_all, logq_all, mask_all, batches, logp_rep = [], [], [], [], []
    routes = _Routes(routing)
    wall, ntok = 0.0, 0
    for i in track(range(0, len(rows), ro.batch_size), progress, unit="batch"):
        chunk = rows[i:i + ro.batch_size]
        t0 = time.perf_counter()
        with routes.record() as ro_tape:
            b = ro.generate(chunk, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed + i)
        wall += time.perf_counter() - t0
        with routes.record() as le_tape, phase("score with the learner"):
            lp = le.token_logprobs(b.input_ids, b.attention_mask, temperature=temperature, top_p=top_p)[:, b.prompt_len - 1:]
        r = max_new_tokens
        pad = lambda t, v: torch.nn.functional.pad(t, (0, r - t.shape[1]), value=v)  # noqa: E731
        if routing:
            rep = routes.replayed_logprobs(le, b, ro_tape, le_tape, temperature=temperature, top_p=top_p)
            logp_rep.append(pad(rep.float().cpu(), 0.0))
        valid = b.response_mask.clone()
        valid[b.n_real:] = False
        ntok += int(valid.sum())
        logp_all.append(pad(lp.float().cpu(), 0.0))
        logq_all.append(pad(b.logq.cpu(), 0.0))
        mask_all.append(pad(valid.cpu(), False))
        batches.append(b)
    logp, logq, mask = torch.cat(logp_all), torch.cat(logq_all), torch.cat(mask_all)
    metrics = mismatch_metrics(logp, logq, mask)
    d = (logp - logq)[mask]
    tps = ntok / wall if wall > 0 else float("nan")
    replay = None
    if routing:
        lrep = torch.cat(logp_rep)
        replay = GapResult(mismatch_metrics(lrep, logq, mask), (lrep - logq)[mask], batches, tps)
    return GapResult(metrics, d, batches, tps, replay, routes.mismatch() if routing else None)


def rescore(
    learner: LearnerEngine | QGraph,
    gap: GapResult,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> GapResult:
    """The gap of another learner on the tokens ``gap`` sampled (same rollout, same ``log q``).

    Pairs a second learner with one rollout engine without sampling again: e.g. the weight-QDQ
    learner against the vLLM W4A4 engine whose samples the BF16 learner already scored.
    ``max_new_tokens`` must be the value the samples were drawn with (the response width).

    Raises:
        ValueError: ``gap`` holds no sampled batches.
    """
    if not gap.batches:
        raise ValueError("rescore: the gap result holds no sampled batches")
    le = as_learner_engine(learner)
    r = max_new_tokens
    pad = lambda t, v: torch.nn.functional.pad(t, (0, r - t.shape[1]), value=v)  # noqa: E731
    logp_all, logq_all, mask_all = [], [], []
    for b in gap.batches:
        lp = le.token_logprobs(b.input_ids, b.attention_mask, temperature=temperature, top_p=top_p)[:, b.prompt_len - 1:]
        valid = b.response_mask.clone()
        valid[b.n_real:] = False
        logp_all.append(pad(lp.float().cpu(), 0.0))
        logq_all.append(pad(b.logq.cpu(), 0.0))
        mask_all.append(pad(valid.cpu(), False))
    logp, logq, mask = torch.cat(logp_all), torch.cat(logq_all), torch.cat(mask_all)
    return GapResult(mismatch_metrics(logp, logq, mask), (logp - logq)[mask], gap.batches, gap.tokens_per_s)


class _Routes:
    """Route recording across chunks for :func:`logprob_gap` (a no-op unless ``on``)."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.differ: dict[str, float] = {}
        self.tokens: dict[str, int] = {}

    def record(self):  # noqa: ANN201
        import contextlib

        if not self.on:
            return contextlib.nullcontext()
        from qpass.moe.routing import record_routes

        return record_routes()

    def replayed_logprobs(self, le, b, ro_tape, le_tape, *, temperature: float, top_p: float) -> torch.Tensor:  # noqa: ANN001
        """Learner log-probs of batch ``b`` replaying the rollout's routes; accumulates the mismatch."""
        from qpass.moe.routing import RoutingError, concat_records, generate_routes, replay_routes, routing_mismatch

        if not ro_tape.records:
            raise RoutingError("routing replay: the rollout recorded no MoE routes (its engine does not run qpass's graph, "
                               "or the model has no MoE layer)")
        bsz, seq = b.input_ids.shape
        ro_routes = generate_routes(ro_tape.records, batch_size=bsz, prompt_len=b.prompt_len, seq_len=seq)
        valid = b.attention_mask.bool().clone()
        valid[b.n_real:] = False
        for layer, m in routing_mismatch(ro_routes, concat_records(le_tape.records), valid).items():
            if m["tokens"]:
                self.differ[layer] = self.differ.get(layer, 0.0) + m["mismatch"] * m["tokens"]
                self.tokens[layer] = self.tokens.get(layer, 0) + m["tokens"]
        with replay_routes(ro_routes):
            lp = le.token_logprobs(b.input_ids, b.attention_mask, temperature=temperature, top_p=top_p)
        return lp[:, b.prompt_len - 1:]

    def mismatch(self) -> dict:
        per = {k: {"mismatch": self.differ[k] / self.tokens[k], "tokens": self.tokens[k]} for k in self.tokens}
        mean = sum(v["mismatch"] for v in per.values()) / len(per) if per else float("nan")
        return {"mean": mean, "layers": per}
