"""``benchmarks/bench_jax_host.py`` keeps running (it reaches into the executor's internals for
its dispatch floor and stubs, so it would rot silently otherwise). No timing is asserted."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_jax_host_emits_every_row(tmp_path):
    out = tmp_path / "host.jsonl"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_jax_host.py"), "--layers", "2",
         "--chunks", "1,2", "--calls", "3", "--warmup", "1", "--lowering", "xla",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert rows == [json.loads(line) for line in out.read_text().splitlines()]
    names = {(r["name"], r.get("chunks")) for r in rows}
    for chunks in (1, 2):
        for d in ("store", "load"):
            for name in ("execute_plan", "backend_execute", "prepared"):
                assert (f"{name}_{d}", chunks) in names and (f"{name}_{d}_python", chunks) in names
            assert (f"dispatch_floor_{d}", chunks) in names
    assert all(r["us_median"] > 0 for r in rows if r["name"] != "meta")
