"""The copy-engine path's host half on the CPU: the ``(dst, src, nbytes)`` lists of
:mod:`kvgroups_torch.copy_engine.runs`, computed against fake base addresses and applied with NumPy
memmoves on host buffers standing in for device memory, move exactly the bytes of the page
oracle (every layout of ``torch_page_cases``) and of the core's NumPy reference (real
managers: NHD, HND, MLA, the indexer's blocked scales, windowed groups, layer subsets and
prefix skips). Bytes no copy names must stay as they were (the buffers start random)."""

import numpy as np
import pytest
from kvgroups_torch.copy_engine.runs import copy_bytes, group_copies, object_plane

from kvgroups_core.formats.catalogue import EngineKVFormat as F
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_core.transfer import reference
from kvgroups_core.transfer.block_runs import block_runs
from kvgroups_core.transfer.planner import bind, plan_call
from kvgroups_tools.catalog import MODELS
from tests.support.torch_engine_cases import ids_for
from tests.support.torch_page_cases import LAYOUTS, make_case, oracle

SPACE = 1 << 40  # buffer k lives at fake address (k + 1) * SPACE


def fake(k: int) -> int:
    return (k + 1) * SPACE


def apply(copies, buffers):
    """Run the copies on ``buffers`` (flat uint8 arrays at fake addresses), checking that
    every range lies inside one buffer and that no two destinations overlap."""
    dst, src, sizes = copies
    written = [np.zeros(b.size, dtype=bool) for b in buffers]
    for d, s, n in zip(dst.tolist(), src.tolist(), sizes.tolist()):
        (bd, od), (bs, os) = divmod(d, SPACE), divmod(s, SPACE)
        dbuf, sbuf = buffers[bd - 1], buffers[bs - 1]
        assert n > 0 and od + n <= dbuf.size and os + n <= sbuf.size
        assert not written[bd - 1][od : od + n].any(), "two copies write the same bytes"
        written[bd - 1][od : od + n] = True
        dbuf[od : od + n] = sbuf[os : os + n]


def run_plan_with_copies(plan, caches, objects):
    """Every group's copies against fake addresses: caches are buffers 0..S-1, object row
    ``c`` of object group ``g`` is a buffer of its own (rows need not be adjacent)."""
    buffers = [c.reshape(-1).view(np.uint8) for c in caches]
    rows = {}
    for g, obj in enumerate(objects):
        for c in range(obj.shape[0]):
            rows[g, c] = len(buffers)
            buffers.append(obj[c])
    count = 0
    for group in plan.groups:
        planes = [fake(p.tensor_index) + p.byte_offset for p in group.planes]
        chunks = [fake(rows[group.object_group_idx, c]) for c in range(group.num_chunks)]
        copies = group_copies(group, plan.direction, planes, chunks)
        count += copies[0].size
        apply(copies, buffers)
    return count


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_page_layout_moves_the_oracles_bytes(layout, direction):
    rng = np.random.default_rng(7)
    for first_item, kept, pad in [(0, 4, 0), (5, 4, 24), (1, 2, 0)]:
        if direction == "store" and first_item:
            continue
        case = make_case(
            layout, "bfloat16", direction, rng, first_item=first_item, kept=kept, region_pad=pad
        )
        want_caches, want_objects = oracle(case)
        caches = [c.copy() for c in case.caches]
        objects = case.objects.copy()
        run_plan_with_copies(case.plan, caches, [objects])
        np.testing.assert_array_equal(objects, want_objects)
        for got, want in zip(caches, want_caches):
            np.testing.assert_array_equal(got, want)


def test_nhd_pages_are_one_copy_and_consecutive_blocks_merge():
    rng = np.random.default_rng(1)
    case = make_case("nhd", "float16", "store", rng, num_chunks=1, bpc=4, kept=4, nl=1)
    group = case.plan.groups[0]
    page = group.block_size * group.row_bytes
    assert copy_bytes(group) == page
    planes = [fake(0) + p.byte_offset for p in group.planes]
    # Scattered ids: one copy per (plane, block) of exactly one page.
    scattered = np.array([9, 3, 30, 17])
    dst, src, sizes = group_copies(group, "store", planes, [fake(5)], scattered)
    assert dst.size == 2 * 4 and (sizes == page).all()
    np.testing.assert_array_equal(src[:4], planes[0] + scattered * group.block_stride_bytes)
    # Consecutive ids at consecutive positions: one copy per plane for the whole chunk.
    dst, src, sizes = group_copies(group, "store", planes, [fake(5)], np.array([4, 5, 6, 7]))
    assert dst.size == 2 and (sizes == 4 * page).all()


def test_contiguous_pages_are_one_copy_per_run_of_consecutive_blocks_and_plane():
    case = make_case(
        "nhd", "float16", "store", np.random.default_rng(4), num_chunks=2, bpc=4, kept=4, nl=1
    )
    group = case.plan.groups[0]
    page = group.block_size * group.row_bytes
    planes = [fake(0) + p.byte_offset for p in group.planes]
    # Chunk 0: blocks 4-5 and 9-10; chunk 1: 11-13 (not joined to 10: another chunk) and 2.
    ids = np.array([4, 5, 9, 10, 11, 12, 13, 2])
    runs = block_runs(group, block_ids=ids)
    assert runs.count == 4
    dst, src, sizes = group_copies(group, "store", planes, [fake(5), fake(6)], ids)
    assert dst.size == runs.count * len(planes)
    np.testing.assert_array_equal(sizes[:4], np.array([2, 2, 3, 1]) * page)
    np.testing.assert_array_equal(
        src[:4], planes[0] + np.array([4, 9, 11, 2]) * group.block_stride_bytes
    )


def test_hnd_copies_are_pieces_and_the_estimate_says_so():
    case = make_case("hnd", "bfloat16", "load", np.random.default_rng(2), nh=2, hs=16)
    group = case.plan.groups[0]
    assert copy_bytes(group) == 16 * 2  # one head of one token
    planes = [fake(0) + p.byte_offset for p in group.planes]
    dst, src, sizes = group_copies(
        group, "load", planes, [fake(1 + c) for c in range(group.num_chunks)]
    )
    assert (sizes == 32).all()  # nothing continues on both sides


def _model(name, fmt=None, layers=3):
    """A manager over random NumPy caches of catalogue model ``name`` (float16 / uint8)."""
    model = MODELS[name].build(num_blocks=48, layers=layers, dtype="float16", fmt=fmt)
    rng = np.random.default_rng(3)
    caches = []
    for spec in model.kv_caches:
        dtype = np.uint8 if spec.dtype.name == "uint8" else np.float16
        raw = rng.integers(
            0, 256, int(np.prod(spec.shape)) * np.dtype(dtype).itemsize, dtype=np.uint8
        )
        caches.append(raw.view(dtype).reshape(spec.shape))
    manager = KVLayerGroupsManager(
        caches,
        list(model.formats),
        list(model.engine_group_infos) or None,
        lmcache_tokens_per_chunk=64,
    )
    return manager, caches


CASES = [
    ("llama3-8b", None, {}),
    ("llama3-8b", F.NL_X_TWO_NB_NH_BS_HS, {}),  # HND
    ("llama3-8b", F.NL_X_NB_TWO_BS_NH_HS, {"layers": [0, 2]}),
    ("deepseek-v3", None, {}),  # MLA
    ("glm5-indexer", None, {"layers": [1]}),  # MLA + blocked-scale indexer, two groups
    ("gpt-oss-20b", None, {}),  # sliding windows: a chunk keeps its last blocks
    ("gpt-oss-20b", None, {"skip": 80}),
    ("llama3-8b", None, {"skip": 130, "layers": [1]}),
]


@pytest.mark.parametrize(
    "name,fmt,kw,direction",
    [
        (*case, d)
        for case in CASES
        for d in ("store", "load")
        if d == "load" or "skip" not in case[2]
    ],
)
def test_model_plans_move_what_the_numpy_reference_moves(name, fmt, kw, direction):
    manager, host = _model(name, fmt)
    binding = bind(manager, host)
    ids = ids_for(manager, np.random.default_rng(4), 3)
    plan = plan_call(
        binding, ids, direction, skip_first_n_tokens=kw.get("skip", 0), layers=kw.get("layers")
    )
    if "layers" in kw:
        assert any(object_plane(p, i) != i for g in plan.groups for i, p in enumerate(g.planes)), (
            "a subset plan keeps its object planes"
        )
    rng = np.random.default_rng(5)
    objects = [rng.integers(0, 256, (3, n), dtype=np.uint8) for n in plan.object_nbytes]
    want_caches = [c.copy() for c in host]
    want_objects = [o.copy() for o in objects]
    reference.execute_plan(plan, [np.asarray(c) for c in want_caches], want_objects)
    caches = [c.copy() for c in host]
    got_objects = [o.copy() for o in objects]
    assert run_plan_with_copies(plan, caches, got_objects) > 0
    for got, want in zip(got_objects, want_objects):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(caches, want_caches):
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
