"""Window and prefix skips: which blocks a load writes, and what a store keeps per chunk."""

import numpy as np
import pytest

from kvgroups_conformance.caches import all_blocks, expected_object, make_caches, token_rows
from kvgroups_conformance.compare import assert_blocks_match, assert_objects_match
from kvgroups_core.formats.catalogue import EngineKVFormat as F
from kvgroups_core.grouping.engine_groups import EngineGroupInfo
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_core.transfer.objects import object_nbytes

CHUNK, BS, NB, CHUNKS = 256, 32, 40, 4
BPC = CHUNK // BS


def _setup(harness, separate, window=64, full_sw=False):
    rng = np.random.default_rng(3)
    geometry = dict(nl=2, nb=NB, bs=BS, nh=1, hs=8, dtype="float16")
    src_np, formats = make_caches(F.NL_X_TWO_NB_BS_NH_HS, rng=rng, **geometry)
    dst_np, _ = make_caches(F.NL_X_TWO_NB_BS_NH_HS, rng=rng, zero=True, **geometry)
    infos = (
        EngineGroupInfo(engine_group_id=0, layer_indices=(0,)),
        EngineGroupInfo(engine_group_id=1, layer_indices=(1,), sw_size_tokens=window),
    )
    manager = KVLayerGroupsManager(
        src_np, formats, infos, lmcache_tokens_per_chunk=CHUNK, separate_object_groups=separate
    )
    if full_sw:
        manager.enable_full_sw_kv()
    ids = {0: rng.permutation(NB)[: CHUNKS * BPC], 1: rng.permutation(NB)[: CHUNKS * BPC]}
    return manager, formats, src_np, dst_np, ids


def _load_and_check(harness, manager, formats, src_np, dst_np, ids, expect, skip=0):
    """Store every chunk, load it back with ``skip`` and check the destination: for each
    layer, exactly the blocks at positions ``expect[layer]`` of its id list were written."""
    src, dst = harness.convert(src_np), harness.convert(dst_np)
    objects = harness.store(manager, src, [ids[0], ids[1]])
    dst = harness.load(manager, objects, dst, [ids[0], ids[1]], skip=skip)
    source = all_blocks(src_np, formats)
    want = dict(all_blocks(dst_np, formats))
    for layer, positions in expect.items():
        for i in positions:
            b = int(ids[layer][i])
            for kv in (0, 1):
                want[(layer, kv, b)] = source[(layer, kv, b)]
    assert_blocks_match(
        harness.read(dst, dst_np),
        formats,
        want,
        what=f"load with skip_first_n_tokens={skip}",
        source=source,
        expected_source={int(b): int(b) for layer in expect for b in ids[layer]},
    )
    return objects


def test_mixed_object_group_load_skips_chunks_outside_the_window(harness):
    manager, formats, src_np, dst_np, ids = _setup(harness, separate=False)
    assert manager.num_object_groups == 1
    # Full attention: all 4 chunks; a window of 64 tokens: the last 2 blocks of chunk 3.
    _load_and_check(harness, manager, formats, src_np, dst_np, ids, {0: range(32), 1: [30, 31]})


def test_prefix_skip_writes_the_partial_block_and_later_chunks(harness):
    manager, formats, src_np, dst_np, ids = _setup(harness, separate=False)
    # The last block (index 7) of chunk 2, then chunk 3.
    _load_and_check(
        harness,
        manager,
        formats,
        src_np,
        dst_np,
        ids,
        {0: [23] + list(range(24, 32)), 1: [30, 31]},
        skip=736,
    )


def test_store_writes_every_chunk_of_every_group(harness):
    manager, formats, src_np, dst_np, ids = _setup(harness, separate=False)
    src = harness.convert(src_np)
    objects = harness.store(manager, src, [ids[0], ids[1]])
    got = harness.to_numpy(objects[0], np.zeros(0, np.uint8))
    assert got.shape == (CHUNKS, object_nbytes(manager, 0))
    want = np.stack(
        [
            expected_object(
                manager, src_np, 0, {g: ids[g][c * BPC : (c + 1) * BPC] for g in (0, 1)}
            )
            for c in range(CHUNKS)
        ]
    )
    assert_objects_match(
        got,
        want,
        manager,
        0,
        what="store: object bytes",
        ids=ids,
        source_caches=src_np,
        formats=formats,
    )


def test_full_sw_mode_turns_window_skips_off(harness):
    manager, formats, src_np, dst_np, ids = _setup(harness, separate=False, full_sw=True)
    _load_and_check(harness, manager, formats, src_np, dst_np, ids, {0: range(32), 1: range(32)})


def test_separated_window_object_group_loads_only_the_last_chunk(harness):
    manager, formats, src_np, dst_np, ids = _setup(harness, separate=True, window=CHUNK)
    assert [og.sw_size_chunks for og in manager.object_groups] == [-1, 1]
    _load_and_check(
        harness, manager, formats, src_np, dst_np, ids, {0: range(32), 1: range(24, 32)}
    )


def test_sub_chunk_window_keeps_the_last_blocks_of_each_chunk(harness):
    rng = np.random.default_rng(5)
    src_np, formats = make_caches(
        F.NL_X_TWO_NB_BS_NH_HS, nl=1, nb=20, bs=32, nh=1, hs=8, dtype="float16", rng=rng
    )
    infos = (EngineGroupInfo(engine_group_id=0, layer_indices=(0,), sw_size_tokens=64),)
    manager = KVLayerGroupsManager(src_np, formats, infos, lmcache_tokens_per_chunk=128)
    objects = harness.store(manager, harness.convert(src_np), list(range(11, 19)))
    got = harness.to_numpy(objects[0], np.zeros(0, np.uint8))
    assert got.shape[0] == 2
    want = np.stack(
        [
            np.concatenate(
                [
                    token_rows(src_np, formats[0], 0, kv, b).reshape(-1)
                    for kv in (0, 1)
                    for b in kept
                ]
            )
            for kept in ((13, 14), (17, 18))
        ]
    )
    assert_objects_match(
        got,
        want,
        manager,
        0,
        what="store of a sub-chunk window: object bytes",
        ids={0: np.arange(11, 19)},
        source_caches=src_np,
        formats=formats,
    )


@pytest.mark.parametrize("skip", [0, 31, 32, 255, 256, 300, 1024])
def test_prefix_skip_never_writes_skipped_whole_blocks(harness, skip):
    manager, formats, src_np, dst_np, ids = _setup(harness, separate=False)
    _load_and_check(
        harness,
        manager,
        formats,
        src_np,
        dst_np,
        ids,
        {0: range(skip // BS, 32), 1: [30, 31] if skip < 960 else []},
        skip=skip,
    )
