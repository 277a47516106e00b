"""Weight-quantization reuse (issue 13, ``qpass.quant.reuse``): bit-identical results, invalidation on
every weight write (an optimizer step), and a GRPO run with reuse equal to one without it."""

from __future__ import annotations

import pytest
import torch

from qpass.apps.grpo.weights import MasterOptimizer, snapshot_rollout_constants, verify_sync
from qpass.quant.groups import group_amax
from qpass.quant.qdq import nvfp4_qdq
from qpass.quant.reuse import ReuseStore, no_reuse, reuse_active, reuse_stats, reuse_weight_quantization
from qpass.quant.weights import quantize_site_weights
from qpass.formats.spec import NVFP4_WEIGHT
from qpass.runtime.learner import TorchLearner
from qpass.runtime.sync import sync_weights
from tests.test_grpo import _one_thread, tiny_cfg, tiny_trainer  # noqa: F401 - _one_thread: autouse, 1 torch thread


def _w(seed: int = 0) -> torch.nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter((torch.randn(32, 64, generator=g) * 0.05).bfloat16())


def test_qdq_reuse_is_bit_identical_and_an_inplace_write_invalidates():
    w = _w()
    ref = nvfp4_qdq(w)
    with reuse_weight_quantization() as st:
        a, b = nvfp4_qdq(w), nvfp4_qdq(w.detach())  # a detached view shares the version counter: a hit
        assert torch.equal(a, ref) and torch.equal(b, ref) and a is not b
        assert (st.hits, st.misses) == (2, 2)  # amax + qdq computed once, reused once
        with torch.no_grad():
            w.mul_(1.5)  # any in-place write (an optimizer step) bumps the version
        fresh = nvfp4_qdq(w)
        assert not torch.equal(fresh, ref)  # a stale cache would return ref here
        with no_reuse():
            assert not reuse_active()
            assert torch.equal(fresh, nvfp4_qdq(w))
        assert reuse_active() and len(st.entries) == 2  # the newer version replaced the older entries
    assert not reuse_active() and reuse_stats() is None and not st.entries


def test_sync_quantization_is_shared_and_store_survives_only_when_given():
    w = _w(1)
    plain = quantize_site_weights(NVFP4_WEIGHT, {"s": w.detach()})["s"].tensor
    store = ReuseStore()
    with reuse_weight_quantization(store):
        q1 = quantize_site_weights(NVFP4_WEIGHT, {"s": w.detach()})["s"].tensor
    assert store.entries  # a caller-owned store keeps its entries between blocks
    with reuse_weight_quantization(store):
        q2 = quantize_site_weights(NVFP4_WEIGHT, {"s": w.detach()})["s"].tensor
    assert q2 is q1 and torch.equal(q1.codes, plain.codes) and torch.equal(q1.scales.view(torch.uint8), plain.scales.view(torch.uint8))
    assert torch.equal(q1.s_dec, plain.s_dec)
    assert torch.equal(group_amax([w]), w.detach().abs().amax().float())
    off = ReuseStore(enabled=False)
    with reuse_weight_quantization(off):
        assert not reuse_active()


def test_learner_logprobs_grads_and_sync_bytes_equal_without_reuse_and_optimizer_step_invalidates(tiny_pipeline):
    from qpass.recipe import load_recipe

    learner, rollout = tiny_pipeline.build(load_recipe("quads_nvfp4"))
    le = TorchLearner(learner)
    params = [p for p in le.parameters() if p.requires_grad]
    ids = torch.randint(3, 256, (4, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)

    def grads():
        for p in params:
            p.grad = None
        lp = le.token_logprobs(ids, mask)
        lp.sum().backward()
        return lp.detach(), [p.grad.clone() for p in params]

    lp0, g0 = grads()
    opt = MasterOptimizer(params, lr=1e-2)
    store = ReuseStore()
    with reuse_weight_quantization(store):
        with torch.no_grad():
            assert torch.equal(le.token_logprobs(ids, mask), lp0)  # proximal-style pass fills the store
        lp1, g1 = grads()  # with grad, from the store
        assert store.hits > 0
        assert torch.equal(lp1, lp0) and all(torch.equal(a, b) for a, b in zip(g0, g1))
        opt.step(None)  # writes bf16(master) into the parameters: the versions move
        lp_new, g_new = grads()
    with no_reuse():
        lp_ref, g_ref = grads()
    assert not torch.equal(lp_ref, lp0)  # the step changed the learner: a stale store would return lp0
    assert torch.equal(lp_new, lp_ref) and all(torch.equal(a, b) for a, b in zip(g_new, g_ref))
    # sync + verify inside one store: same bytes and fingerprints as without it
    rep_plain = sync_weights(learner, rollout)
    snap_plain = snapshot_rollout_constants(rollout)
    with reuse_weight_quantization() as st:
        rep = sync_weights(learner, rollout)
        hits = st.hits
        ver = verify_sync(learner, rollout, rep.fingerprints)
        assert st.hits > hits  # the verification read the sync's quantization
    assert ver.ok and ver.n_aligned == ver.n_checked and rep.fingerprints == rep_plain.fingerprints
    snap = snapshot_rollout_constants(rollout)
    for sid, parts in snap.nvfp4.items():
        for x, y in zip(parts, snap_plain.nvfp4[sid]):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.dtype == torch.float8_e4m3fn else torch.equal(x, y)


@pytest.mark.parametrize("master_dtype", ["fp32", "param"])
def test_grpo_rows_params_and_rollout_bytes_identical_with_and_without_reuse(tiny_pipeline, master_dtype):
    from tests.test_grpo_long import _strip

    # 4 micro-batches of 2 in 2 minibatches x 2 epochs: optimizer steps inside the store's lifetime
    cfg = tiny_cfg(steps=2, prompts_per_step=4, micro_batch_size=2, minibatches=2, ppo_epochs=2, eval_every=0, diag_every=0,
                   bitexact_every=1, master_dtype=master_dtype)
    runs = []
    for enabled in (False, True):
        tr = tiny_trainer(tiny_pipeline, "quads_nvfp4", cfg)
        tr.quant_reuse = ReuseStore(enabled=enabled)
        tr.run()
        assert not tr.quant_reuse.entries
        runs.append(tr)
    off, on = runs
    assert _strip(off.history["metrics"]) == _strip(on.history["metrics"])
    assert all(r["parity/fp_ok"] and r["parity/bitexact_ok"] for r in on.history["metrics"])
    for p, q in zip(off.le.parameters(), on.le.parameters()):
        assert torch.equal(p, q)
    a, b = snapshot_rollout_constants(off.rollout_qg), snapshot_rollout_constants(on.rollout_qg)
    for sid in a.nvfp4:
        for x, y in zip(a.nvfp4[sid], b.nvfp4[sid]):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.dtype == torch.float8_e4m3fn else torch.equal(x, y)
