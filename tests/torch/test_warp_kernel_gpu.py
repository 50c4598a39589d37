"""The warp kernels (``kvg_*_v16_warp``: one warp per segment of a contiguous page) on a GPU
through the public prepared calls, bit-exact against the NumPy reference: pages smaller than a
segment, one segment, one and a half, several; store and load with host and CUDA ids, device
and host skips, layer subsets, the CTA cap (warps looping over units), out-of-range device ids
(their items untouched, raised at the check) and the other unroll / occupancy points measured.
Skipped cleanly without CUDA."""

import kvgroups_torch
import numpy as np
import pytest
import torch
from cuda_marks import needs_cuda
from engine_cases import (
    cache_bytes,
    object_bytes,
    random_objects,
    reference_load,
    reference_store,
    reference_with_drops,
)
from kvgroups_torch import cuda_path, geometry, nvrtc
from kvgroups_torch import params as P

import kvgroups_core as kc
from kvgroups_core.errors import KVGroupsIndexError
from kvgroups_core.formats import EngineKVFormat as F
from kvgroups_core.manager import KVLayerGroupsManager

pytestmark = needs_cuda

# (bs, nh, hs) of float16 NHD pages (bytes per block and plane); segments are 8 KiB.
PAGES = {1024: (16, 2, 16), 8192: (16, 2, 128), 12288: (16, 3, 128), 32768: (16, 8, 128)}
CHUNK = 64  # tokens: 4 blocks per chunk
NUM_BLOCKS = 320
LAYERS = 3


@pytest.fixture
def warp(monkeypatch):
    """Every contiguous 16-byte page runs the warp kernels; records the kernels picked."""
    names = []
    real = P.kernel_name

    def spy(*args, **kw):
        name = real(*args, **kw)
        names.append(name)
        return name

    monkeypatch.setattr(geometry, "WARP_MIN_PAGE_BYTES", 16)
    monkeypatch.setattr(P, "kernel_name", spy)
    cuda_path.reset_caches()
    yield names
    monkeypatch.undo()
    cuda_path.reset_caches()


def _caches(page, seed=0):
    bs, nh, hs = PAGES[page]
    shape = (2, NUM_BLOCKS, bs, nh, hs)
    rng = np.random.default_rng(seed)
    caches = []
    for _ in range(LAYERS):
        raw = rng.integers(0, 256, int(np.prod(shape)) * 2, dtype=np.uint8)
        caches.append(torch.from_numpy(raw).view(torch.float16).view(shape).cuda())
    manager = KVLayerGroupsManager(caches, [F.NL_X_TWO_NB_BS_NH_HS] * LAYERS,
                                   lmcache_tokens_per_chunk=CHUNK)
    return manager, caches


def _ids(rng, chunks):
    return rng.permutation(NUM_BLOCKS)[: chunks * (CHUNK // 16)]


def _check(caches, objects, want_caches, want_objects):
    torch.cuda.synchronize()
    kvgroups_torch.check_errors()
    if want_objects is not None:
        for got, want in zip(object_bytes(objects), want_objects):
            np.testing.assert_array_equal(got, want)
    if want_caches is not None:
        for got, want in zip(cache_bytes(caches), want_caches):
            np.testing.assert_array_equal(got, want)


def _used_warp(names):
    return any(n.endswith("_warp") for n in names)


@pytest.mark.parametrize("chunks", [1, 70])
@pytest.mark.parametrize("ids_kind", ["host", "device"])
@pytest.mark.parametrize("page", sorted(PAGES))
def test_store_and_load_are_bit_exact(warp, page, ids_kind, chunks):
    manager, caches = _caches(page, seed=page)
    prep = kc.prepare(manager, caches)
    rng = np.random.default_rng(chunks)
    host = _ids(rng, chunks)
    ids = torch.from_numpy(host.astype(np.int32)).cuda() if ids_kind == "device" else host
    objects = random_objects(manager, chunks, seed=1, device="cuda")
    want_objects = reference_store(manager, caches, host, objects=objects)
    prep.store(ids, objects)
    _check(caches, objects, None, want_objects)
    loaded = random_objects(manager, chunks, seed=2, device="cuda")
    want_caches = reference_load(manager, loaded, caches, host)
    prep.load(loaded, ids)
    _check(caches, loaded, want_caches, None)
    assert _used_warp(warp)


@pytest.mark.parametrize("skip_kind", ["host", "device"])
@pytest.mark.parametrize("page", [1024, 12288])
def test_load_skips_match_the_reference(warp, page, skip_kind):
    manager, caches = _caches(page, seed=3)
    prep = kc.prepare(manager, caches)
    host = _ids(np.random.default_rng(4), 6)
    dev = torch.from_numpy(host).cuda()
    skip = torch.zeros((), dtype=torch.int64, device="cuda")
    for tokens in (0, 16, 80, 200, 384):
        loaded = random_objects(manager, 6, seed=tokens, device="cuda")
        want = reference_load(manager, loaded, caches, host, skip=tokens)
        if skip_kind == "device":
            skip.fill_(tokens)
            prep.load(loaded, dev, skip_first_n_tokens=skip)
        else:
            prep.load(loaded, dev, skip_first_n_tokens=tokens)
        _check(caches, loaded, want, None)
    assert _used_warp(warp)


@pytest.mark.parametrize("direction", ["store", "load"])
def test_layer_subsets_move_only_their_planes(warp, direction):
    manager, caches = _caches(12288, seed=5)
    prep = kc.prepare(manager, caches)
    host = _ids(np.random.default_rng(6), 5)
    dev = torch.from_numpy(host).cuda()
    for layers in ([1], [0, 2]):
        objects = random_objects(manager, 5, seed=7, device="cuda")
        if direction == "store":
            want = reference_store(manager, caches, host, layers=layers, objects=objects)
            prep.store(dev, objects, layers=layers)
            _check(caches, objects, None, want)
        else:
            want = reference_load(manager, objects, caches, host, layers=layers)
            prep.load(objects, dev, layers=layers)
            _check(caches, objects, want, None)
    assert _used_warp(warp)


@pytest.mark.parametrize("page", [1024, 32768])
def test_cta_cap_loops_warps_over_the_same_bytes(warp, page):
    manager, caches = _caches(page, seed=8)
    prep = kc.prepare(manager, caches)
    host = _ids(np.random.default_rng(9), 40)
    objects = random_objects(manager, 40, seed=10, device="cuda")
    want = reference_store(manager, caches, host, objects=objects)
    prep.store(torch.from_numpy(host).cuda(), objects, max_ctas=3)
    _check(caches, objects, None, want)
    loaded = random_objects(manager, 40, seed=11, device="cuda")
    want_caches = reference_load(manager, loaded, caches, host)
    prep.load(loaded, torch.from_numpy(host).cuda(), max_ctas=5)
    _check(caches, loaded, want_caches, None)
    assert _used_warp(warp)


@pytest.mark.parametrize("direction", ["store", "load"])
def test_out_of_range_device_ids_move_nothing_and_raise_at_the_check(warp, direction):
    manager, caches = _caches(32768, seed=11)
    prep = kc.prepare(manager, caches)
    bad = _ids(np.random.default_rng(12), 8).astype(np.int64)
    bad[[0, 9, 31]] = [NUM_BLOCKS, -2, 2**40]
    objects = random_objects(manager, 8, seed=13, device="cuda")
    want_caches, want_objects, met = reference_with_drops(manager, caches, objects, bad,
                                                          direction)
    assert met == {NUM_BLOCKS, -2, 2**40}
    ids = torch.from_numpy(bad).cuda()
    if direction == "store":
        prep.store(ids, objects)
    else:
        prep.load(objects, ids)
    torch.cuda.synchronize()
    # Segments run in parallel: any of the three may be the first recorded; each counts once.
    with pytest.raises(KVGroupsIndexError,
                       match=rf"got ({NUM_BLOCKS}|-2|{2**40}) on .*; 3 bad id"):
        kvgroups_torch.check_errors()
    for got, want in zip(object_bytes(objects), want_objects):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(cache_bytes(caches), want_caches):
        np.testing.assert_array_equal(got, want)
    assert _used_warp(warp)


@pytest.mark.parametrize("point", [{"KVG_WARP_UNROLL": 4, "KVG_WARP_MIN_BLOCKS": 6},
                                   {"KVG_WARP_UNROLL": 8, "KVG_WARP_MIN_BLOCKS": 4}])
def test_measured_tunables_stay_bit_exact(warp, monkeypatch, point):
    monkeypatch.setattr(nvrtc, "TUNING", dict(point))
    cuda_path.reset_caches()
    manager, caches = _caches(12288, seed=14)
    prep = kc.prepare(manager, caches)
    host = _ids(np.random.default_rng(15), 30)
    dev = torch.from_numpy(host).cuda()
    objects = random_objects(manager, 30, seed=16, device="cuda")
    want = reference_store(manager, caches, host, objects=objects)
    prep.store(dev, objects)
    _check(caches, objects, None, want)
    loaded = random_objects(manager, 30, seed=17, device="cuda")
    want_caches = reference_load(manager, loaded, caches, host)
    prep.load(loaded, dev)
    _check(caches, loaded, want_caches, None)
    assert _used_warp(warp)
