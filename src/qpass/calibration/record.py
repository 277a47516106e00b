"""The calibration file ``qpass calibrate`` writes and every other command verifies before use.

A calibration is a directory of two files:

* ``calibration.safetensors`` — the tensors (one metadata key, so identical runs give identical bytes):

  ===================================  ========  ========  =====================================================
  name                                 dtype     shape     meaning
  ===================================  ========  ========  =====================================================
  ``<site>.input_amax``                float32   ``[]``    max |x| of the site's input over every calibration token
  ``<site>.input_scale``               float32   ``[]``    ``S_dec = fl(1/fl(2688/a))``, ``a`` the fused group's amax
                                                           (q/k/v, gate/up share one; SPEC §3) — ModelOpt's slot
  ``<site>.input_global_scale``        float32   ``[]``    ``S_enc = fl(2688/a)`` (compressed-tensors' slot)
  ``<site>.rac_channels``              int64     ``[k]``   static RAC channels, sorted (static-RAC sites only)
  ``<site>.rac_scores``                int64     ``[K]``   the exact residual scores they are the top-k of
  ``calibration.token_ids``            int64     ``[T]``   every calibration token, prompts concatenated
  ``calibration.token_offsets``        int64     ``[n+1]`` prompt boundaries in ``token_ids``
  ===================================  ========  ========  =====================================================

* ``calibration.json`` — what the numbers are and where they came from: ``format``
  (:data:`FORMAT`), ``data`` (prompt source, sha256 of the prompt texts / file / tokens, token
  counts), ``model`` (reference, name, sha256 of every weight: :func:`~qpass.calibration.measure.model_fingerprint`),
  ``recipe`` (name, sha256 and text of the recipe it was computed for), ``method``, ``sites``
  (per site: group, K, amax and input_scale as numbers), ``rac`` (per static-RAC site: ratio,
  activation mode, k, and the calibrated amax its residual was scored under for a static
  activation scale), ``tensors`` (file name and sha256), ``qpass_version`` and ``sha256``: the
  sha256 of the canonical JSON of everything else.

:func:`load_calibration` verifies all of it (both checksums, the tensor set against ``sites`` /
``rac``, dtypes and shapes, ``input_scale`` = the SPEC §3 scales of the group amax bit for bit,
channels = the top-k of the scores with ties toward the lower index, the tokens against their
sha256) and raises :class:`~qpass.calibration.source.CalibrationError` naming the file and what
differs. :meth:`Calibration.check_model` compares the weights' sha256 with a model's; the
passes' requests (:class:`~qpass.calibration.source.RACRequest`) must match what the file was
computed for (ratio, activation mode, K).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from qpass.calibration.source import ACTS, AmaxRequest, CalibrationError, RACRequest, group_max
from qpass.quant.nvfp4 import global_scales
from qpass.quant.rac import rac_num_channels, topk_channels

FORMAT = "qpass-calibration/1"
JSON_NAME = "calibration.json"
TENSORS_NAME = "calibration.safetensors"
METHOD = {
    "activations": "input of every linear site in the unquantized model's own forward (forward pre-hooks), "
                   "one calibration prompt per forward, no padding",
    "input_amax": "max |x| over every calibration token (float32, exact)",
    "groups": "fused groups q/k/v and gate/up (qpass.graph.sites) share the max of their members' amax (SPEC §3 rule 1)",
    "input_scale": "S_dec = fl(1/fl(2688/group_amax)); input_global_scale = S_enc = fl(2688/group_amax) (SPEC §3)",
    "rac_channels": "top-k (k = floor(ratio*K)) of the exact int64 residual energy of R = X - DQ(Q_A(X)) over every "
                    "calibration token, ties toward the lower channel index (SPEC §2; qpass.quant.rac.static_channels)",
    "moe_experts_not_reached": "an expert site no calibration token reached takes the max amax of the same projection "
                               "over its layer's reached experts (listed in data.experts_not_reached)",
}


def canonical_json(value: Any) -> str:
    """The JSON text the self-checksum is taken over (sorted keys, no spaces, strict floats)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tokens_sha256(token_ids: Sequence[Sequence[int]]) -> str:
    """sha256 of the calibration tokens as little-endian int64, prompt lengths first."""
    h = hashlib.sha256()
    for ids in token_ids:
        h.update(len(ids).to_bytes(8, "little"))
        h.update(torch.tensor(list(ids), dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


def _bits(t: torch.Tensor) -> int:
    return int(t.detach().float().reshape(()).cpu().view(torch.int32))


@dataclasses.dataclass(frozen=True)
class RACEntry:
    """The static RAC channels of one site and what they were computed for.

    Attributes:
        ratio: RAC ratio; ``k = floor(ratio * in_features)``.
        act: activation mode whose ``Q_A`` the residual was scored under.
        in_features: K.
        channels: int64 ``[k]`` sorted.
        scores: int64 ``[K]`` exact residual energy per channel.
        act_amax: the calibrated amax of a static activation scale (``act == 'nvfp4_static'``), else None.
    """

    ratio: float
    act: str
    in_features: int
    channels: torch.Tensor
    scores: torch.Tensor
    act_amax: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A calibration (see module docstring); also a :class:`~qpass.calibration.source.CalibrationSource`.

    Attributes:
        amax: per site its own input amax (float32 0-d).
        groups: per site its fused-group id.
        in_features: per site K.
        rac: per static-RAC site its :class:`RACEntry`.
        token_ids: the calibration tokens, one tuple per prompt.
        meta: the JSON fields ``data``, ``model``, ``recipe``, ``method``, ``qpass_version``.
        path: the directory it was loaded from / saved to (None: in memory).
    """

    amax: Mapping[str, torch.Tensor]
    groups: Mapping[str, str]
    in_features: Mapping[str, int]
    rac: Mapping[str, RACEntry]
    token_ids: tuple[tuple[int, ...], ...]
    meta: Mapping[str, Any]
    path: Path | None = None

    # ------------------------------------------------------------------ values
    @property
    def name(self) -> str:
        return f"calibration {self.path}" if self.path is not None else "calibration (in memory)"

    def group_amax(self, site: str) -> torch.Tensor:
        """float32 0-d: the max amax over the members of ``site``'s fused group (all of them in the file)."""
        g = self.groups[site]
        return torch.stack([self.amax[s].float().reshape(()) for s, gg in self.groups.items() if gg == g]).amax()

    def input_scale(self, site: str) -> torch.Tensor:
        """``S_dec`` of the group amax (float32 0-d, SPEC §3): the ``input_scale`` a checkpoint carries."""
        return global_scales(self.group_amax(site))[1]

    def input_global_scale(self, site: str) -> torch.Tensor:
        """``S_enc`` of the group amax (float32 0-d, SPEC §3)."""
        return global_scales(self.group_amax(site))[0]

    # ------------------------------------------------------------------ CalibrationSource
    def input_amax(self, requests: Sequence[AmaxRequest]) -> dict[str, torch.Tensor]:
        """Per requested site the max of the file's amax over the requested members of its group.

        Raises:
            CalibrationError: a site the file has no amax for, or of another K (names file and site).
        """
        for r in requests:
            if r.site not in self.amax:
                raise CalibrationError(f"{self.name} has no input amax for site {r.site} (computed for another model?)")
            if self.in_features.get(r.site) != r.in_features:
                raise CalibrationError(f"{self.name}: site {r.site} has K={self.in_features.get(r.site)} there, "
                                       f"{r.in_features} in this graph")
        return group_max(self.amax, requests)

    def rac_channels(self, requests: Sequence[RACRequest]) -> dict[str, torch.Tensor]:
        """Per requested site the file's channels, if it was computed for exactly that request.

        Raises:
            CalibrationError: a site without static RAC channels in the file, or one computed for
                another ratio, activation mode, K or calibrated activation amax (names file, site, field).
        """
        out = {}
        for r in requests:
            e = self.rac.get(r.site)
            if e is None:
                raise CalibrationError(f"{self.name} has no static RAC channels for site {r.site} (it was computed for "
                                       f"recipe {self.meta.get('recipe', {}).get('name')!r}; run qpass calibrate with this recipe)")
            diffs = []
            if repr(float(e.ratio)) != repr(float(r.ratio)):
                diffs.append(f"ratio {e.ratio} there, {r.ratio} here")
            if e.act != r.act:
                diffs.append(f"activation mode {e.act} there, {r.act} here")
            if e.in_features != r.in_features:
                diffs.append(f"K={e.in_features} there, {r.in_features} here")
            if (e.act_amax is None) != (r.act_amax is None) or (e.act_amax is not None and _bits(e.act_amax) != _bits(r.act_amax)):
                diffs.append("the residual was scored under another calibrated activation amax")
            if diffs:
                raise CalibrationError(f"{self.name}: static RAC channels of site {r.site} were computed for another "
                                       f"configuration: {'; '.join(diffs)}")
            out[r.site] = e.channels.clone()
        return out

    # ------------------------------------------------------------------ identity
    def check_model(self, model: torch.nn.Module, fingerprint: str | None = None) -> str:
        """Refuse a model whose weights are not the ones this calibration was computed on.

        Returns:
            the model's fingerprint.
        Raises:
            CalibrationError: the weights' sha256 differs (names the file and both models).
        """
        from qpass.calibration.measure import model_fingerprint

        fp = fingerprint or model_fingerprint(model)
        m = self.meta.get("model", {})
        if fp != m.get("weights_sha256"):
            raise CalibrationError(
                f"{self.name} was computed on model {m.get('name')!r} ({m.get('ref')}, weights sha256 {str(m.get('weights_sha256'))[:12]}...); "
                f"this model's weights have sha256 {fp[:12]}... — calibrate this model (qpass calibrate --model ...)")
        return fp

    def summary(self) -> dict[str, Any]:
        """What a report records about the calibration in use."""
        d, m, r = self.meta.get("data", {}), self.meta.get("model", {}), self.meta.get("recipe", {})
        return {"path": str(self.path) if self.path else None, "sha256": self.meta.get("sha256"),
                "data": {k: d.get(k) for k in ("source", "prompts", "tokens", "prompts_sha256", "file_sha256")},
                "model": {k: m.get(k) for k in ("ref", "name", "weights_sha256")},
                "recipe": {k: r.get(k) for k in ("name", "sha256")},
                "sites": len(self.amax), "rac_sites": len(self.rac)}

    # ------------------------------------------------------------------ files
    def tensors(self) -> dict[str, torch.Tensor]:
        """The ``calibration.safetensors`` tensors (module table), sorted by name."""
        out: dict[str, torch.Tensor] = {}
        for s in self.amax:
            out[f"{s}.input_amax"] = self.amax[s].detach().float().reshape(()).cpu().clone()
            out[f"{s}.input_scale"] = self.input_scale(s).clone()
            out[f"{s}.input_global_scale"] = self.input_global_scale(s).clone()
        for s, e in self.rac.items():
            out[f"{s}.rac_channels"] = e.channels.to(torch.int64).cpu().contiguous()
            out[f"{s}.rac_scores"] = e.scores.to(torch.int64).cpu().contiguous()
        lengths = [len(t) for t in self.token_ids]
        out["calibration.token_ids"] = torch.tensor([i for t in self.token_ids for i in t], dtype=torch.int64)
        out["calibration.token_offsets"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()] if lengths else [0],
                                                        dtype=torch.int64)
        return dict(sorted(out.items()))

    def to_json(self, tensors_sha256: str) -> dict[str, Any]:
        """``calibration.json`` (module docstring), its ``sha256`` field included."""
        body = {
            "format": FORMAT,
            **{k: self.meta[k] for k in ("qpass_version", "data", "model", "recipe") if k in self.meta},
            "method": dict(METHOD),
            "sites": {s: {"group": self.groups[s], "in_features": int(self.in_features[s]),
                          "input_amax": float(self.amax[s]), "input_scale": float(self.input_scale(s))}
                      for s in sorted(self.amax)},
            "rac": {s: {"ratio": float(e.ratio), "act": e.act, "in_features": int(e.in_features), "k": int(e.channels.numel()),
                        "act_amax": None if e.act_amax is None else float(e.act_amax)} for s, e in sorted(self.rac.items())},
            "tensors": {"file": TENSORS_NAME, "sha256": tensors_sha256},
        }
        return {**body, "sha256": _sha(canonical_json(body).encode())}

    def write(self, directory: Path) -> dict[str, Any]:
        """Write both files into the existing ``directory`` (the caller makes it atomic). Returns the JSON."""
        from safetensors.torch import save_file

        from qpass.atomic import write_atomic

        directory = Path(directory)
        tpath = directory / TENSORS_NAME
        save_file(self.tensors(), str(tpath), metadata={"format": FORMAT})
        data = self.to_json(_sha(tpath.read_bytes()))
        write_atomic(directory / JSON_NAME, json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n")
        return data


# ----------------------------------------------------------------------------- loading


def calibration_dir(path: str | Path) -> Path:
    """The calibration directory of ``--calibration PATH`` (the directory, or its ``calibration.json``)."""
    p = Path(path)
    return p.parent if p.name == JSON_NAME and not p.is_dir() else p


def load_calibration(path: str | Path) -> Calibration:
    """Read and verify a calibration (module docstring); ``path`` is the directory or its ``calibration.json``.

    Raises:
        CalibrationError: a missing or unreadable file, a checksum that differs, or contents that
            are inconsistent (names the file and the tensor / site / field).
    """
    from safetensors import safe_open

    d = calibration_dir(path)
    jpath = d / JSON_NAME
    if not d.is_dir() or not jpath.is_file():
        raise CalibrationError(f"calibration {path}: no {JSON_NAME} there (give the directory `qpass calibrate --out` wrote)")
    try:
        raw = jpath.read_bytes()
        doc = json.loads(raw.decode("utf-8"), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"non-standard constant {c}")))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CalibrationError(f"calibration {jpath} is not readable JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise CalibrationError(f"calibration {jpath}: format {got!r}, expected {FORMAT!r}")
    body = {k: v for k, v in doc.items() if k != "sha256"}
    if doc.get("sha256") != _sha(canonical_json(body).encode()):
        raise CalibrationError(f"calibration {jpath}: its sha256 field does not match its contents (the file was edited)")
    try:
        tinfo, sites, rac, data = doc["tensors"], doc["sites"], doc["rac"], doc["data"]
        tname = tinfo["file"]
        if not isinstance(tname, str) or "/" in tname or "\\" in tname or tname in ("", ".", ".."):
            raise CalibrationError(f"calibration {jpath}: tensors.file must be a plain file name, got {tname!r}")
        tpath = d / tname
        if not tpath.is_file():
            raise CalibrationError(f"calibration {d}: {tname} is missing")
        if _sha(tpath.read_bytes()) != tinfo["sha256"]:
            raise CalibrationError(f"calibration {tpath}: sha256 differs from {JSON_NAME} (the tensors changed after qpass calibrate wrote them)")
        try:
            with safe_open(str(tpath), framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise CalibrationError(f"calibration {tpath} is not a readable safetensors file: {exc}") from exc
        return _build(d, doc, tensors, tpath)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, CalibrationError):
            raise
        raise CalibrationError(f"calibration {jpath}: malformed ({type(exc).__name__}: {exc})") from exc


def _expect(t: torch.Tensor | None, name: str, dtype: torch.dtype, shape: tuple[int, ...] | None, where: Path) -> torch.Tensor:
    if t is None:
        raise CalibrationError(f"calibration {where}: tensor {name} is missing")
    if t.dtype != dtype or (shape is not None and tuple(t.shape) != shape):
        raise CalibrationError(f"calibration {where}: tensor {name} is {t.dtype}{tuple(t.shape)}, expected {dtype}{shape or ''}")
    return t


def _build(d: Path, doc: dict[str, Any], tensors: dict[str, torch.Tensor], tpath: Path) -> Calibration:
    """A :class:`Calibration` from verified-checksum files, with every consistency check."""
    sites, rac = doc["sites"], doc["rac"]
    used: set[str] = set()

    def take(name: str, dtype: torch.dtype, shape: tuple[int, ...] | None) -> torch.Tensor:
        used.add(name)
        return _expect(tensors.get(name), name, dtype, shape, tpath)

    amax, groups, kdim = {}, {}, {}
    for s, info in sites.items():
        a = take(f"{s}.input_amax", torch.float32, ())
        if not (math.isfinite(float(a)) and float(a) >= 0) or float(a) != float(info["input_amax"]):
            raise CalibrationError(f"calibration {tpath}: {s}.input_amax = {float(a)} (JSON {info['input_amax']}); "
                                   "must be finite, >= 0 and equal")
        amax[s], groups[s], kdim[s] = a, str(info["group"]), int(info["in_features"])
    cal = Calibration(amax, groups, kdim, {}, (), {}, d)
    for s in sites:
        ga = cal.group_amax(s)
        if not float(ga) > 0:
            raise CalibrationError(f"calibration {tpath}: fused group {groups[s]} (site {s}) has amax 0: no input scale")
        enc, dec = global_scales(ga)
        for suffix, want in (("input_scale", dec), ("input_global_scale", enc)):
            got = take(f"{s}.{suffix}", torch.float32, ())
            if _bits(got) != _bits(want):
                raise CalibrationError(f"calibration {tpath}: {s}.{suffix} = {float(got)!r} is not the SPEC §3 scale "
                                       f"{float(want)!r} of its group amax {float(ga)!r}")
        if float(sites[s]["input_scale"]) != float(dec):
            raise CalibrationError(f"calibration {tpath}: JSON sites.{s}.input_scale differs from the tensor")
    entries = {}
    for s, info in rac.items():
        if s not in sites:
            raise CalibrationError(f"calibration {tpath}: static RAC site {s} has no input amax entry")
        k_dim, ratio, act = int(info["in_features"]), float(info["ratio"]), str(info["act"])
        if act not in ACTS or not 0.0 <= ratio <= 1.0 or k_dim != kdim[s]:
            raise CalibrationError(f"calibration {tpath}: rac.{s}: bad act {act!r}, ratio {ratio} or K {k_dim}")
        k = rac_num_channels(k_dim, ratio)
        if int(info["k"]) != k:
            raise CalibrationError(f"calibration {tpath}: rac.{s}.k = {info['k']}, but floor({ratio} * {k_dim}) = {k}")
        ch = take(f"{s}.rac_channels", torch.int64, (k,))
        scores = take(f"{s}.rac_scores", torch.int64, (k_dim,))
        if not torch.equal(ch, topk_channels(scores, k)):
            raise CalibrationError(f"calibration {tpath}: {s}.rac_channels are not the top-{k} of {s}.rac_scores "
                                   "(ties toward the lower channel index)")
        act_amax = None
        if act == "nvfp4_static":
            if info.get("act_amax") is None:
                raise CalibrationError(f"calibration {tpath}: rac.{s}: act nvfp4_static without act_amax")
            act_amax = torch.tensor(float(info["act_amax"]), dtype=torch.float32)
        elif info.get("act_amax") is not None:
            raise CalibrationError(f"calibration {tpath}: rac.{s}: act_amax given for act {act}")
        entries[s] = RACEntry(ratio, act, k_dim, ch, scores, act_amax)
    ids = take("calibration.token_ids", torch.int64, None)
    offs = take("calibration.token_offsets", torch.int64, None)
    if ids.dim() != 1 or offs.dim() != 1 or offs.numel() < 2 or int(offs[0]) != 0 or int(offs[-1]) != ids.numel() \
            or bool((offs[1:] <= offs[:-1]).any()):
        raise CalibrationError(f"calibration {tpath}: calibration.token_offsets do not partition calibration.token_ids")
    tokens = tuple(tuple(ids[int(a):int(b)].tolist()) for a, b in zip(offs[:-1], offs[1:]))
    data = doc["data"]
    if tokens_sha256(tokens) != data.get("tokens_sha256") or len(tokens) != data.get("prompts") \
            or ids.numel() != data.get("tokens"):
        raise CalibrationError(f"calibration {tpath}: the calibration tokens do not match data (count or sha256) in {JSON_NAME}")
    extra = sorted(set(tensors) - used)
    if extra:
        raise CalibrationError(f"calibration {tpath}: {len(extra)} tensor(s) {JSON_NAME} does not describe: {extra[:4]}")
    meta = {k: doc[k] for k in ("qpass_version", "data", "model", "recipe", "method", "sha256") if k in doc}
    return Calibration(amax, groups, kdim, entries, tokens, meta, d)
