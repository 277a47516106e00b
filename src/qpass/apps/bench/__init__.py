"""Benchmarks and device checks of the kernel backends: tooling, not product (``qpass bench``).

One concept per module:

* :mod:`.cli`: the ``qpass bench`` command line (argparse only; imports without triton);
* :mod:`.triton_bench`: the Triton kernel benchmark behind ``qpass bench`` (ratios against baselines
  timed in the same run);
* :mod:`.e2e`: the benchmark's end-to-end decode step under CUDA graphs;
* :mod:`.peers`: the 4-bit peers it times (tinygemm INT4, GemLite) and their INT4 g128 quantization;
* :mod:`.triton_selfcheck`: large-shape correctness of the Triton kernels
  (``python -m qpass.apps.bench.triton_selfcheck``);
* :mod:`.moe_check`: the grouped-experts GEMM's checks and timing (``python -m qpass.apps.bench.moe_check``);
* :mod:`.aot`: compile every kernel variant for sm_90 and report registers / spills
  (``python -m qpass.apps.bench.aot``).

The old paths ``qpass.backends.triton.{bench,bench_e2e,peers,selfcheck,moe_check,aot}`` are
deprecated aliases of these modules (``python -m`` on them still runs); the import map forbids new
imports of them. Everything here except :mod:`.cli` needs triton.
"""

from qpass.apps.bench.cli import build_bench_parser, main

__all__ = ["build_bench_parser", "main"]
