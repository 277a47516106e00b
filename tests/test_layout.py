"""128x4 block-scale swizzle (cuBLASLt/CUTLASS NVFP4 layout): round trip, a hand-checked byte
position, zero padding, and equality with torchao's ``to_blocked``."""

from __future__ import annotations

import os

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qpass.quant.layout import from_swizzled_128x4, to_swizzled_128x4

utils = pytest.importorskip("torchao.prototype.mx_formats.utils")


def _bytes(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (rows, cols), generator=g, dtype=torch.int32).to(torch.uint8)


def test_hand_checked_position():
    # [200, 9] scales -> rows padded to 256 (2 row tiles), columns to 12 (3 column tiles), tiles of
    # 512 bytes stored tile-row-major: tile (rt, ct) starts at (rt * 3 + ct) * 512.
    # Byte (m=33, k=5): tile (0, 1) -> base 512; inside: (m % 32) * 16 + ((m // 32) % 4) * 4 + k % 4
    # = 1 * 16 + 1 * 4 + 1 = 21 -> flat offset 533.
    # Byte (m=199, k=8): tile (1, 2) -> base (1*3 + 2) * 512 = 2560; m % 128 = 71: 71 % 32 = 7,
    # 71 // 32 = 2 -> 7 * 16 + 2 * 4 + 0 = 120 -> 2680.
    s = torch.zeros(200, 9, dtype=torch.uint8)
    s[33, 5] = 0xAB
    s[199, 8] = 0xCD
    buf = to_swizzled_128x4(s)
    assert buf.numel() == 256 * 12
    assert buf.nonzero().flatten().tolist() == [533, 2680]
    assert buf[533].item() == 0xAB and buf[2680].item() == 0xCD


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.integers(1, 20), st.integers(0, 1000))
def test_round_trip_padding_and_torchao(rows, cols, seed):
    s = _bytes(rows, cols, seed)
    buf = to_swizzled_128x4(s)
    rt, ct = -(-rows // 128), -(-cols // 4)
    assert buf.shape == (rt * 128 * ct * 4,)
    assert torch.equal(from_swizzled_128x4(buf, rows, cols), s)
    # the padding is exactly the zero bytes (input bytes are 1..255)
    assert int((buf == 0).sum()) == buf.numel() - rows * cols
    assert torch.equal(utils.to_blocked(s).flatten(), buf)


def test_float8_dtype_is_kept_and_errors():
    s = _bytes(130, 5).view(torch.float8_e4m3fn)
    buf = to_swizzled_128x4(s)
    assert buf.dtype == torch.float8_e4m3fn
    back = from_swizzled_128x4(buf, 130, 5)
    assert back.dtype == torch.float8_e4m3fn and torch.equal(back.view(torch.uint8), s.view(torch.uint8))
    with pytest.raises(ValueError, match="2-D"):
        to_swizzled_128x4(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="expected 512"):
        from_swizzled_128x4(torch.zeros(100, dtype=torch.uint8), 3, 3)
