"""Routing record / replay and the routing-mismatch diagnostic (MoE).

Every MoE router of a prepared model (:func:`qpass.moe.experts.prepare_moe`) passes its top-k expert
indices through the custom op ``qpass::moe_route(top_k_index [T, k] int64, layer) -> [T, k]``, which
survives ``torch.export`` (so it is a node of both the scoring and the step graph) and consults the
active :class:`RouteTape`:

* no tape: returns the indices unchanged;
* ``record``: appends a copy of the indices to ``tape.records[layer]`` (one tensor per call, call
  order: a rollout records its prefill ``[B*P, k]`` then one ``[B, k]`` per decode step);
* ``replay``: returns ``tape.replay[layer]`` (rows ``< 0`` keep the graph's own choice), so the
  learner reuses the rollout's routes (routing replay, "R3"; survey mismatch source of its own).

The router's weights are then recomputed for the indices actually used: ``softmax(logits)`` in
float32 gathered at the indices, renormalised over the k slots when the router normalises
(``norm_topk_prob``; Mixtral always does), cast to the router's score dtype. Without replay this is
bit-identical to the transformers routers (Qwen3-MoE, OLMoE, Mixtral; tested).

Routing mismatch (per layer): the fraction of valid tokens whose top-k *set* differs between two
recordings of the same sequences.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import types
from collections.abc import Iterator, Mapping, Sequence

import torch

from qpass.errors import QpassError


class RoutingError(QpassError):
    """A replayed route does not fit the call it is replayed into (names the layer and shapes)."""


@dataclasses.dataclass
class RouteTape:
    """Routes recorded or to be replayed, keyed by layer name (``layers.3``).

    Attributes:
        mode: ``record`` or ``replay``.
        records: (record) per layer, the int64 ``[T, k]`` indices of each router call, in order;
            (replay with ``keep_own``) the indices the router itself chose before the replay
            replaced them (so one forward gives both the replayed score and the routing mismatch).
        replay: (replay) per layer, int64 ``[T, k]`` indices to use (``-1``: keep the graph's own).
        keep_own: (replay) also record the router's own choices in ``records``.
    """

    mode: str = "record"
    records: dict[str, list[torch.Tensor]] = dataclasses.field(default_factory=dict)
    replay: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    keep_own: bool = False


_TAPE: contextvars.ContextVar[RouteTape | None] = contextvars.ContextVar("qpass_route_tape", default=None)


@contextlib.contextmanager
def record_routes() -> Iterator[RouteTape]:
    """``with record_routes() as tape:`` every router call inside appends to ``tape.records``."""
    tape = RouteTape("record")
    token = _TAPE.set(tape)
    try:
        yield tape
    finally:
        _TAPE.reset(token)


@contextlib.contextmanager
def replay_routes(routes: Mapping[str, torch.Tensor], *, keep_own: bool = False) -> Iterator[RouteTape]:
    """``with replay_routes({layer: idx [T, k]}):`` routers use the given indices (``-1``: own);
    ``keep_own``: the routers' own choices are recorded in ``tape.records`` as well."""
    tape = RouteTape("replay", replay=dict(routes), keep_own=keep_own)
    token = _TAPE.set(tape)
    try:
        yield tape
    finally:
        _TAPE.reset(token)


@torch.library.custom_op("qpass::moe_route", mutates_args=())
def moe_route(top_k_index: torch.Tensor, layer: str) -> torch.Tensor:
    """Record or replay the top-k expert indices ``[T, k]`` int64 of MoE layer ``layer``.

    Raises:
        RoutingError: (replay) the replayed tensor for ``layer`` is missing or not ``[T, k]``.
    """
    tape = _TAPE.get()
    if tape is None:
        return top_k_index.clone()
    if tape.mode == "record":
        tape.records.setdefault(layer, []).append(top_k_index.detach().clone())
        return top_k_index.clone()
    if tape.keep_own:
        tape.records.setdefault(layer, []).append(top_k_index.detach().clone())
    rep = tape.replay.get(layer)
    if rep is None:
        raise RoutingError(f"routing replay has no routes for MoE layer {layer} (have: {sorted(tape.replay)[:4]})")
    if tuple(rep.shape) != tuple(top_k_index.shape):
        raise RoutingError(f"routing replay for MoE layer {layer}: recorded routes {tuple(rep.shape)}, "
                           f"the call routes {tuple(top_k_index.shape)} (not the same token batch)")
    rep = rep.to(top_k_index.device)
    return torch.where(rep >= 0, rep, top_k_index)


@moe_route.register_fake
def _moe_route_fake(top_k_index, layer):  # noqa: ANN001
    return torch.empty_like(top_k_index)


def _routed_forward(self, hidden_states: torch.Tensor):  # noqa: ANN001, ANN202
    logits, scores, idx = self._qpass_router_forward(hidden_states)
    idx = torch.ops.qpass.moe_route(idx, self._qpass_layer)
    w = torch.nn.functional.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, idx)
    if getattr(self, "norm_topk_prob", True):
        w = w / w.sum(dim=-1, keepdim=True)
    return logits, w.to(scores.dtype), idx


def patch_router(router: torch.nn.Module, layer: str) -> None:
    """Route ``router``'s top-k indices through ``qpass::moe_route`` (instance-level, idempotent).

    ``router.forward(hidden [T, H]) -> (logits [T, E], scores [T, k], indices [T, k])`` (the
    transformers 5.x TopKRouter contract).
    """
    if getattr(router, "_qpass_layer", None) is not None:
        return
    router._qpass_router_forward = router.forward
    router._qpass_layer = layer
    router.forward = types.MethodType(_routed_forward, router)


def generate_routes(records: Mapping[str, list[torch.Tensor]], *, batch_size: int, prompt_len: int,
                    seq_len: int) -> dict[str, torch.Tensor]:
    """Per-position routes ``[B * seq_len, k]`` (row ``b * seq_len + t``) from a rollout's recording.

    A rollout's ``generate`` makes one prefill call over ``[B, P]`` then one call per decode step
    over ``[B, 1]``; the position after the last decode input was never routed by the rollout and
    gets ``-1`` (the learner keeps its own route there).

    Raises:
        RoutingError: the recording does not have the prefill + decode shape.
    """
    out = {}
    for layer, calls in records.items():
        if not calls or calls[0].shape[0] != batch_size * prompt_len:
            raise RoutingError(f"MoE layer {layer}: first recorded call is not a [B*P] prefill ({batch_size}x{prompt_len})")
        k = calls[0].shape[1]
        full = torch.full((batch_size, seq_len, k), -1, dtype=torch.long)
        full[:, :prompt_len] = calls[0].reshape(batch_size, prompt_len, k).cpu()
        for j, c in enumerate(calls[1:]):
            if c.shape[0] != batch_size or prompt_len + j >= seq_len:
                raise RoutingError(f"MoE layer {layer}: decode call {j} routes {tuple(c.shape)}, expected [{batch_size}, {k}]")
            full[:, prompt_len + j] = c.cpu()
        out[layer] = full.reshape(batch_size * seq_len, k)
    return out


def routing_mismatch(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor],
                     valid: torch.Tensor | None = None) -> dict[str, dict[str, float]]:
    """Per layer, the fraction of tokens whose top-k expert set differs between ``a`` and ``b``.

    Args:
        a, b: per layer int64 ``[T, k]`` routes of the same T tokens (``-1`` rows count as invalid).
        valid: optional bool ``[T]``: tokens to count (e.g. attention-mask 1).
    Returns:
        ``{layer: {"mismatch": fraction, "tokens": n}}`` (fraction NaN when no token counts).
    Raises:
        RoutingError: the two recordings have different layers or shapes.
    """
    if set(a) != set(b):
        raise RoutingError(f"routing mismatch: layers differ ({sorted(set(a) ^ set(b))[:4]})")
    out = {}
    for layer in a:
        x, y = a[layer].cpu(), b[layer].cpu()
        if x.shape != y.shape:
            raise RoutingError(f"routing mismatch at {layer}: shapes {tuple(x.shape)} vs {tuple(y.shape)}")
        ok = (x >= 0).all(-1) & (y >= 0).all(-1)
        if valid is not None:
            ok &= valid.reshape(-1).bool().cpu()
        differ = (x.sort(-1).values != y.sort(-1).values).any(-1) & ok
        n = int(ok.sum())
        out[layer] = {"mismatch": float(differ.sum()) / n if n else float("nan"), "tokens": n}
    return out


def concat_records(records: Mapping[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One ``[sum T, k]`` tensor per layer from a recording (calls concatenated in order)."""
    return {layer: torch.cat([c.cpu() for c in calls]) for layer, calls in records.items()}


def has_routing(gm: torch.fx.GraphModule) -> bool:
    """Whether a captured graph routes through ``qpass::moe_route`` (an MoE model)."""
    return any(n.op == "call_function" and n.target == torch.ops.qpass.moe_route.default for n in gm.graph.nodes)


def assemble_routes(chunks: Sequence[Mapping[str, torch.Tensor]], batches: Sequence[object], *, prompt_len: int,
                    width: int) -> dict[str, torch.Tensor]:
    """Per-row routes ``[N, P + R, k]`` in the layout of :func:`qpass.rl.experience.assemble`.

    Args:
        chunks: per rollout chunk, :func:`generate_routes` of its recording (``[B * T_c, k]`` per layer).
        batches: the chunks' :class:`qpass.runtime.RolloutBatch` es (``input_ids [B, T_c]``,
            ``prompt_len``, ``n_real``), same order.
        prompt_len, width: the assembled ``P`` and ``R``.
    Returns:
        per layer int64 ``[N, P + R, k]``: real rows only, ``-1`` on the new left / right padding.
    Raises:
        RoutingError: chunks disagree on their layers.
    """
    import torch.nn.functional as F

    if not chunks:
        return {}
    layers = set(chunks[0])
    out: dict[str, torch.Tensor] = {}
    for layer in sorted(layers):
        parts = []
        for routes, b in zip(chunks, batches):
            if set(routes) != layers:
                raise RoutingError(f"routing: rollout chunks recorded different MoE layers ({sorted(set(routes) ^ layers)[:4]})")
            bsz, t = b.input_ids.shape
            r = routes[layer].reshape(bsz, t, -1)[: int(b.n_real)]
            left, right = prompt_len - int(b.prompt_len), width - (t - int(b.prompt_len))
            parts.append(F.pad(r, (0, 0, left, right), value=-1))
        out[layer] = torch.cat(parts)
    return out
