import zlib

import numpy as np
import pytest
import torch
from kvgroups_torch import cpu as cpu_copy
from kvgroups_torch.cuda import execute as cuda_execute

from kvgroups_core.tensors.descriptors import describe_numpy
from kvgroups_core.transfer.reference import byte_view, execute_group
from tests.support.cuda_marks import needs_cuda
from tests.support.torch_page_cases import (
    ITEMSIZE,
    LAYOUTS,
    as_bytes,
    as_tensor,
    make_case,
    oracle,
)

DTYPES = ("float16", "bfloat16", "float32", "uint8", "float8_e4m3fn")
IMPLS = [
    pytest.param("cpu", id="torch-cpu"),
    pytest.param("cuda", id="torch-cuda", marks=needs_cuda),
    pytest.param("cuda-pinned", id="torch-cuda-pinned", marks=needs_cuda),
    pytest.param("cuda-staged", id="torch-cuda-staged", marks=needs_cuda),
    pytest.param("cuda-indexing", id="torch-cuda-indexing", marks=needs_cuda),
]


def _execute(impl, plan, caches, objects):
    if impl in ("cpu", "cuda-indexing"):
        cpu_copy.execute_plan(plan, caches, objects)
    else:
        pinned = "staged" if impl == "cuda-staged" else "direct"
        cuda_execute.execute_plan(plan, caches, objects, caches[0].device.index, pinned=pinned)


def _objects_tensor(impl, raw, per_chunk=False):
    t = torch.from_numpy(raw.copy())
    if impl in ("cuda-pinned", "cuda-staged"):
        t = t.pin_memory()
    elif impl != "cpu":
        t = t.to("cuda")
    if per_chunk:
        # Separate buffers, deliberately not adjacent: each inside its own larger allocation.
        return [
            torch.cat([torch.zeros(5, dtype=torch.uint8, device=t.device), row])[5:].clone()
            if not t.is_pinned()
            else row.clone().pin_memory()
            for row in t
        ]
    return t


def run_case(impl, case, *, offset_elems=0, per_chunk=False):
    device = "cpu" if impl == "cpu" else "cuda"
    offset = offset_elems * ITEMSIZE[case.dtype]
    caches = [as_tensor(c, case.dtype, device, offset) for c in case.caches]
    objects = _objects_tensor(impl, case.objects, per_chunk)
    _execute(impl, case.plan, caches, [objects])
    if device == "cuda":
        torch.cuda.synchronize()
    got_objects = (
        np.stack([o.cpu().numpy() for o in objects]) if per_chunk else objects.cpu().numpy()
    )
    return [as_bytes(c) for c in caches], got_objects


def assert_case(impl, case, **kw):
    want_caches, want_objects = oracle(case)
    got_caches, got_objects = run_case(impl, case, **kw)
    # Whole buffers: moved bytes right AND every other byte untouched.
    np.testing.assert_array_equal(got_objects, want_objects)
    for got, want in zip(got_caches, want_caches):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_and_dtype_moves_exact_bytes(impl, layout, dtype, direction):
    if layout == "indexer" and dtype != "uint8":
        pytest.skip("the blocked-scale indexer cache is uint8 only")
    rng = np.random.default_rng(zlib.crc32(f"{layout}/{dtype}/{direction}".encode()))
    assert_case(impl, make_case(layout, dtype, direction, rng))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["nhd", "hnd", "interleaved", "indexer"])
def test_sliding_window_keeps_the_last_blocks_of_each_chunk(impl, layout):
    rng = np.random.default_rng(11)
    for direction in ("store", "load"):
        assert_case(impl, make_case(layout, "bfloat16", direction, rng, bpc=5, kept=2))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("first_item", [1, 5, 11, 12])
def test_load_skips_a_prefix_of_items(impl, first_item):
    rng = np.random.default_rng(first_item)
    assert_case(impl, make_case("hnd", "float16", "load", rng, first_item=first_item))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("region_pad,offset_elems", [(6, 0), (2, 3), (16, 1), (4, 0)])
def test_unaligned_regions_and_storage_offsets_narrow_the_vector(impl, region_pad, offset_elems):
    rng = np.random.default_rng(region_pad * 7 + offset_elems)
    for layout in ("nhd", "hnd"):
        for direction in ("store", "load"):
            case = make_case(layout, "float16", direction, rng, region_pad=region_pad)
            assert_case(impl, case, offset_elems=offset_elems)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("direction", ["store", "load"])
def test_objects_as_separate_per_chunk_buffers(impl, direction):
    rng = np.random.default_rng(5)
    assert_case(impl, make_case("interleaved", "float32", direction, rng), per_chunk=True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bs", [1, 3, 16])
def test_block_sizes(impl, bs):
    rng = np.random.default_rng(bs)
    for layout in ("nhd", "hnd", "heads_outer"):
        assert_case(
            impl,
            make_case(layout, "bfloat16", "store", rng, bs=bs, nb=20, num_chunks=2, bpc=3, kept=3),
        )


@pytest.mark.parametrize("impl", IMPLS)
def test_many_chunks_and_large_pages(impl):
    # More than 64 chunks (object table on the device for per-chunk buffers) and more ids
    # than fit in the launch parameters.
    rng = np.random.default_rng(3)
    case = make_case(
        "nhd",
        "bfloat16",
        "store",
        rng,
        nl=2,
        nb=700,
        bs=2,
        nh=4,
        hs=64,
        num_chunks=130,
        bpc=5,
        kept=4,
    )
    assert_case(impl, case)
    assert_case(impl, case, per_chunk=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_oracle_agrees_with_the_core_reference(layout):
    rng = np.random.default_rng(21)
    for direction in ("store", "load"):
        case = make_case(
            layout,
            "uint8" if layout == "indexer" else "bfloat16",
            direction,
            rng,
            bpc=4,
            kept=3,
            first_item=1 if direction == "load" else 0,
        )
        want_caches, want_objects = oracle(case)
        caches = [c.copy() for c in case.caches]
        objects = case.objects.copy()
        views = [byte_view(describe_numpy(c), writable=True) for c in caches]
        execute_group(case.plan.groups[0], direction == "store", views, objects)
        np.testing.assert_array_equal(objects, want_objects)
        for got, want in zip(caches, want_caches):
            np.testing.assert_array_equal(got, want)
