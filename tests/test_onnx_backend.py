"""ONNX backend: every spec's ``onnx_lower`` emitter reproduces qpass's reference bit for bit.

Weights: the ONNX decode of stored bytes (random bytes, so every code / scale byte occurs) equals
``dequantize``. Activations: the fake-quant subgraph equals ``reference_qdq`` on tie-rich inputs
(exact E2M1 / E4M3 midpoints), outliers, subnormal and zero block scales, signed zeros. Both
flavours run in ``onnx.reference.ReferenceEvaluator``; the portable flavour also in onnxruntime
(CPU). The per-site rollout export equals the rollout ops on the tiny Llama.
"""

from __future__ import annotations

import os

import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("ml_dtypes")

from qpass.backends.onnx import (  # noqa: E402
    ONNX_LOWERINGS,
    activation_qdq_model,
    export_rollout_onnx,
    rollout_sites_model,
    run_onnx,
    weight_decode_model,
)
from qpass.backends.onnx.export import SiteLinear, emit_site_linear, sites_from_qgraph  # noqa: E402
from qpass.formats.spec import NVFP4_WEIGHT  # noqa: E402
from qpass.formats.spec import ALL_SPECS, FP8Spec, Granularity, spec_by_key  # noqa: E402
from qpass.formats.spec import spec_by_key  # noqa: E402
from qpass.tables import entry, reference_qdq, reference_quantize  # noqa: E402
from qpass.quant.fp8 import FP8Tensor  # noqa: E402
from qpass.quant.mxfp4 import MXFP4Tensor  # noqa: E402
from qpass.quant.nvfp4 import NVFP4Tensor, global_scales, nvfp4_quantize  # noqa: E402

try:
    import onnxruntime  # noqa: F401

    HAVE_ORT = True
except ImportError:  # pragma: no cover - onnxruntime is in the test extra
    HAVE_ORT = False

WEIGHT_KEYS = [s.key for s in ALL_SPECS if s.role == "weight"]
ACT_KEYS = [s.key for s in ALL_SPECS if s.role == "activation"]
RUNS = [("spec", "reference"), ("portable", "reference"), ("portable", "onnxruntime")]


def _runs():
    return [pytest.param(f, r, marks=pytest.mark.skipif(r == "onnxruntime" and not HAVE_ORT, reason="onnxruntime not installed"), id=f"{f}-{r}") for f, r in RUNS]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view for bit comparison (NaNs canonicalised so two NaNs compare equal)."""
    t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype])


def _assert_bits_equal(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    bad = _bits(got) != _bits(ref)
    assert not bool(bad.any()), f"{int(bad.sum())}/{ref.numel()} elements differ, first at {bad.nonzero()[0].tolist()}: {got[bad][:4]} vs {ref[bad][:4]}"


def _run(model, feeds, flavour, runtime):
    if flavour == "spec":
        onnx.checker.check_model(model, full_check=True)
    return run_onnx(model, feeds, runtime=runtime)


# ----------------------------------------------------------------------------------------- table
def test_every_spec_has_an_onnx_lowering_with_its_role_and_opsets():
    for s in ALL_SPECS:
        lo = entry("onnx", s)(s)  # the spec-table rule builds the same emitter as ONNX_LOWERINGS
        assert lo.key == s.key == ONNX_LOWERINGS[s.key].key and lo.role == s.role == ONNX_LOWERINGS[s.key].role
        assert lo.opset == ONNX_LOWERINGS[s.key].opset
        assert lo.opset["portable"] == 21
        assert lo.opset["spec"] == (24 if s.name == "mxfp4" else 23)


# ----------------------------------------------------------------------------------------- weights
def _random_weight(key: str, seed: int = 0):
    """A quantized weight made of random stored bytes (every code and scale byte can occur)."""
    g = torch.Generator().manual_seed(seed)
    spec = spec_by_key(key)
    if spec.name == "nvfp4":
        n, k = 24, 96
        codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        scales = torch.randint(0, 0x7F, (n, k // 16), generator=g, dtype=torch.uint8)  # every non-NaN positive byte
        scales[0, :2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # zero scale, 448
        amax = torch.tensor(0.66688365, dtype=torch.float32)  # a global scale where double-DQ rounding differs
        return NVFP4Tensor.from_parts(codes, scales, global_scales(amax)[1])
    if spec.name == "mxfp4":
        n, k = 24, 128
        codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        scales = torch.randint(0, 256, (n, k // 32), generator=g, dtype=torch.uint8)
        scales[0, :3] = torch.tensor([0, 254, 255], dtype=torch.uint8)  # 2^-127, 2^127, NaN
        return MXFP4Tensor(codes, scales, torch.Size((n, k)), torch.bfloat16)
    n, k = 160, 200  # partial 128x128 edge blocks
    data = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    data[(data & 0x7F) == 0x7F] = 0x7E  # no NaN bytes
    if spec.granularity == Granularity.BLOCK_128X128:
        scale = torch.rand(2, 2, generator=g) * 1e-2 + 1e-4
    else:
        scale = torch.tensor(3.0517578e-05 * 1.7, dtype=torch.float32)
    return FP8Tensor(data.view(torch.float8_e4m3fn), scale.float(), torch.Size((n, k)), torch.bfloat16, spec)


@pytest.mark.parametrize("flavour,runtime", _runs())
@pytest.mark.parametrize("key", WEIGHT_KEYS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_weight_decode_of_random_bytes_is_bit_exact(key, flavour, runtime, dtype):
    q = _random_weight(key)
    model = weight_decode_model(key, q, flavour=flavour, dtype=dtype)
    assert model.opset_import[0].version == ONNX_LOWERINGS[key].opset[flavour]
    out = _run(model, {}, flavour, runtime)["w_hat"].to(dtype)
    _assert_bits_equal(out, q.dequantize(dtype))


@pytest.mark.parametrize("flavour,runtime", _runs())
@pytest.mark.parametrize("key", WEIGHT_KEYS)
def test_weight_decode_of_a_real_quantization_is_bit_exact(key, flavour, runtime):
    w = (torch.randn(40, 256, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16()
    w[5, 17] = 0.9
    q = reference_quantize(spec_by_key(key), w)
    out = _run(weight_decode_model(key, q, flavour=flavour), {}, flavour, runtime)["w_hat"].bfloat16()
    _assert_bits_equal(out, q.dequantize(torch.bfloat16))


def test_initializer_bytes_are_the_checkpoint_bytes():
    w = (torch.randn(16, 64, generator=torch.Generator().manual_seed(4)) * 0.05).bfloat16()
    q = nvfp4_quantize(w)
    for flavour in ("spec", "portable"):
        inits = {t.name: t for t in weight_decode_model("nvfp4.weight.per_tensor", q, flavour=flavour).graph.initializer}
        assert inits["w.weight"].raw_data == q.codes.numpy().tobytes()
        assert inits["w.weight_scale"].raw_data == q.scales.view(torch.uint8).numpy().tobytes()
        assert inits["w.weight_scale_2"].raw_data == q.s_dec.reshape(1).numpy().tobytes()
    assert inits["w.weight"].data_type == onnx.TensorProto.UINT8
    spec_model = weight_decode_model("nvfp4.weight.per_tensor", q, flavour="spec")
    assert {t.name: t.data_type for t in spec_model.graph.initializer}["w.weight"] == onnx.TensorProto.FLOAT4E2M1


def test_modelopt_double_dq_order_is_not_bit_exact():
    """DQ(codes, DQ(scales, S_dec)) rounds fl(s_b*S_dec) first: one (code, scale, global) triple where
    even the bf16 result differs from SPEC §3's fl(fl(e2m1*s_b)*S_dec); our default order matches."""
    amax = torch.tensor(0.66688365, dtype=torch.float32)
    s_dec = global_scales(amax)[1]
    sb = torch.tensor(0.017578125).to(torch.float8_e4m3fn).view(torch.uint8)
    codes = torch.full((1, 8), 0x33, dtype=torch.uint8)  # every element 1.5
    q = NVFP4Tensor.from_parts(codes, sb.reshape(1, 1), s_dec)
    ref = q.dequantize(torch.bfloat16)
    ours = run_onnx(weight_decode_model("nvfp4.weight.per_tensor", q, flavour="spec"), {})["w_hat"]
    theirs = run_onnx(weight_decode_model("nvfp4.weight.per_tensor", q, flavour="spec", pattern="double_dq"), {})["w_hat"]
    _assert_bits_equal(ours, ref)
    assert not torch.equal(theirs, ref)
    assert int((theirs.view(torch.int16) - ref.view(torch.int16)).abs().max()) == 1  # one bf16 ulp


# ----------------------------------------------------------------------------------------- activations
def _nvfp4_tie_rich(per_row_amax: bool) -> torch.Tensor:
    """bf16 [6, 128]: S_enc = 1 (amax 2688), power-of-two block scales, every E2M1 midpoint exactly,
    outliers, a subnormal and a zero block scale, signed zeros."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 6.0, -0.0])
    x = torch.zeros(6, 128)
    x[0, 0] = 2688.0  # per-tensor amax -> S_enc = 1, S_dec = 1
    for r in range(6):
        if per_row_amax:
            x[r, 0] = 2688.0 if r % 2 else -2688.0
        for blk in range(1, 6):
            s = 2.0 ** (r - blk)
            x[r, 16 * blk:16 * blk + 16] = mids * s  # vmax = 6 s -> s_b = s, enc = 1/s: exact ties
            x[r, 16 * blk + 14] = 6.0 * s
    x[1, 96:112] = torch.linspace(-0.02, 0.02, 16)  # subnormal E4M3 block scale
    x[2, 96:112] = torch.linspace(-1e-4, 1e-4, 16)  # block scale rounds to 0 -> decodes to (signed) zero
    x[3, 112:128] = -0.0
    x[4, 112:128] = torch.randn(16, generator=torch.Generator().manual_seed(0)) * 300  # outlier block
    return x.bfloat16()


def _fp8_tie_rich(block: int) -> torch.Tensor:
    """bf16 [4, 300]: scale = 1 in every block (448 present), exact E4M3 midpoints (normal and
    subnormal), -0.0, a partial last 1x128 block."""
    vals = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (vals[:-1] + vals[1:]) / 2
    x = torch.zeros(4, 300)
    for r in range(4):
        row = torch.cat([mids, -mids, torch.tensor([-0.0, 448.0])])[: 300]
        x[r, : row.numel()] = row.roll(r * 37)
        for b0 in range(0, 300, block):
            x[r, b0] = 448.0 if r % 2 else -448.0
    x[3, 256:300] = torch.linspace(-3e-3, 3e-3, 44)  # last (partial) block: small values
    return x.bfloat16()


def _random_activation(k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, k, generator=g) * torch.logspace(-3, 2, 5).unsqueeze(1)
    x[:, 7] *= 50  # an outlier channel, as in real LLM activations
    return x.bfloat16()


@pytest.mark.parametrize("flavour,runtime", _runs())
@pytest.mark.parametrize("key", ACT_KEYS)
def test_activation_fake_quant_is_bit_exact(key, flavour, runtime):
    spec = spec_by_key(key)
    if spec.name == "nvfp4":
        inputs = [_nvfp4_tie_rich(spec.global_scope == "per_token"), _random_activation(128, 1)]
    else:
        inputs = [_fp8_tie_rich(300 if spec.granularity == Granularity.PER_TOKEN else 128), _random_activation(300, 2)]
    for x in inputs:
        for dtype in (torch.bfloat16, torch.float32):
            xd = x.to(dtype)
            model = activation_qdq_model(key, ("M", xd.shape[-1]), flavour=flavour, dtype=dtype)
            out = _run(model, {"x": xd if flavour == "spec" else xd.float()}, flavour, runtime)["x_hat"].to(dtype)
            _assert_bits_equal(out, reference_qdq(key, xd))


@pytest.mark.parametrize("flavour,runtime", _runs())
def test_activation_fake_quant_keeps_leading_dims_and_rounds_to_out_dtype(flavour, runtime):
    key = "nvfp4.activation.per_token"
    x = _random_activation(64, 3).reshape(5, 1, 64).float()
    model = activation_qdq_model(key, (5, 1, 64), flavour=flavour, dtype=torch.float32, out_dtype=torch.bfloat16)
    out = _run(model, {"x": x}, flavour, runtime)["x_hat"]
    ref = reference_quantize(spec_by_key(key), x).dequantize(torch.bfloat16)
    _assert_bits_equal(out.to(torch.bfloat16), ref)
    assert out.shape == (5, 1, 64)


@pytest.mark.parametrize("flavour,runtime", _runs())
@pytest.mark.parametrize("key", ACT_KEYS)
def test_non_finite_activation_poisons_output_instead_of_encoding(key, flavour, runtime):
    """qpass raises on NaN/inf; an ONNX graph cannot, so the affected scale group is NaN: the whole
    tensor for a per-tensor global scale, the row for per-token and 1x128 scales."""
    x = _random_activation(256, 4).float()
    x[2, 9] = float("inf")
    model = activation_qdq_model(key, ("M", 256), flavour=flavour, dtype=torch.float32)
    out = _run(model, {"x": x}, flavour, runtime)["x_hat"]
    per_row = key.endswith("per_token") or key.endswith("block_1x128")
    assert bool(torch.isnan(out[2]).all())
    assert bool(torch.isnan(out[0]).all()) != per_row
    if per_row:
        _assert_bits_equal(out[[0, 1, 3, 4]], reference_qdq(key, x[[0, 1, 3, 4]]))


# ----------------------------------------------------------------------------------------- export
def _op_reference(rollout, site: str, x: torch.Tensor) -> torch.Tensor:
    node = next(n for n in rollout.nodes_of_site(site) if n.op == "call_function" and str(n.target).startswith("qpass"))
    args = [rollout.attr(str(a.target)) if isinstance(a, torch.fx.Node) else a for a in node.args[1:]]
    return node.target(x, *args)


def _check_export(rollout, recs, model, flavour, runtime, *, exact_sites_min: float):
    feeds, refs = {}, {}
    for i, s in enumerate(recs):
        x = torch.randn(6, s.in_features, generator=torch.Generator().manual_seed(10 + i)).bfloat16()
        x[:, 5] *= 20
        feeds[f"{s.site}.x"] = x if flavour == "spec" else x.float()
        refs[f"{s.site}.y"] = _op_reference(rollout, s.site, x)
    out = run_onnx(model, feeds, runtime=runtime)
    exact = 0
    for name, ref in refs.items():
        got = out[name].to(ref.dtype)
        # only the float32 summation order inside MatMul may differ: at most 1 bf16 ulp of the output
        assert torch.allclose(got.float(), ref.float(), rtol=2 ** -7, atol=1e-6), name
        exact += int(torch.equal(got, ref))
    assert exact >= exact_sites_min * len(refs)


EXPORT_RECIPES = {
    "w4a4_rac_masked_batch": "  - pass: w4a4_lower\n    act: nvfp4\n  - pass: residual_compensation\n    ratio: 0.5\n",
    "w4a4pt_rac_gathered_token": "  - pass: w4a4_lower\n    act: nvfp4_per_token\n  - pass: residual_compensation\n    ratio: 0.3\n    mode: gathered\n    selection: token\n",
    "w4a16": "  - pass: w4a16_lower\n",
    "fp8_block": "  - pass: fp8_lower\n",
    "mxfp4": "  - pass: mxfp4_lower\n",
}


@pytest.mark.parametrize("recipe", list(EXPORT_RECIPES))
def test_rollout_site_export_matches_rollout_ops(tiny_pipeline, recipe):
    from qpass.recipe import parse_recipe

    _, rollout = tiny_pipeline.build(parse_recipe(f"name: {recipe}\nrollout:\n{EXPORT_RECIPES[recipe]}"))
    for flavour, runtime in RUNS:
        if runtime == "onnxruntime" and not HAVE_ORT:
            continue
        model, recs = rollout_sites_model(rollout, flavour=flavour)
        assert len(recs) == 14  # 2 layers x (q, k, v, o, gate, up, down); lm_head excluded
        if flavour == "spec":
            onnx.checker.check_model(model, full_check=True)
        # the quantized operands are bit-exact (tests above); MatMul may sum in another order, so
        # outputs agree to one bf16 ulp, and most sites are bit-identical anyway
        _check_export(rollout, recs, model, flavour, runtime, exact_sites_min=0.5)


def test_gathered_batch_and_static_rac_site_match_reference():
    """RAC variants not covered by the recipe test: gathered/batch and masked/static on one site."""
    from qpass.formats.spec import NVFP4_ACT
    from qpass.ops import NVFP4_LINEAR
    from qpass.ops.linear import nvfp4_linear_ref

    g = torch.Generator().manual_seed(5)
    w = (torch.randn(48, 96, generator=g) * 0.05).bfloat16()
    q = nvfp4_quantize(w)
    x = (torch.randn(7, 96, generator=g)).bfloat16()
    x[:, 3] *= 40
    bias = torch.randn(48, generator=g).bfloat16()
    static = torch.tensor([90, 3, 40, 41, 7], dtype=torch.int64)
    from qpass.quant.rac import RACConfig

    cases = [(RACConfig(0.3, "gathered", "batch"), None), (RACConfig(0.25, "masked", "static"), static), (RACConfig(0.25, "gathered", "static"), static)]
    for rac, ch in cases:
        s = SiteLinear("blk.proj", NVFP4_WEIGHT, q, bias, NVFP4_ACT, rac, ch)
        ref = nvfp4_linear_ref(NVFP4_LINEAR.make_call(x, q.codes, q.scales, q.s_dec, bias, "blk.proj", "nvfp4", rac.ratio,
                                                      rac.mode, rac.selection, ch))
        for flavour, runtime in RUNS:
            if runtime == "onnxruntime" and not HAVE_ORT:
                continue
            model, _ = rollout_sites_model([s], flavour=flavour)
            got = run_onnx(model, {"blk.proj.x": x if flavour == "spec" else x.float()}, runtime=runtime)["blk.proj.y"].bfloat16()
            assert torch.allclose(got.float(), ref.float(), rtol=2 ** -7, atol=1e-6), (rac, flavour, runtime)
            if runtime == "reference":
                assert torch.equal(got, ref), (rac, flavour)


def test_export_writes_atomically_and_reads_back_from_artifacts(tiny_pipeline, tmp_path):
    from qpass.apps.artifacts import save_rollout
    from qpass.recipe import parse_recipe

    text = "name: quads_like\nrollout:\n  - pass: w4a4_lower\n    act: nvfp4\n  - pass: residual_compensation\n    ratio: 0.5\n"
    _, rollout = tiny_pipeline.build(parse_recipe(text))
    path = tmp_path / "out" / "rollout.onnx"
    rep = export_rollout_onnx(rollout, path, flavour="portable")
    assert path.exists() and rep.opset == 21 and len(rep.sites) == 14 and rep.bytes == path.stat().st_size
    assert [p.name for p in path.parent.iterdir()] == ["rollout.onnx"]  # no temp file left behind
    with pytest.raises(Exception, match="unknown or unquantized site"):
        export_rollout_onnx(rollout, tmp_path / "bad.onnx", sites=["model.nope"])
    assert not (tmp_path / "bad.onnx").exists() and not any(p.name.startswith(".") for p in tmp_path.iterdir())

    save_rollout(rollout, tmp_path / "art" / "rollout", text, {"recipe": "quads_like"})
    from_graph = onnx.load(str(path))
    from_dir, recs = rollout_sites_model(tmp_path / "art", flavour="portable")
    assert {s.site: (s.act, s.rac) for s in recs} == {s.site: (s.act, s.rac) for s in sites_from_qgraph(rollout)}
    inits = lambda m: {t.name: t.raw_data for t in m.graph.initializer if t.name.startswith("model.")}  # noqa: E731
    assert len(inits(from_dir)) == 14 * 3  # codes, block scales, S_dec per site
    assert inits(from_dir) == inits(from_graph)
    rep = export_rollout_onnx(tmp_path / "art", tmp_path / "spec.onnx", flavour="spec", sites=["model.layers.0.mlp.gate_proj"])
    assert rep.opset == 23 and rep.sites == ("model.layers.0.mlp.gate_proj",)
    onnx.checker.check_model(onnx.load(str(tmp_path / "spec.onnx")), full_check=True)
    assert not os.path.exists(tmp_path / f".spec.onnx.tmp-{os.getpid()}")


def test_export_dispatches_on_the_onnx_table_by_spec_type(tiny_pipeline, tmp_path, monkeypatch):
    """The per-site export reads and emits every site through ``entry("onnx", spec).linear`` (was a
    chain over kind strings that ignored the table): a wrapped entry sees every MXFP4 site, from the
    graph and from saved artifacts, and a deleted entry is a KeyError naming the table and the spec."""
    import dataclasses

    from qpass.apps.artifacts import save_rollout
    from qpass.backends.onnx.export import sites_from_artifacts
    from qpass.formats.spec import MXFP4Spec
    from qpass.recipe import parse_recipe
    from qpass.tables import TABLES

    text = f"name: mx\nrollout:\n{EXPORT_RECIPES['mxfp4']}"
    _, rollout = tiny_pipeline.build(parse_recipe(text))
    save_rollout(rollout, tmp_path / "art" / "rollout", text, {"recipe": "mx"})
    rule = TABLES["onnx"][MXFP4Spec]
    seen: list[str] = []

    def spy(name):
        fn = getattr(rule.linear, name)
        return lambda *a, **k: seen.append(f"{name}:{a[0] if name != 'operands' else a[1].site}") or fn(*a, **k)

    linear = dataclasses.replace(rule.linear, **{n: spy(n) for n in ("from_op_args", "from_checkpoint", "operands")})
    monkeypatch.setitem(TABLES["onnx"], MXFP4Spec, dataclasses.replace(rule, linear=linear))
    _, recs = rollout_sites_model(rollout, flavour="spec")
    assert len(recs) == 14 and all(isinstance(s.spec, MXFP4Spec) and s.kind == "mxfp4_linear" for s in recs)
    assert sorted(seen) == sorted([f"from_op_args:{s.site}" for s in recs] + [f"operands:{s.site}" for s in recs])
    seen.clear()
    assert [s.site for s in sites_from_artifacts(tmp_path / "art")] == sorted(s.site for s in recs)
    assert seen == [f"from_checkpoint:{s}" for s in sorted(s.site for s in recs)]
    monkeypatch.delitem(TABLES["onnx"], MXFP4Spec)
    with pytest.raises(KeyError, match="table 'onnx' has no entry for spec mxfp4"):
        rollout_sites_model(rollout, flavour="spec")


def test_fp16_site_export_at_the_fp16_max_equals_the_rollout_op():
    """An fp16 model's W4A4 site at the fp16 max: the factored ONNX graph (``B_X``, ``B_W``, ``alpha``;
    SPEC §3.1) gives ``qpass::nvfp4_linear``'s y bit for bit, finite: 65504 plain, 65472 with RAC (its
    residual is against the bf16 dequant 65536, as ``rac_reference``'s)."""
    from qpass.formats.spec import NVFP4_ACT, NVFP4_WEIGHT
    from qpass.ops import NVFP4_LINEAR
    from qpass.ops.linear import nvfp4_linear_ref
    from qpass.quant.rac import RACConfig

    x = torch.zeros(2, 32, dtype=torch.float16)
    x[:, 0] = 65504.0
    w = torch.zeros(16, 32)
    w[0, 0] = 1.0
    q = nvfp4_quantize(w.bfloat16())
    for rac in (None, RACConfig(0.5, "masked", "batch")):
        s = SiteLinear("p", NVFP4_WEIGHT, q, None, NVFP4_ACT, rac)
        ref = nvfp4_linear_ref(NVFP4_LINEAR.make_call(x, q.codes, q.scales, q.s_dec, None, "p", "nvfp4", rac.ratio if rac else 0.0,
                                                      "masked", "batch", None))
        model, _ = rollout_sites_model([s], flavour="spec", dtype=torch.float16)
        got = run_onnx(model, {"p.x": x})["p.y"]
        assert got.dtype == torch.float16 and torch.equal(got, ref), rac
        assert got[0, 0].item() == (65504.0 if rac is None else 65472.0)


def test_emit_site_linear_rejects_unknown_activation_mode():
    from qpass.backends.onnx import GraphBuilder
    from qpass.errors import QpassError

    q = nvfp4_quantize(torch.randn(16, 32).bfloat16())
    b = GraphBuilder("portable")
    x = b.add_input("x", onnx.TensorProto.FLOAT, ["t", 32])
    with pytest.raises(QpassError, match="site s has unknown NVFP4 activation mode 'int4'"):
        emit_site_linear(b, SiteLinear("s", NVFP4_WEIGHT, q, None, "int4"), x, elem_type=onnx.TensorProto.FLOAT, out_type=onnx.TensorProto.FLOAT)


def test_fp8_per_tensor_activation_granularity_is_supported():
    """fp8_lower accepts act_granularity per_tensor (not a canonical spec key): the export emitter handles it."""
    from qpass.backends.onnx import GraphBuilder
    from qpass.backends.onnx.emit import fp8_activation

    spec = FP8Spec(role="activation", granularity=Granularity.PER_TENSOR)
    x = _random_activation(200, 6)
    for flavour in ("spec", "portable"):
        b = GraphBuilder(flavour)
        xin = b.add_input("x", onnx.TensorProto.BFLOAT16, ["M", 200])
        b.need_opset(23 if flavour == "spec" else 21)
        out = fp8_activation(b, xin, 200, elem_type=onnx.TensorProto.BFLOAT16, dtype=onnx.TensorProto.BFLOAT16, spec=spec)
        b.add_output(out, "y", onnx.TensorProto.BFLOAT16, ["M", 200])
        got = run_onnx(b.model(), {"x": x})["y"]
        from qpass.quant.fp8 import fp8_quantize

        _assert_bits_equal(got, fp8_quantize(x, spec=spec).dequantize(torch.bfloat16))
