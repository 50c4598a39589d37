"""``bench_torch_transfer.py --host-only-cpu`` keeps running without a GPU (it reaches into
the prepared path's internals to stub the launches, so it would rot silently otherwise)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_host_only_cpu_runs_the_cuda_path_with_stubbed_launches():
    # Its own process: the stubs replace module globals of cuda_path for good.
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_torch_transfer.py"), "--host-only-cpu",
         "--host-calls", "3"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    names = {r["name"] for r in rows}
    assert {"host_cost_cpu_stub_core_prepared_store",
            "host_cost_cpu_stub_core_prepared_load"} <= names
