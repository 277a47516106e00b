"""The engine seam: what a rollout engine and a learner engine must do, and a factory keyed by name.

qpass's apps (``apply``'s behavioural parity, ``check``, ``study``'s replay, the GRPO trainer) talk
to engines only through these two protocols. The built-in implementations run qpass's own
pass-rewritten graphs (:mod:`qpass.runtime.graph_engine`, name ``"qpass"``); a real serving engine
(vLLM, SGLang) or a real trainer (Megatron-core) plugs in by implementing the protocol and calling
:func:`register_rollout_engine` / :func:`register_learner_engine` (from its backend's
``register()``), after which ``make_rollout_engine("vllm", ...)`` constructs it.

Names: weights cross the seam in **Hugging Face parameter names** (``model.layers.0.mlp.up_proj.weight``),
never in graph attribute paths, so a learner and a rollout engine of different frameworks can be
paired. Sites are named by their module path (``model.layers.0.mlp.up_proj``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from qpass.errors import QpassError
from qpass.graph.qgraph import QGraph
from qpass.runtime.graph_engine import GraphLearnerEngine, GraphRolloutEngine
from qpass.runtime.served import ServedSite

__all__ = ["LearnerEngine", "RolloutEngine", "ServedSite", "learner_engines", "make_learner_engine",
           "make_rollout_engine", "register_learner_engine", "register_rollout_engine", "rollout_engines",
           "as_learner_engine", "as_rollout_engine"]


@runtime_checkable
class RolloutEngine(Protocol):
    """The behaviour policy ``q``: samples tokens and records the log-probs it sampled them with.

    Attributes:
        name: the factory name (``"qpass"``, ``"vllm"``, ...).
        batch_size: most rows one :meth:`generate` / :meth:`score` call takes.
        device: where the tensors it returns live (``score`` returns CPU tensors).
        pad_token_id: the id it pads prompts and finished rows with.
        eos_token_ids: ids that end a response.
    """

    name: str
    batch_size: int
    device: torch.device
    pad_token_id: int
    eos_token_ids: list[int]

    def generate(
        self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
        seed: int = 0,
    ) -> Any:
        """Sample up to ``max_new_tokens`` tokens per prompt.

        Args:
            prompts: token ids per row, ``1 <= len(prompts) <= batch_size``.
            temperature, top_p: the sampling distribution.
            seed: sampling seed (same seed, same weights, same prompts: same tokens).
        Returns:
            a :class:`qpass.runtime.RolloutBatch`: ``input_ids``/``attention_mask`` int64
            ``[B, P + R]`` (left-padded prompts then responses), ``response_mask`` bool ``[B, R]``,
            ``logq`` float32 ``[B, R]``: the **raw** log-probabilities of each sampled token under
            the sampling distribution actually used (after temperature/top-p, before any
            penalty), 0 where invalid; ``n_real`` real rows.
        Raises:
            QpassError: too many prompts, or prompt + new tokens longer than the engine allows.
        """
        ...

    def score(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, temperature: float = 1.0,
        top_p: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced ``log q`` of given response tokens, through the engine's sampling path.

        Returns:
            ``(logq, mask)``: float32 ``[n, R]`` (0 where invalid) and bool ``[n, R]``, on CPU,
            ``n = len(prompts)``, ``R = max(len(r) for r in responses)``.
        """
        ...

    def update_weights(self, weights: Mapping[str, torch.Tensor]) -> Any:
        """Load new weights from the learner's **master** weights (HF names, model dtype).

        The engine quantizes them itself with qpass's one quantizer (fresh amax; never from stale
        bytes) and serves the result from its next call.

        Returns:
            a sync report (:class:`qpass.runtime.SyncReport` for the built-in engine: parameters
            copied, sites re-quantized, fingerprint per group).
        Raises:
            QpassError: a weight the engine serves is missing from ``weights`` (named).
        """
        ...

    def served_weights(self) -> dict[str, ServedSite]:
        """The quantized bytes the engine serves right now, read back from its own storage, per site."""
        ...


@runtime_checkable
class LearnerEngine(Protocol):
    """The learner policy ``p``: scores tokens with grad, owns the master weights.

    Attributes:
        name: the factory name.
        device: where ``token_logprobs`` expects its inputs.
    """

    name: str
    device: torch.device

    def token_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float = 1.0, top_p: float = 1.0,
    ) -> torch.Tensor:
        """``log p(x_t | x_<t)`` under the sampling distribution, with autograd.

        Args:
            input_ids, attention_mask: int64 ``[B, T]`` (mask 0/1; left padding allowed).
        Returns:
            float32 ``[B, T - 1]``: entry ``t`` is the log-prob of token ``t + 1``.
        """
        ...

    def parameters(self) -> Iterable[torch.nn.Parameter]:
        """The trainable master parameters (what the trainer's optimizer steps)."""
        ...

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Current master weights by Hugging Face name (detached, model dtype; tied weights under
        every name they have)."""
        ...


RolloutFactory = Callable[..., RolloutEngine]
LearnerFactory = Callable[..., LearnerEngine]
_ROLLOUT: dict[str, RolloutFactory] = {"qpass": GraphRolloutEngine}
_LEARNER: dict[str, LearnerFactory] = {"qpass": GraphLearnerEngine}
_F = TypeVar("_F", RolloutFactory, LearnerFactory)


def _registrar(table: dict[str, _F], kind: str, name: str) -> Callable[[_F], _F]:
    """The decorator that enters a factory into ``table`` as ``name`` (``kind`` names the table in the error)."""

    def deco(factory: _F) -> _F:
        if table.get(name, factory) is not factory:
            raise QpassError(f"{kind} engine {name!r} is already registered ({table[name]!r})")
        table[name] = factory
        return factory

    return deco


def register_rollout_engine(name: str) -> Callable[[RolloutFactory], RolloutFactory]:
    """Decorator: make ``factory(**kwargs) -> RolloutEngine`` constructible as ``name``.

    Raises:
        QpassError: ``name`` is taken by another factory.
    """
    return _registrar(_ROLLOUT, "rollout", name)


def register_learner_engine(name: str) -> Callable[[LearnerFactory], LearnerFactory]:
    """Decorator: make ``factory(**kwargs) -> LearnerEngine`` constructible as ``name``.

    Raises:
        QpassError: ``name`` is taken by another factory.
    """
    return _registrar(_LEARNER, "learner", name)


def rollout_engines() -> list[str]:
    """Registered rollout engine names."""
    return sorted(_ROLLOUT)


def learner_engines() -> list[str]:
    """Registered learner engine names."""
    return sorted(_LEARNER)


def _registered(table: dict[str, _F], kind: str, name: str) -> _F:
    """``table[name]``; raises QpassError naming the registered ones if there is none."""
    if name not in table:
        raise QpassError(f"unknown {kind} engine {name!r}; registered: {sorted(table)} "
                         "(engines of optional backends register when the app loads them)")
    return table[name]


def make_rollout_engine(name: str, **kwargs: Any) -> RolloutEngine:
    """Construct the rollout engine registered as ``name`` (the built-in one is ``"qpass"``).

    Raises:
        QpassError: unknown name (the message lists the registered ones).
    """
    return _registered(_ROLLOUT, "rollout", name)(**kwargs)


def make_learner_engine(name: str, **kwargs: Any) -> LearnerEngine:
    """Construct the learner engine registered as ``name`` (the built-in one is ``"qpass"``).

    Raises:
        QpassError: unknown name (the message lists the registered ones).
    """
    return _registered(_LEARNER, "learner", name)(**kwargs)


def as_rollout_engine(obj: RolloutEngine | QGraph, *, pad_token_id: int, eos_token_id: int | Sequence[int]) -> RolloutEngine:
    """``obj`` itself if it is an engine; a rollout step graph becomes the built-in ``"qpass"`` engine."""
    if isinstance(obj, QGraph):
        return make_rollout_engine("qpass", qg=obj, pad_token_id=pad_token_id, eos_token_id=eos_token_id)
    return obj


def as_learner_engine(obj: LearnerEngine | QGraph) -> LearnerEngine:
    """``obj`` itself if it is an engine; a learner scoring graph becomes the built-in ``"qpass"`` engine."""
    if isinstance(obj, QGraph):
        return make_learner_engine("qpass", qg=obj)
    return obj
