"""Run coalescing (kvgroups_core.block_runs): runs of consecutive block ids at consecutive
items of one chunk, checked against a plain per-item walk on random, contiguous and
adversarial id sets, and through GroupTransfer.block_runs of real plans."""

import numpy as np
import pytest

from kvgroups_core import BlockRuns, KVLayerGroupsManager, block_runs, coalesce_runs
from kvgroups_core.errors import KVGroupsIndexError, KVGroupsTypeError, KVGroupsValueError
from kvgroups_core.formats.catalogue import EngineKVFormat as F
from kvgroups_core.transfer.planner import bind, plan_call


def walk(src, dst, breaks=None):
    """The runs by a per-pair loop: the definition, written the slow way."""
    runs = []
    for i, (a, b) in enumerate(zip(src, dst)):
        brk = breaks is not None and breaks[i]
        if runs and not brk and a == runs[-1][0] + runs[-1][2] and b == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([a, b, 1])
    return [tuple(r) for r in runs]


def as_list(runs: BlockRuns):
    return list(zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist()))


@pytest.mark.parametrize("seed", range(20))
def test_coalesce_matches_the_per_pair_walk_on_random_ids(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 60))
    # Mostly ascending stretches with jumps, as an allocator hands pages out.
    src = np.cumsum(rng.choice([1, 1, 1, 2, -5, 7], size=n)) + 100
    dst = np.arange(n) + rng.integers(0, 3, size=n).cumsum() * (rng.random(n) < 0.2)
    breaks = rng.random(n) < 0.1
    runs = coalesce_runs(src, dst, breaks)
    assert as_list(runs) == walk(src.tolist(), dst.tolist(), breaks.tolist())
    assert runs.total == n
    a, b = runs.pairs()
    np.testing.assert_array_equal(a, src)
    np.testing.assert_array_equal(b, dst)


def test_contiguous_ids_are_one_run_and_reversed_ids_are_all_single():
    assert as_list(coalesce_runs(np.arange(10, 26), np.arange(16))) == [(10, 0, 16)]
    runs = coalesce_runs(np.arange(16)[::-1], np.arange(16))
    assert runs.count == 16 and (runs.length == 1).all()
    empty = coalesce_runs([], [])
    assert empty.count == 0 and empty.total == 0


def test_mismatched_lengths_are_refused():
    with pytest.raises(KVGroupsValueError, match="dst: expected as many entries as src"):
        coalesce_runs([1, 2], [1])
    with pytest.raises(KVGroupsValueError, match="breaks: expected 2 entries"):
        coalesce_runs([1, 2], [1, 2], [True])


@pytest.mark.parametrize(
    "src, dst, breaks, error, text",
    [
        (None, [0, 1, 2], None, KVGroupsTypeError, "src: expected a 1-D sequence of ints"),
        ([2**70], [0], None, KVGroupsIndexError, "src: expected block ids that fit int64"),
        ([0, 1], [0, 1.5], None, KVGroupsTypeError, "dst: expected integer block ids"),
        ([0, 1], np.arange(2.0), None, KVGroupsTypeError, "dst: expected a 1-D sequence"),
        ([0, 1], [0, 1], "ab", KVGroupsTypeError, "breaks: expected a 1-D bool sequence"),
        ([0, 1], [0, 1], [0, 1], KVGroupsTypeError, "breaks: expected a 1-D bool sequence"),
    ],
)
def test_malformed_arguments_are_refused_by_name(src, dst, breaks, error, text):
    with pytest.raises(error) as info:
        coalesce_runs(src, dst, breaks)
    assert text in str(info.value)


def _plan(ids, direction="store", skip=0, window=None):
    nb, bs = 64, 4
    caches = [np.zeros((2, nb, bs, 2, 8), np.float16) for _ in range(2)]
    from kvgroups_core import EngineGroupInfo

    infos = [EngineGroupInfo(engine_group_id=0, layer_indices=(0, 1), sw_size_tokens=window or -1)]
    manager = KVLayerGroupsManager(
        caches, [F.NL_X_TWO_NB_BS_NH_HS] * 2, infos, lmcache_tokens_per_chunk=16
    )
    return plan_call(bind(manager, caches), np.asarray(ids), direction, skip_first_n_tokens=skip)


def test_group_runs_never_cross_a_chunk_and_cover_every_item():
    ids = np.arange(8, 20)  # 3 chunks of 4 blocks, all consecutive
    group = _plan(ids).groups[0]
    runs = group.block_runs()
    assert as_list(runs) == [(8, 0, 4), (12, 4, 4), (16, 8, 4)]
    chunk, pos, block = group.items()
    a, b = runs.pairs()
    np.testing.assert_array_equal(a, block)
    np.testing.assert_array_equal(b // group.kept_per_chunk, chunk)
    np.testing.assert_array_equal(b % group.kept_per_chunk, pos)


@pytest.mark.parametrize("seed", range(10))
def test_group_runs_of_random_ids_match_the_walk_with_chunk_breaks(seed):
    rng = np.random.default_rng(seed)
    ids = rng.permutation(64)[:12]
    ids[3:7] = np.arange(30, 34)  # one ascending stretch across a chunk boundary
    group = _plan(ids, "load", skip=5).groups[0]
    chunk, pos, block = group.items()
    item = chunk * group.kept_per_chunk + pos
    assert as_list(group.block_runs()) == walk(block.tolist(), item.tolist(), (pos == 0).tolist())
    assert group.block_runs().total == group.num_items


def test_windowed_groups_keep_only_the_last_blocks_of_each_chunk():
    group = _plan(np.arange(12), window=8).groups[0]  # 2 of 4 blocks kept per chunk
    assert group.kept_per_chunk == 2
    assert as_list(group.block_runs()) == [(2, 0, 2), (6, 2, 2), (10, 4, 2)]


def test_out_of_range_ids_are_dropped_and_end_their_run():
    group = _plan(np.arange(8)).groups[0]
    ids = np.array([4, 5, 99, 7, -1, 9, 10, 11])
    runs = block_runs(group, block_ids=ids, num_blocks=64)
    assert as_list(runs) == [(4, 0, 2), (7, 3, 1), (9, 5, 3)]


def test_ids_at_the_ends_of_int64_never_join_one_run():
    # int64's largest id plus one wraps to its smallest: two runs, not one.
    top, bottom = np.iinfo(np.int64).max, np.iinfo(np.int64).min
    for src, dst in (([top, bottom], [0, 1]), ([5, 6], [top, bottom])):
        runs = coalesce_runs(src, dst)
        assert runs.length.tolist() == [1, 1]
        assert runs.src.tolist() == src and runs.dst.tolist() == dst
