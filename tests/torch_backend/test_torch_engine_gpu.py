"""Engine-native calls on a GPU through the public API: CUDA-tensor block ids with no host
sync, CUDA graph capture and replay with ids and skips written in place, out-of-range device
ids (nothing written, raised at the check), torch.compile on CUDA, layer-wise calls, the CTA
cap and a side-stream store overlapped with compute. Skipped cleanly without CUDA."""

import kvgroups_torch
import numpy as np
import pytest
import torch

import kvgroups_core as kc
from kvgroups_core.errors import KVGroupsIndexError, KVGroupsValueError
from tests.support.cuda_marks import needs_cuda
from tests.support.torch_engine_cases import (
    cache_bytes,
    ids_for,
    map_ids,
    model_caches,
    object_bytes,
    random_objects,
    reference_load,
    reference_store,
    reference_with_drops,
)

pytestmark = needs_cuda

MODELS = ["llama3-8b", "gpt-oss-20b"]  # one engine group; two engine groups with a window


def _cuda_ids(ids, dtype=torch.int32):
    return map_ids(ids, lambda v: torch.as_tensor(np.asarray(v)).to("cuda", dtype))


def _empty_objects(manager, num_chunks):
    return [
        torch.zeros((num_chunks, kc.object_nbytes(manager, g)), dtype=torch.uint8, device="cuda")
        for g in range(manager.num_object_groups)
    ]


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("name", MODELS)
def test_cuda_ids_store_and_load_without_a_host_sync(name, id_dtype):
    manager, caches = model_caches(name, device="cuda", seed=1)
    prep = kc.prepare(manager, caches)
    rng = np.random.default_rng(2)
    host_ids = ids_for(manager, rng, 2)
    ids = _cuda_ids(host_ids, id_dtype)
    objects = _empty_objects(manager, 2)
    loaded = random_objects(manager, 2, seed=3, device="cuda")
    skip = torch.tensor(80, device="cuda")
    prep.store(ids, objects)  # warm-up: kernels, plane tables (host-to-device copies)
    prep.load(loaded, ids, skip_first_n_tokens=skip)
    want_caches = reference_load(manager, loaded, caches, host_ids, skip=80)
    want_objects = reference_store(manager, caches, host_ids)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        prep.store(ids, objects)
        prep.load(loaded, ids, skip_first_n_tokens=skip)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    kvgroups_torch.check_errors()
    for got, want in zip(object_bytes(objects), want_objects):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(cache_bytes(caches), want_caches):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", MODELS)
def test_graph_replays_pick_up_new_ids_and_skips_written_in_place(name):
    manager, caches = model_caches(name, device="cuda", seed=4)
    prep = kc.prepare(manager, caches)
    rng = np.random.default_rng(5)
    first = ids_for(manager, rng, 2)
    ids = _cuda_ids(first)
    skip = torch.tensor(0, device="cuda")
    objects = _empty_objects(manager, 2)
    loaded = random_objects(manager, 2, seed=6, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graph asks
        prep.store(ids, objects)
        prep.load(loaded, ids, skip_first_n_tokens=skip)
    torch.cuda.current_stream().wait_stream(side)
    store_graph, load_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(store_graph):
        prep.store(ids, objects)
    with torch.cuda.graph(load_graph):
        prep.load(loaded, ids, skip_first_n_tokens=skip)
    for step, skip_tokens in enumerate((0, 80, 64)):
        new = ids_for(manager, rng, 2)
        map_ids(ids, lambda t: t)  # same tensors: written in place below
        if isinstance(ids, dict):
            for g, t in ids.items():
                t.copy_(torch.as_tensor(new[g]))
        else:
            ids.copy_(torch.as_tensor(new))
        skip.fill_(skip_tokens)
        want_objects = reference_store(manager, caches, new)
        store_graph.replay()
        want_caches = reference_load(manager, loaded, caches, new, skip=skip_tokens)
        load_graph.replay()
        torch.cuda.synchronize()
        kvgroups_torch.check_errors()
        for got, want in zip(object_bytes(objects), want_objects):
            np.testing.assert_array_equal(got, want, err_msg=f"replay {step}")
        for got, want in zip(cache_bytes(caches), want_caches):
            np.testing.assert_array_equal(got, want, err_msg=f"replay {step}")


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_back_to_back_launches_see_what_the_kernels_before_them_wrote(mode):
    """The page-copy kernels are launched to start while the kernel before them on the stream
    drains (programmatic launch on sm_90+) and wait before touching memory. Each round here
    has a torch kernel write the ids, a store read the pages of ``a`` into the objects and a
    load write them back at ``b`` at once, with no sync between rounds: each launch must see
    every write of the one before it (caches end as the sequential model says)."""
    num_blocks, chunks, rounds = 512, 16, 12
    manager, caches = model_caches(
        "llama3-8b", layers=8, num_blocks=num_blocks, device="cuda", seed=21
    )
    prep = kc.prepare(manager, caches)
    n = chunks * manager.calculate_num_blocks(0, manager.lmcache_tokens_per_chunk)
    perm = torch.from_numpy(np.random.default_rng(22).permutation(num_blocks)).cuda()
    objects = _empty_objects(manager, chunks)
    ids_a = torch.empty(n, dtype=torch.int64, device="cuda")
    ids_b = torch.empty_like(ids_a)
    shift = torch.zeros((), dtype=torch.int64, device="cuda")
    positions = torch.arange(n, device="cuda")

    def one_round():  # ids from kernels (index and remainder), then the store and the load
        torch.index_select(perm, 0, torch.remainder(positions + shift, num_blocks), out=ids_a)
        torch.index_select(perm, 0, torch.remainder(positions + shift + n, num_blocks), out=ids_b)
        prep.store(ids_a, objects)
        prep.load(objects, ids_b)

    model = [c.view(torch.uint8).view(2, num_blocks, -1).cpu().numpy().copy() for c in caches]
    host_perm = perm.cpu().numpy()
    graph = None
    if mode == "graph":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture
            one_round()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        model = [c.view(torch.uint8).view(2, num_blocks, -1).cpu().numpy().copy() for c in caches]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            one_round()
    for k in range(rounds):
        shift.fill_(7 * k)
        graph.replay() if graph is not None else one_round()
        a = host_perm[(np.arange(n) + 7 * k) % num_blocks]
        b = host_perm[(np.arange(n) + 7 * k + n) % num_blocks]
        for layer in model:
            layer[:, b] = layer[:, a]
    torch.cuda.synchronize()
    kvgroups_torch.check_errors()
    for got, want in zip(cache_bytes(caches), model):
        np.testing.assert_array_equal(got.reshape(-1), want.reshape(-1))


@pytest.mark.parametrize("direction", ["store", "load"])
def test_out_of_range_device_ids_write_nothing_and_raise_at_the_check(direction):
    manager, caches = model_caches("llama3-8b", device="cuda", seed=7)
    prep = kc.prepare(manager, caches)
    host_ids = np.random.default_rng(8).permutation(48)[:8]
    bad = host_ids.copy()
    bad[[2, 5]] = [48, -3]
    objects = random_objects(manager, 2, seed=9, device="cuda")
    before_objects, before_caches = object_bytes(objects), cache_bytes(caches)
    if direction == "store":
        prep.store(_cuda_ids(bad, torch.int64), objects)
    else:
        prep.load(objects, _cuda_ids(bad, torch.int64))
    with pytest.raises(KVGroupsIndexError, match=r"block_ids\[0\].*got (48|-3)") as info:
        kvgroups_torch.check_errors()
    assert isinstance(info.value, IndexError)
    kvgroups_torch.check_errors()  # cleared
    want_caches, want_objects, met = reference_with_drops(
        manager,
        before_caches_as(caches, before_caches),
        before_objects_as(before_objects),
        bad,
        direction,
    )
    assert met == {48, -3}
    for got, want in zip(object_bytes(objects), want_objects):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(cache_bytes(caches), want_caches):
        np.testing.assert_array_equal(got, want)


def before_caches_as(caches, raw):
    return [torch.from_numpy(r).view(torch.float16).view(c.shape) for c, r in zip(caches, raw)]


def before_objects_as(raw):
    return [torch.from_numpy(r) for r in raw]


def test_device_skip_outside_the_tokens_covered_is_clamped_and_raised():
    manager, caches = model_caches("llama3-8b", device="cuda", seed=10)
    prep = kc.prepare(manager, caches)
    ids = _cuda_ids(np.arange(8))
    objects = random_objects(manager, 2, seed=11, device="cuda")
    prep.load(objects, ids, skip_first_n_tokens=torch.tensor(500, device="cuda"))
    with pytest.raises(KVGroupsValueError, match="skip_first_n_tokens.*got 500"):
        kvgroups_torch.check_errors()


@pytest.mark.parametrize("name", MODELS)
def test_layer_wise_calls_equal_the_whole_model_call_on_cuda(name):
    manager, caches = model_caches(name, device="cuda", seed=12)
    prep = kc.prepare(manager, caches)
    host_ids = ids_for(manager, np.random.default_rng(13), 2)
    ids = _cuda_ids(host_ids)
    whole = prep.store(ids)
    parts = random_objects(manager, 2, seed=14, device="cuda")
    for layer in range(len(manager.engine_kv_formats)):
        prep.store(ids, parts, layers=[layer])
    for a, b in zip(object_bytes(whole), object_bytes(parts)):
        np.testing.assert_array_equal(a, b)
    loaded = random_objects(manager, 2, seed=15, device="cuda")
    want = reference_load(manager, loaded, caches, host_ids, skip=64)
    for layer in range(len(manager.engine_kv_formats)):
        prep.load(loaded, ids, skip_first_n_tokens=64, layers=[layer])
    for got, w in zip(cache_bytes(caches), want):
        np.testing.assert_array_equal(got, w)


def test_cta_cap_moves_the_same_bytes():
    manager, caches = model_caches("llama3-8b", layers=8, device="cuda", seed=16)
    prep = kc.prepare(manager, caches)
    host_ids = ids_for(manager, np.random.default_rng(17), 3)
    capped = _empty_objects(manager, 3)
    prep.store(_cuda_ids(host_ids), capped, max_ctas=3)
    for got, want in zip(object_bytes(capped), reference_store(manager, caches, host_ids)):
        np.testing.assert_array_equal(got, want)


def test_side_stream_store_overlaps_compute_and_the_engine_waits_on_its_event():
    # The docs/INTEGRATION.md pattern: a layer's store on a side stream right after the
    # layer's KV is written, the forward pass continuing on the main stream, one event per
    # store the engine waits on before it reuses or frees the blocks.
    manager, caches = model_caches("llama3-8b", layers=4, device="cuda", seed=18)
    prep = kc.prepare(manager, caches)
    host_ids = ids_for(manager, np.random.default_rng(19), 2)
    ids = _cuda_ids(host_ids)
    objects = _empty_objects(manager, 2)
    want = reference_store(manager, caches, host_ids)
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    done = []
    for layer in range(4):
        kv_written = torch.cuda.Event()
        kv_written.record(main)  # the layer's KV is in the cache from here on
        with torch.cuda.stream(side):
            side.wait_event(kv_written)
            prep.store(ids, objects, layers=[layer], max_ctas=16)
            saved = torch.cuda.Event()
            saved.record(side)
        done.append(saved)
        a = a @ a  # the next layer's compute, on the main stream
        a = a / a.norm()
    for event in done:
        main.wait_event(event)  # before the engine frees or overwrites those blocks
    torch.cuda.synchronize()
    for got, w in zip(object_bytes(objects), want):
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_engine_step_on_cuda_equals_eager_and_reuses_the_graph(backend):
    manager, caches = model_caches("gpt-oss-20b", device="cuda", seed=20)
    twin = [c.clone() for c in caches]
    prep, twin_prep = kc.prepare(manager, caches), kc.prepare(manager, twin)
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(gm)
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(backend)(gm, example_inputs)

    def step(p, ids, objects, loaded, skip):
        out = p.store(ids, objects)
        p.load(loaded, ids, skip_first_n_tokens=skip, layers=[1])
        whole = kc.store(manager, p.kv_caches, ids)
        return out[0].sum(dtype=torch.int64) + whole[0].sum(dtype=torch.int64)

    compiled = torch.compile(step, fullgraph=True, backend=counting)
    rng = np.random.default_rng(21)
    for call in range(3):
        ids = _cuda_ids(ids_for(manager, rng, 2))
        loaded = random_objects(manager, 2, seed=22 + call, device="cuda")
        skip = torch.tensor(64 * call, device="cuda")
        got_objects, want_objects = _empty_objects(manager, 2), _empty_objects(manager, 2)
        got = compiled(prep, ids, got_objects, loaded, skip)
        want = step(twin_prep, ids, want_objects, [o.clone() for o in loaded], skip)
        assert int(got) == int(want)
        for a, b in zip(object_bytes(got_objects), object_bytes(want_objects)):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(cache_bytes(caches), cache_bytes(twin)):
            np.testing.assert_array_equal(a, b)
    assert len(compiles) == 1
