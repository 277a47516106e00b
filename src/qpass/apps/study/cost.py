"""Cost of residual activation compensation (RAC) for the QUADS study: analytic GEMM FLOPs and,
on CUDA, measured time of the rollout linear op.

FLOPs (multiply-adds counted as 2 FLOPs, per token, forward only), for a W4A4 linear ``[N, K]``
with RAC ratio ``r`` and ``k = floor(r K)`` selected channels (:meth:`qpass.quant.rac.RACConfig.num_channels`):

* main GEMM ``X_hat W_hat^T``: ``2 K N``;
* ``masked`` compensation ``R_hat W_hat^T`` over all K columns (zeros outside S): ``+ 2 K N``
  whenever ``k > 0`` (SPEC §2, Eq. 21 as written);
* ``gathered``: ``+ 2 K' N`` with ``K' = ceil16(k)`` (at least 16), the gathered columns. With
  ``selection: token`` every row has its own columns, which is no longer one dense GEMM: the
  figure is the ideal per-row gathered cost (the plain-torch reference scatters back and pays the
  dense ``2 K N``, reported as ``reference_extra``).

The quantization work (elements passed through the NVFP4 quantizer per token) is ``K`` for
``X``, plus ``K`` (masked) or ``K'`` (gathered) for the residual.

Timing (CUDA only): median microseconds of one eager ``torch.ops.qpass.nvfp4_linear`` call under
the study's kernel backend (Python dispatch and launch overhead included), timed with
:func:`qpass.apps.bench.triton_bench.time_fn` when that module imports (``do_bench`` median, L2 flushed), else with
CUDA events. On CPU no time is reported (FLOPs only).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from qpass.graph.sites import Site
from qpass.quant.rac import RACConfig, ceil16


def rac_extra_flops(k_in: int, n_out: int, ratio: float, mode: str, selection: str) -> dict[str, float]:
    """Extra GEMM FLOPs per token of RAC on one ``[N, K]`` linear.

    Returns:
        ``{"channels": k, "k_prime": K' or K (masked) or 0, "extra": ideal-kernel FLOPs,
        "reference_extra": what the plain-torch reference computes, "quantized_elems": residual
        elements quantized}``.
    """
    k = RACConfig(ratio, mode, selection).num_channels(k_in)
    if k == 0:
        return {"channels": 0, "k_prime": 0, "extra": 0.0, "reference_extra": 0.0, "quantized_elems": 0}
    if mode == "masked":
        f = 2.0 * k_in * n_out
        return {"channels": k, "k_prime": k_in, "extra": f, "reference_extra": f, "quantized_elems": k_in}
    kp = max(ceil16(k), 16)
    f = 2.0 * kp * n_out
    ref = f if selection != "token" else 2.0 * k_in * n_out
    return {"channels": k, "k_prime": kp, "extra": f, "reference_extra": ref, "quantized_elems": kp}


def rac_cost_table(
    all_sites: Iterable[Site],
    rac_sites: Sequence[str],
    ratios: Sequence[float],
    modes: Sequence[str],
    selections: Sequence[str],
) -> dict[str, Any]:
    """Per (ratio, mode, selection): extra FLOPs per token over the RAC sites, relative to the RAC
    sites' own main GEMMs and to every linear of the model (lm_head included).

    Args:
        all_sites: every linear site of the model (``Site.in_features``/``out_features``).
        rac_sites: ids of the sites RAC applies to.
    """
    sites = list(all_sites)
    by_id = {s.id: s for s in sites}
    missing = [s for s in rac_sites if s not in by_id]
    if missing:
        raise ValueError(f"rac_cost_table: unknown RAC sites {missing[:3]}")
    model_flops = sum(2.0 * s.in_features * s.out_features for s in sites)
    rac_main = sum(2.0 * by_id[s].in_features * by_id[s].out_features for s in rac_sites)
    rows = {}
    for ratio in ratios:
        for mode in modes:
            for sel in selections:
                parts = [rac_extra_flops(by_id[s].in_features, by_id[s].out_features, ratio, mode, sel) for s in rac_sites]
                extra = sum(p["extra"] for p in parts)
                ref = sum(p["reference_extra"] for p in parts)
                rows[config_key(ratio, mode, sel)] = {
                    "ratio": ratio, "mode": mode, "selection": sel, "extra_flops_per_token": extra,
                    "reference_extra_flops_per_token": ref,
                    "extra_vs_rac_sites": extra / rac_main if rac_main else 0.0,
                    "extra_vs_model": extra / model_flops if model_flops else 0.0,
                    "k_prime": parts[0]["k_prime"] if parts else 0,
                    "channels": parts[0]["channels"] if parts else 0,
                }
    return {"model_linear_flops_per_token": model_flops, "rac_sites_flops_per_token": rac_main,
            "rac_sites": len(rac_sites), "configs": rows}


def config_key(ratio: float, mode: str, selection: str) -> str:
    """``k12.5_masked_batch``-style key of one RAC configuration (ratio as a percentage)."""
    pct = ratio * 100.0
    txt = f"{pct:.1f}".rstrip("0").rstrip(".")
    return f"k{txt}_{mode}_{selection}"


def time_rac_linear(
    shapes: Sequence[tuple[int, int, int]],
    ratios: Sequence[float],
    modes: Sequence[str],
    selections: Sequence[str],
    *,
    kernels: str,
    device: str,
    seed: int = 0,
    deadline: float | None = None,
) -> dict[str, Any]:
    """Median time (us) of one ``qpass::nvfp4_linear`` W4A4(+RAC) call per shape and configuration.

    Args:
        shapes: ``(M, N, K)`` triples (M tokens per call).
        kernels: kernel backend (``reference`` or ``triton``) the op dispatches to.
        device: only ``cuda`` is timed; anything else returns ``{"available": False, ...}``.
        deadline: ``time.perf_counter()`` value after which remaining configurations are recorded
            as ``"skipped: time budget"``.
    Returns:
        ``{"available", "reason", "timer", "rows": {shape_key: {config_key: us, "plain": us}}}``;
        a configuration that raised is recorded as its error string.
    """
    if device != "cuda" or not torch.cuda.is_available():
        return {"available": False, "reason": "no CUDA device: FLOPs only", "rows": {}}
    from qpass import ops
    from qpass.quant.nvfp4 import nvfp4_quantize

    timer_name = "cuda events"
    try:
        from qpass.apps.bench.triton_bench import time_fn  # noqa: F401 - the project's timer when its deps import

        timer_name = "qpass.apps.bench.triton_bench.time_fn"
    except Exception:  # noqa: BLE001 - bench needs triton; fall back to events
        time_fn = None  # type: ignore[assignment]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows: dict[str, dict[str, Any]] = {}
    from qpass.apps.plugins import load_backends

    load_backends([kernels])  # the one registration path (core ops never import a backend)
    with ops.use_kernels(kernels):
        for m, n, k in shapes:
            w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
            scale = torch.exp(torch.randn(k, device="cuda", generator=gen) * 0.7)
            x = (torch.randn(m, k, device="cuda", generator=gen) * scale).to(torch.bfloat16)
            q = nvfp4_quantize(w)
            row: dict[str, Any] = {}
            configs = [("plain", 0.0, "masked", "batch")] + [
                (config_key(r, mo, se), r, mo, se) for r in ratios if r > 0 for mo in modes for se in selections]
            for key, r, mo, se in configs:
                def call(x=x, r=r, mo=mo, se=se):  # noqa: ANN001, ANN202
                    return torch.ops.qpass.nvfp4_linear(x, q.codes, q.scales, q.s_dec, None, "study", "nvfp4",
                                                        float(r), mo, se, None)
                if deadline is not None and time.perf_counter() > deadline:
                    row[key] = "skipped: time budget"
                    continue
                try:
                    row[key] = _time(call, time_fn)
                except Exception as exc:  # noqa: BLE001 - record and continue
                    row[key] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows[f"M{m}_N{n}_K{k}"] = row
    return {"available": True, "reason": "", "timer": timer_name, "kernels": kernels, "rows": rows}


def _time(call: Any, time_fn: Any) -> float:
    """Median us of ``call()``, eager (launch overhead included; the reference op syncs the host,
    so it cannot be graph-captured): ``qpass.apps.bench.triton_bench.time_fn`` or, if that cannot run (no triton),
    CUDA events over 20 calls."""
    if time_fn is not None:
        try:
            us, _mode = time_fn(lambda i: (), call, 0, graphs=False)
            return float(us)
        except ImportError:
            pass
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return float(statistics.median(times))
