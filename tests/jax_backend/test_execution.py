import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kvgroups_jax import JaxBackend, describe_array, execute_plan, trace_count
from kvgroups_jax.geometry import group_geometry
from kvgroups_jax.lowerings.choice import resolve_lowering

from kvgroups_core.errors import KVGroupsValueError, UnsupportedConfigError
from tests.support.jax_checks import run_and_check
from tests.support.jax_layouts import make_group, make_plan


def _nbytes(g):
    return g.num_planes * g.slots * g.row_bytes


@pytest.mark.parametrize("lowering", ["interpret", "xla", "tpu-interpret"])
def test_load_donates_caches_and_writes_in_place(lowering):
    arrays, g = make_group("hnd", "bfloat16")
    caches, objs, new_c, new_o, ptrs, optrs = run_and_check(
        "load", [g], arrays, [_nbytes(g)], lowering=lowering
    )
    assert [c.unsafe_buffer_pointer() for c in new_c] == ptrs
    assert all(c.is_deleted() for c in caches)
    assert not any(o.is_deleted() for o in objs)  # objects are read, not consumed


@pytest.mark.parametrize("lowering", ["interpret", "xla", "tpu-interpret"])
def test_store_donates_objects_and_keeps_caches(lowering):
    arrays, g = make_group("nhd", "float16")
    caches, objs, new_c, new_o, ptrs, optrs = run_and_check(
        "store", [g], arrays, [_nbytes(g)], lowering=lowering
    )
    assert [o.unsafe_buffer_pointer() for o in new_o] == optrs
    assert all(o.is_deleted() for o in objs)
    assert not any(c.is_deleted() for c in caches)


def test_a_new_item_count_inside_the_bucket_does_not_recompile():
    arrays, g = make_group("nhd", "bfloat16", nb=16, num_chunks=4, bpc=2, first_item=1)
    run_and_check("load", [g], arrays, [_nbytes(g)], lowering="interpret")
    before = trace_count()
    for first in (2, 3):  # 7 -> 6, 5 items: all in bucket 8
        arrays, g = make_group(
            "nhd", "bfloat16", nb=16, num_chunks=4, bpc=2, first_item=first, seed=first
        )
        run_and_check("load", [g], arrays, [_nbytes(g)], lowering="interpret")
    assert trace_count() == before
    arrays, g = make_group("nhd", "bfloat16", nb=16, num_chunks=4, bpc=2, first_item=5)
    run_and_check("load", [g], arrays, [_nbytes(g)], lowering="interpret")  # 3 items: bucket 4
    assert trace_count() == before + 1


def test_describe_concrete_and_abstract_arrays():
    x = jax.device_put(jnp.zeros((2, 3), jnp.bfloat16), jax.devices("cpu")[0])
    d = describe_array(x)
    assert d.spec.shape == (2, 3) and d.spec.dtype.name == "bfloat16" and d.data_ptr != 0
    assert d.spec.device == "cpu" and d.framework == "jax"
    a = describe_array(jax.ShapeDtypeStruct((4, 8), jnp.float8_e4m3fn))
    assert a.is_abstract and a.spec.dtype.itemsize == 1

    seen = []

    @jax.jit
    def f(y):
        seen.append(describe_array(y))
        return y

    f(jnp.ones((5,), jnp.float32))
    assert seen[0].is_abstract and seen[0].spec.shape == (5,)


def test_bool_arrays_are_refused_when_described_and_as_objects():
    # XLA has no bitcast of bool, which every lowering's byte view needs; a convert would
    # copy the whole cache per call. Refused when a cache is described, nothing donated.
    import kvgroups_core as kc
    from kvgroups_core.errors import KVGroupsTypeError

    fmts = [kc.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS] * 2
    shape, ids = (2, 16, 4, 2, 4), np.arange(4)
    bools = [jnp.ones(shape, bool), jnp.zeros(shape, bool)]
    refused = r"^kv_caches\[0\].*expected a JAX array of a dtype with a bitcast to uint8.*got bool"
    with pytest.raises(KVGroupsTypeError, match=refused):
        kc.KVLayerGroupsManager(bools, fmts, lmcache_tokens_per_chunk=8)
    with pytest.raises(KVGroupsTypeError, match="got bool"):
        describe_array(jax.ShapeDtypeStruct(shape, jnp.bool_))
    as_bytes = [jnp.ones(shape, jnp.uint8), jnp.zeros(shape, jnp.uint8)]
    manager = kc.KVLayerGroupsManager(as_bytes, fmts, lmcache_tokens_per_chunk=8)
    objects = kc.store(manager, as_bytes, ids)
    for call in (
        lambda: kc.store(manager, bools, ids),
        lambda: kc.load(manager, objects, bools, ids),
        lambda: kc.prepare(manager, bools),
    ):
        with pytest.raises(KVGroupsTypeError, match=refused):
            call()
    assert not any(b.is_deleted() for b in bools)
    assert bool(bools[0].all()) and not bool(bools[1].any())
    # A bool object is named by the object rule as not uint8, before the caches are donated.
    flags = [objects[0].astype(bool)]
    with pytest.raises(KVGroupsValueError, match=r"^objects\[0\]: expected uint8 .*got bool"):
        kc.load(manager, flags, as_bytes, ids)
    assert not any(c.is_deleted() for c in as_bytes)


def test_planning_works_on_traced_values_under_jit():
    arrays, g = make_group("nhd", "float32")
    plan = make_plan("store", [g], arrays, [_nbytes(g)])

    @jax.jit
    def store(caches, objs):
        return execute_plan(plan, caches, objs, lowering="xla")[1]

    objs = [jnp.zeros((g.num_chunks, _nbytes(g)), jnp.uint8)]
    out = store([jnp.asarray(a) for a in arrays], objs)
    assert out[0].shape == objs[0].shape


def test_explicit_gpu_lowerings_refuse_cpu_with_unsupported_config():
    arrays, g = make_group("nhd", "bfloat16")
    geom = group_geometry(g, make_plan("store", [g], arrays, [_nbytes(g)]).tensor_specs, _nbytes(g))
    for lowering in ("cuda", "triton", "mosaic"):
        with pytest.raises(UnsupportedConfigError, match="needs a CUDA GPU"):
            resolve_lowering(lowering, geom, "cpu")
    assert resolve_lowering("auto", geom, "cpu") == "xla"
    with pytest.raises(KVGroupsValueError, match="lowering"):
        JaxBackend(lowering="pallas")


def test_wrong_object_shape_is_rejected_before_anything_is_donated():
    arrays, g = make_group("nhd", "bfloat16")
    plan = make_plan("load", [g], arrays, [_nbytes(g)])
    caches = [jnp.asarray(a) for a in arrays]
    bad = [jnp.zeros((g.num_chunks, _nbytes(g) + 2), jnp.uint8)]
    with pytest.raises(KVGroupsValueError, match=r"objects\[0\]"):
        execute_plan(plan, caches, bad)
    assert not any(c.is_deleted() for c in caches)


def test_execute_plan_applies_the_core_object_rule_before_anything_is_donated():
    # The same rule and message as the core's calls (kvgroups_core.transfer.objects): one
    # [num_chunks, nbytes] uint8 array per object group; a pool with more rows than the plan's
    # chunks is refused like any other shape. A store's None is an object it creates.
    from kvgroups_core.errors import KVGroupsError, KVGroupsTypeError
    from kvgroups_core.transfer.objects import check_objects

    arrays, g = make_group("nhd", "bfloat16")
    plan = make_plan("load", [g], arrays, [_nbytes(g)])
    caches = [jnp.asarray(a) for a in arrays]
    rows, nbytes = g.num_chunks, _nbytes(g)
    for bad in (
        [jnp.zeros((rows + 1, nbytes), jnp.uint8)],
        [jnp.zeros((rows, nbytes), jnp.int8)],
        [None],
        [],
        [np.zeros((rows, nbytes), np.uint8).tolist()[0]],
    ):
        with pytest.raises(KVGroupsError) as core:
            check_objects(
                plan,
                bad,
                lambda x: (
                    (str(x.dtype), tuple(x.shape), (nbytes, 1))
                    if hasattr(x, "shape")
                    else (type(x).__name__, (), ())
                ),
            )
        with pytest.raises(type(core.value), match=f"^{re.escape(str(core.value))}$"):
            execute_plan(plan, caches, bad)
    # The executor's own limit on top: per-chunk buffers, which the rule allows, are refused.
    per_chunk = [[jnp.zeros((nbytes,), jnp.uint8) for _ in range(rows)]]
    with pytest.raises(KVGroupsTypeError, match="per-chunk buffers"):
        execute_plan(plan, caches, per_chunk)
    assert not any(c.is_deleted() for c in caches)
    store = make_plan("store", [g], arrays, [_nbytes(g)])
    _, (created,) = execute_plan(store, caches, [None], lowering="xla")
    assert created.shape == (rows, nbytes) and created.dtype == jnp.uint8


def test_torch_cpu_cache_imported_with_import_dlpack_sees_the_load():
    torch = pytest.importorskip("torch")
    from kvgroups_jax import import_dlpack

    arrays, g = make_group("nhd", "float32")
    # torch's allocator aligns to 64 bytes, so the import is zero-copy (no import-time copy)
    owners = [torch.empty(a.shape, dtype=torch.float32).copy_(torch.from_numpy(a)) for a in arrays]
    caches = [import_dlpack(t) for t in owners]
    plan = make_plan("load", [g], arrays, [_nbytes(g)])
    obj = np.random.default_rng(1).integers(0, 256, (g.num_chunks, _nbytes(g)), np.uint8)
    new_c, _ = JaxBackend(lowering="xla").execute(plan, caches, [jnp.asarray(obj)])
    for t, c in zip(owners, new_c):
        np.testing.assert_array_equal(t.numpy().view(np.uint8), np.asarray(c).view(np.uint8))


def test_plain_dlpack_import_on_cpu_warns_instead_of_losing_the_write_silently():
    torch = pytest.importorskip("torch")
    from kvgroups_jax import InPlaceCopyWarning

    arrays, g = make_group("nhd", "float32")
    # torch's allocator aligns to 64 bytes, so the import is zero-copy (no import-time copy)
    owners = [torch.empty(a.shape, dtype=torch.float32).copy_(torch.from_numpy(a)) for a in arrays]
    caches = [jax.dlpack.from_dlpack(t) for t in owners]
    plan = make_plan("load", [g], arrays, [_nbytes(g)])
    obj = jnp.zeros((g.num_chunks, _nbytes(g)), jnp.uint8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        JaxBackend(lowering="xla").execute(plan, caches, [obj])
    assert any(issubclass(w.category, InPlaceCopyWarning) for w in caught)
