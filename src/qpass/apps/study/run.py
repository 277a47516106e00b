"""``qpass study``: reproduce the QUADS ablations at a fixed checkpoint on a fixed probe set.

Usage::

    qpass study --model default --out DIR [--device cpu|cuda] [--kernels reference|triton]
                [--prompts N] [--max-new-tokens T] [--quick] [--ratios 0,12.5,25,50,75,100]
                [--layers L] [--batch-size B] [--seed S] [--budget-s SEC] [--threads N] [--force]
    python -m qpass.apps.study ...   (same arguments)

What it measures (SPEC §2 claims, SPEC §4 metrics), on the model as loaded:

1. rollout operand ablation vs a BF16 learner: W4A16, W16A4, W4A4, plus the BF16 floor and a kernel
   floor (BF16 weights, the rollout op's fp32-accumulate arithmetic: the ``fp32_accumulate_linear``
   pass of the study recipe ``kernel_control``);
2. learner-side QDQ: weight QDQ on the W4A16 gap, activation QDQ on the W16A4 gap (and the
   symmetric W4A4-QAT learner against the W4A4 rollout);
3. RAC ratio k x mode {masked, gathered} x selection {batch, token} on the QUADS configuration
   (weight-QDQ learner, W4A4 rollout + RAC on gate/up): mean and max |d|, FLOPs, CUDA time;
4. layer-wise input mismatch per site, asymmetric W4A16 QAT vs symmetric W4A4 QAT, in decode mode
   (the rows the rollout computes when it samples; the former prefill reading is dropped: there the
   symmetric learner's per-tensor scales are those of the rollout's own call over the same rows, so
   the two were bit-identical at most sites and the comparison said nothing about C4).

``--learner-engine hf-eager|hf-sdpa`` scores every learner configuration with the Hugging Face
model's own forward (:class:`qpass.runtime.hf_engine.HFLearnerEngine`, the learner's QDQ applied
with qpass's ops) instead of qpass's scoring graph, so learner and rollout are different engines and
the BF16 floor carries a real engine drift (``qpass`` keeps both in qpass's graphs: a floor of
about 0 on the GPU).

Every configuration is one side of a YAML recipe (shipped or ``qpass/apps/study/recipes``), with the
layer restriction and the RAC sweep applied as overrides and validated like a recipe file, built
through the pass manager with the graph verifier on: see :mod:`qpass.apps.study.configs`.

Gaps are measured **paired**: one fixed set of sequences is sampled from the BF16 rollout and every
configuration's ``log q`` comes from replaying exactly those tokens through its rollout step graph
(:meth:`qpass.runtime.TorchRollout.replay`), ``log p`` from its learner
(:mod:`qpass.apps.study.replay`). The operand ablation is also measured **on-policy** with
:func:`qpass.parity.behavior.logprob_gap` (each rollout samples its own tokens, same seeds).

Outputs (written atomically: a sibling temp dir renamed to ``DIR`` at the end): ``study.json``
(every number, the configuration, model, device, kernel backend, versions, timings, ``provenance``),
``provenance.json`` (:mod:`qpass.provenance`), ``kernel_tiles.json``, ``gaps.safetensors`` (every
learner's ``log p`` and every rollout's ``log q`` on the fixed tokens plus the valid mask: each pair's
per-response gaps, so every CI can be recomputed, :func:`qpass.apps.study.recompute.recompute`),
``study.md`` (tables and a verdict per SPEC §2 claim), ``gap_vs_k.png``, ``layerwise.png``,
``operand_ablation.png``.

Full defaults: the whole 24-prompt probe set in one static batch, 32 new tokens, all layers,
k in {0, 12.5, 25, 50, 75, 100}%. ``--quick`` (tests): 2 prompts, 3 new tokens, k in {0, 50, 100}%,
only decoder layer 0 quantized, static batch 2, the zero-channel RAC check in two of the four
mode x selection combos; its claims table says ``quick run: not evidence`` in place of each verdict
(JSON: ``quick: true``, the rule's outcome as ``toy_outcome``). ``--threads 1`` is advisable on a
CPU shared with other jobs.
"""

from __future__ import annotations

import argparse

from qpass.apps.cliutil import Parser
import dataclasses
import logging
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from qpass.apps.study import layerwise as lw
from qpass.apps.study.configs import LEARNERS, RAC_RECIPE, ROLLOUTS, RACOverride, rac_targets, study_recipe
from qpass.atomic import check_output_path
from qpass.errors import QpassError
from qpass.graph.qgraph import QGraph
from qpass.graph.sites import select_sites
from qpass.compiler.recipe import Recipe
from qpass.apps.study.cost import config_key, rac_cost_table, time_rac_linear
from qpass.apps.study.replay import (
    SampledSet,
    gap_summary,
    graph_device,
    learner_logp,
    pair_metrics,
    paired_bootstrap,
    replay_logq,
    sample_fixed_set,
)

log = logging.getLogger(__name__)

FULL_RATIOS = (0.0, 0.125, 0.25, 0.5, 0.75, 1.0)
QUICK_RATIOS = (0.0, 0.5, 1.0)
MODES = ("masked", "gathered")
SELECTIONS = ("batch", "token")
QUADS_REF = (0.5, "masked", "batch")  # the paper's configuration (k = 50%, per-batch selection)
DEFAULT_MAX_BATCH = 24  # the whole built-in probe set in one static batch


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """Resolved study options (see the module docstring for the CLI).

    Attributes:
        model: ``default``, an HF directory or a ``.gguf`` path.
        out: output directory.
        device: ``cpu`` or ``cuda``.
        kernels: rollout kernel backend (``reference`` | ``triton``).
        prompts: probe prompts (one response each).
        max_new_tokens: response length cap.
        quick: the tiny test configuration.
        ratios: RAC channel ratios (fractions in [0, 1]); 0 is plain W4A4.
        layers: quantize only decoder layers ``[0, layers)`` (None: all).
        batch_size: static rollout batch (None: ``min(prompts, 24)``).
        seed, temperature, top_p: sampling.
        budget_s: wall-clock budget (None: unlimited); RAC configurations and timing not started
            before it runs out are recorded as skipped.
        bootstrap: paired-bootstrap resamples.
        threads: ``torch.set_num_threads`` for the run (None: leave as is). On a CPU shared with
            other jobs, 1 thread avoids OpenMP oversubscription (10x faster on the dev box).
        force: replace an existing ``out``.
        progress: show a tqdm bar.
        rollout_engine: who samples in the on-policy operand ablation: ``qpass`` (the rollout
            graphs) or ``vllm`` (a live vLLM engine per configuration serving its exported
            checkpoint: the BF16 floor then carries vLLM's engine drift; W16A4 is served as an
            activation-only checkpoint, ``qpass_weight: "none"``). The paired replay always uses the graphs.
        learner_engine: who scores ``log p``: ``qpass`` (the learner graphs) or ``hf-eager`` /
            ``hf-sdpa`` (:class:`qpass.runtime.hf_engine.HFLearnerEngine`: another engine than the
            rollout's, for a floor with real engine drift).
        kernel_tiles: Triton launch tiles, ``pinned`` (per shape, no timing) or ``autotune``.
    """

    model: str = "default"
    out: str = "study"
    device: str = "cpu"
    kernels: str = "reference"
    prompts: int = 24
    max_new_tokens: int = 32
    quick: bool = False
    ratios: tuple[float, ...] = FULL_RATIOS
    layers: int | None = None
    batch_size: int | None = None
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    budget_s: float | None = None
    bootstrap: int = 2000
    threads: int | None = None
    force: bool = False
    progress: bool = True
    rollout_engine: str = "qpass"
    learner_engine: str = "qpass"
    kernel_tiles: str = "pinned"


#: ``--learner-engine`` choices: qpass's scoring graph, or the HF forward with that attention.
LEARNER_ENGINES = ("qpass", "hf-eager", "hf-sdpa")


# ------------------------------------------------------------------------------------ building
def build_config(pipe: Any, side: str, recipe: Recipe) -> QGraph:
    """One study configuration: ``side`` of ``recipe`` built by :meth:`Pipeline.build_side` (pass
    manager, verifier on). The clone shares the BF16 parameters with the base graph (the study
    never trains); buffers (the static KV cache) are the clone's own."""
    return pipe.build_side(recipe, side, share_params=True, debug=True)


# ------------------------------------------------------------------------------------ helpers
def _clean(o: Any) -> Any:
    """JSON-safe copy: non-finite floats become None, tuples lists."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_clean(v) for v in o]
    return o


def _environment(cfg: StudyConfig) -> dict[str, Any]:
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "platform": platform.platform(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
           "device": cfg.device}
    if cfg.device == "cuda" and torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name(0)
    else:
        env["device_name"] = platform.processor() or platform.machine()
    from qpass.ops import effective_backend

    eff = effective_backend(cfg.kernels, cfg.device)
    if eff != cfg.kernels:
        eff += f" ({cfg.kernels} falls back to reference off CUDA)"
    env["effective_kernels"] = eff
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                           cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except Exception:  # noqa: BLE001 - informational only
        env["git_commit"] = None
    return env


class _Progress:
    """tqdm bar over named steps (a no-op bar when disabled)."""

    def __init__(self, total: int, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, disable=not enabled, desc="study", unit="step", file=sys.stderr)

    def step(self, name: str) -> None:
        self.bar.set_description(f"study: {name}")

    def done(self) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


# ------------------------------------------------------------------------------------ the study
def run_study(cfg: StudyConfig, pipe: Any | None = None) -> dict[str, Any]:
    """Run every measurement and return the JSON-able result (see :func:`write_outputs`).

    Args:
        cfg: options.
        pipe: an already prepared :class:`qpass.compiler.pipeline.Pipeline` (tests share one); None loads
            ``cfg.model`` and captures with a static batch of ``cfg.batch_size`` rows.
    Raises:
        QpassError: the probe prompts plus ``max_new_tokens`` do not fit the captured cache, or a
            bad option.
    """
    prev_threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, pipe)
    finally:
        torch.set_num_threads(prev_threads)


def _run(cfg: StudyConfig, pipe: Any | None) -> dict[str, Any]:
    from qpass.apps.runinfo import kernel_tiles_report, kernel_tiles_scope
    from qpass.apps.plugins import load_backends

    if cfg.learner_engine not in LEARNER_ENGINES:
        raise QpassError(f"learner_engine must be one of {LEARNER_ENGINES}, got {cfg.learner_engine!r}")
    load_backends([cfg.kernels])  # the one registration path
    with kernel_tiles_scope(cfg.kernel_tiles):
        res = _run_phases(cfg, pipe)
        res["kernel_tiles"] = kernel_tiles_report(cfg.kernel_tiles, cfg.kernels)
    return res


def _run_phases(cfg: StudyConfig, pipe: Any | None) -> dict[str, Any]:
    from qpass.ops import use_kernels

    st = _Study(cfg, pipe)
    with use_kernels(cfg.kernels), torch.no_grad():
        graphs, roll_acts = st.base_rollouts()
        layerwise, learners = st.learners(roll_acts)
        del roll_acts
        on_policy = st.on_policy(learners, graphs)
        del learners
        del graphs
        st.rac_sweep()
        cost, timing = st.cost()
    st.prog.close()
    return st.assemble(layerwise, on_policy, cost, timing)


class _Study:
    """State of one study run; one method per phase (called in order by :func:`_run`)."""

    def __init__(self, cfg: StudyConfig, pipe: Any | None) -> None:
        from qpass.compiler.pipeline import Pipeline
        from qpass.prompts import encode_chat, probe_prompts

        self.t0 = time.perf_counter()
        if any(not 0.0 <= r <= 1.0 for r in cfg.ratios):
            raise QpassError(f"RAC ratios must be in [0, 1], got {cfg.ratios}")
        self.cfg = cfg
        self.ratios = tuple(sorted(set(float(r) for r in cfg.ratios)))
        self.timings: dict[str, float] = {}
        if pipe is None:
            from qpass.graph.model import load_model

            lm = load_model(cfg.model, device=cfg.device)
            self.timings["load_s"] = time.perf_counter() - self.t0
            enc = encode_chat(lm.tokenizer, probe_prompts(cfg.prompts))
            b = cfg.batch_size or min(cfg.prompts, DEFAULT_MAX_BATCH)
            max_len = -(-(max(len(p) for p in enc) + cfg.max_new_tokens) // 8) * 8
            pipe = Pipeline.prepare(cfg.model, device=cfg.device, batch_size=b, max_len=max_len, loaded=lm)
            self.timings["capture_s"] = pipe.timings["capture_scoring_s"] + pipe.timings["capture_step_s"]
        self.pipe = pipe
        tok = pipe.tokenizer
        self.prompts = encode_chat(tok, probe_prompts(cfg.prompts))
        self.bs, self.max_len = int(pipe.base_step.captured.batch_size), int(pipe.base_step.captured.max_len)
        longest = max(len(p) for p in self.prompts)
        if longest + cfg.max_new_tokens > self.max_len:
            raise QpassError(f"longest prompt ({longest}) + max_new_tokens ({cfg.max_new_tokens}) exceeds the captured "
                             f"KV cache ({self.max_len})")
        self.pad, self.eos = int(tok.pad_token_id), tok.eos_token_id
        self.deadline = None if cfg.budget_s is None else self.t0 + cfg.budget_s
        self.skipped: list[str] = []
        self.rac_targets = rac_targets(cfg.layers)
        self.rac_sites = [s.id for s in select_sites(pipe.base_step.sites.values(), self.rac_targets)]
        if not self.rac_sites:
            raise QpassError(f"no RAC target site matches {self.rac_targets} in {pipe.loaded.name}")
        self.combos = [(m, s) for m in MODES for s in SELECTIONS]
        # k = 0 is the plain W4A4 rollout (the pass's 'rac' postcondition needs ratio > 0). The op's
        # zero-channel path is exercised by a ratio below 1/K (floor(ratio K) = 0 channels).
        self.zero_ratio = 1.0 / (2 * max(pipe.base_step.sites[s].in_features for s in self.rac_sites))
        # priority order (a time budget drops the tail): the paper's k = 50% first, then the ends of
        # the sweep, then the interior points; the zero-channel checks last
        order = sorted((r for r in self.ratios if r > 0), key=lambda r: (r != 0.5, r != 1.0, abs(r - 0.5)))
        self.rac_cfgs = [("rac_" + config_key(r, m, s), r, m, s) for r in order for m, s in self.combos]
        zero_combos = [("masked", "batch"), ("gathered", "token")] if cfg.quick else self.combos
        self.rac_cfgs += [(f"rac_zero_channels_{m}_{s}", self.zero_ratio, m, s) for m, s in zero_combos]
        self.prog = _Progress(1 + 5 + 1 + 4 + 4 + len(self.rac_cfgs) + 1, cfg.progress)
        self.logq: dict[str, torch.Tensor] = {}
        self.logp: dict[str, torch.Tensor] = {}
        self.rollout_info: dict[str, dict[str, Any]] = {}
        self.learner_info: dict[str, dict[str, Any]] = {}
        self.invariants: dict[str, Any] = {}

    def learner_engine(self, learner: QGraph) -> Any:
        """``learner`` as the configured learner engine (its graph, or the HF forward with its QDQ)."""
        if self.cfg.learner_engine == "qpass":
            return learner
        from qpass.runtime.hf_engine import HFLearnerEngine

        return HFLearnerEngine(self.pipe.loaded.model, attn=self.cfg.learner_engine.split("-", 1)[1], learner=learner)

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline

    def _replay(self, qg: QGraph, factory: Any = None) -> torch.Tensor:
        logq, mask = replay_logq(qg, self.sset, pad_token_id=self.pad, eos_token_id=self.eos, step_fn_for_chunk=factory)
        self.invariants["replay_masks_equal_sampled"] = self.invariants.get("replay_masks_equal_sampled", True) and bool(
            torch.equal(mask, self.sampled_mask))
        return logq

    # ---------------------------------------------------------------- phases
    def base_rollouts(self) -> tuple[dict[str, QGraph], dict[str, lw.Acts]]:
        """Sample the fixed set from the BF16 rollout; replay it through the base rollouts.

        The W4A4 replay of chunk 0 records its activations (decode-mode layer-wise rows); the W4A4
        step graph is also run once over the whole sequences (prefill-mode rows).
        """
        cfg, prog = self.cfg, self.prog
        prog.step("sample (BF16 rollout)")
        t = time.perf_counter()
        recipes = {name: study_recipe(ref, layers=cfg.layers) for name, ref in ROLLOUTS.items()}
        graphs: dict[str, QGraph] = {"bf16": build_config(self.pipe, "rollout", recipes["bf16"])}
        self.sset: SampledSet = sample_fixed_set(
            graphs["bf16"], self.prompts, pad_token_id=self.pad, eos_token_id=self.eos, max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed)
        self.valid = self.sset.valid_mask()
        self.sampled_mask = torch.cat([torch.nn.functional.pad(c.response_mask, (0, self.sset.width - c.response_mask.shape[1]))
                                       for c in self.sset.chunks])
        self.timings["sample_s"] = time.perf_counter() - t
        prog.done()
        decode_rec: lw.DecodeRecorder | None = None
        for name in ("bf16", "bf16_fp32acc", "w4a16", "w16a4", "w4a4", "w16a4_pt", "w4a4_pt"):
            prog.step(f"replay {name}")
            t = time.perf_counter()
            if name not in graphs:
                graphs[name] = build_config(self.pipe, "rollout", recipes[name])
            build_s = time.perf_counter() - t
            factory = None
            if name == "w4a4":
                decode_rec = lw.DecodeRecorder(graphs[name].gm)
                factory = lambda ci, ro, rec=decode_rec: rec if ci == 0 else None  # noqa: E731
            self.logq[name] = self._replay(graphs[name], factory)
            self.rollout_info[name] = {**_recipe_info(recipes[name], "rollout"), "build_s": build_s,
                                       "replay_s": time.perf_counter() - t - build_s}
            prog.done()
        self.invariants["bf16_replay_equals_sampled_logq"] = bool(torch.equal(self.logq["bf16"], self.sset.sampled_logq()))
        prog.step("layer-wise: W4A4 rollout prefill capture")
        t = time.perf_counter()
        c0 = self.sset.chunks[0]
        dev = graph_device(graphs["w4a4"])
        self.ids0, self.am0 = c0.input_ids.to(dev), c0.attention_mask.to(dev)
        roll_acts = {"prefill": lw.capture_prefill(graphs["w4a4"], self.ids0, self.am0), "decode": decode_rec.assemble()}
        self.lw_mask = lw.scored_positions_mask(c0.attention_mask, c0.response_mask, c0.prompt_len, c0.n_real)
        self.invariants.update(_k100_selection_check(roll_acts["prefill"], self.rac_sites))
        self.timings["layerwise_rollout_capture_s"] = time.perf_counter() - t
        prog.done()
        return graphs, roll_acts

    def learners(self, roll_acts: dict[str, lw.Acts]) -> tuple[dict[str, Any], dict[str, QGraph]]:
        """``log p`` of every learner on the fixed set; layer-wise mismatch of the asymmetric
        (``w_qdq``) and symmetric (``wa_qdq``) learners against the W4A4 rollout captures.

        Returns the layer-wise section and the BF16 and weight-QDQ learner graphs (for the
        on-policy phase).
        """
        raw: dict[str, dict[str, Any]] = {"decode": {}}
        kept: dict[str, QGraph] = {}
        for name in ("bf16", "w_qdq", "a_qdq", "wa_qdq", "a_qdq_pt", "wa_qdq_pt"):
            self.prog.step(f"learner {name}")
            t = time.perf_counter()
            recipe = study_recipe(LEARNERS[name], layers=self.cfg.layers)
            learner = build_config(self.pipe, "learner", recipe)
            build_s = time.perf_counter() - t
            self.logp[name] = learner_logp(self.learner_engine(learner), self.sset)
            info = {**_recipe_info(recipe, "learner"), "build_s": build_s, "score_s": time.perf_counter() - t - build_s}
            side = {"w_qdq": "asym", "wa_qdq": "sym"}.get(name)
            if side is not None:
                t2 = time.perf_counter()
                lacts = lw.capture_scoring(learner, self.ids0, self.am0)
                for mode in raw:  # decode only: the prefill reading is degenerate (module docstring)
                    raw[mode][side] = lw.compare(lacts, roll_acts[mode], self.lw_mask)
                del lacts
                info["layerwise_s"] = time.perf_counter() - t2
            self.learner_info[name] = info
            if name in ("bf16", "w_qdq"):
                kept[name] = learner
            del learner
            self.prog.done()
        summary: dict[str, dict[str, Any]] = {}
        per_site: dict[str, dict[str, Any]] = {}
        for mode, sides in raw.items():
            a, s = sides["asym"], sides["sym"]
            summary[mode] = {"asym": lw.summarize(a), "sym": lw.summarize(s), "asym_below_sym_fraction": {
                w: sum(a[k][w].rel < s[k][w].rel for k in a) / len(a) for w in ("pre", "eff")}}
            per_site[mode] = {"asym": lw.per_site_table(a), "sym": lw.per_site_table(s)}
        rows = int(self.lw_mask.sum())
        layerwise = {
            "rollout": "w4a4", "asym_learner": "w_qdq", "sym_learner": "wa_qdq", "chunk": 0, "rows": rows,
            "definition": ("Rows: chunk 0, the positions whose logits score a valid response token of a real row "
                           f"({rows} rows). rel = ||X_roll - X_learn||_F / ||X_learn||_F per site. `pre`: the "
                           "projection input before activation quantization (upstream drift); `eff`: the GEMM operand "
                           "(learner: act-QDQ output or X; rollout: DQ(Q_A(X)) over the rows of that op call). Rollout "
                           "mode `decode`: rows recorded while replaying the tokens one decode step at a time (what the "
                           "rollout computes when it samples). The prefill reading (the step graph run once over prompt "
                           "+ response) is not reported: the symmetric learner's per-tensor activation scales are then "
                           "the rollout's own over the same rows, bit-identical at most sites."),
            "summary": summary, "per_site": per_site,
        }
        return layerwise, kept

    def on_policy(self, learners: dict[str, QGraph], graphs: dict[str, QGraph]) -> dict[str, dict[str, float]]:
        """Operand ablation measured on-policy: each rollout samples its own tokens (same seeds),
        scored by the BF16 learner; the W4A16 and W4A4 samples are also scored by the weight-QDQ
        learner (keys ``w4a16@w_qdq``, ``w4a4@w_qdq``: the learner-side QDQ rows on-policy, with the
        engine's drift when the rollout engine is vLLM)."""
        from qpass.parity.behavior import logprob_gap, rescore

        learner_bf16 = self.learner_engine(learners["bf16"])

        cfg, out = self.cfg, {}
        for name in ("bf16", "w4a16", "w16a4", "w4a4"):
            self.prog.step(f"on-policy {name}")
            if self.out_of_time():
                self.skipped.append(f"on_policy_{name} (time budget)")
                self.prog.done()
                continue
            t = time.perf_counter()
            kw = dict(pad_token_id=self.pad, eos_token_id=self.eos, max_new_tokens=cfg.max_new_tokens, samples_per_prompt=1,
                      temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed)
            if cfg.rollout_engine == "vllm":  # w16a4: an activation-only qpass_nvfp4 checkpoint (qpass_weight "none")
                from qpass.apps.engines import vllm_rollout

                with vllm_rollout(self.pipe.loaded.model, self.pipe.tokenizer, next(self.pipe.loaded.model.parameters()).dtype,
                                  rollout=None if name == "bf16" else graphs[name], calibration_ids=self.prompts,
                                  batch_size=self.bs, max_len=self.max_len, seed=cfg.seed) as eng:
                    g = logprob_gap(learner_bf16, eng, self.prompts, **kw)
            else:
                g = logprob_gap(learner_bf16, graphs[name], self.prompts, **kw)
            out[name] = {**g.summary(), "tokens_per_s": g.tokens_per_s, "time_s": time.perf_counter() - t,
                         "rollout_engine": cfg.rollout_engine}
            if name in ("w4a16", "w4a4") and "w_qdq" in learners:
                t = time.perf_counter()
                g2 = rescore(self.learner_engine(learners["w_qdq"]), g, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                             top_p=cfg.top_p)
                out[f"{name}@w_qdq"] = {**g2.summary(), "time_s": time.perf_counter() - t,
                                        "rollout_engine": cfg.rollout_engine}
            self.prog.done()
        return out

    def rac_sweep(self) -> None:
        """Replay every RAC configuration: the rollout of :data:`RAC_RECIPE` with the ratio, mode
        and selection overridden (:func:`study_recipe`)."""
        for key, ratio, mode, sel in self.rac_cfgs:
            self.prog.step(key)
            if self.out_of_time():
                self.skipped.append(f"{key} (time budget)")
                self.prog.done()
                continue
            t = time.perf_counter()
            zero = key.startswith("rac_zero_channels_")  # the invariant configs: RAC with 0 channels == W4A4
            recipe = study_recipe(RAC_RECIPE, layers=self.cfg.layers,
                                  rac=RACOverride(ratio, mode, sel, allow_zero_channels=zero))
            g = build_config(self.pipe, "rollout", recipe)
            build_s = time.perf_counter() - t
            self.logq[key] = self._replay(g)
            self.rollout_info[key] = {**_recipe_info(recipe, "rollout"), "base": "w4a4",
                                      "rac": {"ratio": ratio, "mode": mode, "selection": sel},
                                      "build_s": build_s, "replay_s": time.perf_counter() - t - build_s}
            del g
            self.prog.done()

    def cost(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Analytic RAC FLOPs; CUDA op time of one gate/up-shaped linear when on CUDA."""
        self.prog.step("RAC cost")
        t = time.perf_counter()
        sites = self.pipe.base_step.sites
        cost = rac_cost_table(sites.values(), self.rac_sites, self.ratios, MODES, SELECTIONS)
        if self.out_of_time():
            timing = {"available": False, "reason": "skipped: time budget", "rows": {}}
            self.skipped.append("rac_timing (time budget)")
        else:
            s0 = sites[self.rac_sites[0]]
            shapes = [(self.bs, s0.out_features, s0.in_features), (self.bs * 64, s0.out_features, s0.in_features)]
            timing = time_rac_linear(shapes, self.ratios, MODES, SELECTIONS, kernels=self.cfg.kernels,
                                     device=self.cfg.device, deadline=self.deadline)
        self.timings["cost_s"] = time.perf_counter() - t
        self.prog.done()
        return cost, timing

    def assemble(self, layerwise: dict[str, Any], on_policy: dict[str, Any], cost: dict[str, Any],
                 timing: dict[str, Any]) -> dict[str, Any]:
        """Pairs, paired comparisons, exact relations, claims: the JSON-able result."""
        from qpass.apps.study.report import evaluate_claims

        cfg, logq, logp, valid, ratios, combos = self.cfg, self.logq, self.logp, self.valid, self.ratios, self.combos
        pairs = _pairs(ratios, combos)
        res_pairs: dict[str, Any] = {}
        for key, (lname, rname) in pairs.items():
            if rname not in logq:
                res_pairs[key] = {"learner": lname, "rollout": rname, "skipped": "time budget"}
                continue
            res_pairs[key] = {"learner": lname, "rollout": rname,
                              "replay": gap_summary(pair_metrics(logp[lname], logq[rname], valid))}
        for op, rname in (("floor", "bf16"), ("op_w4a16", "w4a16"), ("op_w16a4", "w16a4"), ("op_w4a4", "w4a4"),
                          ("qdq_w4a16_wqdq", "w4a16@w_qdq"), ("quads_k0", "w4a4@w_qdq")):
            if rname in on_policy:
                res_pairs[op]["on_policy"] = on_policy[rname]
        quads_key = _quads_ref_key(ratios)
        if quads_key and pairs[quads_key][1] in logq:
            res_pairs["quads_ref"] = {**res_pairs[quads_key], "alias_of": quads_key}
            pairs["quads_ref"] = pairs[quads_key]
        d = {k: logp[lname] - logq[rname] for k, (lname, rname) in pairs.items() if rname in logq}
        comparisons = {f"{a}_vs_{b}": paired_bootstrap(d[a], d[b], valid, n_boot=cfg.bootstrap, seed=cfg.seed)
                       for a, b in _comparison_list(ratios, combos) if a in d and b in d}
        inv = self.invariants
        zero = [k for k, *_ in self.rac_cfgs if k.startswith("rac_zero_channels_") and k in logq]
        if zero:
            inv["rac_zero_channels_logq_equals_w4a4"] = {k: bool(torch.equal(logq[k], logq["w4a4"])) for k in zero}
            inv["rac_zero_channels_ratio"] = self.zero_ratio
        k100 = [f"rac_{config_key(1.0, m, s)}" for m, s in combos]
        if all(k in logq for k in k100):
            inv["rac_k100_logq_equal_across_mode_selection"] = all(torch.equal(logq[k100[0]], logq[k]) for k in k100[1:])
        if "bf16" in on_policy:  # same graph, same seeds: the on-policy floor samples the fixed set itself
            inv["floor_on_policy_equals_replay"] = (
                on_policy["bf16"]["mean_abs"] == res_pairs["floor"]["replay"]["mean_abs"]
                and on_policy["bf16"]["max_abs"] == res_pairs["floor"]["replay"]["max_abs"])
        sweep = {}
        for mode, sel in combos:
            pts = []
            for r in ratios:
                key = "rac_k0" if r == 0 else f"rac_{config_key(r, mode, sel)}"
                p = res_pairs.get(key, {})
                pts.append({"k": r, "pair": key, **(p.get("replay") or {"mean_abs": None, "max_abs": None})})
            sweep[f"{mode}/{sel}"] = pts
        self.timings["total_s"] = time.perf_counter() - self.t0
        sset, pipe = self.sset, self.pipe
        res = {
            "schema": "qpass.study/1",
            "config": {**dataclasses.asdict(cfg), "ratios": list(ratios)},
            "model": {"name": pipe.loaded.name, "source": pipe.loaded.source, "sites": len(pipe.base_step.sites),
                      "batch_size": self.bs, "max_len": self.max_len},
            "environment": _environment(cfg),
            "sampled": {"responses": sset.n_responses, "tokens": sset.n_tokens, "width": sset.width,
                        "chunks": [{"seed": c.seed, "n_real": c.n_real, "prompt_len": c.prompt_len,
                                    "response_lengths": [len(r) for r in c.responses[:c.n_real]]} for c in sset.chunks]},
            "learners": self.learner_info, "rollouts": self.rollout_info, "pairs": res_pairs,
            "quads_ref_config": f"k={QUADS_REF[0]:.0%} {QUADS_REF[1]}/{QUADS_REF[2]}" if quads_key else None,
            "rac": {"targets": self.rac_targets, "sites": len(self.rac_sites), "sweep": sweep, "cost": cost,
                    "timing": timing},
            "layerwise": layerwise, "comparisons": comparisons, "invariants": inv,
            "skipped": self.skipped, "timings": self.timings,
        }
        res = _clean(res)
        res["claims"] = evaluate_claims(res)
        # the per-token log-probs behind every pair (written to gaps.safetensors, not into study.json)
        res["_tensors"] = {"valid": valid.to(torch.uint8).contiguous(),
                           "response_index": self.sset.response_ids().contiguous(),
                           **{f"logp.{k}": v.float().contiguous() for k, v in logp.items()},
                           **{f"logq.{k}": v.float().contiguous() for k, v in logq.items()}}
        return res


def _recipe_info(recipe: Recipe, side: str) -> dict[str, Any]:
    """What ``study.json`` records about a configuration's recipe."""
    return {"recipe": recipe.name, "recipe_path": recipe.path,
            "passes": [p.describe() for p in (recipe.learner if side == "learner" else recipe.rollout)]}


def _quads_ref_key(ratios: tuple[float, ...]) -> str | None:
    return f"rac_{config_key(*QUADS_REF)}" if QUADS_REF[0] in ratios else None


def _pairs(ratios: tuple[float, ...], combos: list[tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """Pair name -> (learner, rollout)."""
    p = {
        "floor": ("bf16", "bf16"), "floor_kernel": ("bf16", "bf16_fp32acc"), "op_w4a16": ("bf16", "w4a16"),
        "op_w16a4": ("bf16", "w16a4"),
        "op_w4a4": ("bf16", "w4a4"), "qdq_w4a16_wqdq": ("w_qdq", "w4a16"), "qdq_w16a4_aqdq": ("a_qdq", "w16a4"),
        "quads_k0": ("w_qdq", "w4a4"), "sym_w4a4_waqdq": ("wa_qdq", "w4a4"),
        # per-token activation-scale controls of C2b / C4 (study configurations *_pt)
        "op_w16a4_pt": ("bf16", "w16a4_pt"), "qdq_w16a4_aqdq_pt": ("a_qdq_pt", "w16a4_pt"),
        "quads_k0_pt": ("w_qdq", "w4a4_pt"), "sym_w4a4_waqdq_pt": ("wa_qdq_pt", "w4a4_pt"),
    }
    if 0.0 in ratios:
        p["rac_k0"] = ("w_qdq", "w4a4")
    for r in ratios:
        if r > 0:
            for m, s in combos:
                key = f"rac_{config_key(r, m, s)}"
                p[key] = ("w_qdq", key)
    return p


def _comparison_list(ratios: tuple[float, ...], combos: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Paired comparisons ``(a, b)`` reported as ``mean|d_a| - mean|d_b|``."""
    out = [("op_w16a4", "op_w4a16"), ("op_w4a16", "floor"), ("op_w4a16", "qdq_w4a16_wqdq"), ("qdq_w4a16_wqdq", "floor"),
           ("qdq_w4a16_wqdq", "floor_kernel"), ("floor_kernel", "floor"),
           ("op_w16a4", "qdq_w16a4_aqdq"), ("op_w4a4", "op_w16a4"), ("sym_w4a4_waqdq", "quads_k0"),
           ("op_w4a4", "quads_ref"), ("quads_ref", "floor"),
           ("op_w16a4_pt", "qdq_w16a4_aqdq_pt"), ("sym_w4a4_waqdq_pt", "quads_k0_pt")]
    for m, s in combos:  # consecutive k, then k = 0 against the paper's 50% and against 100%
        prev = "rac_k0" if 0.0 in ratios else None
        for r in ratios:
            if r == 0:
                continue
            key = f"rac_{config_key(r, m, s)}"
            if prev is not None:
                out.append((prev, key))
            prev = key
        if 0.0 in ratios:
            out += [("rac_k0", f"rac_{config_key(r, m, s)}") for r in (0.5, 1.0) if r in ratios]
    return list(dict.fromkeys(out))


def _k100_selection_check(acts: lw.Acts, rac_sites: list[str]) -> dict[str, bool]:
    """At k = 100% every mode/selection selects all K channels and yields the same compensation.

    Checked on the real prefill input of the first RAC site (rows of chunk 0).
    """
    from qpass.formats.spec import NVFP4_ACT
    from qpass.quant.rac import RACConfig, rac_reference

    x = acts[rac_sites[0]][0]
    x2 = x.reshape(-1, x.shape[-1])
    k = x2.shape[-1]
    ar = torch.arange(k, device=x2.device)
    out = {}
    comps = []
    for mode in MODES:
        for sel in SELECTIONS:
            r = rac_reference(x2, RACConfig(1.0, mode, sel), NVFP4_ACT)
            ch = r.channels
            all_ch = bool(torch.equal(ch, ar) if ch.dim() == 1 else torch.equal(ch, ar.expand_as(ch)))
            out[f"k100_{mode}_{sel}_selects_all_channels"] = all_ch
            comps.append(r.comp)
    out["k100_compensation_equal_across_mode_selection"] = all(torch.equal(comps[0], c) for c in comps[1:])
    return out


# ------------------------------------------------------------------------------------ outputs
GAPS_FILE = "gaps.safetensors"


def write_outputs(res: dict[str, Any], out: Path, *, force: bool = False, provenance: dict[str, Any] | None = None) -> Path:
    """Write ``study.json``, ``study.md``, the plots, ``gaps.safetensors``, ``provenance.json`` and
    ``kernel_tiles.json`` into ``out`` atomically.

    ``provenance``: the command's record (:func:`qpass.apps.runinfo.provenance`; default: collected
    here with the study's configuration, command ``study``).
    """
    import hashlib

    from safetensors.torch import save_file

    from qpass.apps.runinfo import provenance as make_provenance
    from qpass.apps.runinfo import write_provenance
    from qpass.atomic import atomic_dir
    from qpass.jsonio import dumps, write_json
    from qpass.apps.study.report import to_markdown, write_plots

    res = dict(res)
    tensors = res.pop("_tensors", None)
    cfg = res.get("config", {})
    prov = provenance or make_provenance(["study"], device=cfg.get("device", "cpu"), kernels=cfg.get("kernels", "reference"),
                                         kernel_tiles=cfg.get("kernel_tiles", "pinned"))
    with atomic_dir(Path(out), force=force, marker="study.json") as tmp:
        if tensors is not None:
            meta = {"pairs": dumps({k: [p["learner"], p["rollout"]] for k, p in res["pairs"].items()}, compact=True),
                    "schema": "qpass.study_gaps/1"}
            save_file(tensors, str(tmp / GAPS_FILE), metadata=meta)
            res["gaps_file"] = {"path": GAPS_FILE, "sha256": hashlib.sha256((tmp / GAPS_FILE).read_bytes()).hexdigest(),
                                "tensors": sorted(tensors)}
        plots = write_plots(res, tmp)
        res = {**res, "plots": plots, "provenance": prov}
        write_json(tmp / "study.json", res)
        write_provenance(tmp, prov)
        if "kernel_tiles" in res:
            write_json(tmp / "kernel_tiles.json", res["kernel_tiles"])
        (tmp / "study.md").write_text(to_markdown(res))
    return Path(out)


# ------------------------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    from qpass.apps.cliutil import DefaultsHelpFormatter, add_force, add_kernels, add_rollout_engine, add_threads, add_verbose, pos_float, pos_int, seed_int
    from qpass.apps.runinfo import add_kernel_tiles

    p = Parser(prog="qpass study", description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default="default", help="default | HF model dir | .gguf path (default: %(default)s)")
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the graphs run")
    add_kernels(p)
    p.add_argument("--prompts", type=pos_int, default=None, help="probe prompts (default: 24 = the whole probe set; --quick: 2)")
    p.add_argument("--max-new-tokens", type=pos_int, default=None, help="response length (default: 32; --quick: 3)")
    p.add_argument("--quick", action="store_true", help="tiny run for tests (layer 0 quantized, k in {0,50,100}%%)")
    p.add_argument("--ratios", default=None, help="RAC k list in percent, comma-separated (default: 0,12.5,25,50,75,100; --quick: 0,50,100)")
    p.add_argument("--layers", type=pos_int, default=None, help="quantize only decoder layers [0, L) (default: all; --quick: 1)")
    p.add_argument("--batch-size", type=pos_int, default=None, help="static rollout batch (default: min(prompts, 24))")
    p.add_argument("--seed", type=seed_int, default=0, help="sampling seed")
    p.add_argument("--temperature", type=pos_float, default=1.0, help="sampling temperature")
    p.add_argument("--top-p", type=pos_float, default=1.0, help="sampling top-p, in (0, 1]")
    p.add_argument("--budget-s", type=pos_float, default=None, help="wall-clock budget; later RAC configs are skipped (default: none)")
    p.add_argument("--bootstrap", type=pos_int, default=2000, help="paired-bootstrap resamples")
    add_threads(p)
    add_force(p, "study.json")
    add_verbose(p)
    add_rollout_engine(p)
    p.add_argument("--learner-engine", default="qpass", choices=LEARNER_ENGINES,
                   help="who scores log p: qpass's learner graph or the Hugging Face forward with eager / SDPA "
                        "attention (a different engine from the rollout: a floor with real engine drift)")
    add_kernel_tiles(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def config_from_args(a: argparse.Namespace) -> StudyConfig:
    """Resolve CLI arguments (quick/full defaults) into a :class:`StudyConfig`.

    Raises:
        QpassError: bad numbers (non-positive counts, ratios outside [0, 100]).
    """
    quick = bool(a.quick)
    prompts = a.prompts if a.prompts is not None else (2 if quick else 24)
    tokens = a.max_new_tokens if a.max_new_tokens is not None else (3 if quick else 32)
    if prompts < 1 or tokens < 1:
        raise QpassError(f"--prompts and --max-new-tokens must be >= 1, got {prompts}, {tokens}")
    if not 0.0 < a.top_p <= 1.0:
        raise QpassError(f"--top-p {a.top_p}: must be in (0, 1]")
    if a.ratios is not None:
        try:
            ratios = tuple(float(x) / 100.0 for x in a.ratios.split(",") if x.strip())
        except ValueError:
            raise QpassError(f"--ratios must be comma-separated percentages, got {a.ratios!r}") from None
    else:
        ratios = QUICK_RATIOS if quick else FULL_RATIOS
    if not ratios or any(not 0.0 <= r <= 1.0 for r in ratios):
        raise QpassError(f"--ratios must be percentages in [0, 100], got {a.ratios!r}")
    layers = a.layers if a.layers is not None else (1 if quick else None)
    if layers is not None and layers < 1:
        raise QpassError(f"--layers must be >= 1, got {layers}")
    batch = a.batch_size if a.batch_size is not None else (min(prompts, 2) if quick else None)
    return StudyConfig(model=a.model, out=a.out, device=a.device, kernels=a.kernels, prompts=prompts,
                       max_new_tokens=tokens, quick=quick, ratios=ratios, layers=layers, batch_size=batch, seed=a.seed,
                       temperature=a.temperature, top_p=a.top_p, budget_s=a.budget_s, bootstrap=a.bootstrap,
                       threads=a.threads, force=a.force, progress=not a.no_progress,
                       rollout_engine=a.rollout_engine, learner_engine=a.learner_engine, kernel_tiles=a.kernel_tiles)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit code (0 ok, 2 usage/QpassError)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    try:
        cfg = config_from_args(args)
        from qpass.apps.validate import check_study_args

        check_study_args(cfg)  # the model reference and counts against the probe set, before the load
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise QpassError("--device cuda but torch.cuda.is_available() is False")
        check_output_path(Path(cfg.out), force=cfg.force, marker="study.json")  # before the long run
        from qpass.apps.runinfo import provenance

        prov = provenance(["study", *argv], device=cfg.device, kernels=cfg.kernels, kernel_tiles=cfg.kernel_tiles,
                          extra={"learner_engine": cfg.learner_engine, "rollout_engine": cfg.rollout_engine})
        res = run_study(cfg)
        write_outputs(res, Path(cfg.out), force=cfg.force, provenance=prov)
    except QpassError as exc:
        print(f"qpass study: error: {exc}", file=sys.stderr)
        return 2
    print(f"qpass study: wrote {cfg.out}/study.json, study.md and plots ({res['timings']['total_s']:.0f} s)")
    if cfg.quick:
        from qpass.apps.study.report import QUICK_NOTE

        print(f"  {QUICK_NOTE}".replace("`", ""))
    for c in res["claims"]:
        print(f"  {c['id']}: {c['verdict']}" + (f" (toy outcome: {c['toy_outcome']})" if c.get("toy_outcome") else ""))
    return 0


if __name__ == "__main__":
    from qpass.apps.cli import main as qpass_main

    sys.exit(qpass_main(["study", *sys.argv[1:]]))
