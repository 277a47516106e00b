"""The study's configurations: named sides of YAML recipes, built through the normal pass manager.

Every learner and rollout configuration of ``qpass study`` is one side of a recipe: a shipped recipe
(``qpass/recipes/*.yaml``) or a study recipe (``qpass/apps/study/recipes/*.yaml``). The quick
run's layer restriction and the RAC sweep are *overrides* applied by :func:`study_recipe` to the
recipe's YAML, which is then validated by :func:`qpass.compiler.recipe.parse_recipe` like any recipe file
(unknown keys, option values, pass order) and built by :meth:`qpass.compiler.pipeline.Pipeline.build_side`
with the graph verifier on.

=================  ===================================  ===================================
configuration      learner (recipe: side)               rollout (recipe: side)
=================  ===================================  ===================================
``bf16``           ``bf16``: no passes                  ``bf16``: no passes
``w_qdq``          ``w4a16_qat``: weight_qdq
``a_qdq``          ``w16a4_qdq`` (study): act_qdq
``wa_qdq``         ``w4a4_qat``: weight_qdq, act_qdq
``bf16_fp32acc``                                        ``kernel_control`` (study): fp32_accumulate_linear
``w4a16``                                               ``w4a16_qat``: w4a16_lower
``w16a4``                                               ``w16a4_qdq`` (study): act_qdq
``w4a4``                                                ``naive_nvfp4``: w4a4_lower (act nvfp4)
``rac_*``                                               ``quads_nvfp4`` + ratio/mode/selection
``a_qdq_pt``       ``w16a4_qdq_per_token`` (study)
``wa_qdq_pt``      ``w4a4_qat_per_token`` (study)
``w16a4_pt``                                            ``w16a4_qdq_per_token`` (study)
``w4a4_pt``                                             ``w4a4_qat_per_token`` (study): act nvfp4_per_token
=================  ===================================  ===================================

The ``*_pt`` configurations are the per-token activation-scale controls of C2b and C4 (issue 13):
with dynamic *per-tensor* scales, decode (a few rows of one token) and the learner (whole
sequences) quantize the same token with different scales, which alone opens a gap; with per-token
scales each token's quantization depends on that token only.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
from pathlib import Path
from typing import Any

import yaml

from qpass.errors import QpassError
from qpass.compiler.recipe import Recipe, builtin_recipes, parse_recipe

LEARNERS: dict[str, str] = {"bf16": "bf16", "w_qdq": "w4a16_qat", "a_qdq": "w16a4_qdq", "wa_qdq": "w4a4_qat",
                            "a_qdq_pt": "w16a4_qdq_per_token", "wa_qdq_pt": "w4a4_qat_per_token"}
ROLLOUTS: dict[str, str] = {"bf16": "bf16", "bf16_fp32acc": "kernel_control", "w4a16": "w4a16_qat",
                            "w16a4": "w16a4_qdq", "w4a4": "naive_nvfp4", "w16a4_pt": "w16a4_qdq_per_token",
                            "w4a4_pt": "w4a4_qat_per_token"}
RAC_RECIPE = "quads_nvfp4"  # its residual_compensation entry is the one the RAC sweep overrides
RAC_PASS = "residual_compensation"


@dataclasses.dataclass(frozen=True)
class RACOverride:
    """RAC options the sweep sets on :data:`RAC_RECIPE`'s ``residual_compensation`` entry.

    Attributes:
        ratio: fraction of input channels compensated, in (0, 1].
        mode: ``masked`` | ``gathered``. selection: ``batch`` | ``token``.
        allow_zero_channels: accept a ratio that selects 0 channels on every site (the study's
            zero-channel invariant: such RAC must equal plain W4A4).
    """

    ratio: float
    mode: str
    selection: str
    allow_zero_channels: bool = False


def study_recipes() -> dict[str, Path]:
    """Study-only recipes by name (files ``qpass/apps/study/recipes/*.yaml``)."""
    root = importlib.resources.files("qpass.apps.study.recipes")
    return {Path(str(p)).stem: Path(str(p)) for p in root.iterdir() if str(p).endswith(".yaml")}


def recipe_path(name: str) -> Path:
    """The file of recipe ``name``: a study recipe, else a shipped one.

    Raises:
        QpassError: no such recipe (the message lists both sets).
    """
    study, shipped = study_recipes(), builtin_recipes()
    if name in study:
        return study[name]
    if name in shipped:
        return shipped[name]
    raise QpassError(f"study recipe {name!r} not found; study recipes: {sorted(study)}, shipped: {sorted(shipped)}")


def layer_targets(layers: int, roles: tuple[str, ...] | None = None) -> list[str]:
    """Site patterns of decoder layers ``[0, layers)``: every linear, or only the MLP ``roles``
    (regex fragments after ``.mlp.``, as :func:`_mlp_roles` returns them).

    Example: ``layer_targets(1, ("gate_proj", "up_proj"))`` ->
    ``[r"re:model\\.layers\\.(0)\\.mlp\\.(gate_proj|up_proj)"]``.
    """
    if layers < 1:
        raise QpassError(f"layers must be >= 1, got {layers}")
    idx = "|".join(str(i) for i in range(layers))
    tail = r"\..*" if not roles else r"\.mlp\.(" + "|".join(roles) + ")"
    return [rf"re:model\.layers\.({idx}){tail}"]


def _mlp_roles(targets: list[str], where: str) -> tuple[str, ...]:
    """Regex fragments of MLP projections: ``("gate_proj", "up_proj")`` from
    ``["*.mlp.gate_proj", "*.mlp.up_proj"]``; MoE experts ``["*.mlp.experts.*.gate_proj"]`` give
    ``(r"experts\.\d+\.gate_proj",)``."""
    roles = []
    for t in targets:
        if t.startswith("*.mlp.experts.*.") and t.count(".") == 4:
            roles.append(r"experts\.\d+\." + t.rsplit(".", 1)[1])
            continue
        if not (t.startswith("*.mlp.") and t.count(".") == 2):
            raise QpassError(f"{where}: cannot restrict RAC target {t!r} to layers (expected '*.mlp.<projection>' "
                             "or '*.mlp.experts.*.<projection>')")
        roles.append(t.rsplit(".", 1)[1])
    return tuple(roles)


def study_recipe(name: str, *, layers: int | None = None, rac: RACOverride | None = None) -> Recipe:
    """Recipe ``name`` with the study's overrides, validated as a recipe file.

    Args:
        name: a study or shipped recipe (:func:`recipe_path`).
        layers: quantize only decoder layers ``[0, layers)``: every pass entry gets
            :func:`layer_targets` (the RAC entry keeps its MLP projections); None: as written.
        rac: set ``ratio``/``mode``/``selection`` of the ``residual_compensation`` entry.
    Returns:
        The parsed :class:`Recipe`; with overrides its ``name`` gets a ``[...]`` suffix, its
        ``path`` says ``<file> + <overrides>`` and its ``text`` is the YAML that was validated.
    Raises:
        QpassError: unknown recipe, ``rac`` on a recipe without a RAC entry, or a RAC target that
            cannot be restricted to layers. RecipeError: the overridden recipe does not validate.
    """
    path = recipe_path(name)
    text = path.read_text()
    if layers is None and rac is None:
        return parse_recipe(text, str(path))
    data: dict[str, Any] = yaml.safe_load(text)
    suffix = []
    if layers is not None:
        suffix.append(f"layers<{layers}")
    if rac is not None:
        suffix.append(f"rac={rac.ratio:g}/{rac.mode}/{rac.selection}")
    seen_rac = False
    for side in ("learner", "rollout"):
        for entry in data.get(side) or []:
            is_rac = entry["pass"] == RAC_PASS
            if layers is not None:
                roles = _mlp_roles(entry.get("targets", []), f"{path} {side}") if is_rac else None
                entry["targets"] = layer_targets(layers, roles)
            if is_rac and rac is not None:
                entry.update(ratio=float(rac.ratio), mode=rac.mode, selection=rac.selection)
                if rac.allow_zero_channels:
                    entry["allow_zero_channels"] = True
                seen_rac = True
    if rac is not None and not seen_rac:
        raise QpassError(f"{path}: no {RAC_PASS!r} entry to apply {rac} to")
    recipe = parse_recipe(yaml.safe_dump(data, sort_keys=False), f"{path} + {', '.join(suffix)}")
    # the decorated name is a label (it holds '/' and spaces), never a path: set after validation
    return dataclasses.replace(recipe, name=f"{data['name']}[{', '.join(suffix)}]")


def rac_targets(layers: int | None) -> list[str]:
    """The RAC entry's targets of :data:`RAC_RECIPE` under the study's layer restriction."""
    rec = study_recipe(RAC_RECIPE, layers=layers)
    return list(next(p for p in rec.rollout if p.name == RAC_PASS).options.targets)
