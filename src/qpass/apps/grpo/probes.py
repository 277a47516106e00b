"""Side computations of a GRPO step: BF16 shadow scoring, the layer-wise probe, held-out evaluation.

**BF16 shadow** (clip-branch disagreement, SPEC §4; the FP8 study's counterfactual "what would a
BF16 rollout have given for these tokens"). The shadow is a *rollout engine* of its own
(:class:`qpass.runtime.RolloutEngine`; ``qpass grpo`` builds the built-in engine from the ``bf16``
recipe's rollout side through :func:`qpass.runtime.make_rollout_engine`, a vLLM engine plugs in the
same way). Before each step it is loaded through :meth:`~qpass.runtime.RolloutEngine.update_weights`
with :func:`shadow_weights` (the learner's master weights by default) and then scores the **same
sampled tokens** the quantized rollout produced, teacher-forced through its own decode path
(:meth:`~qpass.runtime.RolloutEngine.score`), in the chunks they were sampled in
(:func:`score_sampled`). For the ``bf16`` recipe the shadow engine and the rollout engine run the
same graph with the same weights and schedule, so ``q_bf16 == q`` bit for bit (the check that the
shadow is what it says).

**Layer-wise probe** (SPEC §4). A fixed batch of ``B`` prompt-only sequences is run through the
learner scoring graph and through the rollout step graph in prefill mode and the inputs of each
linear site are compared over the real (non-padding) tokens
(:func:`qpass.diagnostics.capture.compare_graph_inputs`, the capture-and-compare apply and the study use).

**Evaluation.** Held-out problems answered by the rollout graph (the engine that would serve the
policy), greedily by default (``top_p`` tiny keeps only the most likely token), scored with the
exact-answer reward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from qpass.progress import track
from qpass.diagnostics.capture import compare_graph_inputs
from qpass.diagnostics.layerwise import SiteMismatch
from qpass.graph.qgraph import QGraph
from qpass.rl.experience import Experience, assemble, decode_responses
from qpass.rl.task import exact_answer_reward

__all__ = ["GREEDY_TOP_P", "evaluate", "layerwise_probe", "layerwise_summary", "prompt_batch", "score_sampled",
           "shadow_weights", "split_experience"]

#: ``top_p`` that keeps exactly the most likely token (the first sorted token is always kept).
GREEDY_TOP_P = 1e-9


@torch.no_grad()
def shadow_weights(learner: QGraph, weights: dict[str, torch.Tensor], *, mode: str = "master") -> dict[str, torch.Tensor]:
    """The weights a BF16 shadow engine is loaded with, by Hugging Face name.

    Args:
        learner: the learner graph (its ``weight_qdq`` site records name the fake-quantized weights).
        weights: the learner engine's :meth:`~qpass.runtime.LearnerEngine.export_weights` (master
            weights, HF names, model dtype).
        mode: ``"master"``: ``weights`` as given (a plain BF16 rollout of the trained model);
            ``"learner"``: at every ``weight_qdq`` site ``DQ(Q(W))`` from ``qpass::nvfp4_qdq`` with
            the learner's group amax (what the learner forward computes with), the rest as given.
    Returns:
        a new dict (the given tensors are not modified).
    Raises:
        ValueError: unknown ``mode``.
    """
    from qpass import ops  # noqa: F401 - registers qpass::nvfp4_qdq / group_amax
    from qpass.graph.capture import site_of

    if mode not in ("master", "learner"):
        raise ValueError(f"shadow weights must be 'master' or 'learner', got {mode!r}")
    out = dict(weights)
    if mode == "master":
        return out
    lparams = dict(learner.gm.named_parameters(remove_duplicate=False))
    amax: dict[str, torch.Tensor] = {}
    for sid, rec in learner.quant.items():
        if not rec.weight_fake_quant:
            continue
        gid = rec.group
        if gid not in amax:
            amax[gid] = torch.ops.qpass.group_amax([lparams[learner.quant[m].weight].detach() for m in rec.members])
        out[site_of(rec.weight)] = torch.ops.qpass.nvfp4_qdq(lparams[rec.weight].detach(), amax[gid], sid)
    return out


def split_experience(exp: Experience) -> tuple[list[list[int]], list[list[int]]]:
    """``(prompts, responses)`` token lists per row of ``exp``: the real prompt tokens and the
    sampled response tokens (``sampled_mask``), i.e. what the rollout engine was given and produced."""
    p = exp.prompt_len
    prompts, responses = [], []
    for i in range(exp.n):
        am = exp.attention_mask[i, :p].bool()
        prompts.append(exp.input_ids[i, :p][am].tolist())
        responses.append(exp.input_ids[i, p:][exp.sampled_mask[i]].tolist())
    return prompts, responses


@torch.no_grad()
def score_sampled(engine: object, exp: Experience, chunk: int, *, temperature: float, top_p: float) -> torch.Tensor:
    """float32 ``[N, R]`` log-probs of ``exp``'s sampled tokens under ``engine`` (0 off ``sampled_mask``).

    Rows are scored in consecutive chunks of ``chunk`` rows (the chunks the rollout sampled in);
    a chunk whose responses are all empty is skipped (zeros).

    Args:
        engine: a :class:`qpass.runtime.RolloutEngine` (``score``).
        exp: the step's :class:`Experience`.
        chunk: rows per ``score`` call (<= ``engine.batch_size``).
    """
    prompts, responses = split_experience(exp)
    r = exp.response_width
    out = torch.zeros(exp.n, r, dtype=torch.float32)
    for start in range(0, exp.n, chunk):
        rs = responses[start:start + chunk]
        if not any(rs):
            continue
        lq, m = engine.score(prompts[start:start + chunk], rs, temperature=temperature, top_p=top_p)
        w = lq.shape[1]
        out[start:start + len(rs), :w] = torch.where(m, lq.float(), torch.zeros_like(lq, dtype=torch.float32))
    return out.to(exp.logq.device)


def prompt_batch(prompts: Sequence[Sequence[int]], n: int, *, pad_token_id: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` left-padded prompts (cycled if fewer are given): ``(input_ids, attention_mask)`` int64 ``[n, P]``.

    Raises:
        ValueError: no prompts, an empty prompt, or ``n < 1``.
    """
    if not prompts or n < 1 or any(len(x) == 0 for x in prompts):
        raise ValueError(f"prompt_batch needs n >= 1 and non-empty prompts (got n={n}, {len(prompts)} prompts)")
    rows = [list(prompts[i % len(prompts)]) for i in range(n)]
    p = max(len(x) for x in rows)
    ids = torch.full((n, p), int(pad_token_id), dtype=torch.long)
    am = torch.zeros(n, p, dtype=torch.long)
    for i, x in enumerate(rows):
        ids[i, p - len(x):] = torch.tensor(x, dtype=torch.long)
        am[i, p - len(x):] = 1
    return ids.to(device), am.to(device)


@torch.no_grad()
def layerwise_probe(learner: QGraph, rollout: QGraph, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, SiteMismatch]:
    """Per-site input-activation mismatch, learner scoring graph vs rollout step graph (prefill).

    Args:
        learner: learner :class:`QGraph` (kind ``scoring``).
        rollout: rollout :class:`QGraph` (kind ``step``); its KV cache is overwritten.
        input_ids, attention_mask: int64 ``[B, T]`` with ``B`` the rollout graph's static batch.
    Returns:
        ``{site: SiteMismatch}`` over the sites both graphs have, real tokens only, in the learner's order;
        sites whose input is not one row per token (MoE expert linears) are left out.
    Raises:
        ValueError: the batch is not the rollout graph's static batch size.
    """
    b = int(rollout.captured.batch_size)
    if input_ids.shape[0] != b:
        raise ValueError(f"layerwise_probe: the probe batch must have the rollout's static batch size {b}, got {input_ids.shape[0]}")
    return {s: m["pre"] for s, m in compare_graph_inputs(learner, rollout, input_ids, attention_mask).per_site.items()}


def layerwise_summary(per_site: dict[str, SiteMismatch]) -> dict[str, object]:
    """``mean_rel``, ``max_rel``, ``max_site`` (and ``n_sites``) of a :func:`layerwise_probe` result."""
    if not per_site:
        return {"n_sites": 0, "mean_rel": float("nan"), "max_rel": float("nan"), "max_site": None}
    rels = {s: m.rel for s, m in per_site.items()}
    worst = max(rels, key=rels.get)
    return {"n_sites": len(rels), "mean_rel": sum(rels.values()) / len(rels), "max_rel": rels[worst], "max_site": worst}


@torch.no_grad()
def evaluate(
    rollout: object,
    tokenizer: object,
    metas: Sequence[dict],
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    answer_fn: Callable[[Mapping[str, Any], str], float] | None = None,
) -> dict[str, float]:
    """Accuracy of the rollout policy on held-out problems.

    Args:
        rollout: a :class:`qpass.runtime.RolloutEngine`.
        tokenizer: decodes responses.
        metas: ``prompt_meta`` per problem (``answer`` is the ground truth).
        prompts: token ids per problem (same order).
        max_new_tokens: response budget.
        temperature: 0 = greedy (``top_p = GREEDY_TOP_P``), else sampling at this temperature.
        seed: sampling seed (chunk ``i`` uses ``seed + i``).
        answer_fn: ``(meta, text) -> float``, correct when ``>= 1.0`` (default
            :data:`qpass.rl.task.exact_answer_reward`).
    Returns:
        ``accuracy`` (exact answer), ``stderr`` (its binomial standard error
        ``sqrt(acc (1 - acc) / n)``), ``len_mean`` (tokens), ``finished_frac``, ``n``.
    Raises:
        ValueError: ``metas`` and ``prompts`` differ in length, or are empty.
    """
    if len(metas) != len(prompts) or not prompts:
        raise ValueError(f"evaluate needs as many metas as prompts (>0), got {len(metas)} and {len(prompts)}")
    temp, top_p = (1.0, GREEDY_TOP_P) if temperature == 0 else (float(temperature), 1.0)
    chunks = []
    b = rollout.batch_size
    for i in track(range(0, len(prompts), b), f"held-out eval ({len(prompts)} prompts)", unit="batch"):
        chunks.append(rollout.generate(list(prompts[i:i + b]), max_new_tokens=max_new_tokens, temperature=temp,
                                       top_p=top_p, seed=seed + i))
    exp = assemble(chunks, pad_token_id=rollout.pad_token_id, eos_token_ids=rollout.eos_token_ids, max_new_tokens=max_new_tokens)
    texts = decode_responses(tokenizer, exp)
    answer_fn = answer_fn or exact_answer_reward
    correct = [answer_fn(m, t) >= 1.0 for m, t in zip(metas, texts)]
    return {
        "accuracy": sum(correct) / len(correct),
        "stderr": math.sqrt((sum(correct) / len(correct)) * (1 - sum(correct) / len(correct)) / len(correct)),
        "len_mean": float(exp.sampled_mask.sum(-1).float().mean()),
        "finished_frac": float(exp.finished.float().mean()),
        "n": float(len(correct)),
    }
