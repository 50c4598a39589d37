"""The TPU lowering (kvgroups_jax.lowerings.tpu) in Pallas' TPU interpret mode on the CPU: DMAs
per group transfer equal to the number of runs, the device run table equal to the core's runs,
one compiled program for every request size, heads-sharded caches under shard_map, pinned_host
objects, tpu-inference's two-shape hybrid (Gemma-4-like) and the choice of lowering. Bytes are
compared with the NumPy backend; every layout and the traced-id cases run in test_kernels.py
and test_jax_engine_native.py (whose lowering lists include "tpu-interpret")."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from kvgroups_jax import PAD_ID, JaxBackend, executor, pad_block_ids
from kvgroups_jax.engines import from_tpu_inference
from kvgroups_jax.geometry import group_geometry
from kvgroups_jax.lowerings import tpu
from kvgroups_jax.lowerings.tpu_windows import plan_dmas

from kvgroups_core import KVLayerGroupsManager, detect_format, load, prepare, store
from kvgroups_core.errors import KVGroupsValueError, UnsupportedConfigError
from kvgroups_core.tensors.arrays import register_backend, registered_backends, unregister_backend
from kvgroups_core.transfer.block_runs import block_runs
from kvgroups_core.transfer.reference import execute_group
from tests.support.jax_layouts import make_group, make_plan

TPU = "jax-tpu-interpret"


@pytest.fixture(scope="module", autouse=True)
def tpu_backend():
    # Installed kvgroups registers it as an entry point; an older install of the package
    # metadata may lack it, then the same backend is registered here for this module.
    added = TPU not in registered_backends()
    if added:
        register_backend(TPU, JaxBackend(lowering="tpu-interpret"))
    yield
    if added:
        unregister_backend(TPU)


def _bf16(rng, shape):
    return rng.integers(0, 2**16, shape, dtype=np.uint16).view(ml_dtypes.bfloat16)


# --- DMAs per group transfer: one per run and plane ------------------------------------------


@pytest.mark.parametrize("ids", ["scattered", "consecutive", "two_runs_per_chunk"])
@pytest.mark.parametrize("layout", ["nhd", "heads_outer"])
def test_dmas_per_group_transfer_equal_runs_times_planes(layout, ids):
    id_sets = {
        "scattered": np.array([9, 3, 30, 17, 4, 22, 11, 0]),
        "consecutive": np.arange(12, 20),
        "two_runs_per_chunk": np.array([2, 3, 10, 11, 20, 21, 22, 5]),
    }
    arrays, g = make_group(layout, "bfloat16", num_chunks=2, bpc=4, nb=32, ids=id_sets[ids])
    nbytes = g.num_planes * g.slots * g.row_bytes
    plan = make_plan("store", [g], arrays, [nbytes])
    geom = group_geometry(g, plan.tensor_specs, nbytes)
    dmas = plan_dmas(geom)
    runs = block_runs(g)
    assert runs.count == {"scattered": 8, "consecutive": 2, "two_runs_per_chunk": 4}[ids]

    @jax.jit
    def launch(caches, obj, meta, ids):
        views = tuple(c.reshape(-1).view(jnp.uint16) for c in caches)
        out, count = tpu.copy_group(
            "store",
            geom,
            8,
            meta,
            ids,
            obj.view(jnp.uint16),
            views,
            interpret=True,
            count_dmas=True,
        )
        return out, count

    obj = jnp.zeros((2, nbytes // 2), jnp.uint16).view(jnp.uint8)
    out, count = launch(
        [jnp.asarray(a) for a in arrays],
        obj,
        jnp.array([0, g.num_items], jnp.int32),
        jnp.asarray(g.block_ids, jnp.int32),
    )
    per_run = {"nhd": 1, "heads_outer": 2}[layout]  # heads outermost: one DMA per head
    assert dmas.dmas_per_run() == g.num_planes * per_run
    assert int(count[0]) == runs.count * g.num_planes * per_run
    ref = np.zeros((2, nbytes), np.uint8)
    execute_group(g, True, [a.copy().view(np.uint8).reshape(-1) for a in arrays], ref)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8).reshape(2, -1), ref)


@pytest.mark.parametrize("seed", range(6))
def test_the_device_run_table_is_the_cores_runs(seed):
    rng = np.random.default_rng(seed)
    kept, bpc, chunks, nb = 3, 4, 5, 24
    ids = np.where(
        rng.random(chunks * bpc) < 0.7,
        np.arange(chunks * bpc),
        rng.integers(-3, nb + 3, chunks * bpc),
    )  # runs, strays and bad ids
    arrays, g = make_group(
        "nhd",
        "float16",
        num_chunks=chunks,
        bpc=bpc,
        kept=kept,
        nb=nb,
        ids=ids,
        first_item=int(rng.integers(0, 4)),
    )
    plan = make_plan("load", [g], arrays, [g.num_planes * g.slots * g.row_bytes])
    geom = group_geometry(g, plan.tensor_specs, plan.object_nbytes[0])
    grid = executor.bucket(g.num_items)
    table = np.asarray(
        tpu.run_table(
            jnp.array([g.first_item, g.num_items], jnp.int32),
            jnp.asarray(executor._padded_ids(ids)),
            geom,
            grid,
        )
    )
    want = block_runs(g, num_blocks=nb)
    n = int(table[0])
    field = [table[1 + k * grid : 1 + k * grid + n] for k in range(4)]
    assert n == want.count
    np.testing.assert_array_equal(field[0] * kept + field[1], want.dst)
    np.testing.assert_array_equal(field[2], want.src)
    np.testing.assert_array_equal(field[3], want.length)


# --- one compiled program for every request size -------------------------------------------


def test_one_program_serves_every_request_size_with_ids_padded_to_a_bucket():
    max_chunks, bpc = 4, 2
    rng = np.random.default_rng(3)
    host = [_bf16(rng, (40, 4, 2, 2, 8)) for _ in range(2)]
    caches = [jnp.asarray(h) for h in host]
    fmt, normalized = detect_format(caches, engine="tpu_inference")
    manager = KVLayerGroupsManager(normalized, fmt, lmcache_tokens_per_chunk=8)
    nbytes = store(manager, host, np.arange(bpc), backend="numpy")[0].shape[1]

    @jax.jit
    def save(caches, pool, ids):  # an engine step: one request's pages into the pool
        return store(manager, caches, ids, pool, backend=TPU)

    @jax.jit
    def restore(caches, pool, ids):
        return load(manager, pool, caches, ids, backend=TPU)

    before = executor.trace_count()
    sentinel = rng.integers(0, 256, (max_chunks, nbytes), dtype=np.uint8)
    for chunks in range(1, max_chunks + 1):
        ids = rng.permutation(40)[: chunks * bpc]
        pool = save(caches, [jnp.asarray(sentinel)], pad_block_ids(ids, max_chunks, bpc))
        got = np.asarray(pool[0])
        np.testing.assert_array_equal(got[:chunks], store(manager, host, ids, backend="numpy")[0])
        np.testing.assert_array_equal(got[chunks:], sentinel[chunks:])  # padding: no DMA
        dst_ids = rng.permutation(40)[: chunks * bpc]
        dst = restore(
            [jnp.zeros_like(c) for c in caches], pool, pad_block_ids(dst_ids, max_chunks, bpc)
        )
        for d, h in zip(dst, host):
            want = np.zeros_like(h)
            want[dst_ids] = h[ids]
            np.testing.assert_array_equal(np.asarray(d).view(np.uint16), want.view(np.uint16))
    # Requests of 1 .. 4 chunks: one store and one load program, each compiled once.
    assert executor.trace_count() - before == 2
    assert save._cache_size() == 1 and restore._cache_size() == 1


def test_padding_ids_fit_the_bucket_or_are_refused():
    padded = np.asarray(pad_block_ids(np.array([5, 6, 7]), 4, 2))
    np.testing.assert_array_equal(padded, [5, 6, 7, PAD_ID, PAD_ID, PAD_ID, PAD_ID, PAD_ID])
    with pytest.raises(KVGroupsValueError, match="at most 8 block ids"):
        pad_block_ids(np.arange(9), 4, 2)


# --- sharded caches, pinned host objects, the hybrid tpu-inference layout -------------------


@pytest.mark.skipif(len(jax.devices("cpu")) < 2, reason="needs 2 CPU devices (conftest sets 8)")
def test_heads_sharded_caches_move_per_shard_under_shard_map():
    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
    sharding = NamedSharding(mesh, P(None, None, "model", None, None))
    rng = np.random.default_rng(5)
    host = [_bf16(rng, (8, 4, 4, 2, 8)) for _ in range(2)]
    caches = [jax.device_put(h, sharding) for h in host]
    fmt, normalized = detect_format(caches, engine="tpu_inference")
    manager = KVLayerGroupsManager(normalized, fmt, lmcache_tokens_per_chunk=8)
    ids = np.array([1, 5, 2, 6])
    objs = store(manager, caches, ids, backend=TPU)
    assert objs[0].sharding.spec == P(None, "model")
    # Each shard's half of the object is what a manager of that shard alone stores.
    got = np.asarray(objs[0])
    half = got.shape[1] // 2
    for r in range(2):
        local = [np.ascontiguousarray(h[:, :, 2 * r : 2 * r + 2]) for h in host]
        lfmt, lnorm = detect_format(local, engine="tpu_inference")
        want = store(
            KVLayerGroupsManager(lnorm, lfmt, lmcache_tokens_per_chunk=8),
            local,
            ids,
            backend="numpy",
        )[0]
        np.testing.assert_array_equal(got[:, r * half : (r + 1) * half], want)
    dst = [jax.device_put(np.zeros_like(h), sharding) for h in host]
    out = load(manager, objs, dst, np.array([7, 0, 3, 4]), backend=TPU)
    for o, h, d in zip(out, host, [np.zeros_like(h) for h in host]):
        d[[7, 0, 3, 4]] = h[[1, 5, 2, 6]]
        np.testing.assert_array_equal(np.asarray(o).view(np.uint16), d.view(np.uint16))
        assert o.sharding == sharding


@pytest.mark.skipif(len(jax.devices("cpu")) < 2, reason="needs 2 CPU devices (conftest sets 8)")
@pytest.mark.parametrize("check_vma", [True, False])
def test_engine_shard_map_with_a_per_shard_manager(check_vma):
    # The engine's own shard_map (check_vma=True is its default): the TPU kernel's outputs
    # vary over the mesh axes its operands vary over, as the shard_map checks.
    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
    heads = P(None, None, "model", None, None)
    rng = np.random.default_rng(8)
    host = [_bf16(rng, (8, 4, 4, 2, 8)) for _ in range(2)]
    caches = [jax.device_put(h, NamedSharding(mesh, heads)) for h in host]
    local = [np.ascontiguousarray(h[:, :, :2]) for h in host]
    fmt, normalized = detect_format(local, engine="tpu_inference")
    manager = KVLayerGroupsManager(normalized, fmt, lmcache_tokens_per_chunk=8)
    ids = jnp.array([1, 5, 2, 6])

    def step(cs, ids):
        objs = store(manager, cs, ids, backend=TPU)
        return objs[0], load(manager, objs, cs, ids[::-1], backend=TPU)

    obj, out = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=([heads, heads], P()),
            out_specs=(P(None, "model"), [heads, heads]),
            check_vma=check_vma,
        )
    )(caches, ids)
    got = np.asarray(obj)
    half = got.shape[1] // 2
    for r in range(2):
        shard = [np.ascontiguousarray(h[:, :, 2 * r : 2 * r + 2]) for h in host]
        want = store(manager, shard, np.asarray(ids), backend="numpy")[0]
        np.testing.assert_array_equal(got[:, r * half : (r + 1) * half], want)
    for o, h in zip(out, host):
        want = h.copy()
        want[[6, 2, 5, 1]] = h[[1, 5, 2, 6]]
        np.testing.assert_array_equal(np.asarray(o).view(np.uint16), want.view(np.uint16))


def test_pinned_host_objects_are_staged_through_device_memory():
    rng = np.random.default_rng(6)
    host = [_bf16(rng, (16, 4, 2, 2, 8)) for _ in range(3)]
    caches = [jnp.asarray(h) for h in host]
    fmt, normalized = detect_format(caches, engine="tpu_inference")
    manager = KVLayerGroupsManager(normalized, fmt, lmcache_tokens_per_chunk=8)
    pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    ids = np.array([3, 9, 1, 14])
    want = store(manager, host, ids, backend="numpy")
    given = [jax.device_put(jnp.zeros(w.shape, jnp.uint8), pinned) for w in want]
    got = prepare(manager, caches, backend=TPU).store(ids, given)
    for g, w in zip(got, want):
        assert g.sharding.memory_kind == "pinned_host"  # as tpu-inference keeps its objects
        np.testing.assert_array_equal(np.asarray(g), w)
    sub = store(
        manager,
        caches,
        ids,
        [jax.device_put(jnp.asarray(w), pinned) for w in want],
        layers=[1],
        backend=TPU,
    )
    np.testing.assert_array_equal(np.asarray(sub[0]), want[0])
    dst = [jnp.zeros_like(c) for c in caches]
    out = load(manager, got, dst, np.array([0, 2, 4, 6]), backend=TPU)
    for o, h in zip(out, host):
        expect = np.zeros_like(h)
        expect[[0, 2, 4, 6]] = h[ids]
        np.testing.assert_array_equal(np.asarray(o).view(np.uint16), expect.view(np.uint16))


def test_tpu_inference_hybrid_with_two_cache_shapes_round_trips():
    # Gemma-4-like: sliding-window layers with head_dim 256 and full-attention layers with
    # head_dim 512 and fewer KV heads, one array per layer in tpu-inference's own shape
    # [num_pages, page_size, 2*heads // packing, packing, head_dim] (bf16: packing 2).
    rng = np.random.default_rng(7)
    pages, page = 24, 4
    sliding = [0, 1, 3, 4]
    shapes = {
        i: (pages, page, 2, 2, 256) if i in sliding else (pages, page, 1, 2, 512) for i in range(6)
    }
    host = [_bf16(rng, shapes[i]) for i in range(6)]
    layout = from_tpu_inference(
        [jnp.asarray(h) for h in host],
        layer_groups=[sliding, [2, 5]],
        windows=[8, -1],
        chunk_size=8,
    )
    manager = layout.manager
    assert manager.num_kernel_groups == 2  # two cache shapes: one kernel group each
    assert {g.shape_desc.hs for g in manager.kernel_groups} == {256, 512}
    ids = {0: rng.permutation(pages)[:6], 1: rng.permutation(pages)[:6]}
    numpy_views = [h.reshape(h.shape[0], h.shape[1], -1, 2, h.shape[-1]) for h in host]
    want = store(manager, numpy_views, [ids[0], ids[1]], backend="numpy")
    objs = store(manager, layout.kv_caches, [ids[0], ids[1]], backend=TPU)
    for o, w in zip(objs, want):
        np.testing.assert_array_equal(np.asarray(o), w)
    dst_host = [np.zeros_like(v) for v in numpy_views]
    dst = [jnp.asarray(d) for d in dst_host]
    back = load(manager, objs, dst, [ids[0], ids[1]], backend=TPU)
    load(manager, want, dst_host, [ids[0], ids[1]], backend="numpy")
    engine = layout.to_engine(back)
    for e, d, s in zip(engine, dst_host, host):
        assert e.shape == s.shape
        np.testing.assert_array_equal(
            np.asarray(e).view(np.uint16).reshape(d.shape), d.view(np.uint16)
        )


# --- which lowering runs --------------------------------------------------------------------


def test_explicit_tpu_on_concrete_cpu_arrays_is_refused_and_auto_picks_it_on_a_tpu():
    arrays, g = make_group("nhd", "bfloat16")
    plan = make_plan("store", [g], arrays, [g.num_planes * g.slots * g.row_bytes])
    geom = group_geometry(g, plan.tensor_specs, plan.object_nbytes[0])
    with pytest.raises(UnsupportedConfigError, match="'tpu' compiles for a TPU.*tpu-interpret"):
        executor.execute_plan(plan, [jnp.asarray(a) for a in arrays], [None], lowering="tpu")
    assert executor.resolve_lowering("auto", geom, "tpu") == "tpu"
    assert executor.resolve_lowering("tpu", geom, executor.TRACED) == "tpu"
    assert executor.resolve_lowering("tpu-interpret", geom, "cpu") == "tpu-interpret"
    assert executor.resolve_lowering("auto", geom, "cpu") == "xla"


def test_lower_plan_lowers_the_tpu_kernels_in_place_without_a_tpu():
    arrays, g = make_group("hnd", "bfloat16", first_item=1)
    nbytes = g.num_planes * g.slots * g.row_bytes
    plan = make_plan("load", [g], arrays, [nbytes])
    text = executor.lower_plan(
        plan,
        "tpu",
        [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays],
        [jax.ShapeDtypeStruct((2, nbytes), jnp.uint8)],
        platform="tpu",
    ).as_text()
    assert "@tpu_custom_call" in text and "kvgroups_load_pages_tpu" in text
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert main.count("tf.aliasing_output") == len(arrays)  # every cache donated, in place


def test_pinned_host_objects_inside_jit_are_staged_through_device_memory():
    # The staging is the backend's, whatever the lowering: the TPU kernels are lowered (TPU
    # interpret mode's host callbacks and memory kinds do not lower together in jax 0.10)
    # and the bytes are checked through the XLA lowering, inside jax.jit both.
    rng = np.random.default_rng(8)
    host = [_bf16(rng, (16, 4, 2, 2, 8)) for _ in range(2)]
    caches = [jnp.asarray(h) for h in host]
    fmt, normalized = detect_format(caches, engine="tpu_inference")
    manager = KVLayerGroupsManager(normalized, fmt, lmcache_tokens_per_chunk=8)
    pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    ids = np.array([3, 9, 1, 14])
    want = store(manager, host, ids, backend="numpy")
    given = [jax.device_put(jnp.asarray(w), pinned) for w in want]
    jids = jnp.asarray(ids, jnp.int32)
    register_backend("jax-cpu-tpu", JaxBackend(lowering="tpu"), replace=True)
    register_backend("jax-cpu-xla", JaxBackend(lowering="xla"), replace=True)
    try:

        def save(kv, objects, ids, backend):
            return store(manager, kv, ids, objects, layers=[1], backend=backend)

        def restore(kv, objects, ids, backend):
            return load(manager, objects, kv, ids, backend=backend)

        text = (
            jax.jit(save, static_argnums=3)
            .trace(caches, given, jids, "jax-cpu-tpu")
            .lower(lowering_platforms=("tpu",))
            .as_text()
        )
        # The kernel reads and writes device memory: the object goes in and comes back out.
        assert "@tpu_custom_call" in text
        assert '_xla_buffer_placement = "device"' in text
        assert '_xla_buffer_placement = "pinned_host"' in text
        text = (
            jax.jit(restore, static_argnums=3)
            .trace(caches, given, jids, "jax-cpu-tpu")
            .lower(lowering_platforms=("tpu",))
            .as_text()
        )
        assert "@tpu_custom_call" in text and '_xla_buffer_placement = "device"' in text
        got = jax.jit(save, static_argnums=3)(caches, given, jids, "jax-cpu-xla")
        assert got[0].sharding.memory_kind == "pinned_host"
        np.testing.assert_array_equal(np.asarray(got[0]), want[0])
        out = jax.jit(restore, static_argnums=3)(
            [jnp.zeros_like(c) for c in caches], got, jnp.asarray([0, 2, 4, 6]), "jax-cpu-xla"
        )
        for o, h in zip(out, host):
            expect = np.zeros_like(h)
            expect[[0, 2, 4, 6]] = h[ids]
            np.testing.assert_array_equal(np.asarray(o).view(np.uint16), expect.view(np.uint16))
    finally:
        unregister_backend("jax-cpu-tpu")
        unregister_backend("jax-cpu-xla")
