"""``CacheGuard.positions_of`` / ``same_entries_at``: what a call-memo hit checks of the cache
structure by identity (kvgroups_core/transfer/checks.py, call_memo.py)."""

import numpy as np

from kvgroups_core.tensors.descriptors import describe_numpy
from kvgroups_core.transfer.checks import CacheGuard


class _NoKeys:  # a backend without fingerprints: identity checks only
    pass


def _guard(structure, bound):
    tensors = [describe_numpy(x) for x in bound]
    return CacheGuard(_NoKeys(), structure, tensors)


def test_a_flat_list_is_checked_at_the_positions_holding_the_touched_tensors():
    caches = [np.zeros((2, 4)) for _ in range(6)]
    caches[5] = caches[2]  # one tensor in two entries (layers sharing a cache)
    guard = _guard(caches, caches[:5])
    positions = guard.positions_of([caches[2]])
    assert positions == (2, 5)
    now = list(caches)
    assert guard.same_entries_at(now, positions)
    now[0] = np.zeros((2, 4))  # an untouched entry replaced: not this call's concern
    assert guard.same_entries_at(now, positions)
    assert guard.positions_of(caches[:5]) is None  # every entry: the whole list
    assert not guard.same_entries_at(now, guard.positions_of(caches[:5]))
    now[5] = np.zeros((2, 4))  # a touched position replaced
    assert not guard.same_entries_at(now, positions)
    assert not guard.same_entries_at(list(caches) + [caches[0]], positions)  # longer
    assert not guard.same_entries_at(tuple(caches), positions)  # another container


def test_other_structures_and_no_tensors_are_checked_whole():
    layers = [np.zeros((2, 4)) for _ in range(3)]
    nested = [[layers[0], layers[1]], [layers[2]]]
    guard = _guard(nested, layers)
    assert guard.positions_of([layers[1]]) is None
    assert guard.same_entries_at([[layers[0], layers[1]], [layers[2]]], None)
    assert not guard.same_entries_at([[layers[0], np.zeros(1)], [layers[2]]], None)
    flat = _guard(layers, layers)
    assert flat.positions_of([]) is None  # nothing concrete touched: the whole list
    assert not flat.same_entries_at([layers[0], layers[1], np.zeros(1)], None)
