"""Caches sharded over a mesh of 8 CPU devices, heads split as TP engines do: per-shard
objects (not replicated), no collective in the compiled transfers, loads in place per shard
keeping the sharding, shard_map with a per-shard manager, and shardings that would need
communication refused before anything is donated. Bytes against the NumPy backend."""

from unittest import mock

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from kvgroups_jax import sharded

from kvgroups_core import KVLayerGroupsManager, detect_format, load, prepare, store
from kvgroups_core.errors import UnsupportedConfigError

NB, BS, NH, HS, NL, TOKENS = 8, 4, 8, 8, 2, 8
COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")

pytestmark = pytest.mark.skipif(
    len(jax.devices("cpu")) < 8 and jax.default_backend() == "cpu",
    reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8",
)


def _mesh(shape=(4,), names=("model",)):
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


def _host(seed=0):
    rng = np.random.default_rng(seed)
    return [
        rng.integers(0, 2**16, (NB, BS, NH, 2, HS), dtype=np.uint16).view(ml_dtypes.bfloat16)
        for _ in range(NL)
    ]


def _manager(caches):
    fmt, normalized = detect_format(caches, engine="tpu_inference")
    return KVLayerGroupsManager(normalized, fmt, lmcache_tokens_per_chunk=TOKENS)


def _shard_reference(host, shards, ids, r):
    """The object a manager of shard ``r`` alone (heads r*k .. (r+1)*k) stores."""
    k = NH // shards
    local = [np.ascontiguousarray(h[:, :, r * k : (r + 1) * k]) for h in host]
    return store(_manager(local), local, ids, backend="numpy")[0]


def _compiled_texts():
    """Record the HLO text of every sharded program compiled while the context is open."""
    texts = []
    real = sharded._sharded_fn.__wrapped__

    def spy(*args):
        fn = real(*args)

        def call(*a):
            texts.append(fn.lower(*a).compile().as_text())
            return fn(*a)

        return call

    return texts, mock.patch.object(sharded, "_sharded_fn", spy)


@pytest.mark.parametrize(
    "mesh_shape, names, heads", [((4,), ("model",), "model"), ((2, 4), ("data", "model"), "model")]
)
def test_heads_sharded_store_and_load_stay_per_shard(mesh_shape, names, heads):
    mesh = _mesh(mesh_shape, names)
    sharding = NamedSharding(mesh, P(None, None, heads, None, None))
    host = _host()
    caches = [jax.device_put(h, sharding) for h in host]
    manager = _manager(caches)
    ids = np.array([1, 5, 2, 6])
    texts, spy = _compiled_texts()
    with spy:
        objs = store(manager, caches, ids)
    shards = mesh.shape["model"]
    nbytes = objs[0].shape[1]
    # Objects are sharded on their byte axis like the heads, not replicated.
    assert objs[0].sharding.is_equivalent_to(NamedSharding(mesh, P(None, heads)), 2)
    assert {s.data.shape for s in objs[0].addressable_shards} == {(2, nbytes // shards)}
    got = np.asarray(objs[0])
    for r in range(shards):
        np.testing.assert_array_equal(
            got[:, r * nbytes // shards : (r + 1) * nbytes // shards],
            _shard_reference(host, shards, ids, r),
            err_msg=f"shard {r}",
        )

    targets = [jax.device_put(np.zeros_like(h), sharding) for h in host]
    before = [[s.data.unsafe_buffer_pointer() for s in t.addressable_shards] for t in targets]
    with spy:
        new = load(manager, objs, targets, np.array([0, 3, 7, 4]))
    assert all(t.is_deleted() for t in targets)  # donated
    for n, b in zip(new, before):
        assert n.sharding == sharding
        assert [s.data.unsafe_buffer_pointer() for s in n.addressable_shards] == b
    for n, h in zip(new, host):
        a = np.asarray(n).view(np.uint16)
        np.testing.assert_array_equal(a[[0, 3, 7, 4]], h.view(np.uint16)[ids])
        np.testing.assert_array_equal(a[[1, 2, 5, 6]], 0)
    assert len(texts) == 2
    for text in texts:
        assert not [c for c in COLLECTIVES if c in text], text[:2000]


def test_a_sharded_block_axis_is_refused_before_anything_is_donated():
    mesh = _mesh()
    sharding = NamedSharding(mesh, P("model", None, None, None, None))
    host = _host()
    caches = [jax.device_put(h, sharding) for h in host]
    manager = _manager(caches)
    with pytest.raises(UnsupportedConfigError, match=r"PartitionSpec\('model'.*heads"):
        store(manager, caches, np.array([1, 5, 2, 6]))
    objs = [jnp.zeros((2, 4096), jnp.uint8)]
    with pytest.raises(UnsupportedConfigError, match="PartitionSpec"):
        load(manager, objs, caches, np.array([1, 5, 2, 6]))
    assert not any(c.is_deleted() for c in caches)


def test_objects_sharded_otherwise_are_refused_not_resharded():
    mesh = _mesh()
    sharding = NamedSharding(mesh, P(None, None, "model", None, None))
    caches = [jax.device_put(h, sharding) for h in _host()]
    manager = _manager(caches)
    objs = store(manager, caches, np.array([1, 5, 2, 6]))
    replicated = [jax.device_put(np.asarray(objs[0]), NamedSharding(mesh, P()))]
    with pytest.raises(UnsupportedConfigError, match=r"objects\[0\].*P\(None, 'model'\)"):
        load(manager, replicated, caches, np.array([0, 3, 7, 4]))
    assert not any(c.is_deleted() for c in caches)


def test_prepared_calls_on_sharded_caches_stay_bound_across_loads():
    mesh = _mesh()
    sharding = NamedSharding(mesh, P(None, None, "model", None, None))
    host = _host(3)
    caches = [jax.device_put(h, sharding) for h in host]
    prepared = prepare(_manager(caches), caches)
    objs = prepared.store(np.array([1, 5, 2, 6]))
    for step in range(2):
        out = prepared.load(objs, np.array([0, 3, 7, 4]) if step == 0 else np.array([1, 5, 2, 6]))
        assert all(c.sharding == sharding for c in out)
    a = np.asarray(out[0]).view(np.uint16)
    np.testing.assert_array_equal(a[[0, 3, 7, 4]], host[0].view(np.uint16)[[1, 5, 2, 6]])


@pytest.fixture
def pallas_interpret():
    """The Pallas (Triton) kernels in interpret mode, registered for one test."""
    from kvgroups_jax import JaxBackend

    from kvgroups_core.tensors.arrays import register_backend, unregister_backend

    register_backend("jax-pallas-interpret", JaxBackend(lowering="interpret"))
    yield "jax-pallas-interpret"
    unregister_backend("jax-pallas-interpret")


@pytest.mark.parametrize("kernels", ["default", "pallas-interpret", "tpu-interpret"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_with_a_per_shard_manager_uses_the_same_calls(kernels, check_vma, request):
    # shard_map checks by default that each output says which mesh axes it varies over
    # (check_vma): the Pallas kernels' outputs vary over their operands' axes.
    backend = {
        "default": None,
        "pallas-interpret": "pallas_interpret",
        "tpu-interpret": "jax-tpu-interpret",
    }[kernels]
    if backend == "pallas_interpret":
        backend = request.getfixturevalue("pallas_interpret")
    mesh = _mesh()
    spec = P(None, None, "model", None, None)
    host = _host(5)
    caches = [jax.device_put(h, NamedSharding(mesh, spec)) for h in host]
    local_specs = [jax.ShapeDtypeStruct((NB, BS, NH // 4, 2, HS), jnp.bfloat16)] * NL
    manager = _manager(local_specs)  # one shard's manager, built from shapes alone
    ids = np.array([1, 5, 2, 6])

    def step(caches):
        objs = store(manager, caches, ids, backend=backend)
        return objs, load(manager, objs, caches, np.array([0, 3, 7, 4]), backend=backend)

    mapped = jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(spec,),
        out_specs=(P(None, "model"), spec),
        check_vma=check_vma,
    )
    objs, new = jax.jit(mapped)(caches)
    nbytes = objs[0].shape[1] // 4
    got = np.asarray(objs[0])
    for r in range(4):
        np.testing.assert_array_equal(
            got[:, r * nbytes : (r + 1) * nbytes], _shard_reference(host, 4, ids, r)
        )
    a = np.asarray(new[0]).view(np.uint16)
    np.testing.assert_array_equal(a[[0, 3, 7, 4]], host[0].view(np.uint16)[ids])


def test_explicitly_sharded_caches_inside_jit_move_per_shard_without_collectives():
    mesh = _mesh()  # jax.make_mesh: Explicit axes, so the tracers carry their sharding
    sharding = NamedSharding(mesh, P(None, None, "model", None, None))
    host = _host(7)
    caches = [jax.device_put(h, sharding) for h in host]
    manager = _manager(caches)  # the global manager, as for eager calls
    ids = np.array([1, 5, 2, 6])

    def step(caches):
        objs = store(manager, caches, ids)
        return objs, load(manager, objs, caches, np.array([0, 3, 7, 4]))

    jitted = jax.jit(step, donate_argnums=(0,))
    text = jitted.lower(caches).compile().as_text()
    assert not [c for c in COLLECTIVES if c in text]
    objs, new = jitted(caches)
    assert objs[0].sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)
    nbytes = objs[0].shape[1] // 4
    got = np.asarray(objs[0])
    for r in range(4):
        np.testing.assert_array_equal(
            got[:, r * nbytes : (r + 1) * nbytes], _shard_reference(host, 4, ids, r)
        )
    assert all(n.sharding == sharding for n in new)
    a = np.asarray(new[0]).view(np.uint16)
    np.testing.assert_array_equal(a[[0, 3, 7, 4]], host[0].view(np.uint16)[ids])


def test_traced_ids_per_shard_drop_bad_ids_and_checkify_reports_them():
    from jax.experimental import checkify

    # Auto axes: checkify's error of a shard_map is then a plain array (jax 0.10 cannot read
    # an explicitly sharded one back).
    mesh = jax.make_mesh(
        (4,), ("model",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,)
    )
    spec = P(None, None, "model", None, None)
    host = _host(8)
    caches = [jax.device_put(h, NamedSharding(mesh, spec)) for h in host]
    manager = _manager([jax.ShapeDtypeStruct((NB, BS, NH // 4, 2, HS), jnp.bfloat16)] * NL)

    def step(caches, ids):
        return store(manager, caches, ids)

    mapped = jax.shard_map(step, mesh=mesh, in_specs=(spec, P()), out_specs=P(None, "model"))
    err, objs = jax.jit(checkify.checkify(mapped))(caches, jnp.asarray([1, 5, 2, 6], jnp.int32))
    assert err.get() is None
    nbytes = objs[0].shape[1] // 4
    for r in range(4):
        np.testing.assert_array_equal(
            np.asarray(objs[0])[:, r * nbytes : (r + 1) * nbytes],
            _shard_reference(host, 4, np.array([1, 5, 2, 6]), r),
        )
    err, _ = jax.jit(checkify.checkify(mapped))(caches, jnp.asarray([1, 5, 2, 60], jnp.int32))
    assert "got 60" in str(err.get())


def test_explicitly_sharded_jit_with_traced_ids_and_skip():
    mesh = _mesh()
    sharding = NamedSharding(mesh, P(None, None, "model", None, None))
    host = _host(9)
    caches = [jax.device_put(h, sharding) for h in host]
    manager = _manager(caches)

    @jax.jit
    def step(caches, src, dst, skip):
        objs = store(manager, caches, src)
        return load(manager, objs, caches, dst, skip_first_n_tokens=skip)

    src, dst = np.array([1, 5, 2, 6]), np.array([0, 3, 7, 4])
    new = step(caches, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32), jnp.int32(4))
    a = np.asarray(new[0]).view(np.uint16)
    h = host[0].view(np.uint16)
    np.testing.assert_array_equal(a[dst[1:]], h[src[1:]])  # block 0 skipped (4 tokens)
    np.testing.assert_array_equal(a[dst[0]], h[dst[0]])
    assert new[0].sharding == sharding


def _auto_mesh(shape=(4,), names=("model",)):
    # Mesh(devices, names): every axis Auto, the constructor most engines use.
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names)


@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
@pytest.mark.parametrize("mesh_shape, names", [((4,), ("model",)), ((2, 4), ("data", "model"))])
def test_jitted_store_and_load_stay_per_shard_on_auto_and_explicit_meshes(
    mesh_kind, mesh_shape, names
):
    mesh = (_auto_mesh if mesh_kind == "auto" else _mesh)(mesh_shape, names)
    sharding = NamedSharding(mesh, P(None, None, "model", None, None))
    host = _host(11)
    caches = [jax.device_put(h, sharding) for h in host]
    manager = _manager(caches)  # built from the concrete sharded arrays
    src, dst = np.array([1, 5, 2, 6]), np.array([0, 3, 7, 4])

    store_fn = jax.jit(lambda c, ids: store(manager, c, ids))
    load_fn = jax.jit(lambda c, o, ids: load(manager, o, c, ids), donate_argnums=(0,))
    ids = jnp.asarray(src, jnp.int32)
    text = store_fn.lower(caches, ids).compile().as_text()
    assert not [c for c in COLLECTIVES if c in text]
    objs = store_fn(caches, ids)
    assert objs[0].sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)
    nbytes = objs[0].shape[1] // 4
    got = np.asarray(objs[0])
    for r in range(4):
        np.testing.assert_array_equal(
            got[:, r * nbytes : (r + 1) * nbytes], _shard_reference(host, 4, src, r)
        )
    dst_ids = jnp.asarray(dst, jnp.int32)
    text = load_fn.lower(caches, objs, dst_ids).compile().as_text()
    assert not [c for c in COLLECTIVES if c in text]
    new = load_fn(caches, objs, dst_ids)
    assert all(n.sharding.is_equivalent_to(sharding, 5) for n in new)
    for a, h in zip(new, host):
        a, h = np.asarray(a).view(np.uint16), h.view(np.uint16)
        np.testing.assert_array_equal(a[dst], h[src])
        untouched = np.setdiff1d(np.arange(NB), dst)
        np.testing.assert_array_equal(a[untouched], h[untouched])


def test_an_auto_mesh_trace_nothing_vouches_for_is_refused_naming_the_fix():
    mesh = _auto_mesh()
    sharding = NamedSharding(mesh, P(None, None, "model", None, None))
    caches = [jax.device_put(h, sharding) for h in _host(12)]
    # Built from shapes alone: the manager cannot say how the traced caches are sharded.
    manager = _manager([jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches])
    fn = jax.jit(lambda c, ids: store(manager, c, ids))
    with pytest.raises(UnsupportedConfigError, match="Explicit axes") as info:
        fn(caches, jnp.asarray([1, 5, 2, 6], jnp.int32))
    assert isinstance(info.value, NotImplementedError)
    assert "kv_caches[0]" in str(info.value)


def test_an_auto_mesh_trace_on_another_mesh_than_the_managers_is_refused():
    caches = [
        jax.device_put(h, NamedSharding(_auto_mesh((4,)), P(None, None, "model")))
        for h in _host(13)
    ]
    manager = _manager(caches)
    other = [
        jax.device_put(h, NamedSharding(_auto_mesh((2,)), P(None, None, "model")))
        for h in _host(13)
    ]
    fn = jax.jit(lambda c, ids: store(manager, c, ids))
    with pytest.raises(UnsupportedConfigError, match="the mesh the manager was built on"):
        fn(other, jnp.asarray([1, 5, 2, 6], jnp.int32))
