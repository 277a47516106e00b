"""Model + rollout sites -> a checkpoint directory (the core of ``qpass export``; engines call it too).

:func:`write_checkpoint` writes a checkpoint of a registered format (:mod:`qpass.checkpoint.formats`)
from a loaded HF model (its config, every tensor in the export dtype), the NVFP4 rollout sites
(:func:`sites_from_rollout` of a rollout ``QGraph``, or the apply's ``hf_quant_config.json``) and
their checkpoint tensors, calibrating the W4A4 ``input_scale`` on given token sequences. It
writes into an existing (temporary) directory; making the result atomic is the caller's job
(``qpass export`` uses :func:`qpass.atomic.atomic_dir`; a vLLM engine writes into a fresh temp dir).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from qpass.checkpoint.formats import ExportInputs, RolloutSite, build_checkpoint, weight_arithmetic
from qpass.checkpoint.hfdir import DEFAULT_MAX_SHARD_SIZE, plain_config, plain_state, write_hf_dir
from qpass.errors import QpassError
from qpass.formats.spec import NVFP4_OP_ACT_MODES, NVFP4Spec

# activation spec key (None: W4A16) -> NVFP4 activation mode of the op (``nvfp4_static``: the
# calibrated scale a rollout graph used), as report files spell specs
ACT_OF_SPEC = {(spec.key if spec is not None else None): mode for mode, spec in NVFP4_OP_ACT_MODES.items()}
INPUT_SCALE_RULE = "S_dec = fl(1/fl(2688/group_amax)) (SPEC §3), decode multiplier, shared per fused group"


def sites_from_rollout(rollout: Any) -> dict[str, RolloutSite]:
    """The NVFP4 sites of a rollout ``QGraph`` (its quant records).

    Lowered NVFP4 sites give NVFP4-weight sites; activation-only sites (the ``act_qdq`` pass: no
    weight spec, an NVFP4 activation spec, op ``qpass::nvfp4_act_qdq``) give ``weight="none"``
    sites (the W16A4 rollout); other unlowered records (e.g. a weight fake-quant left on the
    rollout) are skipped.

    Raises:
        QpassError: a lowered site that is not NVFP4 (FP8 / MXFP4 have no checkpoint format here), or
            an activation-only site whose activation spec is not NVFP4.
    """
    out = {}
    for s, rec in rollout.quant.items():
        if not rec.lowered:
            if rec.spec is None and rec.act_spec is not None and rec.op == "qpass::nvfp4_act_qdq":
                if rec.nvfp4_act_mode() is None:
                    raise QpassError(f"rollout site {s}: activation-only spec {rec.act_spec.key} is not NVFP4")
                out[s] = RolloutSite(s, rec.group, rec.nvfp4_act_mode(), None, weight="none")
            continue
        if not rec.lowered_as(NVFP4Spec):
            raise QpassError(f"rollout site {s} is {rec.kind}; qpass export writes NVFP4 checkpoints only")
        out[s] = RolloutSite(s, rec.group, rec.nvfp4_act_mode(), rec.rac, rec.spec.arithmetic)
    return out


def engine_names(content: Any, model_type: str) -> Any:
    """``content`` with every tensor and module name in the checkpoint naming engines load for
    ``model_type`` (:func:`qpass.moe.export.engine_name`: Mixtral's ``block_sparse_moe.experts.E.w1``
    for qpass's ``mlp.experts.E.gate_proj``; other model types unchanged): tensor keys, the
    ``quantization_config`` RAC sites and excluded modules, ``hf_quant_config.json``'s lists."""
    from qpass.moe.export import engine_name

    if model_type != "mixtral":
        return content

    def ren(x: str) -> str:
        return engine_name(x, model_type)

    content.tensors = {ren(k): v for k, v in content.tensors.items()}
    qc = content.config.get("quantization_config")
    if isinstance(qc, dict):
        qc = dict(qc)
        for key in ("exclude_modules", "ignore"):
            if isinstance(qc.get(key), list):
                qc[key] = [ren(x) for x in qc[key]]
        if isinstance(qc.get("rac"), dict):
            qc["rac"] = {ren(k): v for k, v in sorted(qc["rac"].items())}
        content.config = dict(content.config) | {"quantization_config": qc}
    hf = content.extra_json.get("hf_quant_config.json")
    if isinstance(hf, dict) and isinstance(hf.get("quantization", {}).get("exclude_modules"), list):
        hf["quantization"]["exclude_modules"] = [ren(x) for x in hf["quantization"]["exclude_modules"]]
        rac = hf.get("qpass", {}).get("not_represented", {}).get("rac_sites")
        if isinstance(rac, list):
            hf["qpass"]["not_represented"]["rac_sites"] = [ren(x) for x in rac]
    return content


def write_checkpoint(
    directory: str | Path,
    fmt: str,
    *,
    model: torch.nn.Module,
    dtype: torch.dtype,
    tokenizer: Any = None,
    sites: Mapping[str, RolloutSite] | None = None,
    site_tensors: Mapping[str, torch.Tensor] | None = None,
    calibration_ids: Sequence[Sequence[int]] | None = None,
    input_amax: Mapping[str, torch.Tensor] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> dict[str, Any]:
    """Write checkpoint format ``fmt`` of ``model`` into the existing directory ``directory``.

    Args:
        model: the HF causal LM whose config and tensors (master weights) are exported.
        dtype: dtype of the unquantized tensors (bf16 / fp16 / fp32).
        sites, site_tensors: the NVFP4 rollout sites and their ``<site>.weight`` / ``weight_scale`` /
            ``weight_scale_2`` tensors (empty: nothing quantized).
        calibration_ids: token sequences the W4A4 ``input_scale`` is calibrated on (needed when a
            site quantizes activations and ``input_amax`` does not cover it).
        input_amax: ``{site: float32 0-d group amax}`` already calibrated (``qpass calibrate``, or the
            static scales the rollout graph used); sites it covers are not calibrated again.
    Returns:
        a summary (format's summary, calibration, files) for the export record.
    Raises:
        QpassError: W4A4 sites without calibration ids; sites of two weight arithmetics; see the format and
            :func:`qpass.checkpoint.hfdir.write_hf_dir`.
    """
    sites = dict(sites or {})
    record: dict[str, Any] = {}
    given = dict(input_amax or {})
    input_amax = given or None
    w4a4 = {s: r.group for s, r in sites.items() if r.needs_input_scale and s not in given}
    if w4a4 and fmt != "plain":
        from qpass.checkpoint import calibrate

        if not calibration_ids:
            raise QpassError(f"{len(w4a4)} W4A4 site(s) need calibration prompts for their input_scale")
        unreached: list[str] = []
        input_amax = given | calibrate.group_input_amax(calibrate.input_amax(model, w4a4, calibration_ids), w4a4, unreached)
        record["calibration"] = {"sequences": len(calibration_ids), "tokens": sum(len(i) for i in calibration_ids),
                                 "input_scale": INPUT_SCALE_RULE}
        if unreached:
            record["calibration"]["experts_not_reached"] = {
                "sites": sorted(unreached), "input_scale": "max over the same layer's reached experts of the same projection"}
    inputs = ExportInputs(plain_config(model, dtype), plain_state(model, dtype), sites, dict(site_tensors or {}), input_amax,
                          weight_arithmetic=weight_arithmetic(sites))
    content = engine_names(build_checkpoint(fmt, inputs), str(inputs.config.get("model_type", "")))
    record.update(content.summary, weight_arithmetic=inputs.weight_arithmetic if sites else None)
    record["files"] = write_hf_dir(directory, config=content.config, tensors=content.tensors, tokenizer=tokenizer,
                                   generation_config=getattr(model, "generation_config", None), extra_json=content.extra_json,
                                   max_shard_size=max_shard_size)
    return record
