"""The rollout ops' typed contract (issue 33 item 1): declared once, kernels receive one typed call."""

from __future__ import annotations

import pytest
import torch

from qpass import ops
from qpass.errors import QpassError, QuantizationError
from qpass.formats.spec import NVFP4_ACT, NVFP4_ACT_MODES, NVFP4_ACT_PER_TOKEN, nvfp4_act_mode, nvfp4_act_spec_of
from qpass.ops import FP8_LINEAR, LINEAR_OPS, MXFP4_LINEAR, NVFP4_LINEAR, NVFP4LinearCall
from qpass.quant import rac as rac_mod
from qpass.quant.nvfp4 import nvfp4_quantize
from qpass.quant.rac import RACConfig
from qpass.tables import KERNEL_CLAIMS, TABLES


def _weight(n: int = 16, k: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return nvfp4_quantize((torch.randn(n, k, generator=g) * 0.05).bfloat16())


def _x(m: int = 5, k: int = 64, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    x[:, 3] *= 30
    return x


def test_each_op_schema_is_the_registered_torch_schema():
    for op in LINEAR_OPS:
        schema = op.overload()._schema
        assert tuple(a.name for a in schema.arguments) == op.arg_names
        assert str(schema) == f"{op.name}{op.schema_str()}"
        # the kernel table key of every reference kernel is the schema's (op, spec type)
        assert (op.name, op.spec_type, "reference") in TABLES["kernels"]


def test_flat_arguments_round_trip_through_the_typed_call():
    q = _weight()
    x = _x()
    ch = torch.tensor([3, 9, 40], dtype=torch.int64)
    for act in ("none", "nvfp4", "nvfp4_per_token"):
        for rac in ((0.0, "masked", "batch"), (0.5, "gathered", "token"), (3 / 64, "masked", "static")):
            flat = dict(x=x, w_codes=q.codes, w_scales=q.scales, w_s_dec=q.s_dec, bias=None, site="s", act=act,
                        rac_ratio=rac[0], rac_mode=rac[1], rac_selection=rac[2], rac_channels=ch)
            call = NVFP4_LINEAR.make_call(**flat)
            assert call.act is nvfp4_act_spec_of(act)
            assert (call.rac is None) == (act == "none" or rac[0] == 0.0)
            assert call.rac_k == (0 if call.rac is None else call.rac.num_channels(64))
            assert (call.rac_channels is ch) == (call.rac is not None and rac[2] == "static")
            again = NVFP4_LINEAR.make_call(**call.to_args())
            assert (again.act, again.rac, again.rac_k, again.site) == (call.act, call.rac, call.rac_k, call.site)


def test_act_modes_are_one_table():
    assert NVFP4_ACT_MODES == {"nvfp4": NVFP4_ACT, "nvfp4_per_token": NVFP4_ACT_PER_TOKEN, "none": None}
    for mode, spec in NVFP4_ACT_MODES.items():
        assert nvfp4_act_mode(spec) == mode and nvfp4_act_spec_of(mode) is spec
    q = _weight()
    with pytest.raises(QpassError, match=r"nvfp4_linear at site blk\.0: NVFP4 activation mode must be one of .*got 'int4'"):
        torch.ops.qpass.nvfp4_linear(_x(), q.codes, q.scales, q.s_dec, None, "blk.0", "int4", 0.0, "masked", "batch", None)


def test_k_mismatch_is_refused_at_the_op_boundary_naming_the_site():
    q = _weight(k=64)
    with pytest.raises(QuantizationError, match="input has K=32 but the weight has K=64 at site blk.1"):
        torch.ops.qpass.nvfp4_linear(_x(k=32), q.codes, q.scales, q.s_dec, None, "blk.1", "nvfp4", 0.0, "masked", "batch", None)


def test_the_ratio_becomes_k_once_per_call(monkeypatch):
    """Failing-first: the old op computed floor(ratio*K) three times per RAC call (op, linear, rac)."""
    calls = []
    real = rac_mod.rac_num_channels.__wrapped__

    def counting(k: int, ratio: float) -> int:
        calls.append((k, ratio))
        return real(k, ratio)

    monkeypatch.setattr(rac_mod, "rac_num_channels", counting)
    q = _weight()
    for sel in ("batch", "token"):
        for mode in ("masked", "gathered"):
            calls.clear()
            torch.ops.qpass.nvfp4_linear(_x(), q.codes, q.scales, q.s_dec, None, "s", "nvfp4", 0.5, mode, sel, None)
            assert calls == [(64, 0.5)], (mode, sel)


def test_kernels_receive_one_typed_call():
    seen = []

    @ops.register_kernel(NVFP4_LINEAR, "recorder")
    def _rec(call):  # noqa: ANN001
        seen.append(call)
        return torch.zeros(*call.x.shape[:-1], call.out_features, dtype=call.out_dtype)

    try:
        q = _weight()
        x = _x()
        bias = torch.randn(16).bfloat16()
        with ops.use_kernels("recorder"):
            y = torch.ops.qpass.nvfp4_linear(x, q.codes, q.scales, q.s_dec, bias, "blk.2", "nvfp4_per_token", 0.25,
                                             "gathered", "batch", None)
        (call,) = seen
        assert isinstance(call, NVFP4LinearCall) and y.shape == (5, 16)
        assert call.x is x and call.bias is bias and call.site == "blk.2" and call.out_dtype == torch.bfloat16
        assert torch.equal(call.weight.codes, q.codes) and torch.equal(call.weight.s_dec, q.s_dec)
        assert call.act is NVFP4_ACT_PER_TOKEN and call.per_token and not call.w4a16
        assert call.rac == RACConfig(0.25, "gathered", "batch") and call.rac_k == 16
    finally:
        TABLES["kernels"].pop(("qpass::nvfp4_linear", NVFP4_LINEAR.spec_type, "recorder"))
        KERNEL_CLAIMS.pop("recorder", None)


def test_fp8_and_mxfp4_calls_carry_their_specs():
    from qpass.formats.spec import FP8_ACT_BLOCK, FP8_WEIGHT_BLOCK
    from qpass.quant.fp8 import fp8_quantize
    from qpass.quant.mxfp4 import mxfp4_quantize

    w = (torch.randn(128, 128) * 0.05).bfloat16()
    q8 = fp8_quantize(w, spec=FP8_WEIGHT_BLOCK)
    call = FP8_LINEAR.make_call(_x(k=128), q8.data, q8.scale, None, "f", "block_1x128", "block_128x128")
    assert call.act == FP8_ACT_BLOCK and call.weight_spec == FP8_WEIGHT_BLOCK
    assert FP8_LINEAR.make_call(**call.to_args()).act == call.act
    qm = mxfp4_quantize(w)
    mcall = MXFP4_LINEAR.make_call(_x(k=128), qm.codes, qm.scales, None, "m")
    assert mcall.weight.shape == (128, 128) and set(mcall.to_args()) == set(MXFP4_LINEAR.arg_names)
    with pytest.raises(QpassError, match="weight-only"):
        MXFP4LinearCall_lowering = MXFP4_LINEAR.call.lowering_args  # noqa: N806
        MXFP4LinearCall_lowering(qm.spec, FP8_ACT_BLOCK, "m")


def test_records_answer_by_method():
    from qpass.formats.spec import FP8Spec, MXFP4Spec, NVFP4_WEIGHT, NVFP4Spec
    from qpass.graph.records import SiteQuant

    w4a4 = SiteQuant("a", "model.a.weight", "a", ("a",), spec=NVFP4_WEIGHT, act_spec=NVFP4_ACT, op="qpass::nvfp4_linear",
                     constants={"codes": "c"})
    act_only = SiteQuant("b", "model.b.weight", "b", ("b",), act_spec=NVFP4_ACT_PER_TOKEN, op="qpass::nvfp4_act_qdq")
    assert w4a4.lowered_as(NVFP4Spec) and not w4a4.lowered_as(FP8Spec) and not w4a4.lowered_as(MXFP4Spec)
    assert w4a4.w4a4 and not w4a4.activation_only and w4a4.nvfp4_act_mode() == "nvfp4"
    assert act_only.activation_only and not act_only.lowered_as(NVFP4Spec) and act_only.nvfp4_act_mode() == "nvfp4_per_token"


def test_static_activation_scale_is_part_of_the_typed_call():
    """The calibrate branch's ``act='nvfp4_static'`` + ``act_amax`` on the op contract: one flat argument,
    one call field, the same numbers as the keyword convenience, and the mode only in the op's table."""
    from qpass.formats.spec import NVFP4_ACT_STATIC, NVFP4_OP_ACT_MODES
    from qpass.quant.linear import w4a4_linear_reference

    assert NVFP4_OP_ACT_MODES == {**NVFP4_ACT_MODES, "nvfp4_static": NVFP4_ACT_STATIC}
    assert "nvfp4_static" not in NVFP4_ACT_MODES  # recipes and checkpoint configs never name it
    assert nvfp4_act_mode(NVFP4_ACT_STATIC) == "nvfp4_static" and nvfp4_act_spec_of("nvfp4_static") is NVFP4_ACT_STATIC
    assert NVFP4_LINEAR.arg_names[-1] == "act_amax"
    q, x = _weight(), _x()
    amax = torch.tensor(2.5)
    for rac in ((0.0, "masked", "batch"), (0.25, "masked", "batch"), (0.25, "gathered", "token")):
        flat = dict(x=x, w_codes=q.codes, w_scales=q.scales, w_s_dec=q.s_dec, bias=None, site="s", act="nvfp4_static",
                    rac_ratio=rac[0], rac_mode=rac[1], rac_selection=rac[2], rac_channels=None, act_amax=amax)
        call = NVFP4_LINEAR.make_call(**flat)
        assert call.act is NVFP4_ACT_STATIC and call.static_act and call.act_amax is amax
        args = call.to_args()
        assert args["act"] == "nvfp4_static" and args["act_amax"] is amax and set(args) == set(NVFP4_LINEAR.arg_names)
        assert NVFP4LinearCall.decode(args) == (NVFP4_ACT_STATIC, call.rac)
        y = torch.ops.qpass.nvfp4_linear(**args)
        want = w4a4_linear_reference(x, q, act_spec=NVFP4_ACT_STATIC, rac=call.rac, act_amax=amax, site="s")
        assert torch.equal(y, want)
        # a static scale really is used: the dynamic op of the same input gives other numbers
        assert not torch.equal(y, torch.ops.qpass.nvfp4_linear(**{**args, "act": "nvfp4", "act_amax": None}))
    with pytest.raises(QuantizationError, match="site s: static activation scale .* but no calibrated amax"):
        NVFP4_LINEAR.make_call(**{**flat, "act_amax": None})
    with pytest.raises(QuantizationError, match="site s: a calibrated act_amax was given for activation mode 'nvfp4'"):
        NVFP4_LINEAR.make_call(**{**flat, "act": "nvfp4"})
    from qpass.formats.spec import NVFP4_WEIGHT as NVFP4_LINEAR_WEIGHT

    lowering = NVFP4LinearCall.lowering_args(NVFP4_LINEAR_WEIGHT, NVFP4_ACT_STATIC, "s")
    assert lowering["act"] == "nvfp4_static" and lowering["act_amax"] is None  # the pass adds the constant


def test_kernels_without_a_static_scale_refuse_it_by_name():
    """A kernel not marked ``serves_static_act`` never computes a static call (it would quantize with the
    input's own amax, silently): the op refuses before it runs, naming site and backend; Triton refuses too."""
    from qpass.tables import KernelMissingError

    ran = []

    @ops.register_kernel(NVFP4_LINEAR, "dynamic_only")
    def _dyn(call):  # noqa: ANN001
        ran.append(call)
        return torch.zeros(*call.x.shape[:-1], call.out_features, dtype=call.out_dtype)

    q = _weight()
    args = (_x(), q.codes, q.scales, q.s_dec, None, "blk.3", "nvfp4_static", 0.0, "masked", "batch", None, torch.tensor(1.0))
    try:
        assert ops.serves_static_act(ops.linear.nvfp4_linear_ref) and not ops.serves_static_act(_dyn)
        with ops.use_kernels("dynamic_only"):
            torch.ops.qpass.nvfp4_linear(*args[:6], "nvfp4", *args[7:11])  # dynamic calls run
            with pytest.raises(KernelMissingError, match="site blk.3: the 'dynamic_only' kernel of qpass::nvfp4_linear has no "
                                                         "static .calibrated. activation scale"):
                torch.ops.qpass.nvfp4_linear(*args)
        assert len(ran) == 1
        with pytest.raises(KernelMissingError, match="site blk.4: the 'dynamic_only' kernel"):
            ops.static_act_kernel_check("dynamic_only", "blk.4")
    finally:
        TABLES["kernels"].pop(("qpass::nvfp4_linear", NVFP4_LINEAR.spec_type, "dynamic_only"))
        KERNEL_CLAIMS.pop("dynamic_only", None)
    from qpass.backends.triton.linear import nvfp4_linear_triton

    with pytest.raises(KernelMissingError, match="site blk.5: the 'triton' kernel"):
        nvfp4_linear_triton(NVFP4_LINEAR.make_call(*args[:5], "blk.5", *args[6:]))
