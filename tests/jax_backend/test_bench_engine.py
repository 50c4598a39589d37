"""``benchmarks/bench_jax_engine.py --tiny`` runs on the CPU and emits every record with the
fields the H200 results are read by. No timing is asserted."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("call", "ids", "runtime", "path", "direction", "placement", "chunks", "page_bytes",
          "gbps", "frac_of_ceiling", "median_s")


def test_bench_jax_engine_tiny_emits_every_record(tmp_path):
    out = tmp_path / "engine.jsonl"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_jax_engine.py"), "--tiny",
         "--chunks", "2", "--repeats", "2", "--target-ms", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [json.loads(line) for line in done.stdout.splitlines()
                    if line.startswith("{")]
    records = [r for r in rows if r["call"] != "meta"]
    seen = {(r["call"], r["ids"], r["path"], r["chunks"]) for r in records}
    for chunks in (2,):
        assert ("jit", "device", "step", chunks) in seen and ("jit", "host", "step", chunks) in seen
        for call in ("store", "prepared"):
            for path in ("default", "donated"):
                assert (call, "host", path, chunks) in seen
    for r in records:
        assert all(f in r for f in FIELDS), r
        assert r["gbps"] > 0 and r["frac_of_ceiling"] > 0
    assert all(r["traces"] == 1 for r in records if r["call"] == "jit")  # no retrace
    assert all(r["compute"] == "flat" for r in records if r["call"] == "jit")


def test_weight_stream_and_mosaic_budget_options_are_recorded(tmp_path):
    # Subprocess: --mosaic-smem sets a module constant for the whole run.
    out = tmp_path / "engine.jsonl"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_jax_engine.py"), "--tiny",
         "--calls", "jit", "--chunks", "1", "--repeats", "2", "--target-ms", "2",
         "--weights-mib", "1", "--mosaic-smem", "32768", "--compute", "inplace",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    jit = [r for r in rows if r["call"] == "jit"]
    assert {r["ids"] for r in jit} == {"device", "host"}
    assert all(r["weights_mib"] == 1 and r["mosaic_smem_bytes"] == 32768 for r in jit)
    assert all(r["compute"] == "inplace" and r["timing"] == "paired" for r in jit)
    assert all(r["traces"] == 1 and r["step_without_transfer_s"] > 0 for r in jit)
    assert all(r["frac_of_per_call_ceiling"] == r["per_call_ceiling_s"] / r["median_s"]
               for r in jit)
