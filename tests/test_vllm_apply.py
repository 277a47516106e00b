"""``qpass apply --rollout-engine vllm`` end to end on a tiny random Llama with a character tokenizer
(marker ``vllm``): the recipe's rollout side is exported (``qpass export --format qpass``), a live
vLLM engine samples, the bit-level check reads the engine's bytes, and the BF16 floor pairs a BF16
vLLM engine with the learner."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _vllm_testutil import tiny_llama_vllm  # noqa: E402
from test_export import char_tokenizer  # noqa: E402

pytestmark = pytest.mark.vllm


def test_apply_with_the_vllm_rollout_engine(tmp_path):
    from qpass.apps.apply import ApplyOptions, run_apply

    model_dir = tmp_path / "tiny"
    m = tiny_llama_vllm(dtype=torch.bfloat16)
    tok = char_tokenizer()
    m.config.pad_token_id, m.config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    m.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    before = set(Path("/dev/shm").glob("qpass-vllm-*"))
    status, rep = run_apply("quads_nvfp4", tmp_path / "out", ApplyOptions(model=str(model_dir), dtype="bf16", prompts=2, samples=1,
                                                                           max_new_tokens=6, batch_size=2, rollout_engine="vllm"))
    p = rep["parity"]
    assert status == 0 and rep["rollout_engine"] == "vllm", (p["problems"], p["checks"])
    assert p["weights_bitexact"] is True and p["engine_weights"] == {"engine": "vllm", "ok": True, "checked": 14, "skipped": 0,
                                                                     "mismatches": []}
    assert p["logprob_gap"]["tokens"] > 0 and p["floor_logprob_gap"]["tokens"] > 0
    assert p["floor_logprob_gap"]["mean_abs"] > 0  # a BF16 vLLM engine vs the BF16 learner: real engine drift
    assert rep["timings"]["engine_start_s"] > 0
    assert set(Path("/dev/shm").glob("qpass-vllm-*")) <= before  # the exported checkpoints are removed
