"""The small-page kernels (``kvg_*_small`` of page_copy.cu) without a GPU: their selection
and sizing, their NVRTC build, and every emulated-launch case of
``test_torch_launch_emulated`` again with the small-page kernels selected (the emulation
follows their work decomposition: a tile of items x a group of planes, one id lookup per
item for the whole unit), so ids, skips, layer subsets, the CTA cap and the error record are
checked bit-exact against the CPU path through the same host code."""

import numpy as np
import pytest
from kvgroups_cuda import geometry, nvrtc
from kvgroups_cuda import params as P
from kvgroups_torch.cuda import launch as cuda_launch

from kvgroups_core.errors import UnsupportedConfig
from tests.support.torch_page_cases import make_case
from tests.torch_backend.test_torch_launch_emulated import (  # noqa: F401 (fixtures and cases run again here)
    _check,
    device_ids,
    emulated,
    test_bound_plan_eager_run_goes_through_device_caches,
    test_emulated_cta_cap_loops_over_the_work_with_the_same_bytes,
    test_emulated_device_ids_drop_bad_items_and_record_the_first_bad_value,
    test_emulated_device_skip_matches_the_host_skip,
    test_emulated_device_skip_out_of_range_is_clamped_and_recorded,
    test_emulated_ids_beyond_the_inline_capacity,
    test_emulated_interleaved_layer_calls_rewrite_what_changed,
    test_emulated_kernel_matches_the_page_model,
    test_emulated_layer_subset_is_one_launch_per_kernel_group_at_its_object_rows,
    test_emulated_out_of_range_ids_move_nothing_and_flag,
    test_emulated_per_chunk_objects_inline_and_on_the_device,
    test_prepared_calls_through_device_caches_match_the_cpu_path,
    test_prepared_fast_path_follows_a_buffer_to_its_new_address,
)


@pytest.fixture(autouse=True)
def small_pages_everywhere(monkeypatch):
    """Every group of these tests runs the small-page kernels, whatever its page size;
    ``emulated`` checks afterwards that they did."""
    monkeypatch.setattr(geometry, "SMALL_PAGE_BYTES", 2**20)
    monkeypatch.setattr(geometry, "SMALL_PLANES_PER_CTA", 4)
    cuda_launch._by_identity.clear()
    cuda_launch._by_value.clear()
    yield
    cuda_launch._by_identity.clear()
    cuda_launch._by_value.clear()


@pytest.fixture(autouse=True)
def only_small_kernels_ran(request):
    checked = "emulated" in request.fixturenames and request.function is not \
        test_default_keeps_the_established_kernels
    launches = request.getfixturevalue("emulated")[0] if checked else None
    yield
    if checked:
        assert launches, "no launch was emulated"
        assert all(name.endswith("_small") for name, *_ in launches), launches


def test_small_kernels_are_named_beside_the_others():
    names = P.all_kernel_names()
    small = [n for n in names if n.endswith("_small")]
    warp = [n for n in names if n.endswith("_warp")]
    assert warp == ["kvg_store_v16_warp", "kvg_load_v16_warp"]  # no small twin
    assert len(small) == (len(names) - len(warp)) // 2
    assert P.all_kernel_names(small=True) == small
    assert P.all_kernel_names(small=False) == [n for n in names if n not in small]
    assert P.kernel_name("load", 8, False, True) == "kvg_load_v8_runs_small"
    assert P.kernel_name("load", 8, False) == "kvg_load_v8_runs"
    src = nvrtc.kernel_source()
    assert f"#define KVG_SMALL_TILE {P.SMALL_TILE}" in src
    assert f"#define KVG_SMALL_PLANES {P.SMALL_PLANES}" in src


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("unroll", [4, 16])
def test_small_kernels_compile_with_the_swept_loads_in_flight(monkeypatch, arch, unroll):
    pytest.importorskip("cuda.core")
    monkeypatch.setattr(nvrtc, "TUNING", {"KVG_SMALL_UNROLL": unroll})
    assert f"-DKVG_SMALL_UNROLL={unroll}" in nvrtc.option_words(arch, small=True)
    cubin = nvrtc.compile_cubin(arch, small=True)
    for name in P.all_kernel_names(small=True):
        assert name.encode() + b"\0" in cubin, name
    for name in P.all_kernel_names(small=False):  # those live in the main cubin only
        assert name.encode() + b"\0" not in cubin, name


def test_small_kernels_have_a_cubin_and_cache_key_of_their_own(cubin_cache, monkeypatch):
    pytest.importorskip("cuda.core")
    assert nvrtc.cache_key("sm_90", small=True) != nvrtc.cache_key("sm_90")
    assert "-DKVG_BUILD_SMALL=1" in nvrtc.option_words("sm_90", small=True)
    assert "-DKVG_BUILD_SMALL=1" not in nvrtc.option_words("sm_90")
    small = nvrtc.get_cubin("sm_90", small=True)
    assert (cubin_cache / f"{nvrtc.cache_key('sm_90', small=True)}.cubin").read_bytes() == small
    assert not (cubin_cache / f"{nvrtc.cache_key('sm_90')}.cubin").exists()


def test_selection_follows_the_threshold(monkeypatch):
    monkeypatch.setattr(geometry, "SMALL_PAGE_BYTES", 1024)
    assert geometry.uses_small_pages(512) and geometry.uses_small_pages(1024)
    assert not geometry.uses_small_pages(2048)
    assert not geometry.uses_small_pages(0)
    monkeypatch.setattr(geometry, "SMALL_PAGE_BYTES", 0)
    assert not geometry.uses_small_pages(512)  # 0: the small-page kernels are off


@pytest.mark.parametrize("page", [16, 512, 1024, 2048, 4096])
@pytest.mark.parametrize("num_items", [1, 3, 64, 1000, 4096, 16384])
@pytest.mark.parametrize("num_planes", [1, 3, 64, 128])
def test_sizing_is_powers_of_two_within_the_kernel_bounds(page, num_items, num_planes):
    ipc, ppc = geometry.small_page_sizing(page, num_items, num_planes, 1, num_sms=132)
    assert ipc & (ipc - 1) == 0 and 1 <= ipc <= P.SMALL_TILE
    assert ppc & (ppc - 1) == 0 and 1 <= ppc <= min(geometry.SMALL_PLANES_PER_CTA, num_planes)
    assert ipc <= 1 << (num_items - 1).bit_length()  # never a tile past the launch's items
    assert ipc * ppc * page <= max(geometry.SMALL_CTA_BYTES, page)
    units = -(-num_items // ipc) * -(-num_planes // ppc)
    if units < 4 * 132:  # too few units only once nothing is left to split
        assert ipc == 1 and ppc == 1


def test_sizing_fills_units_with_planes_and_items_when_there_is_work(monkeypatch):
    monkeypatch.setattr(geometry, "SMALL_PLANES_PER_CTA", 8)
    monkeypatch.setattr(geometry, "SMALL_CTA_BYTES", 65536)
    # 256 chunks of 16 kept blocks, 64 planes of 512-byte pages: full units of 8 planes.
    ipc, ppc = geometry.small_page_sizing(512, 4096, 64, 1, num_sms=132)
    assert (ipc, ppc) == (16, 8)
    # 4 chunks: planes are given up first, then items, until ~4 units per SM.
    ipc, ppc = geometry.small_page_sizing(512, 64, 64, 1, num_sms=132)
    assert ppc == 1 and -(-64 // ipc) * 64 >= 4 * 132


def test_sizing_refuses_units_past_32_bit_vector_counts(monkeypatch):
    monkeypatch.setattr(geometry, "SMALL_PAGE_BYTES", 2**30)
    monkeypatch.setattr(geometry, "SMALL_CTA_BYTES", 2**33)
    with pytest.raises(UnsupportedConfig, match="small pages: expected a work unit below"):
        geometry.small_page_sizing(2**28, 4096, 64, 1, num_sms=1)


def test_emulated_small_kernels_keep_the_vector_width_rules(emulated):  # noqa: F811
    launches, _ = emulated
    rng = np.random.default_rng(1)
    _check(make_case("nhd", "float32", "store", rng, nb=8, bs=2, hs=8, num_chunks=1, bpc=2,
                     kept=2))
    assert launches[-1][0] == "kvg_store_v16_contig_small"
    _check(make_case("hnd", "float16", "load", rng, nb=8, bs=2, hs=8, num_chunks=1, bpc=2,
                     kept=2, region_pad=6))
    assert launches[-1][0] == "kvg_load_v2_runs_small"
    _check(make_case("indexer", "uint8", "store", rng, nb=8, bs=2, num_chunks=1, bpc=2, kept=2))
    assert launches[-1][0] == "kvg_store_v4_runs_small"


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("planes_per_cta", [1, 2, 8])
def test_emulated_partial_tiles_and_plane_groups(emulated, monkeypatch, direction,  # noqa: F811
                                                 planes_per_cta):
    # 3 layers x 2 planes = 6 planes (a partial last plane group for 4 or 8), 7 chunks of 3
    # kept items (a partial last tile), a load skipping 2 items.
    monkeypatch.setattr(geometry, "SMALL_PLANES_PER_CTA", planes_per_cta)
    monkeypatch.setattr(geometry, "SMALL_CTA_BYTES", 4 * 256)
    launches, _ = emulated
    rng = np.random.default_rng(planes_per_cta)
    _check(make_case("nhd", "bfloat16", direction, rng, nl=3, nb=40, bs=2, nh=2, hs=32,
                     num_chunks=7, bpc=4, kept=3, first_item=2 if direction == "load" else 0))
    name, grid, ipc, ppc = launches[-1]
    assert ppc <= planes_per_cta and ipc <= 4


def test_default_keeps_the_established_kernels(monkeypatch, emulated):  # noqa: F811
    monkeypatch.setattr(geometry, "SMALL_PAGE_BYTES", 0)
    cuda_launch._by_identity.clear()
    cuda_launch._by_value.clear()
    launches, _ = emulated
    rng = np.random.default_rng(3)
    _check(make_case("nhd", "float16", "store", rng, nb=8, bs=2, hs=8, num_chunks=1, bpc=2,
                     kept=2))
    warp = geometry.WARP_MIN_PAGE_BYTES > 0  # the emulated fixture's warp mode
    assert [name for name, *_ in launches] == [
        "kvg_store_v16_warp" if warp else "kvg_store_v16_contig"]
