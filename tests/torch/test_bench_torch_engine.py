"""``bench_torch_engine.py --tiny`` runs on the CPU through the public calls and writes the
record fields the H200 run reports (so the GPU run cannot rot unseen)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"call", "ids", "runtime", "path", "direction", "placement", "chunks", "page_bytes",
          "gbps", "frac_of_ceiling", "median"}


def test_tiny_cpu_run_writes_every_call_kind_with_its_fields(tmp_path):
    out = tmp_path / "engine.jsonl"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_torch_engine.py"), "--tiny",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    every = [json.loads(line) for line in out.read_text().splitlines()]
    # The path sweep: the kernel measured, the copy engine recorded as skipped on the CPU.
    sweep = [r for r in every if r.get("path") in ("kernel", "copy_engine")]
    assert {r["path"] for r in sweep} == {"kernel", "copy_engine"}
    assert all(r["skipped"] == "the copy engine needs a CUDA GPU" for r in sweep
               if r["path"] == "copy_engine")
    kernel = [r for r in sweep if r["path"] == "kernel"]
    assert {r["page_bytes"] for r in kernel} == {1024, 4096}
    assert all(r["sms_used"] == 0 and r["placement"] == "device" for r in kernel)
    rows = [r for r in every if "skipped" not in r]
    assert {r["call"] for r in rows} == {"prepared", "store", "load", "layerwise", "compile"}
    for row in rows:
        assert FIELDS <= set(row), row
        assert row["gbps"] > 0 and row["median"] > 0 and row["frac_of_ceiling"] > 0
    assert {(r["ids"], r["direction"]) for r in rows if r["call"] == "prepared"} == {
        ("host", "store"), ("host", "load"), ("device", "store"), ("device", "load")}
    layerwise = [r for r in rows if r["call"] == "layerwise"]
    assert all(r["calls_per_step"] == 2 and r["frac_of_whole"] > 0 for r in layerwise)
    # Recurrent state beside attention: a store moves every chunk's snapshot, a load only
    # the last one (the request's state slot), whatever the chunk count.
    state = [r for r in rows if r.get("layers") == "state"]
    assert {(r["ids"], r["direction"], r["chunks"]) for r in state} == {
        (i, d, c) for i in ("host", "device") for d in ("store", "load") for c in (1, 2)}
    one = {r["direction"]: r["bytes"] for r in state if r["chunks"] == 1}
    for r in state:
        assert r["bytes"] == one[r["direction"]] * (r["chunks"] if r["direction"] == "store"
                                                     else 1)
    assert {r["layers"] for r in rows if r.get("model") == "qwen3-next-like"} == {
        "state", "attention", "all"}
