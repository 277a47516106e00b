"""Command line: ``qpass grpo`` (train and log) and ``qpass grpo-plot`` (overlay runs).

    qpass grpo --recipe quads_nvfp4 --model default --steps 20 --out runs/quads
    qpass grpo --recipe bf16,naive_nvfp4,quads_nvfp4 --steps 20 --out runs/cmp   # one run dir per recipe
    qpass grpo-plot runs/cmp/bf16 runs/cmp/naive_nvfp4 runs/cmp/quads_nvfp4 --out cmp.png

Entry points: :func:`main` (``argv[0]`` is ``grpo`` or ``grpo-plot``), :func:`grpo_main` and
:func:`grpo_plot_main` (arguments after the subcommand). ``python -m qpass.apps.grpo.cli grpo ...`` works
too.

**Output directories are written atomically.** A run is built in a hidden temporary directory next
to its final path and renamed into place only when it finishes, so ``DIR`` either does not exist
or is complete. On Ctrl-C or an error the temporary directory is deleted, or, with
``--keep-partial``, renamed to ``DIR.partial`` (never ``DIR``). With several recipes the model is
loaded and captured once, each recipe gets ``DIR/<recipe>`` (atomic each) and ``DIR/overlay.png``;
a recipe that fails is reported and the others still run (exit status 1).

Run directory: ``config.json`` (arguments, resolved config, model, timings), ``provenance.json``
(command line, git commit + dirty flag, source digest, torch/triton/transformers versions, GPU name
and driver: :mod:`qpass.provenance`), ``kernel_tiles.json`` (the Triton tile mode, ``--kernel-tiles``,
and every tile used: :mod:`qpass.apps.runinfo`), ``recipe.yaml``, ``metrics.jsonl`` (one row per
step; keys in :mod:`qpass.apps.grpo.grpo`), ``eval.jsonl``, ``layerwise.jsonl``, ``summary.json``
and ``plots.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from qpass.apps.cliutil import Parser, DefaultsHelpFormatter, add_dtype, add_force, add_kernels, add_rollout_engine, add_threads, add_verbose, exit_status, seed_int
from qpass.apps.cliutil import nonneg_float as _nonneg_float
from qpass.apps.cliutil import nonneg_int as _nonneg_int
from qpass.apps.cliutil import pos_float as _pos_float
from qpass.apps.cliutil import pos_int as _pos_int
from qpass.apps.runinfo import add_kernel_tiles

log = logging.getLogger("qpass.apps.grpo.cli")

__all__ = ["build_compare_parser", "build_grpo_parser", "build_plot_parser", "grpo_compare_main", "grpo_main", "grpo_plot_main", "main"]


# --------------------------------------------------------------------------- presets


@dataclasses.dataclass(frozen=True)
class GrpoPreset:
    """A named set of ``qpass grpo`` defaults (``--preset NAME``); flags given on the command line override them.

    Attributes:
        name: the ``--preset`` value.
        description: one line for ``--help``.
        values: ``{argparse dest: value}`` (every key must be an option of :func:`build_grpo_parser`).
    """

    name: str
    description: str
    values: dict[str, Any]


#: ``qpass grpo --preset``: smoke = a real run (load, capture, both graphs, sampling, reward, update, weight sync,
#: the final bit-level parity check, plots) at sizes where the update still runs; measured in
#: docs/results/suite_time.md (claims table). The heavy default diagnostics (400-prompt eval, layer-wise probe, BF16 shadow) are off.
GRPO_PRESETS: dict[str, GrpoPreset] = {p.name: p for p in (
    GrpoPreset("smoke", "a real 2-step run on the default model (about 1.5 minutes on an idle 2-core AVX2 CPU, more when it is shared): the 'larger' task "
               "with its few-shot prompt (the calibrated task of the long runs) sampled at temperature 0.5, so the untrained "
               "model is right often enough that rewards differ and the update runs; 1 prompt x 4 responses of <= 6 tokens per "
               "step (sampling, reward, update, weight sync) and the bit-level parity check on the last step; no held-out eval, "
               "no BF16 shadow, no layer-wise probe",
               {"steps": 2, "task": "larger", "template": "larger_fewshot", "temperature": 0.5, "reward": "first",
                "prompts_per_step": 1, "group_size": 4, "max_new_tokens": 6, "n_train": 64, "n_eval": 8, "eval_every": 0,
                "diag_every": 0, "bitexact_every": 0, "no_initial_check": True, "no_shadow": True}),
)}


def _apply_preset(ap: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    """Read ``--preset`` from ``argv`` and make its values the parser's defaults (explicit flags still win).

    Returns the preset's name (None: no preset).
    """
    pre = Parser(prog=ap.prog, add_help=False)
    pre.add_argument("--preset", choices=sorted(GRPO_PRESETS), default=None)
    known, _ = pre.parse_known_args(list(argv))
    if known.preset is None:
        return None
    ap.set_defaults(**GRPO_PRESETS[known.preset].values)
    return known.preset


def _add_run_args(ap: argparse.ArgumentParser, D: Any) -> None:  # noqa: N803 - D: the GRPOConfig defaults
    """The ``qpass grpo`` argument group: run: recipe, model, output, device, engines and budgets."""
    from qpass.runtime.cuda_graph import CUDA_GRAPH_MODES

    g = ap.add_argument_group("run")
    g.add_argument("--recipe", required=True, help="recipe name or YAML path; a comma list runs each (one model load)")
    g.add_argument("--preset", default=None, choices=sorted(GRPO_PRESETS),
                   help="a named set of defaults (flags given override it; default: none): "
                        + "; ".join(f"{p.name}: {p.description} ({', '.join(f'--{k.replace(chr(95), chr(45))} {v}' for k, v in p.values.items())})"
                                    for p in GRPO_PRESETS.values()))
    g.add_argument("--model", default="default", help="'default' (SmolLM2-135M GGUF), a .gguf file or an HF model directory")
    g.add_argument("--steps", type=_pos_int, default=D.steps, help=f"GRPO steps per recipe (default {D.steps})")
    g.add_argument("--out", required=True, type=Path, help="run directory (several recipes: parent of one dir per recipe)")
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    add_dtype(g)
    add_kernels(g, help="rollout kernel backend")
    g.add_argument("--learner", default="qpass", choices=["qpass", "megatron"],
                   help="learner engine: qpass's learner graph (default) or a Megatron-core GPTModel (backend 'megatron')")
    g.add_argument("--tp", type=_pos_int, default=1, help="tensor-parallel size of the Megatron learner (ranks 1..N-1 are "
                   "worker processes; rank 0 also drives the rollout)")
    g.add_argument("--megatron-timeout-s", type=_pos_float, default=300.0,
                   help="collective timeout of the Megatron learner's ranks (a rank that stops answering fails the run)")
    g.add_argument("--seed", type=seed_int, default=D.seed)
    add_force(g, "summary.json", "--overwrite")
    g.add_argument("--keep-partial", action="store_true", help="on error/Ctrl-C keep what was written as DIR.partial")
    g.add_argument("--max-time-s", type=_pos_float, default=None, help="time budget per recipe (seconds; default: none)")
    g.add_argument("--total-time-s", type=_pos_float, default=None,
                   help="time budget for everything incl. model load; split evenly over the remaining recipes (default: none)")
    add_threads(g)
    add_rollout_engine(g)
    g.add_argument("--no-progress", action="store_true", help="no progress display (phases, steps, ETA)")
    g.add_argument("--no-plots", action="store_true", help="do not write plots")
    g.add_argument("--cuda-graphs", default=D.cuda_graphs, choices=list(CUDA_GRAPH_MODES),
                   help="decode step of the rollout (and BF16 shadow) engine under CUDA graphs (CPU: always eager; "
                        "an MoE rollout: always eager)")
    add_kernel_tiles(g)
    add_verbose(g)


def _add_moe_args(ap: argparse.ArgumentParser) -> None:
    """The ``qpass grpo`` argument group: MoE routing replay."""
    g = ap.add_argument_group("MoE (--model moe-default or another MoE model)")
    g.add_argument("--routing-replay", default="off", choices=["on", "off"],
                   help="the learner replays the rollout's recorded expert routes in every forward (R3); either way "
                        "every step logs the routing mismatch (routing/...)")


def _add_checkpoint_args(ap: argparse.ArgumentParser) -> None:
    """The ``qpass grpo`` argument group: long runs: checkpoint / resume."""
    g = ap.add_argument_group("long runs (checkpoint / resume)")
    g.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="save the run's state to DIR/<recipe>.ckpt at the end of this command (and every --checkpoint-every steps; "
                        "default: no checkpoint)")
    g.add_argument("--checkpoint-every", type=_nonneg_int, default=0, help="also save every N steps (0: only at the end)")
    g.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint-dir/<recipe>.ckpt where it exists (same flags; --steps is the run's total)")
    g.add_argument("--segment-steps", type=_pos_int, default=None,
                   help="run at most N steps in this command (chain commands with --resume; default: all remaining)")


def _add_sampling_args(ap: argparse.ArgumentParser, D: Any) -> None:  # noqa: N803 - D: the GRPOConfig defaults
    """The ``qpass grpo`` argument group: sampling (defaults from GRPOConfig)."""
    g = ap.add_argument_group("sampling")
    g.add_argument("--prompts-per-step", type=_pos_int, default=D.prompts_per_step)
    g.add_argument("--group-size", type=_pos_int, default=D.group_size, help="responses per prompt (G)")
    g.add_argument("--max-new-tokens", type=_pos_int, default=D.max_new_tokens)
    g.add_argument("--temperature", type=_pos_float, default=D.temperature)
    g.add_argument("--top-p", type=_pos_float, default=D.top_p)
    g.add_argument("--batch-size", type=_pos_int, default=None,
                   help="rollout graph static batch (default: prompts-per-step x group-size, at most 64)")
    g.add_argument("--max-len", type=_pos_int, default=None, help="KV cache length (default: longest prompt + max new tokens)")


def _add_optimization_args(ap: argparse.ArgumentParser, D: Any) -> None:  # noqa: N803 - D: the GRPOConfig defaults
    """The ``qpass grpo`` argument group: optimization (defaults from GRPOConfig)."""
    g = ap.add_argument_group("optimization")
    g.add_argument("--lr", type=_pos_float, default=D.lr)
    g.add_argument("--weight-decay", type=_nonneg_float, default=D.weight_decay)
    g.add_argument("--grad-clip", type=_nonneg_float, default=D.grad_clip or 0.0, help="max grad norm (0: no clipping)")
    g.add_argument("--master-dtype", default=D.master_dtype, choices=["fp32", "param"])
    g.add_argument("--ppo-epochs", type=_pos_int, default=D.ppo_epochs)
    g.add_argument("--minibatches", type=_pos_int, default=D.minibatches, help="optimizer steps per epoch")
    g.add_argument("--micro-batch-size", type=_pos_int, default=D.micro_batch_size, help="rows per learner forward (default: batch size)")


def _add_loss_args(ap: argparse.ArgumentParser, D: Any) -> None:  # noqa: N803 - D: the GRPOConfig defaults
    """The ``qpass grpo`` argument group: loss, SPEC §5 (defaults from LossConfig and its Correction)."""
    from qpass.rl.loss import CORRECTIONS, RATIO_MODES

    L, C = D.loss, D.loss.correction  # noqa: N806
    g = ap.add_argument_group("loss (SPEC §5)")
    g.add_argument("--ratio", default=L.ratio, choices=list(RATIO_MODES),
                   help="decoupled: r = p_theta/p_prox times a correction of p_prox/q; coupled: r = p_theta/q, no correction")
    g.add_argument("--correction", default=C.kind, choices=list(CORRECTIONS),
                   help="none: no importance weight; is: untruncated p_prox/q; tis: min(p_prox/q, cap); mis: masked outside [lo, hi]")
    g.add_argument("--tis-cap", type=_pos_float, default=C.cap)
    g.add_argument("--mis-lo", type=_nonneg_float, default=C.lo)
    g.add_argument("--mis-hi", type=_pos_float, default=C.hi)
    g.add_argument("--eps-low", type=_nonneg_float, default=L.eps_low)
    g.add_argument("--eps-high", type=_nonneg_float, default=L.eps_high)
    g.add_argument("--beta", type=_nonneg_float, default=L.beta, help="k3 KL to the initial learner weights")
    g.add_argument("--agg", default=L.agg, choices=["token_mean", "seq_mean"])
    g.add_argument("--mask-truncated", action="store_true", help="exclude responses without EOS from the loss")


def _add_task_args(ap: argparse.ArgumentParser) -> None:
    """The ``qpass grpo`` argument group: task and reward."""
    from qpass.rl.task import TASK_PRESETS, TEMPLATES

    g = ap.add_argument_group("task and reward")
    g.add_argument("--task", default="arithmetic", choices=["arithmetic", *TASK_PRESETS],
                   help="problem kind (qpass.rl.task.TASK_PRESETS): arithmetic expressions (--difficulty, --operators), "
                        "successor ('What number comes after 389?', 900 problems), larger ('Which is larger, 47 or 52?'), "
                        "chain / chain_long (4-5 / 6-7 operand + - expressions answered with worked steps; use "
                        "--reward answer and --max-new-tokens >= 64)")
    g.add_argument("--difficulty", type=int, default=2, choices=[1, 2, 3, 4],
                   help="arithmetic preset (1: a+b one digit, 100 problems in all; 2: a+-b up to 2 digits; default 2)")
    g.add_argument("--operators", default=None,
                   help="override the arithmetic preset's operators, comma list of + - * (e.g. '+': addition only; "
                        "default: the preset's)")
    g.add_argument("--template", default=None, choices=list(TEMPLATES),
                   help="prompt template (qpass.rl.task.TEMPLATES; default: the task's own, qpass.rl.task.KINDS): "
                        "default asks for reasoning + 'Answer:', terse for the integer only")
    g.add_argument("--n-train", type=_pos_int, default=2000)
    g.add_argument("--n-eval", type=_nonneg_int, default=500, help="held-out split size (eval uses --eval-prompts of it)")
    g.add_argument("--reward", default="exact", help="'exact' (the last integer of the response is the answer), 'first' "
                   "(the first integer is), 'answer' (the integer after the first 'Answer:'; for --task chain), 'format' "
                   "(exact + --format-weight for a well-formed wrong answer) or MODULE:ATTR naming a callable "
                   "(prompt_meta, response_text) -> float")
    g.add_argument("--format-weight", type=_nonneg_float, default=0.1)


def _add_diagnostics_args(ap: argparse.ArgumentParser, D: Any) -> None:  # noqa: N803 - D: the GRPOConfig defaults
    """The ``qpass grpo`` argument group: checks and diagnostics (defaults from GRPOConfig)."""
    g = ap.add_argument_group("checks and diagnostics")
    g.add_argument("--bitexact-every", type=_nonneg_int, default=D.bitexact_every, help="full bit-exact parity check every N steps (0: last only)")
    g.add_argument("--on-parity-failure", default=D.on_parity_failure, choices=["raise", "warn"])
    g.add_argument("--no-initial-check", action="store_true")
    g.add_argument("--no-shadow", action="store_true", help="skip the BF16 shadow (no clip-branch disagreement)")
    g.add_argument("--shadow-weights", default=D.shadow_weights, choices=["learner", "master"],
                   help="BF16 shadow weights: as the learner forward uses them (default) or the BF16 masters")
    g.add_argument("--diag-every", type=_nonneg_int, default=D.diag_every, help="layer-wise probe + decoded visibility every N steps")
    g.add_argument("--eval-every", type=_nonneg_int, default=D.eval_every, help="held-out eval every N steps (0: never)")
    g.add_argument("--eval-prompts", type=_nonneg_int, default=D.eval_prompts)
    g.add_argument("--eval-max-new-tokens", type=_pos_int, default=D.eval_max_new_tokens,
                   help="response budget of the held-out eval (default: --max-new-tokens)")
    g.add_argument("--eval-temperature", type=_nonneg_float, default=D.eval_temperature, help="0 = greedy")
    g.add_argument("--ess-cap", type=_pos_float, default=D.ess_cap)


def _add_calibration_args(ap: argparse.ArgumentParser, D: Any) -> None:  # noqa: N803 - D: the GRPOConfig defaults
    """The ``qpass grpo`` argument group: calibration (static RAC channels / activation scales)."""
    g = ap.add_argument_group("calibration (static RAC channels / activation scales)")
    from qpass.apps.calibrate import add_calibration_arg

    add_calibration_arg(g, "also turns on the per-step calib/ staleness report")
    g.add_argument("--recalibrate", action="store_true", default=D.recalibrate,
                   help="re-calibrate the rollout's static constants from the new weights after every weight sync "
                        "(on the calibration's own tokens; needs --calibration)")


def build_grpo_parser(prog: str = "qpass grpo") -> argparse.ArgumentParser:
    """The ``qpass grpo`` argument parser (defaults read from :class:`GRPOConfig` / :class:`LossConfig`:
    one source of defaults)."""
    from qpass.apps.grpo.grpo import GRPOConfig

    D = GRPOConfig()  # noqa: N806
    ap = Parser(prog=prog, description="GRPO with a learner graph and a (quantized) rollout graph; "
                                 "logs SPEC §4 mismatch diagnostics per step.", formatter_class=DefaultsHelpFormatter)
    _add_run_args(ap, D)
    _add_moe_args(ap)
    _add_checkpoint_args(ap)
    _add_sampling_args(ap, D)
    _add_optimization_args(ap, D)
    _add_loss_args(ap, D)
    _add_task_args(ap)
    _add_diagnostics_args(ap, D)
    _add_calibration_args(ap, D)
    return ap


def build_plot_parser(prog: str = "qpass grpo-plot") -> argparse.ArgumentParser:
    """The ``qpass grpo-plot`` argument parser."""
    ap = Parser(prog=prog, description="Overlay GRPO runs (gap, reward, eval accuracy vs step).",
                                 formatter_class=DefaultsHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (each with metrics.jsonl)")
    ap.add_argument("--out", required=True, type=Path, help="output image (PNG)")
    ap.add_argument("--metric", action="append", default=None,
                    help="a metrics key to plot (repeatable; default: gap/token/g_abs, gap/max_abs, reward/mean, eval/accuracy)")
    ap.add_argument("--preset", default="default", choices=["default", "quads", "cost"],
                    help="panel set: default (gap, max|d|, reward, eval), quads (QUADS Fig. 1/6 curves + clip "
                         "fraction per advantage sign + clip-branch disagreement) or cost (held-out accuracy and G_abs "
                         "against cumulative rollout seconds); --metric overrides")
    ap.add_argument("--x", default=None,
                    help="x axis: 'step' or a metrics key, e.g. time/rollout_s_cum (default: the preset's)")
    ap.add_argument("--smooth", type=_pos_int, default=1, help="moving-average window")
    ap.add_argument("--title", default=None, help="figure title (default: none)")
    add_verbose(ap)
    return ap


DEFAULT_COMPARE_METRICS = ("eval/accuracy@last:3", "eval/accuracy@all", "gap/token/g_abs@all", "reward/mean@last:10")


def build_compare_parser(prog: str = "qpass grpo-compare") -> argparse.ArgumentParser:
    """The ``qpass grpo-compare`` argument parser."""
    ap = Parser(prog=prog, description="Between-arm differences of GRPO runs with two-level block-bootstrap "
                                 "CIs (seeds, then steps), and collapse per run by the written definition and by accuracy alone.")
    ap.add_argument("runs", nargs="*", type=Path, help="run directories; an arm is the directory name without its _s<seed> suffix")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=DIR[,DIR...]", help="an arm given explicitly (repeatable)")
    ap.add_argument("--metric", action="append", default=None, metavar="KEY[@WINDOW]",
                    help="metric and window (all | last:N | steps:LO-HI), repeatable; default: " + ", ".join(DEFAULT_COMPARE_METRICS))
    ap.add_argument("--block", type=_pos_int, default=5, help="moving-block length in steps (default 5)")
    ap.add_argument("--boot", type=_pos_int, default=2000, help="bootstrap replicates (default 2000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", default=None, help="compare every arm against this arm only (default: every pair)")
    ap.add_argument("--out", required=True, type=Path, help="JSON output (a .md with the tables is written beside it)")
    add_verbose(ap)
    return ap


# --------------------------------------------------------------------------- helpers


class CliError(Exception):
    """A user-facing error: printed as ``qpass grpo: error: ...`` with exit status 2."""


def _load_reward(spec: str, format_weight: float) -> Any:
    from qpass.rl.task import REWARDS, ExactAnswerReward

    if spec in REWARDS:
        return REWARDS[spec]
    if spec == "format":
        if not format_weight < 1:
            raise CliError(f"--format-weight must be in [0, 1), got {format_weight}")
        return ExactAnswerReward(format_weight=format_weight)
    if ":" not in spec:
        raise CliError(f"--reward must be one of {[*REWARDS, 'format']} or MODULE:ATTR, got {spec!r}")
    mod, _, attr = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except Exception as exc:  # noqa: BLE001 - the user's module: ImportError, SyntaxError, whatever its import raises
        raise CliError(f"--reward {spec!r}: cannot import: {type(exc).__name__}: {exc}") from None
    if not callable(obj):
        raise CliError(f"--reward {spec!r} is not callable")
    return obj


def _recipes(spec: str) -> list[Any]:
    from qpass.errors import RecipeError
    from qpass.compiler.recipe import load_recipe

    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise CliError("--recipe is empty")
    out = []
    for n in names:
        try:
            out.append(load_recipe(n))
        except RecipeError as exc:
            raise CliError(f"--recipe: {exc}") from exc
    seen: set[str] = set()
    for r in out:
        if r.name in seen:
            raise CliError(f"--recipe names {r.name!r} twice")
        seen.add(r.name)
    return out


def _grpo_config(a: argparse.Namespace, steps: int, max_time_s: float | None) -> Any:
    from qpass.apps.grpo.grpo import GRPOConfig
    from qpass.rl.loss import Correction, LossConfig

    try:
        corr = Correction(kind=a.correction, cap=a.tis_cap, lo=a.mis_lo, hi=a.mis_hi)
        loss = LossConfig(eps_low=a.eps_low, eps_high=a.eps_high, ratio=a.ratio, correction=corr, agg=a.agg, beta=a.beta)
        return GRPOConfig(
            steps=steps, prompts_per_step=a.prompts_per_step, group_size=a.group_size, max_new_tokens=a.max_new_tokens,
            temperature=a.temperature, top_p=a.top_p, lr=a.lr, weight_decay=a.weight_decay,
            grad_clip=a.grad_clip or None, master_dtype=a.master_dtype, ppo_epochs=a.ppo_epochs, minibatches=a.minibatches,
            micro_batch_size=a.micro_batch_size, loss=loss, mask_truncated=a.mask_truncated, seed=a.seed,
            bitexact_every=a.bitexact_every, on_parity_failure=a.on_parity_failure, shadow=not a.no_shadow,
            shadow_weights=a.shadow_weights,
            diag_every=a.diag_every, eval_every=a.eval_every if a.n_eval else 0, eval_prompts=min(a.eval_prompts, a.n_eval),
            eval_max_new_tokens=a.eval_max_new_tokens, eval_temperature=a.eval_temperature, ess_cap=a.ess_cap,
            initial_check=not a.no_initial_check, max_time_s=max_time_s, cuda_graphs=a.cuda_graphs,
            recalibrate=a.recalibrate, routing_replay=a.routing_replay == "on",
        )
    except (ValueError, TypeError) as exc:
        from qpass.apps.validate import flag_message

        raise CliError(flag_message(exc)) from exc


def _max_prompt_len(tokenizer: Any, task: Any, template: str) -> int:
    from qpass.prompts import encode_chat
    from qpass.rl.task import format_prompt

    texts = [format_prompt(p, template) for p in list(task.train) + list(task.eval)]
    return max(len(x) for x in encode_chat(tokenizer, texts))


def _run_config(a: argparse.Namespace, pipe: Any, recipe: Any, task: Any, cfg: Any, argv: Sequence[str], build_s: float,
                calibration: Any) -> dict[str, Any]:
    """The run's ``config.json`` record (before the engines add theirs)."""
    return {
        "recipe": recipe.name, "argv": list(argv), "model": pipe.loaded.name, "model_source": pipe.loaded.source,
        "device": a.device, "dtype": a.dtype, "kernels": a.kernels, "batch_size": pipe.base_step.captured.batch_size,
        "max_len": pipe.base_step.captured.max_len, "task": dataclasses.asdict(task.cfg), "template": a.template, "reward": a.reward,
        "grpo": cfg.to_dict(), "timings": {**pipe.timings, "build_s": build_s}, "kernel_tiles": a.kernel_tiles,
        "calibration": calibration.summary() if calibration is not None else None,
    }


def _resume(a: argparse.Namespace, trainer: Any, name: str, steps: int) -> tuple[Path | None, int]:
    """``(checkpoint path or None, the step the run resumes at)``: loads ``--checkpoint-dir/<name>.ckpt``
    into ``trainer`` under ``--resume``.

    Raises:
        CliError: only a legacy (pickle) checkpoint exists, or the checkpoint is past ``steps``.
    """
    from qpass.apps.grpo.checkpoint import checkpoint_path, legacy_path

    ckpt = checkpoint_path(a.checkpoint_dir, name) if a.checkpoint_dir is not None else None
    resumed_from = 0
    if a.resume and ckpt is not None and not ckpt.exists() and legacy_path(ckpt).is_file():
        raise CliError(f"{name}: {legacy_path(ckpt)} is a checkpoint of an older qpass (a pickle, which qpass "
                       "does not load: it can run code); convert it with `python -m qpass.apps.grpo.checkpoint "
                       f"convert {legacy_path(ckpt)}` (reads plain data only), or delete it to start over")
    if a.resume and ckpt is not None and ckpt.exists():
        resumed_from = trainer.load_checkpoint(ckpt)
        print(f"qpass grpo: {name}: resumed at step {resumed_from} from {ckpt}", file=sys.stderr)
    if resumed_from > steps:
        raise CliError(f"{name}: the checkpoint {ckpt} is at step {resumed_from}, the run has --steps {steps}")
    return ckpt, resumed_from


def _run_summary(a: argparse.Namespace, name: str, trainer: Any, res: Any, steps: int, resumed_from: int,
                 ckpt: Path | None) -> dict[str, Any]:
    """The run's ``summary.json`` record from the trainer's history and this command's result ``res``."""
    from qpass.diagnostics.collapse import accuracy_collapse_summary, collapse_summary

    rows = trainer.history["metrics"]
    last = rows[-1] if rows else {}
    keys = ("gap/token/g_abs", "gap/resp/g_abs", "gap/max_abs", "gap/token/k3", "shadow_gap/token/g_abs",
            "clip/frac", "clip/frac_pos", "clip/frac_neg", "reward/mean", "eval/accuracy", "parity/fp_ok",
            "parity/bitexact_ok", "vis/code_frac", "calib/amax_ratio_max", "calib/amax_ratio_median")
    summary = {
        "recipe": name, "steps_done": len(rows), "steps_requested": steps, "stop_reason": res.stop_reason,
        "resumed_from_step": resumed_from, "steps_this_command": len(res.rows), "checkpoint": str(ckpt) if ckpt else None,
        "wall_s": res.wall_s, "initial": res.initial, "final": res.final,
        "collapse": collapse_summary(trainer.history["eval"], rows),
        "collapse_accuracy_only": accuracy_collapse_summary(trainer.history["eval"]),
        "last": {k: last.get(k) for k in keys},
        "mean_over_steps": {k: _mean([r.get(k) for r in rows]) for k in ("gap/token/g_abs", "gap/max_abs", "reward/mean",
                                                                            "shadow_gap/token/g_abs", "clip/frac",
                                                                            "clip/frac_pos", "clip/frac_neg",
                                                                            "loss/clip_pos_frac", "loss/clip_neg_frac")},
        "reward_failures": trainer.reward.stats(),
        "parity_all_steps_ok": all(r.get("parity/fp_ok") for r in rows)
        and all(r.get("parity/bitexact_ok", True) for r in rows)
        and all(r.get("parity/served_ok", True) and r.get("parity/learner_bytes_ok", True) for r in rows)
        and all(r.get("parity/engine_bitexact_ok", True) for r in rows),
        "rollout_engine": a.rollout_engine,
        "engine_bitexact_steps": [r.get("parity/engine_bitexact_ok") for r in rows if "parity/engine_bitexact_ok" in r],
    }
    return summary


def _run_one(a: argparse.Namespace, pipe: Any, recipe: Any, task: Any, reward: Any, dest: Path, steps: int,
             max_time_s: float | None, argv: Sequence[str], shadow: Any = None, calibration: Any = None,
             prov: dict | None = None) -> dict[str, Any]:
    """Train one recipe into ``dest`` (atomically), resuming from / saving to ``--checkpoint-dir``.
    ``prov``: the command's provenance record (``provenance.json``). Returns the summary."""
    from qpass.apps.runinfo import kernel_tiles_report, write_provenance
    from qpass.apps.grpo.grpo import GRPOTrainer
    from qpass.apps.grpo.jsonl import write_json_atomic, write_text_atomic
    from qpass.apps.grpo.plots import plot_runs
    from qpass.atomic import atomic_dir
    from qpass.rl.task import REWARDS, TEMPLATES

    cfg = _grpo_config(a, steps, max_time_s)
    out_dir = atomic_dir(dest, force=a.force, marker="summary.json", keep_partial=a.keep_partial)
    try:
        with out_dir as tmp:
            t0 = time.perf_counter()
            learner, rollout = pipe.build(recipe, calibration=calibration)
            build_s = time.perf_counter() - t0
            config = _run_config(a, pipe, recipe, task, cfg, argv, build_s, calibration)
            write_json_atomic(tmp / "config.json", config)
            if prov is not None:
                write_provenance(tmp, {**prov, "run": {"recipe": recipe.name, "out": str(dest)}})
            write_text_atomic(tmp / "recipe.yaml", recipe.text or "")
            with contextlib.ExitStack() as engines:
                engine = engines.enter_context(_learner_engine(a, pipe, learner))
                if engine is not None:
                    config["learner_engine"] = {"name": engine.name, "tp": a.tp, "timeout_s": a.megatron_timeout_s,
                                                "fake_quant_modules": len(getattr(engine, "plan", {}))}
                rollout_eng = None
                if a.rollout_engine == "vllm":
                    rollout_eng = engines.enter_context(_vllm_engine(a, pipe, rollout))
                    config["rollout_engine"] = {"name": "vllm", "start_s": rollout_eng.start_s}
                if engine is not None or rollout_eng is not None:
                    write_json_atomic(tmp / "config.json", config)
                trainer = GRPOTrainer(learner, rollout, pipe.tokenizer, task, cfg, reward_fn=reward,
                                      shadow=shadow if cfg.shadow else None, metrics_path=tmp / "metrics.jsonl",
                                      layerwise_path=tmp / "layerwise.jsonl", eval_path=tmp / "eval.jsonl", recipe_name=recipe.name,
                                      template=TEMPLATES[a.template], learner_engine=engine, rollout_engine=rollout_eng,
                                      answer_fn=REWARDS.get(a.reward),
                                      calibration=calibration,
                                      calibration_model=_calibration_model(pipe) if cfg.recalibrate else None)
                ckpt, resumed_from = _resume(a, trainer, recipe.name, steps)

                def on_step(row: dict[str, Any]) -> None:
                    if ckpt is not None and a.checkpoint_every and row["step"] % a.checkpoint_every == 0:
                        trainer.save_checkpoint(ckpt)

                if resumed_from == steps:  # already complete: rewrite the run directory from the checkpoint only
                    from qpass.apps.grpo.grpo import GRPOResult

                    res = GRPOResult([], trainer.initial or {}, {}, "completed", 0.0)
                else:
                    res = trainer.run(a.segment_steps, progress=not a.no_progress, on_step=on_step)
                    if ckpt is not None:
                        trainer.save_checkpoint(ckpt)
            rows = trainer.history["metrics"]
            summary = _run_summary(a, recipe.name, trainer, res, steps, resumed_from, ckpt)
            write_json_atomic(tmp / "summary.json", summary)
            write_json_atomic(tmp / "kernel_tiles.json", kernel_tiles_report(a.kernel_tiles, a.kernels))
            if not a.no_plots and rows:
                plot_runs([tmp], tmp / "plots.png", title=f"GRPO {recipe.name}")
                plot_runs([tmp], tmp / "quads_curves.png", title=f"GRPO {recipe.name}", preset="quads")
        return summary
    finally:
        if out_dir.kept is not None:
            print(f"qpass grpo: output of {recipe.name} kept in {out_dir.kept}", file=sys.stderr)


@contextlib.contextmanager
def _learner_engine(a: argparse.Namespace, pipe: Any, learner: Any) -> Any:
    """The ``--learner`` engine for one recipe (None: the built-in one over ``learner``), closed after
    the run (a Megatron learner's worker processes stop with it)."""
    if a.learner == "qpass":
        yield None
        return
    from qpass.runtime.engine import make_learner_engine

    engine = make_learner_engine(a.learner, hf_model=pipe.loaded.model, tp=a.tp, device=a.device,
                                 learner_sites=learner.quant, timeout_s=a.megatron_timeout_s)
    try:
        yield engine
    finally:
        engine.close()


def _check_learner_args(a: argparse.Namespace) -> None:
    """``--learner`` / ``--tp`` combinations refused before any model is loaded."""
    if a.learner == "qpass" and a.tp != 1:
        raise CliError("--tp needs --learner megatron (the qpass learner graph is not sharded)")
    if a.learner != "qpass" and a.beta > 0:
        raise CliError(f"--beta > 0 needs a reference policy; --learner {a.learner} has none here (use --beta 0)")


def _check_learner_model(a: argparse.Namespace, hf_config: Any) -> None:
    """The model's config against the ``--learner`` backend, before any learner process starts."""
    if a.learner == "megatron":
        from qpass.backends.megatron.config import MegatronConfigError, layout_from_hf

        try:
            layout_from_hf(hf_config, tp=a.tp)
        except MegatronConfigError as exc:
            raise CliError(f"--learner megatron --tp {a.tp}: {exc}") from None


def _check_moe_args(a: argparse.Namespace, pipe: Any) -> None:
    """``--routing-replay`` / ``--cuda-graphs`` against the loaded model (MoE or dense), before any recipe runs."""
    from qpass.moe.routing import has_routing

    moe = has_routing(pipe.base_step.gm)
    if a.routing_replay == "on" and not moe:
        raise CliError(f"--routing-replay on needs an MoE model; {pipe.loaded.name} has no MoE router")
    if moe and a.cuda_graphs == "on":
        raise CliError("--cuda-graphs on: an MoE rollout records its expert routes at every decode step and stays eager "
                       "(use --cuda-graphs auto or off)")


def _vllm_engine(a: argparse.Namespace, pipe: Any, rollout: Any) -> Any:
    """The vLLM engine context for ``--rollout-engine vllm``: the recipe's rollout side exported from the
    initial master weights (:func:`qpass.apps.engines.vllm_rollout`), one live engine for the whole run."""
    from qpass.apps.engines import vllm_rollout
    from qpass.compiler.pipeline import DTYPES
    from qpass.prompts import encode_chat, probe_prompts

    cap = pipe.base_step.captured
    return vllm_rollout(pipe.loaded.model, pipe.tokenizer, DTYPES[a.dtype], rollout=rollout,
                        calibration_ids=encode_chat(pipe.tokenizer, probe_prompts(4)), batch_size=int(cap.batch_size),
                        max_len=int(cap.max_len), seed=a.seed)


def _calibration_model(pipe: Any) -> Any:
    """A private copy of the unquantized model for ``--recalibrate`` (its weights get overwritten)."""
    import copy

    return copy.deepcopy(pipe.loaded.model).eval()


def _mean(xs: list[Any]) -> float | None:
    v = [float(x) for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)]
    return sum(v) / len(v) if v else None


# --------------------------------------------------------------------------- entry points


def grpo_main(argv: Sequence[str] | None = None) -> int:
    """``qpass grpo`` (arguments after the subcommand). Returns the exit status.

    0: every recipe finished; 1: a recipe failed (others still ran); 2: bad arguments;
    130: interrupted (Ctrl-C), nothing half-written left at the output path.
    """
    ap = build_grpo_parser()
    argv_list = list(sys.argv[1:] if argv is None else argv)
    try:
        _apply_preset(ap, argv_list)
        a = ap.parse_args(argv_list)
    except SystemExit as exc:
        return _exit_code(exc)
    from qpass.apps.progress import command_progress

    with command_progress(enabled=not a.no_progress):
        return _grpo_main(ap, a, argv_list)


def _check_before_load(a: argparse.Namespace) -> tuple[list[Any], dict[str, Path], Any, Any]:
    """``(recipes, {recipe name: run directory}, reward, calibration or None)``: every check that needs
    no model (outputs, flags and their combinations, the calibration file, backends).

    Raises:
        CliError: the first problem found.
    """
    from qpass.atomic import check_output_path
    from qpass.errors import QpassError

    recipes = _recipes(a.recipe)
    multi = len(recipes) > 1
    dests = {r.name: (a.out / r.name if multi else a.out) for r in recipes}
    for d in dests.values():
        try:  # symlink, existing without --force/--overwrite, not replaceable: before any work
            check_output_path(d, force=a.force, marker="summary.json")
        except QpassError as exc:
            raise CliError(f"--out: {exc}") from None
    reward = _load_reward(a.reward, a.format_weight)
    _grpo_config(a, a.steps, a.max_time_s)  # every value and range, before the model load
    from qpass.apps.validate import check_grpo_args

    try:  # option combinations, counts against the task, the model reference
        check_grpo_args(a)
    except QpassError as exc:
        raise CliError(str(exc)) from None
    if a.recalibrate and a.calibration is None:
        raise CliError("--recalibrate needs --calibration CAL (its prompts are what it re-calibrates on)")
    calibration = None
    if a.calibration is not None:  # verified before the model load (its model's sha256 after it)
        from qpass.apps.calibrate import load_for_model

        try:
            calibration = load_for_model(a.calibration, None)
        except QpassError as exc:
            raise CliError(str(exc)) from None
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise CliError("--device cuda: no CUDA device is available")
    _check_backends(a)
    return recipes, dests, reward, calibration


def _check_backends(a: argparse.Namespace) -> None:
    """Load the ``--kernels`` (and a non-default ``--learner``) backend; check ``--routing-replay``.

    Raises:
        CliError: a backend that does not load, or routing replay without an MoE model / qpass rollout.
    """
    from qpass.apps.plugins import load_backends
    from qpass.errors import QpassError as _QpassError

    try:
        load_backends([a.kernels])  # the one registration path
    except (_QpassError, ImportError) as exc:
        raise CliError(f"--kernels {a.kernels}: {exc}") from exc
    _check_learner_args(a)
    if a.routing_replay == "on" and a.model == "default":
        raise CliError("--routing-replay on needs an MoE model (e.g. --model moe-default); the default model is dense")
    if a.routing_replay == "on" and a.rollout_engine != "qpass":
        raise CliError(f"--routing-replay on needs the rollout's recorded routes: --rollout-engine {a.rollout_engine} "
                       "does not record them (use --rollout-engine qpass)")
    if a.learner != "qpass":
        try:
            load_backends([a.learner])
        except (_QpassError, ImportError) as exc:
            raise CliError(f"--learner {a.learner}: {exc}") from exc


def _grpo_task(a: argparse.Namespace) -> Any:
    """The ``--task`` (``--difficulty``, ``--operators``, split sizes); fills in ``a.template`` when not given.

    Raises:
        CliError: ``--operators`` with another task, or a bad preset value.
    """
    from qpass.rl.task import KINDS, ArithmeticTask, task_preset

    try:
        over = {"operators": tuple(a.operators.split(","))} if a.operators else {}
        if over and a.task != "arithmetic":
            raise ValueError(f"--operators applies to --task arithmetic only, not {a.task!r}")
        task = ArithmeticTask(task_preset(a.task, level=a.difficulty, n_train=a.n_train, n_eval=a.n_eval, seed=a.seed, **over))
    except ValueError as exc:
        raise CliError(f"task: {exc}") from exc
    if a.template is None:
        a.template = KINDS[task.cfg.kind].template
    return task


def _grpo_pipeline(a: argparse.Namespace, task: Any, calibration: Any) -> tuple[Any, Any]:
    """``(pipeline, BF16 shadow engine or None)``: the model loaded and checked against the flags and
    the calibration, the static batch and KV length sized for the task's longest prompt.

    Raises:
        CliError: a learner/MoE/calibration mismatch or a ``--max-len`` that is too short.
    """
    from qpass.compiler.pipeline import DTYPES, Pipeline
    from qpass.errors import QpassError
    from qpass.graph.model import load_model
    from qpass.progress import phase
    from qpass.rl.task import TEMPLATES

    with phase(f"load the model ({a.model})"):
        lm = load_model(a.model, dtype=DTYPES[a.dtype], device=a.device)
    _check_learner_model(a, lm.model.config)
    if calibration is not None:
        try:
            calibration.check_model(lm.model)
        except QpassError as exc:
            raise CliError(f"--calibration: {exc}") from None
    need = _max_prompt_len(lm.tokenizer, task, TEMPLATES[a.template]) + max(a.max_new_tokens, a.eval_max_new_tokens or 0)
    max_len = a.max_len or int(math.ceil(need / 16) * 16)
    if max_len < need:
        raise CliError(f"--max-len {max_len} is shorter than the longest prompt + max new tokens ({need})")
    batch = a.batch_size or min(a.prompts_per_step * a.group_size, 64)
    pipe = Pipeline.prepare(a.model, dtype=a.dtype, device=a.device, batch_size=batch, max_len=max_len, loaded=lm)
    _check_moe_args(a, pipe)
    shadow = None
    if not a.no_shadow:  # the BF16 shadow: the bf16 recipe's rollout engine, built once for every recipe
        from qpass.compiler.recipe import load_recipe
        from qpass.runtime.engine import make_rollout_engine

        tok = lm.tokenizer
        eos = tok.eos_token_id if isinstance(tok.eos_token_id, (list, tuple)) else [tok.eos_token_id]
        shadow = make_rollout_engine("qpass", qg=pipe.build_side(load_recipe("bf16"), "rollout"),
                                     pad_token_id=int(tok.pad_token_id), eos_token_id=[int(e) for e in eos],
                                     cuda_graphs=a.cuda_graphs)
    return pipe, shadow


def _train_recipes(a: argparse.Namespace, pipe: Any, task: Any, reward: Any, recipes: list[Any], dests: dict[str, Path],
                   shadow: Any, calibration: Any, prov: dict, argv_list: list[str],
                   t_start: float) -> tuple[dict[str, dict], list[str]]:
    """Run every recipe in turn (``--total-time-s`` split over those left); ``(summaries by recipe,
    names of the recipes that failed or were skipped)``. With one recipe its error propagates."""
    from qpass.errors import QpassError
    from qpass.ops import use_kernels

    multi = len(recipes) > 1
    summaries: dict[str, dict] = {}
    failed: list[str] = []
    with use_kernels(a.kernels):
        for i, recipe in enumerate(recipes):
            budget = a.max_time_s
            if a.total_time_s is not None:
                left = a.total_time_s - (time.perf_counter() - t_start)
                share = left / (len(recipes) - i)
                if share <= 0:
                    print(f"qpass grpo: total time budget spent; skipping {recipe.name}", file=sys.stderr)
                    failed.append(recipe.name)
                    continue
                budget = share if budget is None else min(budget, share)
            try:
                summaries[recipe.name] = _run_one(a, pipe, recipe, task, reward, dests[recipe.name], a.steps, budget, argv_list,
                                                  shadow, calibration, prov)
                s = summaries[recipe.name]
                print(f"qpass grpo: {recipe.name}: {s['steps_done']} steps ({s['stop_reason']}), "
                      f"G_abs {_fmt4(s['last'].get('gap/token/g_abs'))}, reward {_fmt4(s['last'].get('reward/mean'))} "
                      f"-> {dests[recipe.name]}",
                      file=sys.stderr)
            except (QpassError, ValueError, RuntimeError) as exc:
                if not multi:
                    raise
                failed.append(recipe.name)
                print(f"qpass grpo: {recipe.name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            finally:
                gc.collect()
                if a.device == "cuda":
                    import torch

                    torch.cuda.empty_cache()
    return summaries, failed


def _grpo_main(ap: argparse.ArgumentParser, a: argparse.Namespace, argv_list: list[str]) -> int:
    """:func:`grpo_main` after the arguments are parsed (inside the progress reporter)."""
    t_start = time.perf_counter()
    from qpass.errors import QpassError

    try:
        recipes, dests, reward, calibration = _check_before_load(a)
    except CliError as exc:
        ap.print_usage(sys.stderr)
        print(f"qpass grpo: error: {exc}", file=sys.stderr)
        return 2

    from qpass.apps.grpo.plots import plot_runs

    if a.threads is not None:
        import torch

        torch.set_num_threads(a.threads)
    from qpass.apps.runinfo import kernel_tiles_scope, provenance

    prov = provenance(["grpo", *argv_list], device=a.device, kernels=a.kernels, kernel_tiles=a.kernel_tiles)
    scopes = contextlib.ExitStack()  # the Triton tile mode (--kernel-tiles) for the whole command
    scopes.enter_context(kernel_tiles_scope(a.kernel_tiles))
    try:
        task = _grpo_task(a)
        pipe, shadow = _grpo_pipeline(a, task, calibration)
        summaries, failed = _train_recipes(a, pipe, task, reward, recipes, dests, shadow, calibration, prov, argv_list, t_start)
        if len(recipes) > 1 and not a.no_plots:
            done = [dests[n] for n in summaries]
            if done:
                plot_runs(done, a.out / "overlay.png", title="GRPO: " + ", ".join(summaries))
    except KeyboardInterrupt as exc:
        from qpass.errors import Terminated

        print(f"qpass grpo: {'terminated' if isinstance(exc, Terminated) else 'interrupted'}; no partial run directory left behind"
              + (" (see *.partial)" if a.keep_partial else ""), file=sys.stderr)
        return exit_status(exc)
    except CliError as exc:
        print(f"qpass grpo: error: {exc}", file=sys.stderr)
        return 2
    except QpassError as exc:  # the shared exit-code map: ParityError 1, other qpass errors (bad input) 2
        print(f"qpass grpo: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        if type(exc).__name__ == "MegatronRankError":  # a learner rank died: a failed run, not bad input
            return 1
        return exit_status(exc)
    finally:
        scopes.close()
    return 1 if failed else 0


def grpo_plot_main(argv: Sequence[str] | None = None) -> int:
    """``qpass grpo-plot RUN_DIR... --out PNG`` (arguments after the subcommand). Returns the exit status."""
    from qpass.apps.grpo.plots import load_run, plot_runs

    ap = build_plot_parser()
    a = _parse_or_status(ap, argv)
    if isinstance(a, int):
        return a
    from qpass.atomic import check_output_file
    from qpass.errors import QpassError

    try:
        check_output_file(a.out, "--out")
        for d in a.runs:  # every run read (and its rows checked) before anything is drawn
            if not load_run(d).rows:
                raise ValueError(f"{d / 'metrics.jsonl'} holds no complete metric row (nothing to plot)")
        out = plot_runs(a.runs, a.out, panels=a.metric, smooth=a.smooth, title=a.title, preset=a.preset, x=a.x)
    except (FileNotFoundError, ValueError, QpassError) as exc:
        print(f"qpass grpo-plot: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


def compare_arms_from_args(a: argparse.Namespace) -> tuple[dict[str, list[Path]], list[tuple[str, Any]]]:
    """Arms and metrics of ``qpass grpo-compare``, validated (no run is read beyond its existence).

    Raises:
        CliError: a bad metric / window, an ``--arm`` without ``=``, a directory without metrics.jsonl,
            an arm named twice, or no runs at all.
    """
    from qpass.diagnostics.compare import arm_of, parse_metric

    try:
        metrics = [parse_metric(m) for m in (a.metric or DEFAULT_COMPARE_METRICS)]
    except ValueError as exc:
        raise CliError(f"--metric: {exc}") from None
    arms: dict[str, list[Path]] = {}
    for d in a.runs:
        arms.setdefault(arm_of(d.name)[0], []).append(d)
    for spec in a.arm:
        name, eq, dirs = spec.partition("=")
        if not eq or not name.strip() or not dirs.strip():
            raise CliError(f"--arm must be NAME=DIR[,DIR...], got {spec!r}")
        if name in arms:
            raise CliError(f"arm {name!r} is given twice")
        arms[name.strip()] = [Path(x) for x in dirs.split(",") if x.strip()]
    if not arms:
        raise CliError("no runs given (positional run directories or --arm NAME=DIR)")
    for name, dirs in arms.items():
        for d in dirs:
            if not (d / "metrics.jsonl").is_file():
                raise CliError(f"arm {name!r}: {d} is not a GRPO run directory (no metrics.jsonl)")
    if a.baseline is not None and a.baseline not in arms:
        raise CliError(f"--baseline {a.baseline!r} is not an arm; arms: {sorted(arms)}")
    return arms, metrics


def grpo_compare_main(argv: Sequence[str] | None = None) -> int:
    """``qpass grpo-compare RUN... --out F.json`` (arguments after the subcommand). Returns the exit status."""
    ap = build_compare_parser()
    a = _parse_or_status(ap, argv)
    if isinstance(a, int):
        return a
    from qpass.apps.grpo.plots import load_run
    from qpass.atomic import check_output_file, write_atomic
    from qpass.diagnostics.compare import compare_runs, to_markdown
    from qpass.errors import QpassError
    from qpass.jsonio import write_json

    try:
        check_output_file(a.out, "--out")
        check_output_file(a.out.with_suffix(".md"), "--out (its .md)")
        arms, metrics = compare_arms_from_args(a)
        res = compare_runs(arms, metrics, load=load_run, block=a.block, n_boot=a.boot, seed=a.seed, baseline=a.baseline)
    except CliError as exc:
        ap.print_usage(sys.stderr)
        print(f"qpass grpo-compare: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, QpassError) as exc:  # a run file that does not parse, an unwritable --out
        print(f"qpass grpo-compare: error: {exc}", file=sys.stderr)
        return 2
    write_json(a.out, res)
    md = to_markdown(res)
    write_atomic(a.out.with_suffix(".md"), md)
    print(md)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``grpo ...``, ``grpo-plot ...`` or ``grpo-compare ...``; returns the exit status (2 for an unknown
    subcommand). ``qpass grpo-sweep`` is dispatched by the ``qpass`` tree (:mod:`qpass.apps.cli`) only:
    the sweep imports this module's parser, so naming it here would be an import cycle."""
    args = list(sys.argv[1:] if argv is None else argv)
    commands = {"grpo": grpo_main, "grpo-plot": grpo_plot_main, "grpo-compare": grpo_compare_main}
    if not args or args[0] not in commands:
        print(f"usage: qpass {{{','.join(commands)}}} ...  (got {args[0]!r})" if args else
              f"usage: qpass {{{','.join(commands)}}} ...", file=sys.stderr)
        return 2
    return commands[args[0]](args[1:])


def _parse_or_status(ap: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace | int:
    """``ap.parse_args(argv)`` (``sys.argv[1:]`` when None), or argparse's exit status (--help: 0, usage error: 2)."""
    try:
        return ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:
        return _exit_code(exc)


def _fmt4(v: object) -> str:
    """A metric for the console: 4 decimals (``None`` and non-numbers as they are)."""
    return f"{v:.4f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def _exit_code(exc: SystemExit) -> int:
    """argparse's SystemExit as a return value (--help: 0, usage error: 2)."""
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


if __name__ == "__main__":  # through the qpass entry point: logging set up once, one exit-code map
    from qpass.apps.cli import main as qpass_main

    with contextlib.suppress(BrokenPipeError):
        sys.exit(qpass_main(sys.argv[1:]))
