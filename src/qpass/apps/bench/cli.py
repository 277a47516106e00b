"""``qpass bench``: the command line of the Triton kernel benchmark.

This module imports nothing but argparse and :mod:`qpass.apps.cliutil`, so ``qpass --help`` and the
CLI tree work without triton, and the benchmark gets the shared flags (``--threads``, ``-v``) like
every other subcommand. The implementation (:mod:`qpass.apps.bench.triton_bench`:
:class:`~qpass.apps.bench.triton_bench.BenchOptions`, :func:`~qpass.apps.bench.triton_bench.run`) is
imported only when the command runs: without triton that import raises
:class:`~qpass.errors.MissingDependencyError` (exit 2 with the install hint).

Not offered: ``--dtype`` (the kernels' operands are bf16 by contract; there is no model) and
``--force`` (the output is one JSON file, rewritten as results arrive so a killed run keeps them).
"""

from __future__ import annotations

import argparse


def build_bench_parser(prog: str = "qpass bench") -> argparse.ArgumentParser:
    """The ``qpass bench`` argument parser (shared flags from :mod:`qpass.apps.cliutil`)."""
    from qpass.apps.cliutil import DefaultsHelpFormatter, add_threads, add_verbose, nonneg_float, pos_float, seed_int

    ap = argparse.ArgumentParser(prog=prog, description="Triton kernel benchmarks: ratios against baselines timed in the same run",
                                 formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CPU interpreter, tiny shapes, correctness only (< 1 min)")
    ap.add_argument("--out", default=None, help="JSON output path (markdown goes beside it as .md; default: none, the table on stdout)")
    ap.add_argument("--budget-s", type=pos_float, default=300.0, help="wall-clock budget of the full benchmark, seconds")
    ap.add_argument("--seed", type=seed_int, default=0, help="torch seed of the --quick inputs (default: %(default)s)")
    ap.add_argument("--gemv-only", action="store_true",
                    help="only the decode M <= 4 grid (small-M GEMV vs the GEMM path, BF16, FP8, INT4 peers)")
    ap.add_argument("--e2e-only", action="store_true",
                    help="only the end-to-end decode step under CUDA graphs (SmolLM2-135M architecture and a 4-layer "
                         "Llama-8B-shaped stack, random weights; recipes bf16, w4a16_qat, naive_nvfp4, quads_nvfp4)")
    ap.add_argument("--e2e-budget-s", type=nonneg_float, default=150.0,
                    help="seconds of --budget-s reserved for the end-to-end section in the full run (default: %(default)s)")
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # full code path on CPU, toy sizes
    add_threads(ap)
    add_verbose(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry of ``qpass bench``. Returns the benchmark's status (0 ok, 1 a check/measurement failed,
    2 no CUDA device for the full run).

    Raises:
        MissingDependencyError: triton is not installed (the CLI prints the install hint, exit 2).
    """
    a = build_bench_parser().parse_args(argv)
    if a.out is not None:
        from qpass.atomic import check_output_file

        check_output_file(a.out, "--out")  # before the benchmark, not when its first result is written
    from qpass.apps.bench import triton_bench as bench  # needs triton: MissingDependencyError names the extra

    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    return bench.run(bench.BenchOptions(quick=a.quick, out=a.out, budget_s=a.budget_s, seed=a.seed, smoke=a.smoke,
                                        gemv_only=a.gemv_only, e2e_only=a.e2e_only, e2e_budget_s=a.e2e_budget_s))
