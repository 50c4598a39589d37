"""The copy-engine path without a GPU: ``cuMemcpyBatchAsync`` is replaced by an emulation
that reads the packed host arrays and attributes exactly as the driver does and moves the
bytes with memmoves, so ``cuda_execute.execute_plan`` / ``DeviceCaches.run`` run end to end on CPU
tensors; the ``path=`` argument is checked through the public calls; the ``"auto"`` chooser
is tested with fake tables."""

import ctypes
import json

import numpy as np
import pytest
import torch
from kvgroups_torch.copy_engine import batch as copy_engine
from kvgroups_torch.copy_engine import paths as copy_paths
from kvgroups_torch.cuda import execute as cuda_execute
from kvgroups_torch.cuda import objects as cuda_objects

import kvgroups_core as kc
from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError, UnsupportedConfigError
from tests.support.torch_engine_cases import ids_for, model_caches, random_objects
from tests.support.torch_page_cases import LAYOUTS, make_case, oracle
from tests.torch_backend.test_torch_launch_emulated import _check, _run, emulated  # noqa: F401  (fixture)

U64 = np.uint64


def _array(address, n):
    return np.frombuffer(ctypes.string_at(address, 8 * n), dtype=U64).copy()


@pytest.fixture
def batches(emulated, monkeypatch):  # noqa: F811
    """Every emulated batch: (copies, attribute stretches); the bytes really move."""
    seen = []

    def fake_submit(fn, args, stream, device_index, buf):
        dst, src, size, count, attrs, idx, num_attrs = args[:7]
        assert stream, "a batch never goes to the legacy NULL stream"
        dsts, srcs, sizes = (_array(a, count) for a in (dst, src, size))
        table = (copy_engine.MemcpyAttributes * num_attrs).from_address(attrs)
        starts = (ctypes.c_size_t * num_attrs).from_address(idx)
        stretches = [
            (starts[i], table[i].srcAccessOrder, table[i].srcLocHint.type, table[i].dstLocHint.type)
            for i in range(num_attrs)
        ]
        assert stretches[0][0] == 0 and all(s[1] == 1 for s in stretches)  # stream order
        for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            ctypes.memmove(d, s, n)
        seen.append((count, stretches))

    monkeypatch.setattr(copy_engine, "batch_function", lambda: (None, False))
    monkeypatch.setattr(copy_engine, "submit", fake_submit)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    copy_paths.forget_tables()
    yield emulated[0], seen
    copy_paths.forget_tables()


def _with_path(case, path):
    from dataclasses import replace

    case.plan = replace(case.plan, path=path)
    return case


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_engine_moves_the_page_models_bytes_and_launches_nothing(batches, layout, direction):
    launches, seen = batches
    rng = np.random.default_rng(len(layout) + 7 * len(direction))
    case = make_case(
        layout,
        "uint8" if layout == "indexer" else "float16",
        direction,
        rng,
        nb=12,
        bs=2,
        hs=8,
        num_chunks=2,
        bpc=3,
        kept=2,
        first_item=1 if direction == "load" else 0,
        region_pad=8,
    )
    _check(_with_path(case, "copy_engine"))
    assert not launches and len(seen) == 1
    # CPU objects stand for pinned host memory: the object side says host, the cache device.
    ((start, _, src, dst),) = seen[0][1]
    assert (src, dst) == ((1, 2) if direction == "store" else (2, 1))


@pytest.mark.parametrize("per_chunk_count", [3, 70])  # inline addresses / a device table
def test_copy_engine_takes_per_chunk_object_buffers(batches, per_chunk_count):
    rng = np.random.default_rng(per_chunk_count)
    case = make_case(
        "nhd",
        "bfloat16",
        "load",
        rng,
        nb=300,
        bs=1,
        nh=1,
        hs=8,
        num_chunks=per_chunk_count,
        bpc=2,
        kept=2,
    )
    _check(_with_path(case, "copy_engine"), per_chunk=True)
    assert batches[1] and not batches[0]


def test_copy_engine_takes_host_ids_that_replace_the_plans(batches):
    case = _with_path(
        make_case(
            "hnd", "float16", "store", np.random.default_rng(3), nb=20, num_chunks=2, bpc=2, kept=2
        ),
        "copy_engine",
    )
    ids = np.random.default_rng(4).permutation(20)[:4]
    want_caches, want_objects = oracle(case, ids)
    got_caches, got_objects = _run(case, ids=torch.from_numpy(ids))
    np.testing.assert_array_equal(got_objects, want_objects)
    assert not np.array_equal(want_objects, oracle(case)[1])  # the ids made a difference
    assert batches[1]


def test_device_ids_with_copy_engine_are_refused_before_anything_moves(batches, monkeypatch):
    case = _with_path(make_case("nhd", "float16", "store", np.random.default_rng(5)), "copy_engine")
    from dataclasses import replace

    case.plan = replace(case.plan, device_ids=True)
    objects = torch.from_numpy(case.objects.copy())
    caches = [torch.from_numpy(c.copy()) for c in case.caches]
    with pytest.raises(KVGroupsValueError, match=r"path: expected host block ids.*device"):
        cuda_execute.execute_plan(case.plan, caches, [objects], 0)
    np.testing.assert_array_equal(objects.numpy(), case.objects)
    skip_plan = replace(case.plan, device_ids=False, direction="load", skip_tokens=torch.tensor(3))
    with pytest.raises(KVGroupsValueError, match=r"path: .*device skip_first_n_tokens"):
        cuda_execute.execute_plan(skip_plan, caches, [objects], 0)
    assert not batches[0] and not batches[1]


def test_prepared_device_caches_run_copy_engine_groups(batches):
    case = _with_path(
        make_case("mla", "bfloat16", "store", np.random.default_rng(6), num_chunks=2), "copy_engine"
    )
    caches = [torch.from_numpy(c.copy()) for c in case.caches]
    objects = torch.from_numpy(case.objects.copy())
    bound = cuda_execute.DeviceCaches(caches, 0)
    bound.execute(case.plan, [cuda_objects.object_addresses(objects, 0, "objects[0]")])
    np.testing.assert_array_equal(objects.numpy(), oracle(case)[1])
    assert batches[1] and not batches[0]


def _table(choice_above: int, placement: str = "pinned") -> copy_paths.PathTable:
    """A fake table: the copy engine wins from ``choice_above`` bytes per copy."""
    points = []
    for nbytes in (64, 1024, 32768):
        for chunks in (1, 16):
            ce = 1.0 if nbytes >= choice_above else 3.0
            points.append(copy_paths.Point("store", placement, nbytes, chunks, 2.0, ce))
            points.append(copy_paths.Point("load", placement, nbytes, chunks, 2.0, ce))
    return copy_paths.PathTable(points, "Fake GPU", 13000)


def test_auto_is_the_kernel_without_a_table_and_follows_the_table_with_one(batches):
    launches, seen = batches
    rng = np.random.default_rng(8)
    copy_paths.set_table(0, None)
    _check(
        make_case("nhd", "float16", "store", rng, nb=12, bs=2, hs=8, num_chunks=2, bpc=3, kept=2)
    )
    assert launches and not seen
    launches.clear()
    # NHD pages of 2 * 2 * 8 * 2 = 64 bytes: the copy engine where the table says so ...
    copy_paths.set_table(0, _table(choice_above=64))
    _check(
        make_case(
            "nhd",
            "float16",
            "load",
            rng,
            nb=12,
            bs=2,
            hs=8,
            num_chunks=2,
            bpc=3,
            kept=2,
            first_item=1,
        )
    )
    assert seen and not launches
    # ... the kernel where it does not (and for placements the table never measured).
    seen.clear()
    copy_paths.set_table(0, _table(choice_above=1024))
    _check(
        make_case("nhd", "float16", "store", rng, nb=12, bs=2, hs=8, num_chunks=2, bpc=3, kept=2)
    )
    assert launches and not seen
    launches.clear()
    copy_paths.set_table(0, _table(choice_above=64, placement="device"))
    _check(
        make_case("nhd", "float16", "store", rng, nb=12, bs=2, hs=8, num_chunks=2, bpc=3, kept=2)
    )
    assert launches and not seen
    launches.clear()
    # path="kernel" beats the table, device ids never take the copy engine under auto.
    copy_paths.set_table(0, _table(choice_above=64))
    _check(
        _with_path(
            make_case(
                "nhd", "float16", "store", rng, nb=12, bs=2, hs=8, num_chunks=2, bpc=3, kept=2
            ),
            "kernel",
        )
    )
    assert launches and not seen


def test_table_choice_is_the_nearest_point_on_a_log_scale():
    table = _table(choice_above=32768, placement="device")
    assert table.choose_for("store", "device", 32768, 16) == "copy_engine"
    assert table.choose_for("store", "device", 20000, 4) == "copy_engine"  # nearer 32 KiB
    assert table.choose_for("store", "device", 4096, 64) == "kernel"  # nearer 1 KiB
    assert table.choose_for("store", "pinned", 32768, 16) == "kernel"  # nothing measured
    again = copy_paths.PathTable.from_json(json.loads(json.dumps(table.to_json())))
    assert again.points == table.points and again.gpu == "Fake GPU"


def test_tables_are_read_from_the_cache_folder_unless_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv(copy_paths.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(copy_paths, "_gpu_and_driver", lambda index: ("NVIDIA H200", 13000))
    file = copy_paths.table_file("NVIDIA H200", 13000)
    assert file == tmp_path / "copy_paths-nvidia-h200-13000.json"
    file.write_text(json.dumps(_table(64).to_json()))
    copy_paths.forget_tables()
    try:
        assert copy_paths.table_for(0).points == _table(64).points
        copy_paths.forget_tables()
        monkeypatch.setenv(copy_paths.ENV_SWITCH, "off")
        assert copy_paths.table_for(0) is None
        copy_paths.forget_tables()
        monkeypatch.delenv(copy_paths.ENV_SWITCH)
        file.write_text("{not json")
        assert copy_paths.table_for(0) is None  # a damaged table is no table
    finally:
        copy_paths.forget_tables()


# The path= argument through the public calls (CPU caches: torch and NumPy; JAX).


def _store_args(backend="torch"):
    manager, caches = model_caches("llama3-8b", layers=2)
    if backend == "numpy":
        caches = [c.numpy() for c in caches]
    ids = ids_for(manager, np.random.default_rng(0), 1)
    return manager, caches, ids


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_path_values_are_checked_by_the_core(backend):
    manager, caches, ids = _store_args(backend)
    with pytest.raises(
        KVGroupsValueError,
        match=r"path: expected one of 'auto', 'kernel'.*"
        r"got 'fast'",
    ):
        kc.store(manager, caches, ids, path="fast")
    with pytest.raises(KVGroupsTypeError, match="path: expected one of .* got int"):
        kc.prepare(manager, caches).store(ids, path=1)
    for path in ("auto", "kernel", None):
        kc.store(manager, caches, ids, path=path)


def test_numpy_refuses_copy_engine_and_torch_cpu_caches_cannot_run_it():
    manager, caches, ids = _store_args("numpy")
    with pytest.raises(
        KVGroupsValueError,
        match=r"path: expected one of 'auto', 'kernel', "
        r"got 'copy_engine'",
    ):
        kc.store(manager, caches, ids, path="copy_engine")
    manager, caches, ids = _store_args("torch")
    objects = random_objects(manager, 1, seed=1)
    before = objects[0].clone()
    with pytest.raises(UnsupportedConfigError, match="path: expected 'auto' or 'kernel' for CPU"):
        kc.store(manager, caches, ids, objects, path="copy_engine")
    with pytest.raises(UnsupportedConfigError, match="path: "):
        kc.prepare(manager, caches).load(objects, ids, path="copy_engine")
    assert torch.equal(objects[0], before)


def test_jax_refuses_copy_engine():
    jnp = pytest.importorskip("jax.numpy")
    manager, caches, ids = _store_args("numpy")
    caches = [jnp.asarray(c) for c in caches]
    with pytest.raises(KVGroupsValueError, match="path: expected one of 'auto', 'kernel'"):
        kc.store(manager, caches, ids, path="copy_engine")
    kc.store(manager, caches, ids, path="kernel")


def test_auto_splits_a_call_between_the_copy_engine_and_the_kernel(batches, monkeypatch):
    """Two object groups (gpt-oss: full and sliding-window layers): the table sends the
    pinned one to the copy engine and the device one to the kernel, in the same call; both
    move exactly the NumPy reference's bytes."""
    from kvgroups_core.transfer import reference
    from kvgroups_core.transfer.planner import bind, plan_call

    launches, seen = batches
    manager, caches = model_caches("gpt-oss-20b", layers=4, seed=12)
    host = [c.numpy().copy() for c in caches]
    ids = ids_for(manager, np.random.default_rng(13), 2)
    for direction in ("store", "load"):
        plan = plan_call(
            bind(manager, host),
            ids,
            direction,
            skip_first_n_tokens=64 if direction == "load" else 0,
        )
        objects = random_objects(manager, 2, seed=14)
        want_caches = [c.copy() for c in host]
        want_objects = [o.numpy().copy() for o in objects]
        reference.execute_plan(plan, want_caches, want_objects)
        pinned = objects[0]
        monkeypatch.setattr(
            copy_engine, "object_on_host", lambda entry, pinned=pinned: entry is pinned
        )
        points = [
            copy_paths.Point(direction, "pinned", 16384, 2, 2.0, 1.0),
            copy_paths.Point(direction, "device", 16384, 2, 1.0, 2.0),
        ]
        copy_paths.set_table(0, copy_paths.PathTable(points))
        got = [c.clone() for c in caches]
        launches.clear()
        seen.clear()
        cuda_execute.execute_plan(plan, got, objects, 0, pinned="direct")
        assert len(seen) == 1 and len(launches) == 1  # one batch, one kernel launch
        for o, want in zip(objects, want_objects):
            np.testing.assert_array_equal(o.numpy(), want)
        for c, want in zip(got, want_caches):
            np.testing.assert_array_equal(c.numpy().view(np.uint8), want.view(np.uint8))


def test_replacing_host_ids_out_of_range_are_refused_before_anything_moves(batches):
    from kvgroups_core.errors import KVGroupsIndexError

    case = _with_path(
        make_case(
            "nhd", "float16", "store", np.random.default_rng(15), nb=20, num_chunks=2, bpc=2, kept=2
        ),
        "copy_engine",
    )
    objects = torch.from_numpy(case.objects.copy())
    caches = [torch.from_numpy(c.copy()) for c in case.caches]
    for bad in ([0, 1, 2, 20], [0, -1, 2, 3]):
        with pytest.raises(KVGroupsIndexError, match=r"block_ids\[0\]: expected ids in \[0, 20\)"):
            cuda_execute.execute_plan(
                case.plan, caches, [objects], 0, block_ids=[torch.tensor(bad)]
            )
    with pytest.raises(KVGroupsValueError, match=r"block_ids\[0\]: expected a 1-D integer"):
        cuda_execute.execute_plan(case.plan, caches, [objects], 0, block_ids=[torch.tensor([1, 2])])
    np.testing.assert_array_equal(objects.numpy(), case.objects)
    assert not batches[1]
