"""``qpass export``: a standalone Hugging Face checkpoint directory from an apply output or a (recipe, model).

Sources (what the tensors come from):

* an apply output ``DIR`` (holds ``report.json``): the quantized bytes of ``DIR/rollout/weights.safetensors``
  (what the rollout graph served), the site list / fused groups / activation mode / RAC of
  ``DIR/rollout/hf_quant_config.json``, the master weights of ``DIR/learner/model.safetensors``
  (else the model itself), the config and tokenizer of the model ``report.json`` names
  (``model.ref``; ``--model`` overrides it).
* ``--recipe R --model M``: the model is loaded and captured, the recipe's rollout passes are run
  (:meth:`qpass.compiler.pipeline.Pipeline.build_side`), and the rollout graph's constants are exported.
* ``--model M`` alone (or ``SRC`` a model): the model unquantized (``--format plain``).

An apply output is verified before anything is read from it or written (:mod:`qpass.apps.integrity`):
the files it needs must be there and well-formed (else exit 2); ``report.json``'s own digest and the
sha256 of every file it lists must match, the recipe copy must equal the report's recipe, the model
files the report recorded must be unchanged, and (formats other than ``plain``) the rollout rebuilt
from the recipe on the saved master weights must give exactly ``hf_quant_config.json`` and every
tensor of ``rollout/weights.safetensors``; any difference is :class:`qpass.errors.IntegrityError`
(exit 1) naming the file and what differs, and no output directory is created.

W4A4 sites get a static ``input_scale`` (``S_dec`` of the fused group's input amax, SPEC §3): a
site with a static activation scale (``act_scale: static``) the one its rollout graph used (the
rollout's ``<site>.input_amax``); other sites the amax of ``--calibration CAL`` (``qpass calibrate``;
for an apply output made with a calibration, ``DIR/calibration`` by default), else calibrated here on
``--calibration-prompts`` built-in probe prompts (chat-templated). A calibration is verified first
(checksums, model weights; :mod:`qpass.calibration.record`). Static RAC channels go into the
``qpass`` format as ``<site>.rac_channels`` (:mod:`qpass.checkpoint.formats`).

The directory is written atomically (:func:`qpass.atomic.atomic_dir`): an existing ``--out`` is
refused unless ``--force`` and it is empty or a previous export (holds ``qpass_export.json``, the
record of what was exported from where); an interrupted export leaves nothing. Formats and their
tensors: :mod:`qpass.checkpoint.formats`; files: :mod:`qpass.checkpoint.hfdir`.
"""

from __future__ import annotations

import argparse

from qpass.apps.cliutil import Parser
import dataclasses
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
from qpass.apps.integrity import SEAL, consistency_problems, open_apply_dir, rebuilt_problems, verify_files
from qpass.errors import IntegrityError, QpassError
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
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
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


@dataclasses.dataclass
class _ApplySource:
    """A verified apply output directory as an export source (:func:`_read_apply_dir`)."""

    verified: Any
    model_ref: str | None
    dtype: str
    sites: dict[str, RolloutSite]
    site_tensors: dict[str, torch.Tensor]
    masters: Path | None
    cal: Any


def _read_apply_dir(apply_dir: Path, fmt: str, recipe: str | None, model_ref: str | None, record: dict[str, Any], cal: Any,
                    calibration: str | Path | None) -> _ApplySource:
    """Verify ``apply_dir`` before reading anything else (:mod:`qpass.apps.integrity`: malformed ->
    exit 2, changed -> exit 1), then read its sites, rollout tensors, masters and calibration; sets
    ``record["source"]``. ``model_ref`` (``--model``) overrides the report's; ``dtype``: the report's.

    Raises:
        QpassError: ``recipe`` given; a malformed report or one naming no model; a missing or corrupt file.
        IntegrityError: files changed since apply or inconsistent with each other.
    """
    if recipe is not None:
        raise QpassError(f"{apply_dir} is an apply output (its recipe is fixed); --recipe applies to --model only")
    verified = open_apply_dir(apply_dir, need_rollout=fmt != "plain")
    report = verified.report
    m = report.get("model") or {}
    if not isinstance(m, dict):
        raise QpassError(f"{apply_dir / 'report.json'}: 'model' must be an object, got {m!r}")
    model_ref = model_ref or m.get("ref")
    if not model_ref:
        raise QpassError(f"{apply_dir / 'report.json'} names no model (model.ref); pass --model")
    problems, notes = verify_files(verified)
    for n in notes:
        log.warning("%s: %s", apply_dir, n)
    _refuse(apply_dir, problems)
    _refuse(apply_dir, consistency_problems(verified, model_ref=model_ref))
    dtype = m.get("dtype") or "bf16"
    sites: dict[str, RolloutSite] = {}
    site_tensors: dict[str, torch.Tensor] = {}
    if fmt != "plain":
        qcfg_path = apply_dir / "rollout" / "hf_quant_config.json"
        sites = sites_from_quant_config(_read_json(qcfg_path, "the rollout quantization config"), qcfg_path)
        if any(r.weight == "nvfp4" for r in sites.values()):  # activation-only sites have no rollout bytes
            from qpass.apps.artifacts import read_tensors

            site_tensors = read_tensors(apply_dir / "rollout" / "weights.safetensors")
    masters: Path | None = apply_dir / "learner" / "model.safetensors"
    record.update(source={"apply_dir": str(apply_dir), "recipe": (report.get("recipe") or {}).get("name")})
    cal = _apply_calibration(apply_dir, report, cal, calibration)
    if "learner/model.safetensors" not in verified.reads:
        log.warning("%s has no learner state; the unquantized tensors come from the model %s", apply_dir, model_ref)
        masters = None
    return _ApplySource(verified, model_ref, dtype, sites, site_tensors, masters, cal)


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
    calibration: str | Path | None = None,
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
        calibration: a ``qpass calibrate`` directory (module docstring).
    Raises:
        QpassError: bad output path (an existing non-export directory, a symlink ...), a missing or
            corrupt apply file (named), unknown format, a non-NVFP4 rollout, and the format's checks.
        IntegrityError: the apply directory differs from what its report recorded or is inconsistent
            with itself or with the rollout rebuilt from its recipe (module docstring); raised before
            ``out`` is created.
    """
    from qpass.apps.validate import check_export_recipe, check_model_ref, check_probe_count
    from qpass.atomic import check_output_path
    from qpass.graph.model import load_model
    from qpass.compiler.pipeline import DTYPES

    out = Path(out)
    if global_scale not in (None, *GLOBAL_SCALE_RULES):
        raise QpassError(f"--global-scale must be one of {sorted(GLOBAL_SCALE_RULES)}, got {global_scale!r}")
    if fmt not in CHECKPOINT_FORMATS:
        raise QpassError(f"unknown --format {fmt!r}; known: {sorted(CHECKPOINT_FORMATS)}")
    check_output_path(out, force=force, marker=RECORD)  # before any model load
    check_probe_count(calibration_prompts, "--calibration-prompts")
    check_export_recipe(recipe, fmt)
    cal = _load_calibration(calibration)
    if src is not None and model is not None and not is_apply_dir(Path(src)):
        raise QpassError(f"give the model once: SRC {src!r} or --model {model!r}")
    apply_dir = Path(src) if src is not None and is_apply_dir(Path(src)) else None
    model_ref = model or (None if apply_dir is not None else (str(src) if src is not None else None))
    record: dict[str, Any] = {"format": fmt, "qpass_version": __version__}
    sites: dict[str, RolloutSite] = {}
    site_tensors: dict[str, torch.Tensor] = {}
    masters = None
    verified = None
    if apply_dir is not None:
        src_ = _read_apply_dir(apply_dir, fmt, recipe, model_ref, record, cal, calibration)
        verified, model_ref, sites, site_tensors, masters, cal = (src_.verified, src_.model_ref, src_.sites, src_.site_tensors,
                                                                  src_.masters, src_.cal)
        dtype = dtype or src_.dtype
    elif model_ref is None:
        raise QpassError("nothing to export: give an apply output DIR, a model (SRC or --model), or --recipe R --model M")
    dtype = dtype or "bf16"
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise QpassError(f"--dtype must be one of bf16, fp16, fp32; got {dtype!r}")
    tdtype = DTYPES[dtype]
    where = "--model" if model is not None else "SRC" if apply_dir is None else f"{apply_dir / 'report.json'} model.ref"
    if not isinstance(model_ref, str):
        raise QpassError(f"{where} must name a model (a string), got {model_ref!r}")
    check_model_ref(model_ref, where)
    build = apply_dir is None and recipe is not None and fmt != "plain"
    rebuild = verified is not None and fmt != "plain"
    with phase(f"export ({fmt})", total=2 + (masters is not None) + build + rebuild, unit="step") as ph:
        ph.advance(0, note=f"load {model_ref}")
        lm = load_model(model_ref, dtype=tdtype)
        if cal is not None:  # the weights it was computed on: the model's (an apply's masters are those)
            cal.check_model(lm.model)
        ph.advance(note="model loaded")
        if masters is not None:
            record["masters"] = {"file": str(masters), "tensors": _load_masters_into(lm.model, masters)}
            ph.advance(note="master weights loaded")
        if apply_dir is None:
            record["source"] = {"model": model_ref, "recipe": recipe}
            if build:
                from qpass.compiler.recipe import load_recipe

                sites, site_tensors, _ = _build_rollout(lm, load_recipe(recipe), cal)
                ph.advance(note="rollout built")
        elif rebuild:
            ph.advance(0, note="rebuild the rollout from the recipe and compare")
            _refuse(apply_dir, _rebuilt_problems(verified, lm, site_tensors, cal))
            record["verified"] = {"checksums": verified.sums is not None, "report_digest": SEAL in verified.report,
                                  "rebuilt_rollout": "hf_quant_config.json and every rollout tensor equal the rollout rebuilt "
                                                     "from the recipe on the saved master weights"}
            ph.advance(note="rollout verified")
        return _export_write(out, fmt, record, lm, dtype, tdtype, model_ref, sites, site_tensors, apply_dir, masters, force,
                             calibration_prompts, max_shard_size, global_scale, cal, ph)


def _export_write(out: Path, fmt: str, record: dict[str, Any], lm: Any, dtype: str, tdtype: torch.dtype, model_ref: str,
                  sites: dict[str, RolloutSite], site_tensors: dict[str, torch.Tensor], apply_dir: Path | None,
                  masters: Path | None, force: bool, calibration_prompts: int, max_shard_size: int | str,
                  global_scale: str | None, cal: Any, ph: Any) -> dict[str, Any]:
    """The write step of :func:`export_checkpoint` (input scales, format, files) and what the export carries."""
    record["model"] = {"ref": model_ref, "name": lm.name, "dtype": dtype}
    arithmetic = weight_arithmetic(sites)
    if global_scale is not None and sites and global_scale != arithmetic:
        raise QpassError(
            f"--global-scale {global_scale}: the rollout's weight bytes follow the {arithmetic} arithmetic; a checkpoint "
            f"cannot carry other global scales than the codes were quantized with. Use a recipe whose weight_qdq and "
            f"w4a4_lower/w4a16_lower set `arithmetic: {global_scale}` (learner and rollout alike, so parity holds)")
    given = _given_input_amax(sites, site_tensors, cal) if fmt != "plain" else {}
    need_ids = fmt != "plain" and any(r.needs_input_scale and s not in given for s, r in sites.items())
    ids = _calibration_ids(lm.tokenizer, calibration_prompts) if need_ids else None
    ph.advance(0, note="calibrate, convert and write the files" if ids else "convert and write the files")
    with atomic_dir(out, force=force, marker=RECORD) as tmp:
        summary = write_checkpoint(tmp, fmt, model=lm.model, dtype=tdtype, tokenizer=lm.tokenizer, sites=sites, site_tensors=site_tensors,
                                   calibration_ids=ids, input_amax=given or None, max_shard_size=max_shard_size)
        if "calibration" in summary:
            summary["calibration"]["source"] = f"{calibration_prompts} qpass probe prompts (chat template)"
        if given:
            summary["input_scale_from"] = {
                "sites": len(given), "rule": "S_dec = fl(1/fl(2688/group_amax)) (SPEC §3), shared per fused group",
                "static_act_sites": sum(r.act == "nvfp4_static" for s, r in sites.items() if s in given),
                "calibration": cal.summary() if cal is not None else None}
        record.update(summary, global_scale_convention=GLOBAL_SCALE_RULES[arithmetic] if sites else None)
        record["carried"] = export_contents(fmt, sites, apply_dir=apply_dir, masters=masters, model_ref=model_ref, dtype=dtype,
                                            calibration=summary.get("calibration"),
                                            calibrated_by=cal.name if cal is not None and given else None)
        write_json(tmp / RECORD, record)
    ph.advance(note="written")
    return record


def _load_calibration(path: str | Path | None) -> Any:
    if path is None:
        return None
    from qpass.apps.calibrate import load_for_model

    return load_for_model(Path(path), None)


def _apply_calibration(apply_dir: Path, report: dict[str, Any], cal: Any, given: str | Path | None) -> Any:
    """The calibration of an apply output: ``--calibration`` (then it must be the one the apply used, if
    it used one) or the apply's ``DIR/calibration`` copy (verified; its sha256 must be report.json's)."""
    from qpass.calibration.source import CalibrationError

    rec = (report.get("artifacts") or {}).get("calibration")
    if not rec:
        return cal
    if cal is not None:
        if cal.meta.get("sha256") != rec.get("sha256"):
            raise CalibrationError(f"--calibration {given} is not the calibration {apply_dir} was applied with "
                                   f"(report.json records sha256 {str(rec.get('sha256'))[:12]}...)")
        return cal
    from qpass.apps.calibrate import load_for_model

    own = load_for_model(apply_dir / rec.get("dir", "calibration"), None, flag=f"{apply_dir}/calibration")
    if own.meta.get("sha256") != rec.get("sha256"):
        raise CalibrationError(f"{apply_dir}/calibration: its sha256 differs from the one report.json records")
    return own


def _given_input_amax(sites: dict[str, RolloutSite], site_tensors: dict[str, torch.Tensor], cal: Any) -> dict[str, torch.Tensor]:
    """The input amax of the W4A4 sites that need no calibration here: static-scale sites the rollout's
    ``<site>.input_amax`` (what its graph used; must equal ``cal``'s group amax when given), others ``cal``'s.

    Raises:
        QpassError: a static site without its ``input_amax`` tensor, a site ``cal`` has no amax for,
            or a static site whose rollout amax is not ``cal``'s.
    """
    out: dict[str, torch.Tensor] = {}
    for s, r in sorted(sites.items()):
        if not r.needs_input_scale:
            continue
        if r.act == "nvfp4_static":
            t = site_tensors.get(f"{s}.input_amax")
            if t is None:
                raise QpassError(f"static activation-scale site {s}: no {s}.input_amax among the rollout tensors")
            out[s] = t.detach().float().reshape(()).clone()
            if cal is not None and s in cal.amax and int(cal.group_amax(s).view(torch.int32)) != int(out[s].view(torch.int32)):
                raise QpassError(f"site {s}: the rollout's static input amax {float(out[s])!r} is not the group amax "
                                 f"{float(cal.group_amax(s))!r} of {cal.name}")
        elif cal is not None:
            if s not in cal.amax:
                raise QpassError(f"W4A4 site {s}: {cal.name} has no input amax for it")
            out[s] = cal.group_amax(s)
    return out


def export_contents(fmt: str, sites: dict[str, RolloutSite], *, apply_dir: Path | None, masters: Path | None, model_ref: str,
                    dtype: str, calibration: dict[str, Any] | None = None, calibrated_by: str | None = None) -> dict[str, Any]:
    """What an export wrote and what its format could not carry (``qpass_export.json["carried"]``, and
    the console lines of ``qpass export``).

    Returns ``{"weights": str, "not_carried": [str, ...], "notes": [str, ...]}``: ``weights`` says which
    tensors the checkpoint's linear weights are (the rollout's NVFP4 bytes, or the unquantized masters —
    never the learner's fake-quantized weights); ``not_carried`` names each part of the recipe the
    format drops (empty: nothing); ``notes`` what a reader should know besides. ``calibration``: the
    probe-prompt calibration summary of :func:`write_checkpoint` (None: none ran); ``calibrated_by``:
    the ``qpass calibrate`` directory the input scales came from (None: none).
    """
    src = f"{masters}" if masters is not None else f"the model {model_ref!r}"
    nvfp4 = {s: r for s, r in sites.items() if r.weight == "nvfp4"}
    act_only = [s for s, r in sites.items() if r.weight == "none"]
    rac = sorted(s for s, r in sites.items() if r.rac is not None)
    w4a4 = [s for s, r in nvfp4.items() if r.needs_input_scale and r.act != "nvfp4_static"]  # dynamic activation scales
    static = [s for s, r in nvfp4.items() if r.needs_input_scale and r.act == "nvfp4_static"]
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
            by = [f"{n} calibration prompts"] if n else []
            by += [f"the calibration {calibrated_by}"] if calibrated_by else []
            out.append(f"dynamic per-tensor activation scales on {len(w4a4)} W4A4 site(s): replaced by a static calibrated "
                       f"{'input_scale' if fmt == 'modelopt' else 'input_global_scale'}"
                       + (f" ({'; '.join(by)})" if by else ""))
        if static:
            notes.append(f"{len(static)} static activation-scale site(s): the calibrated input amax the rollout graph used, "
                         "written as its input_scale (carried)")
    elif w4a4:
        notes.append(f"the static input_scale of the {len(w4a4)} W4A4 site(s) is written for other loaders; qpass's plugins "
                     "quantize activations dynamically (as the recipe does) and ignore it")
    return {"weights": weights, "not_carried": out, "notes": notes}


def _build_rollout(lm: Any, recipe: Any, cal: Any = None) -> tuple[dict[str, RolloutSite], dict[str, torch.Tensor], Any]:
    """Capture ``lm`` and run the recipe's rollout passes (with ``cal`` for static recipes); the NVFP4
    sites, their tensors and the rollout graph."""
    from qpass.apps.artifacts import rollout_tensors
    from qpass.apps.plugins import load_backends
    from qpass.compiler.pipeline import Pipeline

    load_backends(["reference"])
    pipe = Pipeline.prepare(loaded=lm, batch_size=1, max_len=8)
    rollout = pipe.build_side(recipe, "rollout", share_params=True, calibration=cal)
    sites = sites_from_rollout(rollout)
    return sites, (rollout_tensors(rollout) if sites else {}), rollout


def _rebuilt_problems(d: Any, lm: Any, site_tensors: dict[str, torch.Tensor], cal: Any = None) -> list[str]:
    """The apply's rollout rebuilt from its recipe on ``lm`` (the saved master weights loaded; with the
    apply's calibration ``cal`` for static recipes) against its quantization config and every tensor of
    its ``rollout/weights.safetensors``."""
    from qpass.apps.artifacts import compare_tensors, rollout_tensors
    from qpass.compiler.recipe import parse_recipe

    rollout = _build_rollout(lm, parse_recipe(d.recipe_text, str(d.root / "rollout" / "recipe.yaml")), cal)[2]
    problems = rebuilt_problems(d, rollout)
    if "rollout/weights.safetensors" in d.reads:
        problems += compare_tensors(rollout_tensors(rollout), site_tensors, "rollout/weights.safetensors")
    return problems


def _refuse(apply_dir: Path, problems: list[str]) -> None:
    """Raise :class:`IntegrityError` (exit 1) naming every problem; nothing has been written yet."""
    if problems:
        raise IntegrityError(f"{apply_dir} failed verification; nothing was exported:\n  " + "\n  ".join(problems[:20])
                             + (f"\n  ... {len(problems) - 20} more" if len(problems) > 20 else ""))


# ----------------------------------------------------------------------------- CLI


def build_export_parser(prog: str = "qpass export") -> argparse.ArgumentParser:
    """The ``qpass export`` argument parser."""
    from qpass.apps.cliutil import DefaultsHelpFormatter, add_force, add_threads, add_verbose, pos_int

    ap = Parser(prog=prog, description="Export a standalone Hugging Face checkpoint (formats: "
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
    from qpass.apps.calibrate import add_calibration_arg

    add_calibration_arg(ap, "input_scale of W4A4 sites from it (not --calibration-prompts); an apply output's own by default")
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
                                global_scale=a.global_scale, calibration=a.calibration)
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
