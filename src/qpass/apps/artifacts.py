"""Output directories written atomically, and the rollout / learner artifacts.

* :func:`atomic_dir` (re-exported from :mod:`qpass.atomic`): build everything in a sibling temp dir
  and rename it into place at the end, the output path reserved from the start.
* Rollout artifacts (``rollout/weights.safetensors``): per NVFP4 site ModelOpt ``modelopt_fp4``
  names — ``<site>.weight`` uint8 ``[N, K/2]`` (low nibble = even k), ``<site>.weight_scale``
  float8_e4m3fn ``[N, K/16]`` (linear layout), ``<site>.weight_scale_2`` float32 0-dim = ``S_dec``
  (a decode **multiplier**) — plus ``<site>.weight_global_scale`` = ``S_enc`` (compressed-tensors
  naming, an encode divisor) so neither convention has to be derived by a reciprocal. FP8 sites:
  ``<site>.weight`` float8_e4m3fn and ``<site>.weight_scale_inv`` float32 block decode multipliers.
  MXFP4 sites: ``<site>.weight`` uint8 packed E2M1 and ``<site>.weight_scale`` uint8 E8M0 bytes.
  Static RAC sites add ``<site>.rac_channels`` (int64), static activation-scale sites
  (``w4a4_lower`` ``act_scale: static``) ``<site>.input_amax`` (float32 0-d, the calibrated group amax
  the op quantizes with). ``hf_quant_config.json`` records per site the
  weight spec, the activation spec (None = weight-only) and the fused group; ``quant_algo`` is
  ``NVFP4`` (W4A4), ``W4A16_NVFP4``, ``FP8_BLOCK`` or ``MXFP4``.
  Dynamic activation scales (computed per forward) store nothing.
* Learner state (``learner/model.safetensors``): the BF16 master weights under Hugging Face names.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from qpass.atomic import atomic_dir
from qpass.jsonio import write_json
from qpass.errors import QpassError
from qpass.formats.spec import FP8Spec, MXFP4Spec, NVFP4Spec
from qpass.graph.capture import site_of
from qpass.graph.opargs import op_args
from qpass.graph.qgraph import QGraph
from qpass.tables import entry

__all__ = ["atomic_dir", "compare_tensors", "file_checksums", "load_learner_into", "load_rollout_into", "probe_safetensors",
           "read_tensors", "rollout_quant_config", "rollout_tensors", "save_learner", "save_rollout", "verify_checksums", "write_json"]


def rollout_tensors(rollout: QGraph) -> dict[str, torch.Tensor]:
    """The rollout's quantized weights under checkpoint names (see module docstring)."""
    out: dict[str, torch.Tensor] = {}
    for sid, rec in rollout.quant.items():
        if not rec.lowered:
            continue
        consts = {k: rollout.gm.get_buffer(attr).detach().cpu() for k, attr in rec.constants.items()}
        out.update(entry("export", rec.spec).tensors(sid, consts))
        for arg, name in CALIBRATED_ARGS.items():
            t = _calibrated_constant(rollout, sid, arg)
            if t is not None:
                out[f"{sid}.{name}"] = t.detach().cpu()
    return {k: v.contiguous() for k, v in out.items()}


# op argument -> checkpoint name of the calibrated constants of a rollout site (qpass calibrate)
CALIBRATED_ARGS = {"rac_channels": "rac_channels", "act_amax": "input_amax"}


def _calibrated_constant(rollout: QGraph, sid: str, arg: str) -> torch.Tensor | None:
    """A site's calibrated constant: ``rac_channels`` (RAC ``selection: static``) or ``act_amax`` (a
    static activation scale), or None."""
    for n in rollout.nodes_of_site(sid):
        if n.target == torch.ops.qpass.nvfp4_linear.default and isinstance(op_args(n).get(arg), torch.fx.Node):
            return rollout.gm.get_buffer(str(op_args(n)[arg].target))
    return None



def save_rollout(rollout: QGraph, directory: Path, recipe_text: str, meta: dict[str, Any]) -> dict[str, Any]:
    """Write ``weights.safetensors``, ``hf_quant_config.json`` and ``recipe.yaml`` into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = rollout_tensors(rollout)
    files: dict[str, Any] = {}
    if tensors:
        # one metadata key: safetensors orders the header's metadata map arbitrarily, so a second key
        # would make the file's bytes differ between identical runs (the recipe is in recipe.yaml)
        save_file(tensors, str(directory / "weights.safetensors"), metadata={"format": "qpass-rollout"})
        files["weights"] = "weights.safetensors"
    write_json(directory / "hf_quant_config.json", rollout_quant_config(rollout, meta.get("qpass_version", "")))
    (directory / "recipe.yaml").write_text(recipe_text)
    files.update(config="hf_quant_config.json", recipe="recipe.yaml", tensors=len(tensors))
    return files


def rollout_quant_config(rollout: QGraph, qpass_version: str) -> dict[str, Any]:
    """The ``hf_quant_config.json`` of a rollout graph (module docstring): per quantized site its
    format, weight / activation spec and fused group, the RAC options, excluded modules, flushed blocks.

    ``qpass check`` and ``qpass export`` rebuild the rollout from the saved recipe and compare this
    with the saved file (:mod:`qpass.apps.integrity`), so the function is the file's one definition.
    """
    nvfp4 = [s for s, r in rollout.quant.items() if r.lowered_as(NVFP4Spec)]
    fp8 = [s for s, r in rollout.quant.items() if r.lowered_as(FP8Spec)]
    mx = [s for s, r in rollout.quant.items() if r.lowered_as(MXFP4Spec)]
    quantized = set(nvfp4) | set(fp8) | set(mx)
    w4a4 = [s for s in nvfp4 if rollout.quant[s].act_spec is not None]
    algo = ("NVFP4" if w4a4 else "W4A16_NVFP4") if nvfp4 else ("FP8_BLOCK" if fp8 else ("MXFP4" if mx else None))
    cfg = {
        "producer": {"name": "qpass", "version": qpass_version},
        "quantization": {
            "quant_algo": algo,
            "group_size": 16 if nvfp4 else None,
            "weight_global_scale_convention": "weight_scale_2 = S_dec (decode multiplier); weight_global_scale = S_enc (encode divisor)",
            "scale_layout": "linear",
            "input_activations": {"dynamic": not any(getattr(rollout.quant[s].act_spec, "global_source", None) == "static" for s in nvfp4),
                                  "per_token": any(getattr(rollout.quant[s].act_spec, "global_scope", None) == "per_token" for s in nvfp4)},
            "exclude_modules": sorted(s for s in rollout.sites if s not in quantized),
            "groups": {s: rollout.quant[s].group for s in sorted(quantized)},
            "rac": {s: dataclasses.asdict(rollout.quant[s].rac) for s in nvfp4 if rollout.quant[s].rac is not None},
            # per site: format, activation spec (None = weight-only), group; what a loader needs to rebuild the ops
            "sites": {s: {k: v for k, v in rollout.quant[s].describe().items() if k in ("kind", "weight_spec", "act_spec", "group")}
                      for s in sorted(quantized)},
            # non-zero weight blocks whose E4M3 block scale underflowed to 0 (decode to zero, SPEC §3)
            "flushed_blocks": {s: rollout.quant[s].flushed_blocks for s in sorted(quantized) if rollout.quant[s].flushed_blocks},
        },
    }
    # activation-only sites (the act_qdq pass, W16A4): weight unquantized, input NVFP4-QDQ'd; `qpass export DIR`
    # writes them as a qpass_weight "none" checkpoint. Only present when there are some (files of other recipes unchanged).
    act_only = sorted(s for s, r in rollout.quant.items() if r.activation_only and s not in quantized)
    if act_only:
        cfg["quantization"]["act_only_sites"] = {s: {"act_spec": rollout.quant[s].act_spec.key, "group": rollout.quant[s].group}
                                                 for s in act_only}
    return cfg


def probe_safetensors(path: Path, what: str) -> int:
    """Read the header of a saved ``.safetensors`` file (no tensor data). Returns its tensor count.

    Raises:
        QpassError: the file is missing, truncated or not a safetensors file.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise QpassError(f"{what} {path} is missing")
    try:
        with safe_open(str(path), framework="pt") as f:
            return len(list(f.keys()))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise QpassError(f"{what} {path} is not a readable safetensors file: {exc}") from exc


def _load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as exc:  # noqa: BLE001
        raise QpassError(f"{path} is not a readable safetensors file: {exc}") from exc


def load_rollout_into(rollout: QGraph, path: Path) -> int:
    """Overwrite the rollout graph's quantized constants with **every** tensor of a saved ``weights.safetensors``.

    Returns the number of tensors loaded (4 per NVFP4 site, 2 per FP8 / MXFP4 site, +1 per static
    RAC site and per static activation-scale site: the whole file).
    Raises:
        QpassError: unreadable file; a tensor the graph needs is missing from the file; the file
            has tensors the graph has no constant for (named); shapes/dtypes differ.
    """
    data = _load(path)
    n = 0
    used: set[str] = set()
    missing: list[str] = []
    for sid, rec in rollout.quant.items():
        c = rec.constants
        if not c:
            continue
        # every constant of the site under its checkpoint name (``export`` spec table)
        for cname, fname in entry("export", rec.spec).names.items():
            key = f"{sid}.{fname}"
            if key not in data:
                missing.append(key)
                continue
            _copy_checked(path, key, data[key], rollout.gm.get_buffer(c[cname]), "graph")
            used.add(key)
            n += 1
        for arg, name in CALIBRATED_ARGS.items():
            buf = _calibrated_constant(rollout, sid, arg)
            if buf is None:
                continue
            key = f"{sid}.{name}"
            if key not in data or data[key].shape != buf.shape or data[key].dtype != buf.dtype:
                raise QpassError(f"{path}: missing or misshapen calibrated constant {key}")
            for node in rollout.nodes_of_site(sid):  # every node of the site (each has its own constant)
                if node.target == torch.ops.qpass.nvfp4_linear.default and isinstance(op_args(node).get(arg), torch.fx.Node):
                    rollout.gm.get_buffer(str(op_args(node)[arg].target)).copy_(data[key])
            used.add(key)
            n += 1
    _refuse_missing_or_extra(path, missing, sorted(set(data) - used), "tensor(s) the rollout graph needs",
                             "tensor(s) the rollout graph has no constant for")
    return n


def _copy_checked(path: Path, key: str, t: torch.Tensor, dst: torch.Tensor, what: str) -> None:
    """``dst.copy_(t)`` for the file tensor ``key``, refused unless shape and dtype match exactly.

    Raises:
        QpassError: ``"{path}: {key} has <dtype><shape>, the {what} expects <dtype><shape>"``.
    """
    if t.shape != dst.shape or t.dtype != dst.dtype:
        raise QpassError(f"{path}: {key} has {t.dtype}{tuple(t.shape)}, the {what} expects {dst.dtype}{tuple(dst.shape)}")
    dst.copy_(t)


def _refuse_missing_or_extra(path: Path, missing: list[str], extra: list[str], missing_what: str, extra_what: str) -> None:
    """A saved tensor file must match its target exactly.

    Raises:
        QpassError: ``missing`` keys the target needs (``"{path}: missing N {missing_what}: names"``),
            else ``extra`` keys it has no place for (``"{path}: N {extra_what}: names"``).
    """
    if missing:
        raise QpassError(f"{path}: missing {len(missing)} {missing_what}: {_names(missing)}")
    if extra:
        raise QpassError(f"{path}: {len(extra)} {extra_what}: {_names(extra)}")


def _names(keys: list[str], limit: int = 5) -> str:
    return ", ".join(keys[:limit]) + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


def compare_tensors(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], what: str) -> list[str]:
    """Bit-level comparison of two tensor dicts (every key). Returns one problem per differing tensor.

    A problem names the tensor and, for a value difference, how many elements differ and the first
    index; missing and extra tensors are problems too.
    """
    problems = [f"{what}: {k} is missing from the file" for k in sorted(set(expected) - set(actual))]
    problems += [f"{what}: {k} is in the file but not produced by the recipe" for k in sorted(set(actual) - set(expected))]
    for k in sorted(set(expected) & set(actual)):
        e, a = expected[k], actual[k]
        if e.shape != a.shape or e.dtype != a.dtype:
            problems.append(f"{what}: {k} is {a.dtype}{tuple(a.shape)}, expected {e.dtype}{tuple(e.shape)}")
            continue
        eb, ab = _bits(e), _bits(a)
        if not torch.equal(eb, ab):
            diff = (eb != ab).reshape(eb.shape)
            first = tuple(int(i) for i in diff.nonzero()[0]) if diff.dim() else ()
            problems.append(f"{what}: {k}: {int(diff.sum())}/{diff.numel()} elements differ (first at {first})")
    return problems


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` (NaN payloads and -0.0 compare as bytes, not as values)."""
    t = t.detach().cpu().contiguous()
    if t.dtype.is_floating_point:
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file. Raises QpassError naming the file if it is unreadable."""
    return _load(Path(path))


def file_checksums(root: Path, exclude: tuple[str, ...] = ("report.json",)) -> dict[str, str]:
    """sha256 (hex) of every file under ``root`` (relative POSIX paths, sorted), except ``exclude``."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel not in exclude:
            out[rel] = sha256_file(p)
    return out


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_checksums(root: Path, sums: dict[str, str]) -> list[str]:
    """Compare the files under ``root`` with the sha256 sums recorded in ``report.json``.

    Returns one problem per missing or changed file (no model needed: seconds even for the learner state).
    """
    return [f"{rel}: listed in report.json but missing" if gone
            else f"{rel}: sha256 differs from report.json (the file changed after qpass apply wrote it)"
            for rel, _, gone in changed_files(Path(root), sums)]


def changed_files(root: Path, sums: dict[str, str]) -> list[tuple[str, Path, bool]]:
    """The files under ``root`` that no longer match their recorded sha256 (``sums``: relative path ->
    hex digest), in path order, as ``(relative path, path, missing)``; ``missing`` False = changed."""
    out = []
    for rel, want in sorted(sums.items()):
        p = root / rel
        if not p.is_file():
            out.append((rel, p, True))
        elif sha256_file(p) != want:
            out.append((rel, p, False))
    return out


def save_learner(learner: QGraph, path: Path) -> int:
    """Write the learner's master weights (HF names, shared tensors once). Returns the tensor count."""
    seen: set[int] = set()
    out = {}
    for name, p in learner.gm.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        out[site_of(name)] = p.detach().cpu().contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path), metadata={"format": "qpass-learner"})
    return len(out)


def load_learner_into(learner: QGraph, path: Path) -> int:
    """Load master weights saved by :func:`save_learner` (tied parameters get the same values).

    Every parameter of the graph must be in the file and every tensor of the file must be a
    parameter: nothing is silently taken from the freshly loaded model.

    Raises:
        QpassError: unreadable file; parameters missing from the file or tensors the graph has no
            parameter for (named); a shape/dtype mismatch.
    """
    data = _load(path)
    n = 0
    used: set[str] = set()
    missing: list[str] = []
    params = list(learner.gm.named_parameters(remove_duplicate=False))
    # save_learner writes a tied parameter once (e.g. lm_head.weight tied to embed_tokens.weight): an
    # alias is satisfied when another name of the same storage is in the file.
    saved_ptrs = {p.data_ptr() for name, p in params if site_of(name) in data}
    with torch.no_grad():
        for name, p in params:
            key = site_of(name)
            if key not in data:
                if p.data_ptr() not in saved_ptrs:
                    missing.append(key)
                continue
            _copy_checked(path, key, data[key], p, "learner")
            used.add(key)
            n += 1
    _refuse_missing_or_extra(path, sorted(set(missing)), sorted(set(data) - used), "learner parameter(s)",
                             "tensor(s) that are no learner parameter")
    return n
