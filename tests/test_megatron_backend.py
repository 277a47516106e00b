"""Megatron-core learner backend: NVFP4 weight fake-quant with STE on Column/RowParallelLinear.

Two gloo processes on CPU run the same MLP block (ColumnParallelLinear -> gelu -> RowParallelLinear,
TE-free local layers) twice: tensor parallel 2, then tensor parallel 1 (data parallel 2). With the
amax all-reduced (MAX) over the TP group: TP=1 and TP=2 agree in outputs and gradients up to float32
summation order, the fake-quant weights and the exported (all-gathered) codes / scale bytes / global
scale equal qpass's quantization of the unsharded weight bit for bit; without the all-reduce the
shard that lacks the outlier gets another global scale and different bytes. The same workers check
the SGLang plugin's K-sharded activation quantization (row-parallel W4A4) against the unsharded one.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from qpass.backends.megatron import megatron_available, split_megatron_fc1, split_megatron_qkv
from qpass.quant.nvfp4 import nvfp4_dequantize, nvfp4_qdq_reference, nvfp4_quantize

WORLD = 2
H, F, S, B = 64, 128, 4, 2  # hidden, MLP width (row-parallel K per rank = 64), seq, batch


def _full_weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    w1 = torch.randn(F, H, generator=g) * 0.05  # fc1 [F, H]: column-parallel, rows split
    w2 = torch.randn(H, F, generator=g) * 0.05  # fc2 [H, F]: row-parallel, K split
    w1[5, 3] = 0.9  # amax in rank 0's rows
    w2[7, 10] = -1.1  # amax in rank 0's K-columns
    x = torch.randn(S, B, H, generator=g)
    gy = torch.randn(S, B, H, generator=g)  # upstream gradient
    return w1, w2, x, gy


def _parts(q) -> dict[str, torch.Tensor]:
    return {"codes": q.codes.clone(), "scales": q.scales.view(torch.uint8).clone(), "s_dec": q.s_dec.clone()}


def _run_block(tp: int, rank: int, sync: bool = True) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from qpass.backends.megatron import enable_nvfp4_weight_fake_quant, export_nvfp4_weight, fake_quant_weight

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        cfg = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True, perform_initialization=True,
                                  params_dtype=torch.float32, gradient_accumulation_fusion=False, sequence_parallel=False)
        init = lambda w: torch.nn.init.zeros_(w)  # noqa: E731 - overwritten below
        col = ColumnParallelLinear(H, F, config=cfg, init_method=init, bias=False, gather_output=False)
        row = RowParallelLinear(F, H, config=cfg, init_method=init, bias=False, input_is_parallel=True, skip_bias_add=False)
        w1, w2, x, gy = _full_weights()
        tr = ps.get_tensor_model_parallel_rank()
        rows, cols = slice(tr * F // tp, (tr + 1) * F // tp), slice(tr * F // tp, (tr + 1) * F // tp)
        with torch.no_grad():
            col.weight.copy_(w1[rows])
            row.weight.copy_(w2[:, cols])
        enable_nvfp4_weight_fake_quant(col, site="mlp.linear_fc1", sync_amax=sync)
        enable_nvfp4_weight_fake_quant(row, site="mlp.linear_fc2", sync_amax=sync)
        xr = x.clone().requires_grad_(True)
        y, _ = col(xr)
        z, _ = row(torch.nn.functional.gelu(y))
        z.backward(gy)
        pg = ps.get_tensor_model_parallel_group()

        def gather(t: torch.Tensor, dim: int) -> torch.Tensor:
            if tp == 1:
                return t
            bufs = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(bufs, t.contiguous(), group=pg)
            return torch.cat(bufs, dim)

        with torch.no_grad():
            w_hat1, w_hat2 = gather(fake_quant_weight(col, col.weight), 0), gather(fake_quant_weight(row, row.weight), 1)
        return {
            "z": z.detach(), "x_grad": xr.grad.detach(),
            "w1_grad": gather(col.weight.grad, 0), "w2_grad": gather(row.weight.grad, 1),
            "w_hat1": w_hat1, "w_hat2": w_hat2,
            "fc1": _parts(export_nvfp4_weight(col)), "fc2": _parts(export_nvfp4_weight(row)),
            "fusion_off": (col.gradient_accumulation_fusion, row.gradient_accumulation_fusion),
        }
    finally:
        ps.destroy_model_parallel()


def _sglang_row_parallel_activation(rank: int) -> bool:
    """SGLang plugin helper: K-sharded W4A4 activation with a TP-MAX amax == slice of the unsharded one."""
    import torch.distributed as dist

    from qpass.backends.sglang.plugin import activation_for_row_parallel
    from qpass.tables import reference_qdq

    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    x[2, 100] = 40.0  # amax in rank 1's half only
    ok = True
    for act, key in (("nvfp4", "nvfp4.activation.per_tensor"), ("nvfp4_per_token", "nvfp4.activation.per_token")):
        part = activation_for_row_parallel(x[:, 64 * rank:64 * rank + 64], act, dist.group.WORLD, "s")
        ok &= torch.equal(part, reference_qdq(key, x)[:, 64 * rank:64 * rank + 64])
    return bool(ok)


def _worker(rank: int, store: str, out_dir: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        res = {"sglang_row_parallel": _sglang_row_parallel_activation(rank)}
        if megatron_available():
            res["tp2"] = _run_block(2, rank)
            res["tp2_nosync"] = _run_block(2, rank, sync=False)
            res["tp1"] = _run_block(1, rank)
            from qpass.backends.megatron import enable_nvfp4_weight_fake_quant

            try:
                enable_nvfp4_weight_fake_quant(torch.nn.Linear(16, 16), site="plain")
                res["rejects_plain_linear"] = False
            except TypeError as e:
                res["rejects_plain_linear"] = "megatron-core Column/RowParallelLinear" in str(e)
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_results():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), tmp), nprocs=WORLD, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]


needs_megatron = pytest.mark.skipif(not megatron_available(), reason="megatron-core not installed (pip install megatron-core==0.16.1)")


@pytest.mark.distributed
def test_sglang_k_sharded_activation_quantization_equals_unsharded(tp_results):
    assert all(r["sglang_row_parallel"] for r in tp_results)


@pytest.mark.distributed
@needs_megatron
def test_tp1_and_tp2_agree_in_outputs_and_gradients(tp_results):
    tp1, tp2 = tp_results[0]["tp1"], tp_results[0]["tp2"]
    for key in ("z", "x_grad", "w1_grad", "w2_grad"):
        assert torch.allclose(tp1[key], tp2[key], rtol=1e-5, atol=1e-6), (key, (tp1[key] - tp2[key]).abs().max())
    # both ranks of the TP=2 run see the same full result
    assert torch.equal(tp_results[0]["tp2"]["z"], tp_results[1]["tp2"]["z"])
    assert tp1["fusion_off"] == (False, False)


@pytest.mark.distributed
@needs_megatron
def test_fake_quant_and_export_are_bit_identical_to_unsharded_quantization(tp_results):
    w1, w2, _, _ = _full_weights()
    for run in ("tp1", "tp2"):
        for rank in range(WORLD):
            r = tp_results[rank][run]
            for name, w, w_hat in (("fc1", w1, r["w_hat1"]), ("fc2", w2, r["w_hat2"])):
                ref = nvfp4_quantize(w)
                assert torch.equal(w_hat, nvfp4_qdq_reference(w)), (run, name)
                assert torch.equal(r[name]["codes"], ref.codes), (run, rank, name)
                assert torch.equal(r[name]["scales"], ref.scales.view(torch.uint8)), (run, rank, name)
                assert torch.equal(r[name]["s_dec"].view(torch.int32), ref.s_dec.view(torch.int32)), (run, rank, name)


@pytest.mark.distributed
@needs_megatron
def test_without_the_amax_all_reduce_shards_quantize_differently(tp_results):
    w1, w2, _, _ = _full_weights()
    r = tp_results[0]["tp2_nosync"]
    for name, w in (("fc1", w1), ("fc2", w2)):
        ref = nvfp4_quantize(w)
        # rank 1's shard holds no outlier: its local amax gives another global scale and other bytes
        assert not torch.equal(r[name]["codes"], ref.codes) or not torch.equal(r[name]["scales"], ref.scales.view(torch.uint8))
    assert not torch.equal(r["w_hat2"], nvfp4_qdq_reference(w2))
    assert not torch.allclose(r["z"], tp_results[0]["tp1"]["z"], rtol=0, atol=0)


@pytest.mark.distributed
@needs_megatron
def test_plain_modules_are_rejected(tp_results):
    assert tp_results[0]["rejects_plain_linear"]


# ------------------------------------------------------------------------------ fused layouts (plain torch)
def test_megatron_qkv_split_commutes_with_quantization():
    heads, groups, hd, hidden = 8, 2, 16, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * hd, hidden, generator=g) * 0.05 for n in (heads, groups, groups))
    # Megatron layout: per query group [its q heads, one k head, one v head]
    qpg = heads // groups
    fused = torch.cat([torch.cat([q[i * qpg * hd:(i + 1) * qpg * hd], k[i * hd:(i + 1) * hd], v[i * hd:(i + 1) * hd]]) for i in range(groups)])
    fq = nvfp4_quantize(fused)
    parts = [split_megatron_qkv(t, num_attention_heads=heads, num_query_groups=groups, head_dim=hd) for t in (fused, fq.codes, fq.scales.view(torch.uint8))]
    for i, w in enumerate((q, k, v)):
        assert torch.equal(parts[0][i], w)
        ref = nvfp4_quantize(w, fq.amax)  # the qkv group amax
        assert torch.equal(parts[1][i], ref.codes) and torch.equal(parts[2][i], ref.scales.view(torch.uint8))


def test_megatron_fc1_split_after_tp_gather():
    tp, ffn, hidden = 2, 32, 48
    gate, up = torch.randn(ffn, hidden), torch.randn(ffn, hidden)
    gathered = torch.cat([torch.cat([gate[r * ffn // tp:(r + 1) * ffn // tp], up[r * ffn // tp:(r + 1) * ffn // tp]]) for r in range(tp)])
    g2, u2 = split_megatron_fc1(gathered, tp_size=tp)
    assert torch.equal(g2, gate) and torch.equal(u2, up)
    q = nvfp4_quantize(gathered)
    assert torch.equal(nvfp4_dequantize(q, torch.float32)[:ffn // tp], nvfp4_dequantize(nvfp4_quantize(gate[: ffn // tp], q.amax), torch.float32))
