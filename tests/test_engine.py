"""The engine seam (:mod:`qpass.runtime.engine`): protocols, factory, and the built-in graph engines.

* the graph engines satisfy both protocols and are built by name; an unknown name lists the known;
* a weight update through the protocol (learner export in HF names -> rollout update) gives exactly
  the bytes of the graph-level sync, and the served bytes read back are the rollout's constants;
* an update that misses a weight is refused naming it (the old graph sync skipped it silently);
* ``score`` (teacher-forced) reproduces ``generate``'s raw sampled-token log-probs bit for bit;
* the one prefill function builds what the rollout's own prefill call used to build.
"""

from __future__ import annotations

import pytest
import torch

from qpass.errors import QpassError
from qpass.recipe import load_recipe
from qpass.runtime import (
    GraphLearnerEngine,
    GraphRolloutEngine,
    LearnerEngine,
    RolloutEngine,
    make_learner_engine,
    make_rollout_engine,
    register_rollout_engine,
    rollout_engines,
    sync_weights,
)
from qpass.runtime.prefill import left_pad, step_prefill_args


def _engines(tiny_pipeline, recipe="quads_nvfp4"):
    learner, rollout = tiny_pipeline.build(load_recipe(recipe))
    le = make_learner_engine("qpass", qg=learner)
    ro = make_rollout_engine("qpass", qg=rollout, pad_token_id=0, eos_token_id=1)
    return le, ro


def test_factory_and_protocols(tiny_pipeline):
    le, ro = _engines(tiny_pipeline)
    assert isinstance(le, GraphLearnerEngine) and isinstance(le, LearnerEngine)
    assert isinstance(ro, GraphRolloutEngine) and isinstance(ro, RolloutEngine)
    assert "qpass" in rollout_engines() and ro.name == le.name == "qpass"
    assert ro.pad_token_id == 0 and ro.eos_token_ids == [1] and ro.batch_size == 4
    with pytest.raises(QpassError, match=r"unknown rollout engine 'vllm'; registered: \['qpass'"):
        make_rollout_engine("vllm")
    with pytest.raises(QpassError, match="already registered"):
        register_rollout_engine("qpass")(lambda **kw: None)
    names = le.export_weights()
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" in names  # HF names
    assert not any(n.startswith("model.model.") for n in names)


def test_update_weights_equals_graph_sync_and_reads_back(tiny_pipeline):
    le, ro = _engines(tiny_pipeline)
    with torch.no_grad():
        for p in le.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    twin = ro.qg.clone("rollout")
    ref = sync_weights(le.qg, twin)
    rep = ro.update_weights(le.export_weights())
    assert rep.fingerprints == ref.fingerprints and rep.requantized == ref.requantized == 14
    served = ro.served_weights()
    assert len(served) == 14
    for sid, s in served.items():
        c = twin.quant[sid].constants
        assert s.format == "nvfp4" and s.codes.dtype == torch.uint8
        assert torch.equal(s.codes, twin.gm.get_buffer(c["codes"]))
        assert torch.equal(s.scales.view(torch.uint8), twin.gm.get_buffer(c["scales"]).view(torch.uint8))
        assert torch.equal(s.global_scale, twin.gm.get_buffer(c["s_dec"]))
    from qpass.parity.checker import check_weights_bitexact

    assert check_weights_bitexact(le.qg, ro.qg).ok


def test_update_missing_weight_is_refused_by_name(tiny_pipeline):
    le, ro = _engines(tiny_pipeline)
    w = le.export_weights()
    del w["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(QpassError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        ro.update_weights(w)
    w = le.export_weights()
    del w["model.norm.weight"]  # an unquantized parameter: the graph sync skipped it silently
    with pytest.raises(QpassError, match=r"model\.norm\.weight"):
        ro.update_weights(w)


def test_score_reproduces_generate_logq(tiny_pipeline):
    _, ro = _engines(tiny_pipeline)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    b = ro.generate(prompts, max_new_tokens=6, temperature=0.8, top_p=0.9, seed=3)
    full = prompts + [prompts[-1]] * (ro.batch_size - len(prompts))
    rows = [b.responses[i][b.response_mask[i]].tolist() for i in range(ro.batch_size)]
    logq, mask = ro.score(full, rows, temperature=0.8, top_p=0.9)
    assert torch.equal(mask, b.response_mask.cpu())
    assert torch.equal(logq.view(torch.int32), b.logq.cpu().view(torch.int32))


def test_prefill_args_match_the_old_rollout_prefill():
    prompts = [[3, 4, 5], [6], [7, 8]]
    b, max_len, pad = 4, 10, 0
    ids, am = left_pad(prompts, pad_token_id=pad)
    got = step_prefill_args(ids, am, batch_size=b, max_len=max_len)
    # what TorchRollout.generate built inline before (rows filled with the last prompt)
    rows = prompts + [prompts[-1]] * (b - len(prompts))
    p = 3
    old_ids = torch.full((b, p), pad, dtype=torch.long)
    old_mask = torch.zeros(b, max_len, dtype=torch.long)
    for i, r in enumerate(rows):
        old_ids[i, p - len(r):] = torch.tensor(r)
        old_mask[i, p - len(r):p] = 1
    old_pos = (old_mask[:, :p].cumsum(-1) - 1).clamp(min=0)
    for a, e in zip(got, (old_ids, old_pos, torch.arange(p), old_mask)):
        assert torch.equal(a, e)
    with pytest.raises(ValueError, match="no rows"):
        left_pad([], pad_token_id=0)


def test_study_prefill_capture_uses_the_shared_prefill(tiny_pipeline):
    from qpass.apps.study.layerwise import capture_prefill
    from qpass.diagnostics.capture import LinearInputRecorder
    from qpass.sampling import positions_from_mask

    _, ro = _engines(tiny_pipeline)
    ids, am = left_pad([[5, 6, 7, 8], [9, 10], [11], [12, 13, 14]], pad_token_id=0)
    got = capture_prefill(ro.qg, ids, am)
    mask = torch.zeros(4, ro.max_len, dtype=torch.long)  # what capture_prefill built inline before
    mask[:, :4] = am
    rec = LinearInputRecorder(ro.qg.gm, effective=True)
    rec.run(ids, positions_from_mask(am), torch.arange(4), mask)
    assert got.keys() == rec.acts.keys() and len(got) >= 14
    for sid in got:
        assert all(torch.equal(a, b) for a, b in zip(got[sid], rec.acts[sid])), sid


def test_bit_level_parity_read_from_the_engine(tiny_pipeline):
    from qpass.parity.served import check_served_weights

    le, ro = _engines(tiny_pipeline)
    with torch.no_grad():
        for p in le.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    w = le.export_weights()
    stale = check_served_weights(w, ro.served_weights())  # the rollout still serves the old weights
    assert not stale.ok and stale.checked == 14
    ro.update_weights(w)
    served = ro.served_weights()
    assert {s.group for s in served.values()} >= {"model.layers.0.self_attn.qkv", "model.layers.1.mlp.gate_up"}
    ok = check_served_weights(w, served)
    assert ok.ok and ok.checked == 14 and ok.skipped == 0 and ok.mismatches == ()
    site = "model.layers.1.mlp.down_proj"
    served[site].scales.view(torch.uint8)[3, 1] ^= 0x01  # one flipped scale byte in the engine's storage
    bad = check_served_weights(w, ro.served_weights())
    assert not bad.ok and bad.mismatches == (f"{site}: scale bytes 1/{served[site].scales.numel()} differ (first at (3, 1))",)
    del w[f"{site}.weight"]
    assert check_served_weights(w, ro.served_weights()).mismatches[0] == f"{site}: no master weight {site}.weight"
