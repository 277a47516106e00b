"""Paired ("replay") log-prob gap measurement for the QUADS study (``qpass study``).

Comparing configurations on *different* sampled sequences mixes the configuration effect with
sampling noise. The paired design removes that noise:

1. :func:`sample_fixed_set`: sample the token sequences once, from one rollout graph (the study
   uses the BF16 rollout), in static batches exactly as :func:`qpass.parity.behavior.logprob_gap`
   does (chunk ``i`` of ``batch_size`` rows uses seed ``seed + first_row``).
2. :func:`replay_logq`: for every rollout configuration, teacher-force those exact tokens through
   its step graph with :meth:`qpass.runtime.RolloutEngine.score` (prefill, then one decode
   call per token, whole static batches including filler rows, so every forward call sees the same
   rows as the sampling run) and read ``log q`` of each given token.
3. :func:`learner_logp`: ``log p`` of the same tokens from each learner configuration
   (full-sequence scoring, :class:`qpass.runtime.LearnerEngine`).

``d = log p - log q`` is then computed on the same tokens for every (learner, rollout) pair, and
:func:`paired_bootstrap` gives a response-level bootstrap interval for the *difference* of mean
``|d|`` between two pairs (SPEC §4 metrics via :func:`qpass.diagnostics.mismatch_metrics`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from qpass.diagnostics.metrics import MismatchMetrics, mismatch_metrics
from qpass.graph.qgraph import QGraph
from qpass.runtime.engine import LearnerEngine, RolloutEngine, as_learner_engine, as_rollout_engine


@dataclasses.dataclass
class Chunk:
    """One static batch of the fixed sequence set.

    Attributes:
        prompts: ``batch_size`` prompt token lists (rows ``>= n_real`` repeat the last prompt).
        responses: valid response tokens of each row (EOS included when sampled).
        n_real: rows that hold real probe prompts.
        input_ids: int64 ``[B, P + R]`` left-padded prompts then responses (pad after the end).
        attention_mask: int64 ``[B, P + R]``.
        prompt_len: ``P``.
        response_mask: bool ``[B, R]`` valid response tokens.
        logq_sampled: float32 ``[B, R]``: ``log q`` recorded by the sampling rollout.
        seed: sampling seed of this chunk.
    """

    prompts: list[list[int]]
    responses: list[list[int]]
    n_real: int
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_len: int
    response_mask: torch.Tensor
    logq_sampled: torch.Tensor
    seed: int


@dataclasses.dataclass
class SampledSet:
    """The fixed token sequences every configuration is scored on.

    Attributes:
        chunks: static batches in probe order.
        width: ``R``, the response width every per-token tensor is padded to.
        temperature, top_p: the sampling distribution (used for ``log p`` and ``log q`` alike).
    """

    chunks: list[Chunk]
    width: int
    temperature: float
    top_p: float

    def valid_mask(self) -> torch.Tensor:
        """bool ``[rows, R]``: valid response tokens of *real* rows (filler rows are False)."""
        out = []
        for c in self.chunks:
            m = _pad(c.response_mask.cpu(), self.width, False)
            m[c.n_real:] = False
            out.append(m)
        return torch.cat(out)

    def sampled_logq(self) -> torch.Tensor:
        """float32 ``[rows, R]``: the sampling rollout's own ``log q`` (0 where invalid)."""
        return torch.cat([_pad(c.logq_sampled.cpu(), self.width, 0.0) for c in self.chunks])

    def response_ids(self) -> torch.Tensor:
        """int64 ``[rows]``: response index of each row (for response-level bootstrap)."""
        return torch.arange(sum(len(c.prompts) for c in self.chunks))

    @property
    def n_tokens(self) -> int:
        return int(self.valid_mask().sum())

    @property
    def n_responses(self) -> int:
        return sum(c.n_real for c in self.chunks)


def _pad(t: torch.Tensor, width: int, value: float | bool) -> torch.Tensor:
    """Right-pad ``t [B, R']`` to ``[B, width]`` with ``value``."""
    if t.shape[1] > width:
        raise ValueError(f"tensor is wider ({t.shape[1]}) than the set width {width}")
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


def sample_fixed_set(
    rollout: RolloutEngine | QGraph,
    prompts: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    eos_token_id: int | Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> SampledSet:
    """Sample one response per prompt from ``rollout`` (an engine, or a step graph on the built-in
    engine; static batches, filler rows kept).

    Raises:
        QpassError: from the engine's ``generate`` (batch or cache too small).
    """
    ro = as_rollout_engine(rollout, pad_token_id=pad_token_id, eos_token_id=eos_token_id)
    chunks = []
    for i in range(0, len(prompts), ro.batch_size):
        real = [list(p) for p in prompts[i:i + ro.batch_size]]
        b = ro.generate(real, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed + i)
        rows = real + [real[-1]] * (ro.batch_size - len(real))
        resp = [b.responses[j][b.response_mask[j]].tolist() for j in range(ro.batch_size)]
        chunks.append(Chunk(rows, resp, b.n_real, b.input_ids.cpu(), b.attention_mask.cpu(), b.prompt_len,
                            b.response_mask.cpu(), b.logq.cpu(), seed + i))
    return SampledSet(chunks, max_new_tokens, temperature, top_p)


def replay_logq(
    rollout: RolloutEngine | QGraph,
    sset: SampledSet,
    *,
    pad_token_id: int,
    eos_token_id: int | Sequence[int],
    step_fn_for_chunk: Callable[[int, object], Callable[..., torch.Tensor] | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log q`` of the fixed tokens under ``rollout`` (teacher-forced decode, whole static batches).

    Args:
        rollout: the configuration's rollout engine, or its step graph (built-in engine).
        sset: the fixed sequences.
        step_fn_for_chunk: optional ``(chunk_index, engine) -> step_fn or None`` (e.g. an
            activation recorder for chunk 0); a step function needs the built-in graph engine.
    Returns:
        ``(logq, mask)``: float32 ``[rows, R]`` and bool ``[rows, R]`` (all rows, filler included).
    Raises:
        QpassError: a step function was asked of an engine that does not run qpass's step graph.
    """
    from qpass.errors import QpassError
    from qpass.runtime.graph_engine import GraphRolloutEngine

    ro = as_rollout_engine(rollout, pad_token_id=pad_token_id, eos_token_id=eos_token_id)
    lq, mk = [], []
    for ci, c in enumerate(sset.chunks):
        fn = step_fn_for_chunk(ci, ro) if step_fn_for_chunk is not None else None
        if fn is None:
            logq, mask = ro.score(c.prompts, c.responses, temperature=sset.temperature, top_p=sset.top_p)
        elif isinstance(ro, GraphRolloutEngine):
            logq, mask = ro.replay(c.prompts, c.responses, temperature=sset.temperature, top_p=sset.top_p, step_fn=fn)
        else:
            raise QpassError(f"replay_logq: a step function (activation capture) needs qpass's graph engine, not {ro.name!r}")
        lq.append(_pad(logq, sset.width, 0.0))
        mk.append(_pad(mask, sset.width, False))
    return torch.cat(lq), torch.cat(mk)


@torch.no_grad()
def learner_logp(learner: LearnerEngine | QGraph, sset: SampledSet) -> torch.Tensor:
    """``log p`` of the fixed response tokens, float32 ``[rows, R]`` (0 where invalid); ``learner``
    is an engine or a scoring graph (built-in engine)."""
    le = as_learner_engine(learner)
    dev = le.device
    out = []
    for c in sset.chunks:
        lp = le.token_logprobs(c.input_ids.to(dev), c.attention_mask.to(dev), temperature=sset.temperature,
                               top_p=sset.top_p)[:, c.prompt_len - 1:]
        lp = torch.where(c.response_mask.to(lp.device), lp.float(), torch.zeros((), device=lp.device))
        out.append(_pad(lp.cpu(), sset.width, 0.0))
    return torch.cat(out)


def graph_device(qg: QGraph) -> torch.device:
    """Device of a graph's tensors (first parameter, else first buffer; CPU if it has neither)."""
    for t in qg.gm.parameters():
        return t.device
    for t in qg.gm.buffers():
        return t.device
    return torch.device("cpu")


def gap_summary(m: MismatchMetrics) -> dict[str, float]:
    """The report keys of one pair (token-mean reduction unless named ``response_*``; nats)."""
    return {"mean_abs": m.token.g_abs, "max_abs": m.max_abs, "k1": m.token.k1, "k3": m.token.k3,
            "ess": m.token.ess_raw, "response_mean_abs": m.response.g_abs, "tokens": m.n_tokens,
            "nonfinite": m.n_nonfinite}


def pair_metrics(logp: torch.Tensor, logq: torch.Tensor, mask: torch.Tensor) -> MismatchMetrics:
    """SPEC §4 metrics of ``d = logp - logq`` on ``mask`` (all ``[rows, R]``)."""
    return mismatch_metrics(logp, logq, mask)


def paired_bootstrap(
    d_a: torch.Tensor,
    d_b: torch.Tensor,
    mask: torch.Tensor,
    *,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> dict[str, float]:
    """Response-level paired bootstrap of ``mean|d_a| - mean|d_b|`` (token-mean, same tokens).

    Args:
        d_a, d_b: float ``[rows, R]`` ``d`` of two pairs on the *same* tokens.
        mask: bool ``[rows, R]`` valid tokens (rows without a valid token never contribute).
        n_boot: resamples of the responses (with replacement).
        level: two-sided percentile interval.
    Returns:
        ``{"diff", "lo", "hi", "n_responses"}`` (nats). ``lo > 0`` means ``a`` has the larger gap
        at that level.
    Raises:
        ValueError: shapes differ or no valid token.
    """
    if d_a.shape != d_b.shape or d_a.shape != mask.shape:
        raise ValueError(f"paired_bootstrap: shapes differ {tuple(d_a.shape)}, {tuple(d_b.shape)}, {tuple(mask.shape)}")
    m = mask.bool()
    keep = m.any(1)
    if not bool(keep.any()):
        raise ValueError("paired_bootstrap: no valid token")
    a = torch.where(m, d_a.double().abs(), torch.zeros((), dtype=torch.float64))[keep].sum(1)
    b = torch.where(m, d_b.double().abs(), torch.zeros((), dtype=torch.float64))[keep].sum(1)
    n = m[keep].sum(1).double()
    diff = float((a.sum() - b.sum()) / n.sum())
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, a.numel(), (n_boot, a.numel()), generator=gen)
    boots = (a[idx].sum(1) - b[idx].sum(1)) / n[idx].sum(1)
    q = torch.tensor([(1 - level) / 2, 1 - (1 - level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(boots, q).tolist()
    return {"diff": diff, "lo": lo, "hi": hi, "n_responses": int(a.numel())}
