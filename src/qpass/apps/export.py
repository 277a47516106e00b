"""``qpass export``: a standalone Hugging Face checkpoint directory from an apply output or a (recipe, model).

Sources (what the tensors come from):

* an apply output ``DIR`` (holds ``report.json``): the quantized bytes of ``DIR/rollout/weights.safetensors``
  (what the rollout graph served), the site list / fused groups / activation mode / RAC of
  ``DIR/rollout/hf_quant_config.json``, the master weights of ``DIR/learner/model.safetensors``
  (else the model itself), the config and tokenizer of the model ``report.json`` names
  (``model.ref``; ``--model`` overrides it).
* ``--recipe R --model M``: the model is loaded and captured, the recipe's rollout passes are run
  (:meth:`qpass.pipeline.Pipeline.build_side`), and the rollout graph's constants are exported.
* ``--model M`` alone (or ``SRC`` a model): the model unquantized (``--format plain``).

W4A4 sites get a static ``input_scale`` calibrated on ``--calibration-prompts`` built-in probe
prompts (chat-templated), shared per fused group (:mod:`qpass.checkpoint.calibrate`).

The directory is written atomically (:func:`qpass.atomic.atomic_dir`): an existing ``--out`` is
refused unless ``--force`` and it is empty or a previous export (holds ``qpass_export.json``, the
record of what was exported from where); an interrupted export leaves nothing. Formats and their
tensors: :mod:`qpass.checkpoint.formats`; files: :mod:`qpass.checkpoint.hfdir`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from qpass import __version__
from qpass.atomic import atomic_dir
from qpass.checkpoint.export import ACT_OF_SPEC, sites_from_rollout, write_checkpoint
from qpass.checkpoint.formats import CHECKPOINT_FORMATS, GLOBAL_SCALE_RULES, RolloutSite, weight_arithmetic
from qpass.checkpoint.hfdir import DEFAULT_MAX_SHARD_SIZE
from qpass.errors import QpassError
from qpass.jsonio import write_json
from qpass.progress import phase
from qpass.quant.rac import RACConfig

log = logging.getLogger(__name__)

RECORD = "qpass_export.json"
DEFAULT_CALIBRATION_PROMPTS = 8

__all__ = ["RECORD", "build_export_parser", "export_checkpoint", "main_export"]


# ----------------------------------------------------------------------------- sources


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise QpassError(f"{path} is missing ({what})")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise QpassError(f"{path} is not readable JSON ({what}): {exc}") from exc
    if not isinstance(data, dict):
        raise QpassError(f"{path}: expected a JSON object ({what})")
    return data


def is_apply_dir(p: Path) -> bool:
    """An apply output: a directory holding ``report.json`` or ``rollout/``."""
    return p.is_dir() and ((p / "report.json").is_file() or (p / "rollout").is_dir())


def sites_from_quant_config(cfg: dict[str, Any], source: Path) -> dict[str, RolloutSite]:
    """The NVFP4 rollout sites an apply's ``hf_quant_config.json`` records (``sites``: NVFP4-weight sites;
    ``act_only_sites``: activation-only sites of the ``act_qdq`` pass, ``weight="none"``).

    Raises:
        QpassError: a malformed file, or a quantized site that is not NVFP4 (FP8 / MXFP4 have no
            checkpoint format here), naming ``source`` and the site.
    """
    try:
        q = cfg["quantization"]
        sites, rac = q.get("sites") or {}, q.get("rac") or {}
        out = {}
        for s, d in sites.items():
            if d["kind"] != "nvfp4_linear":
                raise QpassError(f"{source}: site {s} is {d['kind']}; qpass export writes NVFP4 checkpoints only")
            if d.get("act_spec") not in ACT_OF_SPEC:
                raise QpassError(f"{source}: site {s} has an unknown activation spec {d.get('act_spec')!r}")
            r = rac.get(s)
            wkey = d.get("weight_spec") or ""
            out[s] = RolloutSite(s, d["group"], ACT_OF_SPEC[d.get("act_spec")],
                                 RACConfig(float(r["ratio"]), r["mode"], r["selection"]) if r else None,
                                 "modelopt" if wkey.endswith(".modelopt") else "te_reference")
        for s, d in (q.get("act_only_sites") or {}).items():
            if s in out:
                raise QpassError(f"{source}: site {s} is both NVFP4-quantized and activation-only")
            if d.get("act_spec") not in ACT_OF_SPEC or d.get("act_spec") is None:
                raise QpassError(f"{source}: activation-only site {s} has an unknown activation spec {d.get('act_spec')!r}")
            out[s] = RolloutSite(s, d["group"], ACT_OF_SPEC[d["act_spec"]], None, weight="none")
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, QpassError):
            raise
        raise QpassError(f"{source}: not a qpass rollout quantization config ({type(exc).__name__}: {exc})") from exc
    return out


def _load_masters_into(model: torch.nn.Module, path: Path) -> int:
    """Load ``learner/model.safetensors`` (HF names) into the HF model; a tied head may be absent.

    Raises:
        QpassError: unreadable file, a tensor the model does not have, or a parameter missing.
    """
    from qpass.apps.artifacts import read_tensors

    data = read_tensors(path)
    want = model.state_dict()
    extra = sorted(set(data) - set(want))
    if extra:
        raise QpassError(f"{path}: {len(extra)} tensor(s) the model has no parameter for: {extra[:5]}")
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = sorted(k for k in set(want) - set(data) if not (tied and k == "lm_head.weight"))
    if missing:
        raise QpassError(f"{path}: missing {len(missing)} model tensor(s): {missing[:5]}")
    for k, t in data.items():
        if t.shape != want[k].shape:
            raise QpassError(f"{path}: {k} has shape {tuple(t.shape)}, the model has {tuple(want[k].shape)}")
    model.load_state_dict(data, strict=False)
    if tied:
        model.tie_weights()
    return len(data)


def _calibration_ids(tokenizer: Any, n: int) -> list[list[int]]:
    from qpass.prompts import encode_chat, probe_prompts

    if tokenizer is None:
        raise QpassError("input_scale calibration needs the model's tokenizer (W4A4 sites)")
    try:
        return encode_chat(tokenizer, probe_prompts(n))
    except ValueError as exc:
        raise QpassError(f"--calibration-prompts {n}: {exc}") from exc


# ----------------------------------------------------------------------------- export


def export_checkpoint(
    out: str | Path,
    fmt: str = "qpass",
    *,
    src: str | Path | None = None,
    model: str | None = None,
    recipe: str | None = None,
    dtype: str | None = None,
    force: bool = False,
    calibration_prompts: int = DEFAULT_CALIBRATION_PROMPTS,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    global_scale: str | None = None,
) -> dict[str, Any]:
    """Write a checkpoint directory ``out`` of format ``fmt`` (module docstring). Returns the record.

    Args:
        src: an apply output directory, or a model reference (``default``, HF dir, ``.gguf``).
        model: the model (with ``recipe``, or overriding the one an apply dir's report names).
        recipe: a recipe name/path: build its rollout side on ``model`` and export that.
        dtype: ``bf16`` | ``fp16`` | ``fp32`` for the unquantized tensors (default: the apply's
            dtype, else bf16).
        global_scale: ``te_reference`` | ``modelopt``: require the weight bytes to follow that
            arithmetic (``weight_scale_2 = fl(1/fl(2688/amax))`` resp. ModelOpt's ``fl(amax/2688)``);
            the arithmetic is the recipe's (``arithmetic:`` of weight_qdq and the NVFP4 lowering), so
            learner QDQ and rollout bytes agree. None: whatever the source has (recorded either way).
    Raises:
        QpassError: bad output path (an existing non-export directory, a symlink ...), a missing or
            corrupt apply file (named), unknown format, a non-NVFP4 rollout, and the format's checks.
    """
    from qpass.atomic import check_output_path
    from qpass.graph.model import load_model
    from qpass.pipeline import DTYPES

    out = Path(out)
    if global_scale not in (None, *GLOBAL_SCALE_RULES):
        raise QpassError(f"--global-scale must be one of {sorted(GLOBAL_SCALE_RULES)}, got {global_scale!r}")
    if fmt not in CHECKPOINT_FORMATS:
        raise QpassError(f"unknown --format {fmt!r}; known: {sorted(CHECKPOINT_FORMATS)}")
    check_output_path(out, force=force, marker=RECORD)  # before any model load
    if src is not None and model is not None and not is_apply_dir(Path(src)):
        raise QpassError(f"give the model once: SRC {src!r} or --model {model!r}")
    apply_dir = Path(src) if src is not None and is_apply_dir(Path(src)) else None
    model_ref = model or (None if apply_dir is not None else (str(src) if src is not None else None))
    record: dict[str, Any] = {"format": fmt, "qpass_version": __version__}
    sites: dict[str, RolloutSite] = {}
    site_tensors: dict[str, torch.Tensor] = {}
    masters = None
    if apply_dir is not None:
        if recipe is not None:
            raise QpassError(f"{apply_dir} is an apply output (its recipe is fixed); --recipe applies to --model only")
        report = _read_json(apply_dir / "report.json", "the apply report")
        qcfg_path = apply_dir / "rollout" / "hf_quant_config.json"
        qcfg = _read_json(qcfg_path, "the rollout quantization config")
        m = report.get("model") or {}
        model_ref = model_ref or m.get("ref")
        if not model_ref:
            raise QpassError(f"{apply_dir / 'report.json'} names no model (model.ref); pass --model")
        dtype = dtype or m.get("dtype") or "bf16"
        if fmt != "plain":
            sites = sites_from_quant_config(qcfg, qcfg_path)
            if any(r.weight == "nvfp4" for r in sites.values()):  # activation-only sites have no rollout bytes
                from qpass.apps.artifacts import read_tensors

                site_tensors = read_tensors(apply_dir / "rollout" / "weights.safetensors")
        masters = apply_dir / "learner" / "model.safetensors"
        record.update(source={"apply_dir": str(apply_dir), "recipe": (report.get("recipe") or {}).get("name")})
        if not masters.is_file():
            log.warning("%s has no learner state; the unquantized tensors come from the model %s", apply_dir, model_ref)
            masters = None
    elif model_ref is None:
        raise QpassError("nothing to export: give an apply output DIR, a model (SRC or --model), or --recipe R --model M")
    dtype = dtype or "bf16"
    if dtype not in DTYPES:
        raise QpassError(f"--dtype must be one of bf16, fp16, fp32; got {dtype!r}")
    tdtype = DTYPES[dtype]
    build = apply_dir is None and recipe is not None and fmt != "plain"
    with phase(f"export ({fmt})", total=2 + (masters is not None) + build, unit="step") as ph:
        ph.advance(0, note=f"load {model_ref}")
        lm = load_model(model_ref, dtype=tdtype)
        ph.advance(note="model loaded")
        if masters is not None:
            record["masters"] = {"file": str(masters), "tensors": _load_masters_into(lm.model, masters)}
            ph.advance(note="master weights loaded")
        if apply_dir is None:
            record["source"] = {"model": model_ref, "recipe": recipe}
            if build:
                sites, site_tensors = _build_rollout(lm, recipe)
                ph.advance(note="rollout built")
        return _export_write(out, fmt, record, lm, dtype, tdtype, model_ref, sites, site_tensors, apply_dir, masters, force,
                             calibration_prompts, max_shard_size, global_scale, ph)


def _export_write(out: Path, fmt: str, record: dict[str, Any], lm: Any, dtype: str, tdtype: torch.dtype, model_ref: str,
                  sites: dict[str, RolloutSite], site_tensors: dict[str, torch.Tensor], apply_dir: Path | None,
                  masters: Path | None, force: bool, calibration_prompts: int, max_shard_size: int | str,
                  global_scale: str | None, ph: Any) -> dict[str, Any]:
    """The write step of :func:`export_checkpoint` (calibration, format, files) and what the export carries."""
    record["model"] = {"ref": model_ref, "name": lm.name, "dtype": dtype}
    arithmetic = weight_arithmetic(sites)
    if global_scale is not None and sites and global_scale != arithmetic:
        raise QpassError(
            f"--global-scale {global_scale}: the rollout's weight bytes follow the {arithmetic} arithmetic; a checkpoint "
            f"cannot carry other global scales than the codes were quantized with. Use a recipe whose weight_qdq and "
            f"w4a4_lower/w4a16_lower set `arithmetic: {global_scale}` (learner and rollout alike, so parity holds)")
    ids = _calibration_ids(lm.tokenizer, calibration_prompts) if fmt != "plain" and any(r.needs_input_scale for r in sites.values()) else None
    ph.advance(0, note="calibrate, convert and write the files" if ids else "convert and write the files")
    with atomic_dir(out, force=force, marker=RECORD) as tmp:
        summary = write_checkpoint(tmp, fmt, model=lm.model, dtype=tdtype, tokenizer=lm.tokenizer, sites=sites, site_tensors=site_tensors,
                                   calibration_ids=ids, max_shard_size=max_shard_size)
        if "calibration" in summary:
            summary["calibration"]["source"] = f"{calibration_prompts} qpass probe prompts (chat template)"
        record.update(summary, global_scale_convention=GLOBAL_SCALE_RULES[arithmetic] if sites else None)
        record["carried"] = export_contents(fmt, sites, apply_dir=apply_dir, masters=masters, model_ref=model_ref, dtype=dtype,
                                            calibration=summary.get("calibration"))
        write_json(tmp / RECORD, record)
    ph.advance(note="written")
    return record


def export_contents(fmt: str, sites: dict[str, RolloutSite], *, apply_dir: Path | None, masters: Path | None, model_ref: str,
                    dtype: str, calibration: dict[str, Any] | None = None) -> dict[str, Any]:
    """What an export wrote and what its format could not carry (``qpass_export.json["carried"]``, and
    the console lines of ``qpass export``).

    Returns ``{"weights": str, "not_carried": [str, ...], "notes": [str, ...]}``: ``weights`` says which
    tensors the checkpoint's linear weights are (the rollout's NVFP4 bytes, or the unquantized masters —
    never the learner's fake-quantized weights); ``not_carried`` names each part of the recipe the
    format drops (empty: nothing); ``notes`` what a reader should know besides.
    """
    src = f"{masters}" if masters is not None else f"the model {model_ref!r}"
    nvfp4 = {s: r for s, r in sites.items() if r.weight == "nvfp4"}
    act_only = [s for s, r in sites.items() if r.weight == "none"]
    rac = sorted(s for s, r in sites.items() if r.rac is not None)
    w4a4 = [s for s, r in nvfp4.items() if r.needs_input_scale]
    out: list[str] = []
    notes: list[str] = []
    if fmt == "plain":
        weights = (f"unquantized {dtype} master weights from {src} (what the learner trains; NOT the NVFP4 fake-quantized weights "
                   "its forward computes with, and not the rollout's bytes)")
        if apply_dir is not None:
            out.append(f"the recipe's quantization of {apply_dir} (its NVFP4 rollout sites, activation quantization and RAC): "
                       "--format plain writes no quantization; use --format qpass or modelopt for the rollout's bytes")
        return {"weights": weights, "not_carried": out, "notes": notes}
    where = f"{apply_dir}/rollout/weights.safetensors" if apply_dir is not None else "the rollout built from the recipe"
    weights = (f"{len(nvfp4)} NVFP4 linear(s) as the rollout's bytes from {where} (E2M1 codes, E4M3 block scales, global "
               f"scale{' S_dec' if fmt != 'compressed-tensors' else ' as S_enc'}); every other tensor (embeddings, norms, "
               f"lm_head{', activation-only sites' if act_only else ''}) {dtype} from {src}")
    if fmt in ("modelopt", "compressed-tensors"):
        if rac:
            out.append(f"RAC on {len(rac)} site(s) (e.g. {rac[0]}): {fmt} has no residual compensation, so an engine serving "
                       "this checkpoint runs plain W4A4 there (qpass's rollout does not); use --format qpass to keep it")
        if w4a4:
            n = (calibration or {}).get("sequences")
            out.append(f"dynamic per-tensor activation scales on {len(w4a4)} W4A4 site(s): replaced by a static calibrated "
                       f"{'input_scale' if fmt == 'modelopt' else 'input_global_scale'}"
                       + (f" ({n} calibration prompts)" if n else ""))
    elif w4a4:
        notes.append(f"the static input_scale of the {len(w4a4)} W4A4 site(s) is written for other loaders; qpass's plugins "
                     "quantize activations dynamically (as the recipe does) and ignore it")
    return {"weights": weights, "not_carried": out, "notes": notes}


def _build_rollout(lm: Any, recipe_ref: str) -> tuple[dict[str, RolloutSite], dict[str, torch.Tensor]]:
    """Capture ``lm`` and run the recipe's rollout passes; the NVFP4 sites and their tensors."""
    from qpass.apps.artifacts import rollout_tensors
    from qpass.apps.plugins import load_backends
    from qpass.pipeline import Pipeline
    from qpass.recipe import load_recipe

    r = load_recipe(recipe_ref)
    load_backends(["reference"])
    pipe = Pipeline.prepare(loaded=lm, batch_size=1, max_len=8)
    rollout = pipe.build_side(r, "rollout", share_params=True)
    sites = sites_from_rollout(rollout)
    return sites, (rollout_tensors(rollout) if sites else {})


# ----------------------------------------------------------------------------- CLI


def build_export_parser(prog: str = "qpass export") -> argparse.ArgumentParser:
    """The ``qpass export`` argument parser."""
    from qpass.apps.cliutil import DefaultsHelpFormatter, add_force, add_threads, add_verbose, pos_int

    ap = argparse.ArgumentParser(prog=prog, description="Export a standalone Hugging Face checkpoint (formats: "
                                 + ", ".join(sorted(CHECKPOINT_FORMATS)) + ")", formatter_class=DefaultsHelpFormatter)
    ap.add_argument("src", nargs="?", help="a qpass apply output directory, or a model (default | HF dir | .gguf)")
    ap.add_argument("--out", required=True, type=Path, help="checkpoint directory to create (written atomically)")
    ap.add_argument("--format", default="qpass", choices=sorted(CHECKPOINT_FORMATS), help="checkpoint format: qpass (qpass's vLLM/SGLang plugins; carries RAC), modelopt (vLLM/SGLang modelopt_fp4: "
                    "no RAC, static input_scale), compressed-tensors (no RAC), plain (unquantized masters)")
    ap.add_argument("--model", help="the model: with --recipe, or overriding the one an apply output's report.json names "
                    "(default: the apply output's model)")
    ap.add_argument("--recipe", help="recipe name or YAML: export its rollout side built on --model (default: none, the model "
                    "unquantized)")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="dtype of the unquantized tensors (default: the apply's, else bf16)")
    ap.add_argument("--calibration-prompts", type=pos_int, default=DEFAULT_CALIBRATION_PROMPTS,
                    help="probe prompts to calibrate the W4A4 input_scale on")
    ap.add_argument("--max-shard-size", type=shard_size, default=DEFAULT_MAX_SHARD_SIZE,
                    help="split model.safetensors into shards + index above this size (e.g. 5GB, 200MB; default: 5GB)")
    ap.add_argument("--global-scale", choices=sorted(GLOBAL_SCALE_RULES),
                    help="require the weight_scale_2 convention: te_reference = qpass's S_dec = fl(1/fl(2688/amax)), modelopt = "
                         "ModelOpt's fl(amax/2688) (set by the recipe: `arithmetic: modelopt` on weight_qdq and w4a4_lower; "
                         "default: whatever the source's bytes follow, recorded)")
    add_force(ap, RECORD)
    add_threads(ap)
    add_verbose(ap)
    return ap


SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def shard_size(text: str) -> int:
    """``--max-shard-size``: bytes from ``"5GB"``, ``"200MB"``, ``"64MiB"`` or a plain integer (decimal units
    as in transformers' ``max_shard_size``)."""
    import re

    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in SIZE_UNITS or int(m.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"expected a size like 5GB, 200MB or a byte count, got {text!r}")
    return int(m.group(1)) * SIZE_UNITS[unit]


def main_export(argv: list[str] | None = None) -> int:
    a = build_export_parser().parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from qpass.apps.progress import command_progress

    with command_progress():
        rec = export_checkpoint(a.out, a.format, src=a.src, model=a.model, recipe=a.recipe, dtype=a.dtype, force=a.force,
                                calibration_prompts=a.calibration_prompts, max_shard_size=a.max_shard_size,
                                global_scale=a.global_scale)
    files = rec["files"]
    print(f"qpass export: {a.out} ({a.format}, {rec.get('quantized_sites', 0)} quantized sites, {files['tensors']} tensors, "
          f"{files['total_size'] / 1e6:.1f} MB{', sharded' if files['sharded'] else ''})")
    carried = rec.get("carried") or {}
    if carried.get("weights"):
        print(f"  weights: {carried['weights']}")
    dropped = carried.get("not_carried")
    if dropped is not None:
        print("  not carried: " + ("nothing (the format holds every part of the recipe)" if not dropped else dropped[0]))
        for line in dropped[1:]:
            print(f"  not carried: {line}")
    for line in carried.get("notes", []):
        print(f"  note: {line}")
    from qpass.apps.report import output_files

    rows = output_files(Path(a.out))
    print(f"  wrote {a.out}/ ({len(rows)} files): " + ", ".join(r[0] for r in rows))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main_export())
