"""Spec tables that run: completeness (proven to fail on a deleted entry), agreement, kernel validation."""

from __future__ import annotations

import copy

import pytest
import torch

from qpass.formats.spec import ALL_SPECS, FP8Spec, MXFP4_WEIGHT, MXFP4Spec, NVFP4_WEIGHT, NVFP4Spec, spec_by_key
from qpass.graph.verify import KNOWN_QPASS_OPS
from qpass.recipe import parse_recipe
from qpass.tables import (
    TABLES, KernelMissingError, emitted_ops, entry, kernel, missing_entries, reference_qdq, reference_quantize,
    register, unknown_ops,
)


def _load_backends() -> None:
    for mod in ("qpass.backends.onnx", "qpass.backends.triton"):
        try:
            __import__(mod)
        except ImportError:
            pass


def test_every_spec_has_an_entry_in_every_table_that_claims_it():
    _load_backends()
    assert missing_entries() == {t: [] for t in ("reference", "learner_qdq", "rollout_lower", "onnx", "export", "kernels")}


@pytest.mark.parametrize("table,key", [("reference", FP8Spec), ("learner_qdq", NVFP4Spec), ("rollout_lower", MXFP4Spec),
                                       ("export", NVFP4Spec)])
def test_completeness_check_fails_when_an_entry_is_deleted(table, key):
    tables = copy.copy(TABLES)
    tables[table] = {k: v for k, v in TABLES[table].items() if k is not key}
    missing = missing_entries(tables)[table]
    assert missing and all(spec_by_key(k).__class__ is key for k in missing)
    assert missing_entries()[table] == []  # the real table is untouched


def test_completeness_check_fails_when_a_reference_kernel_is_deleted():
    tables = copy.copy(TABLES)
    tables["kernels"] = {k: v for k, v in TABLES["kernels"].items() if k != ("qpass::fp8_linear", FP8Spec, "reference")}
    assert "qpass::fp8_linear/fp8_e4m3.weight.block_128x128/reference" in missing_entries(tables)["kernels"]


def test_every_op_a_table_can_emit_is_known_to_the_verifier():
    _load_backends()
    assert "qpass::qdq" in KNOWN_QPASS_OPS
    assert {"qpass::nvfp4_linear", "qpass::fp8_linear", "qpass::mxfp4_linear", "qpass::qdq"} <= emitted_ops()
    assert unknown_ops(KNOWN_QPASS_OPS) == []
    # and the check notices an op the verifier does not know
    assert unknown_ops(KNOWN_QPASS_OPS - {"qpass::qdq"}) == ["qpass::qdq"]


@pytest.mark.parametrize("key", [s.key for s in ALL_SPECS])
def test_learner_qdq_equals_reference_dequantize(key):
    spec = spec_by_key(key)
    x = (torch.randn(4, 128, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    x[:, 7] *= 20
    lq = entry("learner_qdq", spec)
    got = lq(spec, x.clone().requires_grad_(True))
    assert torch.equal(got.detach(), reference_qdq(spec, x))
    xr = x.clone().requires_grad_(True)  # straight-through gradient
    lq(spec, xr).float().sum().backward()
    assert torch.equal(xr.grad, torch.ones_like(xr))


def test_rollout_lowering_entries_are_consistent():
    from qpass.quant.weights import quantize_site_weights

    w = (torch.randn(32, 128) * 0.05).to(torch.bfloat16)
    for s in ALL_SPECS:
        lo = entry("rollout_lower", s)
        assert lo.lower_pass and lo.op.startswith("qpass::")
        op_schema = {a.name for a in lo.op_overload()._schema.arguments}
        assert tuple(a.name for a in lo.op_overload()._schema.arguments) == lo.schema.arg_names  # declared once
        assert set(lo.constant_args.values()) <= op_schema
        if s.role == "weight":
            sw = quantize_site_weights(s, {"site": w})["site"]
            assert set(lo.constant_args) <= set(sw.constants)
            assert all(isinstance(v, torch.Tensor) for v in sw.constants.values())
            assert kernel(lo.op, s, "reference") is not None
            act = next((a for a in ALL_SPECS if a.role == "activation" and type(a) is type(s)), None)
            options = lo.option_args(s, act, "site")
            # a lowered node's arguments = constants + options + x/bias/site, nothing missing, nothing extra
            assert set(options) | set(lo.constant_args.values()) | {"x", "bias", "site"} == op_schema
        else:  # the activation spec becomes string options of the op of its type's weight
            wspec = next(w for w in ALL_SPECS if w.role == "weight" and type(w) is type(s))
            opts = lo.option_args(wspec, s, "site")
            assert opts and all(isinstance(v, str) for k, v in opts.items() if k in ("act", "act_granularity"))
    nv = quantize_site_weights(NVFP4_WEIGHT, {"s": w})["s"].constants
    ref = reference_quantize(NVFP4_WEIGHT, w)
    assert torch.equal(nv["codes"], ref.codes) and torch.equal(nv["s_dec"], ref.s_dec)


def test_register_rejects_unknown_table_and_kernels_without_backend():
    with pytest.raises(KeyError, match="unknown spec table"):
        register("tvm", NVFP4Spec)
    with pytest.raises(KeyError, match="op and backend"):
        register("kernels", NVFP4Spec)


def test_missing_kernel_is_a_named_error():
    with pytest.raises(KernelMissingError, match=r"no 'triton' kernel for qpass::mxfp4_linear with weight spec mxfp4.weight"):
        kernel("qpass::mxfp4_linear", MXFP4_WEIGHT, "triton")


def test_mxfp4_with_a_backend_without_its_kernel_fails_at_build(tiny_pipeline):
    """No silent fallback: a backend that has kernels but not mxfp4_linear is rejected by Pipeline.build."""
    from qpass import ops

    fake = ops.register_kernel(ops.NVFP4_LINEAR, "fakegpu")(lambda call: None)
    try:
        recipe = parse_recipe("name: m\nrollout:\n  - pass: mxfp4_lower\n")
        with pytest.raises(KernelMissingError, match=r"site model\.layers\.\d+\..*no 'fakegpu' kernel for qpass::mxfp4_linear"):
            tiny_pipeline.build(recipe, kernels="fakegpu")
        with ops.use_kernels("fakegpu"), pytest.raises(KernelMissingError, match="fakegpu"):
            tiny_pipeline.build(recipe)  # the current backend is validated too
        tiny_pipeline.build(parse_recipe("name: w\nrollout:\n  - pass: w4a16_lower\n"), kernels="fakegpu")  # has it
    finally:
        TABLES["kernels"].pop(("qpass::nvfp4_linear", NVFP4Spec, "fakegpu"))
        from qpass.tables import KERNEL_CLAIMS

        KERNEL_CLAIMS.pop("fakegpu", None)
    del fake


def test_unregistered_kernel_backend_is_refused():
    from qpass import ops
    from qpass.errors import QpassError

    with pytest.raises(QpassError, match="no registered kernels"):
        with ops.use_kernels("nosuchbackend"):
            pass


def test_mxfp4_lowered_rollout_matches_reference(tiny_pipeline):
    from qpass.graph.opargs import op_args
    from qpass.ops import MXFP4_LINEAR
    from qpass.ops.linear import mxfp4_linear_ref

    _, rollout = tiny_pipeline.build(parse_recipe("name: m\nrollout:\n  - pass: mxfp4_lower\n"))
    nodes = rollout.call_nodes(torch.ops.qpass.mxfp4_linear.default)
    assert len(nodes) == 14  # K = 64 and 128 are multiples of 32; lm_head excluded by default
    x = torch.randn(3, 64).to(torch.bfloat16)
    n = next(n for n in nodes if op_args(n)["site"].endswith("q_proj"))
    a = op_args(n)
    codes, scales = (rollout.gm.get_buffer(str(a[k].target)) for k in ("w_codes", "w_scales"))
    out = torch.ops.qpass.mxfp4_linear(x, codes, scales, None, a["site"])
    assert torch.equal(out, mxfp4_linear_ref(MXFP4_LINEAR.make_call(x, codes, scales, None, a["site"])))


def test_triton_quantizers_live_in_the_one_kernel_table():
    pytest.importorskip("triton")
    import qpass.backends.triton as tr
    from qpass.tables import QUANTIZE_OP

    assert set(tr.TRITON_KERNELS) == {s.key for s in ALL_SPECS}
    tables = copy.copy(TABLES)
    tables["kernels"] = {k: v for k, v in TABLES["kernels"].items() if k != (QUANTIZE_OP, MXFP4Spec, "triton")}
    assert missing_entries(tables)["kernels"] == ["quantize/mxfp4.weight/triton"]
