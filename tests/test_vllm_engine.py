"""vLLM as qpass's rollout engine, against a live vLLM-CPU engine (marker ``vllm``; one engine for the
module: eager, in-process, explicit KV size).

The checkpoint is a random 2-layer Llama quantized by qpass (W4A4 NVFP4 per-tensor activations + RAC
masked/batch on gate/up: the ``quads_nvfp4`` rollout side) in float32. Checked: the engine serves
qpass's quantizer bytes (read back from its parameters), its sampled-token log-probs equal qpass's own
rollout graph replaying the same tokens (one row per call, so both see the same activation batch for
the per-tensor amax), a live weight update swaps exactly the bytes qpass computes, and a failure in the
middle of an update stops the engine with the reason instead of serving what was left.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from qpass.checkpoint.qconfig import QpassQuantOptions
from qpass.errors import QpassError
from qpass.parity.served import check_served_weights
from qpass.quant.rac import RACConfig

sys.path.insert(0, str(Path(__file__).parent))
from _vllm_testutil import EOS, PAD, master_weights, save_qpass, tiny_llama_vllm  # noqa: E402

pytestmark = pytest.mark.vllm

RAC = RACConfig(0.5, "masked", "batch")
OPTIONS = QpassQuantOptions(act="nvfp4", rac={f"model.layers.{i}.mlp.{p}_proj": RAC for i in range(2) for p in ("gate", "up")})
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def model():
    return tiny_llama_vllm(dtype=torch.float32)


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    from qpass.backends.vllm.engine import VLLMRolloutEngine

    ckpt = save_qpass(model, tmp_path_factory.mktemp("vllm") / "ck", OPTIONS)
    eng = VLLMRolloutEngine(ckpt, dtype="float32", batch_size=4, max_model_len=128, kv_cache_bytes=16 << 20,
                            pad_token_id=PAD, eos_token_id=EOS, llm_kwargs={"skip_tokenizer_init": True})
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def qpass_rollout(model):
    """qpass's own rollout graph of the same model and recipe side (one row, so the batch equals vLLM's)."""
    from qpass.graph.model import LoadedModel
    from qpass.pipeline import Pipeline
    from qpass.recipe import load_recipe
    from qpass.runtime.engine import make_rollout_engine

    pipe = Pipeline.prepare(loaded=LoadedModel(model=model, tokenizer=None, name="tiny", source="random"), batch_size=1, max_len=64)
    _, rollout = pipe.build(load_recipe("quads_nvfp4"))
    return make_rollout_engine("qpass", qg=rollout, pad_token_id=PAD, eos_token_id=EOS)


def _valid(b, i):
    return b.responses[i][b.response_mask[i]].tolist()


def _gap_to_qpass(engine, ro, seed):
    """vLLM samples one row at a time; qpass's rollout graph replays the tokens; all |d| of valid tokens."""
    d = []
    for j, p in enumerate(PROMPTS):
        b = engine.generate([p], max_new_tokens=12, seed=seed + j)
        lq, mask = ro.score([p], [_valid(b, 0)])
        assert torch.equal(mask[0], b.response_mask[0, : mask.shape[1]])
        d.append((b.logq[0, : mask.shape[1]] - lq[0])[mask[0]].abs())
    return torch.cat(d)


def test_engine_start_leaves_torch_threads_alone(engine):
    """The in-process engine replaced ``torch.set_num_threads`` with a no-op that only warns; the
    engine restores it (``keep_torch_threads``), so the learner in this process can still set its threads."""
    assert torch.set_num_threads is torch._C.set_num_threads
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(n + 1)
        assert torch.get_num_threads() == n + 1
    finally:
        torch.set_num_threads(n)


def test_engine_serves_qpass_quantizer_bytes(engine, model):
    served = engine.served_weights()
    assert len(served) == 14 and served["model.layers.0.self_attn.k_proj"].codes.shape == (64, 64)
    res = check_served_weights(master_weights(model), served)
    assert res.ok and res.checked == 14, res.mismatches


def test_sampled_logprobs_equal_qpass_rollout_graph(engine, qpass_rollout):
    d = _gap_to_qpass(engine, qpass_rollout, seed=10)
    assert d.numel() >= 20
    assert float(d.mean()) <= 1e-4, (float(d.mean()), float(d.max()))


def test_generate_layout_seeds_and_teacher_forced_score(engine, qpass_rollout):
    from qpass.runtime.prefill import step_prefill_args

    b = engine.generate(PROMPTS, max_new_tokens=6, seed=3)
    assert b.input_ids.shape[0] == 3 and b.prompt_len == 6 and b.n_real == 3
    assert b.input_ids[1, :3].tolist() == [PAD] * 3 and b.input_ids[1, 3:6].tolist() == PROMPTS[1]
    assert b.attention_mask[1, :3].sum() == 0 and bool(b.response_mask[:, 0].all())
    assert bool((b.logq[b.response_mask] < 0).all()) and bool((b.logq[~b.response_mask] == 0).all())
    again = engine.generate(PROMPTS, max_new_tokens=6, seed=3)
    assert torch.equal(again.input_ids, b.input_ids)
    other = engine.generate(PROMPTS, max_new_tokens=6, seed=4)
    assert not torch.equal(other.input_ids, b.input_ids)
    # teacher-forced = one prefill of prompt + response, so with per-tensor activation scales it is not
    # the decode schedule of sampling; it equals qpass's rollout step graph prefilling the same tokens
    for i, p in enumerate(PROMPTS):
        r = _valid(engine.generate([p], max_new_tokens=6, seed=20 + i), 0)
        lq, mask = engine.score([p], [r])
        assert bool(mask.all()) and lq.shape == (1, len(r))
        ids = torch.tensor([p + r])
        logits = qpass_rollout.gm(*step_prefill_args(ids, torch.ones_like(ids), batch_size=1, max_len=64))
        want = torch.log_softmax(logits.float(), -1)[0, len(p) - 1:-1].gather(-1, torch.tensor(r).unsqueeze(-1)).squeeze(-1)
        assert float((lq[0] - want).abs().mean()) <= 1e-4, (lq, want)
    with pytest.raises(QpassError, match="temperature 1 and top_p 1 only"):
        engine.score(PROMPTS[:1], [[3]], temperature=0.7)
    with pytest.raises(QpassError, match="1..4 rows"):
        engine.generate(PROMPTS * 2, max_new_tokens=2)


def test_live_weight_update_swaps_exactly_qpass_bytes(engine, model, qpass_rollout):
    w0 = master_weights(model)
    w1 = {k: (v * 1.05 + 0.01 * torch.randn_like(v)) if k.endswith("proj.weight") else v for k, v in w0.items()}
    before = engine.generate(PROMPTS[:1], max_new_tokens=8, seed=1)
    rep = engine.update_weights(w1)
    assert rep.requantized == 14 and rep.copied == len(w0) - 14 and len(rep.fingerprints) == 2 * 4  # per layer: qkv, o, gate/up, down
    assert check_served_weights(w1, engine.served_weights()).ok
    stale = check_served_weights(w0, engine.served_weights())
    assert not stale.ok and stale.mismatches[0].startswith("model.layers.0.mlp.down_proj: codes")
    after = engine.generate(PROMPTS[:1], max_new_tokens=8, seed=1)
    assert not torch.equal(after.logq, before.logq)
    qpass_rollout.update_weights(w1)  # qpass's graph on the new masters agrees with the updated engine
    assert float(_gap_to_qpass(engine, qpass_rollout, seed=30).mean()) <= 1e-4
    # an update missing a tensor is refused before anything is sent; the engine keeps serving w1
    with pytest.raises(QpassError, match=r"1 tensor\(s\) missing, e.g. \['model.norm.weight'\]"):
        engine.update_weights({k: v for k, v in w1.items() if k != "model.norm.weight"})
    assert check_served_weights(w1, engine.served_weights()).ok


def test_update_failing_inside_the_engine_stops_it_with_the_reason(engine, model, monkeypatch):
    """Last test of the module (it stops the shared engine): the update written to /dev/shm lacks one
    block scale, vLLM's reload re-allocates that parameter uninitialised, and the plugin refuses to
    serve it; the engine is stopped, and every later call says why."""
    import safetensors.torch as st

    from qpass.backends.vllm.engine import EngineFailed

    real = st.save_file

    def drop_one_scale(tensors, path, *a, **k):
        tensors = dict(tensors)
        tensors.pop("model.layers.1.mlp.up_proj.weight_scale")
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(st, "save_file", drop_one_scale)
    with pytest.raises(EngineFailed, match=r"weight update \d+ failed: .*layer model.layers.1.mlp.gate_up_proj: weight_scale\[1\] not loaded"):
        engine.update_weights(master_weights(model))
    with pytest.raises(EngineFailed, match="the vLLM engine was stopped: weight update"):
        engine.generate(PROMPTS[:1], max_new_tokens=2)
    with pytest.raises(EngineFailed):
        engine.served_weights()


def test_plugin_classes_pickle_by_reference_for_the_spawned_engine_core():
    """vLLM's default engine core is a spawned process that pickles the quantization config: a class
    built inside ``plugin_classes()`` must resolve by name (``Can't pickle local object`` otherwise)."""
    import pickle

    from qpass.backends.vllm import plugin

    cfg_cls, method_cls = plugin.plugin_classes()
    assert pickle.loads(pickle.dumps(cfg_cls)) is cfg_cls
    assert pickle.loads(pickle.dumps(method_cls)) is method_cls
    assert plugin.QpassNvfp4Config is cfg_cls and cfg_cls.__qualname__ == "QpassNvfp4Config"
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        plugin.Nope  # noqa: B018
