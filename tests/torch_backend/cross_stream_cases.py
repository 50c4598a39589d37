"""Cross-stream cases of the CUDA path, each run in a process of its own by
test_cross_stream_gpu.py: before the tables were made stream-safe, these read garbage plane
addresses, which faults the whole CUDA context (hence the separate process).

    python tests/torch_backend/cross_stream_cases.py upload|lifetime|capture|check
"""

import gc
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parents[1] / "backends")]  # tests.support, ...

import kvgroups_torch  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from kvgroups_torch.cuda import launch as cuda_launch  # noqa: E402

import kvgroups_core as kc  # noqa: E402
from kvgroups_core.errors import KVGroupsIndexError  # noqa: E402
from tests.support.torch_engine_cases import (  # noqa: E402
    ids_for,
    map_ids,
    model_caches,
    object_bytes,
    reference_store,
)

NUM_BLOCKS = 48  # engine_cases.model_caches' default
BUSY_CYCLES = 200_000_000  # ~0.1 s of one busy thread on the GPU: the queued work waits that long


def _objects(manager, chunks):
    return [
        torch.zeros((chunks, kc.object_nbytes(manager, g)), dtype=torch.uint8, device="cuda")
        for g in range(manager.num_object_groups)
    ]


def _fill_free_blocks_with_junk(stream):
    """Hand the allocator's small free blocks of ``stream`` back filled with -1, so a table
    read before its upload (or after its block was reused) holds addresses that fault."""
    with torch.cuda.stream(stream):
        junk = [
            torch.full((n,), -1, dtype=torch.int64, device="cuda")
            for n in (8, 16, 32, 64, 128, 256, 512, 1024)
            for _ in range(4)
        ]
    return junk


def _setup(seed):
    manager, caches = model_caches("llama3-8b", layers=4, device="cuda", seed=seed)
    host_ids = ids_for(manager, np.random.default_rng(seed + 1), 2)
    ids = map_ids(host_ids, lambda v: torch.as_tensor(np.asarray(v)).to("cuda", torch.int32))
    want = reference_store(manager, caches, host_ids)
    torch.cuda.synchronize()
    return manager, caches, ids, want


def upload():
    """The launch state (its plane table and the GPU's error record) is built by a call on a
    stream busy for 0.1 s; a call on another stream at once must wait for those uploads."""
    manager, caches, ids, want = _setup(30)
    busy, other = torch.cuda.Stream(), torch.cuda.Stream()
    del _fill_free_blocks_with_junk(busy)[:]
    with torch.cuda.stream(busy):
        torch.cuda._sleep(BUSY_CYCLES)
        prep = kc.prepare(manager, caches)
        first = _objects(manager, 2)
        prep.store(ids, first)
    with torch.cuda.stream(other):
        second = _objects(manager, 2)
        prep.store(ids, second)
    torch.cuda.synchronize()
    kvgroups_torch.check_errors()
    for objects in (first, second):
        for got, w in zip(object_bytes(objects), want):
            np.testing.assert_array_equal(got, w)


def lifetime():
    """A call queued on a busy stream reads the plane table of a launch state that is dropped
    (and its memory handed out again on the stream that built it) before that call runs."""
    manager, caches, ids, want = _setup(32)
    home, busy = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(home):
        prep = kc.prepare(manager, caches)
        prep.store(ids, _objects(manager, 2))
    torch.cuda.synchronize()
    late = _objects(manager, 2)
    with torch.cuda.stream(busy):
        torch.cuda._sleep(BUSY_CYCLES)
        prep.store(ids, late)
    del prep
    cuda_launch._by_identity.clear()
    cuda_launch._by_value.clear()
    gc.collect()
    junk = _fill_free_blocks_with_junk(home)  # runs at once: home is idle
    torch.cuda.synchronize()
    del junk
    kvgroups_torch.check_errors()
    for got, w in zip(object_bytes(late), want):
        np.testing.assert_array_equal(got, w)


def capture():
    """A graph captured while the launch state's upload is not yet known to be done (built on
    a busy stream, warmed up on another, captured on PyTorch's capture stream): the capture
    takes the upload as an external event wait, and replays copy exactly."""
    manager, caches, ids, want = _setup(36)
    busy, side = torch.cuda.Stream(), torch.cuda.Stream()
    del _fill_free_blocks_with_junk(busy)[:]
    with torch.cuda.stream(busy):
        torch.cuda._sleep(BUSY_CYCLES)
        prep = kc.prepare(manager, caches)
        prep.store(ids, _objects(manager, 2))
    objects = _objects(manager, 2)
    with torch.cuda.stream(side):
        prep.store(ids, objects)  # the engine's warm-up, while busy still sleeps
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prep.store(ids, objects)
    objects[0].zero_()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    kvgroups_torch.check_errors()
    for got, w in zip(object_bytes(objects), want):
        np.testing.assert_array_equal(got, w)


def check():
    """A bad device id met by a launch on a side stream that has not run yet is raised by the
    check made on the main stream (the check waits for every stream), and only once."""
    manager, caches, ids, _ = _setup(34)
    prep = kc.prepare(manager, caches)
    objects = _objects(manager, 2)
    prep.store(ids, objects)  # warm-up
    torch.cuda.synchronize()
    kvgroups_torch.check_errors()
    bad = ids.clone()  # llama3-8b: one engine group, flat ids
    bad[3] = NUM_BLOCKS  # one past the last block
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(BUSY_CYCLES)
        prep.store(bad, objects)
    try:
        kvgroups_torch.check_errors()
    except KVGroupsIndexError as exc:
        assert "block_ids[0]" in str(exc), exc
    else:
        raise AssertionError("check_errors() did not raise for the side stream's bad id")
    kvgroups_torch.check_errors()  # cleared: nothing left to raise


if __name__ == "__main__":
    {"upload": upload, "lifetime": lifetime, "capture": capture, "check": check}[sys.argv[1]]()
    print("ok")
