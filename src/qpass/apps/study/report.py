"""``qpass study`` report: verdicts on the SPEC §2 paper claims, ``study.md`` tables and PNG plots.

Everything here reads the JSON-able result dict built by :func:`qpass.apps.study.run_study` (no
tensors), so a report can be regenerated from ``study.json`` alone.

Verdict rules (thresholds are stated in ``study.md`` next to each verdict):

* C1 ``W16A4 gap >> W4A16 gap``: mean|d| ratio >= :data:`DOMINANCE_RATIO` and the paired
  bootstrap interval of the difference excludes 0.
* C2a weight QDQ brings the W4A16 gap to the floor: the reduction is significant and the gap with
  weight QDQ is <= :data:`FLOOR_TOLERANCE` x the engine-drift floor. Two floors are measured: the
  BF16 recipe's (same ``aten.linear`` kernels on both sides: decode vs prefill only) and the kernel
  floor (BF16 weights, but the rollout's linears computed with the NVFP4 op's arithmetic: float32
  product, one rounding), the drift a quantized rollout carries even with identical weights.
* C2b activation QDQ does not shrink the W16A4 gap: *not* (reduction > :data:`NO_HELP_MARGIN` of
  the gap and significant).
* C3 RAC reduces the gap monotonically in k: mean|d| (and separately max|d|) non-increasing over
  the measured k for each mode x selection.
* C4 asymmetric < symmetric layer-wise mismatch: mean over sites of the relative mismatch in decode
  mode (the rows the rollout computes when it samples; the degenerate prefill reading is no longer
  measured) per input (pre-quantization X, GEMM operand).
* C5 (GRPO) is not measured by a fixed-checkpoint study; its static analogue (naive W4A4 vs
  QUADS vs BF16 floor at this checkpoint) is.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

QUICK_VERDICT = "quick run: not evidence"
QUICK_NOTE = ("Quick run (`--quick`: a toy configuration of a few prompts, tokens and layers for tests): the "
              "verdicts are not evidence for or against the paper's claims; each shows only what the rule gave "
              "on the toy numbers. Run without `--quick` for verdicts.")

DOMINANCE_RATIO = 2.0
FLOOR_TOLERANCE = 1.25
NO_HELP_MARGIN = 0.10


def _f(v: Any, spec: str = ".4f") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return format(v, spec)


def _gap(res: dict, pair: str, key: str = "mean_abs") -> float | None:
    p = res["pairs"].get(pair)
    return None if p is None or p.get("skipped") else p["replay"][key]


def _cmp(res: dict, name: str) -> dict | None:
    return res["comparisons"].get(name)


def evaluate_claims(res: dict) -> list[dict[str, Any]]:
    """One entry per SPEC §2 claim: ``{"id", "claim", "verdict", "evidence", "quick"}``.

    ``verdict`` is ``reproduced``, ``not reproduced``, ``partially reproduced``, ``mixed`` or
    ``not measured``. From a quick run (``res["config"]["quick"]``) every entry has ``quick: true``,
    ``verdict`` is :data:`QUICK_VERDICT` and the rule's outcome moves to ``toy_outcome``: a toy run
    is no evidence for or against a claim.
    """
    out = _evaluate(res)
    quick = bool(res["config"].get("quick"))
    for c in out:
        c["quick"] = quick
        if quick:
            c["toy_outcome"], c["verdict"] = c["verdict"], QUICK_VERDICT
    return out


def _evaluate(res: dict) -> list[dict[str, Any]]:
    """The verdict rules of the module docstring (see :func:`evaluate_claims`)."""
    out = []
    floor = _gap(res, "floor")
    w4a16, w16a4 = _gap(res, "op_w4a16"), _gap(res, "op_w16a4")
    c = _cmp(res, "op_w16a4_vs_op_w4a16")
    if w4a16 is not None and w16a4 is not None and c:
        ratio = w16a4 / w4a16 if w4a16 > 0 else math.inf
        ok = ratio >= DOMINANCE_RATIO and c["lo"] > 0
        out.append({"id": "C1", "claim": "W16A4 gap >> W4A16 gap (activation error dominates)",
                    "verdict": "reproduced" if ok else "not reproduced",
                    "evidence": f"replay mean|d|: W16A4 {w16a4:.4f} vs W4A16 {w4a16:.4f} nats (ratio {ratio:.2f}, "
                                f"threshold {DOMINANCE_RATIO}); difference {c['diff']:.4f} "
                                f"[{c['lo']:.4f}, {c['hi']:.4f}] 95% CI"})
    wq = _gap(res, "qdq_w4a16_wqdq")
    kfloor = _gap(res, "floor_kernel")
    c = _cmp(res, "op_w4a16_vs_qdq_w4a16_wqdq")
    if wq is not None and w4a16 is not None and floor is not None and kfloor is not None and c:
        ok_k = c["lo"] > 0 and wq <= FLOOR_TOLERANCE * kfloor
        ok_b = c["lo"] > 0 and wq <= FLOOR_TOLERANCE * floor
        verdict = "reproduced" if ok_k and ok_b else "reproduced against the kernel floor only" if ok_k else "not reproduced"
        out.append({"id": "C2a", "claim": "learner weight QDQ shrinks the W4A16 gap to the engine-drift floor",
                    "verdict": verdict,
                    "evidence": f"W4A16 gap {w4a16:.4f} (BF16 learner) -> {wq:.4f} (weight-QDQ learner); engine-drift "
                                f"floor with the rollout's GEMM arithmetic (BF16 weights, fp32-accumulate linears) {kfloor:.4f} "
                                f"(ratio {wq / kfloor:.2f}), same-kernel BF16 floor {floor:.4f} (ratio {wq / floor:.2f}); "
                                f"tolerance {FLOOR_TOLERANCE}x; reduction {c['diff']:.4f} [{c['lo']:.4f}, {c['hi']:.4f}]"})
    aq = _gap(res, "qdq_w16a4_aqdq")
    c = _cmp(res, "op_w16a4_vs_qdq_w16a4_aqdq")
    if aq is not None and w16a4 is not None and c:
        helped = c["lo"] > 0 and c["diff"] > NO_HELP_MARGIN * w16a4
        out.append({"id": "C2b", "claim": "learner activation QDQ does not shrink the W16A4 gap",
                    "verdict": "not reproduced" if helped else "reproduced",
                    "evidence": f"W16A4 gap {w16a4:.4f} (BF16 learner) -> {aq:.4f} (activation-QDQ learner); change "
                                f"{-c['diff']:+.4f} [{-c['hi']:+.4f}, {-c['lo']:+.4f}] (counts as shrinking only if "
                                f"> {NO_HELP_MARGIN:.0%} and significant)"})
    sweep = res.get("rac", {}).get("sweep", {})
    if sweep:
        lines, mono_mean, mono_max = [], 0, 0
        for combo, pts in sweep.items():
            ks = [p for p in pts if p.get("mean_abs") is not None]
            means = [p["mean_abs"] for p in ks]
            maxs = [p["max_abs"] for p in ks]
            mm = all(b <= a for a, b in zip(means, means[1:]))
            mx = all(b <= a for a, b in zip(maxs, maxs[1:]))
            mono_mean += mm
            mono_max += mx
            lines.append(f"{combo}: mean|d| " + " > ".join(f"{v:.4f}" for v in means)
                         + f" ({'monotone' if mm else 'not monotone'}); max|d| "
                         + " > ".join(f"{v:.3f}" for v in maxs) + f" ({'monotone' if mx else 'not monotone'})")
        n = len(sweep)
        reduced = []  # k = 0 vs 50% per combo: does RAC lower mean|d| significantly at the paper's k?
        for combo in sweep:
            c = _cmp(res, f"rac_k0_vs_rac_k50_{combo.replace('/', '_')}")
            if c:
                reduced.append(c["lo"] > 0)
                lines.append(f"{combo} k=0 -> 50%: mean|d| {-c['diff']:+.4f} [{-c['hi']:+.4f}, {-c['lo']:+.4f}]")
        verdict = ("reproduced" if mono_mean == n and mono_max == n else
                   "partially reproduced (RAC lowers the gap, not monotonically)" if any(reduced) or mono_mean or mono_max
                   else "not reproduced")
        ks_txt = ", ".join(_f(k * 100, "g") for k in res["config"]["ratios"])
        out.append({"id": "C3", "claim": "RAC reduces the gap monotonically in k",
                    "verdict": verdict,
                    "evidence": f"k = {ks_txt}%; mean|d| monotone in {mono_mean}/{n}, max|d| monotone in {mono_max}/{n} "
                                "mode x selection combos; " + "; ".join(lines)})
    lw = res.get("layerwise", {})
    if lw.get("summary"):
        parts, wins, by_mode = [], [], {}
        for mode in ("prefill", "decode"):
            s = lw["summary"].get(mode)
            if not s:
                continue
            for which in ("pre", "eff"):
                a, y = s["asym"][which]["mean_rel"], s["sym"][which]["mean_rel"]
                frac = s["asym_below_sym_fraction"][which]
                wins.append(a < y)
                by_mode.setdefault(mode, []).append(a < y)
                parts.append(f"{mode}/{which}: asym {a:.4f} vs sym {y:.4f} (asym lower at {frac:.0%} of sites)")
        gap_a, gap_s = _gap(res, "quads_k0"), _gap(res, "sym_w4a4_waqdq")
        if gap_a is not None and gap_s is not None:
            parts.append(f"log-prob gap vs the W4A4 rollout: asym learner {gap_a:.4f}, sym learner {gap_s:.4f}")
        full = [m for m, w in by_mode.items() if all(w)]
        verdict = ("reproduced" if wins and all(wins) else "not reproduced" if not any(wins) else
                   f"reproduced in {full[0]} mode only" if len(full) == 1 and not any(
                       any(w) for m, w in by_mode.items() if m != full[0]) else "mixed")
        out.append({"id": "C4", "claim": "asymmetric W4A16 QAT gives smaller layer-wise mismatch than symmetric W4A4 QAT",
                    "verdict": verdict, "evidence": "; ".join(parts)})
    naive, quads = _gap(res, "op_w4a4"), _gap(res, "quads_ref")
    if naive is not None and quads is not None and floor is not None:
        ok = naive > quads > 0 and abs(quads - floor) < abs(naive - floor)
        out.append({"id": "C5", "claim": "in GRPO, naive W4A4 shows a larger log-prob gap than QUADS, which sits "
                                         "closer to the BF16 floor",
                    "verdict": "not measured (static analogue " + ("holds" if ok else "does not hold") + ")",
                    "evidence": f"no training here; at this checkpoint: naive W4A4 {naive:.4f}, QUADS "
                                f"({res['quads_ref_config']}) {quads:.4f}, BF16 floor {floor:.4f} nats mean|d|"})
    return out


# ------------------------------------------------------------------------------------ markdown
def _pair_row(res: dict, key: str, on_policy: bool = False) -> str:
    p = res["pairs"][key]
    if p.get("skipped"):
        return f"| {key} | {p['learner']} | {p['rollout']} | skipped: {p['skipped']} | | | | | |"
    r = p["on_policy"] if on_policy else p["replay"]
    return (f"| {key} | {p['learner']} | {p['rollout']} | {_f(r['mean_abs'])} | {_f(r['max_abs'], '.3f')} | "
            f"{_f(r['k1'], '.5f')} | {_f(r['k3'], '.5f')} | {_f(r['ess'], '.3f')} | {r['tokens']} |")


PAIR_HEAD = ("| pair | learner | rollout | mean abs d | max abs d | K1 | K3 | ESS | tokens |\n"
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")


def _md_setup(res: dict) -> list[str]:
    """``study.md`` lines: title, configuration and the two scoring modes."""
    cfg, env = res["config"], res["environment"]
    L = [f"# QUADS study: {res['model']['name']}", ""]
    L.append(f"Device `{env['device']}` ({env.get('device_name', '')}), kernels `{cfg['kernels']}` "
             f"(effective: `{env['effective_kernels']}`), torch {env['torch']}, transformers {env['transformers']}, "
             f"{env['threads']} CPU threads. Mode: {'quick' if cfg['quick'] else 'full'}; {cfg['prompts']} probe prompts, "
             f"{cfg['max_new_tokens']} new tokens, temperature {cfg['temperature']}, top-p {cfg['top_p']}, seed {cfg['seed']}; "
             f"quantized layers: {cfg['layers'] if cfg['layers'] is not None else 'all'}; "
             f"RAC targets: {', '.join(res['rac']['targets'])} ({res['rac']['sites']} sites). "
             f"Fixed sequence set: {res['sampled']['responses']} responses, {res['sampled']['tokens']} valid tokens, "
             f"sampled once from the BF16 rollout. Wall time {res['timings']['total_s']:.0f} s.")
    L.append("")
    L.append("**Replay (paired)**: every configuration scores the *same* fixed tokens: log q by teacher-forcing them "
             "through that configuration's rollout step graph (prefill, then one decode step per token, whole static "
             "batches), log p by that configuration's learner; d = log p - log q. **On-policy (sampled)**: "
             "`logprob_gap`, each rollout samples its own tokens (same seeds). All gaps are token means in nats "
             "(SPEC §4); 95% intervals are response-level paired bootstraps. Caveat: replay tokens are sampled "
             "from the BF16 rollout, not from each configuration's q, so in replay rows K1, K3 and ESS are not the "
             "KL(q||p) / importance-weight estimators SPEC §4 defines (those assume tokens drawn from q; the "
             "on-policy rows are); mean and max |d| are the paired comparison metrics.")
    return L


def _md_operands(res: dict) -> list[str]:
    """``study.md`` lines: section 1, the rollout operand ablation."""
    L: list[str] = []
    L += ["", "## 1. Rollout operand ablation (BF16 learner)", "", "Replay (paired):", "", PAIR_HEAD]
    for k in ("floor", "floor_kernel", "op_w4a16", "op_w16a4", "op_w4a4"):
        L.append(_pair_row(res, k))
    L += ["", "`floor` = BF16 learner vs BF16 rollout (same `aten.linear` kernels; decode vs prefill only). "
          "`floor_kernel` = BF16 learner vs a BF16 rollout whose quantizable linears use the rollout op's arithmetic "
          "(float32 product, one rounding): the engine-drift floor of the quantized rollouts' kernels.", "",
          "On-policy (sampled, each rollout its own tokens):", "", PAIR_HEAD]
    for k in ("floor", "op_w4a16", "op_w16a4", "op_w4a4"):
        if res["pairs"][k].get("on_policy"):
            L.append(_pair_row(res, k, on_policy=True))
    return L


def _md_learner_qdq(res: dict) -> list[str]:
    """``study.md`` lines: section 2, learner-side QDQ."""
    cfg = res["config"]
    L: list[str] = []
    L += ["", "## 2. Learner-side QDQ (replay)", "", PAIR_HEAD]
    for k in ("op_w4a16", "qdq_w4a16_wqdq", "op_w16a4", "qdq_w16a4_aqdq", "quads_k0", "sym_w4a4_waqdq"):
        if k in res["pairs"]:
            L.append(_pair_row(res, k))
    on = [k for k in ("op_w4a16", "qdq_w4a16_wqdq", "op_w4a4", "quads_k0") if res["pairs"].get(k, {}).get("on_policy")]
    if any(k in ("qdq_w4a16_wqdq", "quads_k0") for k in on):
        L += ["", f"Learner-side QDQ on-policy (rollout engine `{cfg.get('rollout_engine', 'qpass')}`: the same sampled "
              "tokens scored by the BF16 and by the weight-QDQ learner):", "", PAIR_HEAD]
        L += [_pair_row(res, k, on_policy=True) for k in on]
    return L


def _md_rac(res: dict) -> list[str]:
    """``study.md`` lines: section 3, the RAC sweep, its FLOPs and measured time."""
    cfg = res["config"]
    L: list[str] = []
    L += ["", "## 3. RAC sweep on the QUADS configuration (weight-QDQ learner, W4A4 rollout + RAC; replay)", ""]
    sweep = res["rac"]["sweep"]
    combos = list(sweep)
    L.append("mean abs d / max abs d (nats); k = 0 is plain W4A4 (the op ignores mode and selection at ratio 0).")
    L.append("")
    L.append("| k | " + " | ".join(combos) + " |")
    L.append("| ---: | " + " | ".join("---" for _ in combos) + " |")
    for i, ratio in enumerate(cfg["ratios"]):
        cells = []
        for c in combos:
            p = sweep[c][i]
            cells.append("skipped" if p.get("mean_abs") is None else f"{p['mean_abs']:.4f} / {p['max_abs']:.3f}")
        L.append(f"| {ratio * 100:g}% | " + " | ".join(cells) + " |")
    cost = res["rac"]["cost"]
    L += ["", f"GEMM FLOPs per token (analytic): all linears {cost['model_linear_flops_per_token'] / 1e6:.1f} MFLOP, "
          f"RAC sites' main GEMMs {cost['rac_sites_flops_per_token'] / 1e6:.1f} MFLOP. Extra for compensation "
          "(ideal kernel; `ref` = what the plain-torch reference computes):", "",
          "| config | K' | extra MFLOP/token | vs RAC sites | vs model | ref extra MFLOP |",
          "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for key, row in cost["configs"].items():
        L.append(f"| {key} | {row['k_prime']} | {row['extra_flops_per_token'] / 1e6:.2f} | {row['extra_vs_rac_sites']:.1%} | "
                 f"{row['extra_vs_model']:.1%} | {row['reference_extra_flops_per_token'] / 1e6:.2f} |")
    t = res["rac"]["timing"]
    if t.get("available"):
        L += ["", f"Measured op time ({t['timer']}, kernels `{t['kernels']}`), us per call:", ""]
        for shape, row in t["rows"].items():
            L.append(f"* {shape}: " + ", ".join(f"{k} {_f(v, '.1f')}" for k, v in row.items()))
    else:
        L += ["", f"Time: not measured ({t.get('reason', '')})."]
    return L


def _md_layerwise(res: dict) -> list[str]:
    """``study.md`` lines: section 4, layer-wise input mismatch (when measured)."""
    L: list[str] = []
    lw = res.get("layerwise", {})
    if lw.get("summary"):
        L += ["", "## 4. Layer-wise input mismatch: asymmetric W4A16 QAT vs symmetric W4A4 QAT (rollout: plain W4A4)", "",
              lw["definition"], "",
              "| rollout mode | input | asym mean rel | sym mean rel | asym median | sym median | sites asym < sym |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for mode, s in lw["summary"].items():
            for which in ("pre", "eff"):
                a, y = s["asym"][which], s["sym"][which]
                L.append(f"| {mode} | {which} | {a['mean_rel']:.4f} | {y['mean_rel']:.4f} | {a['median_rel']:.4f} | "
                         f"{y['median_rel']:.4f} | {s['asym_below_sym_fraction'][which]:.0%} |")
    return L


def _md_checks(res: dict) -> list[str]:
    """``study.md`` lines: sections 5 and 6, paired comparisons and exact relations."""
    L: list[str] = []
    L += ["", "## 5. Paired comparisons (difference of mean abs d, a - b, 95% bootstrap CI)", "",
          "| a vs b | diff | lo | hi |", "| --- | ---: | ---: | ---: |"]
    for name, c in res["comparisons"].items():
        L.append(f"| {name} | {c['diff']:+.4f} | {c['lo']:+.4f} | {c['hi']:+.4f} |")
    L += ["", "## 6. Exact relations checked", ""]
    for name, v in res["invariants"].items():
        L.append(f"* `{name}`: {v}")
    return L


def _md_claims(res: dict) -> list[str]:
    """``study.md`` lines: section 7, claim verdicts, skipped items, plots."""
    cfg = res["config"]
    L: list[str] = []
    L += ["", "## 7. Paper claims (SPEC §2)", ""]
    if cfg["quick"]:
        L += [f"> **{QUICK_NOTE}**", ""]
    L += ["| claim | verdict | evidence |", "| --- | --- | --- |"]
    for c in res["claims"]:
        verdict = f"**{c['verdict']}**" + (f" (toy outcome: {c['toy_outcome']})" if c.get("toy_outcome") else "")
        L.append(f"| {c['id']}: {c['claim']} | {verdict} | {c['evidence']} |")
    L += ["", "Verdict thresholds: C1 ratio >= %g and CI excludes 0; C2a significant reduction and <= %g x floor; "
          "C2b shrinking counts only if > %d%% of the gap and significant; C3 non-increasing over the measured k "
          "(partial: k = 50%% significantly below k = 0 in some mode x selection); "
          "C4 mean relative mismatch over sites." % (DOMINANCE_RATIO, FLOOR_TOLERANCE, NO_HELP_MARGIN * 100), ""]
    if res.get("skipped"):
        L += ["Skipped (reason in parentheses): " + ", ".join(res["skipped"]), ""]
    L += ["Plots: `gap_vs_k.png`, `layerwise.png`, `operand_ablation.png`.", ""]
    return L


def to_markdown(res: dict) -> str:
    """``study.md``: configuration, tables, invariants, claim verdicts."""
    L: list[str] = []
    for section in (_md_setup, _md_operands, _md_learner_qdq, _md_rac, _md_layerwise, _md_checks, _md_claims):
        L += section(res)
    return "\n".join(L)


# ------------------------------------------------------------------------------------ plots
def write_plots(res: dict, out: Path) -> list[str]:
    """Write the three PNGs into ``out``; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    cfg = res["config"]
    ks = [r * 100 for r in cfg["ratios"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for combo, pts in res["rac"]["sweep"].items():
        xs = [k for k, p in zip(ks, pts) if p.get("mean_abs") is not None]
        for ax, key in zip(axes, ("mean_abs", "max_abs")):
            ax.plot(xs, [p[key] for p in pts if p.get("mean_abs") is not None], marker="o", label=combo)
    floor = _gap(res, "floor")
    for ax, key, title in zip(axes, ("mean_abs", "max_abs"), ("mean |d| (token mean)", "max |d|")):
        for pair, ls, label in (("floor", "--", "BF16 floor"), ("floor_kernel", ":", "kernel floor")):
            fv = _gap(res, pair, key)
            if fv is not None:
                ax.axhline(fv, color="gray", ls=ls, label=label)
        ax.set_xlabel("RAC channel ratio k (%)")
        ax.set_ylabel("nats")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("QUADS RAC sweep (weight-QDQ learner, W4A4 rollout), paired replay")
    fig.tight_layout()
    fig.savefig(out / "gap_vs_k.png", dpi=110)
    plt.close(fig)
    names.append("gap_vs_k.png")

    lw = res.get("layerwise", {})
    if lw.get("per_site"):
        modes = list(lw["per_site"])
        fig, axes = plt.subplots(len(modes), 2, figsize=(12, 3.6 * len(modes)), squeeze=False)
        for i, mode in enumerate(modes):
            for j, which in enumerate(("pre", "eff")):
                ax = axes[i][j]
                for side in ("asym", "sym"):
                    d = lw["per_site"][mode][side]
                    ax.plot(range(len(d)), [max(v[f"{which}_rel"], 1e-9) for v in d.values()], lw=1, label=side)
                ax.set_yscale("log")
                ax.set_title(f"{mode} rollout, {'pre-quant X' if which == 'pre' else 'GEMM operand'}")
                ax.set_xlabel("site index (graph order)")
                ax.set_ylabel("||X_roll - X_learn|| / ||X_learn||")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "layerwise.png", dpi=110)
        plt.close(fig)
        names.append("layerwise.png")

    keys = [k for k in ("floor", "floor_kernel", "op_w4a16", "op_w16a4", "op_w4a4", "qdq_w4a16_wqdq", "qdq_w16a4_aqdq",
                        "quads_ref")
            if k in res["pairs"] and not res["pairs"][k].get("skipped")]
    fig, ax = plt.subplots(figsize=(13, 4.2))
    xs = range(len(keys))
    ax.bar([x - 0.2 for x in xs], [res["pairs"][k]["replay"]["mean_abs"] for k in keys], 0.4, label="replay (paired)")
    on = [res["pairs"][k].get("on_policy", {}).get("mean_abs") for k in keys]
    ax.bar([x + 0.2 for x, v in zip(xs, on) if v is not None], [v for v in on if v is not None], 0.4, label="on-policy (sampled)")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{k}\n{res['pairs'][k]['learner']}/{res['pairs'][k]['rollout']}" for k in keys], fontsize=7)
    ax.set_ylabel("mean |d| (nats)")
    if floor is not None:
        ax.axhline(floor, color="gray", ls="--", lw=1)
    ax.legend()
    ax.set_title("Operand ablation and learner-side QDQ")
    fig.tight_layout()
    fig.savefig(out / "operand_ablation.png", dpi=110)
    plt.close(fig)
    names.append("operand_ablation.png")
    return names
