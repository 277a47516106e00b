"""The strict recipe loader (issue 31 item 4): every lenient reading of the old loader is refused,
naming the file and line.

Old code (a264965, ``yaml.compose`` + ``yaml.safe_load`` + lax pydantic): a repeated key silently
dropped the first value, ``ratio: yes`` became 1.0, a list where a pass name belongs crashed with
TypeError, aliases expanded without bound, a non-UTF-8 file raised UnicodeDecodeError, and a recipe
name with ``../`` was accepted (it becomes a path in ``qpass grpo``).
"""

from __future__ import annotations

import pytest

from qpass.errors import RecipeError
from qpass.recipe import load_recipe, parse_recipe

RAC = "name: x\nrollout:\n  - pass: w4a4_lower\n  - pass: residual_compensation\n"


def _err(text: str | bytes) -> str:
    with pytest.raises(RecipeError) as ei:
        parse_recipe(text, "r.yaml")
    return str(ei.value)


# ----------------------------------------------------------------------------- duplicate keys


def test_duplicate_keys_are_refused_naming_both_lines():
    # old: the second 'rollout:' silently replaced the first pass list
    msg = _err("name: x\nrollout:\n  - pass: w4a4_lower\nlearner: []\nrollout: []\n")
    assert msg == "r.yaml:5: duplicate key 'rollout' (first at line 2); each key may appear once"
    # inside a pass entry: old kept ratio 0.9
    msg = _err(RAC + "    ratio: 0.5\n    ratio: 0.9\n")
    assert msg.startswith("r.yaml:6: duplicate key 'ratio' (first at line 5)")
    msg = _err("name: x\nname: y\n")
    assert msg.startswith("r.yaml:2: duplicate key 'name' (first at line 1)")
    msg = _err("name: x\nparity:\n  - check: logprob_gap\n    prompts: 2\n    prompts: 3\n")
    assert msg.startswith("r.yaml:5: duplicate key 'prompts' (first at line 4)")


# ----------------------------------------------------------------------------- structural types


@pytest.mark.parametrize(("text", "expected"), [
    ("name: x\nrollout:\n  - pass: [w4a4_lower]\n", "r.yaml:3: 'pass:' (a pass name) must be a string, got a list"),
    ("name: x\nrollout:\n  - pass: {a: 1}\n", "r.yaml:3: 'pass:' (a pass name) must be a string, got a mapping"),
    ("name: x\nrollout:\n  - pass: 7\n", "r.yaml:3: 'pass:' (a pass name) must be a string, got int '7'"),
    ("name: x\nrollout:\n  - pass:\n", "r.yaml:3: 'pass:' (a pass name) must be a string, got an empty value"),
    ("name: x\nparity:\n  - check: [structural]\n", "r.yaml:3: 'check:' (a parity check name) must be a string, got a list"),
    ("name: [a, b]\n", "r.yaml:1: 'name:' must be a string, got a list"),
    ("name: 12\n", "r.yaml:1: 'name:' must be a string, got int '12'"),
    ("name: true\n", "r.yaml:1: 'name:' must be a string, got bool 'true'"),
    ("name: x\ndescription: [a]\n", "r.yaml:2: 'description:' must be a string, got a list"),
    ("name: x\nrollout: {pass: w4a4_lower}\n", "r.yaml:2: 'rollout:' must be a list, got a mapping"),
    ("name: x\nrollout:\n  - w4a4_lower\n", "r.yaml:3: each rollout entry must be a mapping, got str 'w4a4_lower'"),
    ("name: x\n? [a]\n: 1\n", "r.yaml:2: mapping keys must be plain strings, got a list"),
    ("name: x\n1: 2\n", "r.yaml:2: mapping keys must be plain strings, got int '1'"),
    ("- name: x\n", "r.yaml:1: a recipe must be a mapping, got a list"),
    ("just text\n", "r.yaml:1: a recipe must be a mapping, got str 'just text'"),
])
def test_structural_fields_are_typed(text, expected):
    assert _err(text) == expected


def test_option_values_are_strictly_typed():
    assert "targets: Input should be a valid list" in _err(RAC + '    targets: "*.mlp.up_proj"\n')
    assert "targets.0: Input should be a valid string" in _err(RAC + "    targets: [1]\n")
    # old: "0.5" (a string) was coerced to 0.5 and 1.0 to the integer 1
    assert "ratio: Input should be a valid number (got '0.5')" in _err(RAC + '    ratio: "0.5"\n')
    assert "expect_matches: Input should be a valid integer (got 1.0)" in _err(RAC + "    expect_matches: 1.0\n")
    r = parse_recipe(RAC + "    ratio: 1\n    allow_zero_channels: true\n")  # int -> float is exact; true is a boolean
    assert r.rollout[1].options.ratio == 1.0 and r.rollout[1].options.allow_zero_channels is True


def test_bad_value_names_the_line_of_its_key():
    msg = _err(RAC + "    mode: masked\n    ratio: 1.5\n")
    assert msg.startswith("r.yaml:6: pass 'residual_compensation': ratio: Input should be less than or equal to 1")


# ----------------------------------------------------------------------------- YAML 1.1 booleans and numbers


@pytest.mark.parametrize("word", ["yes", "Yes", "on", "ON", "y", "no", "off", "n"])
def test_yaml11_booleans_are_never_numbers(word):
    # old: yes/on -> True -> ratio 1.0 (RAC on every channel); no/off -> 0.0
    msg = _err(RAC + f"    ratio: {word}\n")
    assert msg.startswith("r.yaml:5: pass 'residual_compensation': ratio: Input should be a valid number")
    assert f"{word!r} is a string here, not a boolean or a number: write true/false" in msg


def test_yaml11_booleans_are_not_booleans_either():
    msg = _err("name: x\nlearner:\n  - pass: weight_qdq\n  - pass: act_qdq\n    per_token: yes\n")
    assert "per_token: Input should be a valid boolean" in msg and "write true/false" in msg
    assert parse_recipe("name: x\nlearner:\n  - pass: weight_qdq\n  - pass: act_qdq\n    per_token: True\n").learner[1].options.per_token


def test_yaml12_numbers():
    # YAML 1.2: '1e-1' is a float (PyYAML 1.1: a string), '0.5' a float, sexagesimal '1:30' (1.1: 90) a string
    assert parse_recipe(RAC + "    ratio: 1e-1\n").rollout[1].options.ratio == 0.1
    assert "ratio: Input should be a valid number (got '0:30')" in _err(RAC + "    ratio: 0:30\n")
    assert parse_recipe("name: x\nparity:\n  - check: logprob_gap\n    seed: 0x10\n").parity[0].seed == 16
    assert parse_recipe("name: x\nparity:\n  - check: logprob_gap\n    seed: 010\n").parity[0].seed == 10  # 1.1: octal 8


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", ".NaN"])
def test_non_finite_numbers_are_refused(value):
    msg = _err(f"name: x\nparity:\n  - check: logprob_gap\n    temperature: {value}\n")
    assert msg == f"r.yaml:4: {value!r} is not a finite number"


# ----------------------------------------------------------------------------- aliases, tags, size


def _bomb(levels: int, width: int = 9) -> str:
    items = ["&a0 [" + ",".join(['"lol"'] * width) + "]"]
    items += [f"&a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "name: x\ndescription:\n" + "".join(f"  - {it}\n" for it in items)


def test_aliases_and_anchors_are_refused():
    # old: accepted (and expanded when the description was read)
    assert _err(_bomb(3)).startswith("r.yaml:3: YAML anchor &a0 is not allowed")
    msg = _err("name: x\nrollout:\n  - pass: w4a4_lower\n    targets: *t\n")
    assert msg.startswith("r.yaml:4: YAML alias *t is not allowed")
    assert "anchor" in _err("name: &n x\n")
    assert "anchor &base" in _err("name: x\nrollout:\n  - &base {pass: w4a4_lower}\n  - <<: *base\n")


def test_a_1kb_alias_bomb_fails_fast():
    """Old code: 9 levels of 9 aliases (9^9 strings) grew to 2.3 GB over ~65 s; refused while parsing now."""
    text = _bomb(9)
    assert len(text) < 1024
    assert _err(text).startswith("r.yaml:3: YAML anchor &a0 is not allowed")


@pytest.mark.parametrize(("text", "part"), [
    ("name: !!python/object/apply:os.system [echo]\n", "YAML tag 'tag:yaml.org,2002:python/object/apply:os.system' is not allowed"),
    ("name: x\ndescription: !!binary aGk=\n", "YAML tag 'tag:yaml.org,2002:binary' is not allowed"),
    ("name: x\ndescription: !custom hi\n", "YAML tag '!custom' is not allowed"),
    ("name: x\n---\nname: y\n", "YAML syntax error: expected a single document"),
    ("name: x\ndescription: " + "[" * 200 + "]" * 200 + "\n", "nesting too deep"),
    ("name: x\nparity:\n  - check: logprob_gap\n    temperature: !!float yes\n", "'yes' is not a valid float"),
])
def test_tags_documents_and_depth(text, part):
    assert part in _err(text)


def test_oversized_recipe_is_refused():
    assert "a qpass YAML input is at most 1048576 bytes" in _err(b"name: x\n" + b"# pad\n" * 200_000)


# ----------------------------------------------------------------------------- encoding


def test_non_utf8_recipe_names_file_and_byte_offset(tmp_path):
    f = tmp_path / "latin1.yaml"
    f.write_bytes("name: x\n# caf\u00e9\nrollout: []\n".encode("latin-1"))
    with pytest.raises(RecipeError) as ei:  # old: UnicodeDecodeError (a traceback, exit 1)
        load_recipe(str(f))
    assert str(ei.value) == (f"{f}: not UTF-8 text: byte 0xe9 at offset 13 (line 2, column 6): invalid continuation byte; "
                             "save the file as UTF-8")
    f.write_bytes(b"\xef\xbb\xbfname: bom\n")  # a UTF-8 BOM is fine
    assert load_recipe(str(f)).name == "bom"


def test_unreadable_recipe_is_a_recipe_error(tmp_path):
    d = tmp_path / "dir.yaml"
    d.mkdir()
    with pytest.raises(RecipeError, match="is a directory, not a recipe file"):
        load_recipe(str(d))


# ----------------------------------------------------------------------------- names that become paths


@pytest.mark.parametrize("name", ["../evil", "../../x", "a/b", "/abs", "a\\\\b", "..", ".hidden", "-flag", "a..b", "a b",
                                  "x" * 129, "'\"\"'"])
def test_unsafe_recipe_names_are_refused(name):
    msg = _err(f"name: {name}\n")
    assert msg.startswith("r.yaml:1: recipe name ") and "is not a safe file name" in msg


@pytest.mark.parametrize("name", ["quads_nvfp4", "w4a4-qat.v2", "A1", "x" * 128])
def test_safe_recipe_names_are_accepted(name):
    assert parse_recipe(f"name: {name}\n").name == name


# ----------------------------------------------------------------------------- values validated with the recipe


def test_site_patterns_are_validated_with_the_recipe():
    # old: a bad regex raised re.error when the pass first matched sites (after load and capture)
    msg = _err(RAC + '    targets: ["re:model\\\\.layers\\\\.(0"]\n')
    assert msg.startswith("r.yaml:5: pass 'residual_compensation': targets: pattern 're:model\\\\.layers\\\\.(0' is not a valid "
                          "regular expression: missing ), unterminated subpattern")
    assert "exclude: an empty site pattern matches nothing" in _err("name: x\nrollout:\n  - pass: w4a4_lower\n    exclude: ['']\n")


def test_counts_are_checked_against_the_probe_set_and_buffer_limits():
    # old: accepted; prompts > 24 raised ValueError after the model load, a huge max_new_tokens sized the KV cache
    assert "prompts: the built-in probe set has 24 prompts, asked for 25" in _err(
        "name: x\nparity:\n  - check: logprob_gap\n    prompts: 25\n")
    assert "max_new_tokens: Input should be less than or equal to 32768" in _err(
        "name: x\nparity:\n  - check: logprob_gap\n    max_new_tokens: 1000000000\n")
    assert parse_recipe("name: x\nparity:\n  - check: logprob_gap\n    prompts: 24\n").parity[0].prompts == 24
