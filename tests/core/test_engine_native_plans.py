"""The core side of the engine-native contract, on the NumPy reference (docs/DESIGN.md).

Layer subsets (``layers=``), device / traced skips through ``first_item_for_skip``, device ids
kept as they are, and the typed refusal of bad ids, all checked byte for byte: a layer-wise
call must equal the matching part of one whole-model call and leave every other byte alone.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvgroups_core as kc
from kvgroups_conformance.caches import TRANSFER_FORMATS, make_caches, random_bits
from kvgroups_core.formats.catalogue import EngineKVFormat as F
from kvgroups_core.grouping.engine_groups import EngineGroupInfo
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_core.tensors import arrays as registry
from kvgroups_core.transfer import api as transfer
from kvgroups_core.transfer import planner as planner_mod
from kvgroups_core.transfer.objects import object_nbytes, object_regions
from kvgroups_core.transfer.plan import first_item_for_skip
from kvgroups_core.transfer.planner import bind, plan_call
from kvgroups_core.transfer.reference import NumpyBackend, byte_view, execute_group, execute_plan

CHUNK, BS, NB = 16, 4, 12


# --- models ------------------------------------------------------------------------------


def _spec_arrays(specs, rng):
    return [
        random_bits(
            s.shape,
            np.dtype(s.dtype.name) if s.dtype.name != "bfloat16" else np.dtype(np.uint16),
            rng,
        )
        for s in specs
    ]


def hybrid_model(rng, chunk=64):
    """Sliding layers (window 32: two of a chunk's four blocks kept), full-attention layers,
    a window of two chunks, and an MLA latent group: four engine groups."""
    kv = kc.TensorSpec((2, 20, 16, 2, 8), "float16")
    mla = kc.TensorSpec((20, 16, 40), "float16")
    specs = [kv, kv, kv, kv, kv, mla, mla]
    formats = [F.NL_X_TWO_NB_BS_NH_HS] * 5 + [F.NL_X_NB_BS_HS] * 2
    infos = [
        EngineGroupInfo(
            engine_group_id=0, layer_indices=(0, 2), tokens_per_block=16, sw_size_tokens=32
        ),
        EngineGroupInfo(engine_group_id=1, layer_indices=(1, 3), tokens_per_block=16),
        EngineGroupInfo(
            engine_group_id=2, layer_indices=(4,), tokens_per_block=16, sw_size_tokens=2 * chunk
        ),
        EngineGroupInfo(engine_group_id=3, layer_indices=(5, 6), tokens_per_block=16),
    ]
    caches = _spec_arrays(specs, rng)
    manager = KVLayerGroupsManager(caches, formats, infos, lmcache_tokens_per_chunk=chunk)
    return manager, caches


def compressed_specs():
    """A DeepSeek-V4-like mix (SEMANTICS.md section 3): compression 4 and 128, a 64-token
    block group and a 4-token fp32 group, each its own engine group."""
    specs = [
        kc.TensorSpec((40, 64, 64), "float16"),
        kc.TensorSpec((40, 2, 64), "float16"),
        kc.TensorSpec((40, 64, 32), "float16"),
        kc.TensorSpec((400, 4, 128), "float32"),
    ]
    infos = [
        EngineGroupInfo(engine_group_id=0, layer_indices=(0,), tokens_per_block=256),
        EngineGroupInfo(engine_group_id=0, layer_indices=(1,), tokens_per_block=256),
        EngineGroupInfo(engine_group_id=1, layer_indices=(2,), tokens_per_block=64),
        EngineGroupInfo(engine_group_id=2, layer_indices=(3,), tokens_per_block=4),
    ]
    return specs, [F.NL_X_NB_BS_HS] * 4, infos


def request_ids(manager, rng, chunks):
    ids = {}
    for k, g in enumerate(manager.kernel_groups):
        if g.engine_group_idx not in ids:
            need = chunks * manager.calculate_num_blocks(k, manager.lmcache_tokens_per_chunk)
            ids[g.engine_group_idx] = rng.permutation(g.shape_desc.nb)[:need]
    return ids


def snapshot(arrays):
    out = []
    for a in arrays:
        if isinstance(a, (list, tuple)):
            out.append(snapshot(a))
        else:
            out.append(np.array(a, copy=True).view(np.uint8))
    return out


def assert_same(arrays, snap):
    for a, s in zip(arrays, snap):
        if isinstance(a, (list, tuple)):
            assert_same(a, s)
        else:
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), s)


def layer_rows_mask(manager, og, layers):
    """Per object byte of object group ``og``: True where it belongs to one of ``layers``
    (SEMANTICS.md section 6: row ``(kv * nl + l) * slots + t`` of the layer's region)."""
    mask = np.zeros(object_nbytes(manager, og), dtype=bool)
    for region in object_regions(manager, og):
        group = manager.kernel_groups[region.kernel_group_idx]
        kv_size, nl, slots, _ = region.shape
        for l_pos, layer in enumerate(group.layer_indices):
            if layer not in layers:
                continue
            for kv in range(kv_size):
                start = region.offset + (kv * nl + l_pos) * slots * region.row_bytes
                mask[start : start + slots * region.row_bytes] = True
    return mask


def _store(manager, caches, ids, objects=None, **kw):
    return kc.store(manager, caches, ids, objects, backend="numpy", **kw)


def _load(manager, objects, caches, ids, **kw):
    return kc.load(manager, objects, caches, ids, backend="numpy", **kw)


def check_layer_wise(manager, caches, ids, rng, skip=0):
    """Per layer and for a two-layer subset: the layer-wise store writes exactly the layer's
    rows of full-size objects (every other byte keeps its sentinel) and equals the whole-model
    store there; the layer-wise load equals a whole-model load of objects whose other layers'
    rows hold what the caches already had; every layer in turn rebuilds the whole call."""
    whole = _store(manager, caches, ids)
    layers = sorted(x for g in manager.kernel_groups for x in g.layer_indices)
    subsets = [[x] for x in layers] + ([layers[::2]] if len(layers) > 2 else [])
    for subset in subsets:
        sentinel = [rng.integers(0, 256, w.shape, dtype=np.uint8) for w in whole]
        got = _store(manager, caches, ids, [s.copy() for s in sentinel], layers=subset)
        for og, (g, w, s) in enumerate(zip(got, whole, sentinel)):
            mask = layer_rows_mask(manager, og, subset)
            np.testing.assert_array_equal(g[:, mask], w[:, mask])
            np.testing.assert_array_equal(g[:, ~mask], s[:, ~mask])
        # Load: the subset from random objects into random caches.
        objs = [rng.integers(0, 256, w.shape, dtype=np.uint8) for w in whole]
        dst = [np.array(c, copy=True) for c in caches]
        for c in dst:
            c.view(np.uint8)[...] = rng.integers(0, 256, c.view(np.uint8).shape, dtype=np.uint8)
        want = [np.array(c, copy=True) for c in dst]
        own = _store(manager, want, ids)
        mixed = [
            np.where(layer_rows_mask(manager, og, subset)[None, :], o, m)
            for og, (o, m) in enumerate(zip(objs, own))
        ]
        _load(manager, mixed, want, ids, skip_first_n_tokens=skip)
        _load(manager, objs, dst, ids, skip_first_n_tokens=skip, layers=subset)
        for d, w in zip(dst, want):
            np.testing.assert_array_equal(d.view(np.uint8), w.view(np.uint8))
    # Every layer in turn = one whole-model call, for both directions.
    acc = [np.zeros_like(w) for w in whole]
    for x in layers:
        _store(manager, caches, ids, acc, layers=[x])
    for a, w in zip(acc, whole):
        np.testing.assert_array_equal(a, w)
    one = [np.zeros_like(c) for c in caches]
    per_layer = [np.zeros_like(c) for c in caches]
    _load(manager, whole, one, ids, skip_first_n_tokens=skip)
    for x in layers:
        _load(manager, whole, per_layer, ids, skip_first_n_tokens=skip, layers=[x])
    for a, b in zip(per_layer, one):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def _flat_arrays(structure):
    if isinstance(structure, (list, tuple)):
        out = []
        for s in structure:
            out.extend(_flat_arrays(s))
        return out
    return [structure]


# --- layers= -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", TRANSFER_FORMATS, ids=lambda f: f.name)
def test_layer_wise_calls_equal_one_whole_model_call_for_every_format(fmt):
    rng = np.random.default_rng(3)
    caches, formats = make_caches(fmt, nl=3, nb=NB, bs=BS, nh=2, hs=8, dtype="float16", rng=rng)
    manager = KVLayerGroupsManager(caches, formats, lmcache_tokens_per_chunk=CHUNK)
    ids = rng.permutation(NB)[:8]
    flat = _flat_arrays(caches)
    # The structure is what the calls take; the byte checks run on its leaves.
    whole = _store(manager, caches, ids)
    for layer in range(3):
        sentinel = [rng.integers(0, 256, w.shape, dtype=np.uint8) for w in whole]
        got = _store(manager, caches, ids, [s.copy() for s in sentinel], layers=[layer])
        mask = layer_rows_mask(manager, 0, [layer])
        np.testing.assert_array_equal(got[0][:, mask], whole[0][:, mask])
        np.testing.assert_array_equal(got[0][:, ~mask], sentinel[0][:, ~mask])
    # Loads: layer by layer into zeroed caches = one whole load; a single layer's load
    # changes only what a whole load of "that layer's rows, the rest as the caches hold"
    # changes.
    zero = [np.zeros_like(a) for a in flat]
    one = [np.zeros_like(a) for a in flat]
    rebuilt_one = _rebuild(caches, one)
    _load(manager, whole, rebuilt_one, ids)
    rebuilt = _rebuild(caches, zero)
    for layer in range(3):
        _load(manager, whole, rebuilt, ids, layers=[layer])
    for a, b in zip(zero, one):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    before = [np.array(a, copy=True) for a in flat]
    dst = _rebuild(caches, [np.array(a, copy=True) for a in flat])
    objs = [rng.integers(0, 256, whole[0].shape, dtype=np.uint8)]
    _load(manager, objs, dst, ids, layers=[1])
    own = _store(manager, caches, ids)
    mixed = [np.where(layer_rows_mask(manager, 0, [1])[None, :], objs[0], own[0])]
    want = _rebuild(caches, [np.array(a, copy=True) for a in before])
    _load(manager, mixed, want, ids)
    for a, b in zip(_flat_arrays(dst), _flat_arrays(want)):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def _rebuild(structure, leaves):
    """``structure`` with its leaves replaced, in order, by ``leaves``."""
    it = iter(leaves)

    def walk(s):
        if isinstance(s, list):
            return [walk(x) for x in s]
        if isinstance(s, tuple):
            return tuple(walk(x) for x in s)
        return next(it)

    return walk(structure)


@pytest.mark.parametrize("skip", [0, 16, 80, 150])
def test_layer_wise_calls_on_a_hybrid_sliding_window_model(skip):
    rng = np.random.default_rng(skip)
    manager, caches = hybrid_model(rng)
    assert manager.num_object_groups > 1  # windows split object groups
    ids = request_ids(manager, rng, chunks=3)
    check_layer_wise(manager, caches, ids, rng, skip=skip)


def test_layer_wise_calls_on_a_compressed_mix_and_on_mla_with_an_indexer():
    rng = np.random.default_rng(21)
    specs, formats, infos = compressed_specs()
    caches = _spec_arrays(specs, rng)
    manager = KVLayerGroupsManager(caches, formats, infos)
    check_layer_wise(manager, caches, request_ids(manager, rng, chunks=2), rng, skip=300)
    mla = [kc.TensorSpec((20, 16, 40), "float16")] * 2 + [kc.TensorSpec((20, 16, 132), "uint8")] * 2
    infos = [
        EngineGroupInfo(engine_group_id=0, layer_indices=(0, 1), tokens_per_block=16),
        EngineGroupInfo(engine_group_id=0, layer_indices=(2, 3), tokens_per_block=16),
    ]
    caches = _spec_arrays(mla, rng)
    manager = KVLayerGroupsManager(
        caches, [F.NL_X_NB_BS_HS] * 2 + [F.NL_X_NB_BSV_BSS] * 2, infos, lmcache_tokens_per_chunk=32
    )
    assert manager.num_kernel_groups == 2 and manager.num_object_groups == 1
    check_layer_wise(manager, caches, request_ids(manager, rng, chunks=3), rng, skip=40)


def test_a_layer_subset_plan_keeps_only_its_planes_with_their_object_planes():
    rng = np.random.default_rng(1)
    manager, caches = hybrid_model(rng)
    binding = bind(manager, caches)
    ids = request_ids(manager, rng, chunks=1)
    whole = plan_call(binding, ids, "store")
    sub = plan_call(binding, ids, "store", layers=[2, 5])
    assert sub.layers == (2, 5) and whole.layers is None
    assert [g.kernel_group_idx for g in sub.groups] == [
        k for k, g in enumerate(manager.kernel_groups) if {2, 5} & set(g.layer_indices)
    ]
    for g in sub.groups:
        full = whole.groups[g.kernel_group_idx]
        nl = len(manager.kernel_groups[g.kernel_group_idx].layer_indices)
        pos = [
            manager.kernel_groups[g.kernel_group_idx].layer_indices.index(x)
            for x in (2, 5)
            if x in manager.kernel_groups[g.kernel_group_idx].layer_indices
        ]
        assert [p.object_plane for p in g.planes] == [
            kv * nl + q for kv in range(len(full.planes) // nl) for q in pos
        ]
        assert all(full.planes[p.object_plane] == p for p in g.planes)
        assert g.region_offset == full.region_offset and g.slots == full.slots
    assert sub.object_nbytes == whole.object_nbytes
    assert [p.object_plane for g in whole.groups for p in g.planes] == [
        i for g in whole.groups for i in range(len(g.planes))
    ]


@pytest.mark.parametrize(
    "bad,error",
    [
        ([True], kc.KVGroupsTypeError),
        (["0"], kc.KVGroupsTypeError),
        ([1.0], kc.KVGroupsTypeError),
        ([99], kc.KVGroupsIndexError),
        ([-1], kc.KVGroupsIndexError),
        ([], kc.KVGroupsValueError),
        ([0, 0], kc.KVGroupsValueError),
        (3, kc.KVGroupsTypeError),
        ("0", kc.KVGroupsTypeError),
    ],
)
def test_bad_layers_are_refused_before_any_byte_moves(bad, error):
    rng = np.random.default_rng(2)
    manager, caches = hybrid_model(rng)
    ids = request_ids(manager, rng, chunks=2)
    objects = _store(manager, caches, ids)
    snap_c, snap_o = snapshot(caches), snapshot(objects)
    with pytest.raises(error, match="layers"):
        _store(manager, caches, ids, objects, layers=bad)
    with pytest.raises(error, match="layers"):
        _load(manager, objects, caches, ids, layers=bad)
    prepared = kc.prepare(manager, caches, backend="numpy")
    with pytest.raises(error, match="layers"):
        prepared.load(objects, ids, layers=bad)
    assert_same(caches, snap_c)
    assert_same(objects, snap_o)


def test_prepared_calls_take_layers_too():
    rng = np.random.default_rng(4)
    manager, caches = hybrid_model(rng)
    ids = request_ids(manager, rng, chunks=2)
    prepared = kc.prepare(manager, caches, backend="numpy")
    whole = prepared.store(ids)
    acc = [np.zeros_like(w) for w in whole]
    for layer in range(7):
        prepared.store(ids, acc, layers=[layer])
    for a, w in zip(acc, whole):
        np.testing.assert_array_equal(a, w)
    dst = [np.zeros_like(c) for c in caches]
    again = kc.prepare(manager, dst, backend="numpy")
    for layer in range(7):
        again.load(whole, ids, layers=[layer], skip_first_n_tokens=64)
    want = [np.zeros_like(c) for c in caches]
    _load(manager, whole, want, ids, skip_first_n_tokens=64)
    for a, b in zip(dst, want):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


# --- device / traced skips ----------------------------------------------------------------


class Dev:
    """A stand-in for a device array on CPU: the planner may not read it, the reference may."""

    def __init__(self, value):
        self.value = np.asarray(value)
        self.dtype, self.shape = self.value.dtype, self.value.shape

    def __array__(self, dtype=None, copy=None):
        return self.value if dtype is None else self.value.astype(dtype)


def dev_spec(x):
    return registry.dtype_and_shape(x) if isinstance(x, Dev) else None


def skip_managers():
    """name -> (manager, the caches it plans from: arrays or TensorSpecs)."""
    rng = np.random.default_rng(5)
    out = {"hybrid": hybrid_model(rng)}
    specs, formats, infos = compressed_specs()
    out["compressed"] = (KVLayerGroupsManager(specs, formats, infos), specs)
    sub = [kc.TensorSpec((2, 30, 16, 2, 8), "float16")] * 2
    out["subchunk-window"] = (
        KVLayerGroupsManager(
            sub,
            F.NL_X_TWO_NB_BS_NH_HS,
            [
                EngineGroupInfo(
                    engine_group_id=0, layer_indices=(0, 1), tokens_per_block=16, sw_size_tokens=48
                )
            ],
            lmcache_tokens_per_chunk=128,
        ),
        sub,
    )
    return out


@pytest.mark.parametrize("name", ["hybrid", "compressed", "subchunk-window"])
def test_device_skip_formula_equals_the_host_skip_for_every_skip(name):
    manager, caches = skip_managers()[name]
    rng = np.random.default_rng(6)
    binding = bind(manager, caches)
    chunk = manager.lmcache_tokens_per_chunk
    for chunks in (1, 2, 3):
        ids = request_ids(manager, rng, chunks)
        device = plan_call(
            binding, ids, "load", skip_first_n_tokens=Dev(np.int64(0)), ids_spec=dev_spec
        )
        assert device.skip_tokens is not None
        windows = plan_call(binding, ids, "load")
        assert [g.first_item for g in device.groups] == [g.first_item for g in windows.groups]
        for skip in range(chunks * chunk + 1):
            host = plan_call(binding, ids, "load", skip_first_n_tokens=skip)
            assert host.skip_tokens is None
            want = [g.first_item for g in host.groups]
            got = [
                int(first_item_for_skip(g, np.int64(skip), np.maximum, np.minimum))
                for g in device.groups
            ]
            assert got == want, (chunks, skip)
            assert [first_item_for_skip(g, skip) for g in device.groups] == want


def test_device_skip_formula_runs_on_torch_tensors():
    torch = pytest.importorskip("torch")
    manager, caches = skip_managers()["hybrid"]
    binding = bind(manager, caches)
    ids = request_ids(manager, np.random.default_rng(7), 3)
    device = plan_call(
        binding, ids, "load", skip_first_n_tokens=Dev(np.int64(0)), ids_spec=dev_spec
    )
    skips = torch.arange(-5, 3 * 64 + 20)
    for g in device.groups:
        got = first_item_for_skip(
            g, skips, lambda a, b: a.clamp(min=b), lambda a, b: a.clamp(max=b)
        )
        want = [first_item_for_skip(g, max(0, min(int(s), 192))) for s in skips]
        assert got.tolist() == want


def test_device_skip_formula_runs_traced_under_jax_jit():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    manager, caches = skip_managers()["compressed"]
    binding = bind(manager, caches)
    ids = request_ids(manager, np.random.default_rng(17), 2)
    device = plan_call(
        binding, ids, "load", skip_first_n_tokens=Dev(np.int64(0)), ids_spec=dev_spec
    )
    for g in device.groups:
        f = jax.jit(lambda s, g=g: first_item_for_skip(g, s, jnp.maximum, jnp.minimum))
        for skip in range(0, 2 * 256 + 1, 7):
            assert int(f(jnp.int32(skip))) == first_item_for_skip(g, skip)


def test_a_device_skip_loads_what_the_host_skip_loads_and_store_refuses_it():
    rng = np.random.default_rng(8)
    manager, caches = hybrid_model(rng)
    ids = request_ids(manager, rng, 3)
    binding = bind(manager, caches)
    objects = _store(manager, caches, ids)
    for skip in (0, 17, 64, 100, 192):
        want = [np.zeros_like(c) for c in caches]
        _load(manager, objects, want, ids, skip_first_n_tokens=skip)
        got = [np.zeros_like(c) for c in caches]
        bound = bind(manager, got)  # tensors in the binding's order, not the layers'
        plan = plan_call(
            bound, ids, "load", skip_first_n_tokens=Dev(np.int32(skip)), ids_spec=dev_spec
        )
        assert execute_plan(plan, bound.tensors, objects) == set()
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    with pytest.raises(kc.KVGroupsValueError, match="skip_first_n_tokens"):
        plan_call(binding, ids, "store", skip_first_n_tokens=Dev(np.int64(0)), ids_spec=dev_spec)
    for bad in (Dev(np.float32(1)), Dev(np.array([1, 2])), Dev(np.bool_(True))):
        with pytest.raises(kc.KVGroupsTypeError, match="skip_first_n_tokens"):
            plan_call(binding, ids, "load", skip_first_n_tokens=bad, ids_spec=dev_spec)


# --- device ids ---------------------------------------------------------------------------


class DeviceNumpyBackend(NumpyBackend):
    """A NumPy backend whose :class:`Dev` ids stay 'on the device': it drops out-of-range
    items and reports them afterwards, as the torch and JAX backends do."""

    name = "numpy-device"
    array_types = ()
    reported: list = []

    def device_ids_spec(self, x):
        return dev_spec(x)

    def execute(self, plan, caches, objects):
        if plan.device_ids or plan.skip_tokens is not None:
            self.reported.append(execute_plan(plan, caches, objects, drop_out_of_range=True))
            return None, list(objects)
        return super().execute(plan, caches, objects)


@pytest.fixture
def device_backend():
    kc.register_backend("numpy-device", DeviceNumpyBackend(), replace=True)
    DeviceNumpyBackend.reported = []
    yield DeviceNumpyBackend
    kc.unregister_backend("numpy-device")


def test_device_ids_go_into_the_plan_untouched():
    rng = np.random.default_rng(9)
    manager, caches = hybrid_model(rng)
    binding = bind(manager, caches)
    ids = {g: Dev(v.astype(np.int32)) for g, v in request_ids(manager, rng, 2).items()}
    plan = plan_call(binding, ids, "store", ids_spec=dev_spec)
    assert plan.device_ids
    for g in plan.groups:
        assert g.block_ids is ids[manager.kernel_groups[g.kernel_group_idx].engine_group_idx]
    host = plan_call(binding, {g: v.value for g, v in ids.items()}, "store")
    assert not host.device_ids


@pytest.mark.parametrize(
    "make,error,text",
    [
        (lambda v: Dev(v.astype(np.float32)), kc.KVGroupsTypeError, "int32 or int64"),
        (lambda v: Dev(v.astype(bool)), kc.KVGroupsTypeError, "int32 or int64"),
        (lambda v: Dev(v.astype(np.uint8)), kc.KVGroupsTypeError, "int32 or int64"),
        (lambda v: Dev(v.reshape(2, -1)), kc.KVGroupsTypeError, "1-D"),
        (lambda v: Dev(v[:-1]), kc.KVGroupsValueError, "multiple of"),
    ],
)
def test_device_ids_are_checked_statically(make, error, text):
    rng = np.random.default_rng(10)
    manager, caches = hybrid_model(rng)
    binding = bind(manager, caches)
    ids = request_ids(manager, rng, 2)
    ids[1] = make(ids[1])
    ids = {g: v if isinstance(v, Dev) else Dev(v) for g, v in ids.items()}
    with pytest.raises(error, match=text):
        plan_call(binding, ids, "store", ids_spec=dev_spec)


def test_device_and_host_id_lists_are_not_mixed():
    rng = np.random.default_rng(11)
    manager, caches = hybrid_model(rng)
    ids = request_ids(manager, rng, 1)
    ids[0] = Dev(ids[0])
    with pytest.raises(kc.KVGroupsTypeError, match="host or every one on the device"):
        plan_call(bind(manager, caches), ids, "store", ids_spec=dev_spec)


def test_out_of_range_device_ids_move_nothing_for_their_items_and_are_reported(device_backend):
    rng = np.random.default_rng(12)
    manager, caches = hybrid_model(rng)
    good = request_ids(manager, rng, 3)
    bad = {g: v.copy() for g, v in good.items()}
    bad[1][2] = 1000
    bad[3][0] = -7
    objects = [
        rng.integers(0, 256, (3, n), dtype=np.uint8)
        for n in (object_nbytes(manager, og) for og in range(manager.num_object_groups))
    ]
    # Reference: the same load with each bad id's item left out, done on host ids.
    want = [np.array(c, copy=True) for c in caches]
    bound = bind(manager, want)
    plan = plan_call(bound, good, "load")
    views = [byte_view(d, True) for d in bound.tensors]
    for t in plan.groups:
        eg = manager.kernel_groups[t.kernel_group_idx].engine_group_idx
        keep = bad[eg] == good[eg]  # per engine block id position
        chunk, pos, _ = t.items()
        where = chunk * t.blocks_per_chunk + (t.blocks_per_chunk - t.kept_per_chunk) + pos
        execute_group(t, False, views, objects[t.object_group_idx], None, keep[where])
    got = [np.array(c, copy=True) for c in caches]
    kc.load(manager, objects, got, {g: Dev(v) for g, v in bad.items()}, backend="numpy-device")
    assert device_backend.reported == [{1000, -7}]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    # Stores: a dropped item leaves its object rows as they were.
    store_objs = [o.copy() for o in objects]
    kc.store(
        manager, caches, {g: Dev(v) for g, v in bad.items()}, store_objs, backend="numpy-device"
    )
    assert device_backend.reported[-1] == {1000, -7}
    clean = _store(manager, caches, good)
    changed = [o != s for o, s in zip(store_objs, objects)]
    for og, (o, c) in enumerate(zip(store_objs, clean)):
        assert (o[changed[og]] == c[changed[og]]).all()


def test_prepared_calls_with_device_ids_do_no_host_conversion(device_backend, monkeypatch):
    rng = np.random.default_rng(13)
    manager, caches = hybrid_model(rng)
    prepared = kc.prepare(manager, caches, backend="numpy-device")
    ids = {g: Dev(v) for g, v in request_ids(manager, rng, 2).items()}

    def no_host(x):
        raise AssertionError("device ids converted on the host")

    monkeypatch.setattr(prepared, "_to_host", no_host)
    objs = prepared.store(ids)
    prepared.load(objs, ids, skip_first_n_tokens=Dev(np.int64(70)))
    assert device_backend.reported == [set(), set()]


# --- id validation (issue 12 point 4) -------------------------------------------------------


def _one_group_setup():
    rng = np.random.default_rng(14)
    caches, formats = make_caches(
        F.NL_X_TWO_NB_BS_NH_HS, nl=2, nb=NB, bs=BS, nh=2, hs=8, dtype="float16", rng=rng
    )
    manager = KVLayerGroupsManager(caches, formats, lmcache_tokens_per_chunk=CHUNK)
    objects = [rng.integers(0, 256, (2, object_nbytes(manager, 0)), dtype=np.uint8)]
    return manager, caches, objects


BAD_FLAT_IDS = [
    ([True, False, True, False, 0, 1, 2, 3], kc.KVGroupsTypeError, "bool"),
    ([0, 1, 2, 3, 4, 5, 6, np.True_], kc.KVGroupsTypeError, "bool"),
    (np.array([1, 0, 1, 0, 1, 0, 1, 0], dtype=bool), kc.KVGroupsTypeError, "bool"),
    ([0, 1, 2, 3, 4, 5, 6, 2**63], kc.KVGroupsIndexError, "9223372036854775808"),
    ([0, 1, 2, 3, 4, 5, 6, 2**64 + 1], kc.KVGroupsIndexError, "18446744073709551617"),
    ([0, 1, 2, 3, 4, 5, 6, -(2**63) - 1], kc.KVGroupsIndexError, "-9223372036854775809"),
    (
        np.array([0, 1, 2, 3, 4, 5, 6, 2**64 - 1], dtype=np.uint64),
        kc.KVGroupsIndexError,
        "18446744073709551615",
    ),
    (
        np.array([0, 1, 2, 3, 4, 5, 6, 2**63], dtype=np.uint64),
        kc.KVGroupsIndexError,
        "uint64 value 9223372036854775808",
    ),
    (np.array([0, 1, 2, 3, 4, 5, 6, 200], dtype=np.uint8), kc.KVGroupsIndexError, "200"),
    ([0, 1, 2, 3, 4, 5, 6, 7.0], kc.KVGroupsTypeError, "float"),
    (np.arange(8.0), kc.KVGroupsTypeError, "float64"),
    (np.arange(8).reshape(2, 4), kc.KVGroupsTypeError, "shape (2, 4)"),
    ({1: list(range(8))}, kc.KVGroupsValueError, "missing [0]"),
    ({0: list(range(8)), 1: list(range(8))}, kc.KVGroupsValueError, "unknown engine groups [1]"),
    ({"0": list(range(8))}, kc.KVGroupsTypeError, "str '0'"),
    ({True: list(range(8))}, kc.KVGroupsTypeError, "bool True"),
    ({0.0: list(range(8))}, kc.KVGroupsTypeError, "float"),
    ([list(range(8)), list(range(8))], kc.KVGroupsValueError, "at most 1 id lists"),
    ([list(range(8)), []], kc.KVGroupsValueError, "at most 1 id lists"),
    # np.asarray drops a mask: masked-out entries must not become real block ids
    (
        np.ma.masked_array([7, 1, 2, 3, 4, 5, 6, 0], mask=[1] + [0] * 7),
        kc.KVGroupsTypeError,
        "masked",
    ),
    ({0: np.ma.masked_array(np.arange(8), mask=False)}, kc.KVGroupsTypeError, "masked"),
]


@pytest.mark.parametrize("ids,error,text", BAD_FLAT_IDS)
def test_bad_ids_raise_typed_errors_with_caches_and_objects_untouched(ids, error, text):
    manager, caches, objects = _one_group_setup()
    snap_c, snap_o = snapshot(caches), snapshot(objects)
    prepared = kc.prepare(manager, caches, backend="numpy")
    for call in (
        lambda: _store(manager, caches, ids, objects),
        lambda: _load(manager, objects, caches, ids),
        lambda: prepared.store(ids, objects),
        lambda: prepared.load(objects, ids),
    ):
        with pytest.raises(error) as info:
            call()
        assert isinstance(info.value, kc.KVGroupsError)
        assert "block_ids" in str(info.value) and text in str(info.value), str(info.value)
        assert_same(caches, snap_c)
        assert_same(objects, snap_o)


def test_bad_ids_per_engine_group_name_the_group():
    rng = np.random.default_rng(15)
    manager, caches = hybrid_model(rng)
    ids = request_ids(manager, rng, 1)
    for g, bad, text, error in [
        (2, [True] * 4, "block_ids[2]", kc.KVGroupsTypeError),
        (3, np.array([2**63] * 4, np.uint64), "block_ids[3]", kc.KVGroupsIndexError),
    ]:
        call = {**ids, g: bad}
        with pytest.raises(error, match=__import__("re").escape(text)):
            _store(manager, caches, call)
    as_list = [ids[g] for g in range(4)]
    with pytest.raises(kc.KVGroupsValueError, match="at most 4 id lists"):
        _store(manager, caches, as_list + [ids[0]])
    with pytest.raises(kc.KVGroupsValueError, match="missing"):
        _store(manager, caches, as_list[:3])
    with pytest.raises(kc.KVGroupsValueError, match="flat list"):
        _store(manager, caches, ids[0])


# --- zero chunks -------------------------------------------------------------------------


def _zero_chunk_backends():
    out = ["numpy"]
    for name, module in (("torch", "torch"), ("jax", "jax")):
        try:
            __import__(module)
            out.append(name)
        except ImportError:
            pass
    return out


@pytest.mark.parametrize("backend", _zero_chunk_backends())
def test_zero_chunk_calls_give_empty_objects_and_move_nothing(backend):
    manager, caches_np, _ = _one_group_setup()
    be = kc.get_backend(backend)
    caches = [be.from_numpy(c) for c in caches_np]
    for empty in ([], np.zeros(0, np.int64), {0: []}, [[]]):
        objects = kc.store(manager, caches, empty)
        assert len(objects) == 1 and tuple(objects[0].shape) == (0, object_nbytes(manager, 0))
        caches = kc.load(manager, objects, caches, empty)
        for c, want in zip(caches, caches_np):
            np.testing.assert_array_equal(be.to_numpy(c).view(np.uint8), want.view(np.uint8))
    with pytest.raises(kc.KVGroupsValueError, match="skip_first_n_tokens"):
        kc.load(manager, objects, caches, [], skip_first_n_tokens=4)


def test_zero_chunk_plans_have_no_items():
    rng = np.random.default_rng(16)
    manager, caches = hybrid_model(rng)
    plan = plan_call(bind(manager, caches), [[], [], [], []], "load")
    assert plan.num_chunks == 0 and all(g.num_items == 0 for g in plan.groups)
    objects = _store(manager, caches, {g: [] for g in range(4)})
    assert [o.shape for o in objects] == [
        (0, object_nbytes(manager, og)) for og in range(manager.num_object_groups)
    ]


# --- one validation point, abstract values -------------------------------------------------


def test_one_shot_calls_find_the_backend_and_bind_once(monkeypatch):
    manager, caches, objects = _one_group_setup()
    counts = {"bind": 0, "backend": 0}
    real_bind, real_find = planner_mod.bind, transfer.backend_for_tensors

    def counting_bind(*a, **k):
        counts["bind"] += 1
        return real_bind(*a, **k)

    def counting_find(*a, **k):
        counts["backend"] += 1
        return real_find(*a, **k)

    monkeypatch.setattr(transfer, "bind", counting_bind)
    monkeypatch.setattr(transfer, "backend_for_tensors", counting_find)
    kc.store(manager, caches, np.arange(8), objects)
    assert counts == {"bind": 1, "backend": 1}
    # The same caches again: the last one-shot call's binding is reused
    # (kvgroups_core.transfer.fast.reuse);
    # the backend is still found per call, from the caches and the call's objects.
    kc.load(manager, objects, caches, np.arange(8))
    assert counts == {"bind": 1, "backend": 2}
    kc.load(manager, objects, [c.copy() for c in caches], np.arange(8))  # other caches
    assert counts == {"bind": 2, "backend": 3}


def test_abstract_descriptors():
    spec = kc.TensorSpec((2, 3), "float16")
    assert kc.describe(spec).is_abstract
    assert not kc.describe(np.zeros((2, 3), np.float16)).is_abstract
    assert not kc.describe(np.zeros((0, 3), np.float16)).is_abstract  # empty, not abstract
    marked = kc.TensorDesc(spec, 1234, 0, object(), "x", abstract=True)
    assert marked.is_abstract and marked.view(spec).is_abstract
    concrete = kc.TensorDesc(spec, 0, 0, object(), "x", abstract=False)  # e.g. sharded
    assert not concrete.is_abstract and not concrete.view(spec).is_abstract
    assert kc.TensorDesc(spec, 0, 0, object(), "x").is_abstract  # no pointer: inferred


def test_device_ids_spec_hook_and_helper():
    assert NumpyBackend().device_ids_spec(np.arange(3)) is None  # the default: host
    assert registry.dtype_and_shape(np.zeros((2, 3), np.int32)) == ("int32", (2, 3))
    torch = pytest.importorskip("torch")
    assert registry.dtype_and_shape(torch.zeros(4, dtype=torch.int64)) == ("int64", (4,))


def test_jax_tracers_are_the_jax_backends_arrays():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    seen = []

    @jax.jit
    def f(x):
        seen.append(registry.framework_of(x))
        return x + 1

    f(jnp.zeros(3))
    assert seen == ["jax"]


def test_specs_plan_with_device_ids_without_pointers():
    specs, formats, infos = compressed_specs()
    manager = KVLayerGroupsManager(specs, formats, infos)
    binding = bind(manager, specs)
    assert all(t.is_abstract for t in binding.tensors)
    ids = {g: Dev(np.arange(n, dtype=np.int64)) for g, n in ((0, 1), (1, 4), (2, 64))}
    plan = plan_call(binding, ids, "load", ids_spec=dev_spec, skip_first_n_tokens=Dev(np.int32(5)))
    assert plan.device_ids and plan.num_chunks == 1


def _framework_ids(backend, values, dtype):
    """``values`` as the backend's own id array (host ids of that framework)."""
    if backend == "torch":
        import torch

        return torch.tensor(np.asarray(values, dtype=dtype))
    if backend == "jax":
        import jax.numpy as jnp

        return jnp.asarray(np.asarray(values, dtype=dtype))
    return np.asarray(values, dtype=dtype)


FRAMEWORK_BAD_IDS = [
    ([1, 0, 1, 0, 1, 0, 1, 0], bool, kc.KVGroupsTypeError, "bool"),
    ([0, 1, 2, 3, 4, 5, 6, NB], np.int64, kc.KVGroupsIndexError, str(NB)),
    ([0, 1, 2, 3, 4, 5, 6, -1], np.int32, kc.KVGroupsIndexError, "-1"),
    ([0, 1, 2, 3, 4, 5, 6, 7.0], np.float32, kc.KVGroupsTypeError, "float32"),
]


@pytest.mark.parametrize("backend", _zero_chunk_backends())
@pytest.mark.parametrize("values,dtype,error,text", FRAMEWORK_BAD_IDS)
def test_bad_framework_ids_are_refused_on_every_cpu_backend(backend, values, dtype, error, text):
    manager, caches_np, objects_np = _one_group_setup()
    be = kc.get_backend(backend)
    caches = [be.from_numpy(c) for c in caches_np]
    objects = [be.from_numpy(o) for o in objects_np]
    ids = _framework_ids(backend, values, dtype)
    for call in (
        lambda: kc.store(manager, caches, ids, objects),
        lambda: kc.load(manager, objects, caches, ids),
        lambda: kc.store(manager, caches, {0: ids}, objects),
        lambda: kc.load(manager, objects, caches, [ids]),
    ):
        with pytest.raises(error, match="block_ids") as info:
            call()
        assert text in str(info.value), str(info.value)
    for c, want in zip(caches, caches_np):
        np.testing.assert_array_equal(be.to_numpy(c).view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(be.to_numpy(objects[0]), objects_np[0])


def test_torch_uint64_ids_that_would_wrap_report_the_value():
    torch = pytest.importorskip("torch")
    manager, caches_np, objects_np = _one_group_setup()
    caches = [torch.from_numpy(c.copy()) for c in caches_np]
    ids = torch.tensor(np.array([0, 1, 2, 3, 4, 5, 6, 2**64 - 2], dtype=np.uint64))
    with pytest.raises(kc.KVGroupsIndexError, match="18446744073709551614"):
        kc.store(manager, caches, ids)
    for c, want in zip(caches, caches_np):
        np.testing.assert_array_equal(c.numpy().view(np.uint8), want.view(np.uint8))


def test_id_lists_at_engine_group_ids_without_kernel_groups_must_be_empty():
    from kvgroups_core.transfer.block_ids import normalize_block_ids

    found = normalize_block_ids((0, 2), [[1, 2], [], np.array([3, 4])])
    assert sorted(found.ids) == [0, 2] and not found.device
    assert [found.ids[g].tolist() for g in (0, 2)] == [[1, 2], [3, 4]]
    with pytest.raises(kc.KVGroupsValueError, match=r"block_ids\[1\]: expected no ids"):
        normalize_block_ids((0, 2), [[1, 2], [5], [3, 4]])
    with pytest.raises(kc.KVGroupsValueError, match="unknown engine groups"):
        normalize_block_ids((0, 2), {0: [1], 1: [], 2: [3]})
