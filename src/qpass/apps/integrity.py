"""Verify a ``qpass apply`` output before another command reads it (the integrity chain across commands).

An apply directory is the record of one run: ``report.json`` (what ran, the parity verdict, the
sha256 of every other file and its own content digest), ``rollout/recipe.yaml`` (the recipe copy),
``rollout/hf_quant_config.json`` (per site: format, specs, fused group, RAC options),
``rollout/weights.safetensors`` and ``learner/model.safetensors``. ``qpass check`` and
``qpass export`` read it; both call this module first, in two stages:

1. **Files** (:func:`verify_files`, seconds, no model): the report's content digest
   (``integrity.report_sha256``: sha256 of the report's canonical JSON without that key, so an edit
   of the recipe text or of a verdict inside ``report.json`` is seen), the sha256 of every file the
   report lists, and that every file the command reads is listed. Skipped by ``check --no-checksums``.
2. **Consistency** (:func:`consistency_problems`, no model; always run): the recipe copy equals the
   report's recipe text and name, the quantization config parses and names the report's qpass
   version; the model files the report records (sha256 of the model the command rebuilds from) are unchanged.
3. **Rebuilt graphs** (:func:`rebuilt_problems`, after the caller rebuilt the rollout graph from the
   recipe and the saved master weights): ``hf_quant_config.json`` equals the config the rebuilt graph
   gives (a RAC ratio 0.5 -> 0.05 edit, a site's group or activation spec ...), the report's site
   counts equal the rebuilt graphs'; the caller compares the tensors
   (:func:`qpass.apps.artifacts.compare_tensors`).

Each stage returns problems (strings naming the file and what differs); ``check`` prints them and
exits 1, ``export`` raises :class:`qpass.errors.IntegrityError` (exit 1) before writing anything.
A malformed file (unreadable JSON, a report without its required keys) is :class:`QpassError`
(exit 2).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from qpass.errors import QpassError

__all__ = ["REPORT", "SEAL", "ApplyDir", "consistency_problems", "json_diff", "model_files", "open_apply_dir",
           "rebuilt_problems", "report_digest", "seal_report", "verify_files"]

REPORT = "report.json"
SEAL = "integrity"
RECIPE_COPY = "rollout/recipe.yaml"
QUANT_CONFIG = "rollout/hf_quant_config.json"
ROLLOUT_WEIGHTS = "rollout/weights.safetensors"
LEARNER_STATE = "learner/model.safetensors"
WHAT = {RECIPE_COPY: "recipe copy", QUANT_CONFIG: "rollout quantization config", ROLLOUT_WEIGHTS: "rollout weights",
        LEARNER_STATE: "learner state"}
_SEAL_METHOD = "sha256 of the canonical JSON (sorted keys, no spaces, ASCII) of report.json without this key"


# ----------------------------------------------------------------------------- report digest


def _canonical(value: Any) -> bytes:
    from qpass.jsonio import json_safe

    return json.dumps(json_safe(value), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def report_digest(report: Mapping[str, Any]) -> str:
    """sha256 (hex) of ``report``'s canonical JSON without the :data:`SEAL` key (the strict-JSON form
    :mod:`qpass.jsonio` writes, so the digest of the dict before writing equals that of the file read back)."""
    return hashlib.sha256(_canonical({k: v for k, v in report.items() if k != SEAL})).hexdigest()


def seal_report(report: dict[str, Any]) -> dict[str, Any]:
    """Add ``report[SEAL] = {"report_sha256": ..., "method": ...}`` (call last, just before writing)."""
    report[SEAL] = {"report_sha256": report_digest(report), "method": _SEAL_METHOD}
    return report


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-standard JSON constant {name}")


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """A strict JSON object from ``path`` (no NaN/Infinity tokens).

    Raises:
        QpassError: missing, unreadable, not UTF-8, not JSON or not an object (names the file).
    """
    if not path.is_file():
        raise QpassError(f"{path} is missing ({what})")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_reject_constant)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise QpassError(f"{path} is not a readable {what} (strict UTF-8 JSON; {type(exc).__name__}: {exc})") from exc
    if not isinstance(data, dict):
        raise QpassError(f"{path} is not a readable {what} (a JSON object expected, got {type(data).__name__})")
    return data


# ----------------------------------------------------------------------------- the directory


@dataclasses.dataclass(frozen=True)
class ApplyDir:
    """An apply output directory as read (nothing verified yet).

    Attributes:
        root: the directory.
        report: ``report.json``.
        sums: ``report.artifacts.sha256`` (relative path -> hex), or None (an older report).
        reads: the files (relative paths) the reading command will read besides ``report.json``
            (the rollout and learner files, and the calibration copy when the apply used one).
    """

    root: Path
    report: dict[str, Any]
    sums: dict[str, str] | None
    reads: tuple[str, ...]

    @property
    def recipe_text(self) -> str:
        return self.report["recipe"]["text"]

    @property
    def artifacts(self) -> dict[str, Any]:
        return self.report.get("artifacts") or {}


def open_apply_dir(root: str | Path, *, need_rollout: bool = True,
                   check: Callable[[dict[str, Any], str], None] | None = None) -> ApplyDir:
    """Read ``root/report.json``, list the files the reading command reads, and check that each is
    there and well-formed (safetensors headers, strict JSON); no checksum is compared yet.

    Args:
        need_rollout: the command reads the rollout artifacts (recipe copy, quantization config and
            weights); ``qpass export --format plain`` reads only the learner state.
        check: the reading command's own report-field check, ``check(report, "DIR/report.json")``,
            run first (``qpass check``: missing keys, then :func:`qpass.apps.validate.check_report_fields`).
    Raises:
        QpassError: no or malformed ``report.json`` (a missing required key is named); a file the
            command reads is missing or malformed (named). Malformed input is exit 2, before any
            comparison (a changed file is a difference: exit 1, later stages).
    """
    root = Path(root)
    rep = read_json_object(root / REPORT, "qpass report")
    if check is not None:
        check(rep, str(root / REPORT))
    try:
        text = rep["recipe"]["text"]
        if not isinstance(text, str):
            raise TypeError(f"recipe.text is {type(text).__name__}, expected a string")
        arts = rep.get("artifacts") or {}
        if not isinstance(arts, dict):
            raise TypeError(f"artifacts is {type(arts).__name__}, expected an object")
        sums = arts.get("sha256")
        if sums is not None and not (isinstance(sums, dict) and all(isinstance(v, str) for v in sums.values())):
            raise TypeError("artifacts.sha256 is not an object of hex strings")
    except (KeyError, TypeError) as exc:
        raise QpassError(f"{root / REPORT} is not a readable qpass report ({type(exc).__name__}: {exc})") from exc
    reads: list[str] = []
    if need_rollout:
        reads += [RECIPE_COPY, QUANT_CONFIG]
        if (arts.get("rollout") or {}).get("weights"):
            reads.append(ROLLOUT_WEIGHTS)
    if arts.get("learner"):
        reads.append(LEARNER_STATE)
    cal = arts.get("calibration")
    if cal:  # the calibration copy `qpass apply --calibration` wrote (qpass.calibration.record verifies its content)
        from qpass.calibration.record import JSON_NAME, TENSORS_NAME

        sub = cal.get("dir", "calibration") if isinstance(cal, dict) else None
        if not isinstance(sub, str) or not sub or "/" in sub or "\\" in sub or sub in (".", ".."):
            raise QpassError(f"{root / REPORT} is not a readable qpass report (artifacts.calibration.dir is {sub!r}, "
                             "expected a subdirectory name)")
        reads += [f"{sub}/{JSON_NAME}", f"{sub}/{TENSORS_NAME}"]
    from qpass.apps.artifacts import probe_safetensors

    for rel in reads:
        what = WHAT.get(rel, "calibration copy")
        if not (root / rel).is_file():
            raise QpassError(f"{what} {root / rel} is missing")
        if rel.endswith(".safetensors"):
            probe_safetensors(root / rel, what)
        elif rel.endswith(".json"):
            read_json_object(root / rel, what)
    return ApplyDir(root, rep, sums, tuple(reads))


def verify_files(d: ApplyDir) -> tuple[list[str], list[str]]:
    """Stage 1: the report's content digest, the sha256 of every file it lists, and that every file
    the command reads is listed.

    Returns:
        (problems, notes): a problem names the file and what differs; notes say what could not be
        checked (a report written before digests / checksums existed).
    """
    from qpass.apps.artifacts import verify_checksums

    problems: list[str] = []
    notes: list[str] = []
    seal = d.report.get(SEAL)
    if seal is None:
        notes.append(f"{REPORT} has no content digest (written by an older qpass): its fields are cross-checked only")
    elif not isinstance(seal, dict) or not isinstance(seal.get("report_sha256"), str):
        problems.append(f"{REPORT}: the '{SEAL}' field is malformed ({seal!r:.80})")
    elif seal["report_sha256"] != report_digest(d.report):
        problems.append(f"{REPORT}: its content differs from the digest qpass apply recorded in it "
                        f"({SEAL}.report_sha256): report.json was edited after it was written")
    if d.sums is None:
        notes.append(f"{REPORT} records no file checksums (written by an older qpass): comparing contents only")
        return problems, notes
    problems += verify_checksums(d.root, d.sums)
    problems += [f"{rel}: read by this command but not covered by the checksums in {REPORT}" for rel in d.reads
                 if rel not in d.sums]
    return problems, notes


def consistency_problems(d: ApplyDir, *, model_ref: str | None = None) -> list[str]:
    """Stage 2: the files agree with each other (no model needed).

    * ``rollout/recipe.yaml`` equals the report's ``recipe.text`` and parses to the report's recipe name;
    * ``rollout/hf_quant_config.json`` is a qpass rollout config of the report's qpass version;
    * the model files the report records (sha256 at apply time) are unchanged, when ``model_ref``
      (the model the command will load) is the one the report names.

    Raises:
        QpassError: an unreadable file (exit 2: malformed input, not a difference).
    """
    problems: list[str] = []
    rep, root = d.report, d.root
    if RECIPE_COPY in d.reads:
        copy = root / RECIPE_COPY
        try:
            text = copy.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise QpassError(f"{copy} is not UTF-8 text (byte {exc.start}): {exc.reason}") from exc
        if text != d.recipe_text:
            problems.append(f"{RECIPE_COPY} differs from the recipe text in {REPORT} ({_first_line_diff(text, d.recipe_text)})")
        else:
            from qpass.errors import RecipeError
            from qpass.compiler.recipe import parse_recipe

            try:
                name = parse_recipe(text, str(copy)).name
            except RecipeError as exc:
                raise QpassError(f"the apply's recipe does not parse: {exc}") from exc
            if name != rep["recipe"].get("name"):
                problems.append(f"{REPORT}: recipe.name is {rep['recipe'].get('name')!r}, the recipe text ({RECIPE_COPY}) names {name!r}")
    if QUANT_CONFIG in d.reads:
        q = read_json_object(root / QUANT_CONFIG, "rollout quantization config")
        version = (q.get("producer") or {}).get("version") if isinstance(q.get("producer"), dict) else None
        if not isinstance(q.get("quantization"), dict):
            raise QpassError(f"{root / QUANT_CONFIG}: not a qpass rollout quantization config (no 'quantization' object)")
        if version != rep.get("qpass_version"):
            problems.append(f"{QUANT_CONFIG}: producer.version is {version!r}, {REPORT} says the apply ran qpass "
                            f"{rep.get('qpass_version')!r}")
    problems += model_problems(rep, model_ref)
    return problems


def rebuilt_problems(d: ApplyDir, rollout: Any, site_counts: Mapping[str, Any] | None = None) -> list[str]:
    """Stage 3: ``hf_quant_config.json`` equals the config of ``rollout`` (the rollout graph rebuilt from
    the recipe, its weights quantized from the saved masters) and the report's site counts equal
    ``site_counts`` (:func:`qpass.apps.report.site_counts` of the rebuilt graphs; None: not compared).
    """
    from qpass.apps.artifacts import rollout_quant_config

    problems: list[str] = []
    if QUANT_CONFIG in d.reads:
        saved = read_json_object(d.root / QUANT_CONFIG, "rollout quantization config")
        version = (saved.get("producer") or {}).get("version", "")
        want = json.loads(_canonical(rollout_quant_config(rollout, version)))
        problems += [f"{QUANT_CONFIG}: {p}" for p in json_diff(want, saved, "the rebuilt rollout", "the file")]
    if site_counts is not None and isinstance(d.report.get("sites"), dict):
        for k, v in site_counts.items():
            got = d.report["sites"].get(k)
            if got != v:
                problems.append(f"{REPORT}: sites.{k} is {got!r}, the graphs rebuilt from the recipe have {v}")
    return problems


# ----------------------------------------------------------------------------- model files


def model_files(source: str | None) -> dict[str, str] | None:
    """sha256 of the files a model was loaded from (``LoadedModel.source``: a ``.gguf`` file or a
    Hugging Face directory; every regular file under it, hidden ones excepted), keyed by path relative
    to the directory; None for a source that is not a local path (an in-memory model)."""
    from qpass.apps.artifacts import sha256_file

    if not source:
        return None
    p = Path(source)
    if p.is_file():
        return {p.name: sha256_file(p)}
    if not p.is_dir():
        return None
    out = {}
    for f in sorted(p.rglob("*")):
        rel = f.relative_to(p)
        if f.is_file() and not any(part.startswith(".") for part in rel.parts):
            out[rel.as_posix()] = sha256_file(f)
    return out


def model_problems(report: Mapping[str, Any], model_ref: str | None) -> list[str]:
    """The model files ``report.model.files`` records, compared with what is at ``report.model.source``
    now; only when ``model_ref`` (the model the command loads) is the report's ``model.ref`` (an
    explicit other ``--model`` is the user's choice; the rebuilt-graph comparison still runs)."""
    m = report.get("model") or {}
    files, source = m.get("files"), m.get("source")
    if not isinstance(files, dict) or not source or (model_ref is not None and model_ref != m.get("ref")):
        return []
    p = Path(source)
    base = p.parent if p.suffix == ".gguf" else p
    from qpass.apps.artifacts import sha256_file

    problems = []
    for rel, want in sorted(files.items()):
        f = base / rel
        if not f.is_file():
            problems.append(f"model file {f} (the model the apply ran on, recorded in {REPORT}) is missing")
        elif sha256_file(f) != want:
            problems.append(f"model file {f}: sha256 differs from the one recorded in {REPORT} (the model changed since qpass apply)")
    return problems


# ----------------------------------------------------------------------------- helpers


def _first_line_diff(a: str, b: str) -> str:
    la, lb = a.splitlines(), b.splitlines()
    for i, (x, y) in enumerate(zip(la, lb), 1):
        if x != y:
            return f"first difference at line {i}: {x.strip()!r:.60} vs {y.strip()!r:.60}"
    return f"{len(la)} vs {len(lb)} lines"


def json_diff(want: Any, got: Any, want_name: str, got_name: str, path: str = "", limit: int = 8) -> list[str]:
    """Differences between two JSON trees, one string per differing leaf (at most ``limit``, then a
    count): ``quantization.rac[model.layers.1.mlp.gate_proj].ratio: the file has 0.05, the rebuilt rollout 0.5``.
    Keys that contain dots are shown in brackets."""
    out: list[str] = []
    _diff(want, got, path, out)
    text = [f"{p or '(top level)'}: {got_name} has {g}, {want_name} {w}" for p, w, g in out[:limit]]
    if len(out) > limit:
        text.append(f"(+{len(out) - limit} more differences)")
    return text


def _key(path: str, k: str) -> str:
    return f"{path}[{k}]" if "." in k or not k else (f"{path}.{k}" if path else k)


def _show(v: Any) -> str:
    s = json.dumps(v, sort_keys=True)
    return s if len(s) <= 80 else s[:77] + "..."


def _diff(want: Any, got: Any, path: str, out: list[tuple[str, str, str]]) -> None:
    if isinstance(want, dict) and isinstance(got, dict):
        for k in sorted(set(want) | set(got), key=str):
            if k not in got:
                out.append((_key(path, str(k)), _show(want[k]), "no such key"))
            elif k not in want:
                out.append((_key(path, str(k)), "no such key", _show(got[k])))
            else:
                _diff(want[k], got[k], _key(path, str(k)), out)
    elif isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        for i, (w, g) in enumerate(zip(want, got)):
            _diff(w, g, f"{path}[{i}]", out)
    elif want != got or type(want) is not type(got):
        out.append((path, _show(want), _show(got)))

