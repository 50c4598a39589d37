"""The connector's scheduler-side index: chained chunk hashes, LRU entries, protected loads."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")  # kvgroups_torch.vllm

from kvgroups_torch.vllm.prefix_index import ChunkIndex, chunk_hashes, consecutive_runs  # noqa: E402

from kvgroups_core import AttnWindowDesc  # noqa: E402


def test_hashes_cover_whole_chunks_and_chain_the_prefix():
    a = chunk_hashes(list(range(600)), 256)
    assert len(a) == 2  # the 88-token tail is no chunk
    b = chunk_hashes(list(range(256)) + [9] * 256, 256)
    assert a[0] == b[0] and a[1] != b[1]
    c = chunk_hashes([1] + list(range(1, 512)), 256)
    assert c[0] != a[0] and c[1] != a[1]  # chunk 1 alike, but its prefix differs
    assert chunk_hashes(list(range(512)), 256, b"salt") != chunk_hashes(list(range(512)), 256)


def test_lookup_has_no_side_effect_and_lru_evicts_the_oldest_unprotected():
    idx = ChunkIndex(3)
    hs = [bytes([i]) * 16 for i in range(5)]
    for h, s in zip(hs[:3], idx.allocate(3)):
        idx.insert(h, s)
    assert idx.lookup(hs[:3]) == [0, 1, 2]
    idx.lookup([hs[0]])  # no recency change
    idx.touch([0])  # chunk 0 used: chunk 1 is now the oldest
    (s,) = idx.allocate(1, protected={1})  # chunk 1 protected (a load reads it): evict chunk 2
    assert s == 2 and hs[2] not in idx and hs[1] in idx
    idx.insert(hs[3], s)
    assert idx.allocate(1, protected={0, 1, 2}) == []  # nothing evictable: the save is dropped
    assert idx.evictions == 1


def test_allocation_evicts_oldest_first_and_takes_consecutive_entries_where_it_can():
    idx = ChunkIndex(6)
    h = [bytes([i]) * 16 for i in range(7)]
    assert idx.allocate(2) == [0, 1] and idx.allocate(3) == [2, 3, 4]
    for i in range(5):
        idx.insert(h[i], i)
    assert idx.allocate(2) == [0, 5]  # one free entry: the oldest chunk (0) makes room
    idx.insert(h[5], 0)
    idx.insert(h[6], 5)
    idx.touch([1, 2])  # oldest first now: entries 3, 4, 0, 5, 1, 2
    assert idx.allocate(2) == [3, 4] and idx.evictions == 3
    assert h[3] not in idx and h[4] not in idx and h[1] in idx and h[5] in idx
    assert consecutive_runs([4, 5, 6, 1, 2]) == [(0, 4, 3), (3, 1, 2)]


def test_presence_feeds_the_window_rule():
    idx = ChunkIndex(4)
    hs = [bytes([i]) * 16 for i in range(3)]
    for h, s in zip(hs, idx.allocate(3)):
        idx.insert(h, s)
    present = idx.present(hs + [b"x" * 16], 2)
    assert present.shape == (4, 2) and present[:3].all() and not present[3].any()
    assert AttnWindowDesc([-1, 1]).hit_chunks(present) == 3
    assert AttnWindowDesc([-1, 1]).hit_chunks(np.zeros((2, 2), bool)) == 0


def test_bad_capacity_is_a_typed_error():
    with pytest.raises(ValueError, match="capacity_chunks"):
        ChunkIndex(0)


def test_a_chunk_cached_without_its_state_snapshot_is_a_miss_at_its_length():
    # LMCache #2863: attention hits reported without the recurrent state garbled outputs.
    idx = ChunkIndex(8)
    hs = [bytes([i]) * 16 for i in range(4)]
    state = 0  # object groups: 0 the snapshots (window 1), 1 attention (full)
    desc = AttnWindowDesc([1, -1])
    for c, (h, s) in enumerate(zip(hs, idx.allocate(4))):
        idx.insert(h, s, absent=() if c in (1, 3) else (state,))
    present = idx.present(hs, 2)
    assert present.tolist() == [[False, True], [True, True], [False, True], [True, True]]
    assert desc.hit_chunks(present) == 4
    assert desc.hit_chunks(idx.present(hs[:3], 2)) == 2  # attention for 3 chunks, state for 2
    assert desc.hit_chunks(idx.present(hs[:1], 2)) == 0
    idx.mark_present(idx.lookup([hs[2]])[0], [state])  # a later request had the snapshot
    assert desc.hit_chunks(idx.present(hs[:3], 2)) == 3
    assert idx.absent(idx.lookup([hs[0]])[0]) == {state}


def test_evicting_an_entry_forgets_what_it_lacked():
    idx = ChunkIndex(1)
    (s,) = idx.allocate(1)
    idx.insert(b"a" * 16, s, absent=(0,))
    (t,) = idx.allocate(1)  # evicts chunk "a"
    idx.insert(b"b" * 16, t)
    assert t == s and idx.absent(t) == frozenset()
    assert idx.present([b"b" * 16], 2).tolist() == [[True, True]]
