"""``benchmarks/bench_oneshot_host.py`` keeps running (it stubs the runtimes' copies, which
would rot silently otherwise). No timing is asserted."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_oneshot_host_emits_every_row(tmp_path):
    runtimes = ["numpy"] + [name for name, module in (("torch", "torch"), ("jax", "jax"))
                            if importlib.util.find_spec(module) is not None]
    out = tmp_path / "oneshot.jsonl"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_oneshot_host.py"), "--layers", "2",
         "--calls", "3", "--warmup", "1", "--runtimes", ",".join(runtimes), "--label", "t",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert rows == [json.loads(line) for line in out.read_text().splitlines()]
    names = {(r["runtime"], r["name"]) for r in rows}
    for runtime in runtimes:
        for call in ("store", "store_objects", "load"):
            for suffix in ("", "_python"):
                for kind in ("prepared", "oneshot"):
                    assert (runtime, f"{kind}_{call}{suffix}") in names
                assert (runtime, f"oneshot_minus_prepared_{call}{suffix}") in names
    assert all(r["us_median"] > 0 for r in rows if "us_median" in r)
    assert all(r["label"] == "t" for r in rows)
