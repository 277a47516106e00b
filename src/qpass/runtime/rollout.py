"""Torch eager rollout: sample from the pass-rewritten step graph (static KV cache).

Prefill runs the whole left-padded prompt batch in one call of the step graph, then every decode
step feeds one token per row. The behaviour log-probabilities ``log q`` are recorded at sampling time
from the same sampling distribution (temperature, top-p) the learner scores with.

:meth:`TorchRollout.replay` is the paired-measurement counterpart of ``generate``: it feeds *given*
response tokens through the same prefill/decode schedule and reads ``log q`` of each given token, so
several rollout configurations can be compared on identical token sequences.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from qpass.errors import QpassError
from qpass.graph.qgraph import QGraph
from qpass.progress import phase
from qpass.runtime.cuda_graph import DecodeGraph
from qpass.runtime.prefill import left_pad, step_prefill_args
from qpass.sampling import sampling_logprobs


@dataclasses.dataclass
class RolloutBatch:
    """Sampled sequences.

    Attributes:
        input_ids: int64 ``[B, P + R]``: left-padded prompts then responses (pad after EOS).
        attention_mask: int64 ``[B, P + R]``: 1 on real prompt tokens and valid response tokens.
        prompt_len: ``P`` (padded prompt width).
        response_mask: bool ``[B, R]``: valid response tokens (up to and including EOS).
        logq: float32 ``[B, R]``: behaviour log-probabilities of the sampled tokens (0 where invalid).
        n_real: rows that hold real prompts (the rest pad the static batch).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_len: int
    response_mask: torch.Tensor
    logq: torch.Tensor
    n_real: int

    @property
    def responses(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len:]


class TorchRollout:
    """Behaviour policy q over the (rewritten) step graph.

    Args:
        qg: rollout-side :class:`QGraph` of kind ``step`` (fixed batch size and cache length).
        pad_token_id, eos_token_id: tokenizer ids.
        cuda_graphs: ``"off"`` (default), ``"auto"`` or ``"on"``: decode steps of ``generate`` and
            ``replay`` through :class:`qpass.runtime.cuda_graph.DecodeGraph` (CUDA only; prefill
            stays eager, its width varies). The tokens and log-probs are those of the eager path
            (same kernels, same inputs).
    """

    def __init__(self, qg: QGraph, *, pad_token_id: int, eos_token_id: int | Sequence[int],
                 cuda_graphs: str = "off") -> None:
        if qg.kind != "step":
            raise ValueError(f"TorchRollout needs a step graph, got kind={qg.kind!r}")
        self.qg = qg
        self.gm = qg.gm
        self.batch_size = int(qg.captured.batch_size)
        self.max_len = int(qg.captured.max_len)
        self.pad = int(pad_token_id)
        self.eos = torch.tensor(list(eos_token_id) if isinstance(eos_token_id, Sequence) else [eos_token_id])
        self.decode = DecodeGraph(self.gm, mode=cuda_graphs, device=self._device())  # type: ignore[arg-type]

    def _device(self) -> torch.device:
        for t in self.gm.buffers():
            return t.device
        return torch.device("cpu")

    def _kv_buffers(self) -> list[torch.Tensor]:
        return [b for n, b in self.gm.named_buffers() if n.startswith(("kv_keys_", "kv_values_"))]

    def _prefill(self, prompts: Sequence[Sequence[int]], dev: torch.device) -> tuple:
        """Step-graph arguments of the prefill call: the prompts left-padded, the static batch
        filled with copies of the last prompt (:func:`qpass.runtime.prefill.step_prefill_args`).

        Zeroes the static KV cache first (in place: a captured decode graph keeps its pointers).
        A left-pad query position has no visible key; on CUDA the attention then spreads it over the
        whole cache, so without the reset its hidden state would depend on the previous call's cache
        contents, and through the batch-wide statistics of the pad row (the RAC ``batch`` channel
        score, the per-tensor activation amax) so would the real rows: measured on the H200, two
        identical ``generate`` calls differed by up to 0.045 in log q under RAC ``batch`` selection
        (``docs/results/h200/cuda_graph_probe/graph_step_probe.json``).
        """
        for buf in self._kv_buffers():
            buf.zero_()
        ids, am = left_pad(prompts, pad_token_id=self.pad, device=dev)
        return step_prefill_args(ids, am, batch_size=self.batch_size, max_len=self.max_len)

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> RolloutBatch:
        """Sample up to ``max_new_tokens`` per prompt.

        Raises:
            QpassError: more prompts than the captured batch size, or prompt + new tokens longer
                than the captured cache.
        """
        n = len(prompts)
        if n == 0 or n > self.batch_size:
            raise QpassError(f"rollout graph was captured for batch {self.batch_size}, got {n} prompts")
        p = max(len(x) for x in prompts)
        if p + max_new_tokens > self.max_len:
            raise QpassError(f"prompt ({p}) + max_new_tokens ({max_new_tokens}) exceeds the KV cache ({self.max_len})")
        dev = self._device()
        b = self.batch_size
        ids, pos, cpos, mask = self._prefill(prompts, dev)
        gen = torch.Generator(device=dev).manual_seed(seed)
        eos = self.eos.to(dev)
        with phase("prefill"):
            logits = self.gm(ids, pos, cpos, mask)[:, -1]
        out_tok, out_lp, out_valid = [], [], []
        alive = torch.ones(b, dtype=torch.bool, device=dev)
        last_pos = pos[:, -1]
        with phase("decode", total=max_new_tokens, unit="token") as ph:
            for t in range(max_new_tokens):
                lp = sampling_logprobs(logits, temperature, top_p)
                tok = torch.multinomial(lp.exp(), 1, generator=gen).squeeze(-1)
                tok = torch.where(alive, tok, torch.full_like(tok, self.pad))
                out_tok.append(tok)
                out_lp.append(torch.where(alive, lp.gather(-1, tok.unsqueeze(-1)).squeeze(-1),
                                          torch.zeros_like(tok, dtype=torch.float32)))
                out_valid.append(alive.clone())
                mask[:, p + t] = alive.long()
                alive = alive & ~torch.isin(tok, eos)
                ph.advance()
                if t == max_new_tokens - 1 or not bool(alive.any()):
                    break
                last_pos = last_pos + 1
                logits = self.decode(tok.unsqueeze(-1), last_pos.unsqueeze(-1), torch.tensor([p + t], device=dev), mask)[:, -1]
        resp = torch.stack(out_tok, 1)
        valid = torch.stack(out_valid, 1)
        full_ids = torch.cat([ids, resp], 1)
        full_mask = torch.cat([mask[:, :p], valid.long()], 1)
        return RolloutBatch(full_ids, full_mask, p, valid, torch.stack(out_lp, 1).float(), n)

    @torch.no_grad()
    def replay(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        step_fn: Callable[..., torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Behaviour log-probabilities of given response tokens (teacher-forced decode).

        The exact schedule of :meth:`generate`: one prefill call over the left-padded prompt batch,
        then one decode call per response position with one token per row, the same position ids,
        cache positions and attention-mask updates; instead of sampling, row ``i`` feeds
        ``responses[i][t]`` while ``t < len(responses[i])`` and the pad token afterwards (a row ends
        where its list ends; EOS inside a list is not interpreted). ``log q`` of the given token is
        read from :func:`qpass.sampling.sampling_logprobs` of the step's logits, as ``generate``
        records it. Replaying every row of a ``generate`` batch (``batch_size`` rows, filler rows
        included, responses = the valid tokens of each row) therefore reproduces its ``logq`` and
        ``response_mask`` bit for bit: every forward call sees the same batch.

        Args:
            prompts: token ids per row (``1 <= len(prompts) <= batch_size``); missing rows of the
                static batch are filled with the last prompt and the last response, as
                ``generate`` fills prompts (so a partial batch is deterministic but is not the
                batch ``generate`` would have run: its filler rows sample their own tokens).
            responses: int token ids per row, same number of rows as ``prompts``; rows may be
                empty, at least one must not be.
            temperature, top_p: the sampling distribution (as in ``generate``).
            step_fn: optional callable with the step graph's signature
                ``(input_ids, position_ids, cache_position, attention_mask) -> logits`` used instead
                of the graph module (e.g. an fx Interpreter over ``self.gm`` recording activations).
        Returns:
            ``(logq, mask)``: float32 ``[n, R]`` log-probabilities of the given tokens (0 where
            invalid) and bool ``[n, R]`` validity, on CPU, ``n = len(prompts)``,
            ``R = max(len(r) for r in responses)``.
        Raises:
            QpassError: row counts differ, no rows, more rows than the captured batch size, all
                responses empty, or prompt + response longer than the captured cache.
        """
        n = len(prompts)
        if n == 0 or n > self.batch_size:
            raise QpassError(f"rollout graph was captured for batch {self.batch_size}, got {n} prompts")
        if len(responses) != n:
            raise QpassError(f"replay needs one response per prompt: {n} prompts, {len(responses)} responses")
        lens = [len(r) for r in responses]
        r_len = max(lens)
        if r_len == 0:
            raise QpassError("replay got only empty responses: nothing to score")
        p = max(len(x) for x in prompts)
        if p + r_len > self.max_len:
            raise QpassError(f"prompt ({p}) + response ({r_len}) exceeds the KV cache ({self.max_len})")
        step = self.gm if step_fn is None else step_fn
        decode = self.decode if step_fn is None else step_fn
        dev = self._device()
        b = self.batch_size
        rows = list(prompts) + [prompts[-1]] * (b - n)
        lens = lens + [lens[-1]] * (b - n)
        resp = torch.full((b, r_len), self.pad, dtype=torch.long)
        for i, r in enumerate(list(responses) + [responses[-1]] * (b - n)):
            if len(r):
                resp[i, : len(r)] = torch.tensor([int(t) for t in r], dtype=torch.long)
        alive_all = torch.arange(r_len).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)  # [b, R]
        ids, pos, cpos, mask = self._prefill(rows, dev)
        resp, alive_all = resp.to(dev), alive_all.to(dev)
        logits = step(ids, pos, cpos, mask)[:, -1]
        out_lp = []
        last_pos = pos[:, -1]
        for t in range(r_len):
            lp = sampling_logprobs(logits, temperature, top_p)
            alive = alive_all[:, t]
            tok = resp[:, t]
            picked = lp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
            out_lp.append(torch.where(alive, picked, torch.zeros_like(tok, dtype=torch.float32)))
            mask[:, p + t] = alive.long()
            if t == r_len - 1:
                break
            last_pos = last_pos + 1
            logits = decode(tok.unsqueeze(-1), last_pos.unsqueeze(-1), torch.tensor([p + t], device=dev), mask)[:, -1]
        logq = torch.stack(out_lp, 1).float()[:n].cpu()
        return logq, alive_all[:n].cpu()
