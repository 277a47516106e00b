"""One GRPO step's sampled data as a single left-padded batch, and learner scoring of it.

The rollout graph has a static batch ``B``, so a step's ``prompts_per_step * group_size`` rows are
sampled in chunks (:class:`qpass.runtime.RolloutBatch` each, with its own padded prompt width
and response width). :func:`assemble` drops the filler rows of partial chunks and re-pads every
chunk to one common layout::

    input_ids       int64 [N, P + R]   prompt left-padded to P, response right-padded to R
    attention_mask  int64 [N, P + R]   1 on real prompt tokens and sampled response tokens
    response_mask   bool  [N, R]       tokens that enter the loss (valid sampled tokens)
    logq            f32   [N, R]       behaviour log-probs recorded at sampling time (0 off-mask)

Extra left padding does not change any position id (positions are ``cumsum(mask) - 1``), so the
learner sees exactly the sequences the rollout produced. ``R`` is ``max_new_tokens``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from qpass.sampling import sampling_logprobs

__all__ = ["Experience", "WindowScorer", "assemble", "decode_responses", "micro_batches", "response_logprobs"]


@runtime_checkable
class WindowScorer(Protocol):
    """A learner that computes logits at a window of positions only (:class:`qpass.runtime.TorchLearner`)."""

    def window_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Logits ``[B, stop - start, V]`` of positions ``start .. stop - 1`` of ``input_ids`` ``[B, T]``:
        those of ``learner(input_ids, attention_mask)[:, start:stop]``, with gradient only through them."""
        ...


@dataclasses.dataclass
class Experience:
    """Sampled rows of one step in the common layout (see module docstring).

    Attributes:
        input_ids: int64 ``[N, P + R]``.
        attention_mask: int64 ``[N, P + R]``.
        prompt_len: ``P``.
        response_mask: bool ``[N, R]``: loss tokens (``sampled_mask`` minus any loss masking,
            e.g. truncated responses under ``mask_truncated``).
        sampled_mask: bool ``[N, R]``: every token the rollout sampled (up to and including EOS).
        logq: float32 ``[N, R]``: ``log q`` of the sampled tokens (0 where not sampled).
        finished: bool ``[N]``: the response ended with an EOS token inside ``R``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_len: int
    response_mask: torch.Tensor
    sampled_mask: torch.Tensor
    logq: torch.Tensor
    finished: torch.Tensor

    @property
    def n(self) -> int:
        """Rows ``N``."""
        return int(self.input_ids.shape[0])

    @property
    def response_width(self) -> int:
        """``R``."""
        return int(self.response_mask.shape[1])

    @property
    def responses(self) -> torch.Tensor:
        """int64 ``[N, R]`` response token ids (pad after EOS)."""
        return self.input_ids[:, self.prompt_len:]

    def select(self, idx: torch.Tensor | Sequence[int]) -> "Experience":
        """Rows ``idx`` (same layout, same ``P`` and ``R``)."""
        i = torch.as_tensor(idx, dtype=torch.long, device=self.input_ids.device)
        return Experience(self.input_ids[i], self.attention_mask[i], self.prompt_len, self.response_mask[i],
                          self.sampled_mask[i], self.logq[i], self.finished[i])


def assemble(batches: Sequence[object], *, pad_token_id: int, eos_token_ids: Sequence[int], max_new_tokens: int) -> Experience:
    """Concatenate rollout chunks (real rows only) into one :class:`Experience`.

    Args:
        batches: :class:`qpass.runtime.RolloutBatch` es in row order (``input_ids``,
            ``attention_mask``, ``prompt_len``, ``response_mask``, ``logq``, ``n_real``).
        pad_token_id: id written into new padding.
        eos_token_ids: ids that end a response (``finished``).
        max_new_tokens: ``R``; every chunk's response width must be ``<= R``.
    Returns:
        :class:`Experience` on the device of the first chunk.
    Raises:
        ValueError: no chunks, a chunk wider than ``max_new_tokens``, or inconsistent shapes.
    """
    if not batches:
        raise ValueError("assemble: no rollout batches")
    p_max = max(int(b.prompt_len) for b in batches)
    r_max = int(max_new_tokens)
    ids, am, rm, lq = [], [], [], []
    for k, b in enumerate(batches):
        n, p = int(b.n_real), int(b.prompt_len)
        r = int(b.response_mask.shape[1])
        if r > r_max:
            raise ValueError(f"assemble: chunk {k} has {r} response tokens > max_new_tokens={r_max}")
        if tuple(b.input_ids.shape) != (b.input_ids.shape[0], p + r) or tuple(b.logq.shape) != tuple(b.response_mask.shape):
            raise ValueError(f"assemble: chunk {k} has inconsistent shapes: input_ids {tuple(b.input_ids.shape)}, "
                             f"prompt_len {p}, response_mask {tuple(b.response_mask.shape)}, logq {tuple(b.logq.shape)}")
        left, right = p_max - p, r_max - r
        ids.append(F.pad(b.input_ids[:n], (left, right), value=int(pad_token_id)))
        am.append(F.pad(b.attention_mask[:n].long(), (left, right), value=0))
        rm.append(F.pad(b.response_mask[:n].bool(), (0, right), value=False))
        lq.append(F.pad(b.logq[:n].float(), (0, right), value=0.0))
    input_ids, attention_mask = torch.cat(ids), torch.cat(am)
    sampled = torch.cat(rm)
    resp = input_ids[:, p_max:]
    eos = torch.as_tensor(list(eos_token_ids), dtype=resp.dtype, device=resp.device)
    finished = (torch.isin(resp, eos) & sampled).any(-1)
    return Experience(input_ids, attention_mask, p_max, sampled.clone(), sampled, torch.cat(lq), finished)


def decode_responses(tokenizer: object, exp: Experience) -> list[str]:
    """Text of each row's sampled response tokens (special tokens such as EOS dropped)."""
    resp, mask = exp.responses.cpu(), exp.sampled_mask.cpu()
    return [tokenizer.decode(resp[i][mask[i]].tolist(), skip_special_tokens=True) for i in range(resp.shape[0])]


def response_logprobs(
    learner: torch.nn.Module,
    exp: Experience,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Learner log-probs of the response tokens under the sampling distribution.

    Takes the learner's logits at the ``R`` positions that predict response tokens only: a
    :class:`WindowScorer` (e.g. :class:`qpass.runtime.TorchLearner`) runs its output projection on
    those ``N * R`` rows alone; any other learner (``learner(input_ids, attention_mask) -> logits``)
    scores the whole sequence and the window is sliced out before the softmax. Either way the
    ``[N, R, V]`` float32 log-softmax is the only float32 vocabulary-sized buffer, and position by
    position this is ``TorchLearner.token_logprobs(...)[:, P - 1:]``.

    Args:
        learner: a :class:`WindowScorer`, or a module returning logits ``[N, T, V]``.
        exp: the rows to score.
        temperature, top_p: the sampling distribution the rollout used (SPEC §4).
        with_entropy: also return the entropy (nats) of that distribution at each position.
    Returns:
        ``(logp, entropy)``: float32 ``[N, R]`` (gradient flows if enabled) and float32 ``[N, R]``
        detached entropy or None. Values off ``exp.sampled_mask`` are meaningless.
    """
    p, r = exp.prompt_len, exp.response_width
    if isinstance(learner, WindowScorer):
        logits = learner.window_logits(exp.input_ids, exp.attention_mask, p - 1, p - 1 + r)
    else:
        logits = learner(exp.input_ids, exp.attention_mask)[:, p - 1:p - 1 + r]
    lp_all = sampling_logprobs(logits, temperature, top_p)
    logp = lp_all.gather(-1, exp.input_ids[:, p:p + r].unsqueeze(-1)).squeeze(-1)
    ent = None
    if with_entropy:
        with torch.no_grad():
            fin = torch.isfinite(lp_all)
            plogp = torch.where(fin, lp_all.exp() * lp_all, torch.zeros_like(lp_all))
            ent = -plogp.sum(-1)
    return logp, ent


def micro_batches(n: int, size: int) -> list[torch.Tensor]:
    """Contiguous index blocks ``[0, size), [size, 2 size), ...`` covering ``range(n)``.

    Raises:
        ValueError: ``n < 0`` or ``size < 1``.
    """
    if n < 0 or size < 1:
        raise ValueError(f"micro_batches needs n >= 0 and size >= 1, got n={n}, size={size}")
    return [torch.arange(i, min(i + size, n)) for i in range(0, n, size)]
