"""vLLM-CPU vs qpass on the tiny random Mixtral of tests/test_vllm_moe.py, with a negative control.

    PYTHONPATH=src:. python scripts/vllm_moe_tiny_parity.py --out docs/results/moe/vllm_tiny_parity.json

The tiny model (2 layers, hidden 64, 4 experts, top-2, float32) is exported with
``quads_nvfp4_moe`` (``qpass export --format qpass --dtype fp32``) and served by vLLM-CPU through the
plugin's FusedMoE method; vLLM samples (T = 1) one prompt at a time and qpass's float32 rollout graph
(batch 1) replays the tokens. Then the same with RAC switched off inside the served MoE method
(``rac13 = None`` for every expert): the control shows the comparison sees the experts' numerics.

Provenance (lab file; scripts/README.md): produced `docs/results/moe/vllm_tiny_parity.json` (docs/results/moe.md,
MoE in vLLM); needs vllm.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def gap(ck, ro, prompts, pad, eos):
    import torch

    from qpass.backends.vllm.engine import VLLMRolloutEngine

    eng = VLLMRolloutEngine(ck, dtype="float32", batch_size=2, max_model_len=128, kv_cache_bytes=16 << 20, pad_token_id=pad,
                            eos_token_id=eos, llm_kwargs={"skip_tokenizer_init": True})
    ds = []
    for j, p in enumerate(prompts):
        b = eng.generate([p], max_new_tokens=12, seed=10 + j)
        r = b.responses[0][b.response_mask[0]].tolist()
        lq, mask = ro.score([p], [r])
        ds.append((b.logq[0, : mask.shape[1]] - lq[0])[mask[0]].abs())
    eng.close()
    d = torch.cat(ds)
    return {"tokens": int(d.numel()), "mean_abs_d": float(d.mean()), "max_abs_d": float(d.max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    from tests._vllm_testutil import EOS, PAD  # the repository root on PYTHONPATH (see the usage line)
    from tests.test_vllm_moe import PROMPTS, tiny_mixtral_dir

    from qpass.apps.export import export_checkpoint
    from qpass.backends.vllm import plugin
    from qpass.graph.model import load_model
    from qpass.pipeline import Pipeline
    from qpass.recipe import load_recipe
    from qpass.runtime.engine import make_rollout_engine

    t0 = time.perf_counter()
    d = Path(tempfile.mkdtemp(prefix="qpass-vmoe-"))
    hf = tiny_mixtral_dir(d / "hf")
    ck = d / "ck"
    export_checkpoint(ck, "qpass", model=str(hf), recipe="quads_nvfp4_moe", dtype="fp32", calibration_prompts=2)
    _, ro = Pipeline.prepare(loaded=load_model(str(hf), dtype=torch.float32), batch_size=1, max_len=64).build(load_recipe("quads_nvfp4_moe"))
    ro = make_rollout_engine("qpass", qg=ro, pad_token_id=PAD, eos_token_id=EOS)
    res = {"model": "tiny random Mixtral (tests/test_vllm_moe.py): 2 layers, hidden 64, expert MLP 64, 4 experts, top-2, vocab 256, fp32",
           "recipe": "quads_nvfp4_moe", "prompts": PROMPTS, "max_new_tokens": 12, "temperature": 1.0}
    res["served_as_exported"] = gap(ck, ro, PROMPTS, PAD, EOS)
    cls = plugin.moe_method_class()
    orig = cls.__init__

    def no_rac(self, *args, **kw):
        orig(self, *args, **kw)
        self.rac13 = [None] * len(self.rac13)

    cls.__init__ = no_rac
    try:
        res["control_rac_off_in_served_moe"] = gap(ck, ro, PROMPTS, PAD, EOS)
    finally:
        cls.__init__ = orig
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
