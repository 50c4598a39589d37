"""The executor as JAX engines call it: a store that creates its objects, ids traced inside
jax.jit, out-of-range traced ids dropped in the kernels and reported through checkify.
Bytes are compared with the NumPy oracle (kvgroups_core.transfer.reference)."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import checkify
from kvgroups_jax.executor import execute_plan

from tests.support.jax_checks import as_bytes, reference_transfer
from tests.support.jax_layouts import make_group, make_plan

LOWERINGS = ["interpret", "xla", "tpu-interpret"]


def _nbytes(g):
    return g.num_planes * g.slots * g.row_bytes


def _expected(direction, group, arrays, obj):
    exp_c = [a.copy().view(np.uint8).reshape(-1) for a in arrays]
    exp_o = obj.copy().reshape(-1)
    reference_transfer(direction, group, exp_c, exp_o, _nbytes(group))
    return exp_c, exp_o


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("layout", ["nhd", "interleaved", "heads_outer"])
def test_store_without_objects_returns_the_reference_bytes(lowering, layout):
    arrays, g = make_group(layout, "bfloat16", nb=8, num_chunks=2, bpc=2)
    plan = make_plan("store", [g], arrays, [_nbytes(g)])
    _, exp_o = _expected("store", g, arrays, np.zeros((2, _nbytes(g)), np.uint8))
    _, objs = execute_plan(plan, [jnp.asarray(a) for a in arrays], [None], lowering=lowering)
    assert objs[0].shape == (2, _nbytes(g)) and objs[0].dtype == jnp.uint8
    np.testing.assert_array_equal(as_bytes(objs[0]), exp_o)


def _traced_load(lowering, g, arrays, obj, ids):
    plan = make_plan("load", [g], arrays, [_nbytes(g)])

    def step(caches, obj, ids):
        traced = replace(plan, groups=(replace(plan.groups[0], block_ids=ids),))
        return execute_plan(traced, caches, [obj], lowering=lowering)[0]

    return step


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_traced_ids_under_jit_match_the_eager_call(lowering):
    arrays, g = make_group("hnd", "bfloat16", nb=16, num_chunks=2, bpc=2)
    obj = np.random.default_rng(3).integers(0, 256, (2, _nbytes(g)), np.uint8)
    ids = np.array([5, 1, 9, 12])
    g = replace(g, block_ids=ids)
    exp_c, _ = _expected("load", g, arrays, obj)
    step = jax.jit(_traced_load(lowering, g, arrays, obj, ids))
    out = step([jnp.asarray(a) for a in arrays], jnp.asarray(obj), jnp.asarray(ids, jnp.int32))
    for c, e in zip(out, exp_c):
        np.testing.assert_array_equal(as_bytes(c), e)


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_out_of_range_traced_ids_move_nothing_and_checkify_names_them(lowering):
    arrays, g = make_group("nhd", "float16", nb=8, num_chunks=2, bpc=2)
    obj = np.random.default_rng(4).integers(0, 256, (2, _nbytes(g)), np.uint8)
    good = np.array([2, 3, 6, 7])
    bad = np.array([2, 3, 6, 42])  # item 3 names a block the caches do not have
    # Expected: every item but the bad one moved; block 7 (which a clamp would hit) untouched.
    ref = [a.copy().view(np.uint8).reshape(-1) for a in arrays]
    full_c, _ = _expected("load", replace(g, block_ids=good), arrays, obj)
    e = arrays[0].dtype.itemsize
    block_bytes = 4 * 2 * 8 * e  # bs * nh * hs
    step = checkify.checkify(jax.jit(_traced_load(lowering, g, arrays, obj, bad)))
    err, out = step([jnp.asarray(a) for a in arrays], jnp.asarray(obj), jnp.asarray(bad, jnp.int32))
    with pytest.raises(
        checkify.JaxRuntimeError,
        match=r"block_ids: expected ids in \[0, 8\).*"
        r"got 42",
    ):
        err.throw()
    for slot, (c, before, moved) in enumerate(zip(out, ref, full_c)):
        got = as_bytes(c)
        for kv in range(2):
            plane = kv * 8 * block_bytes
            for blk in range(8):
                lo = plane + blk * block_bytes
                want = moved if blk in (2, 3, 6) else before
                np.testing.assert_array_equal(
                    got[lo : lo + block_bytes],
                    want[lo : lo + block_bytes],
                    err_msg=f"slot {slot} plane {kv} block {blk}",
                )
    err, _ = step([jnp.asarray(a) for a in arrays], jnp.asarray(obj), jnp.asarray(good, jnp.int32))
    assert err.get() is None


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_out_of_range_traced_ids_on_store_leave_given_objects_untouched(lowering):
    arrays, g = make_group("nhd", "float16", nb=8, num_chunks=2, bpc=2)
    plan = make_plan("store", [g], arrays, [_nbytes(g)])
    obj = np.random.default_rng(5).integers(0, 256, (2, _nbytes(g)), np.uint8)

    def step(caches, obj, ids):
        traced = replace(plan, groups=(replace(plan.groups[0], block_ids=ids),))
        return execute_plan(traced, caches, [obj], lowering=lowering)[1][0]

    good = np.array([1, 0, 5, 4])
    _, exp_o = _expected("store", replace(g, block_ids=good), arrays, obj)
    err, out = checkify.checkify(jax.jit(step))(
        [jnp.asarray(a) for a in arrays], jnp.asarray(obj), jnp.asarray([1, -3, 5, 4], jnp.int32)
    )
    assert "got -3" in str(err.get())
    got = as_bytes(out).reshape(2, -1)
    want = exp_o.reshape(2, -1)
    row = g.row_bytes
    # Chunk 0, position 1 (the bad id) keeps the given bytes in every plane; the rest moved.
    for plane in range(g.num_planes):
        for pos in range(2):
            for chunk in range(2):
                lo = (plane * g.slots + pos * g.block_size) * row
                sl = slice(lo, lo + g.block_size * row)
                expect = obj[chunk, sl] if (chunk, pos) == (0, 1) else want[chunk, sl]
                np.testing.assert_array_equal(got[chunk, sl], expect)


# --- the public calls inside jax.jit (planning from abstract values) -------------------------

NB, BS, NH, HS, TOKENS = 16, 4, 2, 8, 8


@pytest.fixture(params=LOWERINGS)
def backend_name(request):
    from kvgroups_jax import JaxBackend

    from kvgroups_core.tensors.arrays import register_backend, unregister_backend

    name = f"jax-cpu-{request.param}"
    register_backend(name, JaxBackend(lowering=request.param), replace=True)
    yield name
    unregister_backend(name)


def _engine(seed=0, layers=2):
    from kvgroups_core import KVLayerGroupsManager, detect_format

    rng = np.random.default_rng(seed)
    host = [
        rng.integers(0, 2**16, (NB, BS, NH, 2, HS), dtype=np.uint16).view(ml_dtypes.bfloat16)
        for _ in range(layers)
    ]
    caches = [jnp.asarray(h) for h in host]
    fmt, normalized = detect_format(caches, engine="tpu_inference")
    return host, caches, KVLayerGroupsManager(normalized, fmt, lmcache_tokens_per_chunk=TOKENS)


def test_public_store_and_load_under_jit_with_traced_ids_and_skip(backend_name):
    from kvgroups_core import load, store

    host, caches, manager = _engine()
    traces = []

    @jax.jit
    def step(caches, load_ids, store_ids, skip):
        traces.append(1)
        objs = store(manager, caches, store_ids, backend=backend_name)
        return objs, load(
            manager, objs, caches, load_ids, skip_first_n_tokens=skip, backend=backend_name
        )

    for src, dst, skip in [
        ([1, 5, 9, 13], [0, 2, 4, 6], 4),
        ([7, 3, 15, 11], [8, 10, 12, 14], 0),
        ([2, 4, 6, 8], [1, 3, 5, 7], 9),
    ]:
        objs, new = step(
            caches, jnp.asarray(dst, jnp.int32), jnp.asarray(src, jnp.int32), jnp.int32(skip)
        )
        ref = store(manager, host, np.array(src), backend="numpy")
        np.testing.assert_array_equal(np.asarray(objs[0]), ref[0])
        want = load(
            manager,
            ref,
            [h.copy() for h in host],
            np.array(dst),
            skip_first_n_tokens=skip,
            backend="numpy",
        )
        for n, w in zip(new, want):
            np.testing.assert_array_equal(np.asarray(n).view(np.uint16), w.view(np.uint16))
    assert len(traces) == 1  # new ids and skips of the same size: one trace


def test_prepared_calls_and_the_manager_work_on_tracers(backend_name):
    from kvgroups_core import KVLayerGroupsManager, detect_format, prepare

    host, caches, _ = _engine(1)

    @jax.jit
    def step(caches, ids):
        fmt, normalized = detect_format(caches, engine="tpu_inference")
        manager = KVLayerGroupsManager(normalized, fmt, lmcache_tokens_per_chunk=TOKENS)
        prepared = prepare(manager, caches, backend=backend_name)
        objs = prepared.store(ids)
        return prepared.load(objs, ids[::-1])

    ids = np.array([3, 12, 6, 1])
    new = step(caches, jnp.asarray(ids, jnp.int32))
    for n, h in zip(new, host):
        a = np.asarray(n).view(np.uint16)
        np.testing.assert_array_equal(a[ids[::-1]], h.view(np.uint16)[ids])


def test_out_of_range_traced_ids_through_the_public_store_are_reported(backend_name):
    from kvgroups_core import store

    host, caches, manager = _engine(2)
    step = checkify.checkify(jax.jit(lambda c, i: store(manager, c, i, backend=backend_name)))
    err, _ = step(caches, jnp.asarray([1, 99, 2, 3], jnp.int32))
    assert "block_ids" in str(err.get()) and "got 99" in str(err.get())
    err, _ = step(caches, jnp.asarray([1, 9, 2, 3], jnp.int32))
    assert err.get() is None


def test_jitted_calls_with_traced_ids_carry_no_effect(backend_name):
    # An effect (checkify.debug_check puts one on the program) moves every call of the
    # engine's jitted step off JAX's C++ dispatch path (docs/PERFORMANCE.md has the cost).
    from kvgroups_jax import id_checks

    from kvgroups_core import load, store

    _, caches, manager = _engine(3)
    ids = jnp.asarray([1, 9, 2, 3], jnp.int32)
    objs = store(manager, caches, np.array([1, 9, 2, 3]), backend=backend_name)
    if backend_name.endswith("tpu-interpret"):
        # The TPU interpreter runs the kernel through host callbacks (effects of its own):
        # the program a TPU runs is the "tpu" lowering's, traced here without running.
        from kvgroups_jax import JaxBackend

        from kvgroups_core.tensors.arrays import register_backend

        backend_name = "jax-cpu-tpu"
        register_backend(backend_name, JaxBackend(lowering="tpu"), replace=True)

    def step(c, o, i):
        return store(manager, load(manager, o, c, i, backend=backend_name), i, backend=backend_name)

    jaxpr = jax.make_jaxpr(step)(caches, objs, ids)
    assert id_checks.EFFECT_FREE
    assert not jaxpr.effects, jaxpr.effects
    assert "kvgroups_block_ids_check" in str(jaxpr)  # the check is there, for checkify


def test_checkify_names_a_bad_traced_id_under_vmap(backend_name):
    from kvgroups_core import store

    host, _, manager = _engine(4, layers=1)
    batch = jnp.asarray(np.stack([host[0]] * 3))  # host bits (jnp.stack may rewrite NaNs)
    ids = jnp.asarray([[1, 5, 2, 6], [1, 5, 2, 77], [0, 1, 2, 3]], jnp.int32)
    mapped = jax.vmap(lambda c, i: store(manager, [c], i, backend=backend_name)[0])
    err, objs = checkify.checkify(jax.jit(mapped))(batch, ids)
    assert "got 77" in str(err.get())
    for b in (0, 2):  # the batch elements with good ids moved their pages
        np.testing.assert_array_equal(
            np.asarray(objs[b]), store(manager, [host[0]], np.asarray(ids[b]), backend="numpy")[0]
        )
    err, _ = checkify.checkify(jax.jit(mapped))(batch, ids.at[1, 3].set(7))
    assert err.get() is None


def _hybrid(seed=0, nb=40):
    from kvgroups_core import KVLayerGroupsManager
    from kvgroups_tools.catalog import MODELS

    model = MODELS["hybrid-demo"].build(num_blocks=nb, layers=4, dtype="float16")
    rng = np.random.default_rng(seed)
    host = [
        rng.integers(0, 2**16, s.shape, dtype=np.uint16).view(np.float16) for s in model.kv_caches
    ]
    manager = KVLayerGroupsManager(
        host, list(model.formats), model.engine_group_infos, lmcache_tokens_per_chunk=256
    )
    return host, manager


def _group_ids(manager, rng, chunks=2, nb=40):
    out = {}
    for k, g in enumerate(manager.kernel_groups):
        out.setdefault(
            g.engine_group_idx, rng.permutation(nb)[: chunks * manager.calculate_num_blocks(k, 256)]
        )
    return out


def test_per_engine_group_traced_ids_and_device_window_skips_match_numpy(backend_name):
    from kvgroups_core import load, store

    host, manager = _hybrid()
    assert len({g.engine_group_idx for g in manager.kernel_groups}) > 1
    rng = np.random.default_rng(1)
    traces = []

    @jax.jit
    def step(caches, src, dst, skip):
        traces.append(1)
        objs = store(manager, caches, src, backend=backend_name)
        return objs, load(
            manager, objs, caches, dst, skip_first_n_tokens=skip, backend=backend_name
        )

    for skip in (0, 300):  # 300 tokens: the first chunk and part of the second skipped
        src, dst = _group_ids(manager, rng), _group_ids(manager, rng)
        objs, new = step(
            [jnp.asarray(h) for h in host],
            {g: jnp.asarray(v, jnp.int32) for g, v in src.items()},
            {g: jnp.asarray(v, jnp.int32) for g, v in dst.items()},
            jnp.int32(skip),
        )
        ref = store(manager, host, src, backend="numpy")
        for o, r in zip(objs, ref):
            np.testing.assert_array_equal(np.asarray(o), r)
        want = load(
            manager, ref, [h.copy() for h in host], dst, skip_first_n_tokens=skip, backend="numpy"
        )
        for n, w in zip(new, want):
            np.testing.assert_array_equal(np.asarray(n).view(np.uint16), w.view(np.uint16))
    assert len(traces) == 1


def test_layer_subset_store_without_objects_leaves_other_regions_zero(backend_name):
    from kvgroups_core import store

    host, caches, manager = _engine(4, layers=3)
    ids = np.array([3, 7, 1, 12])
    got = jax.jit(lambda c, i: store(manager, c, i, layers=[1], backend=backend_name))(
        caches, jnp.asarray(ids, jnp.int32)
    )
    want = store(manager, host, ids, layers=[1], backend="numpy")
    np.testing.assert_array_equal(np.asarray(got[0]), want[0])
    assert np.asarray(got[0]).any() and (np.asarray(got[0]) == 0).any()


def test_vmap_over_caches_stores_and_loads_each(backend_name):
    from kvgroups_core import load, store

    hosts, _, manager = _engine(5, layers=1)
    batch = np.stack([_engine(s, layers=1)[0][0] for s in range(3)])
    ids = np.array([1, 5, 2, 6])
    objs = jax.vmap(lambda c: store(manager, [c], ids, backend=backend_name)[0])(jnp.asarray(batch))
    for b in range(3):
        np.testing.assert_array_equal(
            np.asarray(objs[b]), store(manager, [batch[b]], ids, backend="numpy")[0]
        )
    new = jax.vmap(
        lambda o, c: load(manager, [o], [c], np.array([0, 3, 7, 4]), backend=backend_name)[0]
    )(objs, jnp.zeros_like(batch))
    a = np.asarray(new).view(np.uint16)
    np.testing.assert_array_equal(a[:, [0, 3, 7, 4]], batch.view(np.uint16)[:, ids])


def test_eager_out_of_range_jax_ids_raise_before_anything_is_donated():
    from kvgroups_core import load, store
    from kvgroups_core.errors import KVGroupsIndexError

    host, caches, manager = _engine(6)
    objs = store(manager, caches, np.array([1, 2, 3, 4]))
    with pytest.raises(KVGroupsIndexError, match=r"block_ids.*\[0, 16\).*got 16"):
        load(manager, objs, caches, jnp.asarray([1, 2, 3, 16], jnp.int32))
    assert not any(c.is_deleted() for c in caches) and not objs[0].is_deleted()


def test_int64_traced_ids_past_int32_are_dropped_not_wrapped():
    arrays, g = make_group("nhd", "float16", nb=8, num_chunks=2, bpc=2)
    obj = np.random.default_rng(4).integers(0, 256, (2, _nbytes(g)), np.uint8)
    exp_c, _ = _expected("load", replace(g, block_ids=np.array([2, 3, 6, 7])), arrays, obj)
    with jax.enable_x64(True):
        ids = jnp.asarray([2, 3, 6, 2**32 + 1], jnp.int64)  # would wrap to block 1
        out = jax.jit(_traced_load("xla", g, arrays, obj, ids))(
            [jnp.asarray(a) for a in arrays], jnp.asarray(obj), ids
        )
    block_bytes = 4 * 2 * 8 * 2
    for c, before, moved in zip(out, arrays, exp_c):
        got, before = as_bytes(c), before.view(np.uint8).reshape(-1)
        for kv in range(2):
            for blk in range(8):
                lo = (kv * 8 + blk) * block_bytes
                want = moved if blk in (2, 3, 6) else before
                np.testing.assert_array_equal(
                    got[lo : lo + block_bytes], want[lo : lo + block_bytes]
                )
