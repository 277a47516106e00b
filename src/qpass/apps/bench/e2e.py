"""End-to-end decode step of ``qpass bench``: a whole model's decode step replayed as a CUDA graph.

The kernel sections of :mod:`qpass.apps.bench.triton_bench` time one linear at a time; this module
times what a GRPO rollout actually runs per generated token: the pass-rewritten step graph of a
recipe (:meth:`qpass.compiler.pipeline.Pipeline.build_side`, rollout side, Triton kernels) inside the
rollout engine :class:`qpass.runtime.rollout.TorchRollout`, its decode step served by
:class:`qpass.runtime.cuda_graph.DecodeGraph` (first call: eager warm-up + capture; every later
call: copy the 4 inputs into the static tensors, replay). One decode step = one token for every row
of the static batch ``B`` against a static KV cache of ``max_len`` slots, logits ``[B, 1, V]`` out
(sampling is not part of it).

Models are built from a ``transformers`` ``LlamaConfig`` with seeded random bf16 weights (no
download, no GGUF: the GPU box has no model files); the labels say so. Speed does not depend on the
weight values, except through the data-dependent parts of the W4A4 path (activation scales, RAC
channel choice), which do the same amount of work for any values.

This module knows nothing about the benchmark's rows: :func:`qpass.apps.bench.triton_bench.bench_e2e`
turns its :class:`DecodeMeasurement` into rows. On CPU (``qpass bench --smoke``) the same code runs
at toy sizes with :class:`EagerReplay` standing in for the CUDA graph, no timing claims.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable

import torch

import qpass.backends.triton  # noqa: F401 - needs triton; registers its kernels (as when this module lived there)
from qpass.compiler.pipeline import Pipeline
from qpass.compiler.recipe import load_recipe
from qpass.graph.capture import capture_step
from qpass.graph.model import LoadedModel
from qpass.graph.qgraph import QGraph
from qpass.runtime.cuda_graph import DecodeGraph
from qpass.runtime.host_sync import forbid_host_sync
from qpass.runtime.prefill import step_prefill_args
from qpass.runtime.rollout import TorchRollout

__all__ = ["E2E_BATCHES", "E2E_MODELS", "E2E_RECIPES", "DecodeMeasurement", "E2EModel", "EagerReplay",
           "build_model", "decode_inputs", "measure_decode", "prepare_pipeline", "rollout_engine", "with_step_batch"]

#: recipes timed end to end, bf16 first (the other rows' ratios are against it).
E2E_RECIPES = ("bf16", "w4a16_qat", "naive_nvfp4", "quads_nvfp4")
#: static batch sizes ``B`` of the decode step (64 runs last, when the budget allows).
E2E_BATCHES = (1, 16, 64)


@dataclasses.dataclass(frozen=True)
class E2EModel:
    """A Llama architecture to build with random weights.

    Attributes:
        label: row label, says "random weights".
        config: ``transformers.LlamaConfig`` keyword arguments (sizes in elements).
    """

    label: str
    config: dict

    def toy(self) -> "E2EModel":
        """The same architecture flags (tied embeddings, rope theta, eps) at toy sizes, for ``--smoke``:
        2 layers, hidden 64, MLP 128, 4 heads / 2 KV heads of 16, vocab 256."""
        small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
                     bos_token_id=1, eos_token_id=2)
        return E2EModel(f"{self.label} [toy sizes, smoke]", {**self.config, **small})


SMOLLM2_135M = E2EModel("SmolLM2-135M architecture, random weights", dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    head_dim=64, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, max_position_embeddings=8192,
    bos_token_id=1, eos_token_id=2))
LLAMA8B_4L = E2EModel("Llama-8B shapes, 4 layers, random weights", dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, vocab_size=128256, tie_word_embeddings=False, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, max_position_embeddings=131072,
    bos_token_id=128000, eos_token_id=128001))
#: the two models of the section, in priority order.
E2E_MODELS = (SMOLLM2_135M, LLAMA8B_4L)


def build_model(spec: E2EModel, *, device: torch.device, seed: int = 0) -> LoadedModel:
    """``LlamaForCausalLM(LlamaConfig(**spec.config))`` with weights drawn from ``seed`` (transformers'
    own initialisation, on ``device``), cast to bf16, eval mode, no grad.

    Returns:
        :class:`LoadedModel` with ``tokenizer=None``, ``name=spec.label``, ``source="random weights (seed N)"``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        lm = LlamaForCausalLM(LlamaConfig(**spec.config))
    lm = lm.to(torch.bfloat16).eval()
    for p in lm.parameters():
        p.requires_grad_(False)
    return LoadedModel(model=lm, tokenizer=None, name=spec.label, source=f"random weights (seed {seed})")


def prepare_pipeline(loaded: LoadedModel, *, batch_size: int, max_len: int, device: torch.device) -> Pipeline:
    """:meth:`Pipeline.prepare` of ``loaded`` (scoring graph + step graph for ``batch_size`` rows)."""
    return Pipeline.prepare(loaded=loaded, device=str(device), batch_size=batch_size, max_len=max_len)


def with_step_batch(pipe: Pipeline, batch_size: int) -> Pipeline:
    """``pipe`` with its step graph re-captured for ``batch_size`` rows (same model, same KV length,
    same scoring graph: only the step graph depends on the static batch)."""
    if batch_size == pipe.base_step.captured.batch_size:
        return pipe
    cap = capture_step(pipe.loaded.model, batch_size=batch_size, max_len=int(pipe.base_step.captured.max_len),
                       opaque=pipe.base_scoring.captured.opaque)
    return dataclasses.replace(pipe, base_step=QGraph.from_capture(cap),
                               timings={**pipe.timings, "capture_step_s": cap.export_s})


class EagerReplay:
    """CPU stand-in for :class:`qpass.runtime.cuda_graph.TorchCudaGraphs` (``--smoke`` only).

    ``capture`` runs the step once under :func:`qpass.runtime.host_sync.forbid_host_sync` (it raises at
    anything a CUDA capture forbids) and keeps its output as the static output; ``replay`` re-runs the
    step eagerly on the static inputs into that output. So :class:`DecodeGraph`'s captured path
    (static input copies, static output) runs on CPU; the numbers are the eager step's.
    """

    def warmup(self, step: Callable[..., torch.Tensor], args: tuple, device: torch.device) -> torch.Tensor:  # noqa: ARG002
        return step(*args)

    def capture(self, step: Callable[..., torch.Tensor], args: tuple,
                device: torch.device) -> tuple[Callable[[], None], torch.Tensor]:  # noqa: ARG002
        with forbid_host_sync("decode step under (simulated) capture"):
            out = step(*args).clone()
        return (lambda: out.copy_(step(*args))), out

    def synchronize(self, device: torch.device) -> None:  # noqa: ARG002
        pass


def rollout_engine(pipe: Pipeline, recipe: str, *, kernels: str, smoke: bool) -> TorchRollout:
    """The GRPO loop's built-in rollout engine for ``recipe``: rollout side built with ``kernels``
    (parameters shared with the model, own KV cache), decode step under CUDA graphs
    (``cuda_graphs="auto"``, as the GRPO default: a failed capture leaves the step eager and says so
    in ``ro.decode.status``). With ``smoke`` (CPU) the decode step goes through :class:`DecodeGraph`'s
    captured path with :class:`EagerReplay`.

    Raises:
        RecipeError / PassError / KernelMissingError: see :meth:`Pipeline.build_side`.
    """
    qg = pipe.build_side(load_recipe(recipe), "rollout", share_params=True, debug=False, kernels=kernels)
    eos = pipe.loaded.model.config.eos_token_id
    ro = TorchRollout(qg, pad_token_id=0, eos_token_id=eos if eos is not None else 0,
                      cuda_graphs="off" if smoke else "auto")
    if smoke:
        ro.decode = DecodeGraph(ro.gm, mode="on", device=torch.device("cuda"), backend=EagerReplay())
    return ro


def decode_inputs(ro: TorchRollout, *, prompt_len: int, vocab_size: int, device: torch.device,
                  seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Prefill ``B`` random prompts of ``prompt_len`` tokens (ids in ``[3, vocab_size)``, drawn from
    ``seed``; eager, one step-graph call), then return the arguments of the next decode step:
    ``(input_ids [B, 1]`` = each row's greedy token, ``position_ids [B, 1]``, ``cache_position [1] =
    prompt_len``, ``attention_mask [B, L])``, int64, on ``device``. Calling the decode step with them
    again rewrites the same cache slot with the same values, so every call computes the same logits.

    Raises:
        ValueError: ``prompt_len + 1`` exceeds the KV cache.
    """
    if prompt_len + 1 > ro.max_len:
        raise ValueError(f"decode_inputs: prompt {prompt_len} + 1 token exceeds the KV cache ({ro.max_len})")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (ro.batch_size, prompt_len), generator=gen).to(device)
    ids, pos, cpos, mask = step_prefill_args(ids, torch.ones_like(ids), batch_size=ro.batch_size, max_len=ro.max_len)
    with torch.no_grad():
        tok = ro.gm(ids, pos, cpos, mask)[:, -1].argmax(-1, keepdim=True)
    mask[:, prompt_len] = 1
    return tok, pos[:, -1:] + 1, torch.tensor([prompt_len], device=device), mask


@dataclasses.dataclass
class DecodeMeasurement:
    """What :func:`measure_decode` saw.

    Attributes:
        step_us: per-step times, microseconds (CUDA events around each decode call; wall clock in
            ``--smoke``), warm-up excluded.
        status: the :class:`DecodeGraph` status after the run (``"captured"`` when replayed).
        replays: decode calls served by a replay.
        logits: float32 ``[B, V]`` logits of the last timed call (a copy).
        eager_logits: float32 ``[B, V]`` logits of the same step called eagerly on the step graph afterwards.
    """

    step_us: list[float]
    status: str
    replays: int
    logits: torch.Tensor
    eager_logits: torch.Tensor

    @property
    def median_us(self) -> float:
        return float(statistics.median(self.step_us))

    @property
    def equals_eager(self) -> bool:
        """Logits (and so greedy tokens) of the timed replay bit-identical to the eager call."""
        return torch.equal(self.logits, self.eager_logits)

    @property
    def greedy_tokens(self) -> list[int]:
        return self.logits.argmax(-1).tolist()


def measure_decode(ro: TorchRollout, args: tuple[torch.Tensor, ...], *, smoke: bool, warmup: int = 3,
                   window_s: float = 0.25, min_steps: int = 20, max_steps: int = 400) -> DecodeMeasurement:
    """Time ``ro.decode(*args)`` (the engine's decode call: input copies + graph replay).

    The first call captures (not timed), ``warmup`` more calls are not timed either; then
    ``n = clamp(window_s / t_warmup, min_steps, max_steps)`` calls are timed one by one with CUDA
    events (host enqueue time counts where the GPU waits for it, as in the engine). ``smoke``: 2
    timed calls, wall clock. Afterwards the same step runs eagerly on the step graph for
    :attr:`DecodeMeasurement.equals_eager`.
    """
    with torch.no_grad():
        ro.decode(*args)  # capture (CUDA) / simulated capture (smoke): never timed
        if smoke:
            times = []
            for _ in range(2):
                t = time.perf_counter()
                out = ro.decode(*args)
                times.append((time.perf_counter() - t) * 1e6)
        else:
            times, out = _cuda_step_times(lambda: ro.decode(*args), warmup, window_s, min_steps, max_steps)
        logits = out[:, -1].float().clone()
        eager = ro.gm(*args)[:, -1].float()
    return DecodeMeasurement(times, ro.decode.status, ro.decode.replays, logits.cpu(), eager.cpu())


def _cuda_step_times(call: Callable[[], torch.Tensor], warmup: int, window_s: float, min_steps: int,
                     max_steps: int) -> tuple[list[float], torch.Tensor]:
    """Per-call CUDA-event times (us) of ``call`` after ``warmup`` untimed calls; returns the last output."""
    t = time.perf_counter()
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    per = max(1e-6, (time.perf_counter() - t) / max(1, warmup))
    n = int(min(max_steps, max(min_steps, math.ceil(window_s / per))))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    out = None
    for a, b in ev:
        a.record()
        out = call()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e3 for a, b in ev], out
