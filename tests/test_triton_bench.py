"""``qpass bench``: the CPU modes run end to end and write their JSON + markdown atomically."""

from __future__ import annotations

import json

from qpass.backends.triton import bench


def test_bench_quick_cpu(tmp_path):
    out = tmp_path / "b" / "bench.json"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["rows"] and all(r["mode"] == "pass" for r in data["rows"]), data["errors"]
    assert out.with_suffix(".md").read_text().startswith("# qpass kernel benchmark")
    assert not list(out.parent.glob(".*.tmp"))  # no temp files left behind


def test_bench_full_code_path_smoke_cpu(tmp_path):
    """The full-benchmark code path (sections, contenders, ratios, targets) at toy sizes on CPU."""
    out = tmp_path / "smoke.json"
    assert bench.main(["--smoke", "--out", str(out), "--budget-s", "120"]) == 0
    data = json.loads(out.read_text())
    names = {r["name"] for r in data["rows"]}
    assert {"bf16 cuBLAS", "w4a16 triton", "w4a4 triton", "w4a4+RAC50 gathered/batch triton",
            "act quant + RAC 50% gathered/batch"} <= names
    assert not data["errors"], data["errors"]
    assert any(t["name"].startswith("RAC overhead") for t in data["targets"])
    rows = [r for r in data["rows"] if r["name"] == "w4a4 triton" and r["vs_bf16"] is not None]
    assert rows and all(r["time_us"] > 0 for r in rows)
