"""GPU-only behaviour: ids on the device, bad ids, graph capture, torch.compile, streams,
threads. Skipped cleanly without CUDA."""

import os
import threading

import numpy as np
import pytest
import torch
from kvgroups_torch import BoundPlan, check_device_errors
from kvgroups_torch.cuda import execute as cuda_execute

from kvgroups_core.errors import KVGroupsIndexError, KVGroupsValueError
from tests.support.cuda_marks import needs_cuda
from tests.support.torch_page_cases import as_bytes, as_tensor, make_case, oracle

pytestmark = needs_cuda


def _bound(case, objects_pinned=False):
    caches = [as_tensor(c, case.dtype, "cuda") for c in case.caches]
    objects = torch.from_numpy(case.objects.copy())
    objects = objects.pin_memory() if objects_pinned else objects.cuda()
    return caches, objects, BoundPlan(case.plan, caches, [objects])


def _assert(case, caches, objects, ids=None):
    torch.cuda.synchronize()
    want_caches, want_objects = oracle(case, ids=ids)
    np.testing.assert_array_equal(objects.cpu().numpy(), want_objects)
    for got, want in zip(caches, want_caches):
        np.testing.assert_array_equal(as_bytes(got), want)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("direction", ["store", "load"])
def test_block_ids_on_the_device_are_read_in_place(direction, id_dtype):
    case = make_case("hnd", "bfloat16", direction, np.random.default_rng(1), bpc=4, kept=3)
    caches, objects, bound = _bound(case)
    ids = np.random.default_rng(2).permutation(40)[:12]
    bound.run(torch.from_numpy(ids).to("cuda", id_dtype))
    _assert(case, caches, objects, ids)
    check_device_errors()


@pytest.mark.parametrize("direction", ["store", "load"])
def test_out_of_range_device_ids_move_nothing_and_raise_on_check(direction):
    case = make_case("nhd", "float16", direction, np.random.default_rng(3))
    caches, objects, bound = _bound(case)
    ids = np.random.default_rng(4).permutation(40)[:12]
    ids[[1, 5, 9]] = [40, -1, 2**40]
    bound.run(torch.from_numpy(ids).cuda())
    with pytest.raises(
        KVGroupsIndexError,
        match=r"block_ids\[0\]: expected ids in \[0, 40\)"
        r".*got (40|-1|1099511627776)",
    ):
        check_device_errors(caches[0].device)
    _assert(case, caches, objects, ids)
    check_device_errors()  # the flag was cleared


def test_short_device_id_tensors_are_rejected_before_launch():
    case = make_case("nhd", "float16", "store", np.random.default_rng(5))
    caches, objects, bound = _bound(case)
    with pytest.raises(KVGroupsValueError, match="at least 12"):
        bound.run(torch.zeros(11, dtype=torch.int32, device="cuda"))
    np.testing.assert_array_equal(objects.cpu().numpy(), case.objects)


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("pinned", [False, True])
def test_captured_graph_replays_with_new_device_ids(direction, pinned):
    if pinned and os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1":
        pytest.skip("staging buffers are allocated during capture: needs the caching allocator")
    case = make_case("interleaved", "bfloat16", direction, np.random.default_rng(6))
    caches, objects, bound = _bound(case, objects_pinned=pinned)
    rng = np.random.default_rng(7)
    ids = torch.from_numpy(rng.permutation(40)[:12]).to("cuda", torch.int32)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        bound.run(ids)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bound.run(ids)
    # Replays see the ids' current content and the current bytes of caches and objects.
    for _ in range(2):
        new_ids = rng.permutation(40)[:12]
        case.caches = [rng.integers(0, 256, c.size, dtype=np.uint8) for c in case.caches]
        case.objects = rng.integers(0, 256, case.objects.shape, dtype=np.uint8)
        for t, raw in zip(caches, case.caches):
            t.view(torch.uint8).copy_(torch.from_numpy(raw))
        objects.copy_(torch.from_numpy(case.objects))
        ids.copy_(torch.from_numpy(new_ids))
        graph.replay()
        _assert(case, caches, objects, new_ids)


def test_store_inside_torch_compile():
    case = make_case("nhd", "bfloat16", "store", np.random.default_rng(8))
    caches, objects, bound = _bound(case)
    ids = torch.from_numpy(np.random.default_rng(9).permutation(40)[:12]).cuda()

    @torch.compile(fullgraph=True)
    def step(ids):
        bound.run(ids)

    step(ids)
    _assert(case, caches, objects, ids.cpu().numpy())


def test_launches_on_the_current_stream():
    case = make_case("hnd", "float32", "store", np.random.default_rng(10))
    caches = [as_tensor(c, case.dtype, "cuda") for c in case.caches]
    objects = torch.from_numpy(case.objects.copy()).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cuda_execute.execute_plan(case.plan, caches, [objects], 0)
        copy = objects.clone()  # ordered after the kernel only if both are on `stream`
    stream.synchronize()
    _, want_objects = oracle(case)
    np.testing.assert_array_equal(copy.cpu().numpy(), want_objects)


def test_runs_from_a_thread_that_never_touched_cuda():
    case = make_case("nhd", "float16", "load", np.random.default_rng(11))
    caches = [as_tensor(c, case.dtype, "cuda") for c in case.caches]
    objects = torch.from_numpy(case.objects.copy()).cuda()
    torch.cuda.synchronize()
    errors = []

    def work():
        try:
            cuda_execute.execute_plan(case.plan, caches, [objects], 0)
            torch.cuda.synchronize()
        except Exception as exc:  # reported below, with the test's own assertion
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not errors, errors
    _assert(case, caches, objects)


def test_core_store_and_load_end_to_end_with_pinned_objects():
    from kvgroups_core.formats.catalogue import EngineKVFormat as F
    from kvgroups_core.grouping.manager import KVLayerGroupsManager
    from kvgroups_core.transfer.api import load, store

    caches = [torch.randn(2, 64, 16, 8, 128, device="cuda").to(torch.bfloat16) for _ in range(4)]
    manager = KVLayerGroupsManager(
        caches, [F.NL_X_TWO_NB_BS_NH_HS] * 4, lmcache_tokens_per_chunk=256
    )
    ids = torch.randperm(64)[:32]
    objs = store(manager, caches, ids.numpy())
    pinned = [o.cpu().pin_memory() for o in objs]
    want = store(manager, [c.cpu() for c in caches], ids.numpy())
    torch.testing.assert_close(objs[0].cpu(), want[0], rtol=0, atol=0)
    dst = [torch.zeros_like(c) for c in caches]
    load(manager, pinned, dst, ids.numpy())
    for c, d in zip(caches, dst):
        assert torch.equal(c[:, ids.cuda()], d[:, ids.cuda()])
        rest = torch.ones(64, dtype=torch.bool, device="cuda")
        rest[ids.cuda()] = False
        assert not d[:, rest].any()
