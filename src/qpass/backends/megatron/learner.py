"""``MegatronLearner``: the learner policy as a Megatron-core ``GPTModel``, behind qpass's
:class:`qpass.runtime.engine.LearnerEngine` protocol (factory name ``"megatron"``).

What runs where (TP ranks as in :mod:`qpass.backends.megatron.dist`): every rank holds its shard
of the model and of the optimizer (FP32 masters, AdamW); rank 0 is the caller's process and
broadcasts each call (forward, backward, zero_grad, step, export) so all ranks run it together:

* ``learner(input_ids, attention_mask)`` / :meth:`MegatronLearner.token_logprobs`: the forward on
  every rank (with grad when grad mode is on); rank 0 returns the TP-gathered logits. A hook on
  them broadcasts ``dL/dlogits`` when rank 0's backward reaches them, and every rank runs the
  backward of its own graph (Megatron's backward collectives pair up).
* :meth:`MegatronLearner.make_optimizer` builds the trainer's optimizer on every rank, with the
  gradient norm reduced over TP (sharded parameters summed over ranks, replicated ones once).
* :meth:`MegatronLearner.export_weights` gathers the shards to rank 0 in HF names;
  :meth:`fake_quant_sites` / :meth:`fake_quant_values` give, per HF site, the NVFP4 bytes and the
  ``W_hat`` the fake-quantized forward uses (gathered over TP, split out of the fused modules).

Parameters of the model are in the HF model's dtype (BF16 for the default model); the NVFP4
weight fake-quant with STE is :mod:`qpass.backends.megatron.fake_quant` on the modules of
:func:`qpass.backends.megatron.plan.fake_quant_plan`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from qpass.backends.megatron.config import LlamaLayout, layout_from_hf
from qpass.backends.megatron.dist import TPRuntime, start_tp
from qpass.backends.megatron.plan import fake_quant_plan, split_to_sites
from qpass.quant.nvfp4 import NVFP4Tensor
from qpass.sampling import sampling_logprobs

__all__ = ["MegatronLearner", "RankState"]


@dataclasses.dataclass(frozen=True)
class _Setup:
    layout: LlamaLayout
    plan: dict[str, tuple[str, ...]]
    dtype: torch.dtype
    weights_file: str


class RankState:
    """The model shard, its optimizer and the command handlers of one TP rank (same code on every rank)."""

    def __init__(self, rt: TPRuntime, setup: _Setup) -> None:
        from qpass.backends.megatron.fake_quant import enable_nvfp4_weight_fake_quant
        from qpass.backends.megatron.model import build_gpt_model, load_hf_shard

        self.rt, self.layout, self.plan = rt, setup.layout, setup.plan
        hf = torch.load(setup.weights_file, map_location="cpu", weights_only=True)
        self.model = build_gpt_model(setup.layout, dtype=setup.dtype, device=rt.device)
        load_hf_shard(self.model, hf, setup.layout, rank=rt.rank)
        del hf
        mods = dict(self.model.named_modules())
        self.fq = {}
        for name in setup.plan:
            enable_nvfp4_weight_fake_quant(mods[name], site=name)
            self.fq[name] = mods[name]
        for p in self.model.parameters():
            p.requires_grad_(True)
        self.model.train()
        self._pending: torch.Tensor | None = None
        self.opt: Any = None

    # ------------------------------------------------------------------ handlers (every rank)
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, grad: bool) -> torch.Tensor:
        from qpass.backends.megatron.model import gpt_logits

        self._pending = None
        with torch.set_grad_enabled(grad):
            logits = gpt_logits(self.model, input_ids.to(self.rt.device), attention_mask.to(self.rt.device), self.layout)
        if grad and self.rt.rank != 0:
            self._pending = logits
        return logits

    def backward(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        import torch.distributed as dist

        g = torch.empty(shape, dtype=dtype, device=self.rt.device)
        dist.broadcast(g, src=0)
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.backward(g)

    def make_optimizer(self, factory: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        extra = {"grad_norm_fn": self.grad_norm} if self.rt.world > 1 else {}
        self.opt = factory(params, **kwargs, **extra)

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self, grad_clip: float | None) -> dict[str, float]:
        return self.opt.step(grad_clip)

    def grad_norm(self, params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> torch.Tensor:
        """Global L2 norm over TP: squares of sharded parameters summed over ranks, replicated ones once."""
        import torch.distributed as dist

        dev = self.rt.device
        sharded = torch.zeros((), dtype=torch.float32, device=dev)
        repl = torch.zeros((), dtype=torch.float32, device=dev)
        for p, g in zip(params, grads):
            sq = g.detach().float().pow(2).sum()
            if p.tensor_model_parallel:
                sharded += sq
            else:
                repl += sq
        dist.all_reduce(sharded)
        return (sharded + repl).sqrt()

    def _gather(self, t: torch.Tensor, dim: int | None) -> list[torch.Tensor]:
        import torch.distributed as dist

        if self.rt.world == 1 or dim is None:
            return [t.clone()] * self.rt.world  # a copy: never a view of a live parameter
        bufs = [torch.empty_like(t) for _ in range(self.rt.world)]
        dist.all_gather(bufs, t.contiguous())
        return bufs

    @torch.no_grad()
    def export(self, grads: bool = False) -> dict[str, torch.Tensor] | None:
        from qpass.backends.megatron.convert import mcore_to_hf

        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(self.rt.world)]
        for name, p in self.model.named_parameters():
            dim = int(p.partition_dim) if p.tensor_model_parallel else None
            t = p.detach() if not grads else (p.grad if p.grad is not None else torch.zeros_like(p))
            for r, part in enumerate(self._gather(t, dim)):
                shards[r][name] = part
        return mcore_to_hf(shards, self.layout) if self.rt.rank == 0 else None

    @torch.no_grad()
    def fake_quant_sites(self) -> dict[str, NVFP4Tensor] | None:
        from qpass.backends.megatron.convert import hf_site_groups
        from qpass.backends.megatron.fake_quant import export_nvfp4_weight

        kinds = hf_site_groups(self.layout)
        out: dict[str, NVFP4Tensor] = {}
        for name, layer in self.fq.items():
            q = export_nvfp4_weight(layer)  # codes and scale bytes gathered along the partition dim
            if self.rt.rank != 0:
                continue
            kind, sites = kinds[name]
            codes = split_to_sites(kind, q.codes, sites, self.layout)
            scales = split_to_sites(kind, q.scales.view(torch.uint8), sites, self.layout)
            for s in sites:
                shape = torch.Size([codes[s].shape[0], q.shape[-1]])
                out[s] = dataclasses.replace(q, codes=codes[s].contiguous(), scales=scales[s].contiguous().view(torch.float8_e4m3fn),
                                             shape=shape)
        return out if self.rt.rank == 0 else None

    @torch.no_grad()
    def fake_quant_values(self) -> dict[str, torch.Tensor] | None:
        from qpass.backends.megatron.convert import hf_site_groups
        from qpass.backends.megatron.fake_quant import fake_quant_weight

        kinds = hf_site_groups(self.layout)
        out: dict[str, torch.Tensor] = {}
        for name, layer in self.fq.items():
            w_hat = fake_quant_weight(layer, layer.weight.detach())
            parts = self._gather(w_hat, int(layer.weight.partition_dim))
            if self.rt.rank == 0:
                kind, sites = kinds[name]
                out.update(split_to_sites(kind, torch.cat(parts, dim=int(layer.weight.partition_dim)), sites, self.layout))
        return out if self.rt.rank == 0 else None


def _worker_loop(rt: TPRuntime, _payload: object) -> None:
    op, args = rt.recv()
    if op != "init":
        raise RuntimeError(f"Megatron worker rank {rt.rank}: expected 'init', got {op!r}")
    state = RankState(rt, *args)
    while True:
        op, args = rt.recv()
        if op == "stop":
            return
        getattr(state, op)(*args)


class _TPOptimizer:
    """Rank 0's handle on the optimizer every rank holds (the trainer calls zero_grad / step)."""

    def __init__(self, learner: "MegatronLearner") -> None:
        self.learner = learner

    def zero_grad(self) -> None:
        self.learner._call("zero_grad")  # noqa: SLF001

    def step(self, grad_clip: float | None) -> dict[str, float]:
        return self.learner._call("step", grad_clip)  # noqa: SLF001


class MegatronLearner:
    """The learner engine over a Megatron-core ``GPTModel`` (see module docstring).

    Args:
        hf_model: a ``transformers`` Llama causal LM (its config and weights; e.g.
            ``qpass.graph.model.load_model(...).model``).
        tp: tensor-parallel size; ``tp - 1`` worker processes are started.
        device: ``cpu`` (gloo) or ``cuda`` (NCCL).
        learner_sites: ``QGraph.quant`` of qpass's learner graph for this model and recipe: the
            sites its ``weight_qdq`` fake-quantizes (None or empty: a BF16 learner).
        timeout_s: collective timeout (seconds); a rank that stops answering fails the call then.
    Raises:
        MegatronConfigError: the config cannot be expressed in Megatron (before any process starts).
        QpassError: the recipe's learner side cannot be mapped (see ``fake_quant_plan``).
        MegatronRankError: a worker died while starting.
    """

    name = "megatron"

    def __init__(self, hf_model: torch.nn.Module, *, tp: int = 1, device: str | torch.device = "cpu",
                 learner_sites: Mapping[str, object] | None = None, timeout_s: float = 300.0) -> None:
        layout = layout_from_hf(hf_model.config, tp=tp)
        plan = fake_quant_plan(learner_sites or {}, layout)
        dtype = next(hf_model.parameters()).dtype
        self.layout, self.plan = layout, plan
        state = {k: v.detach().cpu() for k, v in hf_model.state_dict().items()}

        self._rt: TPRuntime | None = None
        rt = start_tp(tp, device=device, timeout_s=timeout_s, worker=_worker_loop, payload=None)
        self._rt = rt
        try:
            setup = _Setup(layout, plan, dtype, os.path.join(rt.workdir, "hf_weights.pt"))
            torch.save(state, setup.weights_file)  # every rank reads its shard from here
            del state
            rt.send(("init", (setup,)))
            with rt.guard("building the model"):
                self._state = RankState(rt, setup)
        except BaseException:
            rt.shutdown()
            raise

    # ------------------------------------------------------------------ plumbing
    @property
    def device(self) -> torch.device:
        return self._runtime.device

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def model(self) -> torch.nn.Module:
        """Rank 0's ``GPTModel`` shard."""
        return self._state.model

    @property
    def _runtime(self) -> TPRuntime:
        if self._rt is None or self._rt.closed:
            from qpass.errors import QpassError

            raise QpassError("the Megatron learner is closed")
        return self._rt

    def _call(self, op: str, *args: Any) -> Any:
        rt = self._runtime
        rt.send((op, args))
        with rt.guard(op):
            return getattr(self._state, op)(*args)

    def close(self) -> None:
        """Stop the workers and leave the process groups (idempotent)."""
        if self._rt is not None:
            self._rt.shutdown()

    def __enter__(self) -> "MegatronLearner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ LearnerEngine
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` (model dtype) of int64 ``input_ids`` ``[B, T]``, 0/1 mask ``[B, T]``
        (left padding), with autograd when grad mode is on (every rank runs the forward)."""
        from qpass.backends.megatron.model import check_left_padded

        check_left_padded(attention_mask)  # on rank 0, before any rank sees the batch
        grad = torch.is_grad_enabled()
        logits = self._call("forward", input_ids, attention_mask, grad)
        rt = self._runtime
        if grad and rt.world > 1 and logits.requires_grad:
            logits.register_hook(self._backward_hook)
        return logits

    def _backward_hook(self, g: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        rt = self._runtime
        rt.send(("backward", (tuple(g.shape), g.dtype)))
        with rt.guard("backward"):
            dist.broadcast(g.contiguous(), src=0)
        return g

    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float = 1.0,
                       top_p: float = 1.0) -> torch.Tensor:
        """``log p(x_t | x_<t)`` under the sampling distribution: float32 ``[B, T - 1]`` (entry t is
        token t + 1), with autograd."""
        logits = self(input_ids, attention_mask)[:, :-1]
        lp = sampling_logprobs(logits, temperature, top_p)
        return lp.gather(-1, input_ids[:, 1:].to(lp.device).unsqueeze(-1)).squeeze(-1)

    def parameters(self) -> Iterable[torch.nn.Parameter]:
        """Rank 0's trainable parameters (all of them at TP = 1). With TP > 1 an optimizer must come
        from :meth:`make_optimizer` (the other ranks step their shards too)."""
        return [p for p in self._state.model.parameters() if p.requires_grad]

    def make_optimizer(self, factory: Callable[..., Any], **kwargs: Any) -> Any:
        """``factory(params, **kwargs)`` on every rank (plus ``grad_norm_fn=`` the TP-reduced norm when
        TP > 1; ``factory`` must be picklable, e.g. ``qpass.apps.grpo.weights.MasterOptimizer``).

        Returns:
            the optimizer itself at TP = 1; otherwise a handle whose ``zero_grad()`` / ``step(clip)``
            run on every rank (``step`` returns rank 0's statistics).
        """
        self._call("make_optimizer", factory, kwargs)
        return self._state.opt if self.tp == 1 else _TPOptimizer(self)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Current weights by HF name, gathered over TP (model dtype; tied weights under both names)."""
        return self._call("export")

    def export_grads(self) -> dict[str, torch.Tensor]:
        """The parameters' current ``.grad`` by HF name, gathered over TP (zeros where none)."""
        return self._call("export", True)

    def fake_quant_sites(self) -> dict[str, NVFP4Tensor]:
        """Per HF site, the NVFP4 weight the fake-quantized forward uses (codes, scale bytes, global
        scale; gathered over TP, split out of ``linear_qkv`` / ``linear_fc1``)."""
        return self._call("fake_quant_sites")

    def fake_quant_values(self) -> dict[str, torch.Tensor]:
        """Per HF site, ``W_hat`` (model dtype) as the fake-quantized forward computes it, gathered over TP."""
        return self._call("fake_quant_values")
