"""Fused RAC kernels vs ``qpass.quant.rac.rac_reference``: qa/qr bytes, channels, operands equal."""

from __future__ import annotations

import itertools

import pytest
import torch

from qpass.errors import QuantizationError
from qpass.formats.spec import NVFP4_ACT, NVFP4_ACT_PER_TOKEN
from qpass.quant.rac import RACConfig, rac_reference

from qpass.backends.triton import rac_triton

try:  # tests/ may or may not be a package
    from ._triton_testutil import activations, fresh_seed, same_nvfp4
except ImportError:
    from _triton_testutil import activations, fresh_seed, same_nvfp4


def _compare(got, ref, seed):
    assert torch.equal(got.channels, ref.channels), (seed, "channels")
    if ref.gather_index is None:
        assert got.gather_index is None
    else:
        assert torch.equal(got.gather_index, ref.gather_index), (seed, "gather_index")
    for name in ("qa", "qr"):
        eq = same_nvfp4(getattr(got, name), getattr(ref, name))
        assert all(eq.values()), (seed, name, eq)
    assert torch.equal(got.x_hat, ref.x_hat), (seed, "x_hat")
    assert torch.equal(got.comp, ref.comp), (seed, "comp")
    assert torch.equal(got.residual, ref.residual), (seed, "residual")


@pytest.mark.parametrize(
    "mode,selection,per_token",
    list(itertools.product(["masked", "gathered"], ["batch", "token", "static"], [False, True])),
)
def test_rac_bit_identical(mode, selection, per_token):
    seed = fresh_seed()
    m = int(torch.randint(5, 24, ()))
    k = 16 * int(torch.randint(4, 7, ()))
    x = activations(m, k, torch.bfloat16)
    cfg = RACConfig([0.125, 0.3, 0.5][seed % 3], mode, selection)
    static = torch.randperm(k)[: max(1, k // 5)] if selection == "static" else None
    spec = NVFP4_ACT_PER_TOKEN if per_token else NVFP4_ACT
    got = rac_triton(x, cfg, spec, static_channels=static)
    ref = rac_reference(x, cfg, spec, static_channels=static)
    _compare(got, ref, (seed, m, k, cfg.ratio))


def test_rac_ties_break_to_lower_index_and_fp32_input():
    """Duplicated channels have identical exact scores: the lower index must win, as in the reference."""
    seed = fresh_seed()
    x = activations(12, 64, torch.float32)
    x[:, 40:48] = x[:, 8:16]  # same residuals -> same int64 scores
    x[:, 49] = x[:, 9]
    for sel in ("batch", "token"):
        cfg = RACConfig(0.25, "gathered", sel)
        _compare(rac_triton(x, cfg, NVFP4_ACT), rac_reference(x, cfg, NVFP4_ACT), (seed, sel))


def test_rac_errors():
    x = torch.randn(4, 32)
    with pytest.raises(QuantizationError, match="static"):
        rac_triton(x, RACConfig(0.5, "masked", "static"), NVFP4_ACT)
    with pytest.raises(QuantizationError, match="out of range"):
        rac_triton(x, RACConfig(0.5, "masked", "static"), NVFP4_ACT, static_channels=torch.tensor([1, 40]))
    bad = x.clone()
    bad[1, 1] = float("inf")
    with pytest.raises(QuantizationError, match="non-finite"):
        rac_triton(bad, RACConfig(0.5, "masked", "batch"), NVFP4_ACT)
