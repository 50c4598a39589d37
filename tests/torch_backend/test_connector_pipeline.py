"""KVGroupsConnector's per-step transfers (kvgroups_torch.vllm.pipeline) on CPU, without vLLM:
pipelined loads land layer by layer at each layer's wait and nowhere before, steps whose
hooks will not run (FULL graph replays) and loads overlapping the step's own writes load
before the forward, saves no hook made are made at the end of the step, and every byte
equals the whole-model calls'. The engine itself runs in tests/vllm/test_e2e.py."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kvgroups_torch.vllm.host_store import HostChunkStore
from kvgroups_torch.vllm.pipeline import StepTransfers, entry_rows, hooks_will_run

from tests.support.torch_engine_cases import (
    cache_bytes,
    ids_for,
    model_caches,
    reference_load,
    reference_store,
)

LAYERS = 4
CHUNK = 64  # engine_cases.model_caches' chunk


def _names(n):
    return {f"model.layers.{i}.attn": i for i in range(n)}


def _setup(name="llama3-8b", seed=0, capacity=8, layerwise_loads=True):
    manager, caches = model_caches(name, layers=LAYERS, seed=seed)
    store = HostChunkStore(manager, caches, capacity)
    gen = torch.Generator().manual_seed(seed + 1)
    for pool in store.pools:
        pool.copy_(torch.randint(0, 256, pool.shape, dtype=torch.uint8, generator=gen))
    steps = StepTransfers(store, _names(LAYERS), CHUNK, layerwise_loads=layerwise_loads)
    return manager, caches, store, steps


def _item(ids, entries, skip=0, taken=None):
    return SimpleNamespace(block_ids=ids, entries=entries, skip_tokens=skip, taken_tokens=taken)


def _want(manager, store, caches, ids, entries, skip=0):
    rows = [pool[entries] for pool in store.pools]
    return reference_load(manager, rows, caches, ids, skip=skip)


def test_hooks_run_in_eager_and_piecewise_steps_not_in_full_graph_replays():
    mode = lambda name: SimpleNamespace(name=name)  # noqa: E731 - vLLM's CUDAGraphMode
    ctx = lambda meta, m: SimpleNamespace(attn_metadata=meta, cudagraph_runtime_mode=m)  # noqa
    assert hooks_will_run(ctx({}, mode("NONE")))
    assert hooks_will_run(ctx({}, mode("PIECEWISE")))
    assert not hooks_will_run(ctx({}, mode("FULL")))
    assert not hooks_will_run(ctx(None, mode("NONE")))  # V2 runner's FULL steps, dummy runs
    assert not hooks_will_run(None)


def test_entry_rows_are_views_never_copies():
    pools = [torch.arange(40, dtype=torch.uint8).view(8, 5)]
    rows = entry_rows(pools, [2, 3, 4])
    assert rows[0].data_ptr() == pools[0][2].data_ptr() and rows[0].shape == (3, 5)
    rows = entry_rows(pools, [5, 1])
    assert [r.data_ptr() for r in rows[0]] == [pools[0][5].data_ptr(), pools[0][1].data_ptr()]


@pytest.mark.parametrize("name", ["llama3-8b", "gpt-oss-20b"])
@pytest.mark.parametrize("entries", [[2, 3], [6, 1]])
def test_pipelined_loads_land_layer_by_layer_at_each_wait(name, entries):
    manager, caches, store, steps = _setup(name, seed=2)
    ids = ids_for(manager, np.random.default_rng(3), 2)
    before = cache_bytes(caches)
    want = _want(manager, store, caches, ids, entries, skip=64)
    steps.start_loads([_item(ids, entries, skip=64, taken=2 * CHUNK)], hooks_run=True)
    for layer in range(LAYERS):
        steps.wait_layer(f"model.layers.{layer}.attn")
        for other, (got, w, b) in enumerate(zip(cache_bytes(caches), want, before)):
            np.testing.assert_array_equal(got, w if other <= layer else b)
    steps.finish_step([])
    for got, w in zip(cache_bytes(caches), want):
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("case", ["full_graph", "recomputed", "not_layerwise"])
def test_loads_that_cannot_wait_per_layer_land_before_the_forward(case):
    manager, caches, store, steps = _setup(seed=4, layerwise_loads=case != "not_layerwise")
    ids = ids_for(manager, np.random.default_rng(5), 2)
    want = _want(manager, store, caches, ids, [0, 1])
    # "recomputed": vLLM took 100 of the 128 tokens loaded; the rest are recomputed into the
    # same blocks by this step, after the load.
    taken = 100 if case == "recomputed" else 2 * CHUNK
    steps.start_loads([_item(ids, [0, 1], taken=taken)], hooks_run=case != "full_graph")
    for got, w in zip(cache_bytes(caches), want):  # before any layer's wait
        np.testing.assert_array_equal(got, w)
    steps.finish_step([])


def test_a_wait_for_a_layer_outside_the_manager_waits_for_every_load():
    manager, caches, store, steps = _setup(seed=6)
    ids = ids_for(manager, np.random.default_rng(7), 1)
    want = _want(manager, store, caches, ids, [3])
    steps.start_loads([_item(ids, [3])], hooks_run=True)
    steps.wait_layer("model.layers.9.attn")  # e.g. a layer reading another layer's KV
    for got, w in zip(cache_bytes(caches), want):
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("hooks", ["all", "none", "some"])
def test_saves_equal_the_whole_model_store_whichever_hooks_ran(hooks):
    manager, caches, store, steps = _setup(seed=8)
    ids = ids_for(manager, np.random.default_rng(9), 2)
    want = reference_store(manager, caches, ids)
    item = _item(ids, [4, 5])
    hooked = {"all": range(LAYERS), "none": (), "some": (0, 2)}[hooks]
    calls = sum(steps.save_layer(f"model.layers.{layer}.attn", [item]) for layer in hooked)
    calls += steps.save_layer("model.layers.9.attn", [item])  # not cached: nothing
    calls += steps.finish_step([item])
    assert calls == {"all": LAYERS, "none": 1, "some": LAYERS}[hooks]
    for pool, w in zip(store.pools, want):
        np.testing.assert_array_equal(pool[4:6].numpy(), w)
    # The next step starts clean: its saves are its own.
    assert steps.finish_step([]) == 0


def test_a_step_whose_forward_skipped_waits_makes_later_loads_go_before_the_forward(caplog):
    manager, caches, store, steps = _setup(seed=10)
    ids = ids_for(manager, np.random.default_rng(11), 1)
    steps.start_loads([_item(ids, [0], taken=CHUNK)], hooks_run=True)
    for layer in (0, 1):  # layers 2 and 3 never wait
        steps.wait_layer(f"model.layers.{layer}.attn")
    steps.finish_step([])
    assert steps.loads is None and "layers [2, 3] were never waited for" in caplog.text
    want = _want(manager, store, caches, ids, [5])
    steps.start_loads([_item(ids, [5], taken=CHUNK)], hooks_run=True)
    for got, w in zip(cache_bytes(caches), want):  # loaded before any wait
        np.testing.assert_array_equal(got, w)
    steps.finish_step([])


def test_steps_that_wait_for_every_layer_stay_pipelined():
    manager, caches, store, steps = _setup(seed=12)
    ids = ids_for(manager, np.random.default_rng(13), 1)
    for _ in range(2):
        steps.start_loads([_item(ids, [0], taken=CHUNK)], hooks_run=True)
        for layer in range(LAYERS):
            steps.wait_layer(f"model.layers.{layer}.attn")
        steps.finish_step([])
        assert steps.loads is not None
