"""``qpass calibrate`` and its users (issue 31 item 6): static RAC channels and static activation scales.

Fast tier: the session's tiny Llama as an HF dir with a character tokenizer; one calibration of a
static recipe (static activation scale + static RAC) and one of a static-RAC-only recipe per module.
The slow test calibrates, applies and checks a static recipe on the default model.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qpass.apps.cli import main as cli_main
from qpass.calibration.record import JSON_NAME, TENSORS_NAME, load_calibration
from qpass.calibration.source import ActivationSource, CalibrationError
from qpass.errors import QpassError
from qpass.quant.nvfp4 import global_scales

STATIC = """name: static_tiny
description: static activation scale + static RAC (the TensorRT-LLM NVFP4_ARC form)
learner:
  - pass: weight_qdq
rollout:
  - pass: w4a4_lower
    act: nvfp4
    act_scale: static
  - pass: residual_compensation
    ratio: 0.25
    selection: static
parity:
  - check: structural
  - check: weights_bitexact
"""
RAC_ONLY = STATIC.replace("name: static_tiny", "name: rac_static_tiny").replace("    act_scale: static\n", "")


def bits(t: torch.Tensor) -> int:
    return int(t.detach().float().reshape(()).view(torch.int32))


@pytest.fixture(scope="module")
def tiny(tiny_pipeline, tmp_path_factory):
    """(HF dir, pipeline with its tokenizer, recipe paths, STATIC calibration dir, RAC_ONLY calibration dir)."""
    from qpass.apps.calibrate import run_calibrate
    from qpass.graph.model import load_model
    from tests.test_export import char_tokenizer

    root = tmp_path_factory.mktemp("calib")
    hf = root / "tiny_hf"
    tiny_pipeline.loaded.model.save_pretrained(hf)
    char_tokenizer().save_pretrained(hf)
    lm = load_model(str(hf))
    pipe = dataclasses.replace(tiny_pipeline, loaded=dataclasses.replace(tiny_pipeline.loaded, tokenizer=lm.tokenizer, source=str(hf)))
    recipes = {}
    for name, text in (("static", STATIC), ("rac", RAC_ONLY)):
        recipes[name] = root / f"{name}.yaml"
        recipes[name].write_text(text)
    cals = {}
    for name in recipes:
        cals[name] = root / f"cal_{name}"
        run_calibrate(str(recipes[name]), cals[name], model=str(hf), pipeline=pipe, num_prompts=4)
    return hf, pipe, recipes, cals


def _site_inputs(model, sites, token_ids):
    """Each site's input rows over the prompts, by forward pre-hooks written here (an independent path)."""
    rows = {s: [] for s in sites}
    mods = dict(model.named_modules())
    hooks = [mods[s].register_forward_pre_hook(lambda m, a, s=s: rows[s].append(a[0].detach().reshape(-1, a[0].shape[-1])))
             for s in sites]
    try:
        with torch.no_grad():
            for ids in token_ids:
                model(input_ids=torch.tensor([list(ids)]))
    finally:
        for h in hooks:
            h.remove()
    return {s: torch.cat(r) for s, r in rows.items()}


# ----------------------------------------------------------------------------- the file


def test_calibration_file_records_data_method_model_and_recipe(tiny):
    from qpass.calibration.measure import model_fingerprint
    from qpass.prompts import encode_chat, probe_prompts

    hf, pipe, recipes, cals = tiny
    cal = load_calibration(cals["static"])
    doc = json.loads((cals["static"] / JSON_NAME).read_text())
    ids = encode_chat(pipe.tokenizer, probe_prompts(4))
    assert cal.token_ids == tuple(tuple(i) for i in ids)
    assert doc["data"]["prompts"] == 4 and doc["data"]["tokens"] == sum(len(i) for i in ids)
    assert doc["data"]["tokens_per_prompt"] == [len(i) for i in ids] and doc["data"]["file_sha256"] is None
    assert "probe prompts" in doc["data"]["source"] and len(doc["data"]["prompts_sha256"]) == 64
    assert doc["model"]["weights_sha256"] == model_fingerprint(pipe.loaded.model) and doc["model"]["ref"] == str(hf)
    assert doc["recipe"]["name"] == "static_tiny" and doc["recipe"]["text"] == STATIC
    assert doc["recipe"]["static_act_sites"] == 14 and doc["recipe"]["static_rac_sites"] == 4
    assert set(doc["method"]) >= {"input_amax", "input_scale", "rac_channels"}
    # 15 linear sites (14 decoder + lm_head), every one with an amax; q/k/v and gate/up share one input scale
    assert len(cal.amax) == 15 and sorted(cal.rac) == sorted(f"model.layers.{i}.mlp.{p}_proj" for i in (0, 1) for p in ("gate", "up"))
    for i in (0, 1):
        qkv = [f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv"]
        assert len({bits(cal.input_scale(s)) for s in qkv}) == 1
        assert bits(cal.input_scale(qkv[0])) == bits(global_scales(torch.stack([cal.amax[s] for s in qkv]).amax())[1])
    t = load_file(str(cals["static"] / TENSORS_NAME))
    for s in cal.amax:
        enc, dec = global_scales(cal.group_amax(s))
        assert bits(t[f"{s}.input_scale"]) == bits(dec) and bits(t[f"{s}.input_global_scale"]) == bits(enc)
    # deterministic bytes: calibrating again gives the same files
    from qpass.apps.calibrate import run_calibrate

    again = cals["static"].parent / "again"
    run_calibrate(str(recipes["static"]), again, model=str(hf), pipeline=pipe, num_prompts=4)
    for name in (JSON_NAME, TENSORS_NAME):
        assert (again / name).read_bytes() == (cals["static"] / name).read_bytes(), name


def test_calibrated_channels_and_scales_equal_the_passes_pick_on_the_same_data(tiny):
    """The file's channels == the residual_compensation pass's static pick (ActivationSource, the one
    channel function) on activations captured here; act_amax == the group max of max|x|, bit for bit."""
    from qpass.calibration.run import graph_constants
    from qpass.quant.rac import static_channels
    from qpass.recipe import load_recipe

    _, pipe, recipes, cals = tiny
    cal = load_calibration(cals["static"])
    sites = list(cal.amax)
    acts = _site_inputs(pipe.loaded.model, sites, cal.token_ids)
    src = ActivationSource(acts)
    rollout = pipe.build_side(load_recipe(str(recipes["static"])), "rollout", calibration=src)
    amax, ch = graph_constants(rollout)
    assert len(amax) == 14 and len(ch) == 4
    for s, a in amax.items():
        members = [m for m in sites if cal.groups[m] == cal.groups[s]]
        want = torch.stack([acts[m].abs().amax().float() for m in members]).amax()
        assert bits(a) == bits(want) == bits(cal.group_amax(s)), s
    for s, c in ch.items():
        from qpass.formats.spec import NVFP4_ACT_STATIC

        assert torch.equal(c, cal.rac[s].channels), s
        assert torch.equal(c, static_channels(acts[s], 0.25, act_spec=NVFP4_ACT_STATIC, act_amax=amax[s])), s
    # the RAC-only recipe scores under the dynamic activation quantizer: plain static_channels
    cal2 = load_calibration(cals["rac"])
    for s, e in cal2.rac.items():
        assert e.act == "nvfp4" and torch.equal(e.channels, static_channels(acts[s], 0.25)), s
    # rollout built from the file = rollout built from the activations
    amax_f, ch_f = graph_constants(pipe.build_side(load_recipe(str(recipes["static"])), "rollout", calibration=cal))
    assert {s: bits(a) for s, a in amax_f.items()} == {s: bits(a) for s, a in amax.items()}
    assert all(torch.equal(ch_f[s], ch[s]) for s in ch)


def test_static_channels_tie_break_toward_the_lower_channel():
    from qpass.quant.rac import static_channels

    x = torch.zeros(4, 32, dtype=torch.float32)
    x[:, [3, 7, 20, 21]] = 1.0 / 3.0  # equal residual energy in four channels
    assert static_channels(x, 2 / 32).tolist() == [3, 7]


# ----------------------------------------------------------------------------- static activation numerics


def test_static_activation_scale_follows_spec3_with_the_calibrated_amax():
    from qpass.formats.spec import NVFP4_ACT, NVFP4_ACT_STATIC
    from qpass.quant.linear import w4a4_linear_reference
    from qpass.quant.nvfp4 import nvfp4_dequantize, nvfp4_operand, nvfp4_quantize, nvfp4_quantize_static

    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    amax = x.float().abs().amax()
    # with the amax of the input itself, the static quantizer is the dynamic one, bit for bit
    a, b = nvfp4_quantize_static(x, amax, spec=NVFP4_ACT_STATIC), nvfp4_quantize(x, spec=NVFP4_ACT)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
    assert bits(a.s_dec) == bits(b.s_dec)
    # an input twice the calibrated range saturates: block scale 448 (0x7E), |code| 6, value 6*448*S_dec
    cal = torch.tensor(1.5)
    xs = torch.zeros(1, 16)
    xs[0, 0], xs[0, 1] = 3.0, -3.0
    q = nvfp4_quantize_static(xs, cal)
    s_enc, s_dec = global_scales(cal)
    assert q.scales.view(torch.uint8).tolist() == [[0x7E]] and bits(q.s_dec) == bits(s_dec)
    assert q.codes[0, 0].item() == 0x7 | (0xF << 4)  # +6 low nibble, -6 high nibble
    assert nvfp4_dequantize(q, torch.float32)[0, 0].item() == ((torch.tensor(6.0) * 448.0) * s_dec).item()
    with pytest.raises(QpassError, match="stale amax"):  # the dynamic quantizer refuses what a static scale accepts
        nvfp4_quantize(xs, amax=cal)
    # the W4A4 linear with a static scale multiplies that operand (SPEC §3.1: B_X @ B_W^T, alpha once)
    w = nvfp4_quantize(torch.randn(32, 64, generator=g).to(torch.bfloat16))
    y = w4a4_linear_reference(x, w, act_spec=NVFP4_ACT_STATIC, act_amax=torch.tensor(0.5))
    xq = nvfp4_quantize_static(x, torch.tensor(0.5))
    alpha = xq.s_dec.float() * w.s_dec.float()
    assert torch.equal(y, ((nvfp4_operand(xq) @ nvfp4_operand(w).t()) * alpha).to(x.dtype))
    with pytest.raises(QpassError, match="no calibrated amax"):
        w4a4_linear_reference(x, w, act_spec=NVFP4_ACT_STATIC)


def test_static_scale_option_validation_and_kernel_refusal(tiny_pipeline):
    from qpass.errors import RecipeError
    from qpass.recipe import parse_recipe
    from qpass.tables import KernelMissingError

    with pytest.raises(RecipeError, match="act_scale: static needs act: nvfp4"):
        parse_recipe("name: x\nrollout:\n  - pass: w4a4_lower\n    act: nvfp4_per_token\n    act_scale: static\n")
    from qpass.apps.cliutil import exit_status

    with pytest.raises(QpassError, match="needs calibrated input scales; run `qpass calibrate RECIPE --out CAL` and pass "
                                         "--calibration CAL") as ei:
        tiny_pipeline.build_side(parse_recipe("name: x\nrollout:\n  - pass: w4a4_lower\n    act_scale: static\n"), "rollout")
    assert exit_status(ei.value) == 2
    import qpass.backends.triton  # noqa: F401 - registers the triton kernels (no static scale)

    src = ActivationSource({}, amax={s: torch.tensor(2.0) for s in tiny_pipeline.base_step.sites})
    with pytest.raises(KernelMissingError, match="no static .calibrated. activation scale"):
        tiny_pipeline.build_side(parse_recipe("name: x\nrollout:\n  - pass: w4a4_lower\n    act_scale: static\n"), "rollout",
                                 calibration=src, kernels="triton")


def test_static_recipe_decode_is_free_of_host_syncs_under_capture_and_observed(tiny):
    """The static scale and the amax tape never read a device value on the host: a decode step captured
    under the host-sync detector equals the eager one; the tape records eager calls only."""
    from qpass.quant.observe import observe_input_amax
    from qpass.recipe import load_recipe
    from qpass.runtime.cuda_graph import DecodeGraph
    from qpass.runtime.engine import make_rollout_engine
    from tests.test_grpo_long import SyncFreeCapture

    _, pipe, recipes, cals = tiny
    rollout = pipe.build_side(load_recipe(str(recipes["static"])), "rollout", calibration=load_calibration(cals["static"]))
    prompts = [[3, 11, 12, 2, 13], [3, 14], [3, 15, 16]]
    eager = make_rollout_engine("qpass", qg=rollout, pad_token_id=0, eos_token_id=[1], cuda_graphs="off")
    with observe_input_amax() as tape:
        a = eager.generate(prompts, max_new_tokens=6, seed=5)
    assert len(tape.amax) == 14 and set(tape.calls.values()) == {6}  # prefill + 5 decode steps per site
    graphed = make_rollout_engine("qpass", qg=rollout, pad_token_id=0, eos_token_id=[1], cuda_graphs="off")
    fake = SyncFreeCapture()
    graphed.decode = DecodeGraph(graphed.gm, mode="on", device=torch.device("cuda"), backend=fake)
    b = graphed.generate(prompts, max_new_tokens=6, seed=5)
    assert graphed.decode.status == "captured" and fake.captures == 1
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.logq, b.logq)


# ----------------------------------------------------------------------------- apply / check / export


@pytest.fixture(scope="module")
def applied(tiny, tmp_path_factory):
    from qpass.apps.apply import ApplyOptions, run_apply

    hf, pipe, recipes, cals = tiny
    out = tmp_path_factory.mktemp("apply") / "static"
    status, report = run_apply(str(recipes["static"]), out, ApplyOptions(model=str(hf), calibration=cals["static"], behavioral=False,
                                                                         floor=False, batch_size=4, prompts=1, samples=1,
                                                                         max_new_tokens=2), pipeline=pipe)
    assert status == 0, report["parity"]["problems"]
    return out, report


def test_apply_builds_the_rollout_from_the_calibration_and_check_verifies_it(tiny, applied):
    from qpass.apps.apply import ApplyOptions
    from qpass.apps.check import run_check

    hf, pipe, _, cals = tiny
    out, report = applied
    cal = load_calibration(cals["static"])
    rec = report["artifacts"]["calibration"]
    assert rec["sha256"] == cal.meta["sha256"] and rec["static_act_sites_used"] == 14 and rec["static_rac_sites_used"] == 4
    for name in (JSON_NAME, TENSORS_NAME):
        assert (out / "calibration" / name).read_bytes() == (cals["static"] / name).read_bytes()
        assert f"calibration/{name}" in report["artifacts"]["sha256"]
    w = load_file(str(out / "rollout" / "weights.safetensors"))
    assert sorted(k for k in w if k.endswith(".rac_channels")) == sorted(f"{s}.rac_channels" for s in cal.rac)
    for s in cal.rac:
        assert torch.equal(w[f"{s}.rac_channels"], cal.rac[s].channels)
    for s in [k[: -len(".input_amax")] for k in w if k.endswith(".input_amax")]:
        assert bits(w[f"{s}.input_amax"]) == bits(cal.group_amax(s))
    qcfg = json.loads((out / "rollout" / "hf_quant_config.json").read_text())["quantization"]
    assert qcfg["input_activations"]["dynamic"] is False
    assert qcfg["sites"]["model.layers.0.mlp.gate_proj"]["act_spec"] == "nvfp4.activation.per_tensor.static"
    status, res = run_check(str(out), ApplyOptions(model=str(hf)), pipeline=pipe)
    assert status == 0 and res["calibration"]["sha256"] == cal.meta["sha256"], res.get("failures")


def test_check_names_the_site_whose_saved_channels_are_not_the_calibrations(tiny, applied, tmp_path):
    from qpass.apps.apply import ApplyOptions
    from qpass.apps.check import run_check

    hf, pipe, _, _ = tiny
    out, _ = applied
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    wpath = bad / "rollout" / "weights.safetensors"
    w = load_file(str(wpath))
    site = "model.layers.1.mlp.up_proj"
    ch = w[f"{site}.rac_channels"]
    w[f"{site}.rac_channels"] = torch.tensor(sorted(set(range(64)) - set(ch.tolist()))[: ch.numel()], dtype=torch.int64)
    save_file(w, str(wpath), metadata={"format": "qpass-rollout"})
    status, res = run_check(str(bad), ApplyOptions(model=str(hf)), pipeline=pipe, checksums=False)
    assert status == 1
    assert any(f"{site}.rac_channels are not the static RAC channels of calibration" in f for f in res["failures"])
    # a tampered calibration copy in the apply output: with checksums exit 1 (report.json), without exit 2 (its own sha256)
    t = bad / "calibration" / TENSORS_NAME
    raw = bytearray(t.read_bytes())
    raw[-3] ^= 0x40
    t.write_bytes(bytes(raw))
    status, res = run_check(str(bad), ApplyOptions(model=str(hf)), pipeline=pipe)
    assert status == 1 and any("calibration/calibration.safetensors" in f for f in res["failures"])
    with pytest.raises(CalibrationError, match=r"calibration\.safetensors: sha256 differs"):
        run_check(str(bad), ApplyOptions(model=str(hf)), pipeline=pipe, checksums=False)


def test_export_writes_input_scale_and_static_channels_where_consumers_read_them(tiny, applied, tmp_path):
    from qpass.apps.export import export_checkpoint
    from qpass.checkpoint.hfdir import read_hf_tensors

    hf, pipe, recipes, cals = tiny
    out, _ = applied
    cal = load_calibration(cals["static"])
    # modelopt_fp4 from the static apply: input_scale per W4A4 site = S_dec of the group amax the rollout used
    rec = export_checkpoint(tmp_path / "mo", "modelopt", src=out)
    t = read_hf_tensors(tmp_path / "mo")
    sites = [k[: -len(".input_scale")] for k in t if k.endswith(".input_scale")]
    assert len(sites) == 14 and rec["input_scale_from"]["static_act_sites"] == 14
    for s in sites:
        assert bits(t[f"{s}.input_scale"]) == bits(cal.input_scale(s)), s
    hq = json.loads((tmp_path / "mo" / "hf_quant_config.json").read_text())
    assert hq["quantization"]["quant_algo"] == "NVFP4" and hq["qpass"]["not_represented"]["dynamic_activation_scales"] is False
    # the qpass format refuses a static activation scale (its engine plugins quantize dynamically)
    with pytest.raises(QpassError, match="--format modelopt"):
        export_checkpoint(tmp_path / "qp", "qpass", src=out)
    # static RAC with dynamic activations, --recipe source: qpass format keeps <site>.rac_channels;
    # a dynamic W4A4 site takes input_scale from --calibration (no probe prompts run)
    rec = export_checkpoint(tmp_path / "qr", "qpass", model=str(hf), recipe=str(recipes["rac"]), calibration=cals["rac"])
    t = read_hf_tensors(tmp_path / "qr")
    cal2 = load_calibration(cals["rac"])
    for s, e in cal2.rac.items():
        assert torch.equal(t[f"{s}.rac_channels"], e.channels), s
    for s in [k[: -len(".input_scale")] for k in t if k.endswith(".input_scale")]:
        assert bits(t[f"{s}.input_scale"]) == bits(cal2.input_scale(s)), s
    assert "calibration" not in rec and rec["static_rac_sites"] == 4
    qc = json.loads((tmp_path / "qr" / "config.json").read_text())["quantization_config"]
    assert qc["rac"]["model.layers.0.mlp.gate_proj"]["selection"] == "static"
    from qpass.checkpoint.qconfig import QpassQuantOptions

    with pytest.raises(QpassError, match="do not serve static RAC"):  # what the engine plugins parse
        QpassQuantOptions.from_config(qc)


# ----------------------------------------------------------------------------- bad input (CLI rows)


def _corrupt_copy(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    if how == "flip_tensor_byte":
        p = dst / TENSORS_NAME
        raw = bytearray(p.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        p.write_bytes(bytes(raw))
    elif how == "edit_json_ratio":
        p = dst / JSON_NAME
        doc = json.loads(p.read_text())
        next(iter(doc["rac"].values()))["ratio"] = 0.5
        p.write_text(json.dumps(doc))
    elif how == "not_json":
        (dst / JSON_NAME).write_bytes(b"\xff\xfe{")
    elif how == "missing_tensors":
        (dst / TENSORS_NAME).unlink()
    return dst


@pytest.mark.parametrize("how, message", [
    ("missing_dir", "no calibration.json there"),
    ("not_json", "not readable JSON"),
    ("flip_tensor_byte", "sha256 differs from calibration.json"),
    ("edit_json_ratio", "its sha256 field does not match its contents"),
    ("missing_tensors", "calibration.safetensors is missing"),
])
def test_cli_refuses_a_bad_calibration_before_loading_the_model(tiny, tmp_path, capsys, how, message):
    hf, _, recipes, cals = tiny
    cal = tmp_path / "nope" if how == "missing_dir" else _corrupt_copy(cals["static"], tmp_path / "cal", how)
    for argv in (["apply", str(recipes["static"]), "--model", str(hf), "--out", str(tmp_path / "o"), "--calibration", str(cal)],
                 ["export", "--model", str(hf), "--recipe", str(recipes["static"]), "--out", str(tmp_path / "e"), "--calibration", str(cal)],
                 ["check", str(recipes["static"]), "--model", str(hf), "--calibration", str(cal)],
                 ["grpo", "--recipe", str(recipes["static"]), "--model", str(hf), "--out", str(tmp_path / "g"), "--calibration", str(cal)]):
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and str(cal) in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "o").exists() and not (tmp_path / "e").exists() and not (tmp_path / "g").exists()


def test_cli_refuses_another_models_calibration(tiny, tmp_path, capsys):
    from tests.conftest import tiny_llama
    from tests.test_export import char_tokenizer

    hf, _, recipes, cals = tiny
    other = tmp_path / "other_hf"
    tiny_llama(seed=1).save_pretrained(other)
    char_tokenizer().save_pretrained(other)
    assert cli_main(["apply", str(recipes["static"]), "--model", str(other), "--out", str(tmp_path / "o"),
                     "--calibration", str(cals["static"])]) == 2
    err = capsys.readouterr().err
    assert "was computed on model" in err and str(cals["static"]) in err and not (tmp_path / "o").exists()


def test_a_calibration_of_another_recipe_configuration_is_refused_naming_the_site(tiny):
    from qpass.apps.cliutil import exit_status
    from qpass.recipe import parse_recipe

    _, pipe, _, cals = tiny
    cal = load_calibration(cals["rac"])  # scored under dynamic activations, ratio 0.25
    with pytest.raises(QpassError, match=r"site model\.layers\.0\.mlp\.gate_proj were computed for another configuration: "
                                         r"ratio 0\.25 there, 0\.5 here") as ei:
        pipe.build_side(parse_recipe(RAC_ONLY.replace("ratio: 0.25", "ratio: 0.5")), "rollout", calibration=cal)
    assert exit_status(ei.value) == 2 and str(cals["rac"]) in str(ei.value)
    with pytest.raises(QpassError, match="activation mode nvfp4 there, nvfp4_static here"):
        pipe.build_side(parse_recipe(STATIC), "rollout", calibration=cal)
    with pytest.raises(QpassError, match="no static RAC channels for site"):
        pipe.build_side(parse_recipe(RAC_ONLY.replace("\n  - pass: residual_compensation", '\n  - pass: residual_compensation\n    targets: ["*.o_proj"]')),
                        "rollout", calibration=cal)


@pytest.mark.parametrize("content, suffix, message", [
    (b'"a"\n{"prompt": 3}\n', ".jsonl", "p.jsonl:2: expected a non-empty string"),
    (b'"a"\nnot json\n', ".jsonl", "p.jsonl:2: not JSON"),
    (b'["ok", "\xff"]', ".json", "not UTF-8 (byte offset 8)"),
    (b"[]", ".json", "no prompt in the file"),
    (b'{"prompts": ["a", 1]}', ".json", "expected a list of non-empty strings"),
    (b"\n\n", ".jsonl", "no prompt in the file"),
])
def test_calibrate_refuses_bad_prompt_files_naming_file_and_line(tiny, tmp_path, capsys, content, suffix, message):
    hf, _, recipes, _ = tiny
    p = tmp_path / f"p{suffix}"
    p.write_bytes(content)
    assert cli_main(["calibrate", str(recipes["static"]), "--model", str(hf), "--prompts", str(p), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "c").exists()


def test_calibrate_flag_rows(tiny, tmp_path, capsys):
    hf, _, recipes, cals = tiny
    rows = [
        (["calibrate", str(recipes["static"]), "--model", str(hf), "--num-prompts", "99", "--out", str(tmp_path / "c")],
         "--num-prompts 99: the prompt source has 24 prompts"),
        (["calibrate", str(recipes["static"]), "--model", str(hf), "--out", str(cals["static"])], "exists"),
        (["grpo", "--recipe", str(recipes["static"]), "--model", str(hf), "--out", str(tmp_path / "g"), "--recalibrate"],
         "--recalibrate needs --calibration"),
    ]
    for argv, message in rows:
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)


def test_calibrate_reads_json_and_jsonl_prompt_files(tiny, tmp_path):
    from qpass.apps.calibrate import run_calibrate

    hf, pipe, recipes, _ = tiny
    (tmp_path / "p.jsonl").write_text('"What is 2+2?"\n\n{"prompt": "Name a color."}\n')
    doc = run_calibrate(str(recipes["rac"]), tmp_path / "c", model=str(hf), pipeline=pipe, prompts=tmp_path / "p.jsonl")
    import hashlib

    assert doc["data"]["prompts"] == 2 and doc["data"]["file_sha256"] == hashlib.sha256((tmp_path / "p.jsonl").read_bytes()).hexdigest()
    (tmp_path / "p.json").write_text(json.dumps({"prompts": ["What is 2+2?", "Name a color."]}))
    doc2 = run_calibrate(str(recipes["rac"]), tmp_path / "c2", model=str(hf), pipeline=pipe, prompts=tmp_path / "p.json")
    assert doc2["data"]["prompts_sha256"] == doc["data"]["prompts_sha256"] and doc2["sites"] == doc["sites"]


# ----------------------------------------------------------------------------- GRPO


def test_staleness_is_observed_over_calibrated_amax():
    from qpass.calibration.run import staleness

    st = staleness({"a": torch.tensor(3.0), "b": torch.tensor(1.0), "c": torch.tensor(0.5), "x": torch.tensor(9.0)},
                   {"a": torch.tensor(2.0), "b": torch.tensor(2.0), "c": torch.tensor(2.0)})
    assert st == {"sites": 3, "ratio_max": 1.5, "ratio_median": 0.5, "ratio_min": 0.25, "sites_over": 1, "worst_site": "a"}


def test_grpo_reports_staleness_and_recalibrates_after_each_sync(tiny, tmp_path):
    """Two GRPO steps of the static recipe with --recalibrate: every row has the calib/ keys; after the run
    the rollout graph's static constants are exactly a fresh calibration of the trained masters."""
    import copy

    from qpass.apps.grpo.grpo import GRPOTrainer
    from qpass.apps.grpo.jsonl import read_jsonl
    from qpass.calibration.run import calibrate, graph_constants, load_masters
    from qpass.recipe import load_recipe
    from tests.test_grpo import TINY_TASK, FakeTok, text_hash_reward, tiny_cfg

    _, pipe, recipes, cals = tiny
    cal = load_calibration(cals["static"])
    recipe = load_recipe(str(recipes["static"]))
    learner, rollout = pipe.build(recipe, calibration=cal)
    before = graph_constants(rollout)
    cfg = tiny_cfg(recalibrate=True, shadow=False, eval_every=0, diag_every=0, lr=3e-2, initial_check=False, bitexact_every=0)
    model = copy.deepcopy(pipe.loaded.model)
    tr = GRPOTrainer(learner, rollout, FakeTok(), TINY_TASK, cfg, reward_fn=text_hash_reward, recipe_name="static_tiny",
                     metrics_path=tmp_path / "metrics.jsonl", calibration=cal, calibration_model=model)
    tr.run()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(rows) == 2
    for r in rows:
        assert r["calib/sites"] == 14 and r["calib/recalibrated"] is True and r["time/recalibrate_s"] >= 0
        assert 0 < r["calib/amax_ratio_min"] <= r["calib/amax_ratio_median"] <= r["calib/amax_ratio_max"]
        assert r["calib/worst_site"] in cal.amax and r["calib/amax_change_max"] > 0
        assert 0 <= r["calib/rac_channels_changed"] <= 1
    after = graph_constants(rollout)
    assert any(bits(after[0][s]) != bits(before[0][s]) for s in before[0])  # lr 3e-2 moves the activations
    fresh = copy.deepcopy(pipe.loaded.model)
    load_masters(fresh, tr.le.export_weights())
    fpipe = dataclasses.replace(pipe, loaded=dataclasses.replace(pipe.loaded, model=fresh))
    want = calibrate(fpipe, recipe, cal.token_ids, data={}, model_ref="trained")
    for s, a in after[0].items():
        assert bits(a) == bits(want.group_amax(s)), s
    for s, c in after[1].items():
        assert torch.equal(c, want.rac[s].channels), s
    # without --recalibrate the report still runs and nothing is re-calibrated
    learner2, rollout2 = pipe.build(recipe, calibration=cal)
    tr2 = GRPOTrainer(learner2, rollout2, FakeTok(), TINY_TASK, tiny_cfg(steps=1, shadow=False, eval_every=0, diag_every=0,
                                                                     initial_check=False, bitexact_every=0),
                      reward_fn=text_hash_reward, recipe_name="static_tiny", calibration=cal)
    row = tr2.run().rows[0]
    assert row["calib/sites"] == 14 and "calib/recalibrated" not in row
    assert {s: bits(a) for s, a in graph_constants(rollout2)[0].items()} == {s: bits(a) for s, a in before[0].items()}


# ----------------------------------------------------------------------------- default model


@pytest.mark.slow
def test_default_model_calibrate_apply_check(default_pipeline, tmp_path):
    """The default model: calibrate a static recipe on 8 probe prompts, apply it with the calibration
    (structural + bit-exact checks), re-check the saved output; the calibrated channels are the pass's
    pick on independently captured inputs."""
    from qpass.apps.apply import ApplyOptions, run_apply
    from qpass.apps.calibrate import run_calibrate
    from qpass.apps.check import run_check
    from qpass.quant.rac import static_channels
    from qpass.formats.spec import NVFP4_ACT_STATIC

    recipe = tmp_path / "static.yaml"
    recipe.write_text(STATIC.replace("ratio: 0.25", "ratio: 0.5"))
    cal_dir = tmp_path / "cal"
    doc = run_calibrate(str(recipe), cal_dir, pipeline=default_pipeline, num_prompts=8)
    assert len(doc["sites"]) == 211 and len(doc["rac"]) == 60 and doc["data"]["prompts"] == 8
    cal = load_calibration(cal_dir)
    site = "model.layers.10.mlp.gate_proj"
    x = _site_inputs(default_pipeline.loaded.model, [site], cal.token_ids)[site]
    assert torch.equal(cal.rac[site].channels, static_channels(x, 0.5, act_spec=NVFP4_ACT_STATIC, act_amax=cal.group_amax(site)))
    out = tmp_path / "apply"
    status, report = run_apply(str(recipe), out, ApplyOptions(calibration=cal_dir, prompts=1, samples=1, max_new_tokens=2,
                                                              batch_size=4, floor=False, behavioral=False, save_learner=False),
                               pipeline=default_pipeline)
    assert status == 0 and report["artifacts"]["calibration"]["static_rac_sites_used"] == 60
    assert report["artifacts"]["calibration"]["static_act_sites_used"] == 210
    status, res = run_check(str(out), ApplyOptions(), pipeline=default_pipeline)
    assert status == 0, res.get("failures")


# ----------------------------------------------------------------------------- console (the first hour x calibration)


def test_calibrate_reports_its_forwards_and_export_says_which_input_scales_it_carries(tiny, applied, tmp_path):
    """``qpass calibrate`` shows its forwards as a phase (qpass.progress); ``qpass export``'s "carried"
    record (its console lines) names static activation scales as carried and says where the input
    scales of dynamic W4A4 sites came from (the calibration, not probe prompts)."""
    import io

    from qpass.apps.calibrate import run_calibrate
    from qpass.apps.export import export_checkpoint
    from qpass.apps.progress import LineReporter
    from qpass.progress import reporting

    hf, pipe, recipes, cals = tiny
    out, _ = applied
    lines = io.StringIO()
    with reporting(LineReporter(lines, interval_s=0.0)):
        run_calibrate(str(recipes["rac"]), tmp_path / "cal", model=str(hf), pipeline=pipe, num_prompts=3)
    assert "calibration forwards of the unquantized model: done 3/3 prompt" in lines.getvalue(), lines.getvalue()
    # the static apply: every W4A4 site has a static scale (carried), static RAC is not (modelopt)
    carried = export_checkpoint(tmp_path / "mo", "modelopt", src=out)["carried"]
    assert not any("dynamic per-tensor activation scales" in s for s in carried["not_carried"]), carried
    assert any(s.startswith("RAC on 4 site(s)") for s in carried["not_carried"]), carried
    assert carried["notes"] == ["14 static activation-scale site(s): the calibrated input amax the rollout graph used, "
                                "written as its input_scale (carried)"]
    # dynamic W4A4 sites, input scales from --calibration: named as the source
    cal = load_calibration(cals["rac"])
    carried = export_checkpoint(tmp_path / "mo2", "modelopt", model=str(hf), recipe=str(recipes["rac"]), calibration=cals["rac"])["carried"]
    dyn = [s for s in carried["not_carried"] if "dynamic per-tensor activation scales" in s]
    assert dyn == [f"dynamic per-tensor activation scales on 14 W4A4 site(s): replaced by a static calibrated input_scale "
                   f"(the calibration {cal.name})"], carried
