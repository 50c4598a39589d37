"""benchmarks/run_h200.sh in its tiny CPU configuration: two lanes, then a resumed run."""

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, **env):
    full = dict(os.environ, KVG_BENCH_MATRIX="tiny", OUT=str(tmp_path / "out"),
                KVG_BENCH_RESULTS=str(tmp_path / "results"), JAX_PLATFORMS="cpu",
                CUDA_VISIBLE_DEVICES="", **env)
    result = subprocess.run(["bash", "benchmarks/run_h200.sh"], cwd=ROOT, env=full,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in
               (tmp_path / "results" / "transfer_h200.jsonl").read_text().splitlines()]
    return result.stdout, records


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_two_lanes_then_a_resumed_run_measures_nothing_twice(tmp_path):
    _, first = _run(tmp_path, KVG_BENCH_GPUS="2")
    transfers = [r for r in first if r["record"] == "transfer"]
    installed = {n for n in ("torch", "jax") if importlib.util.find_spec(n)}
    assert {r["backend"] for r in transfers} == {"numpy"} | installed
    assert not [r for r in first if r["record"] == "error"]
    keys = sorted((r["backend"], r["shape"], r["layers"], r["chunks"], r["placement"],
                   r["path"], r["direction"], r["call"], r["ids"]) for r in transfers)
    assert len(keys) == len(set(keys))

    # Drop one record: the resumed run measures exactly that one again.
    lost = transfers[-1]
    path = tmp_path / "results" / "transfer_h200.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in first if r is not lost))
    _, second = _run(tmp_path, KVG_BENCH_APPEND="1")
    again = [r for r in second if r["record"] == "transfer"]
    keys2 = sorted((r["backend"], r["shape"], r["layers"], r["chunks"], r["placement"],
                    r["path"], r["direction"], r["call"], r["ids"]) for r in again)
    # A first run cut by its time budget (a loaded machine) leaves "time budget" records,
    # which the resumed run measures too: those, and nothing else, may be new.
    cut = sorted((r.get("backend"), r.get("shape"), r.get("layers"), r.get("chunks"),
                  r.get("placement"), r.get("path"), r.get("direction"), r.get("call"),
                  r.get("ids")) for r in first if r["record"] == "skipped"
                 and r.get("reason") in ("time budget", "script time allowance"))
    extra = [k for k in keys2 if k not in keys]
    assert [k for k in keys if k not in keys2] == []
    assert all(k in cut for k in extra), (extra, cut)
