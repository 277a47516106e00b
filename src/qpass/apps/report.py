"""The report of ``qpass apply``: ``report.json`` (assembled from the check results), ``report.md``, plots.

Plots use matplotlib's headless Agg backend (imported only when plotting).
"""

from __future__ import annotations

import dataclasses
import math
import platform
from pathlib import Path
from typing import Any

import torch

from qpass import __version__
from qpass.apps.artifacts import file_checksums, write_json
from qpass.apps.integrity import model_files, seal_report
from qpass.apps.options import ApplyOptions
from qpass.apps.parity_checks import CheckResult
from qpass.formats.spec import FP8Spec, NVFP4Spec
from qpass.graph.qgraph import QGraph
from qpass.compiler.recipe import Recipe


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


ROLE_COLORS = {"q_proj": "tab:blue", "k_proj": "tab:cyan", "v_proj": "tab:purple", "o_proj": "tab:gray",
               "gate_proj": "tab:orange", "up_proj": "tab:red", "down_proj": "tab:green"}


def plot_activation_mismatch(rel: dict[str, float], path: Path, title: str) -> None:
    """Per-site relative input mismatch ||X_roll - X_learn|| / ||X_learn|| in graph order."""
    plt = _plt()
    sites = list(rel)
    fig, ax = plt.subplots(figsize=(11, 3.6))
    for role, color in ROLE_COLORS.items():
        xs = [i for i, s in enumerate(sites) if s.endswith(role)]
        ax.scatter(xs, [rel[sites[i]] for i in xs], s=10, color=color, label=role)
    other = [i for i, s in enumerate(sites) if not any(s.endswith(r) for r in ROLE_COLORS)]
    if other:
        ax.scatter(other, [rel[sites[i]] for i in other], s=10, color="black", label="other")
    ax.set_yscale("log")
    ax.set_xlabel("linear site (graph order)")
    ax.set_ylabel("relative input mismatch")
    ax.set_title(title)
    ax.legend(ncol=8, fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_residual_heatmap(resid: torch.Tensor, channels: torch.Tensor | None, path: Path, title: str) -> None:
    """Write :func:`residual_heatmap_figure` to ``path`` (PNG)."""
    plt = _plt()
    fig = residual_heatmap_figure(resid, channels, title)
    try:
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def residual_heatmap_figure(resid: torch.Tensor, channels: torch.Tensor | None, title: str) -> Any:
    """Heatmap of |X - DQ(Q_A(X))| (tokens x channels); below it the per-channel norm ``||R[:, j]||`` and a
    strip marking the RAC-compensated channels (red; their count in its title). Returns the matplotlib figure.

    ``resid``: ``[tokens, K]``; ``channels``: the compensated channel indices (any shape; None or empty:
    no RAC at this site, no strip).
    """
    plt = _plt()
    from matplotlib.colors import ListedColormap
    from matplotlib.ticker import MaxNLocator

    from qpass.apps.plot_style import readable_log_ticks

    r = resid.float().abs().cpu()
    k = r.shape[-1]
    has_rac = channels is not None and channels.numel() > 0
    rows = 3 if has_rac else 2
    fig, axes = plt.subplots(rows, 1, figsize=(11, 6.2 if has_rac else 5.6), sharex=True, layout="constrained",
                             height_ratios=[5, 1.8, 0.35][:rows])
    ax, ax2 = axes[0], axes[1]
    im = ax.imshow(torch.log10(r + 1e-6).numpy(), aspect="auto", cmap="magma", interpolation="nearest")
    fig.colorbar(im, ax=list(axes), label="log10 |residual|", shrink=0.9)
    ax.set_ylabel("token")
    ax.set_title(title)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
    per_ch = r.pow(2).sum(0).sqrt()
    ax2.plot(per_ch.numpy(), lw=0.7, color="black")
    ax2.set_yscale("log")
    ax2.set_ylabel("||R[:, j]||")
    ax2.grid(alpha=0.3, axis="y")
    if has_rac:
        ch = channels.flatten().unique().cpu()
        mask = torch.zeros(k)
        mask[ch] = 1.0
        ax3 = axes[2]
        ax3.imshow(mask.reshape(1, -1).numpy(), aspect="auto", cmap=ListedColormap(["#eeeeee", "tab:red"]), vmin=0, vmax=1,
                   interpolation="nearest")
        ax3.set_yticks([])
        ax3.set_ylabel("RAC", rotation=0, ha="right", va="center")
        ax3.set_title(f"compensated channels (red): {len(ch)} of {k} ({100 * len(ch) / k:.0f}%), first sampled batch",
                      fontsize=8, loc="left")
        ax3.set_xlabel("input channel")
    else:
        ax2.set_xlabel("input channel")
    axes[-1].xaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))
    readable_log_ticks(ax2)
    return fig


def plot_gap_histogram(d: torch.Tensor, d_floor: torch.Tensor | None, path: Path, title: str) -> None:
    """Histogram of d = log p - log q over valid tokens (recipe vs the BF16 floor)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    vals = [x for x in (d, d_floor) if x is not None and x.numel()]
    lo = min(float(x.min()) for x in vals) if vals else -1.0
    hi = max(float(x.max()) for x in vals) if vals else 1.0
    bins = torch.linspace(lo, hi, 61).numpy() if hi > lo else 60
    if d.numel():
        ax.hist(d.numpy(), bins=bins, alpha=0.6, label=f"recipe (mean |d| {d.abs().mean():.4f})", color="tab:red")
    if d_floor is not None and d_floor.numel():
        ax.hist(d_floor.numpy(), bins=bins, alpha=0.6, label=f"bf16 floor (mean |d| {d_floor.abs().mean():.4f})", color="tab:blue")
    ax.set_yscale("log")
    ax.set_xlabel("d = log p(learner) - log q(rollout)  [nats]")
    ax.set_ylabel("tokens")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "**NO**"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.4g}"
    return str(v)


def _cell(text: Any) -> str:
    """A markdown table cell: pipes escaped, newlines flattened."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(report: dict[str, Any]) -> str:
    """Human-readable summary of a report dict (the same numbers as report.json)."""
    p = report["parity"]
    lines = [f"# qpass apply: {report['recipe']['name']}", "",
             f"**{report['verdict']['line']}**" if report.get("verdict") else "", "",
             f"Model: {report['model']['name']} ({report['model']['dtype']}, {report['model']['device']}, kernels: {report['kernels']}"
             + (f", effective: {report['kernels_effective']}" if report.get("kernels_effective", report["kernels"]) != report["kernels"] else "")
             + ")", "",
             *_machine_line(report.get("machine")),
             report["recipe"].get("description", ""), "",
             "## Parity", "", "| check | result | detail |", "| --- | --- | --- |"]
    for c in p["checks"]:  # one row per check of the recipe's parity: list
        lines.append(f"| {c['check']} | {_fmt(c['ok'])} | {_cell(c.get('detail', ''))} |")
    if p["mismatched_groups"]:
        lines.append(f"| mismatched groups | {len(p['mismatched_groups'])} | {_cell(', '.join(map(str, p['mismatched_groups'][:10])))} |")
    lines += ["", "## Log-prob gap (d = log p - log q, valid sampled tokens, token mean)", "",
              "| pair | mean abs | max abs | K1 | K3 | tokens |", "| --- | --- | --- | --- | --- | --- |"]
    for label, key in (("recipe", "logprob_gap"), ("bf16 floor", "floor_logprob_gap")):
        g = p.get(key)
        if g:
            lines.append(f"| {label} | {_fmt(g['mean_abs'])} | {_fmt(g['max_abs'])} | {_fmt(g['k1'])} | {_fmt(g['k3'])} | {g['tokens']} |")
    s = report["sites"]
    lines += ["", "## Sites", "", f"total linear sites {s['total']}; learner QDQ {s['learner_qdq']}; rollout W4A4 {s['rollout_w4a4']}; "
              f"W4A16 {s['rollout_w4a16']}; FP8 {s['rollout_fp8']}; RAC {s['rac']}", "",
              "## Passes", "", "| side | pass | line | matches | skipped | seconds |", "| --- | --- | --- | --- | --- | --- |"]
    for h in report["passes"]:
        lines.append(f"| {h['side']} | {h['name']} | {h.get('line') or ''} | {h['matches']} | {len(h['skipped'])} | {h['elapsed_s']:.2f} |")
    if report.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{k}]({v})" for k, v in report["plots"].items()]
    if p.get("problems"):
        lines += ["", "## Problems", ""] + [f"- {x}" for x in p["problems"]]
    return "\n".join(lines) + "\n"


def site_counts(learner: QGraph, rollout: QGraph) -> dict[str, Any]:
    rq = rollout.quant.values()
    return {
        "total": len(rollout.sites),
        "learner_qdq": sum(1 for r in learner.quant.values() if r.weight_fake_quant),
        "learner_act_qdq": sum(1 for r in learner.quant.values() if r.act_spec is not None),
        "rollout_w4a4": sum(1 for r in rq if r.w4a4),
        "rollout_w4a16": sum(1 for r in rq if r.lowered_as(NVFP4Spec) and r.act_spec is None),
        "rollout_fp8": sum(1 for r in rq if r.lowered_as(FP8Spec)),
        "rollout_act_qdq": sum(1 for r in rq if r.activation_only),
        "rac": sum(1 for r in rq if r.rac is not None),
    }


def uncaptured_linears(model: torch.nn.Module, sites: dict[str, Any], opaque: list | None = None) -> list[dict[str, str]]:
    """nn.Linear modules of the model that are not quantization sites, each with the reason."""
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name not in sites:
            owner = next((o for o in opaque or [] if name == o.name or name.startswith(o.name + ".")), None)
            reason = (f"inside {owner.name}, captured as one opaque node because torch.export failed there: {owner.reason}"
                      if owner else "not called in the captured forward (no aten.linear node carries it)")
            out.append({"module": name, "reason": reason})
    return out


def build_report(recipe: Recipe, o: ApplyOptions, lm: Any, pipe: Any, learner: QGraph, rollout: QGraph,
                 results: list[CheckResult], kernels_eff: str, bsz: int, max_len: int, gopt: Any, diag: dict[str, Any],
                 plots: dict[str, str], files: dict[str, Any], timings: dict[str, float]) -> dict[str, Any]:
    """The ``report.json`` dict of one ``qpass apply`` (parity fields come from the check results)."""
    parity: dict[str, Any] = {"structural_ok": None, "weights_bitexact": None, "mismatched_groups": [], "mismatch_detail": [],
                              "logprob_gap": None, "floor_logprob_gap": None}
    for r in results:
        parity.update(r.fields)
    parity |= {"probe": gopt.model_dump() | {"rollout_batch": bsz, "max_len": max_len},
               "checks": [r.row() for r in results], "problems": [p for r in results for p in r.problems]}
    rep = {
        "qpass_version": __version__,
        "recipe": recipe.to_json() | {"text": recipe.text},
        # the model files' sha256: what `qpass check` / `qpass export` rebuild from (qpass.apps.integrity)
        "model": {"name": lm.name, "source": lm.source, "dtype": o.dtype, "device": o.device, "ref": o.model,
                  "files": model_files(lm.source)},
        "kernels": o.kernels,
        "kernels_effective": kernels_eff,
        "rollout_engine": o.rollout_engine,
        "sites": site_counts(learner, rollout) | {
            "uncaptured": uncaptured_linears(lm.model, rollout.sites, pipe.base_scoring.captured.opaque),
            "opaque_modules": [dataclasses.asdict(x) for x in pipe.base_scoring.captured.opaque]},
        "passes": [h.to_json() for h in learner.history + rollout.history],
        "parity": parity,
        "diagnostics": diag,
        "plots": plots,
        "artifacts": files,
        "timings": timings,
        "versions": {"torch": torch.__version__, "python": platform.python_version(), **_versions()},
        "machine": machine_record(o.device),
        "ok": not any(r.ok is False for r in results),
    }
    rep["verdict"] = verdict(rep)
    return rep


# what each file of an apply output is (``qpass apply`` lists every file it wrote with these)
OUTPUT_FILES: dict[str, str] = {
    "report.json": "every number: parity, log-prob gap and floor, sites, passes, machine, timings, sha256 of each file",
    "report.md": "the same report, readable",
    "learner/model.safetensors": "learner state: the BF16 master weights (HF names; the learner fake-quantizes them on the fly)",
    "rollout/weights.safetensors": "rollout linears: packed E2M1 codes, E4M3 block scales, S_dec, S_enc (ModelOpt names)",
    "rollout/hf_quant_config.json": "per-site quantization of the rollout (groups, activation mode, RAC)",
    "rollout/recipe.yaml": "the recipe that was applied",
    "activation_mismatch.png": "plot: per-site input mismatch, rollout prefill vs learner",
    "residual_heatmap.png": "plot: NVFP4 activation residual of one RAC (or W4A4) site, compensated channels marked",
    "logprob_gap_hist.png": "plot: log-prob gap per token, recipe vs BF16 floor",
}


def verdict(report: dict[str, Any]) -> dict[str, Any]:
    """The one-line verdict of an apply report, the log-prob gap in units of the BF16 engine-drift floor.

    Returns ``{"ok": bool, "gap_over_floor": float | None, "line": str}``; ``gap_over_floor`` is
    ``mean|d|(recipe) / mean|d|(bf16 floor)`` (SPEC §4 ``G_abs``, token mean), None when either was not
    measured or the floor is 0.
    """
    p = report["parity"]
    ok = bool(report["ok"])
    parts: list[str] = []
    if p.get("structural_ok") is False or p.get("weights_bitexact") is False:
        n = len(p.get("mismatched_groups") or [])
        parts.append("learner and rollout do NOT share one quantizer"
                     + (f" ({n} fused group(s) differ bit-wise)" if n else " (structural parity failed)"))
    elif p.get("weights_bitexact"):
        groups = next((c.get("detail", "") for c in p.get("checks", []) if c["check"] == "weights_bitexact"), "")
        parts.append("learner and rollout share the NVFP4 weight quantizer bit for bit" + (f" ({groups})" if groups else ""))
    elif p.get("structural_ok"):
        parts.append("structural parity holds (no bit-level weight check: the learner has no NVFP4 weight QDQ)")
    g, f = p.get("logprob_gap"), p.get("floor_logprob_gap")
    ratio = None
    if g:
        gated = {c["check"]: c["ok"] for c in p.get("checks", [])}.get("logprob_gap")
        gate = " (not gated: the recipe sets no max_abs_gap)" if gated is None else (" (within the recipe's max_abs_gap)" if gated
                                                                                      else " (ABOVE the recipe's max_abs_gap)")
        if f and f.get("mean_abs"):
            ratio = g["mean_abs"] / f["mean_abs"]
            parts.append(f"rollout/learner log-prob gap mean|d| {g['mean_abs']:.4f} = {ratio:.1f}x the BF16 engine-drift floor "
                         f"({f['mean_abs']:.4f}){gate}")
        elif f:
            parts.append(f"rollout/learner log-prob gap mean|d| {g['mean_abs']:.4f}; the BF16 engine-drift floor is exactly 0 "
                         f"on this probe (no ratio){gate}")
        else:
            parts.append(f"rollout/learner log-prob gap mean|d| {g['mean_abs']:.4f} (no BF16 floor measured: --no-floor){gate}")
    else:
        parts.append("log-prob gap not measured (--no-behavioral)")
    return {"ok": ok, "gap_over_floor": ratio, "line": ("PASS: " if ok else "FAIL: ") + "; ".join(parts)}


def output_files(out: Path) -> list[tuple[str, int, str]]:
    """Every file under the apply output ``out``: ``(relative path, bytes, what it is)``, sorted."""
    rows = []
    for f in sorted(x for x in Path(out).rglob("*") if x.is_file()):
        rel = f.relative_to(out).as_posix()
        rows.append((rel, f.stat().st_size, OUTPUT_FILES.get(rel, "plot" if rel.endswith(".png") else "")))
    return rows


def write_report(tmp: Path, report: dict[str, Any]) -> None:
    """Write ``report.md``, then ``report.json`` with the sha256 of every other file in the directory and
    its own content digest (:func:`qpass.apps.integrity.seal_report`, added last)."""
    (tmp / "report.md").write_text(markdown(report))
    report["artifacts"]["sha256"] = file_checksums(tmp)
    write_json(tmp / "report.json", seal_report(report))


def _machine_line(m: dict[str, Any] | None) -> list[str]:
    if not m:
        return []
    gpu = f", GPU {m['cuda_device']}" if m.get("cuda_device") else ""
    amx = {True: ", AMX-BF16", False: ", no AMX", None: ""}[m.get("cpu_flags_amx_bf16")]
    return [f"Machine: {m['arch']}, torch CPU capability {m['cpu_capability']}{amx}, {m['torch_threads']} threads{gpu}", ""]


def machine_record(device: str) -> dict[str, Any]:
    """What the numbers were computed on: the sampled tokens, hence every log-prob gap of the probe,
    depend on the matmul kernels torch picks for this CPU (e.g. AMX-BF16 vs AVX-512 bf16 GEMMs round
    differently) and on the thread count, so two machines can report different gaps for one commit.

    Returns ``{"cpu_capability": torch's CPU dispatch level (``"AVX512"``, ``"AVX2"``, ...),
    "torch_threads": int, "arch": platform.machine(), "cpu_flags_amx_bf16": bool | None (None off
    Linux), "cuda_device": name or None}``.
    """
    flags = None
    try:
        with open("/proc/cpuinfo") as f:
            flags = any(line.startswith("flags") and " amx_bf16" in line for line in f)
    except OSError:
        pass
    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch_threads": torch.get_num_threads(),
            "arch": platform.machine(), "cpu_flags_amx_bf16": flags,
            "cuda_device": torch.cuda.get_device_name(torch.device(device)) if cuda else None}


def _versions() -> dict[str, str]:
    out = {}
    for mod in ("transformers", "triton"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            pass
    return out
