"""The small-page kernels (``kvg_*_small``) on a GPU through the public prepared calls,
bit-exact against the NumPy reference: 512 B, 1 KiB and 2 KiB pages, NHD and HND, store and
load with host and CUDA ids, device and host skips, layer subsets, the CTA cap, out-of-range
device ids (their items untouched, raised at the check), and the swept tunables (planes per
unit, unit bytes, loads in flight). Skipped cleanly without CUDA."""

import pytest
from kvgroups_cuda import geometry, nvrtc
from kvgroups_torch.cuda import launch as cuda_launch

from tests.support.cuda_marks import needs_cuda
from tests.support.torch_kernel_cases import PageCases, spy_on_kernels

pytestmark = needs_cuda

# (bs, nh, hs) of float16 pages: 512 B, 1 KiB, 2 KiB per block and plane.
PAGES = {512: (16, 1, 16), 1024: (16, 2, 16), 2048: (16, 1, 64)}
CASES = PageCases(PAGES, num_blocks=640, layers=4)  # 64-token chunks: 4 blocks per chunk


@pytest.fixture
def small(monkeypatch):
    """Select the small-page kernels with partial plane groups (8 planes, 3 per unit is not
    a power of two: 2) and record every kernel the launches pick."""
    yield from spy_on_kernels(monkeypatch, (geometry, "SMALL_PAGE_BYTES", 4096),
                              (geometry, "SMALL_PLANES_PER_CTA", 4))


def _used_small(names):
    # The spy also sees the kernel table's names at load: only launches pick *_small ones.
    # (An HND block-plane holding every head is one contiguous span too: contig either way.)
    return any(n.endswith("_small") for n in names)


@pytest.mark.parametrize("chunks", [3, 100])  # a partial tile; many units per plane group
@pytest.mark.parametrize("ids_kind", ["host", "device"])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("page", sorted(PAGES))
def test_store_and_load_are_bit_exact(small, page, layout, ids_kind, chunks):
    CASES.round_trip(page, chunks, layout=layout, ids_kind=ids_kind, seed=page + chunks)
    assert _used_small(small)


@pytest.mark.parametrize("skip_kind", ["host", "device"])
@pytest.mark.parametrize("page", [512, 2048])
def test_load_skips_match_the_reference(small, page, skip_kind):
    CASES.load_skips(page, skip_kind, seed=3)
    assert _used_small(small)


@pytest.mark.parametrize("direction", ["store", "load"])
def test_layer_subsets_move_only_their_planes(small, direction):
    CASES.layer_subsets(1024, direction, ([1], [0, 3]), seed=5)
    assert _used_small(small)


def test_cta_cap_moves_the_same_bytes(small):
    CASES.round_trip(512, 40, store_ctas=3, load_ctas=5, seed=8)
    assert _used_small(small)


@pytest.mark.parametrize("direction", ["store", "load"])
def test_out_of_range_device_ids_move_nothing_and_raise_at_the_check(small, direction):
    CASES.bad_device_ids(1024, direction, seed=11)
    assert _used_small(small)


@pytest.mark.parametrize("point", [
    {"planes": 1, "cta_bytes": 65536, "unroll": 8},
    {"planes": 16, "cta_bytes": 16384, "unroll": 4},
    {"planes": 8, "cta_bytes": 131072, "unroll": 16},
])
def test_swept_tunables_stay_bit_exact(small, monkeypatch, point):
    monkeypatch.setattr(geometry, "SMALL_PLANES_PER_CTA", point["planes"])
    monkeypatch.setattr(geometry, "SMALL_CTA_BYTES", point["cta_bytes"])
    monkeypatch.setattr(nvrtc, "TUNING", {"KVG_SMALL_UNROLL": point["unroll"]})
    cuda_launch.reset_caches()
    CASES.round_trip(512, 150, seed=14)
    assert _used_small(small)
