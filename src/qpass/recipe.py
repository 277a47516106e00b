"""Recipe schema and loader: YAML pass lists for the learner and rollout graphs, plus the parity checks to run.

Schema (unknown keys are errors, reported as ``file:line: message``)::

    name: quads_nvfp4                 # required
    description: ...                  # optional
    learner:                          # ordered pass list for the scoring graph
      - pass: weight_qdq
    rollout:                          # ordered pass list for the step (KV-cache) graph
      - pass: w4a4_lower
        act: nvfp4
      - pass: residual_compensation
        ratio: 0.5
    parity:                           # checks `qpass apply` / `qpass check` run
      - check: structural
      - check: weights_bitexact
      - check: logprob_gap
        max_new_tokens: 24

Each pass entry is validated against the pass's own pydantic ``Options`` (``extra='forbid'``).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml

from qpass.errors import RecipeError
import qpass.passes  # noqa: F401 - registers the built-in passes (the pass manager never imports them)
from qpass.pm import Pass, get_pass

TOP_KEYS = ("name", "description", "learner", "rollout", "parity")


class StructuralCheck(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)
    check: Literal["structural"]


class BitexactCheck(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)
    check: Literal["weights_bitexact"]


class LogprobGapCheck(pydantic.BaseModel):
    """Behavioural check: sample from the rollout, score with the learner (SPEC §4 metrics)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)
    check: Literal["logprob_gap"]
    prompts: int = pydantic.Field(8, ge=1, description="number of probe prompts (from the built-in probe set)")
    samples_per_prompt: int = pydantic.Field(2, ge=1)
    max_new_tokens: int = pydantic.Field(24, ge=1)
    temperature: float = pydantic.Field(1.0, gt=0.0)
    top_p: float = pydantic.Field(1.0, gt=0.0, le=1.0)
    seed: int = 0
    max_abs_gap: float | None = pydantic.Field(None, gt=0.0, description="fail if mean |d| exceeds this")


CHECKS = {"structural": StructuralCheck, "weights_bitexact": BitexactCheck, "logprob_gap": LogprobGapCheck}
ParityCheck = StructuralCheck | BitexactCheck | LogprobGapCheck


@dataclasses.dataclass
class Recipe:
    """A validated recipe.

    Attributes:
        name, description: identity.
        learner, rollout: instantiated passes in order (each knows its recipe line).
        parity: parity checks with options.
        path: source file (None for recipes built in code).
        text: the YAML text (saved next to the rollout artifacts).
    """

    name: str
    description: str
    learner: list[Pass]
    rollout: list[Pass]
    parity: list[ParityCheck]
    path: str | None = None
    text: str = ""

    def check(self, kind: str) -> ParityCheck | None:
        return next((c for c in self.parity if c.check == kind), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "description": self.description, "path": self.path,
            "learner": [p.describe() for p in self.learner], "rollout": [p.describe() for p in self.rollout],
            "parity": [c.model_dump() for c in self.parity],
        }


def _loc(path: str, node: yaml.Node) -> str:
    return f"{path}:{node.start_mark.line + 1}"


def _plain(node: yaml.Node) -> Any:
    return yaml.safe_load(yaml.serialize(node)) if node is not None else None


def _mapping_items(node: yaml.Node, path: str, what: str) -> list[tuple[yaml.ScalarNode, yaml.Node]]:
    if not isinstance(node, yaml.MappingNode):
        raise RecipeError(f"{_loc(path, node)}: {what} must be a mapping, got {node.tag.split(':')[-1]}")
    return list(node.value)


def _pydantic_msg(exc: pydantic.ValidationError) -> str:
    parts = []
    for e in exc.errors():
        field = ".".join(str(x) for x in e["loc"])
        if e["type"] == "extra_forbidden":
            parts.append(f"unknown key {field!r}")
        else:
            parts.append(f"{field}: {e['msg']}")
    return "; ".join(parts)


def _parse_pass(item: yaml.Node, path: str, side: str) -> Pass:
    items = _mapping_items(item, path, f"each {side} entry")
    keys = {k.value: (k, v) for k, v in items}
    if "pass" not in keys:
        raise RecipeError(f"{_loc(path, item)}: {side} entry has no 'pass:' key (got keys {sorted(keys)})")
    name_node = keys["pass"][1]
    cls = _resolve_pass(name_node.value, _loc(path, name_node))
    opts = {k: _plain(v) for k, (kn, v) in keys.items() if k != "pass"}
    for k, (kn, _v) in keys.items():
        if k != "pass" and k not in cls.Options.model_fields:
            near = difflib.get_close_matches(k, list(cls.Options.model_fields), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise RecipeError(
                f"{_loc(path, kn)}: unknown key {k!r} for pass {cls.name!r}{hint}; allowed: {sorted(cls.Options.model_fields)}"
            )
    try:
        options = cls.Options(**opts)
    except pydantic.ValidationError as exc:
        raise RecipeError(f"{_loc(path, item)}: pass {cls.name!r}: {_pydantic_msg(exc)}") from None
    if side not in cls.sides:
        raise RecipeError(f"{_loc(path, name_node)}: pass {cls.name!r} cannot run on the {side} side (allowed: {list(cls.sides)})")
    return cls(options, line=item.start_mark.line + 1)


def _resolve_pass(name: str, where: str) -> type[Pass]:
    try:
        return get_pass(name)
    except RecipeError as exc:
        raise RecipeError(f"{where}: {exc}") from None


def _parse_check(item: yaml.Node, path: str) -> ParityCheck:
    data = _plain(item)
    if not isinstance(data, dict) or "check" not in data:
        raise RecipeError(f"{_loc(path, item)}: each parity entry needs a 'check:' key")
    cls = CHECKS.get(data["check"])
    if cls is None:
        near = difflib.get_close_matches(str(data["check"]), list(CHECKS), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise RecipeError(f"{_loc(path, item)}: unknown parity check {data['check']!r}{hint}; known: {sorted(CHECKS)}")
    try:
        return cls(**data)
    except pydantic.ValidationError as exc:
        raise RecipeError(f"{_loc(path, item)}: parity check {data['check']!r}: {_pydantic_msg(exc)}") from None


def parse_recipe(text: str, path: str = "<recipe>") -> Recipe:
    """Validate recipe YAML text.

    Raises:
        RecipeError: YAML syntax error, unknown top-level key, unknown pass or check, unknown or
            invalid option, pass on the wrong side, passes in an order that breaks a ``requires``;
            messages start with ``path:line:`` (ordering errors name the recipe lines).
    """
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f"{mark.line + 1}" if mark else "?"
        raise RecipeError(f"{path}:{line}: YAML syntax error: {getattr(exc, 'problem', exc)}") from None
    if root is None:
        raise RecipeError(f"{path}:1: empty recipe")
    top = {k.value: (k, v) for k, v in _mapping_items(root, path, "a recipe")}
    for k, (kn, _v) in top.items():
        if k not in TOP_KEYS:
            near = difflib.get_close_matches(k, TOP_KEYS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise RecipeError(f"{_loc(path, kn)}: unknown top-level key {k!r}{hint}; allowed: {list(TOP_KEYS)}")
    if "name" not in top:
        raise RecipeError(f"{path}:1: recipe has no 'name:'")
    lists: dict[str, list[Any]] = {"learner": [], "rollout": [], "parity": []}
    for side in lists:
        if side not in top:
            continue
        node = top[side][1]
        if isinstance(node, yaml.ScalarNode) and node.value in ("", "null", "~"):
            continue
        if not isinstance(node, yaml.SequenceNode):
            raise RecipeError(f"{_loc(path, node)}: '{side}:' must be a list")
        for item in node.value:
            lists[side].append(_parse_check(item, path) if side == "parity" else _parse_pass(item, path, side))
    from qpass.pm import validate_order

    try:
        validate_order(lists["learner"], {"sites_stamped"})
        validate_order(lists["rollout"], {"sites_stamped"})
    except RecipeError as exc:
        raise RecipeError(f"{path}: {exc}") from None
    return Recipe(
        name=str(_plain(top["name"][1])),
        description=str(_plain(top["description"][1])) if "description" in top else "",
        learner=lists["learner"], rollout=lists["rollout"], parity=lists["parity"], path=path, text=text,
    )


def check_site_globs(recipe: Recipe, site_ids: list[str], model: str = "the model") -> None:
    """Check every pass's explicitly given ``targets`` / ``exclude`` patterns against the captured sites.

    Run right after capture, before any pass (:meth:`qpass.pipeline.Pipeline.build` calls it), so a
    typo fails in seconds instead of after a long build. Default patterns (``targets: ["*"]``, the
    default ``exclude`` list) are not checked.

    Raises:
        RecipeError: ``path:line: pass NAME: targets pattern P matches no site of MODEL``, with the
            nearest site names (difflib) when there are any.
    """
    from qpass.graph.sites import _matches

    for side, passes in (("learner", recipe.learner), ("rollout", recipe.rollout)):
        for p in passes:
            for key in ("targets", "exclude"):
                if key not in p.options.model_fields_set:
                    continue
                for pat in getattr(p.options, key):
                    if any(_matches(s, pat) for s in site_ids):
                        continue
                    near = nearest_sites(pat, site_ids)
                    hint = f"; nearest: {', '.join(near)}" if near else f"; sites look like {', '.join(site_ids[:3])}"
                    raise RecipeError(f"{recipe.path or '<recipe>'}:{p.line or '?'}: {side} pass {p.name!r}: {key} pattern "
                                      f"{pat!r} matches no site of {model} ({len(site_ids)} sites){hint}")


def nearest_sites(pattern: str, site_ids: list[str], n: int = 3) -> list[str]:
    """Site names (and their layer-generalized globs, ``*.mlp.up_proj``) closest to ``pattern`` (difflib)."""
    import re

    cands = set(site_ids)
    for s in site_ids:
        cands.add(re.sub(r"\.\d+\.", ".*.", s))
        cands.add("*." + ".".join(s.split(".")[-2:]))
    bare = pattern[3:] if pattern.startswith("re:") else pattern
    return difflib.get_close_matches(bare, sorted(cands), n=n, cutoff=0.5)


def builtin_recipes() -> dict[str, Path]:
    """Shipped recipes by name (files ``recipes/*.yaml``)."""
    root = importlib.resources.files("qpass.recipes")
    return {Path(str(p)).stem: Path(str(p)) for p in root.iterdir() if str(p).endswith(".yaml")}


def load_recipe(ref: str) -> Recipe:
    """Load a recipe from a path or a built-in name (``quads_nvfp4``).

    Raises:
        RecipeError: file missing (the message lists the built-in names) or invalid.
    """
    p = Path(ref)
    if not p.is_file():
        builtins = builtin_recipes()
        if ref in builtins:
            p = builtins[ref]
        elif p.name.removesuffix(".yaml") in builtins and not p.exists():
            p = builtins[p.name.removesuffix(".yaml")]
        else:
            raise RecipeError(f"recipe {ref!r} not found; built-in recipes: {sorted(builtins)}")
    return parse_recipe(p.read_text(), str(p))
