"""SGLang plugin against SGLang's real classes on CPU (skipped when SGLang is not installed).

SGLang is a multi-GB install (sglang 0.5.23 pins torch 2.14.1 and pulls the CUDA wheels), so CI
skips this module; docs/RESULTS.md ("SGLang plugin contract (CPU)") records the throwaway-venv run.
Checks: registration through the real ``sglang.srt.plugins`` entry point; ``create_weights`` builds
the same parameters (names, classes, dtypes, shapes, loader attributes) as SGLang's own
``ModelOptFp4LinearMethod``; checkpoint tensors load through SGLang's weight loaders (plain, fused
QKV / gate-up shards, fake TP=2 column and row shards); ``process_weights_after_loading`` is
idempotent and rejects unequal fused global scales; ``apply`` equals qpass's op; an RL weight-update
session (restore -> load -> process) swaps in new weights in place.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qpass.backends.sglang import plugin_classes, quantize_state_dict, sglang_available, tp_shard

pytestmark = pytest.mark.skipif(not sglang_available(), reason="sglang is not installed (multi-GB; run in a throwaway venv, see docs/RESULTS.md)")

H, I, HEADS, KV_HEADS, HD = 64, 128, 4, 2, 16


@pytest.fixture(scope="module")
def sgl():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.srt.layers.linear as L
    import sglang.srt.layers.quantization as Q
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config

    cfg_cls, method_cls = plugin_classes()
    return SimpleNamespace(L=L, Q=Q, ModelOptFp4Config=ModelOptFp4Config, Config=cfg_cls, Method=method_cls)


def _tp(rank: int = 0, size: int = 1):
    """Fake tensor parallelism (no torch.distributed): SGLang's loaders shard for (rank, size)."""
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().override(tp_rank=rank, tp_size=size, tp_group=SimpleNamespace(rank_in_group=rank, world_size=size))


def _config(sgl, **options):
    from qpass.checkpoint.qconfig import QpassQuantOptions

    return sgl.Config(QpassQuantOptions(**options))


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = lambda n, k: (torch.randn(n, k, generator=g) * 0.05).bfloat16()  # noqa: E731
    p = "model.layers.0"
    state = {f"{p}.self_attn.q_proj.weight": w(HEADS * HD, H), f"{p}.self_attn.k_proj.weight": w(KV_HEADS * HD, H),
             f"{p}.self_attn.v_proj.weight": w(KV_HEADS * HD, H), f"{p}.mlp.gate_proj.weight": w(I, H),
             f"{p}.mlp.up_proj.weight": w(I, H), f"{p}.mlp.down_proj.weight": w(H, I)}
    state[f"{p}.self_attn.k_proj.weight"][3, 9] = 0.75  # the qkv group amax lives in k
    return state


def _load(layer, named: dict[str, torch.Tensor], site: str, shard_id=None) -> None:
    for suffix in ("weight", "weight_scale", "weight_scale_2"):
        param = getattr(layer, suffix)
        t = named[f"{site}.{suffix}"]
        if shard_id is None:
            param.weight_loader(param, t)
        else:
            param.weight_loader(param, t, shard_id)


def test_registered_through_the_entry_point(sgl):
    from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES

    assert sgl.Q.get_quantization_config("qpass_nvfp4") is sgl.Config
    assert "qpass_nvfp4" in QUANTIZATION_CHOICES and "QpassNvfp4LinearMethod" in sgl.L.WEIGHT_LOADER_V2_SUPPORTED
    assert sgl.Config.override_quantization_method({"quant_method": "qpass_nvfp4"}, None) == "qpass_nvfp4"
    assert sgl.Config.override_quantization_method({"quant_method": "modelopt", "quant_algo": "NVFP4"}, None) is None


def _param_table(layer) -> dict[str, tuple]:
    return {n: (type(p).__name__, p.dtype, tuple(p.shape), getattr(p, "input_dim", None), getattr(p, "output_dim", None),
                bool(getattr(p, "needs_scalar_to_array", False)))
            for n, p in layer.named_parameters()}


def test_create_weights_equals_modelopt_fp4(sgl):
    mo = sgl.ModelOptFp4Config.from_config({"quant_algo": "NVFP4", "group_size": 16, "ignore": []})
    mo.packed_modules_mapping = {}
    ours = _config(sgl)
    builders = {
        "replicated": lambda q: sgl.L.ReplicatedLinear(H, 96, bias=False, quant_config=q, prefix="model.layers.0.x", params_dtype=torch.bfloat16),
        "qkv": lambda q: sgl.L.QKVParallelLinear(H, HD, HEADS, KV_HEADS, bias=False, quant_config=q, prefix="model.layers.0.self_attn.qkv_proj", params_dtype=torch.bfloat16),
        "gate_up": lambda q: sgl.L.MergedColumnParallelLinear(H, [I, I], bias=False, quant_config=q, prefix="model.layers.0.mlp.gate_up_proj", params_dtype=torch.bfloat16),
    }
    for name, build in builders.items():
        with _tp():
            a, b = build(mo), build(ours)
        assert type(b.quant_method).__name__ == "QpassNvfp4LinearMethod", name
        assert _param_table(b) == _param_table(a), name


def test_load_process_apply_equal_qpass_op(sgl):
    named = dict(quantize_state_dict(_weights()))
    site = "model.layers.0.mlp.down_proj"
    x = (torch.randn(5, I, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    x[:, 7] *= 30
    from qpass.quant.rac import RACConfig

    for opts in ({"act": "none"}, {"act": "nvfp4"}, {"act": "nvfp4_per_token"}, {"act": "nvfp4", "rac": {site: RACConfig(0.5, "gathered", "token")}}):
        lin = sgl.L.ReplicatedLinear(I, H, bias=False, quant_config=_config(sgl, **opts), prefix=site, params_dtype=torch.bfloat16)
        _load(lin, named, site)
        lin.quant_method.process_weights_after_loading(lin)
        s_dec = lin.qpass_s_dec
        y = lin(x)[0]
        rac = opts.get("rac", {}).get(site)
        ref = torch.ops.qpass.nvfp4_linear(x, named[f"{site}.weight"], named[f"{site}.weight_scale"], named[f"{site}.weight_scale_2"], None, site,
                                           opts["act"], rac.ratio if rac else 0.0, rac.mode if rac else "masked", rac.selection if rac else "batch", None)
        assert torch.equal(y, ref), opts
        lin.quant_method.process_weights_after_loading(lin)  # idempotent
        assert lin.qpass_s_dec is s_dec and torch.equal(lin(x)[0], y)


def test_fused_qkv_shards_share_one_global_scale(sgl):
    named = dict(quantize_state_dict(_weights()))
    p = "model.layers.0.self_attn"
    with _tp():
        qkv = sgl.L.QKVParallelLinear(H, HD, HEADS, KV_HEADS, bias=False, quant_config=_config(sgl, act="nvfp4"), prefix=f"{p}.qkv_proj", params_dtype=torch.bfloat16)
    for shard in "qkv":
        _load(qkv, named, f"{p}.{shard}_proj", shard)
    assert torch.equal(qkv.weight.data, torch.cat([named[f"{p}.{s}_proj.weight"] for s in "qkv"]))
    assert qkv.weight_scale_2.data.unique().numel() == 1
    qkv.quant_method.process_weights_after_loading(qkv)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(2)).bfloat16()
    ref = torch.ops.qpass.nvfp4_linear(x, qkv.weight.data.clone(), qkv.weight_scale.data.clone(), named[f"{p}.q_proj.weight_scale_2"], None, "r", "nvfp4", 0.0, "masked", "batch", None)
    assert torch.equal(qkv(x)[0], ref)
    # a checkpoint whose shards carry different globals (e.g. quantized per projection) is refused
    other = dict(quantize_state_dict({f"{p}.v_proj.weight": _weights()[f"{p}.v_proj.weight"]}))
    qkv.weight_scale_2.weight_loader(qkv.weight_scale_2, other[f"{p}.v_proj.weight_scale_2"], "v")
    from qpass.errors import QuantizationError

    with pytest.raises(QuantizationError, match=f"{p}.qkv_proj has different weight_scale_2 per fused shard"):
        qkv.quant_method.process_weights_after_loading(qkv)


def test_rl_weight_update_session_reloads_in_place(sgl):
    site = "model.layers.0.mlp.gate_up_proj"
    with _tp():
        lin = sgl.L.MergedColumnParallelLinear(H, [I, I], bias=False, quant_config=_config(sgl, act="nvfp4"), prefix=site, params_dtype=torch.bfloat16)
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(3)).bfloat16()
    outs, ids = [], None
    for seed in (0, 1):  # step 0 weights, then an "optimizer step"
        named = dict(quantize_state_dict(_weights(seed)))
        lin.quant_method.restore_weights_before_loading(lin)  # begin_weight_update
        for i, m in enumerate(("gate_proj", "up_proj")):  # update_weights_from_tensor -> load_weights
            _load(lin, named, f"model.layers.0.mlp.{m}", i)
        lin.quant_method.process_weights_after_loading(lin)  # end_weight_update
        now = tuple(id(p) for p in lin.parameters()) + (id(lin.qpass_s_dec),)
        assert ids is None or now == ids  # same Parameter / buffer objects (CUDA graphs stay valid)
        ids = now
        w = torch.cat([named[f"model.layers.0.mlp.{m}.weight"] for m in ("gate_proj", "up_proj")])
        s = torch.cat([named[f"model.layers.0.mlp.{m}.weight_scale"] for m in ("gate_proj", "up_proj")])
        ref = torch.ops.qpass.nvfp4_linear(x, w, s, named["model.layers.0.mlp.gate_proj.weight_scale_2"], None, site, "nvfp4", 0.0, "masked", "batch", None)
        outs.append(lin(x)[0])
        assert torch.equal(outs[-1], ref)
    assert not torch.equal(outs[0], outs[1])


def test_fake_tp2_column_and_row_shards_load_like_tp_shard(sgl):
    named = dict(quantize_state_dict(_weights()))
    up, down = "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"
    for rank in (0, 1):
        with _tp(rank, 2):
            col = sgl.L.ColumnParallelLinear(H, I, bias=False, quant_config=_config(sgl, act="nvfp4"), prefix=up, params_dtype=torch.bfloat16)
            row = sgl.L.RowParallelLinear(I, H, bias=False, quant_config=_config(sgl, act="nvfp4"), prefix=down, params_dtype=torch.bfloat16)
            for layer, site, par in ((col, up, "column"), (row, down, "row")):
                _load(layer, named, site)
                for suffix in ("weight", "weight_scale"):
                    want = tp_shard(f"{site}.{suffix}", named[f"{site}.{suffix}"], tp_rank=rank, tp_size=2, parallel=par)
                    assert torch.equal(getattr(layer, suffix).data.view(torch.uint8), want.view(torch.uint8)), (site, suffix, rank)
            assert row.qpass_k_sharded and not col.qpass_k_sharded
            from qpass.quant.rac import RACConfig

            with pytest.raises(NotImplementedError, match=f"{down} is row-parallel"):
                sgl.L.RowParallelLinear(I, H, bias=False, quant_config=_config(sgl, act="nvfp4", rac={down: RACConfig(0.5)}), prefix=down, params_dtype=torch.bfloat16)


def test_excluded_layers_stay_unquantized(sgl):
    lin = sgl.L.ReplicatedLinear(H, 256, bias=False, quant_config=_config(sgl), prefix="lm_head", params_dtype=torch.bfloat16)
    assert type(lin.quant_method).__name__ == "UnquantizedLinearMethod" and lin.weight.dtype == torch.bfloat16
