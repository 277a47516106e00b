"""qpass.tables.backend_quantize: the learner's weight QDQ and the weight sync run the kernel
backend's quantizer (Triton under ``use_kernels("triton")``) and get the reference bytes (issue 13).

CPU: the Triton kernels run under the interpreter (``TRITON_INTERPRET=1``), small shapes only.
"""

from __future__ import annotations

import pytest
import torch

from qpass.formats.spec import NVFP4_WEIGHT, nvfp4_weight_spec
from qpass.quant.groups import group_amax
from qpass.quant.nvfp4 import nvfp4_dequantize, nvfp4_quantize
from qpass.quant.qdq import nvfp4_qdq
from qpass.quant.weights import quantize_site_weights
from qpass.tables import backend_quantize
from tests._triton_testutil import fresh_seed


def _group(seed_shift: float = 1.0) -> dict[str, torch.Tensor]:
    q = torch.randn(48, 64) * 0.05
    k = torch.randn(32, 64) * 0.05 * seed_shift
    q[3, :16] = 0.0  # an all-zero block
    k[5, 17] = 0.9  # the group amax comes from k
    return {"q": q.to(torch.bfloat16), "k": k.to(torch.bfloat16)}


@pytest.fixture
def counted_triton(monkeypatch, triton_backend):
    """The Triton NVFP4 quantizer entry with a call counter (so a test fails if dispatch skipped it)."""
    from qpass.formats.spec import NVFP4Spec
    from qpass.tables import QUANTIZE_OP, TABLES

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    key = (QUANTIZE_OP, NVFP4Spec, "triton")
    inner = TABLES["kernels"][key]
    calls = []

    def counting(spec, x, *args, **kw):
        calls.append(tuple(x.shape))
        return inner(spec, x, *args, **kw)

    monkeypatch.setitem(TABLES["kernels"], key, counting)
    return calls


def test_weight_qdq_and_sync_bytes_on_triton_equal_reference(counted_triton):
    import qpass.ops as ops

    seed = fresh_seed()
    ws = _group()
    amax = group_amax(list(ws.values()))
    ref_hat = {s: nvfp4_dequantize(nvfp4_quantize(w, amax, spec=NVFP4_WEIGHT), w.dtype) for s, w in ws.items()}
    ref_q = quantize_site_weights(NVFP4_WEIGHT, ws)
    assert counted_triton == [], "the reference backend must not call the Triton kernel"
    with ops.use_kernels("triton"):
        hat = {s: nvfp4_qdq(w, amax, site=s) for s, w in ws.items()}
        tq = quantize_site_weights(NVFP4_WEIGHT, ws)
    assert counted_triton == [(48, 64), (32, 64), (48, 64), (32, 64)], counted_triton
    for s in ws:
        assert torch.equal(hat[s].view(torch.int16), ref_hat[s].view(torch.int16)), (seed, s)
        a, b = tq[s].tensor, ref_q[s].tensor
        assert torch.equal(a.codes, b.codes), (seed, s)
        assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8)), (seed, s)
        assert torch.equal(a.s_dec, b.s_dec) and torch.equal(a.s_enc, b.s_enc), (seed, s)
        assert tq[s].flushed_blocks == ref_q[s].flushed_blocks, (seed, s)


def test_modelopt_arithmetic_and_specs_without_a_backend_kernel_take_the_reference(counted_triton):
    import qpass.ops as ops

    w = _group()["q"]
    amax = w.float().abs().amax()
    spec = nvfp4_weight_spec("modelopt")
    with ops.use_kernels("triton"):
        got = backend_quantize(spec, w, amax, site="q")
    assert counted_triton == []  # the Triton NVFP4 kernels implement te_reference only
    ref = nvfp4_quantize(w, amax, spec=spec)
    assert torch.equal(got.codes, ref.codes) and torch.equal(got.scales.view(torch.uint8), ref.scales.view(torch.uint8))


def test_reference_backend_on_cpu_without_interpreter_never_calls_triton(monkeypatch, counted_triton):
    import qpass.ops as ops

    monkeypatch.delenv("TRITON_INTERPRET")
    w = _group()["k"]
    with ops.use_kernels("triton"):  # triton off CUDA without the interpreter runs the reference ops
        nvfp4_qdq(w, None, site="k")
    assert counted_triton == []
