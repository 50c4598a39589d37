"""Prefill and decode processes on one GPU over NIXL: caches, pools and staging in device
memory (NIXL ``VRAM``, UCX's CUDA transports), bit-exact for every object group kind, a
partial and a layer-streamed pull, the failure cases, and a 2 -> 1 tensor-parallel pair."""

from __future__ import annotations

import pytest

from tests.support.pd_runs import run_pair, skip_without_nixl

torch = pytest.importorskip("torch")
skip_without_nixl()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MODELS = ("mha-nhd", "hybrid-full-sw-gqa2", "mla-indexer")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("pd-gpu")
    return {
        pair: run_pair(base / f"tp{pair[0]}to{pair[1]}", *pair, device="cuda")
        for pair in ((1, 1), (2, 1))
    }


@pytest.mark.parametrize("model", MODELS)
def test_device_memory_moves_bit_exact_between_two_processes(runs, model):
    (result,) = runs[(1, 1)]["decode"]
    entry = result[model]
    assert entry["exact"] and entry["partial_exact"] and entry["stream_exact"]


def test_failures_on_the_gpu_leave_the_caches_untouched(runs):
    (result,) = runs[(1, 1)]["decode"]
    failures = result["failures"]
    assert failures["mismatch"]["error"][0] == "FingerprintMismatchError"
    assert failures["released"]["error"][0] == "PublicationReleasedError"
    assert failures["timeout"]["error"][0] == "TransferTimeoutError"
    assert failures["gone"]["error"][0] == "PeerUnavailableError"
    assert all(f["untouched"] for f in failures.values())


@pytest.mark.parametrize("model", ("hybrid-full-sw-gqa2", "mla-indexer"))
def test_two_gpu_writer_ranks_to_one_reader(runs, model):
    (result,) = runs[(2, 1)]["decode"]
    assert result[model]["exact"] and result[model]["partial_exact"]
