"""Where and why vLLM's float32 W4A4 log-probs leave qpass's rollout graph (issue 11 follow-up).

    python scripts/probes/vllm_divergence_probe.py CKPT APPLY_DIR --out docs/results/vllm/divergence_probe.json

For each probe prompt (one prompt per call, T = 1, seeded as in ``scripts/vllm_parity.py``) and for
each engine configuration (vLLM default = prefix caching on; prefix caching off):

* ``repeat_equal``: vLLM generates the same prompt twice with the same seed; tokens and log q equal?
* per-token |log q_vLLM - log q_qpass| (qpass's float32 rollout graph replaying the same tokens,
  batch 1), the first response position where it exceeds 1e-4, and the mean before / from there.
* ``qpass_generate_vs_score``: qpass's own graph sampling then scoring its own tokens (control:
  must be 0, else the replay itself is not the rollout's computation).

Writes one JSON document; prints a one-line summary per (configuration, prompt).

Provenance (lab file; scripts/README.md): produced `docs/results/vllm/divergence_probe.json` (docs/results/engines.md,
vLLM rollout engine); needs vllm.
"""

from __future__ import annotations

import json
import runpy
import time
from pathlib import Path
from types import SimpleNamespace


def _vllm_parity() -> SimpleNamespace:
    """scripts/vllm_parity.py's shared command line and float32 apply-dir rollout (loaded by path: no sys.path edit)."""
    return SimpleNamespace(**runpy.run_path(str(Path(__file__).resolve().parents[1] / "vllm_parity.py")))


def main() -> None:
    vp = _vllm_parity()
    ap = vp.vllm_cli(__doc__)
    ap.add_argument("--configs", default="default,no_prefix_cache")
    a = ap.parse_args()

    import torch

    from qpass.backends.vllm.engine import VLLMRolloutEngine

    t0 = time.perf_counter()
    report, masters = vp.read_apply_dir(a.apply_dir)
    lm, _, ids, ro = vp.fp32_rollout(a.apply_dir, report, masters, a.prompts,
                                     lambda ids: max(len(p) for p in ids) + a.max_new_tokens + 1)

    res: dict = {"ckpt": str(a.ckpt), "apply_dir": str(a.apply_dir), "recipe": report["recipe"].get("name"), "configs": {}}
    # control: qpass generate vs qpass score of its own tokens
    ctl = []
    for i, p in enumerate(ids):
        b = ro.generate([p], max_new_tokens=a.max_new_tokens, seed=i)
        r = b.responses[0][b.response_mask[0]].tolist()
        lq, _ = ro.score([p], [r])
        ctl.append(float((b.logq[0, : len(r)] - lq[0, : len(r)]).abs().max()))
    res["qpass_generate_vs_score_max_abs"] = ctl
    print("qpass generate vs score, max |d| per prompt:", ctl, flush=True)

    kwargs = {"default": {}, "no_prefix_cache": {"enable_prefix_caching": False}}
    for name in a.configs.split(","):
        eng = VLLMRolloutEngine(a.ckpt, dtype="float32", batch_size=1, max_model_len=512, kv_cache_bytes=512 << 20,
                                llm_kwargs=kwargs[name])
        rows = []
        for i, p in enumerate(ids):
            b1 = eng.generate([p], max_new_tokens=a.max_new_tokens, seed=i)
            b2 = eng.generate([p], max_new_tokens=a.max_new_tokens, seed=i)
            r = b1.responses[0][b1.response_mask[0]].tolist()
            r2 = b2.responses[0][b2.response_mask[0]].tolist()
            rep = r == r2 and torch.equal(b1.logq[0, : len(r)], b2.logq[0, : len(r)])
            lq, _ = ro.score([p], [r])
            d = (b1.logq[0, : len(r)] - lq[0, : len(r)]).abs()
            over = (d > 1e-4).nonzero().flatten().tolist()
            k = over[0] if over else None
            row = {"prompt": i, "prompt_tokens": len(p), "response_tokens": len(r), "repeat_equal": bool(rep),
                   "repeat_max_abs": float((b1.logq[0, : min(len(r), len(r2))] - b2.logq[0, : min(len(r), len(r2))]).abs().max()) if r2 else None,
                   "mean_abs": float(d.mean()), "max_abs": float(d.max()), "first_over_1e-4": k,
                   "mean_before_first": float(d[:k].mean()) if k else None, "mean_from_first": float(d[k:].mean()) if k is not None else None,
                   "per_token_abs": [float(x) for x in d]}
            rows.append(row)
            print(name, {kk: v for kk, v in row.items() if kk != "per_token_abs"}, flush=True)
        eng.close()
        dd = torch.tensor([x for row in rows for x in row["per_token_abs"]])
        res["configs"][name] = {"llm_kwargs": kwargs[name], "mean_abs": float(dd.mean()), "max_abs": float(dd.max()), "rows": rows}
    res["wall_s"] = time.perf_counter() - t0
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(a.out)
    print({n: (c["mean_abs"], c["max_abs"]) for n, c in res["configs"].items()})


if __name__ == "__main__":
    main()
