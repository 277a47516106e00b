"""vLLM-CPU vs qpass's rollout graph on the tiny random Llama of tests/test_vllm_engine.py (float32,
W4A4 NVFP4 per-tensor + RAC masked/batch on gate/up = the quads_nvfp4 rollout side), raw numbers:

    python scripts/vllm_tiny_parity.py --out docs/results/vllm/tiny_parity_fp32.json

Per prompt, vLLM samples one row (T = 1, 12 tokens); qpass's step graph (batch 1) replays the tokens.
Also: bytes read back vs qpass's quantizer, before and after one live weight update, and the update time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import tempfile

    import torch
    from _vllm_testutil import EOS, PAD, master_weights, save_qpass, tiny_llama_vllm
    from test_vllm_engine import OPTIONS, PROMPTS

    from qpass.backends.vllm.engine import VLLMRolloutEngine
    from qpass.graph.model import LoadedModel
    from qpass.parity.served import check_served_weights
    from qpass.pipeline import Pipeline
    from qpass.recipe import load_recipe
    from qpass.runtime.engine import make_rollout_engine

    model = tiny_llama_vllm(dtype=torch.float32)
    res: dict = {"model": "tiny random Llama (2 layers, hidden 128, fp32)", "options": OPTIONS.to_config()}
    with tempfile.TemporaryDirectory() as d:
        ckpt = save_qpass(model, Path(d) / "ck", OPTIONS)
        t0 = time.perf_counter()
        eng = VLLMRolloutEngine(ckpt, dtype="float32", batch_size=4, max_model_len=128, kv_cache_bytes=16 << 20,
                                pad_token_id=PAD, eos_token_id=EOS, llm_kwargs={"skip_tokenizer_init": True})
        res["engine_start_s"] = time.perf_counter() - t0
        pipe = Pipeline.prepare(loaded=LoadedModel(model=model, tokenizer=None, name="tiny", source="random"), batch_size=1, max_len=64)
        _, rollout = pipe.build(load_recipe("quads_nvfp4"))
        ro = make_rollout_engine("qpass", qg=rollout, pad_token_id=PAD, eos_token_id=EOS)

        def gap(seed: int) -> dict:
            ds = []
            for j, p in enumerate(PROMPTS):
                b = eng.generate([p], max_new_tokens=12, seed=seed + j)
                r = b.responses[0][b.response_mask[0]].tolist()
                lq, _ = ro.score([p], [r])
                ds.append((b.logq[0, : len(r)] - lq[0, : len(r)]).abs())
            d = torch.cat(ds)
            return {"tokens": int(d.numel()), "mean_abs": float(d.mean()), "max_abs": float(d.max())}

        w0 = master_weights(model)
        c0 = check_served_weights(w0, eng.served_weights())
        res["before_update"] = {"readback_ok": c0.ok, "sites": c0.checked, "logprob_vs_qpass_graph": gap(10)}
        w1 = {k: (v * 1.05 + 0.01 * torch.randn_like(v)) if k.endswith("proj.weight") else v for k, v in w0.items()}
        t0 = time.perf_counter()
        eng.update_weights(w1)
        res["update_s"] = time.perf_counter() - t0
        res["update_parts_s"] = eng.last_update_s
        ro.update_weights(w1)
        c1, stale = check_served_weights(w1, eng.served_weights()), check_served_weights(w0, eng.served_weights())
        res["after_update"] = {"readback_ok": c1.ok, "readback_vs_old_masters_ok": stale.ok, "first_stale_mismatch": stale.mismatches[:1],
                               "logprob_vs_qpass_graph": gap(30)}
        eng.close()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
