"""The TP-native layout: every rank stores straight into one shared object (its part of each
region, heads outermost), and the result converts to and from the canonical objects."""

from __future__ import annotations

import numpy as np
import pytest

from kvgroups_core import (
    KVGroupsValueError,
    load,
    merge_shards,
    object_nbytes,
    object_regions,
    rank_byte_ranges,
    split_canonical,
    store,
)
from tests.support.tp_models import (
    MODELS,
    assert_same_bytes,
    block_ids,
    leaves,
    make_model_caches,
    manager,
    reference_load,
    reference_store,
    shard_caches,
    to_backend,
    to_numpy,
)

torch = pytest.importorskip("torch")

NATIVE = {"object_layout": "tp_native"}


def native_group(model, full, tp, backend="numpy"):
    shards = [to_backend(shard_caches(model, full, r, tp), backend) for r in range(tp)]
    return shards, [manager(model, shards[r], r, tp, **NATIVE) for r in range(tp)]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize(
    "model_name", ["mha-nhd", "hybrid-full-sw-gqa2", "mla-indexer", "sglang-kv-list"]
)
def test_ranks_store_into_one_shared_buffer_which_is_the_native_object(model_name, tp, backend):
    model = MODELS[model_name]
    rng = np.random.default_rng(tp)
    full = make_model_caches(model, rng)
    ids = block_ids(model, 3, rng)
    canonical = reference_store(model, full, ids)
    shards, managers = native_group(model, full, tp, backend)
    sizes = [object_nbytes(managers[0], og) for og in range(managers[0].num_object_groups)]
    assert sizes == [c.shape[1] for c in canonical]  # the whole model's bytes, permuted
    shared = to_backend([np.full((3, n), 0xEE, np.uint8) for n in sizes], backend)
    for r in range(tp):
        returned = store(managers[r], shards[r], ids, shared, backend=backend)
        assert all(x is y for x, y in zip(returned, shared))  # filled in place
    # Together the ranks wrote every byte: the shared buffer is the TP-native object.
    assert_same_bytes(shared, [to_numpy(x) for x in split_canonical(managers[0], canonical)])
    assert_same_bytes(merge_shards(managers, [shared] * tp), canonical)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_native_region_is_the_rank_objects_concatenated_heads_outermost(tp):
    model = MODELS["hybrid-full-sw-gqa2"]
    rng = np.random.default_rng(1)
    full = make_model_caches(model, rng)
    ids = block_ids(model, 2, rng)
    shards = [shard_caches(model, full, r, tp) for r in range(tp)]
    plain = [manager(model, shards[r], r, tp) for r in range(tp)]
    rank_objs = [store(plain[r], shards[r], ids, backend="numpy") for r in range(tp)]
    native = split_canonical(
        manager(model, shards[0], 0, tp, **NATIVE), reference_store(model, full, ids)
    )
    m0 = plain[0]
    for og in range(m0.num_object_groups):
        offset = 0
        for i, region in enumerate(object_regions(m0, og)):
            shard = m0.tp_shard(region.kernel_group_idx)
            owners = [shard.owner_of_part(p) for p in range(shard.num_parts)]
            parts = [
                rank_objs[r][og][:, object_regions(plain[r], og)[i].offset :][:, : region.nbytes]
                for r in owners
            ]
            width = region.nbytes * shard.num_parts
            assert np.array_equal(native[og][:, offset : offset + width], np.concatenate(parts, 1))
            offset += width
        assert offset == native[og].shape[1]
    # With more than one head set the native object is not the canonical one.
    assert not all(np.array_equal(a, b) for a, b in zip(native, reference_store(model, full, ids)))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_rank_byte_ranges_tile_the_native_object(tp):
    model = MODELS["hybrid-full-sw-gqa2"]
    full = make_model_caches(model, np.random.default_rng(0))
    _, managers = native_group(model, full, tp)
    for og in range(managers[0].num_object_groups):
        covered = np.zeros(object_nbytes(managers[0], og), np.int64)
        for m in managers:
            for (offset, nbytes), region in zip(rank_byte_ranges(m, og), object_regions(m, og)):
                if m.tp_shard(region.kernel_group_idx).is_owner:
                    covered[offset : offset + nbytes] += 1
        assert (covered == 1).all()  # the owners' ranges: disjoint, covering every byte


@pytest.mark.parametrize("store_tp,load_tp", [(2, 4), (8, 2), (1, 4)])
def test_native_store_at_one_degree_loads_at_another(store_tp, load_tp):
    model = MODELS["hybrid-full-sw-gqa2"]
    rng = np.random.default_rng(5)
    full = make_model_caches(model, rng)
    engine_before = make_model_caches(model, rng)
    ids = block_ids(model, 3, rng)
    shards, managers = native_group(model, full, store_tp)
    shared = [
        np.zeros((3, object_nbytes(managers[0], og)), np.uint8)
        for og in range(managers[0].num_object_groups)
    ]
    for m, caches in zip(managers, shards):
        store(m, caches, ids, shared, backend="numpy")
    canonical = merge_shards(managers, [shared] * store_tp)
    want_full = reference_load(model, canonical, engine_before, ids)
    loaders = [
        manager(model, shard_caches(model, engine_before, r, load_tp), r, load_tp, **NATIVE)
        for r in range(load_tp)
    ]
    native = split_canonical(loaders[0], canonical)  # one conversion for every loading rank
    for r, m in enumerate(loaders):
        caches = shard_caches(model, engine_before, r, load_tp)
        load(m, native, caches, ids, backend="numpy")
        assert_same_bytes(leaves(caches), leaves(shard_caches(model, want_full, r, load_tp)))


def test_native_and_canonical_are_the_same_bytes_at_tp1():
    model = MODELS["hybrid-full-sw-gqa2"]
    rng = np.random.default_rng(2)
    full = make_model_caches(model, rng)
    ids = block_ids(model, 2, rng)
    objs = store(manager(model, full, **NATIVE), full, ids, backend="numpy")
    assert_same_bytes(objs, reference_store(model, full, ids))


def test_rank_byte_ranges_need_the_native_layout():
    model = MODELS["mha-nhd"]
    m = manager(model, make_model_caches(model, np.random.default_rng(0)))
    with pytest.raises(KVGroupsValueError, match="tp_native"):
        rank_byte_ranges(m, 0)
