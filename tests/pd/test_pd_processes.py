"""Prefill and decode in separate processes over NIXL (UCX loopback): bit-exact loads of every
object group kind, tensor-parallel pairs over gloo ranks on each side, a partial pull, a
layer-streamed pull, and the failure cases (pd_worker.py runs each rank)."""

from __future__ import annotations

import pytest

from tests.support.pd_runs import run_pair, skip_without_nixl

pytest.importorskip("torch")
skip_without_nixl()

MODELS_11 = ("mha-nhd", "hybrid-full-sw-gqa2", "mla-indexer")
MODELS_TP = ("hybrid-full-sw-gqa2", "mla-indexer")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("pd")
    return {
        pair: run_pair(base / f"tp{pair[0]}to{pair[1]}", *pair)
        for pair in ((1, 1), (1, 2), (2, 1), (4, 2))
    }


@pytest.mark.parametrize("model", MODELS_11)
def test_one_to_one_loads_bit_exact_for_every_object_group_kind(runs, model):
    (result,) = runs[(1, 1)]["decode"]
    assert result[model]["exact"]


def test_one_descriptor_per_object_group_for_a_run_of_chunks(runs):
    (result,) = runs[(1, 1)]["decode"]
    # Consecutive entries on both sides: each object group's chunks move as one descriptor.
    assert result["mha-nhd"]["descriptors"] == 1
    assert result["hybrid-full-sw-gqa2"]["descriptors"] == 2  # full and sliding-window objects
    assert result["hybrid-full-sw-gqa2"]["chunks"] == [3, 1]  # the window needs its last chunk
    assert all(0 < result[m]["posted"] <= result[m]["descriptors"] for m in MODELS_11)


@pytest.mark.parametrize("model", MODELS_11)
def test_a_partial_pull_moves_only_the_chunks_the_reader_lacks(runs, model):
    (result,) = runs[(1, 1)]["decode"]
    entry = result[model]
    assert entry["partial_exact"]
    full_chunks = [c for c in entry["chunks"]]
    assert entry["partial_chunks"] == [min(c, 2) for c in full_chunks]
    assert entry["partial_bytes"] < entry["bytes"] or entry["chunks"] == [1]


@pytest.mark.parametrize("model", MODELS_11)
def test_layer_streamed_pull_starts_before_the_writer_finished(runs, model):
    (result,) = runs[(1, 1)]["decode"]
    entry = result[model]
    assert entry["stream_exact"]
    assert entry["stream_ready_seen"][0] < entry["stream_layers"]


@pytest.mark.parametrize("pair", [(1, 2), (2, 1), (4, 2)])
@pytest.mark.parametrize("model", MODELS_TP)
def test_heterogeneous_tp_pairs_load_each_ranks_heads_bit_exact(runs, pair, model):
    for rank, result in enumerate(runs[pair]["decode"]):
        assert result[model]["exact"], (pair, rank)
        assert result[model]["partial_exact"], (pair, rank)


def test_a_reader_of_lower_degree_reads_every_writer_it_needs(runs):
    ranks = [r["hybrid-full-sw-gqa2"]["src_ranks"] for r in runs[(4, 2)]["decode"]]
    assert ranks == [[0, 1], [2, 3]]
    (one,) = runs[(2, 1)]["decode"]
    assert one["hybrid-full-sw-gqa2"]["src_ranks"] == [0, 1]


def test_every_publication_is_released_by_all_its_readers(runs):
    for pair, result in runs.items():
        assert all(r["unreleased"] == [] for r in result["prefill"]), pair


@pytest.fixture(scope="module")
def failures(runs):
    return runs[(1, 1)]["decode"][0]["failures"]


def test_a_fingerprint_mismatch_is_refused_before_any_byte_moves(failures):
    entry = failures["mismatch"]
    assert entry["error"][0] == "FingerprintMismatchError"
    assert (
        "fingerprint" in entry["error"][1]
        and "chunk 128" in entry["error"][1]
        and "chunk 64" in entry["error"][1]
    )
    assert entry["descriptors"] == 0 and entry["untouched"]


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("released", "PublicationReleasedError"),
        ("timeout", "TransferTimeoutError"),
        ("gone", "PeerUnavailableError"),
    ],
)
def test_failed_pulls_raise_and_leave_the_caches_untouched(failures, case, error):
    entry = failures[case]
    assert entry["error"] is not None and entry["error"][0] == error, entry
    assert entry["untouched"]
    assert entry["seconds"] < 20  # nothing hangs
