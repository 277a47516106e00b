"""Read-back from inside vLLM's workers: ``LLM(..., worker_extension_cls=WORKER_EXTENSION)`` mixes
:class:`QpassWorkerExtension` into every worker; ``llm.collective_rpc("qpass_served")`` then returns,
per rank, the bytes the engine's own parameters hold (never a copy qpass kept).

Results cross vLLM's process boundary as msgpack: plain ``bytes``/``int``/``str``/``list``/``dict``
only. :func:`assemble_served` (pure torch, testable without vLLM) turns the per-rank records back into
one :class:`qpass.runtime.served.ServedSite` per checkpoint site (fused ``qkv_proj`` rows split into
q/k/v by ``logical_widths``; tensor-parallel shards concatenated along N, or along K for row-parallel
layers). Weight reload itself is vLLM's own worker method ``reload_weights`` (prototype §5).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from qpass.errors import QpassError

WORKER_EXTENSION = "qpass.backends.vllm.worker.QpassWorkerExtension"
METHOD_CLASS = "QpassNvfp4LinearMethod"
ACT_METHOD_CLASS = "QpassNvfp4ActLinearMethod"
MOE_METHOD_CLASS = "QpassNvfp4FusedMoEMethod"
MOE_PARAMS = ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight", "w2_weight_scale", "w2_weight_scale_2")


def _raw(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    return t.view(torch.uint8).numpy().tobytes()


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(_raw(t)).hexdigest()


def _layer_header(name: str, mod: torch.nn.Module) -> dict[str, Any]:
    """The fields every served-layer record starts with: checkpoint site (``layer``), shard widths,
    whether K is split over TP ranks, and the rank's TP position."""
    return {"layer": getattr(mod, "qpass_site", name), "logical_widths": list(mod.logical_widths),
            "k_sharded": bool(mod.qpass_k_sharded), "tp_rank": int(getattr(mod, "tp_rank", 0)),
            "tp_size": int(getattr(mod, "tp_size", 1))}


class QpassWorkerExtension:
    """Methods vLLM's worker gains (called by name through ``collective_rpc``)."""

    def _qpass_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def qpass_served(self) -> list[dict[str, Any]]:
        """One record per ``qpass_nvfp4`` layer of this rank: its name, ``logical_widths``,
        ``k_sharded``, ``tp_rank``/``tp_size`` and the raw bytes + shape of ``weight`` (uint8),
        ``weight_scale`` (E4M3 bytes) and ``weight_scale_2`` (float32 per shard)."""
        out = []
        for name, mod in self._qpass_model().named_modules():
            if type(getattr(mod, "quant_method", None)).__name__ != METHOD_CLASS:
                continue
            out.append({
                **_layer_header(name, mod),
                **{p: {"bytes": _raw(getattr(mod, p)), "shape": list(getattr(mod, p).shape)}
                   for p in ("weight", "weight_scale", "weight_scale_2")},
            })
        return out

    def qpass_served_act_only(self) -> list[dict[str, Any]]:
        """One record per activation-only layer (``QpassNvfp4ActLinearMethod``) of this rank: its
        name, ``logical_widths``, ``k_sharded``, ``tp_rank``/``tp_size`` and the raw bytes, shape and
        dtype name of its unquantized ``weight`` (the engine's own parameter)."""
        out = []
        for name, mod in self._qpass_model().named_modules():
            if type(getattr(mod, "quant_method", None)).__name__ != ACT_METHOD_CLASS:
                continue
            out.append({
                **_layer_header(name, mod),
                "weight": {"bytes": _raw(mod.weight), "shape": list(mod.weight.shape), "dtype": str(mod.weight.dtype).removeprefix("torch.")},
            })
        return out

    def qpass_served_moe(self) -> list[dict[str, Any]]:
        """One record per ``qpass_nvfp4`` MoE layer (``QpassNvfp4FusedMoEMethod``) of this rank: its
        name, checkpoint projection names per shard id (``w1``/``w3``/``w2``) and the raw bytes + shape
        of ``w13_weight``, ``w13_weight_scale``, ``w13_weight_scale_2``, ``w2_weight``,
        ``w2_weight_scale``, ``w2_weight_scale_2`` (the engine's own parameters)."""
        out = []
        for name, mod in self._qpass_model().named_modules():
            if type(getattr(mod, "quant_method", None)).__name__ != MOE_METHOD_CLASS:
                continue
            out.append({"layer": getattr(mod, "qpass_site", name), "ckpt_names": dict(mod.qpass_ckpt_names),
                        **{p: {"bytes": _raw(getattr(mod, p)), "shape": list(getattr(mod, p).shape)} for p in MOE_PARAMS}})
        return out

    def qpass_digests(self) -> dict[str, str]:
        """sha256 of every parameter that is not part of a ``qpass_nvfp4`` layer (norms, embeddings,
        unquantized linears), by vLLM parameter name (HF name for those)."""
        model = self._qpass_model()
        skip = {n for n, m in model.named_modules()
                if type(getattr(m, "quant_method", None)).__name__ in (METHOD_CLASS, ACT_METHOD_CLASS, MOE_METHOD_CLASS)}
        out = {}
        for name, p in model.named_parameters():
            if name.rpartition(".")[0] not in skip:
                out[name] = _sha(p)
        return out


def _layers_by_rank(per_rank: Sequence[Sequence[Mapping[str, Any]]], members: Any):
    """Yield ``(records sorted by TP rank, checkpoint sites in shard order)`` per layer of the served
    records, after checking that every rank's shard widths match the layer's checkpoint members.

    Raises:
        QpassError: a fused layer's widths do not match its members.
    """
    by_layer: dict[str, list[Mapping[str, Any]]] = {}
    for recs in per_rank:
        for r in recs:
            by_layer.setdefault(r["layer"], []).append(r)
    for layer, recs in sorted(by_layer.items()):
        recs = sorted(recs, key=lambda r: r["tp_rank"])
        sites = members(layer)
        if any(len(r["logical_widths"]) != len(sites) for r in recs):
            raise QpassError(f"vLLM layer {layer}: {len(recs[0]['logical_widths'])} shards served, checkpoint sites {sites}")
        yield recs, sites


def assemble_served(per_rank: Sequence[Sequence[Mapping[str, Any]]], members: Any, group_of: Any) -> dict[str, Any]:
    """Per-rank :meth:`QpassWorkerExtension.qpass_served` records -> ``{site: ServedSite}``.

    Args:
        per_rank: what ``collective_rpc("qpass_served")`` returned (one list per worker).
        members: ``members(layer) -> [checkpoint sites]`` in shard order
            (:meth:`qpass.checkpoint.qconfig.QpassQuantOptions.members`).
        group_of: ``group_of(site) -> fused group id``.
    Raises:
        QpassError: ranks disagree on a layer's shards, or a fused layer's widths do not match its members.
    """
    from qpass.runtime.served import ServedSite

    out: dict[str, ServedSite] = {}
    for recs, sites in _layers_by_rank(per_rank, members):
        parts: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {s: [] for s in sites}
        for r in recs:
            codes = _tensor(r["weight"], torch.uint8)
            scales = _tensor(r["weight_scale"], torch.float8_e4m3fn)
            gs = _tensor(r["weight_scale_2"], torch.float32)
            row = 0
            for i, (s, w) in enumerate(zip(sites, r["logical_widths"])):
                parts[s].append((codes[row:row + w], scales[row:row + w], gs[i].reshape(())))
                row += w
        k_sharded = recs[0]["k_sharded"]
        for s in sites:
            ps = parts[s]
            dim = 1 if k_sharded else 0
            codes = torch.cat([p[0] for p in ps], dim) if len(ps) > 1 else ps[0][0]
            scales = torch.cat([p[1] for p in ps], dim) if len(ps) > 1 else ps[0][1]
            g = ps[0][2]
            if any(not torch.equal(p[2].view(torch.int32), g.view(torch.int32)) for p in ps):
                raise QpassError(f"vLLM site {s}: tensor-parallel ranks serve different weight_scale_2 {[float(p[2]) for p in ps]}")
            out[s] = ServedSite(s, "nvfp4", codes, scales, g.clone(), group_of(s))
    return out


def assemble_served_act_only(per_rank: Sequence[Sequence[Mapping[str, Any]]], members: Any, group_of: Any) -> dict[str, Any]:
    """Per-rank :meth:`QpassWorkerExtension.qpass_served_act_only` records -> ``{site: ServedSite}``
    with ``format="unquantized"``: ``codes`` = the served weight rows ``[N, K]`` in the engine dtype
    (fused rows split by ``logical_widths``, TP shards joined along N, or K for row-parallel layers),
    ``scales`` empty ``[N, 0]`` uint8, no global scale.

    Raises:
        QpassError: ranks disagree on a layer's shards, or a fused layer's widths do not match its members.
    """
    from qpass.runtime.served import ServedSite

    out: dict[str, ServedSite] = {}
    for recs, sites in _layers_by_rank(per_rank, members):
        parts: dict[str, list[torch.Tensor]] = {s: [] for s in sites}
        for r in recs:
            w = _tensor(r["weight"], getattr(torch, r["weight"]["dtype"]))
            row = 0
            for s, n in zip(sites, r["logical_widths"]):
                parts[s].append(w[row:row + n])
                row += n
        dim = 1 if recs[0]["k_sharded"] else 0
        for s in sites:
            w = torch.cat(parts[s], dim) if len(parts[s]) > 1 else parts[s][0]
            out[s] = ServedSite(s, "unquantized", w, torch.empty((w.shape[0], 0), dtype=torch.uint8), None, group_of(s))
    return out


def assemble_served_moe(per_rank: Sequence[Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """Per-rank :meth:`QpassWorkerExtension.qpass_served_moe` records -> ``{checkpoint site: ServedSite}``
    per expert projection (``<layer>.<e>.<gate name>`` = w13 rows ``[0, I)`` with global column 0,
    ``<up name>`` = rows ``[I, 2I)`` with column 1, ``<down name>`` = w2); gate and up of one expert
    form the group ``<layer>.<e>.w13``.

    Raises:
        QpassError: ranks disagree (the plugin serves MoE layers at TP=1 only, so every rank holds all experts).
    """
    from qpass.runtime.served import ServedSite

    out: dict[str, ServedSite] = {}
    seen: dict[str, bytes] = {}
    for recs in per_rank:
        for r in recs:
            layer, names = r["layer"], r["ckpt_names"]
            digest = b"".join(r[p]["bytes"] for p in MOE_PARAMS)
            if seen.setdefault(layer, digest) != digest:
                raise QpassError(f"vLLM MoE layer {layer}: ranks serve different expert bytes")
            w13, s13, g13 = _tensor(r["w13_weight"], torch.uint8), _tensor(r["w13_weight_scale"], torch.float8_e4m3fn), _tensor(r["w13_weight_scale_2"], torch.float32)
            w2, s2, g2 = _tensor(r["w2_weight"], torch.uint8), _tensor(r["w2_weight_scale"], torch.float8_e4m3fn), _tensor(r["w2_weight_scale_2"], torch.float32)
            i = w13.shape[1] // 2
            for e in range(w13.shape[0]):
                grp = f"{layer}.{e}.w13"
                out[f"{layer}.{e}.{names['w1']}"] = ServedSite(f"{layer}.{e}.{names['w1']}", "nvfp4", w13[e, :i].clone(), s13[e, :i].clone(), g13[e, 0].clone(), grp)
                out[f"{layer}.{e}.{names['w3']}"] = ServedSite(f"{layer}.{e}.{names['w3']}", "nvfp4", w13[e, i:].clone(), s13[e, i:].clone(), g13[e, 1].clone(), grp)
                out[f"{layer}.{e}.{names['w2']}"] = ServedSite(f"{layer}.{e}.{names['w2']}", "nvfp4", w2[e].clone(), s2[e].clone(), g2[e].clone(), f"{layer}.{e}.{names['w2']}")
    return out


def _tensor(rec: Mapping[str, Any], dtype: torch.dtype) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(rec["bytes"]), dtype=torch.uint8)
    return raw.view(dtype).reshape(rec["shape"])


__all__ = ["ACT_METHOD_CLASS", "METHOD_CLASS", "assemble_served_act_only", "MOE_METHOD_CLASS", "QpassWorkerExtension", "WORKER_EXTENSION", "assemble_served", "assemble_served_moe"]
