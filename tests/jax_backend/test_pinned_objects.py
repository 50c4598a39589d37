"""JAX objects in pinned host memory (the CPU backend has the memory kind too): a store that
writes whole objects creates them on the device and copies them out once; a layer-subset store
keeps every other byte of the given objects; a load reads them. Bytes against NumPy."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kvgroups_core import KVLayerGroupsManager, detect_format, load, prepare, store

NB, BS, NH, HS, TOKENS = 16, 4, 2, 8, 8


def _pinned(x):
    device = jax.devices()[0]
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host"))


def _engine(seed=0, layers=3):
    rng = np.random.default_rng(seed)
    host = [
        rng.integers(0, 2**16, (NB, BS, NH, 2, HS), dtype=np.uint16).view(ml_dtypes.bfloat16)
        for _ in range(layers)
    ]
    caches = [jnp.asarray(h) for h in host]
    fmt, normalized = detect_format(caches, engine="tpu_inference")
    return host, caches, KVLayerGroupsManager(normalized, fmt, lmcache_tokens_per_chunk=TOKENS)


def _memory_kind(x):
    return x.sharding.memory_kind


def test_store_into_pinned_objects_matches_numpy_and_stays_pinned():
    host, caches, manager = _engine(1)
    ids = np.array([3, 9, 1, 14])
    want = store(manager, host, ids, backend="numpy")
    given = [_pinned(jnp.zeros(w.shape, jnp.uint8)) for w in want]
    got = prepare(manager, caches).store(ids, given)
    for g, w in zip(got, want):
        assert _memory_kind(g) == "pinned_host"
        np.testing.assert_array_equal(np.asarray(g), w)


def test_layer_subset_store_into_pinned_objects_keeps_other_bytes():
    host, caches, manager = _engine(2)
    ids = np.array([3, 9, 1, 14])
    rng = np.random.default_rng(7)
    shapes = [w.shape for w in store(manager, host, ids, backend="numpy")]
    before = [rng.integers(0, 256, s, dtype=np.uint8) for s in shapes]
    want = store(manager, host, ids, [b.copy() for b in before], layers=[1], backend="numpy")
    got = store(manager, caches, ids, [_pinned(jnp.asarray(b)) for b in before], layers=[1])
    for g, w, b in zip(got, want, before):
        assert _memory_kind(g) == "pinned_host"
        np.testing.assert_array_equal(np.asarray(g), w)
        assert (w != b).any() and (w == b).any()  # some regions written, others kept


@pytest.mark.parametrize("skip", [0, 4])
def test_load_from_pinned_objects_matches_numpy(skip):
    host, caches, manager = _engine(3)
    ids = np.array([3, 9, 1, 14])
    objs = store(manager, host, ids, backend="numpy")
    target = [np.zeros_like(h) for h in host]
    want = load(
        manager, objs, [t.copy() for t in target], ids, skip_first_n_tokens=skip, backend="numpy"
    )
    got = load(
        manager,
        [_pinned(jnp.asarray(o)) for o in objs],
        [jnp.asarray(t) for t in target],
        ids,
        skip_first_n_tokens=skip,
    )
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint16), w.view(np.uint16))


def test_whole_store_does_not_copy_the_old_pinned_bytes_in(monkeypatch):
    # One trip over the link per store (the object out), not two (old bytes in, new out).
    from kvgroups_jax import backend as jax_backend

    copied = []
    real = jax_backend._to_device
    monkeypatch.setattr(jax_backend, "_to_device", lambda x: copied.append(x) or real(x))
    host, caches, manager = _engine(4)
    ids = np.array([3, 9, 1, 14])
    shapes = [w.shape for w in store(manager, host, ids, backend="numpy")]
    store(manager, caches, ids, [_pinned(jnp.zeros(s, jnp.uint8)) for s in shapes])
    assert copied == []
    store(manager, caches, ids, [_pinned(jnp.zeros(s, jnp.uint8)) for s in shapes], layers=[0])
    assert len(copied) == len(shapes)  # a layer subset keeps the other bytes: copied in


@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host"])
def test_caches_in_host_memory_are_refused_before_anything_moves(kind):
    # Objects may live in host memory; caches may not: the programs gather from them with
    # device-memory indices, which XLA refuses across memory spaces.
    from kvgroups_core.errors import UnsupportedConfigError

    host, caches, manager = _engine(3, layers=2)
    objects = store(manager, caches, np.arange(2))
    device = jax.devices()[0]
    if kind not in {m.kind for m in device.addressable_memories()}:
        pytest.skip(f"no {kind} memory on {device}")
    in_host = [
        jax.device_put(c, jax.sharding.SingleDeviceSharding(device, memory_kind=kind))
        for c in caches
    ]
    expected = (
        r"^kv_caches \(bound array 0\): expected an array in device memory "
        rf".*got memory_kind '{kind}'"
    )
    for call in (
        lambda: store(manager, in_host, np.arange(2)),
        lambda: load(manager, objects, in_host, np.arange(2, 4)),
        lambda: prepare(manager, in_host),
    ):
        with pytest.raises(UnsupportedConfigError, match=expected):
            call()
    for c, h in zip(in_host, host):  # nothing donated, nothing written
        assert not c.is_deleted()
        np.testing.assert_array_equal(np.asarray(c).view(np.uint16), h.view(np.uint16))
