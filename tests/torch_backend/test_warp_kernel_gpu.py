"""The warp kernels (``kvg_*_v16_warp``: one warp per segment of a contiguous page) on a GPU
through the public prepared calls, bit-exact against the NumPy reference: pages smaller than a
segment, one segment, one and a half, several; store and load with host and CUDA ids, device
and host skips, layer subsets, the CTA cap (warps looping over units), out-of-range device ids
(their items untouched, raised at the check). Skipped cleanly without CUDA."""

import pytest
from kvgroups_cuda import geometry

from tests.support.cuda_marks import needs_cuda
from tests.support.torch_kernel_cases import PageCases, spy_on_kernels

pytestmark = needs_cuda

# (bs, nh, hs) of float16 NHD pages (bytes per block and plane); segments are 8 KiB.
PAGES = {1024: (16, 2, 16), 8192: (16, 2, 128), 12288: (16, 3, 128), 32768: (16, 8, 128)}
CASES = PageCases(PAGES, num_blocks=320, layers=3)  # 64-token chunks: 4 blocks per chunk


@pytest.fixture
def warp(monkeypatch):
    """Every contiguous 16-byte page runs the warp kernels; records the kernels picked."""
    yield from spy_on_kernels(monkeypatch, (geometry, "WARP_MIN_PAGE_BYTES", 16))


def _used_warp(names):
    return any(n.endswith("_warp") for n in names)


@pytest.mark.parametrize("chunks", [1, 70])
@pytest.mark.parametrize("ids_kind", ["host", "device"])
@pytest.mark.parametrize("page", sorted(PAGES))
def test_store_and_load_are_bit_exact(warp, page, ids_kind, chunks):
    CASES.round_trip(page, chunks, ids_kind=ids_kind, seed=page + chunks)
    assert _used_warp(warp)


@pytest.mark.parametrize("skip_kind", ["host", "device"])
@pytest.mark.parametrize("page", [1024, 12288])
def test_load_skips_match_the_reference(warp, page, skip_kind):
    CASES.load_skips(page, skip_kind, seed=3)
    assert _used_warp(warp)


@pytest.mark.parametrize("direction", ["store", "load"])
def test_layer_subsets_move_only_their_planes(warp, direction):
    CASES.layer_subsets(12288, direction, ([1], [0, 2]), seed=5)
    assert _used_warp(warp)


@pytest.mark.parametrize("page", [1024, 32768])
def test_cta_cap_loops_warps_over_the_same_bytes(warp, page):
    CASES.round_trip(page, 40, store_ctas=3, load_ctas=5, seed=8)
    assert _used_warp(warp)


@pytest.mark.parametrize("direction", ["store", "load"])
def test_out_of_range_device_ids_move_nothing_and_raise_at_the_check(warp, direction):
    CASES.bad_device_ids(32768, direction, seed=11)
    assert _used_warp(warp)
