"""Trace one prefill site by site: vLLM's float32 W4A4 forward vs qpass's rollout graph (issue 11).

    python scripts/probes/vllm_site_trace.py CKPT APPLY_DIR --prompt 3 --out docs/results/vllm/site_trace_prompt3.json

Both engines run in this process (vLLM in-process engine core) and both call
``qpass.quant.linear.w4a4_linear_reference`` for every quantized linear; a wrapper records each
call's input ``x`` and output. vLLM generates one token for the probe prompt (its prefill); qpass's
float32 rollout graph scores that token (its prefill). Calls are matched by order within a layer and
input kind (vLLM fuses q/k/v and gate/up: one call where qpass makes three / two calls on the same
input). Per matched input: max |x_vLLM - x_qpass| / max |x|, whether the per-tensor activation global
scale bits are equal, how many packed NVFP4 code bytes (two E2M1 codes each) and E4M3 block-scale bytes differ, whether the RAC
channel sets are equal; and the relative output difference. Writes one JSON document.

Provenance (lab file; scripts/README.md): produced `docs/results/vllm/site_trace_prompt3.json`
(docs/results/engines.md and docs/DESIGN.md, vLLM rollout engine); needs vllm.
"""

from __future__ import annotations

import json
import re
import runpy
import time
from pathlib import Path
from types import SimpleNamespace


def _vllm_parity() -> SimpleNamespace:
    """scripts/vllm_parity.py's shared command line and float32 apply-dir rollout (loaded by path: no sys.path edit)."""
    return SimpleNamespace(**runpy.run_path(str(Path(__file__).resolve().parents[1] / "vllm_parity.py")))


def main() -> None:
    vp = _vllm_parity()  # imports the qpass modules the rollout needs before the recording wrapper below
    ap = vp.vllm_cli(__doc__, max_new_tokens=False)
    ap.add_argument("--prompt", type=int, default=3)
    a = ap.parse_args()

    import torch

    import qpass.ops as qops
    import qpass.quant.linear as qlin
    from qpass.backends.vllm.engine import VLLMRolloutEngine
    from qpass.quant.nvfp4 import nvfp4_quantize
    from qpass.quant.rac import rac_reference

    calls: list[dict] = []
    orig = qlin.w4a4_linear_reference

    def rec(x, w, bias=None, **kw):
        out = orig(x, w, bias, **kw)
        calls.append({"site": kw.get("site"), "x": x.detach().reshape(-1, x.shape[-1]).clone(), "out": out.detach().reshape(-1, out.shape[-1]).clone(),
                      "act_spec": kw.get("act_spec"), "rac": kw.get("rac")})
        return out

    qlin.w4a4_linear_reference = rec
    qops.w4a4_linear_reference = rec

    t0 = time.perf_counter()
    report, masters = vp.read_apply_dir(a.apply_dir)
    lm, _, ids, ro = vp.fp32_rollout(a.apply_dir, report, masters, a.prompts, lambda ids: len(ids[a.prompt]) + 8)
    p = ids[a.prompt]

    eng = VLLMRolloutEngine(a.ckpt, dtype="float32", batch_size=1, max_model_len=512, kv_cache_bytes=512 << 20)
    calls.clear()
    b = eng.generate([p], max_new_tokens=1, seed=a.prompt)
    v_calls = list(calls)
    eng.close()
    r = b.responses[0][b.response_mask[0]].tolist()
    calls.clear()
    lq, _ = ro.score([p], r and [r] or [[0]])
    q_calls = [c for c in calls if c["x"].shape[0] == len(p)]  # the prefill's calls (decode calls have 1 row)

    def kind(site: str) -> tuple[int, str]:
        m = re.search(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)", site or "")
        n, blk, proj = int(m.group(1)), m.group(2), m.group(3)
        k = {"qkv_proj": "attn_in", "q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "o_in",
             "gate_up_proj": "mlp_in", "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "down_in"}[proj]
        return n, k

    vmap: dict = {}
    for c in v_calls:
        vmap.setdefault(kind(c["site"]), []).append(c)
    qmap: dict = {}
    for c in q_calls:
        qmap.setdefault(kind(c["site"]), []).append(c)

    rows = []
    for key in sorted(qmap):
        qc, vc = qmap[key][0], vmap.get(key, [None])[0]
        if vc is None:
            rows.append({"layer": key[0], "input": key[1], "missing_in_vllm": True})
            continue
        xq, xv = qc["x"], vc["x"]
        row = {"layer": key[0], "input": key[1], "qpass_site": qc["site"], "vllm_site": vc["site"], "rows": [int(xq.shape[0]), int(vc["x"].shape[0])]}
        if xq.shape != xv.shape:
            row["shape_mismatch"] = True
            rows.append(row)
            continue
        scale = float(xq.abs().max())
        row["x_rel_maxdiff"] = float((xq - xv).abs().max()) / scale
        row["x_bitequal"] = bool(torch.equal(xq, xv))
        spec = qc["act_spec"]
        aq, av = nvfp4_quantize(xq, spec=spec), nvfp4_quantize(xv, spec=spec)
        row["global_scale_equal"] = bool(torch.equal(aq.s_dec, av.s_dec))
        row["codes_differ"] = int((aq.codes != av.codes).sum()) if aq.codes.shape == av.codes.shape else -1
        row["scale_bytes_differ"] = int((aq.scales.view(torch.uint8) != av.scales.view(torch.uint8)).sum())
        if qc["rac"] is not None and qc["rac"].ratio > 0:
            rq, rv = rac_reference(xq, qc["rac"], spec), rac_reference(xv, qc["rac"], spec)
            row["rac_channels_equal"] = bool(torch.equal(rq.channels, rv.channels))
            row["rac_channels_differ"] = int(len(set(rq.channels.flatten().tolist()) ^ set(rv.channels.flatten().tolist())))
            row["rac_comp_rel_maxdiff"] = float((rq.comp - rv.comp).abs().max()) / max(float(rq.comp.abs().max()), 1e-30)
        oq = torch.cat([c["out"] for c in qmap[key]], dim=-1) if len(qmap[key]) > 1 else qc["out"]
        ov = vc["out"][-oq.shape[0]:]
        if oq.shape == ov.shape:
            row["out_rel_maxdiff"] = float((oq - ov).abs().max()) / max(float(oq.abs().max()), 1e-30)
        rows.append(row)
        print({k: v for k, v in row.items() if k not in ("qpass_site", "vllm_site")}, flush=True)

    res = {"ckpt": str(a.ckpt), "prompt": a.prompt, "prompt_tokens": len(p), "vllm_token": r,
           "logq_vllm": float(b.logq[0, 0]) if r else None, "logq_qpass": float(lq[0, 0]) if r else None,
           "vllm_calls": len(v_calls), "qpass_prefill_calls": len(q_calls), "rows": rows, "wall_s": time.perf_counter() - t0}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(a.out)
    print({k: v for k, v in res.items() if k != "rows"})


if __name__ == "__main__":
    main()
