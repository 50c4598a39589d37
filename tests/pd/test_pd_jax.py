"""JAX caches between two processes over jax.experimental.transfer (pd_jax_worker.py):
bit-exact for every object group kind, a partial pull, TP pairs 2 -> 1 and 1 -> 2, and the
refusals (fingerprint mismatch, released publication) before anything moves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("kvgroups_jax")
try:
    pytest.importorskip("kvgroups_transport.jax_transfer").import_jax_transfer()
except ImportError as exc:  # TransportUnavailableError: a JAX without jax.experimental.transfer
    pytest.skip(str(exc), allow_module_level=True)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NAMES = ("mha-nhd", "hybrid-full-sw-gqa2", "mla-indexer")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pd-jax")
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
        PYTHONPATH=os.pathsep.join(
            [
                str(ROOT),
                str(ROOT / "backends"),
                str(ROOT / "tests" / "tp"),
                os.environ.get("PYTHONPATH", ""),
            ]
        ),
    )
    worker = str(HERE / "pd_jax_worker.py")
    procs = [
        subprocess.Popen(
            [sys.executable, worker, role, str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for role in ("writer", "reader")
    ]
    logs = []
    try:
        for p in procs[::-1]:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs[::-1], logs):
        assert p.returncode == 0, log[-4000:]
    return (
        json.loads((out / "reader.json").read_text()),
        json.loads((out / "writer.json").read_text()),
    )


@pytest.mark.parametrize("name", NAMES)
def test_jax_caches_load_bit_exact_over_jax_transfer(run, name):
    result, _ = run
    entry = result[name]
    assert entry[f"{name}-tp1"]["exact"]


@pytest.mark.parametrize("name", NAMES)
def test_a_partial_pull_moves_only_the_last_chunk(run, name):
    entry = run[0][name][f"{name}-partial"]
    assert entry["exact"]
    assert all(c == 1 for c in entry["chunks"])


@pytest.mark.parametrize("name", NAMES)
def test_tp_pairs_2_to_1_and_1_to_2(run, name):
    entry = run[0][name]
    assert entry[f"{name}-tp2"]["exact"] and entry[f"{name}-to2"]["exact"]


def test_one_array_per_chunk_and_object_group(run):
    entry = run[0]["hybrid-full-sw-gqa2"]["hybrid-full-sw-gqa2-tp1"]
    assert entry["chunks"] == [3, 1] and entry["descriptors"] == 4


def test_refusals_before_anything_moves_and_every_publication_released(run):
    result, writer = run
    assert result["refusals"] == {
        "mismatch": "FingerprintMismatchError",
        "released": "PublicationReleasedError",
    }
    assert writer["unreleased"] == []
