"""Tensor-parallel NVFP4 quantization (SPEC §3 rule 1): with the group amax all-reduced (MAX) over the
process group, every shard quantizes exactly as its slice of the unsharded tensor; without it the
shards' global scales, and so their bytes, differ. Two gloo processes on CPU."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qpass.quant.groups import group_amax
from qpass.quant.nvfp4 import nvfp4_quantize

WORLD = 2
ROWS, K = 64, 96
COL_SPLIT = (32, 64)  # uneven column shards, both multiples of 16: every 1x16 block lies in one shard


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    """Two bf16 weights of a fused group (e.g. gate and up), amax in different shards and tensors."""
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(ROWS, K, generator=g) * 0.02).bfloat16()
    w[3, 70] = 0.8125  # global max of w: row shard 0, column shard 1
    u = (torch.randn(ROWS, K, generator=g) * 0.02).bfloat16()
    u[40, 5] = -1.5  # max of u, and of the fused group: row shard 1, column shard 0
    return w, u


def _parts(q) -> dict[str, torch.Tensor]:
    return {"codes": q.codes, "scales": q.scales.view(torch.uint8), "s_dec": q.s_dec, "s_enc": q.s_enc}


def _worker(rank: int, store_path: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    try:
        w, u = _weights()
        rows = slice(rank * ROWS // WORLD, (rank + 1) * ROWS // WORLD)
        c0 = sum(COL_SPLIT[:rank])
        cols = slice(c0, c0 + COL_SPLIT[rank])
        pg = dist.group.WORLD
        res = {
            "row_synced": _parts(nvfp4_quantize(w[rows], process_group=pg, name="w", site=f"tp{rank}")),
            "row_local": _parts(nvfp4_quantize(w[rows])),
            "col_synced": _parts(nvfp4_quantize(w[:, cols], process_group=pg)),
            "col_local": _parts(nvfp4_quantize(w[:, cols])),
            # fused group (w, u) sharded by rows: amax over both members and both ranks
            "group_synced": _parts(nvfp4_quantize(w[rows], group=[u[rows]], process_group=pg)),
            "group_amax": group_amax([w[rows], u[rows]], process_group=pg),
        }
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_tensor_parallel_quantization_matches_unsharded():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), tmp), nprocs=WORLD, join=True)
        res = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]
    w, u = _weights()
    full = nvfp4_quantize(w)
    fused = nvfp4_quantize(w, group=[u])
    rs = ROWS // WORLD

    def same(parts, ref, rows=slice(None), cols=slice(None)) -> bool:
        codes_cols = slice(None) if cols == slice(None) else slice(cols.start // 2, cols.stop // 2)
        scale_cols = slice(None) if cols == slice(None) else slice(cols.start // 16, cols.stop // 16)
        return (
            torch.equal(parts["codes"], ref.codes[rows, codes_cols])
            and torch.equal(parts["scales"], ref.scales.view(torch.uint8)[rows, scale_cols])
            and torch.equal(parts["s_dec"].view(torch.int32), ref.s_dec.view(torch.int32))
            and torch.equal(parts["s_enc"].view(torch.int32), ref.s_enc.view(torch.int32))
        )

    assert not torch.equal(fused.codes, full.codes)  # the group amax (1.5, from u) matters
    col_slices = [slice(0, COL_SPLIT[0]), slice(COL_SPLIT[0], K)]
    for r in range(WORLD):
        rows = slice(r * rs, (r + 1) * rs)
        # with the MAX all-reduce: byte for byte the slice of the unsharded quantization
        assert same(res[r]["row_synced"], full, rows=rows), f"row shard {r}"
        assert same(res[r]["col_synced"], full, cols=col_slices[r]), f"column shard {r}"
        assert same(res[r]["group_synced"], fused, rows=rows), f"fused group shard {r}"
        assert res[r]["group_amax"].item() == 1.5
    # without it: the shard that does not hold the global max (row shard 1, column shard 0) derives
    # its own, larger S_enc, so its global scale and its bytes differ
    assert same(res[0]["row_local"], full, rows=slice(0, rs))
    assert same(res[1]["col_local"], full, cols=col_slices[1])
    for parts, rows, cols in ((res[1]["row_local"], slice(rs, ROWS), slice(None)), (res[0]["col_local"], slice(None), col_slices[0])):
        assert not same(parts, full, rows=rows, cols=cols)
        assert parts["s_enc"].item() > full.s_enc.item()
        codes_cols = slice(None) if cols == slice(None) else slice(0, cols.stop // 2)
        assert not torch.equal(parts["codes"], full.codes[rows, codes_cols])
