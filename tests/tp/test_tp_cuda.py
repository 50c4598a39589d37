"""Tensor parallelism on a CUDA GPU (gpu marker, skipped without one): rank shards stored by
the CUDA kernels merge on the device to the TP=1 objects, splits load at another degree, and
ranks store into one shared pinned host buffer (TP-native)."""

from __future__ import annotations

import numpy as np
import pytest

from kvgroups_core import load, merge_shards, object_nbytes, split_canonical, store
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
)

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
]


def cuda(structure):
    if isinstance(structure, list):
        return [cuda(x) for x in structure]
    return torch.from_numpy(structure.copy()).cuda()


def host(xs):
    return [x.cpu().numpy() for x in xs]


@pytest.mark.parametrize("store_tp,load_tp", [(2, 4), (4, 1), (1, 8), (8, 2)])
@pytest.mark.parametrize(
    "model_name", ["mha-nhd", "hybrid-full-sw-gqa2", "mla-indexer", "sglang-kv-list"]
)
def test_cuda_rank_stores_merge_on_device_and_splits_load(model_name, store_tp, load_tp):
    model = MODELS[model_name]
    rng = np.random.default_rng(store_tp + 10 * load_tp)
    full = make_model_caches(model, rng)
    before = make_model_caches(model, rng)
    ids = block_ids(model, 3, rng)
    shards = [cuda(shard_caches(model, full, r, store_tp)) for r in range(store_tp)]
    managers = [manager(model, shards[r], r, store_tp) for r in range(store_tp)]
    objects = [store(managers[r], shards[r], ids) for r in range(store_tp)]
    merged = merge_shards(managers, objects)
    assert all(x.is_cuda for x in merged)
    assert_same_bytes(host(merged), reference_store(model, full, ids))
    want = reference_load(model, host(merged), before, ids)
    for r in range(load_tp):
        caches = cuda(shard_caches(model, before, r, load_tp))
        mine = manager(model, caches, r, load_tp)
        load(mine, split_canonical(mine, merged), caches, ids)
        torch.cuda.synchronize()
        assert_same_bytes(host(leaves(caches)), leaves(shard_caches(model, want, r, load_tp)))


@pytest.mark.parametrize("tp", [2, 4])
def test_cuda_ranks_store_into_one_pinned_host_buffer(tp):
    model = MODELS["hybrid-full-sw-gqa2"]
    rng = np.random.default_rng(tp)
    full = make_model_caches(model, rng)
    ids = block_ids(model, 3, rng)
    shards = [cuda(shard_caches(model, full, r, tp)) for r in range(tp)]
    managers = [manager(model, shards[r], r, tp, object_layout="tp_native") for r in range(tp)]
    shared = [
        torch.zeros((3, object_nbytes(managers[0], og)), dtype=torch.uint8).pin_memory()
        for og in range(managers[0].num_object_groups)
    ]
    for m, caches in zip(managers, shards):
        store(m, caches, ids, shared)
    torch.cuda.synchronize()
    canonical = reference_store(model, full, ids)
    assert_same_bytes(host(shared), split_canonical(managers[0], canonical))
    assert_same_bytes(host(merge_shards(managers, [shared] * tp)), canonical)
