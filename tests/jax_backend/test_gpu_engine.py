"""The engine-native JAX cases on the GPU, on both Pallas lowerings (Triton, Mosaic GPU) and
the CUDA kernel XLA launches (lowering "cuda"):
stores that create their objects, traced ids inside jax.jit, out-of-range traced ids dropped
in the kernels and reported by checkify, vmap over caches, and the public calls inside a
jitted engine step. Bytes against the NumPy oracle. scripts/gpu_checks.sh runs this file
under compute-sanitizer memcheck too (step memcheck_kernels)."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import checkify
from kvgroups_jax import JaxBackend
from kvgroups_jax.executor import execute_plan

from kvgroups_core import EngineKVFormat, KVLayerGroupsManager, detect_format, load, store
from kvgroups_core.tensors.arrays import register_backend, unregister_backend
from tests.support.jax_checks import as_bytes, reference_transfer
from tests.support.jax_layouts import make_group, make_plan

pytestmark = pytest.mark.gpu

LOWERINGS = ["triton", "mosaic", "cuda"]
SHAPE = dict(nb=32, bs=16, nh=2, hs=128, num_chunks=2, bpc=2)


def _nbytes(g):
    return g.num_planes * g.slots * g.row_bytes


def _gpu(x):
    return jax.device_put(x, jax.devices("gpu")[0])


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_gpu_store_without_objects_matches_the_reference(lowering):
    arrays, g = make_group("nhd", "bfloat16", **SHAPE)
    plan = make_plan("store", [g], arrays, [_nbytes(g)])
    exp_o = np.zeros(2 * _nbytes(g), np.uint8)
    reference_transfer(
        "store", g, [a.copy().view(np.uint8).reshape(-1) for a in arrays], exp_o, _nbytes(g)
    )
    _, objs = execute_plan(plan, [_gpu(a) for a in arrays], [None], lowering=lowering)
    np.testing.assert_array_equal(as_bytes(objs[0]), exp_o)


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_gpu_traced_bad_ids_move_nothing_and_checkify_reports_them(lowering):
    arrays, g = make_group("nhd", "bfloat16", **SHAPE)
    plan = make_plan("load", [g], arrays, [_nbytes(g)])
    obj = np.random.default_rng(1).integers(0, 256, (2, _nbytes(g)), np.uint8)
    good = np.array([3, 9, 17, 30])
    exp_c = [a.copy().view(np.uint8).reshape(-1) for a in arrays]
    reference_transfer(
        "load", replace(g, block_ids=good), exp_c, obj.copy().reshape(-1), _nbytes(g)
    )

    def step(caches, obj, ids):
        traced = replace(plan, groups=(replace(plan.groups[0], block_ids=ids),))
        return execute_plan(traced, caches, [obj], lowering=lowering)[0]

    run = jax.jit(checkify.checkify(step), donate_argnums=(0,))
    err, out = run([_gpu(a) for a in arrays], _gpu(obj), _gpu(np.array([3, 9, 17, 1000], np.int32)))
    assert "got 1000" in str(err.get())
    block = 16 * 2 * 128 * 2
    for c, before, moved in zip(out, arrays, exp_c):
        got, before = as_bytes(c), before.view(np.uint8).reshape(-1)
        for kv in range(2):
            for blk in range(32):
                lo = (kv * 32 + blk) * block
                want = moved if blk in (3, 9, 17) else before
                np.testing.assert_array_equal(got[lo : lo + block], want[lo : lo + block])
    err, out = run([_gpu(a) for a in arrays], _gpu(obj), _gpu(good.astype(np.int32)))
    assert err.get() is None
    for c, e in zip(out, exp_c):
        np.testing.assert_array_equal(as_bytes(c), e)


@pytest.fixture(params=LOWERINGS)
def backend_name(request):
    name = f"jax-gpu-{request.param}"
    register_backend(name, JaxBackend(lowering=request.param), replace=True)
    yield name
    unregister_backend(name)


# Mosaic GPU and the CUDA kernel serve block-planes that are one contiguous span (vLLM's NHD
# pages); the tpu-inference pages interleave K and V heads, which only Triton (and XLA) serve.
_SPAN_ONLY = ("mosaic", "cuda")


def _engine(seed=0, nb=32, layers=2, backend_name="jax-gpu-triton"):
    rng = np.random.default_rng(seed)
    if backend_name.endswith(_SPAN_ONLY):
        host = [rng.integers(0, 2**16, (2, nb, 16, 2, 128), dtype=np.uint16) for _ in range(layers)]
        caches = [_gpu(jnp.asarray(h).view(jnp.bfloat16)) for h in host]
        manager = KVLayerGroupsManager(
            caches, [EngineKVFormat.NL_X_TWO_NB_BS_NH_HS] * layers, lmcache_tokens_per_chunk=32
        )
        return host, caches, manager
    host = [rng.integers(0, 2**16, (nb, 16, 2, 2, 128), dtype=np.uint16) for _ in range(layers)]
    caches = [_gpu(jnp.asarray(h).view(jnp.bfloat16)) for h in host]
    fmt, normalized = detect_format(caches, engine="tpu_inference")
    return host, caches, KVLayerGroupsManager(normalized, fmt, lmcache_tokens_per_chunk=32)


def _blocks(a, ids, backend_name):
    """The pages ``ids`` of a cache array (block axis 1 for NHD pages, 0 for packed ones)."""
    return a[:, ids] if backend_name.endswith(_SPAN_ONLY) else a[ids]


def test_gpu_public_calls_inside_a_jitted_step_with_traced_ids(backend_name):
    host, caches, manager = _engine(backend_name=backend_name)
    traces = []

    @jax.jit
    def step(caches, load_ids, store_ids, skip):
        traces.append(1)
        objs = store(manager, caches, store_ids, backend=backend_name)
        return objs, load(
            manager, objs, caches, load_ids, skip_first_n_tokens=skip, backend=backend_name
        )

    for src, dst in [([1, 5, 9, 13], [0, 2, 4, 6]), ([7, 3, 30, 21], [8, 10, 12, 14])]:
        objs, new = step(
            caches, _gpu(np.array(dst, np.int32)), _gpu(np.array(src, np.int32)), _gpu(np.int32(16))
        )
        ref = store(
            manager, [h.view(ml_dtypes.bfloat16) for h in host], np.array(src), backend="numpy"
        )
        np.testing.assert_array_equal(np.asarray(objs[0]), ref[0])
        a = np.asarray(new[0]).view(np.uint16)
        # 16 tokens = one block skipped: dst[0] keeps its bytes, the rest were loaded.
        np.testing.assert_array_equal(
            _blocks(a, dst[1:], backend_name), _blocks(host[0], src[1:], backend_name)
        )
        np.testing.assert_array_equal(
            _blocks(a, dst[0], backend_name), _blocks(host[0], dst[0], backend_name)
        )
    assert len(traces) == 1  # new ids of the same size: no retrace


def test_gpu_vmap_over_caches(backend_name):
    if backend_name.endswith("mosaic"):
        # Mosaic GPU kernels (pl.kernel with scoped SMEM) have no batching rule in jax 0.11:
        # vmap over caches is served by the Triton and XLA lowerings (request one of them).
        _, caches, manager = _engine(0, nb=8, layers=1, backend_name=backend_name)
        batch = jnp.stack([caches[0]] * 2)
        with pytest.raises(NotImplementedError, match="Batching rule"):
            jax.vmap(
                lambda c: store(manager, [c], np.array([1, 5, 2, 6]), backend=backend_name)[0]
            )(batch)
        return
    hosts, stacked = [], []
    for seed in range(3):
        host, caches, manager = _engine(seed, nb=8, layers=1, backend_name=backend_name)
        hosts.append(host[0])
        stacked.append(caches[0])
    batch = jnp.stack(stacked)
    ids = np.array([1, 5, 2, 6])
    out = jax.vmap(lambda c: store(manager, [c], ids, backend=backend_name)[0])(batch)
    for b in range(3):
        ref = store(manager, [hosts[b].view(ml_dtypes.bfloat16)], ids, backend="numpy")[0]
        np.testing.assert_array_equal(np.asarray(out[b]), ref)
