"""Markdown tables of a ``devcheck`` run, generated from its raw files (``devcheck.json`` and, from an
``--e2e-only`` call, ``e2e.json``), so the tables in BENCHMARKS.md are a function of the raw data.

``python -m qpass.apps.bench.cuda_tables RUN_DIR [RUN_DIR ...]`` prints the decode, prefill,
end-to-end and GRPO sample-phase tables of the files found in the given directories (a later
directory's section replaces an earlier one's; e2e rows are concatenated). Every ratio is the one the
run computed against its own BF16 row (``*_vs_bf16``), or, where the run stored only times, BF16 µs ÷ µs
of the same row. Exit 2 when no directory holds a ``devcheck.json`` or ``e2e.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _num(row: dict, key: str, fmt: str = "{:.2f}") -> str:
    v = row.get(key)
    return fmt.format(v) if isinstance(v, (int, float)) else "-"


def _ratio(row: dict, key: str) -> str:
    if isinstance(row.get(f"{key}_vs_bf16"), float):
        return f"{row[f'{key}_vs_bf16']:.2f}"
    if isinstance(row.get(key), float) and isinstance(row.get("bf16"), float):
        return f"{row['bf16'] / row[key]:.2f}"
    return "-"


def decode_table(rows: list[dict]) -> list[str]:
    """One linear at decode shapes: µs and ratios vs BF16 cuBLAS of the same row (``mma W4A4, one launch``:
    the GEMM that quantizes its own activations, ``act_quant=True``, timed where it fits)."""
    out = ["| M×N×K | BF16 µs | FP8 `_scaled_mm` | tinygemm INT4 | GemLite A16W4 | qpass Triton W4A16 | **qpass mma W4A16** "
           "| best 4-bit peer µs ÷ mma µs | **qpass mma W4A4** | mma W4A4, one launch | mma W4A4 + RAC 50 % | act quant µs "
           "| act quant + RAC 50 % µs | RAC ÷ plain act quant |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r or not isinstance(r.get("bf16"), float):
            continue
        peers = [r[k] for k in ("tinygemm_int4", "gemlite_a16w4") if isinstance(r.get(k), float)]
        peer = f"{min(peers) / r['mma_w4a16']:.2f}" if peers and isinstance(r.get("mma_w4a16"), float) else "-"
        aq, aqr = r.get("act_quant_only"), r.get("act_quant_rac50_only")
        rac = f"{aqr / aq:.2f}" if isinstance(aq, float) and isinstance(aqr, float) else "-"
        out.append(f"| {'×'.join(map(str, r['shape']))} | {r['bf16']:.1f} | {_ratio(r, 'fp8_scaled_mm')} | "
                   f"{_ratio(r, 'tinygemm_int4')} | {_ratio(r, 'gemlite_a16w4')} | {_ratio(r, 'triton_w4a16')} | "
                   f"**{_ratio(r, 'mma_w4a16')}** | {peer} | **{_ratio(r, 'mma_w4a4')}** | {_ratio(r, 'mma_w4a4_qx')} | "
                   f"{_ratio(r, 'mma_w4a4_rac50')} | "
                   f"{_num(r, 'act_quant_only', '{:.1f}')} | {_num(r, 'act_quant_rac50_only', '{:.1f}')} | {rac} |")
    return out


def prefill_table(rows: list[dict]) -> list[str]:
    out = ["| M×N×K | BF16 µs | FP8 | W4A16 cuBLAS cached | W4A4 cuBLAS cached | W4A4 + RAC 50 % | qpass Triton W4A4 "
           "| act quant µs | + RAC 50 % µs | B_W cache bytes |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r or not isinstance(r.get("bf16"), float):
            continue
        gib = f"{r['bw_cache_bytes'] / 2**30:.2f} GiB" if isinstance(r.get("bw_cache_bytes"), int) else "-"
        out.append(f"| {'×'.join(map(str, r['shape']))} | {r['bf16']:.0f} | {_ratio(r, 'fp8_scaled_mm')} | "
                   f"{_ratio(r, 'w4a16_cublas_cached')} | {_ratio(r, 'w4a4_cublas_cached')} | "
                   f"{_ratio(r, 'w4a4_rac50_masked_dense')} | {_ratio(r, 'triton_w4a4')} | {_num(r, 'act_quant', '{:.0f}')} | "
                   f"{_num(r, 'act_quant_rac50', '{:.0f}')} | {gib} |")
    return out


E2E_COLUMNS = (("quads_nvfp4", True), ("naive_nvfp4", True), ("w4a16_qat", True), ("fp8_block", False),
               ("quads_nvfp4", False), ("naive_nvfp4", False), ("w4a16_qat", False))


def e2e_table(rows: list[dict]) -> list[str]:
    """Decode step tokens/s ratio vs the bf16 recipe of the same model and batch."""
    head = " | ".join(f"{r} ({'cuda' if on else 'triton'})" for r, on in E2E_COLUMNS)
    out = [f"| model | B | bf16 step µs | {head} |", "|---|---|---|" + "---|" * len(E2E_COLUMNS)]
    groups: dict[tuple, dict] = {}
    for r in rows:
        if "recipe" not in r:
            continue
        groups.setdefault((r["model"], r["B"]), {})[(r["recipe"], r["cuda_route"])] = r
    for (model, b), g in groups.items():
        base = g.get(("bf16", False), {}).get("step_us")
        cells = []
        for key in E2E_COLUMNS:
            r = g.get(key)
            cells.append(f"{r['vs_bf16']:.2f}" if r and isinstance(r.get("vs_bf16"), float)
                         else ("skipped" if r and "skipped" in r else ("error" if r and "error" in r else "-")))
        out.append(f"| {model} | {b} | {base:.0f} | " if isinstance(base, float) else f"| {model} | {b} | - | ")
        out[-1] += " | ".join(cells) + " |"
    return out


def rollout_table(rows: list[dict]) -> list[str]:
    out = ["| recipe (kernels) | tokens/s | vs bf16 |", "|---|---|---|"]
    for r in rows:
        if "tokens_per_s" in r:
            out.append(f"| {r['recipe']} ({'cuda' if r.get('cuda_route') else 'triton'}) | {r['tokens_per_s']:.0f} | "
                       f"{r.get('vs_bf16', float('nan')):.2f} |")
    return out


def load(dirs: list[Path]) -> dict:
    """The sections of the runs in ``dirs``; raises FileNotFoundError when none holds a raw file."""
    rep: dict = {"e2e": []}
    found = False
    for d in dirs:
        if (d / "devcheck.json").is_file():
            found = True
            data = json.loads((d / "devcheck.json").read_text())
            for key in ("env", "timings", "prefill", "rollout_phase", "act_checks", "bound_checks", "exhaustive"):
                if key in data:
                    rep[key] = data[key]
            rep["e2e"] += data.get("e2e", [])
        if (d / "e2e.json").is_file():
            found = True
            rep["e2e"] += json.loads((d / "e2e.json").read_text())["rows"]
    if not found:
        raise FileNotFoundError(f"no devcheck.json or e2e.json in {', '.join(map(str, dirs))}")
    return rep


def render(rep: dict) -> str:
    parts = []
    if rep.get("timings"):
        parts += ["Decode, one linear, graph-replayed:", "", *decode_table(rep["timings"]), ""]
    if rep.get("prefill"):
        parts += ["Prefill:", "", *prefill_table(rep["prefill"]), ""]
    if rep.get("e2e"):
        parts += ["End-to-end decode step (CUDA graphs):", "", *e2e_table(rep["e2e"]), ""]
    if rep.get("rollout_phase"):
        parts += ["GRPO sample phase:", "", *rollout_table(rep["rollout_phase"]), ""]
    acts, bounds, exh = rep.get("act_checks", []), rep.get("bound_checks", []), rep.get("exhaustive", [])
    if acts or bounds or exh:
        parts.append(f"Correctness: operand mismatches {sum(e['mismatches'] for e in exh)}; bound checks "
                     f"{sum(c['ok'] for c in bounds)}/{len(bounds)}; activation checks {sum(c['ok'] for c in acts)}/{len(acts)}")
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qpass.apps.bench.cuda_tables", description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="directories holding devcheck.json and/or e2e.json")
    args = ap.parse_args(argv)
    try:
        rep = load(args.dirs)
    except (FileNotFoundError, json.JSONDecodeError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render(rep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
