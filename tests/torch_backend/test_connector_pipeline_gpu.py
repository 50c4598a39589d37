"""KVGroupsConnector's step transfers (kvgroups_torch.vllm.pipeline) on a GPU, without vLLM:
pinned pool buffers, vLLM-style host ids, the loads queued per layer on a side stream held
back by a sleep, each layer's reads after its wait_layer seeing its loaded pages; per-layer
saves of what each layer wrote; the FULL-graph path loading before the forward; no host
sync on the pipelined path."""

import numpy as np
import pytest
import torch
from kvgroups_torch import check_errors
from kvgroups_torch.vllm.host_store import HostChunkStore
from kvgroups_torch.vllm.pipeline import StepTransfers, entry_rows

from tests.support.cuda_marks import needs_cuda
from tests.support.torch_engine_cases import (
    cache_bytes,
    ids_for,
    model_caches,
    reference_load,
    reference_store,
)
from tests.support.torch_layerwise_cases import delay

pytestmark = needs_cuda

LAYERS = 8
CHUNK = 64  # engine_cases.model_caches' chunk
DELAY = 4_000_000


def _setup(name, seed):
    manager, caches = model_caches(name, layers=LAYERS, num_blocks=96, device="cuda", seed=seed)
    store = HostChunkStore(manager, caches, 8)
    assert store.pinned and store.layerwise
    gen = torch.Generator().manual_seed(seed + 1)
    for pool in store.pools:
        pool.copy_(torch.randint(0, 256, pool.shape, dtype=torch.uint8, generator=gen))
    names = {f"model.layers.{i}.attn": i for i in range(LAYERS)}
    return manager, caches, store, StepTransfers(store, names, CHUNK)


class Item:
    def __init__(self, ids, entries, taken):
        self.block_ids = (
            {g: list(map(int, v)) for g, v in ids.items()}
            if isinstance(ids, dict)
            else list(map(int, ids))
        )
        self.entries, self.skip_tokens, self.taken_tokens = entries, 0, taken


def _layer_ids(manager, ids, layer):
    group = next(g for g in manager.kernel_groups if layer in g.layer_indices)
    flat = ids[group.engine_group_idx] if isinstance(ids, dict) else ids
    return torch.as_tensor(np.asarray(flat), device="cuda")


def _forward(manager, caches, steps, ids, waits=True):
    seen = []
    for layer in range(LAYERS):
        if waits:
            steps.wait_layer(f"model.layers.{layer}.attn")
        seen.append(caches[layer].index_select(1, _layer_ids(manager, ids, layer)))
    return seen


def _check(manager, caches, store, ids, entries, seen, before):
    torch.cuda.synchronize()
    check_errors()
    want = reference_load(manager, [pool[entries] for pool in store.pools], before, ids)
    for layer, (w, c) in enumerate(zip(want, caches)):
        loaded = torch.from_numpy(w).view(c.dtype).view(c.shape)
        expect = loaded.index_select(1, _layer_ids(manager, ids, layer).cpu())
        assert torch.equal(seen[layer].cpu().view(torch.int16), expect.view(torch.int16)), (
            f"layer {layer} read before its load"
        )
    for got, w in zip(cache_bytes(caches), want):
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("name", ["llama3-8b", "gpt-oss-20b"])
@pytest.mark.parametrize("entries", [[2, 3], [6, 1]])
def test_pipelined_loads_reach_each_layer_at_its_wait(name, entries):
    manager, caches, store, steps = _setup(name, seed=1)
    ids = ids_for(manager, np.random.default_rng(2), 2, num_blocks=96)
    before = [c.clone() for c in caches]
    for _ in range(2):  # the first round warms the launch state up
        for c, b in zip(caches, before):
            c.copy_(b)
        delay(steps.loads.stream, DELAY)
        steps.start_loads([Item(ids, entries, 2 * CHUNK)], hooks_run=True)
        seen = _forward(manager, caches, steps, ids)
        steps.finish_step([])
        _check(manager, caches, store, ids, entries, seen, before)


def test_the_pipelined_path_never_syncs_the_host():
    manager, caches, store, steps = _setup("llama3-8b", seed=3)
    ids = ids_for(manager, np.random.default_rng(4), 2, num_blocks=96)
    save_ids = ids_for(manager, np.random.default_rng(5), 1, num_blocks=96)
    item, save = Item(ids, [0, 1], 2 * CHUNK), Item(save_ids, [4], CHUNK)
    for round_ in range(2):
        torch.cuda.synchronize()
        if round_:
            torch.cuda.set_sync_debug_mode("error")
        try:
            steps.start_loads([item], hooks_run=True)
            for layer in range(LAYERS):
                steps.wait_layer(f"model.layers.{layer}.attn")
                steps.save_layer(f"model.layers.{layer}.attn", [save])
            steps.finish_step([save])
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    want = reference_store(manager, caches, save_ids)
    for pool, w in zip(store.pools, want):
        np.testing.assert_array_equal(pool[4:5].numpy(), w)


def test_a_full_graph_step_loads_before_the_forward():
    manager, caches, store, steps = _setup("llama3-8b", seed=6)
    ids = ids_for(manager, np.random.default_rng(7), 2, num_blocks=96)
    before = [c.clone() for c in caches]
    steps.start_loads([Item(ids, [5, 6], 2 * CHUNK)], hooks_run=False)
    seen = _forward(manager, caches, steps, ids, waits=False)  # no hook runs in a replay
    steps.finish_step([])
    _check(manager, caches, store, ids, [5, 6], seen, before)


@pytest.mark.parametrize("hooks", ["all", "none"])
def test_saves_store_what_each_layer_wrote(hooks):
    manager, caches, store, steps = _setup("gpt-oss-20b", seed=8)
    ids = ids_for(manager, np.random.default_rng(9), 2, num_blocks=96)
    src = [torch.empty_like(c) for c in caches]
    for s in src:
        s.view(torch.int16).random_()
    item = Item(ids, [2, 3], 2 * CHUNK)
    for _ in range(2):
        for pool in store.pools:
            pool[2:4].zero_()  # chunks outside a window are not stored: zero, as the reference
        torch.cuda._sleep(DELAY)  # the writes come late: a save before them would miss them
        for layer in range(LAYERS):
            caches[layer].copy_(src[layer])  # the layer writes its KV
            if hooks == "all":
                steps.save_layer(f"model.layers.{layer}.attn", [item])
        steps.finish_step([item])
        torch.cuda.synchronize()
        want = reference_store(manager, src, ids)
        for pool, w in zip(store.pools, want):
            np.testing.assert_array_equal(pool[2:4].numpy(), w)


def test_entry_rows_of_pinned_pools_stay_pinned_views():
    pool = torch.empty((4, 64), dtype=torch.uint8, pin_memory=True)
    rows = entry_rows([pool], [3, 0])[0]
    assert all(r.is_pinned() for r in rows)
    assert [r.data_ptr() for r in rows] == [pool[3].data_ptr(), pool[0].data_ptr()]
