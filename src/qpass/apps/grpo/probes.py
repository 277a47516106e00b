"""Side computations of a GRPO step: BF16 shadow scoring, the layer-wise probe, held-out evaluation.

**BF16 shadow** (for clip-branch disagreement, SPEC §4). The shadow is the *unquantized* captured
step graph (``Pipeline.base_step`` cloned, no passes), refreshed from the learner before each use
and run in **prefill mode**: every sampled sequence is fed in one call of the step graph and the
log-probs of its response tokens are read off under the sampling distribution. Its weights are by
default those the learner's forward computes with (``DQ(Q(W))`` at ``weight_qdq`` sites, the BF16
master elsewhere), so it stands for "a BF16 rollout of the policy being trained";
``weights="master"`` uses the BF16 masters everywhere (for QAT recipes that also differs from the
learner by the weight quantization).

Why the step graph and not the base scoring graph: the shadow stands for the rollout engine without
quantization, so it runs the rollout's own code path (static-KV step graph, static batch, same
attention/cache implementation); and for recipes whose learner is plain BF16 (bf16, naive_nvfp4,
fp8_block) the scoring graph *is* the learner, so a scoring-graph shadow would equal ``p_prox`` and
the shadow ratio would collapse into the PPO ratio itself. Why prefill and not a token-by-token
decode replay: one forward per chunk instead of ``R``; the price is that the shadow contains the
prefill-versus-decode engine drift, which the ``bf16`` recipe measures (its rollout *is* the BF16
decode path, so its ``shadow_gap`` is exactly that drift).

**Layer-wise probe** (SPEC §4). A fixed batch of ``B`` prompt-only sequences is run through the
learner scoring graph and through the rollout step graph in prefill mode with
:func:`qpass.diagnostics.capture.capture_linear_inputs`; :func:`qpass.diagnostics.layerwise_mismatch`
compares the inputs of each linear site over the real (non-padding) tokens.

**Evaluation.** Held-out problems answered by the rollout graph (the engine that would serve the
policy), greedily by default (``top_p`` tiny keeps only the most likely token), scored with the
exact-answer reward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qpass.diagnostics.capture import capture_linear_inputs
from qpass.diagnostics.layerwise import SiteMismatch, layerwise_mismatch
from qpass.graph.qgraph import QGraph
from qpass.sampling import positions_from_mask, sampling_logprobs
from qpass.rl.experience import Experience, assemble, decode_responses, micro_batches
from qpass.runtime.prefill import step_prefill_args
from qpass.rl.task import exact_answer_reward

__all__ = ["GREEDY_TOP_P", "BF16Shadow", "evaluate", "layerwise_probe", "layerwise_summary", "prompt_batch"]

#: ``top_p`` that keeps exactly the most likely token (the first sorted token is always kept).
GREEDY_TOP_P = 1e-9


class BF16Shadow:
    """The unquantized step graph, synced from the learner, scoring sampled sequences in prefill.

    Args:
        base_step: the captured step graph (``Pipeline.base_step``); it is cloned, never modified.
    Raises:
        ValueError: ``base_step`` is not a step graph or already carries quantized sites.
    """

    def __init__(self, base_step: QGraph) -> None:
        if base_step.kind != "step":
            raise ValueError(f"BF16Shadow needs the base step graph, got kind={base_step.kind!r}")
        if base_step.quant:
            raise ValueError("BF16Shadow needs an unquantized step graph; this one has quantized sites")
        self.qg = base_step.clone("rollout")
        self.batch_size = int(base_step.captured.batch_size)
        self.max_len = int(base_step.captured.max_len)

    @torch.no_grad()
    def sync(self, learner: QGraph, *, weights: str = "learner") -> int:
        """Refresh the shadow's weights from the learner; returns the number of parameters set.

        Args:
            learner: the learner graph.
            weights: ``"learner"``: the weights the learner's forward computes with (for
                ``weight_qdq`` sites the fake-quantized ``DQ(Q(W))`` from ``qpass::nvfp4_qdq`` with
                the learner's group amax; every other weight as is), so the shadow is "a BF16
                rollout of the policy being trained"; ``"master"``: the BF16 master weights
                (the literal unquantized model, which for QAT recipes also differs from the learner
                by the weight quantization).
        Raises:
            ValueError: unknown ``weights``.
        """
        from qpass import ops  # noqa: F401 - registers qpass::nvfp4_qdq / group_amax
        from qpass.runtime import sync_weights

        if weights not in ("learner", "master"):
            raise ValueError(f"BF16Shadow.sync: weights must be 'learner' or 'master', got {weights!r}")
        n = sync_weights(learner, self.qg).copied
        if weights == "learner":
            lparams = dict(learner.gm.named_parameters(remove_duplicate=False))
            sparams = dict(self.qg.gm.named_parameters(remove_duplicate=False))
            amax: dict[str, torch.Tensor] = {}
            for sid, rec in learner.quant.items():
                if not rec.weight_fake_quant:
                    continue
                gid = rec.group
                if gid not in amax:
                    amax[gid] = torch.ops.qpass.group_amax([lparams[learner.quant[m].weight].detach() for m in rec.members])
                w = lparams[rec.weight].detach()
                sparams[rec.weight].copy_(torch.ops.qpass.nvfp4_qdq(w, amax[gid], sid))
        return n

    @torch.no_grad()
    def score(self, exp: Experience, *, temperature: float, top_p: float) -> torch.Tensor:
        """float32 ``[N, R]`` shadow log-probs of the response tokens (meaningless off-mask)."""
        p, r = exp.prompt_len, exp.response_width
        out = []
        for idx in micro_batches(exp.n, self.batch_size):
            sub = exp.select(idx)
            args = step_prefill_args(sub.input_ids, sub.attention_mask, batch_size=self.batch_size, max_len=self.max_len)
            logits = self.qg.gm(*args)[: len(idx), p - 1:p - 1 + r]
            lp = sampling_logprobs(logits, temperature, top_p)
            out.append(lp.gather(-1, sub.input_ids[:, p:p + r].unsqueeze(-1)).squeeze(-1))
        return torch.cat(out)


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
        ``{site: SiteMismatch}`` over the sites both graphs have, real tokens only.
    Raises:
        ValueError: the batch is not the rollout graph's static batch size.
    """
    b = int(rollout.captured.batch_size)
    if input_ids.shape[0] != b:
        raise ValueError(f"layerwise_probe: the probe batch must have the rollout's static batch size {b}, got {input_ids.shape[0]}")
    am = attention_mask.long()
    acts_l = capture_linear_inputs(learner.gm, (input_ids, am, positions_from_mask(am)))
    acts_r = capture_linear_inputs(rollout.gm, step_prefill_args(input_ids, am, batch_size=b, max_len=int(rollout.captured.max_len)))
    return layerwise_mismatch(acts_l, acts_r, am.reshape(-1).bool(), strict=False)


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
    Returns:
        ``accuracy`` (exact answer), ``len_mean`` (tokens), ``finished_frac``, ``n``.
    Raises:
        ValueError: ``metas`` and ``prompts`` differ in length, or are empty.
    """
    if len(metas) != len(prompts) or not prompts:
        raise ValueError(f"evaluate needs as many metas as prompts (>0), got {len(metas)} and {len(prompts)}")
    temp, top_p = (1.0, GREEDY_TOP_P) if temperature == 0 else (float(temperature), 1.0)
    chunks = []
    b = rollout.batch_size
    for i in range(0, len(prompts), b):
        chunks.append(rollout.generate(list(prompts[i:i + b]), max_new_tokens=max_new_tokens, temperature=temp,
                                       top_p=top_p, seed=seed + i))
    exp = assemble(chunks, pad_token_id=rollout.pad_token_id, eos_token_ids=rollout.eos_token_ids, max_new_tokens=max_new_tokens)
    texts = decode_responses(tokenizer, exp)
    correct = [exact_answer_reward(m, t) >= 1.0 for m, t in zip(metas, texts)]
    return {
        "accuracy": sum(correct) / len(correct),
        "len_mean": float(exp.sampled_mask.sum(-1).float().mean()),
        "finished_frac": float(exp.finished.float().mean()),
        "n": float(len(correct)),
    }
