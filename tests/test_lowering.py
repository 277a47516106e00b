"""One spec, many lowerings: every canonical spec has an entry in every table, and they agree."""

from __future__ import annotations

import pytest
import torch

from qpass.formats.spec import ALL_SPECS, NVFP4_WEIGHT, spec_by_key
from qpass.lowering import TABLES, missing_entries, reference_qdq, register
from qpass.recipe import parse_recipe


def test_every_spec_has_every_lowering():
    assert missing_entries() == {t: [] for t in TABLES}


@pytest.mark.parametrize("key", [s.key for s in ALL_SPECS])
def test_learner_qdq_equals_reference_dequantize(key):
    spec = spec_by_key(key)
    k = 128 if spec.name != "mxfp4" else 128
    x = (torch.randn(4, k, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    x[:, 7] *= 20
    got = TABLES["learner_qdq"][key](x.clone().requires_grad_(True))
    assert torch.equal(got.detach(), reference_qdq(key, x))
    # straight-through gradient
    xr = x.clone().requires_grad_(True)
    TABLES["learner_qdq"][key](xr).float().sum().backward()
    assert torch.equal(xr.grad, torch.ones_like(xr))


def test_rollout_lowering_records_are_consistent():
    w = (torch.randn(32, 64) * 0.05).to(torch.bfloat16)
    for s in ALL_SPECS:
        lo = TABLES["rollout_lower"][s.key]
        assert lo.lower_pass and lo.op.startswith("qpass::")
        assert (lo.constants is None) == (s.role == "activation")
        if lo.constants is not None:
            consts = lo.constants(w)
            assert consts and all(isinstance(v, torch.Tensor) for v in consts.values())
    nv = TABLES["rollout_lower"][NVFP4_WEIGHT.key].constants(w)
    ref = TABLES["reference"][NVFP4_WEIGHT.key](w)
    assert torch.equal(nv["codes"], ref.codes) and torch.equal(nv["s_dec"], ref.s_dec)


def test_register_rejects_unknown_table_and_spec():
    with pytest.raises(KeyError, match="unknown lowering table"):
        register("tvm", NVFP4_WEIGHT.key)
    with pytest.raises(KeyError, match="unknown quantization spec"):
        register("onnx_lower", "nvfp4.weight.per_block")


def test_mxfp4_lowered_rollout_matches_reference(tiny_pipeline):
    from qpass.ops import _mxfp4_linear_ref

    _, rollout = tiny_pipeline.build(parse_recipe("name: m\nrollout:\n  - pass: mxfp4_lower\n"))
    nodes = rollout.call_nodes(torch.ops.qpass.mxfp4_linear.default)
    assert len(nodes) == 14  # K = 64 and 128 are multiples of 32; lm_head excluded by default
    x = torch.randn(3, 64).to(torch.bfloat16)
    n = next(n for n in nodes if n.args[4].endswith("q_proj"))
    codes, scales = (rollout.gm.get_buffer(str(a.target)) for a in n.args[1:3])
    out = torch.ops.qpass.mxfp4_linear(x, codes, scales, None, n.args[4])
    assert torch.equal(out, _mxfp4_linear_ref(x, codes, scales, None, n.args[4]))
