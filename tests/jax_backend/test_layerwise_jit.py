"""Per-layer loads inside one jitted step, as a JAX engine pipelines them: ``load(...,
layers=[l])`` before layer l's compute, ids traced. The dependency is data flow: each layer's
compute reads the array its own load returned, and XLA orders the program by it (the compiled
program's load of layer l reads only layer l's array, so no load waits for another layer's
compute). Checked here: the bytes each layer's compute sees and the caches after the step
equal the NumPy reference, one trace for new ids."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kvgroups_core import KVLayerGroupsManager, detect_format, load, store

NB, BS, NH, HS, TOKENS, LAYERS = 16, 4, 2, 8, 8, 4


@pytest.fixture(params=["interpret", "xla"])
def backend_name(request):
    from kvgroups_jax import JaxBackend

    from kvgroups_core.tensors.arrays import register_backend, unregister_backend

    name = f"jax-cpu-layerwise-{request.param}"
    register_backend(name, JaxBackend(lowering=request.param), replace=True)
    yield name
    unregister_backend(name)


def _engine(seed):
    rng = np.random.default_rng(seed)
    host = [
        rng.integers(0, 2**16, (NB, BS, NH, 2, HS), dtype=np.uint16).view(ml_dtypes.bfloat16)
        for _ in range(LAYERS)
    ]
    fmt, normalized = detect_format([jnp.asarray(h) for h in host], engine="tpu_inference")
    return host, KVLayerGroupsManager(normalized, fmt, lmcache_tokens_per_chunk=TOKENS)


def test_per_layer_loads_inside_one_jit_feed_each_layers_compute(backend_name):
    host, manager = _engine(0)
    traces = []

    @jax.jit
    def step(caches, objs, ids):
        traces.append(1)
        seen = []
        for layer in range(LAYERS):
            caches = load(manager, objs, caches, ids, layers=[layer], backend=backend_name)
            seen.append(caches[layer][ids])  # the layer's compute reads its loaded pages
        return seen, caches

    rng = np.random.default_rng(1)
    for _ in range(2):
        src, dst = rng.permutation(NB)[:4], rng.permutation(NB)[:4]
        objs = store(manager, host, src, backend="numpy")
        objs = [np.ascontiguousarray(o[::-1]) for o in objs]  # other bytes than dst holds
        want = load(manager, objs, [h.copy() for h in host], dst, backend="numpy")
        seen, new = step(
            [jnp.asarray(h) for h in host],
            [jnp.asarray(o) for o in objs],
            jnp.asarray(dst, jnp.int32),
        )
        for layer in range(LAYERS):
            np.testing.assert_array_equal(
                np.asarray(seen[layer]).view(np.uint16), want[layer][dst].view(np.uint16)
            )
            np.testing.assert_array_equal(
                np.asarray(new[layer]).view(np.uint16), want[layer].view(np.uint16)
            )
    assert len(traces) == 1
