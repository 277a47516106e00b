"""The BENCHMARKS.md CUDA tables are generated from the raw devcheck files (qpass.apps.bench.cuda_tables)."""

from __future__ import annotations

from pathlib import Path

from qpass.apps.bench import cuda_tables as dt

RUN2 = Path(__file__).resolve().parents[1] / "docs" / "results" / "cuda_kernels" / "run2_h100"


def test_tables_of_the_h100_run_reproduce_its_published_rows():
    text = dt.render(dt.load([RUN2]))
    # the rows BENCHMARKS.md printed for this run (decode 1x4096x4096, prefill 4096^3, SmolLM2 B = 1)
    assert "| 1×4096×4096 | 23.2 | 1.64 | 2.08 | 1.71 | 1.45 | **1.98** | 0.95 | **1.51** | - | 0.26 | 6.8 | 79.0 | 11.59 |" in text
    assert "| 4096×4096×4096 | 176 | 1.81 | 0.68 | 0.53 | 0.29 | 0.23 | 80 | 162 | 2.58 GiB |" in text
    assert "| SmolLM2-135M architecture, random weights | 1 | 3274 | 0.66 | 0.89 | 1.01 | 0.55 | 0.37 | 0.80 | 1.06 |" in text
    assert "| quads_nvfp4 (cuda) | 6562 | 0.55 |" in text
    assert "Correctness: operand mismatches 0; bound checks 19/19; activation checks 69/69" in text


def test_a_directory_without_raw_files_is_exit_2(tmp_path, capsys):
    assert dt.main([str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err
