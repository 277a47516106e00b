"""``qpass check DIR|RECIPE``: re-verify saved artifacts of ``qpass apply``, or a recipe on fresh graphs.

For a saved ``DIR``, in order (each stage fails before the slower next one; :mod:`qpass.apps.integrity`):

1. ``report.json`` is read and the safetensors headers it lists (a missing or corrupt file is exit 2);
2. ``report.json``'s own content digest, the sha256 of every file it lists, and that every file this
   command reads is listed (seconds, no model): a flipped byte in any artifact, or an edit of the
   report itself, fails here (exit 1), naming the file (``--no-checksums`` skips this stage to get the
   site-level diagnosis of stage 4);
3. the files agree with each other (with or without ``--no-checksums``): the recipe copy
   ``rollout/recipe.yaml`` equals the report's recipe text and name, ``rollout/hf_quant_config.json``
   parses and names the report's qpass version, the model files recorded at apply time are unchanged;
4. both graphs are rebuilt from the saved recipe; the learner state is loaded (every parameter must
   be in the file, every tensor of the file must be a parameter); the rollout constants a fresh
   quantization of those master weights gives are compared with **every** tensor of
   ``rollout/weights.safetensors`` (codes, block scales, ``S_dec``, ``S_enc``, static RAC channels;
   missing or extra tensors named); ``rollout/hf_quant_config.json`` is compared with the rebuilt
   rollout's config (per site kind, specs, group, RAC options: e.g. an edited RAC ratio is named) and
   the report's site counts with the rebuilt graphs';
5. the saved rollout bytes are loaded into the rollout graph and the parity checks of
   :mod:`qpass.apps.parity_checks` run on it (the same registry ``qpass apply`` runs), naming the
   site and fused group of any difference.

A calibration (``DIR/calibration``, written by ``qpass apply --calibration``; or ``--calibration CAL``)
is verified before the model loads (its own checksums and consistency,
:func:`qpass.calibration.record.load_calibration`; with a ``DIR`` also that it is the one
``report.json`` recorded, and its files are among those stage 2 checks), then against the loaded
model's weights, and the rollout is rebuilt from it; stage 4 then compares the saved static
constants too, and :func:`calibration_problems` names every site whose saved ``rac_channels`` /
``input_amax`` are not exactly the calibration's.

For a recipe, stages 4-5 run on freshly built graphs (no files).
"""

from __future__ import annotations

import argparse

from qpass.apps.cliutil import Parser
import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from qpass.apps.artifacts import (
    compare_tensors,
    load_learner_into,
    load_rollout_into,
    read_tensors,
    rollout_tensors,
    write_json,
)
from qpass.apps.console import console, print_check_problems
from qpass.apps.integrity import consistency_problems, open_apply_dir, rebuilt_problems, verify_files
from qpass.apps.options import ApplyOptions, add_common_args
from qpass.apps.parity_checks import BehaviorProbe, CheckContext, run_checks
from qpass.apps.report import site_counts
from qpass.apps.validate import check_model_ref, check_report_fields
from qpass.errors import QpassError, RecipeError
from qpass.progress import phase
from qpass.compiler.recipe import load_recipe, parse_recipe

__all__ = ["build_check_parser", "main_check", "run_check"]


def _check_report(rep: dict[str, Any], where: str) -> None:
    """The report fields ``qpass check`` needs before its model load (run by :func:`open_apply_dir`
    right after reading ``report.json``): missing keys, then their types (:func:`check_report_fields`)."""
    try:
        rep["recipe"]["text"], rep["parity"]["probe"]["rollout_batch"], rep["parity"]["probe"]["max_len"]  # noqa: B018
    except (KeyError, TypeError) as exc:
        raise QpassError(f"{where} is not a readable qpass report ({type(exc).__name__}: {exc})") from exc
    check_report_fields(rep, where)


def _check_calibration(path: Path | None, saved: bool, rep: dict[str, Any], o: ApplyOptions) -> Any:
    """The calibration a check uses (None: none): ``--calibration`` or the apply output's copy, verified.

    Raises:
        CalibrationError: unreadable / tampered files, or a ``DIR/calibration`` that is not the one
            ``report.json`` recorded (exit 2).
    """
    from qpass.apps.calibrate import load_for_model
    from qpass.calibration.source import CalibrationError

    rec = (rep.get("artifacts") or {}).get("calibration") if saved else None
    if o.calibration is not None:
        cal = load_for_model(o.calibration, None)
        if rec and cal.meta.get("sha256") != rec.get("sha256"):
            raise CalibrationError(f"--calibration {o.calibration} is not the calibration {path} was applied with "
                                   f"(sha256 {str(cal.meta.get('sha256'))[:12]}..., report.json records {str(rec.get('sha256'))[:12]}...)")
        return cal
    if not rec:
        return None
    cal = load_for_model(path / rec.get("dir", "calibration"), None, flag=f"{path}/calibration")
    if cal.meta.get("sha256") != rec.get("sha256"):
        raise CalibrationError(f"{path}/calibration: its sha256 differs from the one report.json records (a different calibration)")
    return cal


def calibration_problems(cal: Any, saved: dict[str, Any], what: str) -> list[str]:
    """Sites whose saved calibrated constants are not exactly ``cal``'s: ``<site>.rac_channels`` (the
    file's channels) and ``<site>.input_amax`` (the file's group amax, bit for bit)."""
    problems = []
    for key, t in sorted(saved.items()):
        site, _, name = key.rpartition(".")
        if name == "rac_channels":
            e = cal.rac.get(site)
            if e is None or not torch.equal(e.channels, t):
                problems.append(f"{what}: {key} are not the static RAC channels of {cal.name}")
        elif name == "input_amax":
            if site not in cal.amax or not torch.equal(cal.group_amax(site).view(torch.int32), t.float().reshape(()).view(torch.int32)):
                problems.append(f"{what}: {key} is not the calibrated group amax of {cal.name}")
    return problems


@dataclasses.dataclass
class _Target:
    """What ``qpass check`` rebuilds and compares: the recipe, the model and probe shape, the
    calibration; for a saved directory also the opened output (``apply_dir``, its ``artifacts``)."""

    recipe: Any
    model: str
    bsz: int
    max_len: int
    cal: Any
    apply_dir: Any = None
    arts: dict[str, Any] = dataclasses.field(default_factory=dict)


def run_check(target: str, o: ApplyOptions, *, behavioral: bool = False, pipeline: Any = None,
              checksums: bool = True) -> tuple[int, dict[str, Any]]:
    """``qpass check DIR`` (saved artifacts) or ``qpass check RECIPE`` (fresh graphs, no outputs).

    Returns (exit status, result): 0 every comparison passed, 1 a comparison failed (the result's
    ``failures`` name the file, tensor or site).

    Args:
        pipeline: reuse a captured :class:`qpass.compiler.pipeline.Pipeline` (tests).
        checksums: compare the files with the sha256 sums in ``report.json`` first (and stop there
            on a difference).
    Raises:
        QpassError: ``target`` is neither an output directory nor a recipe; unreadable report;
            missing, truncated or inconsistent artifact files (exit 2).
    """
    con = console()
    path = _checked_target_path(target, o, pipeline)
    saved = path.is_dir()
    result: dict[str, Any] = {"target": target}
    if saved:
        t = _open_saved(path, target, o, pipeline, checksums, con, result)
        if isinstance(t, tuple):  # the files differ from what apply wrote, or from each other
            return t
    else:
        t = _recipe_target(target, o)
    result["recipe"] = t.recipe.name
    if t.cal is not None:
        result["calibration"] = t.cal.summary()
    loaded: dict[str, int] = {}
    pipe, learner, rollout, failures = _rebuild_and_compare(t, path, o, pipeline, result, loaded)
    result["loaded"] = loaded
    if saved:
        con.print(f"loaded from {path}: " + (", ".join(f"{v} {k.replace('_', ' ')}" for k, v in loaded.items())
                                             or "no tensors (the recipe quantizes nothing; graphs rebuilt only)"))
        print_check_problems(con, "tensor", failures)
    names = _parity_names(t.recipe, learner, behavioral, o.rollout_engine)
    with contextlib.ExitStack() as engines:
        engine = None
        if o.rollout_engine == "vllm":
            engine = engines.enter_context(_vllm_engine(pipe, learner, rollout, o, t.bsz, t.max_len))
        ctx = CheckContext(t.recipe, learner, rollout, probe=_probe(pipe, t.bsz, t.max_len) if behavioral else None, engine=engine)
        results = list(run_checks(ctx, names))
    result["rollout_engine"] = o.rollout_engine
    for r in results:
        result.update(r.fields)
        if r.ok is False:
            failures += list(r.problems)
            print_check_problems(con, r.name, r.problems)
            if r.name == "weights_bitexact" and "learner_tensors" in loaded:
                con.print("the rollout bytes were compared with a fresh quantization of the saved learner master "
                          "weights: a changed byte in either file shows up here (most codes of a site differing "
                          "usually means the learner state changed)")
    result["failures"] = failures
    result["ok"] = ok = not failures
    con.print(f"qpass check {target}: {'[green]pass[/]' if ok else '[red]FAIL[/]'}")
    return (0 if ok else 1), result


def _checked_target_path(target: str, o: ApplyOptions, pipeline: Any) -> Path:
    """``target`` as a path, after the checks that need no file read.

    Raises:
        QpassError: a directory without ``report.json``; a missing path that is not a recipe name;
            a bad ``--model`` reference.
    """
    path = Path(target)
    if pipeline is None and o.model != "default":
        check_model_ref(o.model)
    if path.is_dir() and not (path / "report.json").is_file():
        raise QpassError(f"{path} is not a `qpass apply` output directory (no report.json); "
                         "qpass check takes such a directory or a recipe")
    if not path.exists() and os.sep in target and not target.endswith((".yaml", ".yml")):
        raise QpassError(f"{path} does not exist; qpass check takes a `qpass apply` output directory or a recipe")
    return path


def _open_saved(path: Path, target: str, o: ApplyOptions, pipeline: Any, checksums: bool, con: Any,
                result: dict[str, Any]) -> _Target | tuple[int, dict[str, Any]]:
    """Open and verify a saved output directory (every file this command reads is verified before
    the slow model load, :mod:`qpass.apps.integrity`): the :class:`_Target` to rebuild, or the
    final ``(1, result)`` when the files differ from their checksums or from each other.

    Raises:
        QpassError: a missing or corrupt file, an unreadable report (exit 2).
    """
    apply_dir = open_apply_dir(path, check=_check_report)
    rep = apply_dir.report
    probe = rep["parity"]["probe"]
    bsz, max_len = probe["rollout_batch"], probe["max_len"]  # positive ints (check_report_fields)
    if checksums:
        problems, notes = verify_files(apply_dir)
        for n in notes:
            con.print(f"checksums: {n}")
        result["checksums_ok"] = not problems
        if problems:
            print_check_problems(con, "checksum", problems)
            con.print(f"qpass check {target}: [red]FAIL[/] (files differ from what qpass apply wrote; "
                      "--no-checksums rebuilds the graphs to name the sites)")
            return 1, result | {"recipe": rep["recipe"].get("name"), "ok": False, "failures": problems}
        if apply_dir.sums:
            con.print(f"checksums: {len(apply_dir.sums)} files and report.json's own digest match")
    model = o.model if o.model != "default" else (rep.get("model") or {}).get("ref") or "default"
    if pipeline is None:
        check_model_ref(model, "--model" if o.model != "default" else f"{path / 'report.json'} model.ref")
    problems = consistency_problems(apply_dir, model_ref=None if pipeline is not None else model)
    result["consistent"] = not problems
    if problems:
        print_check_problems(con, "consistency", problems)
        con.print(f"qpass check {target}: [red]FAIL[/] (the apply's files disagree with each other)")
        return 1, result | {"recipe": rep["recipe"].get("name"), "ok": False, "failures": problems}
    recipe = parse_recipe(apply_dir.recipe_text, str(path / "rollout" / "recipe.yaml"))
    cal = _check_calibration(path, True, rep, o)
    return _Target(recipe, model, bsz, max_len, cal, apply_dir=apply_dir, arts=apply_dir.artifacts)


def _recipe_target(target: str, o: ApplyOptions) -> _Target:
    """A recipe name or file to build fresh (probe batch 4, length 64).

    Raises:
        RecipeError: no such recipe (the message says what ``qpass check`` takes) or a bad one.
    """
    try:
        recipe = load_recipe(target)
    except RecipeError as exc:
        if "not found" in str(exc):
            raise RecipeError(f"{exc} (qpass check takes a `qpass apply` output directory or a recipe)") from exc
        raise
    return _Target(recipe, o.model, 4, 64, _check_calibration(None, False, {}, o))


def _rebuild_and_compare(t: _Target, path: Path, o: ApplyOptions, pipeline: Any, result: dict[str, Any],
                         loaded: dict[str, int]) -> tuple[Any, Any, Any, list[str]]:
    """Rebuild both graphs under ``o.kernels``, load the saved learner state and compare (then load)
    every saved rollout tensor, and compare the saved quantization config with the rebuilt graphs.

    Returns ``(pipeline, learner, rollout, failures)``; fills ``loaded`` (tensor counts) and
    ``result["compared"]``.
    """
    from qpass.apps.plugins import load_backends
    from qpass.ops import use_kernels
    from qpass.compiler.pipeline import Pipeline

    failures: list[str] = []
    cal = t.cal
    load_backends([o.kernels])
    with use_kernels(o.kernels):  # phases: load + capture, the passes of each side, the re-quantization
        pipe = pipeline or Pipeline.prepare(t.model, dtype=o.dtype, device=o.device, batch_size=t.bsz, max_len=t.max_len)
        if cal is not None:
            cal.check_model(pipe.loaded.model)
        learner, rollout = pipe.build(t.recipe, debug=True, calibration=cal)
        if t.arts.get("learner"):
            with phase("load the saved learner state"):
                loaded["learner_tensors"] = load_learner_into(learner, path / "learner" / "model.safetensors")
        if t.arts.get("rollout", {}).get("weights"):
            from qpass.runtime import sync_weights

            sync_weights(learner, rollout)  # what the saved (or fresh) masters quantize to
            with phase("compare and load every saved rollout tensor"):
                saved_tensors = read_tensors(path / "rollout" / "weights.safetensors")
                tensor_problems = compare_tensors(rollout_tensors(rollout), saved_tensors, "rollout/weights.safetensors")
                if cal is not None:
                    tensor_problems += calibration_problems(cal, saved_tensors, "rollout/weights.safetensors")
                result["compared"] = {"rollout_tensors": len(saved_tensors)}
                failures += tensor_problems
                loaded["rollout_tensors"] = load_rollout_into(rollout, path / "rollout" / "weights.safetensors")
        if t.apply_dir is not None:  # the quantization config and the report's site counts vs the rebuilt graphs
            failures += rebuilt_problems(t.apply_dir, rollout, site_counts(learner, rollout))
    return pipe, learner, rollout, failures


def _parity_names(recipe: Any, learner: Any, behavioral: bool, rollout_engine: str) -> list[str]:
    """The parity checks to run, in order: the recipe's (its ``logprob_gap`` only when
    ``behavioral``), plus ``weights_bitexact`` for a learner QDQ recipe and first for the vLLM engine."""
    names = [c.check for c in recipe.parity if c.check != "logprob_gap"]
    if "weights_bitexact" not in names and any(r.weight_fake_quant for r in learner.quant.values()):
        names.append("weights_bitexact")  # a learner QDQ recipe is always re-verified bit for bit
    if behavioral:
        names.append("logprob_gap")
    if rollout_engine == "vllm" and "weights_bitexact" not in names:
        names.insert(0, "weights_bitexact")
    return names


@contextlib.contextmanager
def _vllm_engine(pipe: Any, learner: Any, rollout: Any, o: ApplyOptions, bsz: int, max_len: int) -> Any:
    """A vLLM engine serving ``rollout``'s quantization of the learner's master weights (exported from
    the model, then updated to the learner's masters through the engine's own weight update)."""
    from qpass.apps.engines import vllm_rollout
    from qpass.compiler.pipeline import DTYPES
    from qpass.prompts import encode_chat, probe_prompts
    from qpass.runtime.graph_engine import graph_weights

    with vllm_rollout(pipe.loaded.model, pipe.tokenizer, DTYPES[o.dtype], rollout=rollout,
                      calibration_ids=encode_chat(pipe.tokenizer, probe_prompts(4)), batch_size=bsz, max_len=max_len) as eng:
        eng.update_weights(graph_weights(learner))
        yield eng


def _probe(pipe: Any, bsz: int, max_len: int) -> BehaviorProbe:
    from qpass.prompts import encode_chat, probe_prompts

    prompts = encode_chat(pipe.tokenizer, probe_prompts(min(bsz, 8)))
    room = max_len - max(len(p) for p in prompts) - 1
    if room < 1:
        raise QpassError(f"the saved probe's KV cache ({max_len} slots) has no room for a response")
    return BehaviorProbe(prompts, dict(pad_token_id=pipe.tokenizer.pad_token_id, eos_token_id=pipe.tokenizer.eos_token_id,
                                       max_new_tokens=min(16, room)))


def build_check_parser(prog: str = "qpass check") -> argparse.ArgumentParser:
    """The ``qpass check`` argument parser (shared flags from :mod:`qpass.apps.cliutil`)."""
    from qpass.apps.cliutil import DefaultsHelpFormatter, add_rollout_engine, add_threads, add_verbose

    ap = Parser(prog=prog, description="Verify learner/rollout parity of saved artifacts (DIR) or of a recipe",
                                 formatter_class=DefaultsHelpFormatter)
    ap.add_argument("target", help="an output DIR of `qpass apply`, or a recipe")
    add_common_args(ap)
    ap.add_argument("--behavioral", action="store_true", help="also sample and measure the log-prob gap")
    ap.add_argument("--no-checksums", action="store_true", help="skip the sha256 comparison with report.json "
                    "(to rebuild the graphs and name the sites of a change)")
    ap.add_argument("--json", type=Path, help="write the check result as JSON here (default: none written)")
    add_rollout_engine(ap)
    from qpass.apps.calibrate import add_calibration_arg

    add_calibration_arg(ap, "DIR: default DIR/calibration; must be the one DIR was applied with")
    add_threads(ap)
    add_verbose(ap)
    return ap


def main_check(argv: list[str] | None = None) -> int:
    a = build_check_parser().parse_args(argv)
    if a.json:
        from qpass.atomic import check_output_file

        check_output_file(a.json, "--json")  # before the check, not after it
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    o = ApplyOptions(model=a.model, device=a.device, dtype=a.dtype, kernels=a.kernels, rollout_engine=a.rollout_engine,
                     calibration=a.calibration)
    from qpass.apps.progress import command_progress

    with command_progress():
        status, result = run_check(a.target, o, behavioral=a.behavioral, checksums=not a.no_checksums)
    if a.json:
        write_json(a.json, result)
    return status
