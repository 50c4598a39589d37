"""The call memo (kvgroups_core/transfer/fast/call_memo.py) on a GPU: warm prepared calls with
CUDA ids
(cuda_repeat.PlanRepeater) follow new ids, new objects and reallocated caches, refuse what a cold
call refuses, never synchronise, and capture in a CUDA graph. Skipped cleanly without CUDA."""

import kvgroups_torch
import numpy as np
import pytest
import torch

import kvgroups_core as kc
from kvgroups_core.transfer import api as transfer
from tests.support.cuda_marks import needs_cuda
from tests.support.torch_engine_cases import (
    cache_bytes,
    ids_for,
    model_caches,
    object_bytes,
    random_objects,
    reference_load,
    reference_store,
)

pytestmark = needs_cuda


def _objects(manager, num_chunks, seed):
    return random_objects(manager, num_chunks, seed=seed, device="cuda")


def test_warm_calls_follow_new_ids_objects_and_lengths(planned):
    manager, caches = model_caches("llama3-8b", layers=4, device="cuda", seed=30)
    prep = kc.prepare(manager, caches)
    rng = np.random.default_rng(31)
    hits = 0
    for call in range(12):
        n = 1 + call % 2  # ids of another length every other call
        host = ids_for(manager, rng, n)
        ids = torch.as_tensor(host).to("cuda", torch.int32 if call % 3 else torch.int64)
        objects = _objects(manager, n, seed=call)  # new buffers every call
        layers = None if call % 4 == 0 else [call % 4]
        want = reference_store(manager, caches, host, layers=layers, objects=objects)
        before = planned[0]
        prep.store(ids, objects, **({} if layers is None else {"layers": layers}))
        hits += planned[0] == before
        for got, w in zip(object_bytes(objects), want):
            np.testing.assert_array_equal(got, w, err_msg=f"store {call}")
        loaded = _objects(manager, n, seed=100 + call)
        want_caches = reference_load(manager, loaded, caches, host, layers=layers)
        prep.load(loaded, ids, **({} if layers is None else {"layers": layers}))
        for got, w in zip(cache_bytes(caches), want_caches):
            np.testing.assert_array_equal(got, w, err_msg=f"load {call}")
    kvgroups_torch.check_errors()
    # The same objects again: warm calls, same bytes.
    objects = _objects(manager, 1, seed=7)
    for _ in range(4):
        host = ids_for(manager, rng, 1)
        before = planned[0]
        prep.store(torch.as_tensor(host).cuda(), objects, layers=[1])
        hits += planned[0] == before
        want = reference_store(manager, caches, host, layers=[1], objects=objects)
        for got, w in zip(object_bytes(objects), want):
            np.testing.assert_array_equal(got, w)
    assert hits >= 3


def test_warm_calls_do_not_synchronise_and_capture_in_a_graph():
    manager, caches = model_caches("llama3-8b", layers=4, device="cuda", seed=32)
    prep = kc.prepare(manager, caches)
    rng = np.random.default_rng(33)
    pool = [torch.as_tensor(ids_for(manager, rng, 1)).to("cuda", torch.int32) for _ in range(3)]
    objects = [_objects(manager, 1, seed=s) for s in (1, 2)]
    for ids in pool:  # warm every signature (layers, objects)
        for objs in objects:
            prep.store(ids, objs, layers=[2])
            prep.store(ids, objs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(6):
            prep.store(pool[i % 3], objects[i % 2], layers=[2])
            prep.store(pool[(i + 1) % 3], objects[(i + 1) % 2])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    static = pool[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        prep.store(static, objects[0])  # a warm call, then captured
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prep.store(static, objects[0])
    for _ in range(3):
        host = ids_for(manager, rng, 1)
        static.copy_(torch.as_tensor(host).to("cuda", torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        for got, w in zip(object_bytes(objects[0]), reference_store(manager, caches, host)):
            np.testing.assert_array_equal(got, w)
    kvgroups_torch.check_errors()


def test_warm_calls_follow_a_reallocated_cache_on_cuda(planned):
    manager, caches = model_caches("llama3-8b", layers=6, device="cuda", seed=34)
    prep = kc.prepare(manager, caches)
    rng = np.random.default_rng(35)
    host = ids_for(manager, rng, 1)
    ids = torch.as_tensor(host).cuda()
    objects = _objects(manager, 1, seed=3)
    for layer in (3, 5, 3, 5):
        prep.store(ids, objects, layers=[layer])
    fresh = torch.randn(caches[5].shape, device="cuda").to(caches[5].dtype)
    caches[5].set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())
    want3 = reference_store(manager, caches, host, layers=[3], objects=objects)
    before = planned[0]
    prep.store(ids, objects, layers=[3])  # touches layer 3 only: stays warm
    assert planned[0] == before
    for got, w in zip(object_bytes(objects), want3):
        np.testing.assert_array_equal(got, w)
    want5 = reference_store(manager, caches, host, layers=[5], objects=objects)
    before = planned[0]
    prep.store(ids, objects, layers=[5])  # rebinds, reads the new tensor
    assert planned[0] == before + 1
    for got, w in zip(object_bytes(objects), want5):
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize(
    "case",
    ["not_whole_chunks", "float_ids", "pageable_object", "object_over_a_cache", "wrong_rows"],
)
def test_warm_memo_on_cuda_refuses_what_a_cold_call_refuses(case, monkeypatch):
    manager, caches = model_caches("llama3-8b", layers=4, device="cuda", seed=36)
    prep = kc.prepare(manager, caches)
    host = ids_for(manager, np.random.default_rng(37), 1)
    ids = torch.as_tensor(host).to("cuda", torch.int32)
    objects = _objects(manager, 1, seed=4)
    for _ in range(3):
        prep.store(ids, objects, layers=[1])
    nbytes = objects[0].shape[1]
    bad_ids, bad_objects = ids, objects
    if case == "not_whole_chunks":
        bad_ids = torch.cat([ids, ids[:1]])
    elif case == "float_ids":
        bad_ids = ids.float()
    elif case == "pageable_object":
        bad_objects = [objects[0].cpu()]
    elif case == "object_over_a_cache":
        view = torch.empty(0, dtype=torch.uint8, device="cuda")
        view.set_(caches[2].untyped_storage(), 0, (1, nbytes), (nbytes, 1))
        bad_objects = [view]
    else:
        bad_objects = [_objects(manager, 2, seed=5)[0]]
    torch.cuda.synchronize()
    before = object_bytes(objects) + cache_bytes(caches)

    def refusal():
        with pytest.raises(kc.KVGroupsError) as info:
            prep.store(bad_ids, bad_objects, layers=[1])
        return type(info.value), str(info.value)

    warm = refusal()
    monkeypatch.setattr(transfer, "call_key", lambda *a, **k: None)
    assert refusal() == warm
    torch.cuda.synchronize()
    for a, b in zip(object_bytes(objects) + cache_bytes(caches), before):
        np.testing.assert_array_equal(a, b)
