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

Each pass entry is validated against the pass's own pydantic ``Options`` (``extra='forbid'``) in
pydantic's strict mode. The file is read by :mod:`qpass.strict_yaml`: UTF-8 only (a bad byte is
named with its offset), YAML 1.2 scalars (``yes``/``on`` are strings, never booleans or numbers),
no anchors or aliases, no repeated keys (both lines named), strings where names belong (``name``,
``pass``, ``check``), and ``name`` safe as a file name (:func:`check_name`: it becomes a path in
``qpass grpo``).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import re
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml

from qpass import strict_yaml
from qpass.errors import RecipeError
import qpass.compiler.passes  # noqa: F401 - registers the built-in passes (the pass manager never imports them)
from qpass.compiler.manager import Pass, get_pass

TOP_KEYS = ("name", "description", "learner", "rollout", "parity")

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: Recipe limits on counts that size buffers (the static KV cache has ``prompt + max_new_tokens``
#: slots per row): refused in the recipe, before any model load, instead of an allocation failure.
MAX_NEW_TOKENS = 32768
MAX_SAMPLES_PER_PROMPT = 4096


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
    samples_per_prompt: int = pydantic.Field(2, ge=1, le=MAX_SAMPLES_PER_PROMPT)
    max_new_tokens: int = pydantic.Field(24, ge=1, le=MAX_NEW_TOKENS)
    temperature: float = pydantic.Field(1.0, gt=0.0)
    top_p: float = pydantic.Field(1.0, gt=0.0, le=1.0)
    seed: int = pydantic.Field(0, ge=0, le=2**63 - 1)
    max_abs_gap: float | None = pydantic.Field(None, gt=0.0, description="fail if mean |d| exceeds this")

    @pydantic.field_validator("prompts")
    @classmethod
    def _prompts_exist(cls, v: int) -> int:
        from qpass.prompts import probe_set_size

        if v > (n := probe_set_size()):
            raise ValueError(f"the built-in probe set has {n} prompts, asked for {v}")
        return v


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


def check_name(name: str, what: str = "recipe name") -> str:
    """``name`` if it is safe as one path component: ``[A-Za-z0-9][A-Za-z0-9._-]*``, at most 128
    characters, no ``..`` (a recipe name becomes ``--out/NAME`` and ``--checkpoint-dir/NAME.pt`` in
    ``qpass grpo``).

    Raises:
        RecipeError: the rule and the name.
    """
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or ".." in name:
        raise RecipeError(f"{what} {name!r} is not a safe file name: use letters, digits, '.', '_', '-' (starting with "
                          "a letter or digit, at most 128 characters, no '..' and no path separators)")
    return name


def _loc(path: str, node: yaml.Node) -> str:
    return strict_yaml.loc(path, node)


def _plain(node: yaml.Node | None, path: str) -> Any:
    return strict_yaml.to_python(node, path, error=RecipeError)


def _mapping_items(node: yaml.Node, path: str, what: str) -> dict[str, tuple[yaml.ScalarNode, yaml.Node]]:
    if not isinstance(node, yaml.MappingNode):
        raise RecipeError(f"{_loc(path, node)}: {what} must be a mapping, got {strict_yaml.kind_of(node)}")
    return {k.value: (k, v) for k, v in node.value}  # keys are unique strings (strict_yaml.compose)


def _string(node: yaml.Node, path: str, what: str, *, empty: bool = False) -> str:
    """A plain string scalar (``pass:``, ``check:``, ``name:``...): a list, a mapping, a number or a
    boolean where a name belongs is refused, naming the line (an empty string too unless ``empty``)."""
    if not isinstance(node, yaml.ScalarNode) or node.tag != strict_yaml.STR or not (node.value or empty):
        got = "an empty value" if isinstance(node, yaml.ScalarNode) and not node.value else strict_yaml.kind_of(node)
        raise RecipeError(f"{_loc(path, node)}: {what} must be a string, got {got}")
    return node.value


def _pydantic_msg(exc: pydantic.ValidationError) -> str:
    parts = []
    for e in exc.errors():
        field = ".".join(str(x) for x in e["loc"])
        if e["type"] == "extra_forbidden":
            parts.append(f"unknown key {field!r}")
            continue
        got = e.get("input")
        hint = ""
        if isinstance(got, str) and got.lower() in strict_yaml.YAML11_BOOLEANS:
            hint = f" ({got!r} is a string here, not a boolean or a number: write true/false, or the number)"
        elif isinstance(got, (bool, int, float, str)) or got is None:
            hint = f" (got {got!r})"
        parts.append(f"{field}: {e['msg'].removeprefix('Value error, ')}{hint}")
    return "; ".join(parts)


def _validate(cls: type[pydantic.BaseModel], opts: dict[str, Any], keys: dict[str, tuple[yaml.Node, yaml.Node]],
              item: yaml.Node, path: str, what: str) -> Any:
    """``cls`` from recipe values in pydantic's strict mode (no str -> number, bool -> float or
    float -> int coercion); the message names the line of the first offending key."""
    try:
        return cls.model_validate(opts, strict=True)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]["loc"]
        node = keys[first[0]][0] if first and first[0] in keys else item
        raise RecipeError(f"{_loc(path, node)}: {what}: {_pydantic_msg(exc)}") from None


def _parse_pass(item: yaml.Node, path: str, side: str) -> Pass:
    keys = _mapping_items(item, path, f"each {side} entry")
    if "pass" not in keys:
        raise RecipeError(f"{_loc(path, item)}: {side} entry has no 'pass:' key (got keys {sorted(keys)})")
    name_node = keys["pass"][1]
    cls = _resolve_pass(_string(name_node, path, "'pass:' (a pass name)"), _loc(path, name_node))
    for k, (kn, _v) in keys.items():
        if k != "pass" and k not in cls.Options.model_fields:
            near = difflib.get_close_matches(k, list(cls.Options.model_fields), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise RecipeError(
                f"{_loc(path, kn)}: unknown key {k!r} for pass {cls.name!r}{hint}; allowed: {sorted(cls.Options.model_fields)}"
            )
    opts = {k: _plain(v, path) for k, (kn, v) in keys.items() if k != "pass"}
    options = _validate(cls.Options, opts, keys, item, path, f"pass {cls.name!r}")
    if side not in cls.sides:
        raise RecipeError(f"{_loc(path, name_node)}: pass {cls.name!r} cannot run on the {side} side (allowed: {list(cls.sides)})")
    return cls(options, line=item.start_mark.line + 1)


def _resolve_pass(name: str, where: str) -> type[Pass]:
    try:
        return get_pass(name)
    except RecipeError as exc:
        raise RecipeError(f"{where}: {exc}") from None


def _parse_check(item: yaml.Node, path: str) -> ParityCheck:
    keys = _mapping_items(item, path, "each parity entry")
    if "check" not in keys:
        raise RecipeError(f"{_loc(path, item)}: each parity entry needs a 'check:' key")
    kind = _string(keys["check"][1], path, "'check:' (a parity check name)")
    cls = CHECKS.get(kind)
    if cls is None:
        near = difflib.get_close_matches(kind, list(CHECKS), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise RecipeError(f"{_loc(path, item)}: unknown parity check {kind!r}{hint}; known: {sorted(CHECKS)}")
    data = {k: _plain(v, path) for k, (_kn, v) in keys.items()}
    return _validate(cls, data, keys, item, path, f"parity check {kind!r}")


def decode_recipe(data: bytes, path: str) -> str:
    """Recipe file bytes as text.

    Raises:
        RecipeError: not UTF-8 (names the byte, its offset, line and column) or too large.
    """
    return strict_yaml.decode_utf8(data, path, error=RecipeError)


def parse_recipe(text: str | bytes, path: str = "<recipe>") -> Recipe:
    """Validate recipe YAML text (or file bytes: decoded as UTF-8 first) with the strict loader
    (:mod:`qpass.strict_yaml`: YAML 1.2 scalars, no aliases, no duplicate keys).

    Raises:
        RecipeError: not UTF-8, YAML syntax error, alias/anchor/tag, repeated key (both lines named),
            unknown top-level key, a non-string where a name belongs (``name``, ``description``,
            ``pass``, ``check``), an unsafe ``name`` (:func:`check_name`), unknown pass or check,
            unknown or invalid option (strict types: ``ratio: yes`` or ``ratio: "0.5"`` is not a
            number), pass on the wrong side, passes in an order that breaks a ``requires``;
            messages start with ``path:line:`` (ordering errors name the recipe lines).
    """
    if isinstance(text, bytes):
        text = decode_recipe(text, path)
    if not isinstance(text, str):
        raise RecipeError(f"{path}: recipe text must be a string, got {type(text).__name__}")
    root = strict_yaml.compose(text, path, error=RecipeError)
    if root is None:
        raise RecipeError(f"{path}:1: empty recipe")
    top = _mapping_items(root, path, "a recipe")
    for k, (kn, _v) in top.items():
        if k not in TOP_KEYS:
            near = difflib.get_close_matches(k, TOP_KEYS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise RecipeError(f"{_loc(path, kn)}: unknown top-level key {k!r}{hint}; allowed: {list(TOP_KEYS)}")
    if "name" not in top:
        raise RecipeError(f"{path}:1: recipe has no 'name:'")
    name_node = top["name"][1]
    name = _string(name_node, path, "'name:'")
    try:
        check_name(name)
    except RecipeError as exc:
        raise RecipeError(f"{_loc(path, name_node)}: {exc}") from None
    description = ""
    if "description" in top:
        dnode = top["description"][1]
        if not (isinstance(dnode, yaml.ScalarNode) and dnode.tag == strict_yaml.NULL):
            description = _string(dnode, path, "'description:'", empty=True)
    lists: dict[str, list[Any]] = {"learner": [], "rollout": [], "parity": []}
    for side in lists:
        if side not in top:
            continue
        node = top[side][1]
        if isinstance(node, yaml.ScalarNode) and node.tag == strict_yaml.NULL:
            continue
        if not isinstance(node, yaml.SequenceNode):
            raise RecipeError(f"{_loc(path, node)}: '{side}:' must be a list, got {strict_yaml.kind_of(node)}")
        for item in node.value:
            lists[side].append(_parse_check(item, path) if side == "parity" else _parse_pass(item, path, side))
    from qpass.compiler.manager import validate_order

    try:
        validate_order(lists["learner"], {"sites_stamped"})
        validate_order(lists["rollout"], {"sites_stamped"})
    except RecipeError as exc:
        raise RecipeError(f"{path}: {exc}") from None
    return Recipe(name=name, description=description, learner=lists["learner"], rollout=lists["rollout"],
                  parity=lists["parity"], path=path, text=text)


def check_site_globs(recipe: Recipe, site_ids: list[str], model: str = "the model") -> None:
    """Check every pass's explicitly given ``targets`` / ``exclude`` patterns against the captured sites.

    Run right after capture, before any pass (:meth:`qpass.compiler.pipeline.Pipeline.build` calls it), so a
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
        RecipeError: file missing (the message lists the built-in names), unreadable, not UTF-8
            (names the byte offset) or invalid (:func:`parse_recipe`).
    """
    p = Path(ref)
    if not p.is_file():
        builtins = builtin_recipes()
        if ref in builtins:
            p = builtins[ref]
        elif p.name.removesuffix(".yaml") in builtins and not p.exists():
            p = builtins[p.name.removesuffix(".yaml")]
        elif p.is_dir() or p.suffix in (".yaml", ".yml") or len(p.parts) > 1:  # meant as a file
            what = "is a directory, not a recipe file" if p.is_dir() else "does not exist"
            raise RecipeError(f"recipe file {ref} {what}; built-in recipes (by name): {sorted(builtins)}")
        else:
            raise RecipeError(f"recipe {ref!r} not found; built-in recipes: {sorted(builtins)}")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise RecipeError(f"{p}: cannot read the recipe: {exc.strerror or exc}") from None
    return parse_recipe(data, str(p))
