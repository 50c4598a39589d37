"""The transport interface in one process: two NIXL agents over UCX loopback (writer and
reader), the descriptors a pull posts, partial pulls, layer ranges, pushes, and every refusal
before a byte moves."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest
from kvgroups_transport import (
    Copy,
    FingerprintMismatchError,
    ObjectPool,
    PeerUnavailableError,
    Publication,
    PublicationReleasedError,
    Receiver,
    TransportUnavailableError,
    chunks_to_read,
    get_transport,
    layer_byte_ranges,
    nixl_connector_descriptors,
    object_sizes,
    publish,
)
from kvgroups_transport.base import memory_region

from kvgroups_core import KVGroupsValueError, load, object_regions, store
from tests.support.pd_runs import skip_without_nixl
from tests.support.tp_models import (
    MODELS,
    block_ids,
    make_model_caches,
    manager,
    reference_load,
    reference_store,
)

skip_without_nixl()
nixl = pytest.importorskip("kvgroups_transport.nixl")

MODEL = MODELS["hybrid-full-sw-gqa2"]  # full attention, a sliding window, a 2-head layer


@pytest.fixture(scope="module")
def agents():
    writer = get_transport("nixl", name="writer", publication_ttl_s=60)
    reader = get_transport("nixl", name="reader", side_channel_timeout_s=2.0)
    yield writer, reader
    writer.close()
    reader.close()


def world(seed=0, chunks=3):
    rng = np.random.default_rng(seed)
    full = make_model_caches(MODEL, rng)
    before = make_model_caches(MODEL, rng)
    ids = block_ids(MODEL, chunks, rng)
    return full, before, ids


_pools = iter(range(10_000))


def written(writer, full, ids, entries, request="req", **kw):
    m = manager(MODEL, full)
    pool = ObjectPool.allocate(f"w{next(_pools)}", object_sizes(m), 8)
    writer.register_pool(pool.pool_id, pool.buffers, pool.object_nbytes)
    for start in range(0, len(entries)):  # one chunk per store: entries need not be consecutive
        one = {
            g: i[start * len(i) // len(entries) : (start + 1) * len(i) // len(entries)]
            for g, i in ids.items()
        }
        store(m, full, one, pool.writable_rows([entries[start]]), backend="numpy")
    return m, pool, publish(writer, m, f"{request}-{pool.pool_id}", pool, entries, **kw)


def pull_and_load(reader, pub, before, ids, first_chunk=0, **kw):
    caches = [x.copy() for x in before]
    m = manager(MODEL, caches)
    rx = Receiver(m, reader, capacity=8, name=f"s{next(_pools)}", **kw)
    job = rx.begin(pub, first_chunk=first_chunk)
    rx.pull(job)
    rx.wait(job)
    n = len(next(iter(ids.values())))
    later = {g: i[first_chunk * n // pub.num_chunks :] for g, i in ids.items()}
    load(m, rx.objects(job), caches, later, backend="numpy")
    rx.end(job)
    return caches, job


def same(a, b):
    return all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(a, b))


def test_consecutive_entries_move_as_one_descriptor_per_object_group(agents):
    writer, reader = agents
    full, before, ids = world()
    _, _, pub = written(writer, full, ids, [3, 4, 5])
    caches, job = pull_and_load(reader, pub, before, ids)
    assert same(caches, reference_load(MODEL, reference_store(MODEL, full, ids), before, ids))
    assert job.chunks == [[0, 1, 2], [2]]  # the sliding-window objects: the last chunk only
    assert job.descriptors == 2 and job.posted_descriptors == 2
    assert job.nbytes == 3 * pub_sizes(pub)[0] + pub_sizes(pub)[1]


def pub_sizes(pub):
    m = manager(MODEL, make_model_caches(MODEL, np.random.default_rng(0)))
    return object_sizes(m)


def test_scattered_entries_move_one_descriptor_per_chunk_and_object_group(agents):
    writer, reader = agents
    full, before, ids = world(1)
    _, _, pub = written(writer, full, ids, [6, 1, 3])
    caches, job = pull_and_load(reader, pub, before, ids)
    assert same(caches, reference_load(MODEL, reference_store(MODEL, full, ids), before, ids))
    assert job.descriptors == 3 + 1


def test_a_partial_pull_moves_only_the_chunks_the_reader_lacks(agents):
    writer, reader = agents
    full, before, ids = world(2)
    _, _, pub = written(writer, full, ids, [0, 1, 2])
    caches, job = pull_and_load(reader, pub, before, ids, first_chunk=2)
    assert job.chunks == [[2], [2]]
    assert job.nbytes == sum(pub_sizes(pub))
    canonical = reference_store(MODEL, full, ids)
    later = {g: i[2 * len(i) // 3 :] for g, i in ids.items()}
    assert same(caches, reference_load(MODEL, [c[2:] for c in canonical], before, later))


def test_chunks_to_read_skip_what_a_window_does_not_attend():
    m = manager(MODEL, make_model_caches(MODEL, np.random.default_rng(0)))
    assert chunks_to_read(m, 5) == [[0, 1, 2, 3, 4], [4]]
    assert chunks_to_read(m, 5, 4) == [[4], [4]]
    assert chunks_to_read(m.with_full_sw_kv(), 3, 1) == [[1, 2], [1, 2]]
    with pytest.raises(KVGroupsValueError, match="first_chunk"):
        chunks_to_read(m, 2, 3)


def test_registered_buffers_stay_alive_while_the_transport_holds_them(agents):
    writer, reader = agents
    full, before, ids = world(3)
    m = manager(MODEL, full)
    pool = ObjectPool.allocate(f"w{next(_pools)}", object_sizes(m), 4)
    writer.register_pool(pool.pool_id, pool.buffers, pool.object_nbytes)
    store(m, full, ids, pool.writable_rows([0, 1, 2]), backend="numpy")
    pub = publish(writer, m, "kept", pool, [0, 1, 2])
    del pool
    gc.collect()
    [np.full((4, n), 0x5A, np.uint8) for n in object_sizes(m)]  # would reuse freed memory
    caches, _ = pull_and_load(reader, pub, before, ids)
    assert same(caches, reference_load(MODEL, reference_store(MODEL, full, ids), before, ids))


def test_layer_byte_ranges_tile_every_region():
    m = manager(MODEL, make_model_caches(MODEL, np.random.default_rng(0)))
    for og in range(m.num_object_groups):
        spans = sorted(
            s for layer in range(len(MODEL.layers)) for s in layer_byte_ranges(m, og, layer)
        )
        regions = object_regions(m, og)
        total = sum(r.nbytes for r in regions)
        assert sum(n for _, n in spans) == total
        assert spans[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:]))
    # Layer 0 is the first layer of a K/V group: two ranges (K rows, V rows) of `slots` rows.
    (k, v) = layer_byte_ranges(m, 0, 0)
    assert k[1] == v[1] and v[0] > k[0] + k[1]
    assert layer_byte_ranges(m, 1, 0) == ()


def test_a_fingerprint_mismatch_is_refused_before_anything_is_reserved(agents):
    writer, reader = agents
    full, before, ids = world(4)
    _, _, pub = written(writer, full, ids, [0, 1, 2])
    other = manager(MODEL, before, lmcache_tokens_per_chunk=2 * MODEL.chunk)
    rx = Receiver(other, reader, capacity=2, name=f"s{next(_pools)}")
    with pytest.raises(FingerprintMismatchError) as info:
        rx.begin(pub)
    message = str(info.value)
    assert (
        pub.fingerprint[:16] in message
        and other.fingerprint(across_degrees=True)[:16] in message
        and "chunk 128 tokens" in message
        and "chunk 64 tokens" in message
    )
    assert isinstance(info.value, ValueError)
    assert rx._free == [0, 1]


def test_a_released_or_expired_publication_is_not_pulled(agents):
    writer, reader = agents
    full, before, ids = world(5)
    _, _, pub = written(writer, full, ids, [0, 1, 2])
    writer.release(pub.request_id)
    with pytest.raises(PublicationReleasedError, match="no longer publishes"):
        pull_and_load(reader, pub, before, ids)
    short = get_transport("nixl", name="short", publication_ttl_s=0.2)
    try:
        _, _, pub = written(short, full, ids, [0, 1, 2])
        time.sleep(0.4)
        with pytest.raises(PublicationReleasedError):
            pull_and_load(reader, pub, before, ids)
        # Slots other than the published ones are not served either.
        _, _, pub = written(short, full, ids, [0, 1, 2])
        with pytest.raises(PublicationReleasedError):
            pull_and_load(reader, replace(pub, entries=(1, 2, 3)), before, ids)
    finally:
        short.close()


def test_a_writer_that_is_gone_raises_peer_unavailable(agents):
    _, reader = agents
    full, before, ids = world(6)
    gone = get_transport("nixl", name="gone")
    _, _, pub = written(gone, full, ids, [0, 1, 2])
    gone.close()
    with pytest.raises(PeerUnavailableError) as info:
        pull_and_load(reader, pub, before, ids)
    assert isinstance(info.value, ConnectionError)


def test_copies_outside_a_pool_are_refused_before_posting(agents):
    writer, reader = agents
    full, _, ids = world(7)
    m, pool, pub = written(writer, full, ids, [0, 1, 2])
    staging = ObjectPool.allocate(f"s{next(_pools)}", object_sizes(m), 2)
    reader.register_pool(staging.pool_id, staging.buffers, staging.object_nbytes)
    bad = Copy(
        object_group=0,
        remote_entry=7,
        remote_offset=0,
        local_entry=1,
        local_offset=1,
        nbytes=pool.object_nbytes[0],
    )
    with pytest.raises(KVGroupsValueError, match="inside local pool"):
        reader.pull(pub, 0, staging.pool_id, [bad])


def test_a_push_writes_into_entries_the_reader_offered(agents):
    writer, reader = agents
    full, before, ids = world(8)
    m, pool, _ = written(writer, full, ids, [4, 5, 6])
    target = ObjectPool.allocate(f"t{next(_pools)}", object_sizes(m), 4)
    target.buffers[0][:] = 0
    reader.register_pool(target.pool_id, target.buffers, target.object_nbytes)
    offer = publish(reader, m, "offer", target, [1, 2, 3])
    copies = [
        Copy(
            object_group=0,
            remote_entry=1,
            remote_offset=0,
            local_entry=4,
            local_offset=0,
            nbytes=3 * pool.object_nbytes[0],
        )
    ]
    writer.wait(writer.push(offer, 0, pool.pool_id, copies))
    assert np.array_equal(target.buffers[0][1:4], pool.buffers[0][4:7])
    assert not target.buffers[0][0].any()


def test_publications_round_trip_through_json(agents):
    writer, _ = agents
    full, _, ids = world(9)
    _, _, pub = written(writer, full, ids, [0, 1, 2], chunk_hashes=["aa", "bb", "cc"])
    assert Publication.from_dict(json.loads(json.dumps(pub.to_dict()))) == pub
    with pytest.raises(KVGroupsValueError, match="'entries'"):
        Publication.from_dict({k: v for k, v in pub.to_dict().items() if k != "entries"})


def test_memory_regions_of_numpy_and_torch_arrays():
    x = np.zeros((4, 16), np.uint8)
    assert memory_region(x).address == x.ctypes.data and memory_region(x).nbytes == 64
    with pytest.raises(KVGroupsValueError, match="contiguous"):
        memory_region(x[:, ::2])
    torch = pytest.importorskip("torch")
    t = torch.zeros((4, 16), dtype=torch.uint8)
    assert memory_region(t).address == t.data_ptr() and memory_region(t).device == "cpu"
    with pytest.raises(KVGroupsValueError, match="contiguous"):
        memory_region(t[:, ::2])


def test_descriptor_baseline_of_vllms_nixl_connector():
    # 4096 tokens in blocks of 16 over 32 layers, K and V: what NixlConnector prepares.
    assert nixl_connector_descriptors(4096 // 16, 32) == 16384
    assert nixl_connector_descriptors(8, 2, kv_planes=1) == 16


def test_unknown_transports_and_missing_packages_are_typed_errors(monkeypatch):
    with pytest.raises(KVGroupsValueError, match="expected one of"):
        get_transport("carrier-pigeon")
    import importlib

    real = importlib.import_module

    def blocked(name, *a, **k):
        if name.startswith("nixl"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", blocked)
    with pytest.raises(TransportUnavailableError, match="pip install nixl-cu12") as info:
        nixl.import_nixl()
    assert isinstance(info.value, ImportError)


def test_importing_the_interface_loads_no_framework_and_no_transport():
    code = (
        "import sys, kvgroups_transport; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'jax', 'nixl', 'nixl_cu12', 'nixl_cu13', 'kvgroups_torch', "
        "'kvgroups_jax')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "remote, local, error, name",
    [
        ([1.9, 2.9], [0, 1], "KVGroupsTypeError", r"remote_entries\[0\]"),
        (["2", "3"], [0, 1], "KVGroupsTypeError", r"remote_entries\[0\]"),
        ([2, 3], [-1, 0], "KVGroupsValueError", r"local_entries\[0\]"),
        (None, [0, 1], "KVGroupsTypeError", "remote_entries"),
        ([2, True], [0, 1], "KVGroupsTypeError", r"remote_entries\[1\]"),
    ],
)
def test_pull_copies_take_entries_as_ints_only(remote, local, error, name):
    # 1.9 went through int() and read entry 1: another chunk's bytes, silently.
    from kvgroups_transport import pull_copies

    import kvgroups_core as kc

    m = manager(MODEL, make_model_caches(MODEL, np.random.default_rng(0)))
    reads = kc.plan_reads(m, 1).objects[0]
    assert pull_copies(reads, 0, [2, 3], [0, 1])[0].remote_entry == 2
    with pytest.raises(getattr(kc, error), match=f"^{name}: expected"):
        pull_copies(reads, 0, remote, local)


def test_chunks_to_read_checks_its_counts_by_name():
    import kvgroups_core as kc

    m = manager(MODEL, make_model_caches(MODEL, np.random.default_rng(0)))
    for args, error, name in [
        ((m, 2.5), kc.KVGroupsTypeError, "num_chunks"),
        ((m, 2**70), kc.KVGroupsValueError, "num_chunks"),
        ((m, 3, "1"), kc.KVGroupsTypeError, "first_chunk"),
        ((None, 3), kc.KVGroupsTypeError, "manager"),
    ]:
        with pytest.raises(error, match=f"^{name}: expected"):
            chunks_to_read(*args)
