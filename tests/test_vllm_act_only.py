"""Activation-only (W16A4) ``qpass_nvfp4`` checkpoints, the parts that need no vLLM (unit tier): the
served linear (:func:`qpass.checkpoint.linear.served_act_linear`) against qpass's ``act_qdq`` rollout
graph at every site, bit for bit; the ``qpass_weight`` config field (round trip, refusals naming the
field); ``qpass export --format qpass`` of a recipe whose rollout is ``act_qdq`` (config, tensors,
pre-flight); the read-back assembly and the served-weights check of unquantized sites. The live
engine is in ``test_vllm_w16a4.py``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from qpass.backends.vllm.worker import assemble_served_act_only
from qpass.checkpoint.linear import served_act_linear
from qpass.checkpoint.qconfig import QpassQuantOptions
from qpass.errors import QpassError, QuantizationError
from qpass.graph.sites import _group_of
from qpass.parity.served import check_served_weights
from qpass.runtime.served import ServedSite

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "src" / "qpass" / "apps" / "study" / "recipes"
sys.path.insert(0, str(Path(__file__).parent))
from _vllm_testutil import tiny_llama_vllm  # noqa: E402
from test_export import char_tokenizer  # noqa: E402


def rollout_of(model: torch.nn.Module, recipe: str):
    """qpass's rollout graph of ``recipe`` on ``model`` (weights shared with the model)."""
    from qpass.graph.model import LoadedModel
    from qpass.pipeline import Pipeline
    from qpass.recipe import load_recipe

    pipe = Pipeline.prepare(loaded=LoadedModel(model=model, tokenizer=None, name="tiny", source="random"), batch_size=1, max_len=64)
    return pipe.build_side(load_recipe(str(RECIPES / recipe)), "rollout", share_params=True)


def site_values(rollout, ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Run the rollout step graph over ``ids`` (prefill); per act-QDQ site the linear's input before
    the QDQ ``x [1, T, K]``, its weight ``[N, K]`` and its output ``[1, T, N]``."""
    from qpass.runtime.prefill import step_prefill_args

    act_qdq, linear = torch.ops.qpass.nvfp4_act_qdq.default, torch.ops.aten.linear.default
    rec = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            x = n.args[0] if n.target == linear else None
            if isinstance(x, torch.fx.Node) and x.target == act_qdq:
                rec[x.args[1]] = (self.env[x.args[0]], self.env[n.args[1]], out)
            return out

    Recorder(rollout.gm, garbage_collect_values=False).run(*step_prefill_args(ids, torch.ones_like(ids), batch_size=1, max_len=64))
    return rec


def _layer(weight: torch.Tensor) -> torch.nn.Module:
    m = torch.nn.Module()
    m.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
    m.qpass_k_sharded = False
    return m


IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 40]])


@pytest.mark.parametrize("dtype,recipe,act", [(torch.float32, "w16a4_qdq.yaml", "nvfp4"),
                                              (torch.bfloat16, "w16a4_qdq_per_token.yaml", "nvfp4_per_token")])
def test_served_act_linear_is_the_rollout_graph_at_every_site_bit_for_bit(dtype, recipe, act):
    rec = site_values(rollout_of(tiny_llama_vllm(dtype=dtype), recipe), IDS)
    assert len(rec) == 14
    for site, (x, w, y) in rec.items():
        assert x.dtype == w.dtype == dtype
        got = served_act_linear(_layer(w), x.reshape(-1, x.shape[-1]), site=site, act=act)  # vLLM's [T, K] layout
        assert got.dtype == dtype and torch.equal(got, y.reshape(-1, y.shape[-1])), site
        # the QDQ is there: a plain linear of the same input differs
        assert not torch.equal(torch.nn.functional.linear(x, w), y), site


def test_fused_qkv_and_gate_up_layers_equal_the_per_site_products():
    """vLLM serves q/k/v and gate/up as one layer: one QDQ of the shared input (the rollout graph's
    three QDQs of that input are identical) and one GEMM over the stacked weight; on this CPU GEMM
    every row of it equals the per-site product bit for bit."""
    rec = site_values(rollout_of(tiny_llama_vllm(dtype=torch.float32), "w16a4_qdq.yaml"), IDS)
    for layer in range(2):
        for parent, members in ((f"model.layers.{layer}.self_attn", ("q_proj", "k_proj", "v_proj")),
                                (f"model.layers.{layer}.mlp", ("gate_proj", "up_proj"))):
            sites = [f"{parent}.{m}" for m in members]
            x = rec[sites[0]][0]
            assert all(torch.equal(rec[s][0], x) for s in sites)
            fused = served_act_linear(_layer(torch.cat([rec[s][1] for s in sites])), x.reshape(-1, x.shape[-1]), site=parent, act="nvfp4")
            want = torch.cat([rec[s][2].reshape(x.shape[1], -1) for s in sites], -1)
            assert torch.equal(fused, want), parent


def test_served_act_linear_refuses_unquantized_activations_and_bad_input():
    layer = _layer(torch.randn(8, 32))
    with pytest.raises(QuantizationError, match="activation-only layer L: act must be nvfp4 or nvfp4_per_token, got 'none'"):
        served_act_linear(layer, torch.randn(3, 32), site="L", act="none")
    x = torch.randn(3, 32)
    x[1, 2] = float("nan")
    with pytest.raises(QuantizationError, match=r"non-finite value\(s\) in tensor 'activation' at site L, first at index \(1, 2\)"):
        served_act_linear(layer, x, site="L", act="nvfp4")


# ----------------------------------------------------------------------------- config


def test_qpass_weight_none_round_trips_through_the_config():
    o = QpassQuantOptions(act="nvfp4_per_token", weight="none", exclude=("lm_head",))
    cfg = o.to_config()
    assert cfg["quant_method"] == "qpass_nvfp4" and cfg["quant_algo"] == "W16A4_NVFP4" and cfg["qpass_weight"] == "none"
    assert cfg["input_activations"] == {"dynamic": True, "per_token": True} and cfg["weight_global_scale_convention"] is None
    assert QpassQuantOptions.from_config(cfg) == o
    assert QpassQuantOptions.from_config({"quantization": {"quant_algo": "W16A4_NVFP4"}}).weight == "none"  # hf_quant_config layout
    assert QpassQuantOptions.from_config(QpassQuantOptions(act="nvfp4").to_config()).weight == "nvfp4"  # default unchanged
    assert QpassQuantOptions.from_config({"quant_algo": "NVFP4"}).weight == "nvfp4"


@pytest.mark.parametrize("cfg,message", [
    ({"quant_algo": "W16A4_NVFP4", "qpass_weight": "bf16"}, r"qpass_weight must be one of \('nvfp4', 'none'\), got 'bf16'"),
    ({"qpass_weight": "fp8"}, r"qpass_weight must be one of \('nvfp4', 'none'\), got 'fp8'"),
    ({"quant_algo": "NVFP4", "qpass_weight": "none"}, "qpass_weight 'none' contradicts quant_algo 'NVFP4'"),
    ({"quant_algo": "W16A4_NVFP4", "qpass_weight": "nvfp4"}, "qpass_weight 'nvfp4' contradicts quant_algo 'W16A4_NVFP4'"),
    ({"quant_algo": "W16A4_NVFP4", "qpass_act": "none"}, "qpass_weight 'none' with qpass_act 'none' quantizes nothing"),
    ({"quant_algo": "W16A4_NVFP4", "rac": {"model.layers.0.mlp.up_proj": {"ratio": 0.5}}},
     "site model.layers.0.mlp.up_proj has RAC, but qpass_weight is 'none'"),
])
def test_bad_qpass_weight_configs_are_refused_naming_the_field(cfg, message):
    with pytest.raises(QpassError, match=message):
        QpassQuantOptions.from_config(cfg)


# ----------------------------------------------------------------------------- export


@pytest.fixture(scope="module")
def act_only_export(tmp_path_factory):
    """``qpass export --format qpass --recipe w16a4_qdq --model <tiny float32 HF dir>``."""
    from qpass.apps.export import export_checkpoint

    root = tmp_path_factory.mktemp("w16a4")
    m = tiny_llama_vllm(dtype=torch.float32)
    tok = char_tokenizer()
    m.config.pad_token_id, m.config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    m.save_pretrained(root / "tiny")
    tok.save_pretrained(root / "tiny")
    rec = export_checkpoint(root / "ck", "qpass", model=str(root / "tiny"), recipe=str(RECIPES / "w16a4_qdq.yaml"), dtype="fp32")
    return root, m, rec


def test_export_of_an_act_qdq_rollout_is_an_activation_only_checkpoint(act_only_export):
    from qpass.backends.vllm.engine import validate_checkpoint
    from qpass.checkpoint.hfdir import read_hf_tensors

    root, model, rec = act_only_export
    assert rec["quantized_sites"] == 14 and rec["act"] == "nvfp4" and rec["weight"] == "none" and "calibration" not in rec
    qc = json.loads((root / "ck" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "qpass_nvfp4" and qc["quant_algo"] == "W16A4_NVFP4" and qc["qpass_weight"] == "none"
    assert qc["qpass_act"] == "nvfp4" and qc["rac"] == {} and qc["exclude_modules"] == ["lm_head", "model.embed_tokens"]
    tensors = read_hf_tensors(root / "ck")
    want = {k: v for k, v in model.state_dict().items()}
    assert sorted(tensors) == sorted(want)  # every tensor, no scales, no input_scale
    for k, v in want.items():
        assert tensors[k].dtype == torch.float32 and torch.equal(tensors[k].view(torch.int32), v.contiguous().view(torch.int32)), k
    info = validate_checkpoint(root / "ck")
    assert info.sites == () and len(info.act_only_sites) == 14 and info.options.weight == "none"
    assert "model.layers.1.mlp.down_proj" in info.act_only_sites and "lm_head" not in info.act_only_sites


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_formats_without_an_activation_only_mode_refuse_it(act_only_export, fmt):
    pytest.importorskip("compressed_tensors") if fmt == "compressed-tensors" else None
    from qpass.apps.export import export_checkpoint

    root, _, _ = act_only_export
    with pytest.raises(QpassError, match=f"--format {fmt} has no activation-only NVFP4 mode .*site model.layers.0"):
        export_checkpoint(root / f"bad-{fmt}", fmt, model=str(root / "tiny"), recipe=str(RECIPES / "w16a4_qdq.yaml"), dtype="fp32")


def test_preflight_refuses_scales_or_bad_weights_in_an_activation_only_checkpoint(act_only_export, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from qpass.backends.vllm.engine import validate_checkpoint

    root, _, _ = act_only_export
    for case in ("scale", "odd_k", "nan"):
        d = tmp_path / case
        shutil.copytree(root / "ck", d)
        t = load_file(str(d / "model.safetensors"))
        if case == "scale":
            t["model.layers.0.mlp.up_proj.weight_scale"] = torch.zeros(256, 8, dtype=torch.float8_e4m3fn)
            message = r"site model.layers.0.mlp.up_proj has NVFP4 scales, but .*config.json says quantization_config.qpass_weight 'none'"
        elif case == "odd_k":
            t["model.layers.1.mlp.down_proj.weight"] = t["model.layers.1.mlp.down_proj.weight"][:, :250].contiguous()
            message = r"model.safetensors: model.layers.1.mlp.down_proj.weight: K=250 is not a multiple of 16"
        else:
            t["model.layers.0.self_attn.o_proj.weight"][3, 4] = float("inf")
            message = r"model.safetensors: model.layers.0.self_attn.o_proj.weight: non-finite values"
        save_file(t, str(d / "model.safetensors"))
        with pytest.raises(QpassError, match=message):
            validate_checkpoint(d)


# ----------------------------------------------------------------------------- read-back


def test_assemble_served_act_only_splits_fused_rows_and_joins_tp_ranks():
    w = torch.randn(12, 32).to(torch.bfloat16)

    def rec(rows, cols, rank, tp, widths, k_sharded):
        t = w[rows, cols].contiguous()
        return {"layer": "m.layers.0.self_attn.qkv_proj", "logical_widths": widths, "k_sharded": k_sharded, "tp_rank": rank,
                "tp_size": tp, "weight": {"bytes": t.view(torch.uint8).numpy().tobytes(), "shape": list(t.shape), "dtype": "bfloat16"}}

    members = QpassQuantOptions(weight="none").members
    one = assemble_served_act_only([[rec(slice(None), slice(None), 0, 1, [8, 2, 2], False)]], members, _group_of)
    assert sorted(one) == [f"m.layers.0.self_attn.{p}_proj" for p in "kqv"]
    q = one["m.layers.0.self_attn.q_proj"]
    assert q.format == "unquantized" and q.global_scale is None and q.scales.shape == (8, 0) and q.group == "m.layers.0.self_attn.qkv"
    assert torch.equal(q.codes, w[:8]) and torch.equal(one["m.layers.0.self_attn.v_proj"].codes, w[10:])
    # row-parallel: two ranks hold K halves of one layer
    r = [[rec(slice(None), slice(0, 16), 0, 2, [12], True)], [rec(slice(None), slice(16, 32), 1, 2, [12], True)]]
    r[0][0]["layer"] = r[1][0]["layer"] = "m.layers.0.self_attn.o_proj"
    two = assemble_served_act_only(r, members, _group_of)
    assert torch.equal(two["m.layers.0.self_attn.o_proj"].codes, w)


def test_served_check_compares_unquantized_sites_bit_for_bit_with_the_master():
    masters = {"a.weight": torch.randn(4, 32), "b.weight": torch.randn(4, 32)}
    served = {s: ServedSite(s, "unquantized", masters[f"{s}.weight"].to(torch.bfloat16), torch.empty(4, 0, dtype=torch.uint8), None, s)
              for s in ("a", "b")}
    ok = check_served_weights(masters, served)
    assert ok.ok and ok.checked == 2 and ok.unquantized == 2 and ok.skipped == 0
    bad_codes = served["b"].codes.clone()
    bad_codes.view(torch.int16)[2, 7] ^= 1  # one bit of one served weight
    bad = check_served_weights(masters, {**served, "b": ServedSite("b", "unquantized", bad_codes, served["b"].scales, None, "b")})
    assert not bad.ok and bad.mismatches == ("b: unquantized weight (torch.bfloat16) bits 1/256 differ (first at (2, 14))",)
    missing = check_served_weights({"a.weight": masters["a.weight"]}, served)
    assert missing.mismatches == ("b: no master weight b.weight",)


def test_apply_quant_config_records_act_only_sites_and_export_reads_them(tmp_path):
    """An apply of the ``w16a4_qdq`` recipe records its activation-only sites in
    ``rollout/hf_quant_config.json`` (``act_only_sites``), which ``qpass export DIR`` turns into
    ``weight="none"`` sites; a malformed entry is refused naming the file and site."""
    from qpass.apps.artifacts import save_rollout
    from qpass.apps.export import sites_from_quant_config

    save_rollout(rollout_of(tiny_llama_vllm(dtype=torch.float32), "w16a4_qdq_per_token.yaml"), tmp_path / "ro", "", {})
    path = tmp_path / "ro" / "hf_quant_config.json"
    cfg = json.loads(path.read_text())
    assert not (tmp_path / "ro" / "weights.safetensors").exists() and cfg["quantization"]["sites"] == {}
    sites = sites_from_quant_config(cfg, path)
    assert len(sites) == 14 and {(r.weight, r.act, r.rac) for r in sites.values()} == {("none", "nvfp4_per_token", None)}
    assert sites["model.layers.1.mlp.up_proj"].group == "model.layers.1.mlp.gate_up"
    cfg["quantization"]["act_only_sites"]["model.layers.0.mlp.up_proj"]["act_spec"] = "fp8.activation"
    with pytest.raises(QpassError, match=r"hf_quant_config.json: activation-only site model.layers.0.mlp.up_proj has an unknown activation spec 'fp8.activation'"):
        sites_from_quant_config(cfg, path)
