"""Stores of rank shards merge into the TP=1 objects of the whole model, and the split of
canonical objects loads into a rank of any degree exactly what a TP=1 load gives its heads."""

from __future__ import annotations

import numpy as np
import pytest

from kvgroups_core import load, merge_shards, split_canonical, store
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

BACKENDS = ["numpy", "torch"]
NUM_CHUNKS = 3


def rank_objects(model, full, ids, tp, backend, **kw):
    shards = [to_backend(shard_caches(model, full, r, tp), backend) for r in range(tp)]
    managers = [manager(model, shards[r], r, tp, **kw) for r in range(tp)]
    objects = [store(managers[r], shards[r], ids, backend=backend) for r in range(tp)]
    return managers, objects


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_rank_stores_merge_to_the_tp1_store_of_the_whole_cache(model_name, tp, backend):
    model = MODELS[model_name]
    rng = np.random.default_rng(tp)
    full = make_model_caches(model, rng)
    ids = block_ids(model, NUM_CHUNKS, rng)
    canonical = reference_store(model, full, ids)
    managers, objects = rank_objects(model, full, ids, tp, backend)
    merged = merge_shards(managers, objects)
    assert all(type(m) is type(o) for m, o in zip(merged, objects[0]))
    assert_same_bytes(merged, canonical)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("store_tp,load_tp", [(2, 4), (4, 1), (1, 8), (8, 2), (4, 4)])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_store_at_one_degree_load_at_another_matches_a_tp1_load(
    model_name, store_tp, load_tp, backend
):
    model = MODELS[model_name]
    rng = np.random.default_rng(store_tp * 10 + load_tp)
    full = make_model_caches(model, rng)
    engine_before = make_model_caches(model, rng)  # what the loading engine holds already
    ids = block_ids(model, NUM_CHUNKS, rng)
    managers, objects = rank_objects(model, full, ids, store_tp, backend)
    merged = merge_shards(managers, objects)
    assert_same_bytes(merged, reference_store(model, full, ids))
    want_full = reference_load(model, [to_numpy(o) for o in merged], engine_before, ids)
    for r in range(load_tp):
        caches = to_backend(shard_caches(model, engine_before, r, load_tp), backend)
        mine = manager(model, caches, r, load_tp)
        out = load(mine, split_canonical(mine, merged), caches, ids, backend=backend)
        # Every block of the rank's heads: the loaded ones and the untouched ones.
        assert_same_bytes(leaves(out), leaves(shard_caches(model, want_full, r, load_tp)))


@pytest.mark.parametrize("skip", [16, 80])
def test_load_of_a_split_honours_the_prefix_skip_like_a_tp1_load(skip):
    model = MODELS["hybrid-full-sw-gqa2"]
    rng = np.random.default_rng(7)
    full = make_model_caches(model, rng)
    engine_before = make_model_caches(model, rng)
    ids = block_ids(model, NUM_CHUNKS, rng)
    canonical = reference_store(model, full, ids)
    want_full = reference_load(model, canonical, engine_before, ids, skip=skip)
    for r in range(4):
        caches = shard_caches(model, engine_before, r, 4)
        mine = manager(model, caches, r, 4)
        out = load(
            mine,
            split_canonical(mine, canonical),
            caches,
            ids,
            skip_first_n_tokens=skip,
            backend="numpy",
        )
        assert_same_bytes(leaves(out), leaves(shard_caches(model, want_full, r, 4)))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_split_then_merge_gives_back_the_canonical_objects(tp):
    model = MODELS["hybrid-full-sw-gqa2"]
    rng = np.random.default_rng(3)
    full = make_model_caches(model, rng)
    canonical = reference_store(model, full, block_ids(model, NUM_CHUNKS, rng))
    managers = [manager(model, shard_caches(model, full, r, tp), r, tp) for r in range(tp)]
    parts = [split_canonical(m, canonical) for m in managers]
    assert_same_bytes(merge_shards(managers, parts), canonical)


def test_results_are_new_arrays_even_when_nothing_moves():
    model = MODELS["mla-indexer"]
    rng = np.random.default_rng(0)
    full = make_model_caches(model, rng)
    canonical = reference_store(model, full, block_ids(model, 1, rng))
    m = manager(model, full)
    for out, src in zip(split_canonical(m, canonical), canonical):
        assert not np.shares_memory(out, src)
    for out, src in zip(merge_shards([m], [canonical]), canonical):
        assert not np.shares_memory(out, src)
