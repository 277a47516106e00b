"""MoE expert weights in the layouts engines use: per-expert checkpoint names and FusedMoE parameters.

qpass's rollout checkpoint (``rollout/weights.safetensors``, ModelOpt ``modelopt_fp4`` names)
stores every expert site separately: ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``
(+ ``weight_scale``, ``weight_scale_2``, ``weight_global_scale``). These are the names Qwen3-MoE and
OLMoE checkpoints use, and the names vLLM's and SGLang's loaders map onto their fused MoE layer
(``FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name=
"down_proj", ckpt_up_proj_name="up_proj", num_experts)``: shard ``w1`` = gate, ``w3`` = up, ``w2`` =
down). Mixtral checkpoints name the same tensors ``block_sparse_moe.experts.E.{w1,w3,w2}``
(:func:`checkpoint_name`).

After loading, the engines hold one fused parameter set per MoE layer (vLLM
``ModelOptNvFp4FusedMoE.create_weights``; SGLang uses the same names):

    experts.w13_weight          uint8   [E, 2I, H/2]   rows [0, I) gate (w1), [I, 2I) up (w3)
    experts.w13_weight_scale    e4m3    [E, 2I, H/16]
    experts.w13_weight_scale_2  float32 [E, 2]         S_dec of gate, up
    experts.w2_weight           uint8   [E, H, I/2]
    experts.w2_weight_scale     e4m3    [E, H, I/16]
    experts.w2_weight_scale_2   float32 [E]

vLLM then keeps **one** global scale for w13: ``process_weights_after_loading`` takes
``w13_weight_scale_2[:, 0]`` (gate's) for both halves and only warns when the two columns differ
("w1_weight_scale_2 must match w3_weight_scale_2. Accuracy may be affected.") — the class of bug
in vLLM #54974. qpass quantizes gate/up of one expert as one group (SPEC §3 rule 1), so the two
columns are bit-identical and the fused dequantization equals the per-expert one
(:func:`fused_moe_params` checks it and refuses otherwise).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from qpass.errors import QpassError

_SITE = re.compile(r"^(?P<prefix>.*\.mlp)\.experts\.(?P<e>\d+)\.(?P<role>gate_proj|up_proj|down_proj)\.(?P<suffix>weight(?:_scale(?:_2)?)?)$")
_CKPT = re.compile(r"^(?P<layer>.*)\.mlp\.experts\.(?P<e>\d+)\.(?P<role>gate_proj|up_proj|down_proj)\.(?P<tail>.+)$")
MIXTRAL_ROLES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def checkpoint_name(site_tensor: str, model_type: str) -> str:
    """The Hugging Face checkpoint name of a qpass expert tensor name for ``model_type``
    (``config.json`` ``model_type``): unchanged for ``qwen3_moe``/``olmoe``/``qwen2_moe``;
    ``mixtral``: ``...mlp.experts.E.gate_proj.weight`` -> ``...block_sparse_moe.experts.E.w1.weight``."""
    m = _CKPT.match(site_tensor)
    if model_type != "mixtral" or m is None:
        return site_tensor
    return f"{m['layer']}.block_sparse_moe.experts.{m['e']}.{MIXTRAL_ROLES[m['role']]}.{m['tail']}"


_MIXTRAL_EXPERT = re.compile(r"^(?P<layer>.*)\.mlp\.experts\.(?P<e>\d+)\.(?P<role>gate_proj|up_proj|down_proj)(?P<tail>\..+)?$")
_MIXTRAL_ROUTER = re.compile(r"^(?P<layer>.*)\.mlp\.gate(?P<tail>\..+)?$")


def engine_name(name: str, model_type: str) -> str:
    """The checkpoint name engines load for a qpass module or tensor name of a ``model_type`` model.

    Unchanged except for ``mixtral``, whose Hugging Face checkpoints (what transformers'
    ``save_pretrained`` writes, and what vLLM's ``MixtralForCausalLM`` loads) keep the pre-5.x module
    names: ``model.layers.N.mlp.experts.E.gate_proj[.weight]`` ->
    ``model.layers.N.block_sparse_moe.experts.E.w1[.weight]`` (``up_proj`` -> ``w3``, ``down_proj`` ->
    ``w2``) and the router ``model.layers.N.mlp.gate[.weight]`` -> ``model.layers.N.block_sparse_moe.gate[.weight]``.
    Works on module paths (RAC sites, excluded modules) as well as tensor names.
    """
    if model_type != "mixtral":
        return name
    m = _MIXTRAL_EXPERT.match(name)
    if m:
        return f"{m['layer']}.block_sparse_moe.experts.{m['e']}.{MIXTRAL_ROLES[m['role']]}{m['tail'] or ''}"
    m = _MIXTRAL_ROUTER.match(name)
    if m:
        return f"{m['layer']}.block_sparse_moe.gate{m['tail'] or ''}"
    return name


def fused_moe_params(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert NVFP4 rollout tensors (``modelopt_fp4`` names) -> FusedMoE parameters per layer.

    Non-expert tensors are ignored; ``weight_global_scale`` (S_enc) is not part of the fused layout.

    Returns:
        ``{"<prefix>.experts.w13_weight": ..., ...}`` (see module docstring), contiguous CPU tensors.
    Raises:
        QpassError: a layer's experts are incomplete (missing role or expert index), or gate and up
            of one expert carry different ``weight_scale_2`` bits (the engines keep one w13 scale).
    """
    by: dict[str, dict[int, dict[str, dict[str, torch.Tensor]]]] = {}
    for name, t in tensors.items():
        m = _SITE.match(name)
        if m:
            by.setdefault(m["prefix"], {}).setdefault(int(m["e"]), {}).setdefault(m["role"], {})[m["suffix"]] = t
    out: dict[str, torch.Tensor] = {}
    for prefix, experts in by.items():
        n = len(experts)
        if sorted(experts) != list(range(n)):
            raise QpassError(f"{prefix}: expert indices {sorted(experts)[:8]} are not 0..{n - 1}")
        w13, s13, g13, w2, s2, g2 = [], [], [], [], [], []
        for e in range(n):
            r = experts[e]
            for role in ("gate_proj", "up_proj", "down_proj"):
                missing = {"weight", "weight_scale", "weight_scale_2"} - set(r.get(role, {}))
                if missing:
                    raise QpassError(f"{prefix}.experts.{e}.{role}: missing {sorted(missing)}")
            g, u, d = r["gate_proj"], r["up_proj"], r["down_proj"]
            if not torch.equal(g["weight_scale_2"].float().view(torch.int32), u["weight_scale_2"].float().view(torch.int32)):
                raise QpassError(f"{prefix}.experts.{e}: gate and up weight_scale_2 differ ({float(g['weight_scale_2'])} vs "
                                 f"{float(u['weight_scale_2'])}); FusedMoE keeps one w13 global scale (vLLM takes gate's), "
                                 "so up would dequantize with the wrong scale — quantize gate/up as one group")
            w13.append(torch.cat([g["weight"], u["weight"]]))
            s13.append(torch.cat([g["weight_scale"], u["weight_scale"]]))
            g13.append(torch.stack([g["weight_scale_2"].reshape(()), u["weight_scale_2"].reshape(())]).float())
            w2.append(d["weight"])
            s2.append(d["weight_scale"])
            g2.append(d["weight_scale_2"].reshape(()).float())
        p = f"{prefix}.experts."
        out.update({p + "w13_weight": torch.stack(w13), p + "w13_weight_scale": torch.stack(s13),
                    p + "w13_weight_scale_2": torch.stack(g13), p + "w2_weight": torch.stack(w2),
                    p + "w2_weight_scale": torch.stack(s2), p + "w2_weight_scale_2": torch.stack(g2)})
    return {k: v.contiguous() for k, v in out.items()}


def unfuse_moe_params(fused: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`fused_moe_params` (e.g. for an engine's read-back of its fused experts):
    per-expert ``<prefix>.experts.E.{gate,up,down}_proj.{weight,weight_scale,weight_scale_2}``.

    Raises:
        QpassError: a layer lacks one of the six fused tensors, or w13 has an odd row count.
    """
    out: dict[str, torch.Tensor] = {}
    prefixes = {k[: -len(".experts.w13_weight")] for k in fused if k.endswith(".experts.w13_weight")}
    for prefix in sorted(prefixes):
        p = f"{prefix}.experts."
        try:
            w13, s13, g13 = fused[p + "w13_weight"], fused[p + "w13_weight_scale"], fused[p + "w13_weight_scale_2"]
            w2, s2, g2 = fused[p + "w2_weight"], fused[p + "w2_weight_scale"], fused[p + "w2_weight_scale_2"]
        except KeyError as exc:
            raise QpassError(f"{prefix}: fused MoE tensor {exc.args[0]} missing") from exc
        if w13.shape[1] % 2:
            raise QpassError(f"{p}w13_weight has an odd row count {w13.shape[1]}")
        i = w13.shape[1] // 2
        for e in range(w13.shape[0]):
            q = f"{p}{e}."
            out[q + "gate_proj.weight"], out[q + "up_proj.weight"] = w13[e, :i], w13[e, i:]
            out[q + "gate_proj.weight_scale"], out[q + "up_proj.weight_scale"] = s13[e, :i], s13[e, i:]
            out[q + "gate_proj.weight_scale_2"], out[q + "up_proj.weight_scale_2"] = g13[e, 0], g13[e, 1]
            out[q + "down_proj.weight"], out[q + "down_proj.weight_scale"], out[q + "down_proj.weight_scale_2"] = w2[e], s2[e], g2[e]
    return {k: v.contiguous() for k, v in out.items()}
