"""Capture a causal LM with ``torch.export`` into the two graphs qpass rewrites.

* **scoring** graph (learner): ``(input_ids [B,T], attention_mask [B,T], position_ids [B,T]) ->
  logits [B,T,V]``, full sequence, no cache, dynamic B and T; supports backward.
* **step** graph (rollout): ``(input_ids [B,T], position_ids [B,T], cache_position [T],
  attention_mask [B,L]) -> logits [B,T,V]`` with a static KV cache of ``L`` slots held as buffers
  and updated in place. ``T`` is dynamic, so one graph runs the prefill (T = prompt length) and
  every decode step (T = 1). ``B`` and ``L`` are fixed at capture.

Both wrappers keep the model under the attribute ``model``, so module paths in the graph read
``model.<hf path>``; :func:`site_of` strips that prefix.

The rewritten graphs are plain ``torch.fx.GraphModule`` s (``ExportedProgram.module()``): what the
parity checker inspects is exactly what the backends run.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import re
import time
import warnings
from typing import Any, Literal

import torch

from qpass.errors import CaptureError

log = logging.getLogger(__name__)

WRAPPER_PREFIX = "model."
GraphKind = Literal["scoring", "step"]


class ScoringWrapper(torch.nn.Module):
    """Full-sequence scoring: logits for every position (no KV cache)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).logits


class StepWrapper(torch.nn.Module):
    """Prefill/decode step over a static KV cache registered as buffers (exportable)."""

    def __init__(self, model: torch.nn.Module, batch_size: int, max_len: int) -> None:
        super().__init__()
        from transformers import StaticCache

        self.model = model
        cfg = model.config
        self.cache = StaticCache(config=cfg, max_cache_len=max_len)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        param = next(model.parameters())
        self.cache.early_initialization(batch_size, cfg.num_key_value_heads, head_dim, param.dtype, param.device)
        # transformers >= 5.20 names the argument `cache`; older 5.x `past_key_values`.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        for i, layer in enumerate(self.cache.layers):
            self.register_buffer(f"kv_keys_{i}", layer.keys, persistent=False)
            self.register_buffer(f"kv_values_{i}", layer.values, persistent=False)
            self.register_buffer(f"kv_length_{i}", layer.cumulative_length, persistent=False)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache_position: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        for layer in self.cache.layers:
            layer.cumulative_length.copy_(cache_position[0])
        return self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache_position=cache_position,
            use_cache=True,
            **{self._cache_kw: self.cache},
        ).logits


_SLICE = re.compile(r"\.slice\([^)]*\)")


def site_of(module_path: str) -> str:
    """Strip the wrapper prefix: ``model.model.layers.0.mlp`` -> ``model.layers.0.mlp``.

    Also drops the ``slice(None, n, None)`` component ``torch.export`` writes into the module path
    when a model iterates ``self.layers[:n]`` (seen with the transformers 5.x MoE models:
    ``model.layers.slice(None, 2, None).0.mlp`` -> ``model.layers.0.mlp``).
    """
    module_path = _SLICE.sub("", module_path)
    return module_path[len(WRAPPER_PREFIX):] if module_path.startswith(WRAPPER_PREFIX) else module_path


def attr_of(site_path: str) -> str:
    """Inverse of :func:`site_of` for parameter paths."""
    return WRAPPER_PREFIX + site_path


@dataclasses.dataclass
class CapturedGraph:
    """A captured graph before any pass: the ``ExportedProgram`` and its unlifted module."""

    kind: GraphKind
    ep: torch.export.ExportedProgram
    gm: torch.fx.GraphModule
    export_s: float
    batch_size: int | None = None
    max_len: int | None = None
    opaque: list = dataclasses.field(default_factory=list)  # list[fallback.OpaqueModule]


def _export(
    module: torch.nn.Module, args: tuple, dynamic_shapes: Any, what: str, model: torch.nn.Module, opaque: list | None = None,
) -> tuple[torch.export.ExportedProgram, list]:
    """``torch.export`` with the per-module fallback of :mod:`qpass.graph.fallback`.

    On failure the innermost submodule of ``model`` on the error's traceback is made opaque (logged
    with the reason) and the export is retried, up to 8 modules.
    """
    from qpass.graph.fallback import OpaqueModule, find_culprit, opaque_modules

    opaque = list(opaque or [])
    deferred = False
    for _attempt in range(10):
        try:
            with warnings.catch_warnings(), opaque_modules(model, [o.name for o in opaque]):
                warnings.simplefilter("ignore")
                ep = torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False,
                                         prefer_deferred_runtime_asserts_over_guards=deferred)
                return ep, opaque
        except CaptureError:
            raise
        except Exception as exc:  # noqa: BLE001
            if not deferred and "Constraints violated" in str(exc):
                # Seen with torch 2.11 on CUDA: a shape guard that holds for every length in range,
                # e.g. min(64*seq, 192*seq) == 64*seq, that the range solver cannot prove. Keep it as
                # a runtime assert instead of rejecting the export.
                log.warning("torch.export could not prove a shape guard (%s); retrying with runtime asserts", str(exc).splitlines()[0][:120])
                deferred = True
                continue
            culprit = find_culprit(exc, model)
            if culprit is None or culprit in {o.name for o in opaque} or len(opaque) >= 8:
                raise CaptureError(f"torch.export could not capture the {what} graph: {type(exc).__name__}: {exc}") from exc
            reason = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
            log.warning("torch.export failed inside %s (%s); capturing it as one opaque node", culprit, reason)
            opaque.append(OpaqueModule(culprit, reason))
    raise AssertionError("unreachable")


def _unlift(ep: torch.export.ExportedProgram) -> torch.fx.GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ep.module()


def capture_scoring(model: torch.nn.Module, *, example_len: int = 16) -> CapturedGraph:
    """Export the scoring graph (dynamic batch and sequence length), with per-module fallback.

    Raises:
        CaptureError: ``torch.export`` failed; the message carries its reason.
    """
    device = next(model.parameters()).device
    b, t = 2, example_len
    ids = torch.randint(0, 100, (b, t), device=device)
    am = torch.ones(b, t, dtype=torch.long, device=device)
    pos = torch.arange(t, device=device).expand(b, t).contiguous()
    bd, td = torch.export.Dim("batch", min=1, max=4096), torch.export.Dim("seq", min=2, max=8192)
    dyn = ({0: bd, 1: td}, {0: bd, 1: td}, {0: bd, 1: td})
    t0 = time.perf_counter()
    ep, opaque = _export(ScoringWrapper(model), (ids, am, pos), dyn, "scoring", model)
    gm = _unlift(ep)
    return CapturedGraph("scoring", ep, gm, time.perf_counter() - t0, opaque=opaque)


def capture_step(model: torch.nn.Module, *, batch_size: int, max_len: int, opaque: list | None = None) -> CapturedGraph:
    """Export the prefill/decode step graph with a static KV cache of ``max_len`` slots.

    Raises:
        CaptureError: ``torch.export`` failed.
    """
    device = next(model.parameters()).device
    wrapper = StepWrapper(model, batch_size, max_len)
    t = min(8, max_len)
    ids = torch.randint(0, 100, (batch_size, t), device=device)
    pos = torch.arange(t, device=device).expand(batch_size, t).contiguous()
    cpos = torch.arange(t, device=device)
    am = torch.ones(batch_size, max_len, dtype=torch.long, device=device)
    td = torch.export.Dim("step_len", min=1, max=max_len)
    dyn = ({1: td}, {1: td}, {0: td}, None)
    t0 = time.perf_counter()
    with torch.no_grad():
        ep, opaque = _export(wrapper, (ids, pos, cpos, am), dyn, "decode-step", model, opaque)
    gm = _unlift(ep)
    return CapturedGraph("step", ep, gm, time.perf_counter() - t0, batch_size=batch_size, max_len=max_len, opaque=opaque)


def clone_graph_module(gm: torch.fx.GraphModule, *, share_params: bool) -> torch.fx.GraphModule:
    """Deep copy of a GraphModule; with ``share_params`` the parameters (not buffers) stay shared."""
    memo: dict[int, Any] = {}
    if share_params:
        for p in gm.parameters():
            memo[id(p)] = p
    return copy.deepcopy(gm, memo)
