"""Summary table of long GRPO runs (``bash scripts/gpu.sh grpo-long``): one row per run directory.

    python scripts/grpo_long_summary.py OUT_MD RUN_DIR...

Columns: steps done, stop reason, reward first/last (mean of the first / last 10 steps), eval
accuracy at step 0 / best / last (with the last eval's binomial standard error), mean G_abs and
max|d| of (p_prox, q), mean shadow gap (q_bf16 vs q), clip fraction per advantage sign of the
coupled ratio p_theta/q, clip-branch disagreement per sign against the BF16 shadow, and the
collapse verdict of ``qpass.diagnostics.collapse`` (or the observation limit).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from qpass.apps.grpo.jsonl import read_jsonl
from qpass.diagnostics.collapse import collapse_summary


def _mean(xs):
    v = [x for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)]
    return sum(v) / len(v) if v else None


def _fmt(v):
    return "n/a" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))


def main() -> None:
    out, runs = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
    lines = ["| run | steps | stop | reward first10 -> last10 | eval step0 / best / last (+-se) | mean G_abs | mean max abs d | "
             "mean shadow G_abs | coupled clip A>0 / A<0 | disagreement A>0 / A<0 | collapse |",
             "| --- | ---: | --- | --- | --- | ---: | ---: | ---: | --- | --- | --- |"]
    doc = {}
    for d in runs:
        rows = read_jsonl(d / "metrics.jsonl")
        ev = read_jsonl(d / "eval.jsonl") if (d / "eval.jsonl").is_file() else []
        s = json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else {}
        col = lambda k: [r.get(k) for r in rows]  # noqa: E731
        rw = col("reward/mean")
        acc = [e.get("eval/accuracy") for e in ev]
        col_res = collapse_summary(ev, rows)
        verdict = (f"yes at step {col_res['step']} (onset {col_res['onset_step']})" if col_res["collapsed"]
                   else f"none within {col_res['observed_until']} steps ({col_res['n_evals']} evals)")
        last_se = ev[-1].get("eval/stderr") if ev else None
        row = {
            "steps": len(rows), "stop": s.get("stop_reason", "partial"),
            "reward_first10": _mean(rw[:10]), "reward_last10": _mean(rw[-10:]),
            "eval_step0": acc[0] if acc else None, "eval_best": max(acc) if acc else None, "eval_last": acc[-1] if acc else None,
            "eval_last_stderr": last_se, "g_abs": _mean(col("gap/token/g_abs")), "max_abs": _mean(col("gap/max_abs")),
            "shadow_g_abs": _mean(col("shadow_gap/token/g_abs")),
            "coupled_clip_pos": _mean(col("loss/coupled_clip_pos_frac")), "coupled_clip_neg": _mean(col("loss/coupled_clip_neg_frac")),
            "disagree_pos": _mean(col("clip/frac_pos")), "disagree_neg": _mean(col("clip/frac_neg")), "collapse": col_res,
        }
        doc[d.name] = row
        lines.append(
            f"| {d.name} | {row['steps']} | {row['stop']} | {_fmt(row['reward_first10'])} -> {_fmt(row['reward_last10'])} | "
            f"{_fmt(row['eval_step0'])} / {_fmt(row['eval_best'])} / {_fmt(row['eval_last'])} (+-{_fmt(last_se)}) | "
            f"{_fmt(row['g_abs'])} | {_fmt(row['max_abs'])} | {_fmt(row['shadow_g_abs'])} | "
            f"{_fmt(row['coupled_clip_pos'])} / {_fmt(row['coupled_clip_neg'])} | {_fmt(row['disagree_pos'])} / "
            f"{_fmt(row['disagree_neg'])} | {verdict} |")
    out.write_text("\n".join(lines) + "\n")
    from qpass.jsonio import write_json

    write_json(out.with_suffix(".json"), doc)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
