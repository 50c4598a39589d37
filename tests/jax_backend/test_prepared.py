"""Repeated calls of a prepared transfer on JAX caches: loads keep the binding (the backend
adopts the result arrays), bytes match the NumPy backend call for call, bad objects still raise
before anything is donated."""

import jax.numpy as jnp
import numpy as np
import pytest
from kvgroups_jax import JaxBackend

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_core.transfer.api import prepare
from kvgroups_tools.catalog import MODELS

NB, CHUNKS, TOKENS = 40, 2, 256


def _setup(seed=0):
    model = MODELS["hybrid-demo"].build(num_blocks=NB, layers=4, dtype="float16")
    rng = np.random.default_rng(seed)
    host = [
        rng.integers(0, 2**16, spec.shape, dtype=np.uint16).view(np.float16)
        for spec in model.kv_caches
    ]
    # One array per layer, committed to the device and owned by XLA: what an engine holds.
    caches = [JaxBackend().from_numpy(a) for a in host]
    assert all(c._committed for c in caches)
    host = [a.copy() for a in host]
    manager = KVLayerGroupsManager(
        caches, list(model.formats), model.engine_group_infos, lmcache_tokens_per_chunk=TOKENS
    )
    return manager, caches, host


def _ids(manager, rng):
    per_group = {}
    for k, group in enumerate(manager.kernel_groups):
        bpc = manager.calculate_num_blocks(k, TOKENS)
        per_group.setdefault(group.engine_group_idx, CHUNKS * bpc)
    return {g: rng.permutation(NB)[:n] for g, n in per_group.items()}


def _same_bytes(jax_caches, np_caches):
    for a, b in zip(jax_caches, np_caches):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), b.view(np.uint16))


def test_prepared_loads_stay_bound_and_match_numpy_call_for_call():
    manager, caches, host = _setup()
    prepared = prepare(manager, caches, backend="jax")
    oracle = prepare(manager, host, backend="numpy")
    plans_binding = prepared._plans
    rng = np.random.default_rng(1)
    for step in range(4):
        ids = _ids(manager, rng)
        objs = prepared.store(ids)
        ref_objs = oracle.store(ids)
        for o, r in zip(objs, ref_objs):
            np.testing.assert_array_equal(np.asarray(o), r)
        # Load those objects to other blocks (objects scrambled so a load is visible).
        objs = [jnp.asarray(np.asarray(o)[::-1].copy()) for o in objs]
        ref_objs = [np.asarray(o) for o in objs]
        target = _ids(manager, rng)
        before = [c.unsafe_buffer_pointer() for c in prepared.kv_caches]
        new = prepared.load(objs, target, skip_first_n_tokens=16 * step)
        oracle.load(ref_objs, target, skip_first_n_tokens=16 * step)
        assert [c.unsafe_buffer_pointer() for c in new] == before  # in place
        _same_bytes(new, host)
        assert prepared._plans is plans_binding  # not rebound
        assert prepared._bound._sharding is not None and prepared._bound._owned  # fast path
    # The binding read after loads describes the current arrays.
    tensors = prepared.binding.tensors
    current = {id(c): c for c in prepared.kv_caches}
    assert len(tensors) == len(current) and all(id(d.obj) in current for d in tensors)
    assert all(d.data_ptr == d.obj.unsafe_buffer_pointer() for d in tensors)


def test_bad_objects_after_loads_raise_and_donate_nothing():
    manager, caches, _ = _setup(2)
    prepared = prepare(manager, caches, backend="jax")
    rng = np.random.default_rng(3)
    ids = _ids(manager, rng)
    objs = prepared.store(ids)
    prepared.load(objs, ids)
    prepared.load(objs, ids)  # the bound arrays are now the executor's own outputs
    current = list(prepared.kv_caches)
    bad_shape = [jnp.zeros((CHUNKS, o.shape[1] + 1), jnp.uint8) for o in objs]
    bad_dtype = [jnp.zeros(o.shape, jnp.int8) for o in objs]
    for bad in (bad_shape, bad_dtype, objs[:-1]):
        with pytest.raises(KVGroupsValueError, match="objects"):
            prepared.load(bad, ids)
    with pytest.raises(KVGroupsTypeError, match="objects"):
        prepared.load(objs[0], ids)  # not a list
    assert not any(c.is_deleted() for c in current)
    assert list(prepared.kv_caches) == current
    # Per-chunk buffers take the generic path and still work.
    chunks = [[o[c] for c in range(CHUNKS)] for o in objs]
    prepared.load(chunks, ids)
    out = prepared.store(ids, [[jnp.zeros_like(b) for b in per] for per in chunks])
    for o, per in zip(objs, out):
        np.testing.assert_array_equal(np.asarray(o), np.stack([np.asarray(b) for b in per]))
