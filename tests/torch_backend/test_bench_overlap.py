"""``bench_overlap.py --tiny`` runs every section on the CPU through the public calls and
writes the records (and fields) the H200 run reports, so the GPU run cannot rot unseen."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CURVE = {
    "call",
    "path",
    "direction",
    "placement",
    "max_ctas",
    "compute",
    "median",
    "frac_of_ceiling",
    "compute_slowdown",
    "concurrent_frac_of_copy",
    "lost_compute_us_per_gib",
    "copy_ms",
    "bytes",
}


def test_tiny_cpu_run_writes_every_record_with_its_fields(tmp_path):
    out = tmp_path / "overlap.jsonl"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_overlap.py"),
            "--tiny",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert not [r for r in rows if "failed" in r], [r for r in rows if "failed" in r]
    assert {r["call"] for r in rows if r["call"].startswith("overlap_")} == {
        "overlap_setup",
        "overlap_interference",
        "overlap_step",
        "overlap_host_link",
        "overlap_default",
    }
    curve = [
        r for r in rows if "compute" in r and r.get("placement") == "device" and "skipped" not in r
    ]
    assert {(r["call"], r["path"]) for r in curve} == {
        ("prepared.store", "kernel"),
        ("prepared.load", "kernel"),
        ("copy_", "copy_"),
    }
    assert {r["max_ctas"] for r in curve if r["path"] == "kernel"} == {4, None}
    assert {r["compute"].split("_")[0] for r in curve} == {"gemm", "sdpa"}
    for row in curve:
        assert CURVE <= set(row), row
        assert row["median"] > 0 and row["compute_alone_ms"] > 0
    engine = [r for r in rows if r.get("path") == "copy_engine"]
    assert engine and all(r["skipped"] == "the copy engine needs a CUDA GPU" for r in engine)
    step = [r for r in rows if r["call"] == "LayerwiseLoad"]
    assert {r["placement"] for r in step} == {"device", "host"}
    for row in step:
        assert row["layers"] == 2 and row["overlap_over_compute"] > 0
        assert {"serial_over_compute", "load_alone_ms", "fits", "compute_ms"} <= set(row)
    both = [r for r in rows if r["call"] == "prepared.store+prepared.load"]
    assert len(both) == 1 and both[0]["sum_link_gbps"] > 0 and both[0]["frac_of_copies"] > 0
    beside = [
        r
        for r in rows
        if r["call"] == "prepared.store" and r.get("placement") == "host" and "skipped" not in r
    ]
    assert beside and all(r["compute_slowdown"] > 0 for r in beside)
    (default,) = [r for r in rows if r["call"] == "overlap_default"]
    assert {"max_ctas", "goal_met", "rule", "by_direction"} <= set(default)
