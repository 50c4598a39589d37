"""JAX engines' own cache arrays through the public calls: detection gives a manager that
stores from and loads into the arrays the engine holds (tpu-inference / sglang-jax packed
pages in fp32, bf16 and fp8; MaxText K/V lists), byte for byte as the NumPy backend."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kvgroups_core import KVLayerGroupsManager, detect_format, load, store

NB, BS, NH, HS, NL, TOKENS = 8, 4, 4, 8, 3, 8
DTYPES = {
    "float32": np.float32,
    "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
}


def _raw(rng, shape, dtype):
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    return rng.integers(0, 256, n, dtype=np.uint8).view(dtype).reshape(shape)


def _bytes(x):
    return np.asarray(x).view(np.uint8).reshape(-1)


def _round_trip(engine, host, manager_from, ids, target_ids):
    """Store ``ids`` from the engine's arrays and load them into ``target_ids`` of zeroed
    copies, with the JAX backend and the NumPy oracle; compare every byte."""
    caches = (
        [[jnp.asarray(x) for x in kv] for kv in host]
        if engine == "maxtext"
        else [jnp.asarray(x) for x in host]
    )
    fmt, normalized = detect_format(caches, engine=engine)
    manager = KVLayerGroupsManager(
        manager_from(caches, normalized), fmt, lmcache_tokens_per_chunk=TOKENS
    )
    objs = store(manager, caches, ids)
    ref = store(manager, host, ids, backend="numpy")
    for o, r in zip(objs, ref):
        np.testing.assert_array_equal(np.asarray(o), r)

    def zeros_like(tree, module):
        if isinstance(tree, list):
            return [zeros_like(t, module) for t in tree]
        return module.zeros_like(tree)

    got = load(manager, objs, zeros_like(caches, jnp), target_ids)
    want = load(manager, ref, zeros_like(host, np), target_ids, backend="numpy")
    flat = (lambda t: [x for kv in t for x in kv]) if engine == "maxtext" else list
    for g, w, c in zip(flat(got), flat(want), flat(caches)):
        assert g.shape == c.shape and g.dtype == c.dtype  # the engine's own arrays back
        np.testing.assert_array_equal(_bytes(g), _bytes(w))
    assert np.any(_bytes(flat(want)[0]))  # something was loaded


@pytest.mark.parametrize("from_engine_arrays", [True, False])
@pytest.mark.parametrize("dtype, packing", [("float32", 1), ("bfloat16", 2), ("float8_e4m3fn", 4)])
@pytest.mark.parametrize("engine", ["tpu_inference", "sglang_jax"])
def test_packed_pages_of_every_packing(engine, dtype, packing, from_engine_arrays):
    rng = np.random.default_rng(packing)
    host = [_raw(rng, (NB, BS, 2 * NH // packing, packing, HS), DTYPES[dtype]) for _ in range(NL)]
    # The manager may be built from detection's normalized views or the engine's arrays.
    pick = (
        (lambda caches, normalized: caches)
        if from_engine_arrays
        else (lambda caches, normalized: normalized)
    )
    _round_trip(engine, host, pick, np.array([5, 1, 3, 6]), np.array([0, 2, 7, 4]))


def test_maxtext_k_and_v_lists():
    rng = np.random.default_rng(9)
    host = [[_raw(rng, (NH, NB, BS, HS), ml_dtypes.bfloat16) for _ in range(NL)] for _ in range(2)]
    _round_trip(
        "maxtext", host, lambda caches, normalized: caches, np.array([5, 1]), np.array([0, 2])
    )
