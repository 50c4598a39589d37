"""The CUDA path's host side (geometry, vector width, packed KvgParams, grids, id and object
modes) checked without a GPU: ``cuLaunchKernel`` is replaced by a NumPy emulation of
page_copy.cu that reads the packed parameters and raw addresses exactly as the kernel does."""

import ctypes
import re

import numpy as np
import pytest
import torch
from kvgroups_cuda import params as P
from kvgroups_torch.cuda import device as cuda_device
from kvgroups_torch.cuda import device_tables
from kvgroups_torch.cuda import execute as cuda_execute
from kvgroups_torch.cuda import launch as cuda_launch
from kvgroups_torch.cuda import objects as cuda_objects
from kvgroups_torch.cuda import repeat as cuda_repeat

from tests.support.torch_page_cases import LAYOUTS, as_bytes, as_tensor, make_case, oracle

NAMES = P.all_kernel_names()


def _read(addr, n):
    return np.frombuffer(ctypes.string_at(addr, n), dtype=np.uint8)


def _write(addr, data):
    ctypes.memmove(addr, np.ascontiguousarray(data).ctypes.data, data.size)


def _report(p, value, engine_group, bound):
    rec = _read(p.err_record, 8 * P.ERR_WORDS).view(np.int64).copy()
    if rec[0] == 0:
        rec[:5] = (1, value, engine_group, p.err_kernel_group, bound)
    rec[5] += 1
    _write(p.err_record, rec.view(np.uint8))


def _first_item(p, report):
    """kvg_first_item of page_copy.cu."""
    if p.skip_mode == P.SKIP_NONE:
        return p.first_item
    size, fmt = (4, np.int32) if p.skip_mode == P.SKIP_DEVICE32 else (8, np.int64)
    skip = int(_read(p.skip, size).view(fmt)[0])
    if not 0 <= skip <= p.skip_max:
        if report:
            _report(p, skip, -1, p.skip_max)
        skip = min(max(skip, 0), p.skip_max)
    s = skip * p.skip_mul // p.skip_div
    bpc, kept = p.blocks_per_chunk, p.kept_per_chunk
    first = (s // bpc) * kept + max(s % bpc - (bpc - kept), 0)
    return min(max(first, p.first_item), p.first_item + p.num_items)


def _item_page(p, item, counts):
    """Chunk, kept position and block id of ``item``; None for an out-of-range id (reported
    when ``counts``), as the kernels' id lookup."""
    chunk, pos = divmod(item, p.kept_per_chunk)
    where = chunk * p.blocks_per_chunk + p.blocks_per_chunk - p.kept_per_chunk + pos
    if p.ids_mode == P.IDS_INLINE32:
        bid = p.inline_ids[where]
    else:
        size, fmt = (4, np.int32) if p.ids_mode == P.IDS_DEVICE32 else (8, np.int64)
        bid = int(_read(p.ids + size * where, size).view(fmt)[0])
    if not 0 <= bid < p.num_blocks:
        if counts:
            _report(p, bid, p.err_engine_group, p.num_blocks)
        return None
    return chunk, pos, bid


def _page_addresses(p, r, plane, chunk, pos, bid) -> tuple[int, int]:
    """(cache, object) addresses of run ``r`` of block ``bid`` in ``plane``, as the kernels
    compute them from the plane table and the object mode."""
    base, plane_off = _read(p.plane_table + 16 * plane, 16).view(np.int64).tolist()
    base &= (1 << 64) - 1
    if p.obj_mode == P.OBJ_STRIDED:
        obj = p.obj_base + chunk * p.obj_chunk_stride
    elif p.obj_mode == P.OBJ_TABLE:
        obj = int(_read(p.obj_table + 8 * chunk, 8).view(np.uint64)[0])
    else:
        obj = p.inline_objs[chunk]
    return (
        base + bid * p.block_stride + r.cache_offset,
        obj + p.region_offset + plane_off + pos * p.page_obj_stride + r.obj_offset,
    )


def _copy_page(p, kind, vec, store, r, plane, chunk, pos, bid):
    """Every vector of one page (run ``r`` of block ``bid`` in ``plane``)."""
    cache_page, obj_page = _page_addresses(p, r, plane, chunk, pos, bid)
    for k in range(r.page_units):
        if kind == "contig":
            c_off = o_off = k * vec
        else:
            t, r2 = divmod(k, r.units_per_token)
            piece, wu = divmod(r2, r.units_per_piece)
            c_off = t * r.token_stride + piece * r.cache_step + wu * vec
            o_off = t * p.row_bytes + piece * r.obj_step + wu * vec
        c_addr, o_addr = cache_page + c_off, obj_page + o_off
        assert c_addr % vec == 0 and o_addr % vec == 0, "misaligned vector"
        src, dst = (c_addr, o_addr) if store else (o_addr, c_addr)
        _write(dst, _read(src, vec))


def emulate(p: P.KvgParams, name: str, grid, launches: list):
    """page_copy.cu, one work unit at a time (threads folded into NumPy slices)."""
    if name.endswith("_warp"):
        emulate_warp(p, name, grid, launches)
        return
    direction, vec, kind = name.split("_")[1], int(name.split("_")[2][1:]), name.split("_")[3]
    launches.append((name, tuple(grid), p.items_per_cta))
    assert grid[1] == grid[2] == 1
    store = direction == "store"
    # Units by groups of about one chunk's tiles, every plane and run of a group in turn.
    planes_x_runs = p.num_planes * p.num_runs
    group_tiles = min(-(-p.kept_per_chunk // p.items_per_cta), p.num_tiles)
    full_groups = p.num_tiles // group_tiles
    full_work = full_groups * group_tiles * planes_x_runs
    num_work = p.num_tiles * planes_x_runs
    seen = set()
    for cta in range(grid[0]):
        for w in range(cta, num_work, grid[0]):
            group = w // (group_tiles * planes_x_runs) if w < full_work else full_groups
            size = group_tiles if w < full_work else p.num_tiles - full_groups * group_tiles
            in_group = w - group * group_tiles * planes_x_runs
            tile, rest = group * group_tiles + in_group % size, in_group // size
            plane, z = rest % p.num_planes, rest // p.num_planes
            assert (tile, plane, z) not in seen and tile < p.num_tiles  # a bijection
            seen.add((tile, plane, z))
            counts = plane == 0 and z == 0
            first = _first_item(p, counts and tile == 0)
            tile0 = tile * p.items_per_cta
            for it in range(min(p.items_per_cta, p.num_items - tile0)):
                item = p.first_item + tile0 + it
                if item < first:
                    continue
                found = _item_page(p, item, counts)
                if found is not None:
                    _copy_page(p, kind, vec, store, p.runs[z], plane, *found)
    assert len(seen) == num_work  # every (tile, plane, run) once


def emulate_warp(p: P.KvgParams, name: str, grid, launches: list):
    """kvg_warp_copy of page_copy.cu: one warp per segment of 32 * WARP_UNROLL vectors of a
    contiguous page, units seg + segs * (pos + kept * (plane + num_planes * row)) over the
    chunk rows from first_item's chunk on, warps looping over units when the grid is capped."""
    store = name.split("_")[1] == "store"
    launches.append((name, tuple(grid), p.segs_per_page))
    assert grid[1] == grid[2] == 1 and p.num_runs == 1
    run, seg_units = p.runs[0], 32 * P.WARP_UNROLL
    segs, kept = p.segs_per_page, p.kept_per_chunk
    assert segs == -(-run.page_units // seg_units)
    assert p.segs_shift == (segs.bit_length() - 1 if segs & (segs - 1) == 0 else 0xFF)
    row0 = p.first_item // kept
    end = p.first_item + p.num_items
    rows = -(-(end - row0 * kept) // kept)
    total = segs * kept * p.num_planes * rows
    assert total < 2**31  # the kernel counts units in 32 bits
    warps = grid[0] * P.WARPS_PER_CTA
    first = _first_item(p, True)  # only the thread of unit 0 reports the skip
    for w in range(warps):
        for u in range(w, total, warps):
            seg, rest = u % segs, u // segs
            row, in_row = divmod(rest, kept * p.num_planes)
            plane, pos = divmod(in_row, kept)
            item = (row0 + row) * kept + pos
            if item < first or item >= end:
                continue
            found = _item_page(p, item, plane == 0 and seg == 0)
            if found is None:
                continue
            cache_page, obj_page = _page_addresses(p, run, plane, *found)
            lo = seg * seg_units * 16
            hi = min(lo + seg_units * 16, run.page_units * 16)
            src, dst = (cache_page, obj_page) if store else (obj_page, cache_page)
            assert src % 16 == 0 and dst % 16 == 0, "misaligned vector"
            _write(dst + lo, _read(src + lo, hi - lo))


@pytest.fixture(params=["classic", "warp"])
def emulated(request, monkeypatch):
    """Launches emulated; ``classic``: contiguous pages run kvg_*_contig, ``warp``: every
    contiguous 16-byte page runs kvg_*_v16_warp (pages smaller than a segment included)."""
    from kvgroups_cuda import geometry

    monkeypatch.setattr(geometry, "WARP_MIN_PAGE_BYTES", 16 if request.param == "warp" else 0)
    launches = []

    class FakeKernels:
        def handle(self, name):
            return NAMES.index(name)

    class FakeDevice:
        index = 0
        arch = "sm_90"
        num_sms = 4
        err_table = device_tables.HostTable(np.zeros(P.ERR_WORDS, dtype=np.int64))
        err_record = err_table.tensor
        kernels = FakeKernels()

    class FakeLauncher:
        def __init__(self, device_index, params_address, *, programmatic=False):
            # Every page-copy kernel waits for the grid before it: all may launch early.
            assert programmatic
            self.address = params_address

        def launch(self, function, grid, threads, stream):
            assert threads == P.THREADS
            emulate(P.KvgParams.from_address(self.address), NAMES[function], grid, launches)

    monkeypatch.setattr(cuda_execute, "device_state", lambda index: FakeDevice())
    monkeypatch.setattr(cuda_launch, "Launcher", FakeLauncher)
    monkeypatch.setattr(cuda_execute, "current_stream", lambda index: 0)
    monkeypatch.setattr(cuda_repeat, "current_stream", lambda index: 0)
    monkeypatch.setattr(cuda_objects, "check_object_placement", lambda t, i, w: None)
    monkeypatch.setattr(cuda_launch, "to_device", lambda a, i: torch.from_numpy(a.copy()))
    monkeypatch.setattr(cuda_objects, "to_table", lambda a, i: device_tables.HostTable(a))
    monkeypatch.setattr(cuda_launch, "to_table", lambda a, i: device_tables.HostTable(a))
    cuda_launch._by_identity.clear()
    cuda_launch._by_value.clear()
    return launches, FakeDevice


def _run(case, offset_elems=0, per_chunk=False, ids=None):
    caches = [
        as_tensor(
            c,
            case.dtype,
            "cpu",
            offset_elems
            * case.caches[0].itemsize
            * (2 if case.dtype in ("float16", "bfloat16") else 1),
        )
        for c in case.caches
    ]
    objects = torch.from_numpy(case.objects.copy())
    entry = [row.clone() for row in objects] if per_chunk else objects
    cuda_execute.execute_plan(
        case.plan, caches, [entry], 0, block_ids=None if ids is None else [ids]
    )
    got = np.stack([o.numpy() for o in entry]) if per_chunk else objects.numpy()
    return [as_bytes(c) for c in caches], got


def _check(case, **kw):
    want_caches, want_objects = oracle(case)
    got_caches, got_objects = _run(case, **kw)
    np.testing.assert_array_equal(got_objects, want_objects)
    for got, want in zip(got_caches, want_caches):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_emulated_kernel_matches_the_page_model(emulated, layout, direction):
    rng = np.random.default_rng(len(layout) * 3 + len(direction))
    _check(
        make_case(
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
        )
    )
    launches, _ = emulated
    name = launches[-1][0]
    assert ("contig" in name or "warp" in name) == (
        layout in ("nhd", "nhd_padded", "cross_layer", "mla")
    )


def test_vector_width_follows_addresses_and_offsets(emulated):
    launches, _ = emulated
    rng = np.random.default_rng(1)
    _check(make_case("nhd", "float32", "store", rng, nb=8, bs=2, hs=8, num_chunks=1, bpc=2, kept=2))
    from kvgroups_cuda import geometry

    warp = geometry.WARP_MIN_PAGE_BYTES > 0
    assert launches[-1][0] == ("kvg_store_v16_warp" if warp else "kvg_store_v16_contig")
    _check(
        make_case(
            "hnd",
            "float16",
            "load",
            rng,
            nb=8,
            bs=2,
            hs=8,
            num_chunks=1,
            bpc=2,
            kept=2,
            region_pad=6,
        )
    )
    assert launches[-1][0] == "kvg_load_v2_runs"
    _check(make_case("indexer", "uint8", "store", rng, nb=8, bs=2, num_chunks=1, bpc=2, kept=2))
    assert launches[-1][0] == "kvg_store_v4_runs"


def test_emulated_per_chunk_objects_inline_and_on_the_device(emulated):
    rng = np.random.default_rng(2)
    _check(
        make_case("hnd", "bfloat16", "store", rng, nb=8, bs=2, hs=8, num_chunks=3, bpc=2, kept=2),
        per_chunk=True,
    )
    _check(
        make_case(
            "nhd", "bfloat16", "load", rng, nb=300, bs=1, nh=1, hs=8, num_chunks=70, bpc=2, kept=2
        ),
        per_chunk=True,
    )


def test_emulated_ids_beyond_the_inline_capacity(emulated):
    rng = np.random.default_rng(4)
    case = make_case(
        "nhd",
        "uint8",
        "store",
        rng,
        nb=1200,
        bs=1,
        nh=1,
        hs=16,
        nl=1,
        num_chunks=130,
        bpc=5,
        kept=5,
    )
    _check(case)


def test_emulated_out_of_range_ids_move_nothing_and_flag(emulated):
    _, device = emulated
    device.err_record.zero_()
    rng = np.random.default_rng(9)
    case = make_case("hnd", "float16", "load", rng, nb=8, bs=2, hs=8, num_chunks=2, bpc=3, kept=3)
    bad = np.array([2, 8, -1, 5, 2**31 + 3, 7], dtype=np.int64)
    want_caches, _ = oracle(case, ids=bad)
    got_caches, _ = _run(case, ids=bad)
    assert device.err_record[:6].tolist() == [1, 8, 0, 0, 8, 3]  # first bad id 8, 3 bad
    for got, want in zip(got_caches, want_caches):
        np.testing.assert_array_equal(got, want)


# The prepared path (kvgroups_core.transfer.api.prepare) through cuda_execute.DeviceCaches, with CPU
# tensors standing in for the GPU's: its object checks, object addresses and launches are the ones a
# CUDA call runs, and the emulated kernel moves the bytes.


def _model_caches(name, rng, layers=2, num_blocks=12):
    from kvgroups_tools.catalog import MODELS

    model = MODELS[name].build(num_blocks=num_blocks, layers=layers, dtype="float16")
    caches = []
    for spec in model.kv_caches:
        nbytes = int(np.prod(spec.shape)) * spec.dtype.itemsize
        raw = torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8))
        caches.append(raw.view(torch.float16).view(spec.shape))
    return model, caches


def _emulated_prepare(manager, caches):
    """A prepared torch transfer whose per-call path is the CUDA one, on CPU tensors."""
    from kvgroups_core.transfer.api import prepare

    prepared = prepare(manager, caches, backend="torch")
    fast = cuda_execute.DeviceCaches(prepared._bound.caches, 0)
    fast.device = torch.device("cpu")  # "objects on the caches' GPU" = CPU tensors here
    prepared._bound.device_caches = fast
    return prepared


def _pair(name, seed, chunk=64):
    from kvgroups_core.grouping.manager import KVLayerGroupsManager

    model, caches = _model_caches(name, np.random.default_rng(seed))
    manager = KVLayerGroupsManager(
        caches,
        list(model.formats),
        list(model.engine_group_infos) or None,
        lmcache_tokens_per_chunk=chunk,
    )
    twin = [c.clone() for c in caches]
    from kvgroups_core.transfer.api import prepare

    return manager, _emulated_prepare(manager, caches), prepare(manager, twin, backend="torch")


def _ids_for(manager, rng, num_chunks, num_blocks=12):
    by_group = {}
    for k, g in enumerate(manager.kernel_groups):
        n = num_chunks * manager.calculate_num_blocks(k, manager.lmcache_tokens_per_chunk)
        by_group.setdefault(g.engine_group_idx, rng.permutation(num_blocks)[:n])
    return by_group if len(by_group) > 1 else next(iter(by_group.values()))


@pytest.mark.parametrize("name", ["llama3-8b", "gpt-oss-20b"])
def test_prepared_calls_through_device_caches_match_the_cpu_path(emulated, name):
    launches, _ = emulated
    manager, fast, ref = _pair(name, 11)
    rng = np.random.default_rng(12)
    for step in range(3):  # repeated calls: new ids, new and reused object buffers
        num_chunks = 1 + step % 2
        ids = _ids_for(manager, rng, num_chunks)
        before = len(launches)
        got = fast.store(
            ids,
            [torch.zeros((num_chunks, n), dtype=torch.uint8) for n in fast.binding.object_nbytes],
        )
        assert len(launches) > before  # the device path ran, not the CPU fallback
        want = ref.store(ids)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
        objects = [
            torch.from_numpy(rng.integers(0, 256, tuple(o.shape), dtype=np.uint8)) for o in got
        ]
        skip = 16 * step
        fast.load(objects, ids, skip_first_n_tokens=skip)
        ref.load([o.clone() for o in objects], ids, skip_first_n_tokens=skip)
        for a, b in zip(fast.kv_caches, ref.kv_caches):
            np.testing.assert_array_equal(as_bytes(a), as_bytes(b))


def test_prepared_fast_path_rejects_bad_input_before_any_launch(emulated):
    from kvgroups_core.errors import KVGroupsIndexError, KVGroupsTypeError, KVGroupsValueError

    launches, _ = emulated
    manager, fast, _ = _pair("llama3-8b", 13)
    nbytes = fast.binding.object_nbytes[0]
    ids = np.arange(4)
    good = torch.zeros((1, nbytes), dtype=torch.uint8)
    fast.store(ids, [good])  # binds (and memoises) this buffer
    snapshot = [as_bytes(c).copy() for c in fast.kv_caches]
    before = len(launches)
    bad_calls = [
        (
            KVGroupsValueError,
            "objects\\[0\\]: expected uint8 \\[1,",
            lambda: fast.load([torch.zeros((1, nbytes + 2), dtype=torch.uint8)], ids),
        ),
        (
            KVGroupsValueError,
            "objects\\[0\\]: expected uint8",
            lambda: fast.load([torch.zeros((1, nbytes // 2), dtype=torch.int16)], ids),
        ),
        (
            KVGroupsValueError,
            "contiguous rows",
            lambda: fast.load([torch.zeros((1, 2 * nbytes), dtype=torch.uint8)[:, ::2]], ids),
        ),
        (
            KVGroupsValueError,
            "objects: expected 1 entries",
            lambda: fast.load([good, good.clone()], ids),
        ),
        (KVGroupsTypeError, "objects: expected a list", lambda: fast.load(good, ids)),
        (
            KVGroupsIndexError,
            "expected ids in \\[0, 12\\)",
            lambda: fast.load([good], np.array([0, 1, 12, 3])),
        ),
        (KVGroupsIndexError, "got -1", lambda: fast.load([good], np.array([0, 1, -1, 3]))),
        (KVGroupsValueError, "multiple of 4", lambda: fast.load([good], np.arange(5))),
        (
            KVGroupsTypeError,
            "block_ids: expected a 1-D sequence of ints",
            lambda: fast.load([good], np.arange(4.0)),
        ),
        (
            KVGroupsValueError,
            "skip_first_n_tokens",
            lambda: fast.load([good], ids, skip_first_n_tokens=65),
        ),
    ]
    for error, text, call in bad_calls:
        with pytest.raises(error, match=text):
            call()
    # The memoised buffer, changed in place under the same tensor object, is checked again.
    good.set_(torch.zeros((2, nbytes), dtype=torch.uint8))
    with pytest.raises(KVGroupsValueError, match="objects\\[0\\]: expected uint8 \\[1,"):
        fast.load([good], ids)
    assert len(launches) == before
    for got, want in zip(fast.kv_caches, snapshot):
        np.testing.assert_array_equal(as_bytes(got), want)


def test_prepared_fast_path_follows_a_buffer_to_its_new_address(emulated):
    manager, fast, ref = _pair("llama3-8b", 14)
    nbytes = fast.binding.object_nbytes[0]
    ids = np.array([3, 1, 4, 0])
    out = torch.zeros((1, nbytes), dtype=torch.uint8)
    fast.store(ids, [out])
    out.set_(torch.zeros((1, nbytes), dtype=torch.uint8))  # same object, new storage
    fast.store(ids, [out])
    np.testing.assert_array_equal(out.numpy(), ref.store(ids)[0].numpy())


def test_bound_plan_eager_run_goes_through_device_caches(emulated, monkeypatch):
    from kvgroups_torch import BoundPlan, bound_plan

    launches, _ = emulated
    monkeypatch.setattr(bound_plan, "cache_device", lambda caches: torch.device("cuda", 0))
    rng = np.random.default_rng(15)
    case = make_case("hnd", "float16", "store", rng, nb=8, bs=2, hs=8, num_chunks=2, bpc=2, kept=2)
    caches = [as_tensor(c, case.dtype, "cpu") for c in case.caches]
    objects = torch.from_numpy(case.objects.copy())
    bound = BoundPlan(case.plan, caches, [objects], pinned="direct")
    for _ in range(2):
        ids = rng.permutation(8)[:4]
        before = len(launches)
        bound.run(torch.from_numpy(ids))
        assert len(launches) == before + 1
        np.testing.assert_array_equal(objects.numpy(), oracle(case, ids=ids)[1])


def test_entry_points_that_bypass_the_core_apply_its_object_rule(emulated, monkeypatch):
    # execute_plan and BoundPlan take a plan directly: they refuse bad objects with the very
    # error of the core's check_objects (one rule, one message), before any launch.
    from kvgroups_torch import BoundPlan, bound_plan
    from kvgroups_torch.describe import shape_of

    from kvgroups_core.errors import KVGroupsError
    from kvgroups_core.transfer.objects import check_objects

    launches, _ = emulated
    monkeypatch.setattr(bound_plan, "cache_device", lambda caches: torch.device("cuda", 0))
    case = make_case(
        "hnd",
        "float16",
        "store",
        np.random.default_rng(16),
        nb=8,
        bs=2,
        hs=8,
        num_chunks=2,
        bpc=2,
        kept=2,
    )
    caches = [as_tensor(c, case.dtype, "cpu") for c in case.caches]
    rows, nbytes = case.objects.shape
    wide = torch.zeros((rows, 2 * nbytes), dtype=torch.uint8)
    bad = [
        torch.zeros((rows, nbytes), dtype=torch.int16),  # dtype
        torch.zeros((rows + 1, nbytes), dtype=torch.uint8),  # chunks
        wide[:, ::2],  # rows not contiguous
        [torch.zeros(nbytes, dtype=torch.uint8), wide[0, ::2]],  # a strided per-chunk buffer
        [torch.zeros(nbytes, dtype=torch.uint8)],  # too few per-chunk buffers
    ]
    for entry in bad:
        with pytest.raises(KVGroupsError) as core:
            check_objects(case.plan, [entry], shape_of)
        want = f"^{re.escape(str(core.value))}$"
        before = len(launches)
        with pytest.raises(type(core.value), match=want):
            cuda_execute.execute_plan(case.plan, caches, [entry], 0)
        with pytest.raises(type(core.value), match=want):
            BoundPlan(case.plan, caches, [entry], pinned="direct")
        assert len(launches) == before


# Device-side ids, skips, layer subsets and the CTA cap through the public prepared calls,
# on CPU tensors standing in for CUDA ones: TorchBackend keeps them where they are (as it
# does CUDA tensors), the emulated kernel reads them by address, and the error record is
# the emulated device's.


@pytest.fixture
def device_ids(emulated, monkeypatch):
    from kvgroups_torch.backend import TorchBackend

    monkeypatch.setattr(cuda_launch, "on_device", lambda t, index: True)
    monkeypatch.setattr(cuda_repeat, "on_device", lambda t, index: True)

    def spec(self, x):
        if isinstance(x, torch.Tensor):
            return str(x.dtype).rpartition(".")[2], tuple(x.shape)
        return None

    def key(self, x):  # the call memo's fingerprint of device ids, CPU tensors included
        if type(x) is torch.Tensor:
            return x.dtype, x.shape, x.is_contiguous()
        return None

    monkeypatch.setattr(TorchBackend, "device_ids_spec", spec)
    monkeypatch.setattr(TorchBackend, "device_ids_key", key)
    return emulated


def test_emulated_device_ids_drop_bad_items_and_record_the_first_bad_value(device_ids):
    from kvgroups_core.errors import KVGroupsIndexError
    from tests.support.torch_engine_cases import (
        cache_bytes,
        object_bytes,
        random_objects,
        reference_with_drops,
    )

    launches, device = device_ids
    device.err_record.zero_()
    manager, fast, _ = _pair("llama3-8b", 21)
    bad = np.random.default_rng(22).permutation(12)[:8]
    bad[[3, 6]] = [12, -5]
    for direction in ("store", "load"):
        objects = random_objects(manager, 2, seed=23)
        want_caches, want_objects, met = reference_with_drops(
            manager, fast.kv_caches, objects, bad, direction
        )
        ids = torch.from_numpy(bad.astype(np.int32))
        before = len(launches)
        if direction == "store":
            fast.store(ids, objects)
        else:
            fast.load(objects, ids)
        assert len(launches) == before + 1 and met == {12, -5}
        for got, want in zip(object_bytes(objects), want_objects):
            np.testing.assert_array_equal(got, want)
        for got, want in zip(cache_bytes(fast.kv_caches), want_caches):
            np.testing.assert_array_equal(got, want)
        rec = device.err_record.tolist()
        assert rec[0] == 1 and rec[1] == 12 and rec[4] == 12 and rec[5] == 2
        with pytest.raises(
            KVGroupsIndexError,
            match=r"block_ids\[0\]: expected ids in "
            r"\[0, 12\).*got 12",
        ):
            cuda_device.raise_recorded(device.err_record, "cuda:0")
        assert device.err_record.tolist() == [0] * P.ERR_WORDS  # cleared by the check


@pytest.mark.parametrize("name", ["llama3-8b", "gpt-oss-20b"])
def test_emulated_device_skip_matches_the_host_skip(device_ids, name):
    from tests.support.torch_engine_cases import cache_bytes, random_objects

    manager, fast, ref = _pair(name, 24)
    rng = np.random.default_rng(25)
    ids = _ids_for(manager, rng, 2)
    dev_ids = (
        {g: torch.from_numpy(v) for g, v in ids.items()}
        if isinstance(ids, dict)
        else torch.from_numpy(ids)
    )
    skip = torch.zeros((), dtype=torch.int64)
    for tokens in (0, 16, 48, 64, 80, 128):
        objects = random_objects(manager, 2, seed=tokens)
        skip.fill_(tokens)  # the same tensor each call, as a graph replay reads it
        fast.load(objects, dev_ids, skip_first_n_tokens=skip)
        ref.load([o.clone() for o in objects], ids, skip_first_n_tokens=tokens)
        for a, b in zip(cache_bytes(fast.kv_caches), cache_bytes(ref.kv_caches)):
            np.testing.assert_array_equal(a, b, err_msg=f"skip {tokens}")


def test_emulated_device_skip_out_of_range_is_clamped_and_recorded(device_ids):
    from kvgroups_core.errors import KVGroupsValueError
    from tests.support.torch_engine_cases import cache_bytes, random_objects

    _, device = device_ids
    device.err_record.zero_()
    manager, fast, ref = _pair("llama3-8b", 26)
    ids = np.arange(8)
    objects = random_objects(manager, 2, seed=27)
    fast.load(objects, torch.from_numpy(ids), skip_first_n_tokens=torch.tensor(-7))
    ref.load([o.clone() for o in objects], ids, skip_first_n_tokens=0)  # clamped to 0
    for a, b in zip(cache_bytes(fast.kv_caches), cache_bytes(ref.kv_caches)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(KVGroupsValueError, match=r"skip_first_n_tokens.*\[0, 128\].*got -7"):
        cuda_device.raise_recorded(device.err_record, "cuda:0")


@pytest.mark.parametrize("name", ["llama3-8b", "gpt-oss-20b"])
def test_emulated_layer_subset_is_one_launch_per_kernel_group_at_its_object_rows(emulated, name):
    launches, _ = emulated
    manager, fast, ref = _pair(name, 28)
    ids = _ids_for(manager, np.random.default_rng(29), 2)
    for layer in range(2):
        groups = [k for k, g in enumerate(manager.kernel_groups) if layer in g.layer_indices]
        objects = [
            torch.from_numpy(np.random.default_rng(layer).integers(0, 256, (2, n), dtype=np.uint8))
            for n in fast.binding.object_nbytes
        ]
        want = ref.store(ids, [o.clone() for o in objects], layers=[layer])
        before = len(launches)
        fast.store(ids, objects, layers=[layer])
        assert len(launches) - before == len(groups)
        for a, b in zip(objects, want):
            np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_emulated_cta_cap_loops_over_the_work_with_the_same_bytes(emulated):
    launches, _ = emulated
    manager, fast, ref = _pair("llama3-8b", 30)
    ids = _ids_for(manager, np.random.default_rng(31), 2)
    objects = [torch.zeros((2, n), dtype=torch.uint8) for n in fast.binding.object_nbytes]
    fast.store(ids, objects, max_ctas=3)
    assert launches[-1][1][0] == 3  # the grid: 3 CTAs for every work unit of the launch
    from kvgroups_cuda import geometry

    assert launches[-1][0].endswith("_warp") == (geometry.WARP_MIN_PAGE_BYTES > 0)
    for a, b in zip(objects, ref.store(ids)):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_emulated_interleaved_layer_calls_rewrite_what_changed(device_ids):
    # Launches skip parameter writes equal to their variant's last launch: interleave layers,
    # chunk counts, object buffers and a CTA cap so every field changes between calls, and
    # check the bytes after each call against the CPU path.
    from tests.support.torch_engine_cases import object_bytes

    launches, _ = device_ids
    manager, fast, ref = _pair("llama3-8b", 31)
    rng = np.random.default_rng(32)
    ids = {n: _ids_for(manager, rng, n) for n in (1, 2)}
    buffers = {
        n: [
            [torch.zeros((n, b), dtype=torch.uint8) for b in fast.binding.object_nbytes]
            for _ in range(2)
        ]
        for n in (1, 2)
    }
    for call in range(12):
        n, layer, which = 1 + call % 2, (call // 2) % 2, (call // 3) % 2
        objects = buffers[n][which]
        for o in objects:
            o.zero_()
        before = len(launches)
        fast.store(
            torch.from_numpy(ids[n]), objects, layers=[layer], max_ctas=None if call % 4 else 1
        )
        assert len(launches) == before + 1
        want = ref.store(ids[n], [o.clone() for o in objects], layers=[layer])
        for got, w in zip(object_bytes(objects), object_bytes(want)):
            np.testing.assert_array_equal(got, w, err_msg=f"call {call}")


def test_emulated_warp_kernel_covers_partial_segments_and_capped_grids(emulated):
    # Pages of an eighth of a segment, one segment and one and a half (8 KiB segments by
    # default): every vector of the page moves once, in both directions.
    from kvgroups_cuda import geometry

    launches, _ = emulated
    rng = np.random.default_rng(41)
    segment = 32 * P.WARP_UNROLL * 16
    for hs in (segment // 256, segment // 32, 3 * segment // 64):  # float32 NHD rows: block
        # of 2 tokens x 4 heads x hs words, so a page is 32 * hs bytes
        for direction in ("store", "load"):
            _check(
                make_case(
                    "nhd",
                    "float32",
                    direction,
                    rng,
                    nb=10,
                    bs=2,
                    nh=4,
                    hs=hs,
                    num_chunks=2,
                    bpc=3,
                    kept=3 if direction == "store" else 2,
                ),
                per_chunk=True,
            )  # one allocation per chunk: 16-byte aligned objects
            name = launches[-1][0]
            assert name.endswith("_warp") == (geometry.WARP_MIN_PAGE_BYTES > 0), name
            if name.endswith("_warp"):
                assert launches[-1][2] == -(-(2 * 4 * hs * 4) // segment)  # segments per page


def test_warp_selection_and_sizing():
    # The warp kernels take contiguous 16-byte pages from WARP_MIN_PAGE_BYTES up, never
    # runs; a launch whose segments would pass the kernel's 32-bit count is refused
    # (None: the classic kernel takes it), and the grid covers every segment with 8 warps/CTA.
    from dataclasses import replace

    from kvgroups_cuda import geometry

    rng = np.random.default_rng(5)
    nhd = geometry.group_shape(
        make_case(
            "nhd", "float32", "store", rng, nb=8, bs=16, nh=8, hs=64, num_chunks=1, bpc=2, kept=2
        ).plan.groups[0]
    )
    assert nhd.contiguous and nhd.page_bytes == 32768
    hnd = geometry.group_shape(
        make_case(
            "hnd",
            "float16",
            "store",
            rng,
            nb=8,
            bs=2,
            hs=8,
            num_chunks=1,
            bpc=2,
            kept=2,
            region_pad=6,
        ).plan.groups[0]
    )
    assert geometry.uses_warp_kernel(nhd)
    assert not geometry.uses_warp_kernel(hnd)
    assert not geometry.uses_warp_kernel(replace(nhd, page_bytes=geometry.WARP_MIN_PAGE_BYTES - 16))
    assert not geometry.uses_warp_kernel(replace(nhd, unit=8))
    assert geometry.warp_sizing(32768, 1000, 64, 16, 8) == (4, -(-4 * 1000 * 64 // 8))
    assert geometry.warp_sizing(12288, 3, 2, 16, 8) == (2, 2)  # 1.5 segments round up
    assert geometry.warp_sizing(32768, 2**26, 32, 16, 8) is None  # 2**33 segments
    # Units cover whole chunk rows: items 3..15 of chunks of 8 kept pages span two rows.
    assert geometry.warp_sizing(32768, 13, 2, 16, 8, first_item=3, kept_per_chunk=8) == (4, 16)
    assert geometry.warp_sizing(32768, 8, 2, 16, 8, first_item=8, kept_per_chunk=8) == (4, 8)
