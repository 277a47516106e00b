"""``qpass study`` with the learner in another engine (the HF forward), per-response gaps stored and
every CI recomputed from them; the HF learner engine against qpass's learner graph."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from qpass.recipe import load_recipe
from qpass.runtime.engine import as_learner_engine
from qpass.runtime.hf_engine import HFLearnerEngine
from tests.test_grpo import FakeTok, _one_thread  # noqa: F401 - _one_thread: autouse, 1 torch thread


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 256, (3, 12), generator=g)
    am = torch.ones_like(ids)
    am[0, :3] = 0  # a left-padded row
    ids[0, :3] = 0
    return ids, am


@pytest.mark.parametrize("recipe", ["bf16", "qat_only", "w4a4_qat", "fp8_qat", "mxfp4_qat"])
def test_hf_sdpa_learner_equals_the_learner_graph_and_eager_drifts(tiny_pipeline, recipe):
    """SDPA: the HF forward with the learner's weight / activation QDQ applied through qpass's ops gives
    the learner graph's log-probs bit for bit (so the QDQ is carried over exactly: the factored NVFP4
    weight-QDQ linear, FP8 / MXFP4 by the learner_qdq table); eager attention is another engine: a
    nonzero drift."""
    learner, _ = tiny_pipeline.build(load_recipe(recipe))
    ids, am = _batch()
    v = am[:, 1:].bool()
    ref = as_learner_engine(learner).token_logprobs(ids, am)[v]
    model = tiny_pipeline.loaded.model
    sdpa = HFLearnerEngine(model, attn="sdpa", learner=learner)
    assert len(sdpa.weight_sites) == (0 if recipe == "bf16" else 14) and len(sdpa.act_sites) == (14 if recipe == "w4a4_qat" else 0)
    assert torch.equal(sdpa.token_logprobs(ids, am)[v], ref)
    eager = HFLearnerEngine(model, attn="eager", learner=learner).token_logprobs(ids, am)[v]
    assert torch.isfinite(eager).all() and 0 < float((eager - ref).abs().max()) < 0.5
    assert model.config._attn_implementation == "sdpa"  # restored after the eager call
    for p in model.parameters():
        assert p.grad is None and not p.requires_grad  # the engine reads the weights, never writes them


def test_hf_engine_refuses_unknown_attention(tiny_pipeline):
    from qpass.errors import QpassError

    with pytest.raises(QpassError, match="attention implementation must be one of"):
        HFLearnerEngine(tiny_pipeline.loaded.model, attn="flash")


@pytest.mark.slow  # ~40 s: a whole quick study on the tiny model
def test_study_stores_per_response_gaps_and_every_ci_recomputes(tiny_pipeline, tmp_path):
    """A toy study (tiny model, HF-eager learner): study.json records the gaps file and its sha256;
    recompute() rebuilds every pair summary and every paired-bootstrap CI exactly; a flipped byte is refused."""
    from qpass.apps.study import build_parser, config_from_args, run_study, write_outputs
    from qpass.apps.study.recompute import recompute
    from qpass.errors import QpassError
    from qpass.graph.model import LoadedModel

    pipe = dataclasses.replace(tiny_pipeline, loaded=LoadedModel(model=tiny_pipeline.loaded.model, tokenizer=FakeTok(),
                                                                 name="tiny-llama", source="random"))
    out = tmp_path / "study"
    a = build_parser().parse_args(["--quick", "--out", str(out), "--no-progress", "--learner-engine", "hf-eager",
                                   "--bootstrap", "200", "--batch-size", "4", "--prompts", "4"])
    cfg = config_from_args(a)
    assert cfg.learner_engine == "hf-eager" and cfg.kernel_tiles == "pinned"
    res = run_study(cfg, pipe=pipe)
    write_outputs(res, out)
    data = json.loads((out / "study.json").read_text())
    assert data["gaps_file"]["path"] == "gaps.safetensors" and "valid" in data["gaps_file"]["tensors"]
    assert data["provenance"]["command"]["argv"] == ["study"] and (out / "provenance.json").is_file()
    assert data["kernel_tiles"]["mode"] == "pinned"
    assert set(data["layerwise"]["summary"]) == {"decode"}  # the degenerate prefill reading is gone
    assert data["pairs"]["floor"]["replay"]["mean_abs"] > 0  # HF eager learner vs qpass's decode: real drift
    rec = recompute(out)
    assert rec["matches"] is True and rec["mismatches"] == []
    assert set(rec["comparisons"]) == set(data["comparisons"]) and len(rec["comparisons"]) > 5
    raw = bytearray((out / "gaps.safetensors").read_bytes())
    raw[-1] ^= 1
    (out / "gaps.safetensors").write_bytes(bytes(raw))
    with pytest.raises(QpassError, match="sha256 .* differs"):
        recompute(out)
