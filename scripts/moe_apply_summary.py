"""Expert-site numbers of a ``qpass apply`` output on an MoE model (from its report.json and rollout config).

    python scripts/moe_apply_summary.py OUT_DIR > docs/results/moe/apply_summary.json

Counts expert sites (``*.mlp.experts.E.{gate,up,down}_proj``) and expert groups in
``rollout/hf_quant_config.json``, whether every expert site is a W4A4 site of a group that the
bit-exact check compared, RAC sites, routers left BF16, and copies the parity verdicts and the
behavioural gap (with and without routing replay, routing mismatch) from ``report.json``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    rep = json.loads((out / "report.json").read_text())
    q = json.loads((out / "rollout" / "hf_quant_config.json").read_text())["quantization"]
    sites = q["sites"]
    expert = {s: EXPERT.match(s) for s in sites if EXPERT.match(s)}
    layers = sorted({int(m[1]) for m in expert.values()})
    experts = sorted({int(m[2]) for m in expert.values()})
    groups = {sites[s]["group"] for s in expert}
    w13_ok = all(sites[s]["group"] == s.rsplit(".", 1)[0] + ".gate_up" for s, m in expert.items() if m[3] != "down_proj")
    rac = set(q.get("rac") or {})
    par = rep["parity"]
    gap = par.get("logprob_gap") or {}
    summary = {
        "model": rep["model"]["name"], "recipe": rep["recipe"]["name"], "kernels": rep.get("kernels_effective"),
        "sites_total": rep["sites"]["total"], "sites_quantized_rollout": rep["sites"]["rollout_w4a4"],
        "sites_quantized_learner": rep["sites"]["learner_qdq"],
        "expert_sites": len(expert), "moe_layers": len(layers), "experts_per_layer": len(experts),
        "expert_sites_expected": len(layers) * len(experts) * 3,
        "expert_groups": len(groups), "w13_groups_fuse_gate_and_up": w13_ok,
        "expert_sites_all_nvfp4_w4a4": all(sites[s]["kind"] == "nvfp4_linear" and sites[s]["act_spec"] for s in expert),
        "rac_sites": len(rac), "rac_sites_are_w13": all(EXPERT.match(s) and EXPERT.match(s)[3] != "down_proj" for s in rac),
        "routers_excluded": sorted(m for m in q["exclude_modules"] if m.endswith(".mlp.gate"))[:3] + ["..."],
        "routers_excluded_count": sum(1 for m in q["exclude_modules"] if m.endswith(".mlp.gate")),
        "structural_ok": par["structural_ok"], "weights_bitexact": par["weights_bitexact"],
        "checks": par["checks"], "mismatched_groups": par["mismatched_groups"],
        "logprob_gap": gap or None, "floor_logprob_gap": par.get("floor_logprob_gap"),
        "timings_s": rep["timings"], "ok": rep["ok"],
    }
    json.dump(summary, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
