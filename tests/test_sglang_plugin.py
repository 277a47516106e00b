"""SGLang plugin, the parts that do not need SGLang (CI): registration safety, the modelopt_fp4
parameter contract, checkpoint config, RL weight-update tensors (names, fused global scales, TP
shards). The tests against SGLang's real classes live in ``test_sglang_contract.py`` and skip when
SGLang is not installed."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch

from qpass.backends import sglang as qsgl
from qpass.checkpoint.qconfig import QpassQuantOptions
from qpass.checkpoint.tensors import checkpoint_tensors
from qpass.errors import QpassError, QuantizationError
from qpass.quant.nvfp4 import NVFP4Tensor, nvfp4_dequantize, nvfp4_quantize
from qpass.quant.rac import RACConfig

from .conftest import check_plugin_without_engine

ROOT = Path(__file__).resolve().parents[1]

# prior-art/backends.md §1.3: SGLang 0.5.23 ModelOptFp4LinearMethod, per logical weight partition
# (N = sum of output partitions, K = input size per partition, S = number of fused shards).
MODELOPT_FP4_TABLE = {
    "weight": ("ModelWeightParameter", torch.uint8, lambda n, k, s: (n, k // 2), 1, 0),
    "weight_scale": ("ModelWeightParameter", torch.float8_e4m3fn, lambda n, k, s: (n, k // 16), 1, 0),
    "weight_scale_2": ("PerTensorScaleParameter", torch.float32, lambda n, k, s: (s,), None, None),
    "input_scale": ("PerTensorScaleParameter", torch.float32, lambda n, k, s: (s,), None, None),
}


# ------------------------------------------------------------------------------------- registration
def test_import_and_register_are_safe_without_sglang(monkeypatch):
    check_plugin_without_engine(monkeypatch, "sglang", qsgl.sglang_available, qsgl.register, qsgl.plugin_classes)


def test_entry_point_is_declared():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    eps = meta["project"]["entry-points"]["sglang.srt.plugins"]
    assert eps == {"qpass_nvfp4": "qpass.backends.sglang:register"}
    from importlib.metadata import entry_points

    installed = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "qpass_nvfp4"]
    if installed:  # present once the package metadata is (re)installed
        assert installed[0].load() is qsgl.register


# ------------------------------------------------------------------------------------- contract
@pytest.mark.parametrize("parts,k", [([96], 64), ([64, 32, 32], 64), ([128, 128], 64), ([64], 32)], ids=["plain", "qkv", "gate_up", "tp_row_half"])
def test_create_weights_spec_matches_modelopt_fp4_table(parts, k):
    specs = qsgl.linear_param_specs(k, parts, prefix="model.layers.0.x")
    assert [p.name for p in specs] == list(MODELOPT_FP4_TABLE)
    n, s = sum(parts), len(parts)
    for p in specs:
        kind, dtype, shape, in_dim, out_dim = MODELOPT_FP4_TABLE[p.name]
        assert (p.kind, p.dtype, p.shape, p.input_dim, p.output_dim) == (kind, dtype, shape(n, k, s), in_dim, out_dim)
        assert p.scalar_to_array == (kind == "PerTensorScaleParameter")  # 0-d checkpoint scalars load per shard


def test_create_weights_spec_rejects_partial_blocks_naming_the_layer():
    with pytest.raises(QuantizationError, match="model.layers.3.mlp.down_proj: input_size_per_partition=40 is not a multiple of 16"):
        qsgl.linear_param_specs(40, [64], prefix="model.layers.3.mlp.down_proj")


# ------------------------------------------------------------------------------------- config
def test_options_from_qpass_hf_quant_config_and_back():
    hf = {
        "producer": {"name": "qpass", "version": "0.1.0"},
        "quantization": {
            "quant_algo": "NVFP4", "group_size": 16, "input_activations": {"dynamic": True, "per_token": True},
            "exclude_modules": ["lm_head"],
            "rac": {"model.layers.0.mlp.gate_proj": {"ratio": 0.5, "mode": "masked", "selection": "batch"},
                    "model.layers.0.mlp.up_proj": {"ratio": 0.5, "mode": "masked", "selection": "batch"}},
        },
    }
    o = QpassQuantOptions.from_config(hf)
    assert o.act == "nvfp4_per_token" and o.exclude == ("lm_head",)
    assert o.rac_for("model.layers.0.mlp.gate_up_proj") == RACConfig(0.5, "masked", "batch")
    assert o.rac_for("model.layers.0.self_attn.qkv_proj") is None
    assert o.members("model.layers.0.self_attn.qkv_proj") == [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    flat = qsgl.checkpoint_quant_config(o)["quantization_config"]
    assert flat["quant_method"] == "qpass_nvfp4" and flat["quant_algo"] == "NVFP4"
    assert QpassQuantOptions.from_config(flat) == o


def test_options_w4a16_exclusions_and_errors():
    assert QpassQuantOptions.from_config({"quant_algo": "W4A16_NVFP4"}).act == "none"
    assert QpassQuantOptions.from_config({"quant_algo": "NVFP4", "qpass_act": "none"}).act == "none"
    o = QpassQuantOptions()
    assert o.is_excluded("lm_head") and o.is_excluded("model.embed_tokens") and not o.is_excluded("model.layers.0.mlp.down_proj")
    with pytest.raises(QpassError, match="quant_algo 'FP8'"):
        QpassQuantOptions.from_config({"quant_algo": "FP8"})
    # a checkpoint may carry static RAC channels (qpass export, issue 31); the engine plugins' parser refuses it
    assert QpassQuantOptions(rac={"a.b": RACConfig(0.5, "masked", "static")}).rac["a.b"].selection == "static"
    with pytest.raises(QpassError, match="do not serve static RAC"):
        QpassQuantOptions.from_config({"quant_algo": "NVFP4", "rac": {"a.b": {"ratio": 0.5, "selection": "static"}}})
    with pytest.raises(QpassError, match="fused layer m.qkv_proj has members both excluded and quantized"):
        QpassQuantOptions(exclude=("m.q_proj",)).is_excluded("m.qkv_proj")
    with pytest.raises(QpassError, match="different RAC settings"):
        QpassQuantOptions(rac={"m.gate_proj": RACConfig(0.5)}).rac_for("m.gate_up_proj")


# ------------------------------------------------------------------------------------- weights
@pytest.fixture(scope="module")
def w4a4_rollout(tiny_pipeline):
    from qpass.recipe import parse_recipe

    return tiny_pipeline.build(parse_recipe("name: t\nrollout:\n  - pass: w4a4_lower\n    act: nvfp4\n"))


def test_named_tensors_for_update_weights_from_tensor(w4a4_rollout):
    learner, rollout = w4a4_rollout
    named = dict(qsgl.named_tensors_from_rollout(rollout))
    assert len(named) == 14 * 3 and {n.rsplit(".", 1)[1] for n in named} == {"weight", "weight_scale", "weight_scale_2"}
    site = "model.layers.1.self_attn.k_proj"
    assert named[f"{site}.weight"].dtype == torch.uint8 and named[f"{site}.weight"].shape == (32, 32)
    assert named[f"{site}.weight_scale"].dtype == torch.float8_e4m3fn and named[f"{site}.weight_scale"].shape == (32, 4)
    assert named[f"{site}.weight_scale_2"].dtype == torch.float32 and named[f"{site}.weight_scale_2"].dim() == 0
    groups = qsgl.check_fused_global_scales(named)
    assert groups["model.layers.1.self_attn.qkv"] == 3 and groups["model.layers.1.mlp.gate_up"] == 2
    # the trainer-side quantization of the learner's weights sends exactly the rollout's bytes
    state = {n: p.detach() for n, p in _hf_state(learner).items()}
    fresh = dict(qsgl.quantize_state_dict(state))
    for name, t in named.items():
        assert torch.equal(fresh[name].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else fresh[name],
                           t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t), name
    assert fresh["model.norm.weight"].dtype == torch.bfloat16 and "lm_head.weight" in fresh and fresh["lm_head.weight"].dtype == torch.bfloat16
    extra = {"model.norm.weight": state["model.norm.weight"]}
    assert dict(qsgl.named_tensors_from_rollout(rollout, extra=extra))["model.norm.weight"] is extra["model.norm.weight"]
    with pytest.raises(QpassError, match="collides"):
        qsgl.named_tensors_from_rollout(rollout, extra={f"{site}.weight": torch.zeros(1)})


def _hf_state(learner) -> dict[str, torch.Tensor]:
    from qpass.graph.capture import site_of

    return {site_of(n): p for n, p in learner.gm.named_parameters()}


def test_fused_group_with_different_global_scales_is_rejected(w4a4_rollout):
    named = dict(qsgl.named_tensors_from_rollout(w4a4_rollout[1]))
    bad = dict(named)
    bad["model.layers.0.self_attn.v_proj.weight_scale_2"] = named["model.layers.0.self_attn.v_proj.weight_scale_2"] * 2
    with pytest.raises(QpassError, match="fused group model.layers.0.self_attn.qkv: weight_scale_2 differs"):
        qsgl.check_fused_global_scales(bad)


def test_named_tensors_from_an_apply_directory(w4a4_rollout, tmp_path):
    from qpass.apps.artifacts import save_rollout

    save_rollout(w4a4_rollout[1], tmp_path / "rollout", "name: t\nrollout: []\n", {})
    a = qsgl.named_tensors_from_rollout(tmp_path)
    b = qsgl.named_tensors_from_rollout(w4a4_rollout[1])
    assert [n for n, _ in a] == [n for n, _ in b]
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.dim() else torch.equal(x, y) for (_, x), (_, y) in zip(a, b))


@pytest.mark.parametrize("parallel", ["column", "row"])
def test_tp_shards_decode_and_quantize_as_slices_of_the_full_weight(parallel):
    w = (torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.03).bfloat16()
    w[50, 3] = 0.7  # the amax lives in one shard only
    full = nvfp4_quantize(w)
    tensors = checkpoint_tensors("m.proj", full)
    w_hat = nvfp4_dequantize(full)
    for rank in range(2):
        sh = {n.rsplit(".", 1)[1]: qsgl.tp_shard(n, t, tp_rank=rank, tp_size=2, parallel=parallel) for n, t in tensors.items()}
        part = NVFP4Tensor.from_parts(sh["weight"], sh["weight_scale"], sh["weight_scale_2"])
        rows = slice(32 * rank, 32 * rank + 32) if parallel == "column" else slice(None)
        cols = slice(64 * rank, 64 * rank + 64) if parallel == "row" else slice(None)
        assert torch.equal(nvfp4_dequantize(part), w_hat[rows, cols])
        # the shard is exactly qpass's quantization of the weight slice with the group (full) amax
        q = nvfp4_quantize(w[rows, cols], full.amax)
        assert torch.equal(q.codes, part.codes) and torch.equal(q.scales.view(torch.uint8), part.scales.view(torch.uint8))
    with pytest.raises(QpassError, match="would cut a 1x16 NVFP4 block"):
        qsgl.tp_shard("m.proj.weight", tensors["m.proj.weight"], tp_rank=0, tp_size=16, parallel="row")


def test_row_parallel_activation_helper_equals_the_reference_fake_quant():
    from qpass.backends.sglang.plugin import activation_for_row_parallel
    from qpass.tables import reference_qdq

    x = (torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2)) * 4).bfloat16()
    for act, key in (("nvfp4", "nvfp4.activation.per_tensor"), ("nvfp4_per_token", "nvfp4.activation.per_token")):
        got = activation_for_row_parallel(x, act, None, "s")
        assert torch.equal(got, reference_qdq(key, x.reshape(-1, 64)).reshape(x.shape))


# ------------------------------------------------------------------------------------- bad input (load/update/read)
def _layer(parts=(32, 32, 32), k=64, prefix="model.layers.0.self_attn.qkv_proj"):
    """A module with the parameters ``create_weights`` registers, as SGLang allocates them."""
    from qpass.checkpoint.params import make_tensor

    layer = torch.nn.Module()
    for p in qsgl.linear_param_specs(k, list(parts), prefix=prefix):
        layer.register_parameter(p.name, torch.nn.Parameter(make_tensor(p), requires_grad=False))
    return layer


def _load(layer, *, codes=True, scales=True, globals_=(0, 1, 2)):
    w = nvfp4_quantize((torch.randn(96, 64, generator=torch.Generator().manual_seed(1)) * 0.05).bfloat16())
    with torch.no_grad():
        if codes:
            layer.weight.copy_(w.codes)
        if scales:
            layer.weight_scale.copy_(w.scales)
        for i in globals_:
            layer.weight_scale_2[i] = w.s_dec.float()
    return w


def test_scales_never_loaded_are_refused_naming_the_layer():
    from qpass.backends.sglang.plugin import finish_loading

    site = "model.layers.0.self_attn.qkv_proj"
    layer = _layer()
    _load(layer, scales=False)  # codes and globals, no block scales (torch.empty before: served as is)
    with pytest.raises(QuantizationError, match=f"layer {site}: 384/384 weight_scale bytes are NaN"):
        finish_loading(layer, site)
    layer = _layer()
    _load(layer, globals_=(0, 2))  # shard 1's global never written
    with pytest.raises(QuantizationError, match=rf"layer {site}: weight_scale_2 of shard\(s\) \[1\] was never loaded"):
        finish_loading(layer, site)
    layer = _layer()
    w = _load(layer)
    finish_loading(layer, site)
    assert torch.equal(layer.qpass_s_dec, w.s_dec.float().reshape(()))


def test_weight_update_with_codes_but_no_scales_is_refused():
    from qpass.backends.sglang.plugin import begin_loading, finish_loading

    site = "model.layers.0.self_attn.qkv_proj"
    layer = _layer()
    _load(layer)
    finish_loading(layer, site)
    begin_loading(layer)  # restore_weights_before_loading: an RL update session starts
    _load(layer, scales=False, globals_=())  # the update carries codes only: stale scales must not be served
    with pytest.raises(QuantizationError, match=f"layer {site}"):
        finish_loading(layer, site)
    begin_loading(layer)
    _load(layer)  # a complete update is accepted again
    finish_loading(layer, site)


def test_readers_refuse_bad_scales_and_truncated_files_naming_file_and_site(w4a4_rollout, tmp_path):
    from safetensors.torch import save_file

    named = dict(qsgl.named_tensors_from_rollout(w4a4_rollout[1]))
    site = "model.layers.1.mlp.down_proj"
    f = tmp_path / "weights.safetensors"

    def bad(name, value):
        t = dict(named)
        if value is None:
            del t[name]
        else:
            t[name] = value
        save_file({k: v.contiguous() for k, v in t.items()}, str(f))
        return t

    bad(f"{site}.weight_scale", named[f"{site}.weight_scale"][:, :-1])  # wrong shape
    with pytest.raises(QuantizationError, match=rf"{f}: {site}\.weight_scale: expected float8_e4m3fn \(64, 8\)"):
        qsgl.named_tensors_from_rollout(tmp_path)
    bad(f"{site}.weight_scale", named[f"{site}.weight_scale"].float())  # wrong dtype
    with pytest.raises(QuantizationError, match=rf"{site}\.weight_scale: expected float8_e4m3fn .* got torch.float32"):
        qsgl.named_tensors_from_rollout(tmp_path)
    nan = named[f"{site}.weight_scale"].clone()
    nan.view(torch.uint8)[2, 1] = 0x7F
    bad(f"{site}.weight_scale", nan)
    with pytest.raises(QuantizationError, match=rf"{f}: {site}: 1/512 weight_scale bytes are NaN \(first at \(2, 1\)\)"):
        qsgl.named_tensors_from_rollout(tmp_path)
    bad(f"{site}.weight_scale_2", torch.tensor(float("nan")))
    with pytest.raises(QuantizationError, match=rf"{f}: {site}: weight_scale_2 of shard\(s\) \[0\] was never loaded, or is NaN"):
        qsgl.named_tensors_from_rollout(tmp_path)
    bad(f"{site}.weight_scale", None)  # codes without scales
    with pytest.raises(QpassError, match=rf"{f}: site {site} has no {site}\.weight_scale"):
        qsgl.named_tensors_from_rollout(tmp_path)
    bad(f"{site}.weight", named[f"{site}.weight"])
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(QpassError, match=rf"{f}: not a readable safetensors file"):
        qsgl.named_tensors_from_rollout(tmp_path)
