"""Megatron-core learner vs Hugging Face / qpass on a real model (issue 12 measurements).

    python scripts/megatron_parity.py --model default --tp 1,2 --out docs/results/megatron

Writes ``OUT/parity_<device>.json`` (one JSON object; every number labelled) and prints a summary:

* ``logits``: max and mean |logit_mcore - logit_HF| over real (unpadded) positions of a left-padded
  batch of chat prompts, per dtype (fp32, bf16), TP=1 and each other TP, plus TP=N vs TP=1; no
  fake-quant (the model mapping alone). HF runs with ``position_ids = cumsum(mask) - 1`` as qpass's
  learner graph does. For bf16 also HF-bf16 and Megatron-bf16 (TP=1) vs HF-fp32: how much of the
  bf16 difference is bf16 itself. A TP the config refuses is recorded as ``tpN_refused``.
  ``--skip-fake-quant`` writes only this part, to ``OUT/logits_<device>.json``.
* ``fake_quant`` (bf16, recipe ``quads_nvfp4``): per HF site, whether the Megatron learner's
  fake-quantized weight ``W_hat`` equals qpass's learner QDQ of the HF site (``qpass::nvfp4_qdq``
  with the group amax of the learner graph) bit for bit, and whether its NVFP4 codes / scale bytes /
  global-scale bits equal ``quantize_site_weights`` of the HF group; for TP=N also whether the bytes
  gathered over TP equal TP=1's; max |logit| of the fake-quantized Megatron learner vs qpass's
  learner graph (both bf16).

Provenance (lab file; scripts/README.md): produced `docs/results/megatron/parity_cpu.json` and
`docs/results/megatron/logits_cpu.json` (docs/results/megatron.md, Megatron learner) and, through
`bash scripts/gpu.sh megatron` (then scripts/gpu_megatron.sh), `docs/results/h200/megatron/`.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch


def _batch(tokenizer, n: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    from qpass.prompts import encode_chat, probe_prompts

    rows = encode_chat(tokenizer, probe_prompts(n))
    t = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (t - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (t - len(r)) + [1] * len(r) for r in rows])
    return ids.to(device), mask.to(device)


def _diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    d = (a.float() - b.float()).abs()[mask.bool()]
    return {"max_abs": float(d.max()), "mean_abs": float(d.mean()), "n_positions": int(mask.sum()), "vocab": int(a.shape[-1])}


def _hf_logits(model, ids, mask):
    from qpass.sampling import positions_from_mask

    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits


def _mcore_logits(hf, tp, device, ids, mask, learner_sites=None):
    from qpass.backends.megatron.learner import MegatronLearner

    t0 = time.perf_counter()
    with MegatronLearner(hf, tp=tp, device=device, learner_sites=learner_sites) as le:
        with torch.no_grad():
            logits = le(ids, mask)
        extra = (le.fake_quant_values(), le.fake_quant_sites()) if learner_sites else (None, None)
    return logits, extra, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tp", default="1", help="comma list of TP sizes (1 is always measured)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--skip-fake-quant", action="store_true", help="logits only (no recipe build, no per-site check)")
    a = ap.parse_args(argv)
    tps = sorted({1, *(int(x) for x in a.tp.split(","))})
    from qpass.backends.megatron.config import MegatronConfigError, layout_from_hf
    from qpass.graph.model import load_model
    from qpass.jsonio import write_json

    res: dict = {"model": a.model, "device": a.device, "tps": tps, "torch": torch.__version__, "python": platform.python_version(),
                 "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]), "logits": {}}
    try:
        import megatron.core

        res["megatron_core"] = megatron.core.__version__
    except (ImportError, AttributeError):
        res["megatron_core"] = None
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        lm = load_model(a.model, dtype=dtype, device=a.device)
        ids, mask = _batch(lm.tokenizer, a.prompts, a.device)
        ref = _hf_logits(lm.model, ids, mask)
        per = {}
        base = None
        for tp in tps:
            try:
                layout_from_hf(lm.model.config, tp=tp)
            except MegatronConfigError as exc:  # recorded: the refusal is a result too
                per[f"tp{tp}_refused"] = str(exc)
                continue
            logits, _, wall = _mcore_logits(lm.model, tp, a.device, ids, mask)
            per[f"tp{tp}_vs_hf"] = {**_diff(logits, ref, mask), "wall_s": wall}
            if tp == 1:
                base = logits
            else:
                per[f"tp{tp}_vs_tp1"] = _diff(logits, base, mask)
        if name == "fp32":
            ref_fp32 = ref.float()
        else:  # context for the bf16 numbers: how far each bf16 model is from the fp32 HF model
            per["hf_bf16_vs_hf_fp32"] = _diff(ref, ref_fp32, mask)
            if base is not None:
                per["tp1_bf16_vs_hf_fp32"] = _diff(base, ref_fp32, mask)
        res["logits"][name] = per
        print(name, {k: v["max_abs"] if isinstance(v, dict) else v for k, v in per.items()}, flush=True)
        if name == "fp32" or a.skip_fake_quant:
            del lm, ref, base
            continue
        # fake-quant identity (bf16, quads_nvfp4)
        from qpass.formats.spec import NVFP4_WEIGHT
        from qpass.pipeline import Pipeline
        from qpass.quant import qdq  # noqa: F401
        from qpass.quant.weights import quantize_site_weights
        from qpass.recipe import load_recipe
        from qpass.runtime.engine import make_learner_engine

        pipe = Pipeline.prepare(loaded=lm, batch_size=4, max_len=64)
        learner = pipe.build_side(load_recipe("quads_nvfp4"), "learner")
        lp = {n[len("model."):]: p.detach() for n, p in learner.gm.named_parameters()}
        with torch.no_grad():
            graph_logits = make_learner_engine("qpass", qg=learner)(ids, mask)
        sites: dict[str, dict] = {}
        fq = {}
        ref_hat_all: dict[str, torch.Tensor] = {}
        for tp in [t for t in tps if f"tp{t}_refused" not in per]:
            logits, (values, qsites), wall = _mcore_logits(lm.model, tp, a.device, ids, mask, learner_sites=learner.quant)
            fq[f"tp{tp}_vs_qpass_learner_graph"] = {**_diff(logits, graph_logits, mask), "wall_s": wall}
            for sid, rec in learner.quant.items():
                row = sites.setdefault(sid, {})
                if tp == 1:
                    ws = [lp[f"{m}.weight"] for m in rec.members]
                    ref_hat = torch.ops.qpass.nvfp4_qdq(lp[f"{sid}.weight"], torch.ops.qpass.group_amax(ws), sid)
                    q = quantize_site_weights(NVFP4_WEIGHT, {m: lp[f"{m}.weight"] for m in rec.members})[sid].tensor
                    s = qsites[sid]
                    row.update({"group": rec.group, "w_hat_equal": bool(torch.equal(values[sid], ref_hat)),
                                "codes_equal": bool(torch.equal(s.codes, q.codes)),
                                "scale_bytes_equal": bool(torch.equal(s.scales.view(torch.uint8), q.scales.view(torch.uint8))),
                                "global_scale_bits_equal": bool(torch.equal(s.s_dec.view(torch.int32), q.s_dec.view(torch.int32)))})
                    row["_tp1"] = s
                else:
                    s, s1 = qsites[sid], row["_tp1"]
                    row[f"tp{tp}_bytes_equal_tp1"] = bool(torch.equal(s.codes, s1.codes) and torch.equal(
                        s.scales.view(torch.uint8), s1.scales.view(torch.uint8)) and torch.equal(s.s_dec.view(torch.int32), s1.s_dec.view(torch.int32)))
                    row[f"tp{tp}_w_hat_equal_tp1"] = bool(torch.equal(values[sid], ref_hat_all[sid]))
            if tp == 1:
                ref_hat_all = dict(values)
        for row in sites.values():
            row.pop("_tp1", None)
        keys = [k for k in next(iter(sites.values())) if k.endswith("_equal") or "_equal_" in k]
        fq["sites"] = len(sites)
        fq["identical"] = {k: sum(1 for r in sites.values() if r[k]) for k in keys}
        fq["per_site"] = sites
        res["fake_quant"] = fq
        print("fake_quant", fq["identical"], {k: v["max_abs"] for k, v in fq.items() if isinstance(v, dict) and "max_abs" in v})
    a.out.mkdir(parents=True, exist_ok=True)
    dest = a.out / f"{'logits' if a.skip_fake_quant else 'parity'}_{a.device}.json"
    write_json(dest, res)
    print("wrote", dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
