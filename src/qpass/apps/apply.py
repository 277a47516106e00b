"""``qpass apply``: recipe -> learner graph + rollout graph + parity report (orchestration).

Load the model, capture the scoring and step graphs, run the recipe's pass lists, run the parity
checks the recipe lists (the registry in :mod:`qpass.apps.parity_checks`, shared with
``qpass check``), compute diagnostics, and write ``DIR/report.json``, ``DIR/report.md``, plots, the
learner state and the rollout artifacts — atomically (:func:`qpass.atomic.atomic_dir`: ``DIR``
appears complete or not at all, reserved from the start). ``report.json`` records the sha256 of
every file written so ``qpass check DIR`` finds a changed byte before loading anything. Exit status
1 when a parity check fails. Console output: :mod:`qpass.apps.console`; the report: :mod:`qpass.apps.report`.
"""

from __future__ import annotations

import argparse

from qpass.apps.cliutil import Parser
import contextlib
import functools
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

from qpass import __version__
from qpass.apps.artifacts import save_learner, save_rollout
from qpass.apps.console import console as _console
from qpass.apps.console import print_passes, print_summary
from qpass.apps.options import ApplyOptions, add_common_args, gap_options
from qpass.apps.parity_checks import PARITY_CHECKS, BehaviorProbe, CheckContext, run_checks
from qpass.apps.report import build_report, site_counts, uncaptured_linears, write_report
from qpass.apps.validate import check_model_ref
from qpass.atomic import atomic_dir
from qpass.errors import QpassError
from qpass.graph.qgraph import QGraph
from qpass.progress import phase
from qpass.compiler.recipe import Recipe, load_recipe

log = logging.getLogger(__name__)

__all__ = ["ApplyOptions", "gap_options", "main_apply", "main_check", "run_apply", "run_check", "site_counts",
           "uncaptured_linears"]


def activation_diagnostics(learner: QGraph, rollout: QGraph, batch: Any,
                           skipped: list[str] | None = None) -> tuple[dict[str, float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per-site relative input mismatch on one sampled batch (valid tokens only), plus the raw inputs.

    The shared capture-and-compare (:func:`qpass.diagnostics.capture.compare_graph_inputs`, in the
    rollout's site order; a non-finite activation gives that site's plain norm ratio, NaN/inf, rather
    than an error). Sites whose input is not one row per token of the batch (MoE expert linears: the
    tokens routed to that expert, a set that can differ between the two sides) have no row-aligned
    comparison; they are left out of the result and their ids appended to ``skipped``.

    Returns:
        ``(rel, learner_rows, rollout_rows)``: ``{site: rel}`` and each side's valid-token inputs
        float32 ``[n_valid, K]`` on CPU.
    """
    from qpass.diagnostics.capture import compare_graph_inputs

    cmp = compare_graph_inputs(learner, rollout, batch.input_ids, batch.attention_mask, order=list(rollout.sites),
                               nonfinite="nan")
    if skipped is not None:
        skipped.extend(cmp.skipped)
    return cmp.rel(), cmp.learner_rows, cmp.rollout_rows


def _pick_rac_site(rollout: QGraph, acts: dict[str, torch.Tensor]) -> str | None:
    """The site whose NVFP4 activation residual the heatmap shows: a RAC site, else any NVFP4-activation
    site, the one with the largest input; None where no site quantizes its activation to NVFP4 (FP8 or
    weight-only recipes)."""
    from qpass.formats.spec import NVFP4Spec

    nvfp4 = {s: r for s, r in rollout.quant.items() if isinstance(r.act_spec, NVFP4Spec) and s in acts}
    cands = [s for s, r in nvfp4.items() if r.rac is not None] or list(nvfp4)
    if not cands:
        return None
    return max(cands, key=lambda s: float(acts[s].abs().max()))


def run_apply(recipe_ref: str, out: Path, o: ApplyOptions, *, pipeline: Any = None) -> tuple[int, dict[str, Any]]:
    """Run the main job. Returns (exit status, report).

    ``pipeline`` (tests, notebooks): reuse an already captured :class:`qpass.compiler.pipeline.Pipeline`
    instead of loading and capturing again; its step graph must have room for the probe.

    Raises:
        RecipeError: invalid recipe, or a CLI override the recipe schema rejects (before any work).
        QpassError: bad output path (symlink, existing without --force, being written by another
            run), no CUDA for ``--device cuda``, a too-small given pipeline.
    """
    from qpass.apps.plugins import load_backends
    from qpass.ops import effective_backend, use_kernels
    from qpass.prompts import encode_chat, probe_prompts

    con = _console()
    t_all = time.perf_counter()
    recipe = load_recipe(recipe_ref)  # validate before any long work
    gopt = gap_options(recipe, o)
    if pipeline is None:
        check_model_ref(o.model)
    if o.batch_size < 1:
        raise QpassError(f"--batch-size must be >= 1, got {o.batch_size}")
    if o.device == "cuda" and not torch.cuda.is_available():
        raise QpassError("--device cuda requested but torch.cuda.is_available() is False")
    cal = _load_calibration(o)  # verified before any heavy work (its model match: after the load)
    kernels_eff = effective_backend(o.kernels, o.device)
    if kernels_eff != o.kernels:
        con.print(f"[yellow]warning: --kernels {o.kernels} on {o.device} runs the {kernels_eff} ops "
                  "(Triton kernels need CUDA, or TRITON_INTERPRET=1 for the slow CPU interpreter)[/]")
    timings: dict[str, float] = {}
    load_backends([o.kernels])  # the one registration path (qpass.apps.plugins)
    with atomic_dir(out, force=o.force) as tmp, use_kernels(o.kernels):
        t0 = time.perf_counter()
        if pipeline is not None:
            lm = pipeline.loaded
        else:
            with phase(f"load the model ({o.model})"):
                lm = _load(o)
        if cal is not None:
            cal.check_model(lm.model)  # before the capture: another model's calibration is bad input
        prompts = encode_chat(lm.tokenizer, probe_prompts(gopt.prompts))
        pipe, bsz, max_len = _capture(o, lm, pipeline, len(prompts) * gopt.samples_per_prompt,
                                      max(len(p) for p in prompts) + gopt.max_new_tokens + 1, t0)
        timings.update(pipe.timings)
        con.print(f"[bold]captured[/] {len(pipe.base_scoring.sites)} linear sites "
                  f"(scoring {timings['capture_scoring_s']:.1f}s, step {timings['capture_step_s']:.1f}s)")
        t0 = time.perf_counter()  # one phase per side (qpass.compiler.manager), one unit per pass
        learner, rollout = pipe.build(recipe, debug=o.debug, reproducer_dir=out.parent / f"{out.name}.reproducers",
                                      calibration=cal)
        timings["passes_s"] = time.perf_counter() - t0
        print_passes(con, learner.history + rollout.history)

        probe = BehaviorProbe(prompts, dict(pad_token_id=lm.tokenizer.pad_token_id, eos_token_id=lm.tokenizer.eos_token_id,
                                            max_new_tokens=gopt.max_new_tokens, samples_per_prompt=gopt.samples_per_prompt,
                                            temperature=gopt.temperature, top_p=gopt.top_p, seed=gopt.seed),
                              gopt.max_abs_gap, (pipe.base_scoring, pipe.base_step) if o.floor else None,
                              _vllm_factory(lm, o, None, prompts, bsz, max_len, gopt.seed) if o.rollout_engine == "vllm" else None)
        names = [c.check for c in recipe.parity if o.behavioral or not PARITY_CHECKS[c.check].behavioral]
        if o.behavioral and "logprob_gap" not in names:  # measured (not gated) even if the recipe does not list it
            names.append("logprob_gap")
        with contextlib.ExitStack() as engines:
            engine = None
            if o.rollout_engine == "vllm":
                with phase("export the rollout checkpoint and start vLLM"):
                    t0 = time.perf_counter()
                    engine = engines.enter_context(_vllm_factory(lm, o, rollout, prompts, bsz, max_len, gopt.seed)())
                    timings["engine_start_s"] = time.perf_counter() - t0
                if "weights_bitexact" not in names:  # the engine's bytes are always read back
                    names.insert(0, "weights_bitexact")
            ctx = CheckContext(recipe, learner, rollout, timings, probe, engine, engines.close if engine else None)
            results = list(run_checks(ctx, names))

        plots: dict[str, str] = {}
        diag: dict[str, Any] = {}
        gap_res = next((r for r in results if r.name == "logprob_gap"), None)
        if gap_res is not None:
            t0 = time.perf_counter()
            try:
                plots.update(_diagnostics_and_plots(recipe, learner, rollout, gap_res.data["gap"], gap_res.data["floor"], tmp, diag))
            except ImportError as exc:  # e.g. no matplotlib on a GPU box: numbers stay in report.json
                diag["plots_skipped"] = f"{type(exc).__name__}: {exc}"
            timings["diagnostics_s"] = time.perf_counter() - t0

        files = _write_artifacts(o, recipe, learner, rollout, cal, tmp, timings)
        report = build_report(recipe, o, lm, pipe, learner, rollout, results, kernels_eff, bsz, max_len, gopt, diag, plots,
                              files, timings | {"total_s": time.perf_counter() - t_all})
        write_report(tmp, report)
    print_summary(con, report, out)
    return (0 if report["ok"] else 1), report


def _write_artifacts(o: ApplyOptions, recipe: Recipe, learner: QGraph, rollout: QGraph, cal: Any, tmp: Path,
                     timings: dict[str, float]) -> dict[str, Any]:
    """Write ``rollout/`` (and ``learner/``, ``calibration/``) under ``tmp``; returns the report's ``files`` entry."""
    with phase("write the artifacts", total=1 + o.save_learner + (cal is not None), unit="file set") as ph:
        t0 = time.perf_counter()
        files: dict[str, Any] = {"rollout": save_rollout(rollout, tmp / "rollout", recipe.text,
                                                         {"recipe": recipe.name, "qpass_version": __version__})}
        ph.advance(note="rollout/")
        if o.save_learner:
            files["learner"] = {"state": "learner/model.safetensors",
                                "tensors": save_learner(learner, tmp / "learner" / "model.safetensors")}
            ph.advance(note="learner/")
        if cal is not None:  # the calibration the rollout was built with, for `qpass check` / `qpass export DIR`
            from qpass.calibration.run import graph_requests

            import shutil

            from qpass.calibration.record import JSON_NAME, TENSORS_NAME

            (tmp / "calibration").mkdir()
            for name in (JSON_NAME, TENSORS_NAME):  # byte for byte: check re-verifies the same sha256
                shutil.copyfile(cal.path / name, tmp / "calibration" / name)
            req = graph_requests(rollout)
            files["calibration"] = {"dir": "calibration", **cal.summary(), "path": str(o.calibration),
                                    "static_act_sites_used": len(req.amax), "static_rac_sites_used": len(req.rac)}
            ph.advance(note="calibration/")
        timings["write_s"] = time.perf_counter() - t0
    return files


def _load_calibration(o: ApplyOptions) -> Any:
    """``--calibration``: the verified calibration (None without the flag). Raises CalibrationError (exit 2)."""
    if o.calibration is None:
        return None
    from qpass.apps.calibrate import load_for_model

    return load_for_model(o.calibration, None)


def _vllm_factory(lm: Any, o: ApplyOptions, rollout: QGraph | None, prompts: list[list[int]], bsz: int, max_len: int,
                  seed: int) -> Any:
    """A factory of the vLLM engine context (:func:`qpass.apps.engines.vllm_rollout`): ``rollout``'s
    quantization on the model's master weights, or the unquantized model (the BF16 floor) for None."""
    from qpass.apps.engines import vllm_rollout
    from qpass.compiler.pipeline import DTYPES

    return functools.partial(vllm_rollout, lm.model, lm.tokenizer, DTYPES[o.dtype], rollout=rollout, calibration_ids=prompts,
                             batch_size=bsz, max_len=max_len, seed=seed)


def _load(o: ApplyOptions) -> Any:
    from qpass.graph.model import load_model
    from qpass.compiler.pipeline import DTYPES

    return load_model(o.model, dtype=DTYPES[o.dtype], device=o.device)


def _capture(o: ApplyOptions, lm: Any, pipeline: Any, rows: int, max_len: int, t0: float) -> tuple[Any, int, int]:
    """Capture both graphs for a ``rows``-row probe of ``max_len`` tokens (or check a given pipeline fits)."""
    from qpass.compiler.pipeline import Pipeline

    if pipeline is None:
        bsz = min(o.batch_size, rows)
        pipe = Pipeline.prepare(o.model, batch_size=bsz, max_len=max_len, loaded=lm)
        pipe.timings["load_s"] = time.perf_counter() - t0 - pipe.timings["capture_scoring_s"] - pipe.timings["capture_step_s"]
        return pipe, bsz, max_len
    cap = pipeline.base_step.captured
    if cap.max_len < max_len:
        raise QpassError(f"the given pipeline's KV cache has {cap.max_len} slots; the probe needs {max_len}")
    return pipeline, cap.batch_size, cap.max_len


def _diagnostics_and_plots(recipe: Recipe, learner: QGraph, rollout: QGraph, gap: Any, floor: Any, tmp: Path, diag: dict[str, Any]) -> dict[str, str]:
    """Per-site activation mismatch, the residual map of one RAC (or W4A4) site, the gap histogram
    (a phase of 3 steps: capture the linear inputs, the residual map, the plots)."""
    with phase("diagnostics and plots", total=3, unit="step") as ph:
        return _diagnostics_steps(recipe, learner, rollout, gap, floor, tmp, diag, ph)


def _diagnostics_steps(recipe: Recipe, learner: QGraph, rollout: QGraph, gap: Any, floor: Any, tmp: Path, diag: dict[str, Any],
                       ph: Any) -> dict[str, str]:
    from qpass.calibration.run import graph_constants
    from qpass.diagnostics.layerwise import residual_channel_map
    from qpass.formats.spec import NVFP4_ACT
    from qpass.quant.rac import activation_residual, static_channels
    from qpass.apps.report import plot_activation_mismatch, plot_gap_histogram, plot_residual_heatmap

    plots: dict[str, str] = {}
    skipped: list[str] = []
    ph.advance(0, note="capture the linear inputs of both graphs")
    rel, la, ra = activation_diagnostics(learner, rollout, gap.batches[0], skipped)
    ph.advance(note="residual map")
    diag["activation_mismatch_rel"] = rel
    if skipped:
        diag["activation_mismatch_skipped"] = {
            "sites": len(skipped), "example": skipped[0],
            "reason": "input is not one row per batch token (MoE expert linear: only the tokens routed to the expert, "
                      "a set that differs between rollout and learner where their routes differ)"}
    diag["rollout_tokens_per_s"] = gap.tokens_per_s
    site = _pick_rac_site(rollout, ra)
    if site is not None:
        x = ra[site].to(torch.bfloat16)
        rec = rollout.quant[site]
        spec = rec.act_spec if rec.act_spec is not None else NVFP4_ACT
        amaxes, static_ch = graph_constants(rollout)
        act_amax = amaxes.get(site) if spec.global_source == "static" else None
        resid = activation_residual(x, spec, act_amax=act_amax, site=site)[2]
        # the channels RAC uses: the calibrated ones (selection: static), else the pick on this batch
        # (qpass.quant.rac.static_channels of these tokens: what selection batch takes on one forward)
        ch = None
        if rec.rac:
            ch = static_ch.get(site) if rec.rac.selection == "static" else \
                static_channels(x, rec.rac.ratio, act_spec=spec, act_amax=act_amax, site=site)
        diag["residual_site"] = site
        diag["residual_channel_l2_top8"] = torch.topk(residual_channel_map(x).l2, 8).indices.tolist()
    ph.advance(note="plots")
    plot_activation_mismatch(rel, tmp / "activation_mismatch.png", f"{recipe.name}: per-site input mismatch (rollout prefill vs learner)")
    plots["activation_mismatch"] = "activation_mismatch.png"
    if site is not None:
        plot_residual_heatmap(resid, ch, tmp / "residual_heatmap.png", f"{site}: NVFP4 activation residual |X - DQ(Q(X))|")
        plots["residual_heatmap"] = "residual_heatmap.png"
    plot_gap_histogram(gap.d, floor.d if floor else None, tmp / "logprob_gap_hist.png", f"{recipe.name}: log-prob gap per token")
    plots["logprob_gap_hist"] = "logprob_gap_hist.png"
    ph.advance()
    return plots


def build_apply_parser(prog: str = "qpass apply") -> argparse.ArgumentParser:
    """The ``qpass apply`` argument parser (shared flags from :mod:`qpass.apps.cliutil`)."""
    from qpass.apps.cliutil import DefaultsHelpFormatter, add_force, add_rollout_engine, add_threads, add_verbose, pos_int, seed_int

    ap = Parser(prog=prog, description="Apply a recipe: learner graph + rollout graph + parity report",
                                 formatter_class=DefaultsHelpFormatter)
    ap.add_argument("recipe", help="recipe YAML path or built-in name (see `qpass recipes`)")
    ap.add_argument("--out", required=True, type=Path, help="output directory (written atomically, reserved from the start)")
    add_common_args(ap)
    from qpass.compiler.recipe import LogprobGapCheck

    gap = LogprobGapCheck.model_fields

    def recipe_default(field: str) -> str:
        return f"(default: the recipe's logprob_gap value, {gap[field].default} where it sets none; validated by its schema)"

    ap.add_argument("--prompts", type=int, help=f"probe prompts {recipe_default('prompts')}")
    ap.add_argument("--samples", type=int, help=f"samples per prompt {recipe_default('samples_per_prompt')}")
    ap.add_argument("--max-new-tokens", type=int, help=f"response tokens per sample {recipe_default('max_new_tokens')}")
    ap.add_argument("--seed", type=seed_int, help=f"sampling seed {recipe_default('seed')}")
    ap.add_argument("--batch-size", type=pos_int, default=16, help="static rollout batch (rows per generate call)")
    ap.add_argument("--no-floor", action="store_true", help="skip the BF16 engine-drift floor")
    ap.add_argument("--no-behavioral", action="store_true", help="skip sampling (structural and bit-level checks only)")
    ap.add_argument("--no-save-learner", action="store_true", help="do not write the learner state (~270 MB for the default model)")
    ap.add_argument("--no-debug", action="store_true", help="skip the graph verifier after every pass")
    add_force(ap, "report.json")
    add_threads(ap)
    add_verbose(ap)
    add_rollout_engine(ap)
    from qpass.apps.calibrate import add_calibration_arg

    add_calibration_arg(ap, "copied into DIR/calibration")
    return ap


def main_apply(argv: list[str] | None = None) -> int:
    a = build_apply_parser().parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    o = ApplyOptions(model=a.model, device=a.device, dtype=a.dtype, kernels=a.kernels, prompts=a.prompts, samples=a.samples,
                     max_new_tokens=a.max_new_tokens, seed=a.seed, batch_size=a.batch_size, floor=not a.no_floor,
                     behavioral=not a.no_behavioral, save_learner=not a.no_save_learner, debug=not a.no_debug, force=a.force,
                     rollout_engine=a.rollout_engine, calibration=a.calibration)
    from qpass.apps.progress import command_progress

    with command_progress():
        status, _ = run_apply(a.recipe, a.out, o)
    return status


from qpass.apps.check import main_check, run_check  # noqa: E402 - re-exported (check imports options, not apply)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main_apply())
