"""merge_shards / split_canonical on JAX arrays (eagerly and under jax.jit), and shards stored
and loaded by the JAX backend."""

from __future__ import annotations

import numpy as np
import pytest

from kvgroups_core import get_backend, load, merge_shards, split_canonical, store
from tests.support.tp_models import (
    MODELS,
    assert_same_bytes,
    block_ids,
    leaves,
    make_model_caches,
    manager,
    reference_load,
    reference_store,
    shard_caches,
)

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


def rank_setup(model_name, tp, layout="canonical", seed=0):
    model = MODELS[model_name]
    rng = np.random.default_rng(seed)
    full = make_model_caches(model, rng)
    ids = block_ids(model, 2, rng)
    shards = [shard_caches(model, full, r, tp) for r in range(tp)]
    managers = [manager(model, shards[r], r, tp, object_layout=layout) for r in range(tp)]
    objects = [store(managers[r], shards[r], ids, backend="numpy") for r in range(tp)]
    return model, full, ids, managers, objects


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("model_name", ["hybrid-full-sw-gqa2", "mla-indexer", "jax-interleaved"])
def test_merge_and_split_of_jax_arrays_match_numpy(model_name, tp):
    model, full, ids, managers, objects = rank_setup(model_name, tp)
    canonical = reference_store(model, full, ids)
    as_jax = [[jnp.asarray(o) for o in objs] for objs in objects]
    merged = merge_shards(managers, as_jax)
    assert all(isinstance(x, jax.Array) for x in merged)
    assert_same_bytes(merged, canonical)
    for r, m in enumerate(managers):
        mine = split_canonical(m, [jnp.asarray(c) for c in canonical])
        assert all(isinstance(x, jax.Array) for x in mine)
        assert_same_bytes(mine, objects[r])


@pytest.mark.parametrize("layout", ["canonical", "tp_native"])
def test_merge_and_split_trace_under_jit(layout):
    model, full, ids, managers, objects = rank_setup("hybrid-full-sw-gqa2", 4, layout)
    canonical = reference_store(model, full, ids)
    if layout == "tp_native":
        objects = [split_canonical(managers[0], canonical)] * 4  # the one shared object
    merged = jax.jit(lambda objs: merge_shards(managers, objs))(
        [[jnp.asarray(o) for o in objs] for objs in objects]
    )
    assert_same_bytes(merged, canonical)
    split = jax.jit(lambda objs: split_canonical(managers[2], objs))(
        [jnp.asarray(c) for c in canonical]
    )
    assert_same_bytes(split, [np.asarray(x) for x in objects[2]])


@pytest.mark.parametrize("store_tp,load_tp", [(2, 4), (4, 2)])
def test_jax_backend_stores_shards_that_merge_and_loads_splits(store_tp, load_tp):
    model = MODELS["mha-nhd"]
    rng = np.random.default_rng(11)
    full = make_model_caches(model, rng)
    before = make_model_caches(model, rng)
    ids = block_ids(model, 2, rng)
    backend = get_backend("jax")
    shards = [
        [backend.from_numpy(x, "cpu") for x in shard_caches(model, full, r, store_tp)]
        for r in range(store_tp)
    ]
    managers = [manager(model, shards[r], r, store_tp) for r in range(store_tp)]
    objects = [store(managers[r], shards[r], ids, backend="jax") for r in range(store_tp)]
    merged = merge_shards(managers, objects)
    assert all(isinstance(x, jax.Array) for x in merged)
    assert_same_bytes(merged, reference_store(model, full, ids))
    want = reference_load(model, [np.asarray(x) for x in merged], before, ids)
    for r in range(load_tp):
        caches = [backend.from_numpy(x, "cpu") for x in shard_caches(model, before, r, load_tp)]
        mine = manager(model, caches, r, load_tp)
        out = load(mine, split_canonical(mine, merged), caches, ids, backend="jax")
        assert_same_bytes(
            [np.asarray(x) for x in leaves(out)], leaves(shard_caches(model, want, r, load_tp))
        )


@pytest.mark.parametrize("tp", [2, 4])
def test_one_manager_merges_shard_objects_laid_side_by_side(tp):
    model, full, ids, managers, objects = rank_setup("hybrid-full-sw-gqa2", tp)
    side_by_side = [
        jnp.concatenate([jnp.asarray(objects[r][og]) for r in range(tp)], axis=1)
        for og in range(managers[0].num_object_groups)
    ]
    for m in (managers[0], managers[tp - 1]):  # the rank of the manager does not matter
        merged = merge_shards([m], [side_by_side])
        assert_same_bytes(merged, reference_store(model, full, ids))
    merged = jax.jit(lambda objs: merge_shards([managers[0]], [objs]))(side_by_side)
    assert_same_bytes(merged, reference_store(model, full, ids))


def test_side_by_side_objects_of_the_wrong_width_are_rejected():
    _, _, _, managers, objects = rank_setup("mha-nhd", 2)
    from kvgroups_core import KVGroupsValueError

    with pytest.raises(KVGroupsValueError, match="side by side"):
        merge_shards([managers[0]], [[jnp.asarray(objects[0][0])]])
    native = manager(
        MODELS["mha-nhd"],
        shard_caches(
            MODELS["mha-nhd"], make_model_caches(MODELS["mha-nhd"], np.random.default_rng(0)), 0, 2
        ),
        0,
        2,
        object_layout="tp_native",
    )
    with pytest.raises(KVGroupsValueError, match="one manager per rank"):
        merge_shards([native], [objects[0]])


def _mesh(shards):
    if len(jax.devices("cpu")) < shards:
        pytest.skip(
            f"needs {shards} CPU devices (XLA_FLAGS=--xla_force_host_platform_device_"
            "count=8 before JAX starts; tests/tp/conftest.py sets it)"
        )
    return jax.make_mesh((shards,), ("model",), devices=jax.devices("cpu")[:shards])


@pytest.mark.parametrize("shards", [2, 4])
def test_global_manager_merges_objects_sharded_over_a_mesh(shards):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh(shards)
    model, full, ids, managers, objects = rank_setup("jax-interleaved", shards)
    whole = manager(model, full)  # built from the global shapes: tp_size 1
    on_mesh = [
        jax.device_put(
            np.concatenate([objects[r][og] for r in range(shards)], axis=1),
            NamedSharding(mesh, P(None, "model")),
        )
        for og in range(whole.num_object_groups)
    ]
    assert_same_bytes(merge_shards([whole], [on_mesh]), reference_store(model, full, ids))
    # The same bytes on one device are a TP=1 store: they merge to themselves.
    plain = [np.asarray(x) for x in on_mesh]
    assert_same_bytes(merge_shards([whole], [[jnp.asarray(x) for x in plain]]), plain)


def test_mesh_sharded_objects_of_groups_that_do_not_split_are_rejected():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from kvgroups_core import KVGroupsValueError

    mesh = _mesh(4)
    model = MODELS["hybrid-full-sw-gqa2"]  # its 2-head layer cannot split 4 ways
    full = make_model_caches(model, np.random.default_rng(0))
    whole = manager(model, full)
    objs = store(whole, full, block_ids(model, 1, np.random.default_rng(0)), backend="numpy")
    with pytest.raises(KVGroupsValueError, match="2 KV heads split evenly over the 4 shards"):
        merge_shards(
            [whole], [[jax.device_put(o, NamedSharding(mesh, P(None, "model"))) for o in objs]]
        )


def test_sharded_jax_store_merges_to_the_tp1_objects():
    sharded = pytest.importorskip(
        "kvgroups_jax.sharded", reason="the mesh-sharded JAX store (issue 13) is not here"
    )
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    assert sharded is not None
    mesh = _mesh(4)
    model = MODELS["jax-interleaved"]  # [NB, BS, NH, TWO, HS]: heads on axis 2
    rng = np.random.default_rng(4)
    full = make_model_caches(model, rng)
    ids = block_ids(model, 2, rng)
    backend = get_backend("jax")
    spec = NamedSharding(mesh, P(None, None, "model", None, None))
    caches = [jax.device_put(backend.from_numpy(x, "cpu"), spec) for x in full]
    whole = manager(model, caches)
    objs = store(whole, caches, ids)
    merged = merge_shards([whole], [objs])
    assert_same_bytes(merged, reference_store(model, full, ids))


@pytest.mark.parametrize("shards", [2, 4])
def test_split_for_a_mesh_lays_every_shards_objects_side_by_side(shards):
    model, full, ids, managers, objects = rank_setup("jax-interleaved", shards)
    whole = manager(model, full)
    canonical = reference_store(model, full, ids)
    side = split_canonical(whole, [jnp.asarray(c) for c in canonical], shards=shards)
    want = [
        np.concatenate([objects[r][og] for r in range(shards)], axis=1)
        for og in range(whole.num_object_groups)
    ]
    assert_same_bytes(side, want)
    assert_same_bytes(split_canonical(whole, canonical, shards=shards), want)  # NumPy too


def test_split_for_a_mesh_rejects_rank_managers_and_uneven_heads():
    from kvgroups_core import KVGroupsValueError

    model, full, ids, managers, objects = rank_setup("hybrid-full-sw-gqa2", 2)
    canonical = reference_store(model, full, ids)
    with pytest.raises(KVGroupsValueError, match="tp_size 1"):
        split_canonical(managers[0], canonical, shards=2)
    with pytest.raises(KVGroupsValueError, match="2 KV heads to split evenly over 4 shards"):
        split_canonical(manager(model, full), canonical, shards=4)


def test_mesh_store_merge_split_and_load_at_another_mesh_size():
    pytest.importorskip(
        "kvgroups_jax.sharded", reason="the mesh-sharded JAX store (issue 13) is not here"
    )
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    model = MODELS["jax-interleaved"]
    rng = np.random.default_rng(9)
    full = make_model_caches(model, rng)
    before = make_model_caches(model, rng)
    ids = block_ids(model, 2, rng)
    backend = get_backend("jax")

    def on_mesh(arrays, shards):
        mesh = _mesh(shards)
        spec = NamedSharding(mesh, P(None, None, "model", None, None))
        return mesh, [jax.device_put(backend.from_numpy(x, "cpu"), spec) for x in arrays]

    _, caches4 = on_mesh(full, 4)
    whole4 = manager(model, caches4)
    canonical = merge_shards([whole4], [store(whole4, caches4, ids)])
    assert_same_bytes(canonical, reference_store(model, full, ids))
    mesh2, caches2 = on_mesh(before, 2)
    whole2 = manager(model, caches2)
    objs = [
        jax.device_put(x, NamedSharding(mesh2, P(None, "model")))
        for x in split_canonical(whole2, canonical, shards=2)
    ]
    out = load(whole2, objs, caches2, ids)
    want = reference_load(model, [np.asarray(c) for c in canonical], before, ids)
    assert_same_bytes([np.asarray(x) for x in out], want)


@pytest.mark.parametrize("tp", [2, 4])
def test_jax_native_stores_fill_one_buffer_rank_after_rank(tp):
    model = MODELS["hybrid-full-sw-gqa2"]
    rng = np.random.default_rng(tp)
    full = make_model_caches(model, rng)
    ids = block_ids(model, 2, rng)
    backend = get_backend("jax")
    shards = [
        [backend.from_numpy(x, "cpu") for x in shard_caches(model, full, r, tp)] for r in range(tp)
    ]
    managers = [manager(model, shards[r], r, tp, object_layout="tp_native") for r in range(tp)]
    from kvgroups_core import object_nbytes

    buffers = [
        jnp.full((2, object_nbytes(managers[0], og)), 0xEE, jnp.uint8)
        for og in range(managers[0].num_object_groups)
    ]
    for m, caches in zip(managers, shards):
        buffers = store(m, caches, ids, buffers, backend="jax")  # donated, returned in place
    canonical = reference_store(model, full, ids)
    assert_same_bytes(buffers, split_canonical(managers[0], canonical))
    assert_same_bytes(merge_shards(managers, [buffers] * tp), canonical)
