"""One-shot calls reuse the last one-shot binding of their manager
(kvgroups_core.transfer.fast.reuse).

``store(manager, caches, ids)`` / ``load(manager, objects, caches, ids)`` on the caches of the
manager's previous one-shot call take that call's binding back instead of binding again; they
must behave exactly as fresh calls: the reference's bytes, every check of ids and objects,
a cache replaced or reallocated in place bound again (or refused as a first call is), dropped
caches freed, threads safe, nothing kept from inside ``jax.jit``.
"""

from __future__ import annotations

import copy
import gc
import pickle
import threading
import weakref

import numpy as np
import pytest

import kvgroups_core as kc
from kvgroups_core.formats.catalogue import EngineKVFormat as F
from kvgroups_core.grouping.engine_groups import EngineGroupInfo
from kvgroups_core.transfer import api as transfer

CHUNK, BS, NB, LAYERS = 16, 4, 32, 4
SHAPE = (2, NB, BS, 2, 8)
BPC = CHUNK // BS  # blocks per chunk


def _host_caches(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 2**16, SHAPE, dtype=np.uint16).view(np.float16) for _ in range(LAYERS)]


def _runtime(kind: str):
    """(to_runtime, to_numpy, loads_return_new) for a CPU runtime; float16 bits exact."""
    if kind == "numpy":
        return (lambda a: a.copy()), (lambda x: np.asarray(x)), False
    if kind in ("torch", "torch-cuda"):
        torch = pytest.importorskip("torch")
        pytest.importorskip("kvgroups_torch")
        device = "cuda" if kind == "torch-cuda" else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            pytest.skip("no CUDA GPU")

        def to_torch(a: np.ndarray):
            if a.dtype == np.float16:
                return torch.from_numpy(a.view(np.int16).copy()).view(torch.float16).to(device)
            return torch.from_numpy(a.copy()).to(device)

        def to_numpy(t) -> np.ndarray:
            t = t.cpu()
            if t.dtype == torch.float16:
                return t.view(torch.int16).numpy().view(np.float16)
            return t.numpy()

        return to_torch, to_numpy, False
    pytest.importorskip("kvgroups_jax")
    backend = kc.get_backend("jax")
    return backend.from_numpy, (lambda x: np.asarray(x)), True


def _manager(caches) -> kc.KVLayerGroupsManager:
    return kc.KVLayerGroupsManager(caches, F.NL_X_TWO_NB_BS_NH_HS, lmcache_tokens_per_chunk=CHUNK)


def _reference_store(host: list[np.ndarray], ids) -> list[np.ndarray]:
    """The NumPy reference's objects for these caches (a prepared transfer: no reuse)."""
    caches = [a.copy() for a in host]
    return [np.asarray(o) for o in kc.prepare(_manager(caches), caches).store(np.asarray(ids))]


def _reference_load(host: list[np.ndarray], objects, ids) -> list[np.ndarray]:
    caches = [a.copy() for a in host]
    kc.prepare(_manager(caches), caches).load([np.array(o) for o in objects], np.asarray(ids))
    return caches


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def _assert_same(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(_bits(g), _bits(w))


@pytest.fixture
def binds(monkeypatch):
    """binds(manager): how many times the transfers bound caches to ``manager``."""
    bound: list = []
    real = transfer.bind

    def counting(manager, *a, **k):
        bound.append(manager)
        return real(manager, *a, **k)

    monkeypatch.setattr(transfer, "bind", counting)
    return lambda manager: sum(m is manager for m in bound)


# On a GPU machine "jax" runs on the GPU (JAX's default device); CUDA torch is its own case.
KINDS = ["numpy", "torch", "jax", pytest.param("torch-cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("kind", KINDS)
def test_repeated_calls_bind_once_and_match_the_reference(kind, binds):
    to_rt, to_np, returns_new = _runtime(kind)
    host = _host_caches(1)
    caches = [to_rt(a) for a in host]
    manager = _manager(caches)
    rng = np.random.default_rng(2)
    for step in range(4):
        ids = rng.permutation(NB)[: 2 * BPC]
        out = kc.store(manager, caches, ids)  # objects allocated by the call
        _assert_same([to_np(o) for o in out], _reference_store(host, ids))
        given = [to_rt(np.zeros_like(to_np(o))) for o in out]
        out = kc.store(manager, caches, ids, given)  # objects passed in
        _assert_same([to_np(o) for o in out], _reference_store(host, ids))
        # Load other bytes into other blocks: every block of every cache as the reference.
        src = _reference_store(_host_caches(10 + step), ids[::-1].copy())
        load_ids = rng.permutation(NB)[: 2 * BPC]
        result = kc.load(manager, [to_rt(o) for o in src], caches, load_ids)
        host = _reference_load(host, src, load_ids)
        if returns_new:
            caches = result  # the next calls pass the load's results, as an engine does
        else:
            assert result is caches
        _assert_same([to_np(c) for c in caches], host)
    assert binds(manager) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_replaced_cache_is_bound_again(kind, binds):
    to_rt, to_np, _ = _runtime(kind)
    host = _host_caches(3)
    caches = [to_rt(a) for a in host]
    manager = _manager(caches)
    ids = np.arange(BPC)
    kc.store(manager, caches, ids)
    other = _host_caches(4)
    caches[2] = to_rt(other[2])  # the engine replaced one layer's tensor
    host[2] = other[2]
    _assert_same([to_np(o) for o in kc.store(manager, caches, ids)], _reference_store(host, ids))
    assert binds(manager) == 2
    kc.store(manager, list(caches), ids)  # a new list of the same tensors: a hit
    assert binds(manager) == 2


def test_numpy_resized_or_read_only_cache_is_refused_then_bound_again(binds):
    host = _host_caches(5)
    caches = [a.copy() for a in host]
    manager = _manager(caches)
    ids = np.arange(BPC)
    objects = kc.store(manager, caches, ids)
    caches[1].resize((2, 4, BS, 2, 8), refcheck=False)  # in place: smaller, reallocated
    with pytest.raises(kc.KVGroupsValueError) as info:
        kc.store(manager, caches, ids)
    assert isinstance(info.value, ValueError) and "kv_caches layer 1" in str(info.value)
    caches[1].resize(SHAPE, refcheck=False)  # the right shape again, new (zeroed) memory
    host[1] = caches[1].copy()
    _assert_same(kc.store(manager, caches, ids), _reference_store(host, ids))
    # Made read-only in place: a load is refused as on a first call, nothing written.
    caches[0].flags.writeable = False
    before = [c.copy() for c in caches]
    with pytest.raises(kc.KVGroupsValueError, match="read-only") as info:
        kc.load(manager, [np.full_like(o, 7) for o in objects], caches, ids)
    assert isinstance(info.value, ValueError)
    _assert_same(caches, before)


def test_torch_reallocated_cache_is_refused_or_bound_again():
    pytest.importorskip("torch")
    pytest.importorskip("kvgroups_torch")
    to_rt, to_np, _ = _runtime("torch")
    host = _host_caches(6)
    caches = [to_rt(a).clone() for a in host]  # torch's own storage: resizable
    manager = _manager(caches)
    ids = np.arange(BPC)
    kc.store(manager, caches, ids)
    caches[0].resize_(4 * int(np.prod(SHAPE)))  # grows past its storage: reallocated, 1-D
    with pytest.raises(kc.KVGroupsValueError) as info:
        kc.store(manager, caches, ids)
    assert isinstance(info.value, ValueError)
    fresh_host = _host_caches(7)[1]
    fresh = to_rt(fresh_host)
    caches[3].set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())  # same object
    caches[0] = to_rt(host[0])
    host[3] = fresh_host
    _assert_same([to_np(o) for o in kc.store(manager, caches, ids)], _reference_store(host, ids))


@pytest.mark.parametrize("kind", KINDS)
def test_dropped_caches_are_freed(kind):
    to_rt, _, returns_new = _runtime(kind)
    host = _host_caches(8)
    caches = [to_rt(a) for a in host]
    manager = _manager([a.copy() for a in host])  # a manager keeps the arrays it was built from
    ids = np.arange(BPC)
    objects = kc.store(manager, caches, ids)
    caches = kc.load(manager, objects, caches, ids)  # JAX: the park holds the results
    kc.store(manager, caches, ids)
    assert manager.one_shot_park is not None  # a park exists: the case under test
    refs = [weakref.ref(c) for c in caches]
    del caches
    gc.collect()
    assert all(r() is None for r in refs), "a one-shot park kept the engine's caches alive"
    # The manager keeps working on new caches.
    host = _host_caches(9)
    new = [to_rt(a) for a in host]
    out = kc.store(manager, new, ids)
    _assert_same([_runtime(kind)[1](o) for o in out], _reference_store(host, ids))


@pytest.mark.parametrize("kind", KINDS)
def test_threads_on_one_manager(kind):
    to_rt, to_np, _ = _runtime(kind)
    hosts = [_host_caches(20), _host_caches(21)]
    sets = [[to_rt(a) for a in h] for h in hosts]
    manager = _manager(sets[0])
    errors: list = []
    wants = {}
    for s in range(2):
        for i in range(NB // BPC):
            ids = np.arange(i * BPC, (i + 1) * BPC)
            wants[s, i] = _reference_store(hosts[s], ids)

    def work(t: int) -> None:
        try:
            for n in range(40):
                s, i = (t + n) % 2, (t * 7 + n) % (NB // BPC)  # both cache sets, interleaved
                ids = np.arange(i * BPC, (i + 1) * BPC)
                got = kc.store(manager, sets[s], ids)
                for g, w in zip(got, wants[s, i]):
                    if not np.array_equal(_bits(to_np(g)), _bits(w)):
                        errors.append((t, n, s, i))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []


def test_objects_and_ids_are_checked_on_a_hit(binds):
    host = _host_caches(11)
    caches = [a.copy() for a in host]
    manager = _manager(caches)
    ids = np.arange(BPC)
    objects = kc.store(manager, caches, ids)
    kc.store(manager, caches, ids, objects)
    read_only = [o.copy() for o in objects]
    read_only[0].flags.writeable = False
    snapshot = read_only[0].copy()
    with pytest.raises(kc.KVGroupsValueError, match="read-only") as info:
        kc.store(manager, caches, ids, read_only)
    assert isinstance(info.value, ValueError)
    np.testing.assert_array_equal(read_only[0], snapshot)
    with pytest.raises(kc.KVGroupsIndexError) as info:
        kc.store(manager, caches, np.arange(NB, NB + BPC))
    assert isinstance(info.value, IndexError)
    with pytest.raises(kc.KVGroupsValueError, match="memory apart from the caches"):
        kc.store(
            manager,
            caches,
            ids,
            [caches[0].reshape(-1).view(np.uint8)[: objects[0].size].reshape(objects[0].shape)],
        )
    torch = pytest.importorskip("torch")
    pytest.importorskip("kvgroups_torch")
    with pytest.raises(kc.KVGroupsTypeError, match="one framework") as info:
        kc.store(manager, caches, ids, [torch.from_numpy(objects[0].copy())])
    assert isinstance(info.value, TypeError)
    _assert_same(caches, host)
    _assert_same(kc.store(manager, caches, ids), _reference_store(host, ids))
    assert binds(manager) == 1  # refused calls moved nothing: the binding stays


def test_a_new_manager_from_with_full_sw_kv_never_uses_the_old_binding():
    caches = _host_caches(12)[:2]
    infos = (
        EngineGroupInfo(engine_group_id=0, layer_indices=(0,)),
        EngineGroupInfo(engine_group_id=1, layer_indices=(1,), sw_size_tokens=8),
    )
    plain = kc.KVLayerGroupsManager(
        caches, F.NL_X_TWO_NB_BS_NH_HS, infos, lmcache_tokens_per_chunk=CHUNK
    )
    ids = {0: np.arange(BPC), 1: np.arange(BPC, 2 * BPC)}
    small = kc.store(plain, caches, ids)
    full = plain.with_full_sw_kv()
    big = kc.store(full, caches, ids)
    assert big[1].shape[1] == kc.object_nbytes(full, 1) == 2 * small[1].shape[1]
    want = kc.prepare(full, caches).store(ids)
    _assert_same(big, want)
    again = kc.store(plain, caches, ids)
    assert [o.shape for o in again] == [o.shape for o in small]
    _assert_same(again, small)


def test_jit_calls_keep_nothing_and_trace_once():
    jax = pytest.importorskip("jax")
    pytest.importorskip("kvgroups_jax")
    to_rt, to_np, _ = _runtime("jax")
    host = _host_caches(13)
    caches = [to_rt(a) for a in host]
    manager = _manager(caches)
    traces = {"n": 0}

    def step(caches, ids):
        traces["n"] += 1
        return kc.store(manager, caches, ids)

    jitted = jax.jit(step)
    for i in range(3):
        ids = np.arange(i * BPC, (i + 1) * BPC)
        out = jitted(caches, jax.numpy.asarray(ids))
        _assert_same([to_np(o) for o in out], _reference_store(host, ids))
        park = manager.one_shot_park
        assert park is None, "a traced call parked a binding"
    assert traces["n"] == 1
    # An eager call parks; a trace over the same (concrete, captured) caches then gives the
    # same bytes, and a new trace (new chunk count) meets no stale tracer.
    kc.store(manager, caches, np.arange(BPC))
    assert manager.one_shot_park is not None
    ids2 = np.arange(2 * BPC)
    out = jax.jit(lambda i: kc.store(manager, caches, i))(jax.numpy.asarray(ids2))
    _assert_same([to_np(o) for o in out], _reference_store(host, ids2))
    out = jitted(caches, jax.numpy.asarray(ids2))
    _assert_same([to_np(o) for o in out], _reference_store(host, ids2))
    # A jitted load that donates the caches: the eager calls after it use its results.
    src = _reference_store(_host_caches(14), np.arange(BPC))
    load = jax.jit(lambda c, o, i: kc.load(manager, o, c, i), donate_argnums=0)
    caches = load(caches, [to_rt(o) for o in src], jax.numpy.asarray(np.arange(BPC)))
    assert manager.one_shot_park is None
    host = _reference_load(host, src, np.arange(BPC))
    _assert_same([to_np(c) for c in caches], host)
    _assert_same(
        [to_np(o) for o in kc.store(manager, caches, np.arange(BPC))],
        _reference_store(host, np.arange(BPC)),
    )


def test_jax_donated_caches_passed_again_are_refused():
    pytest.importorskip("jax")
    pytest.importorskip("kvgroups_jax")
    to_rt, _, _ = _runtime("jax")
    caches = [to_rt(a) for a in _host_caches(15)]
    manager = _manager(caches)
    ids = np.arange(BPC)
    objects = kc.store(manager, caches, ids)
    new = kc.load(manager, objects, caches, ids)  # consumes ``caches``
    with pytest.raises(kc.KVGroupsValueError, match="deleted or donated") as info:
        kc.load(manager, objects, caches, ids)
    assert isinstance(info.value, ValueError)
    kc.store(manager, new, ids)  # the results are usable


def test_a_manager_with_a_park_still_pickles_and_copies(binds):
    host = _host_caches(16)
    caches = [a.copy() for a in host]
    manager = _manager(caches)
    kc.store(manager, caches, np.arange(BPC))
    assert manager.one_shot_park is not None
    for other in (pickle.loads(pickle.dumps(manager)), copy.deepcopy(manager)):
        assert other.one_shot_park is None  # no park travels
        _assert_same(
            kc.store(other, caches, np.arange(BPC)), _reference_store(host, np.arange(BPC))
        )
    shallow = copy.copy(manager)  # shares the park: never served to the copy
    _assert_same(kc.store(shallow, caches, np.arange(BPC)), _reference_store(host, np.arange(BPC)))
    assert binds(shallow) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_repeated_calls_with_objects_take_the_call_memo_and_follow_reallocation(kind, monkeypatch):
    # The parked binding keeps its call memo: after the first call (which binds and records)
    # a one-shot call with the same objects runs the memo's runner, with the reference's
    # bytes; a cache reallocated in place between calls is bound afresh, its new bytes moved.
    # (JAX returns new object arrays for the donated ones: new objects, so no memo hit, as
    # for prepared JAX calls; the bytes are checked all the same.)
    from kvgroups_core.transfer.fast import call_memo

    to_rt, to_np, _ = _runtime(kind)
    hits = []
    real_call = call_memo.CallMemo.call

    def spy(self, *args, **kw):
        done = real_call(self, *args, **kw)
        hits.append(done is not None)
        return done

    monkeypatch.setattr(call_memo.CallMemo, "call", spy)
    host = _host_caches(21)
    caches = [to_rt(a) for a in host]
    manager = _manager(caches)
    rng = np.random.default_rng(22)
    shapes = [o.shape for o in _reference_store(host, np.arange(2 * BPC))]
    # The engine's pattern: the same object buffers every step (JAX: the returned ones,
    # donated again), filled with other pages each time.
    buffers = [to_rt(np.zeros(shape, np.uint8)) for shape in shapes]
    for _ in range(5):
        ids = rng.permutation(NB)[: 2 * BPC]
        buffers = kc.store(manager, caches, ids, buffers)
        _assert_same([to_np(o) for o in buffers], _reference_store(host, ids))
    if kind != "jax":
        assert hits[0] is False and all(hits[1:]), hits
    if kind != "torch":
        return
    fresh_host = _host_caches(23)[2]
    fresh = to_rt(fresh_host)
    caches[2].set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())  # same object
    host[2] = fresh_host
    ids = rng.permutation(NB)[: 2 * BPC]
    _assert_same(
        [to_np(o) for o in kc.store(manager, caches, ids, buffers)], _reference_store(host, ids)
    )
