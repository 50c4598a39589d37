"""The small-page kernels (``kvg_*_small``) on a GPU through the public prepared calls,
bit-exact against the NumPy reference: 512 B, 1 KiB and 2 KiB pages, NHD and HND, store and
load with host and CUDA ids, device and host skips, layer subsets, the CTA cap, out-of-range
device ids (their items untouched, raised at the check), and the swept tunables (planes per
unit, unit bytes, loads in flight). Skipped cleanly without CUDA."""

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

# (bs, nh, hs) of float16 pages: 512 B, 1 KiB, 2 KiB per block and plane.
PAGES = {512: (16, 1, 16), 1024: (16, 2, 16), 2048: (16, 1, 64)}
CHUNK = 64  # tokens: 4 blocks per chunk
NUM_BLOCKS = 640
LAYERS = 4


@pytest.fixture
def small(monkeypatch):
    """Select the small-page kernels with partial plane groups (8 planes, 3 per unit is not
    a power of two: 2) and record every kernel the launches pick."""
    names = []
    real = P.kernel_name

    def spy(*args, **kw):
        name = real(*args, **kw)
        names.append(name)
        return name

    monkeypatch.setattr(geometry, "SMALL_PAGE_BYTES", 4096)
    monkeypatch.setattr(geometry, "SMALL_PLANES_PER_CTA", 4)
    monkeypatch.setattr(P, "kernel_name", spy)
    cuda_path.reset_caches()
    yield names
    monkeypatch.undo()
    cuda_path.reset_caches()


def _caches(page, layout="nhd", seed=0):
    bs, nh, hs = PAGES[page]
    shape = (2, NUM_BLOCKS, bs, nh, hs) if layout == "nhd" else (2, NUM_BLOCKS, nh, bs, hs)
    fmt = F.NL_X_TWO_NB_BS_NH_HS if layout == "nhd" else F.NL_X_TWO_NB_NH_BS_HS
    rng = np.random.default_rng(seed)
    caches = []
    for _ in range(LAYERS):
        raw = rng.integers(0, 256, int(np.prod(shape)) * 2, dtype=np.uint8)
        caches.append(torch.from_numpy(raw).view(torch.float16).view(shape).cuda())
    manager = KVLayerGroupsManager(caches, [fmt] * LAYERS, lmcache_tokens_per_chunk=CHUNK)
    return manager, caches


def _ids(rng, chunks):
    return rng.permutation(NUM_BLOCKS)[: chunks * (CHUNK // 16)]


def _check(manager, caches, objects, want_caches, want_objects):
    torch.cuda.synchronize()
    kvgroups_torch.check_errors()
    if want_objects is not None:
        for got, want in zip(object_bytes(objects), want_objects):
            np.testing.assert_array_equal(got, want)
    if want_caches is not None:
        for got, want in zip(cache_bytes(caches), want_caches):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("chunks", [3, 100])  # a partial tile; many units per plane group
@pytest.mark.parametrize("ids_kind", ["host", "device"])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("page", sorted(PAGES))
def test_store_and_load_are_bit_exact(small, page, layout, ids_kind, chunks):
    manager, caches = _caches(page, layout, seed=page)
    prep = kc.prepare(manager, caches)
    rng = np.random.default_rng(chunks)
    host = _ids(rng, chunks)
    ids = torch.from_numpy(host.astype(np.int32)).cuda() if ids_kind == "device" else host
    objects = random_objects(manager, chunks, seed=1, device="cuda")
    want_objects = reference_store(manager, caches, host, objects=objects)
    prep.store(ids, objects)
    _check(manager, caches, objects, None, want_objects)
    loaded = random_objects(manager, chunks, seed=2, device="cuda")
    want_caches = reference_load(manager, loaded, caches, host)
    prep.load(loaded, ids)
    _check(manager, caches, objects, want_caches, None)
    # The spy also sees the kernel table's names at load: only launches pick *_small ones.
    # (An HND block-plane holding every head is one contiguous span too: contig either way.)
    assert any(n.endswith("_small") for n in small)


@pytest.mark.parametrize("skip_kind", ["host", "device"])
@pytest.mark.parametrize("page", [512, 2048])
def test_load_skips_match_the_reference(small, page, skip_kind):
    manager, caches = _caches(page, seed=3)
    prep = kc.prepare(manager, caches)
    rng = np.random.default_rng(4)
    host = _ids(rng, 6)
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
        _check(manager, caches, loaded, want, None)
    assert small


@pytest.mark.parametrize("direction", ["store", "load"])
def test_layer_subsets_move_only_their_planes(small, direction):
    manager, caches = _caches(1024, seed=5)
    prep = kc.prepare(manager, caches)
    host = _ids(np.random.default_rng(6), 5)
    dev = torch.from_numpy(host).cuda()
    for layers in ([1], [0, 3]):
        objects = random_objects(manager, 5, seed=7, device="cuda")
        if direction == "store":
            want = reference_store(manager, caches, host, layers=layers, objects=objects)
            prep.store(dev, objects, layers=layers)
            _check(manager, caches, objects, None, want)
        else:
            want = reference_load(manager, objects, caches, host, layers=layers)
            prep.load(objects, dev, layers=layers)
            _check(manager, caches, objects, want, None)
    assert small


def test_cta_cap_moves_the_same_bytes(small):
    manager, caches = _caches(512, seed=8)
    prep = kc.prepare(manager, caches)
    host = _ids(np.random.default_rng(9), 40)
    objects = random_objects(manager, 40, seed=10, device="cuda")
    want = reference_store(manager, caches, host, objects=objects)
    prep.store(torch.from_numpy(host).cuda(), objects, max_ctas=3)
    _check(manager, caches, objects, None, want)
    assert small


@pytest.mark.parametrize("direction", ["store", "load"])
def test_out_of_range_device_ids_move_nothing_and_raise_at_the_check(small, direction):
    manager, caches = _caches(1024, seed=11)
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
    # Units run in parallel: any of the three may be the first recorded; each counts once.
    with pytest.raises(KVGroupsIndexError,
                       match=rf"got ({NUM_BLOCKS}|-2|{2**40}) on .*; 3 bad id"):
        kvgroups_torch.check_errors()
    for got, want in zip(object_bytes(objects), want_objects):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(cache_bytes(caches), want_caches):
        np.testing.assert_array_equal(got, want)
    assert small


@pytest.mark.parametrize("point", [
    {"planes": 1, "cta_bytes": 65536, "unroll": 8},
    {"planes": 16, "cta_bytes": 16384, "unroll": 4},
    {"planes": 8, "cta_bytes": 131072, "unroll": 16},
])
def test_swept_tunables_stay_bit_exact(small, monkeypatch, point):
    monkeypatch.setattr(geometry, "SMALL_PLANES_PER_CTA", point["planes"])
    monkeypatch.setattr(geometry, "SMALL_CTA_BYTES", point["cta_bytes"])
    monkeypatch.setattr(nvrtc, "TUNING", {"KVG_SMALL_UNROLL": point["unroll"]})
    cuda_path.reset_caches()
    manager, caches = _caches(512, seed=14)
    prep = kc.prepare(manager, caches)
    host = _ids(np.random.default_rng(15), 150)
    dev = torch.from_numpy(host).cuda()
    objects = random_objects(manager, 150, seed=16, device="cuda")
    want = reference_store(manager, caches, host, objects=objects)
    prep.store(dev, objects)
    _check(manager, caches, objects, None, want)
    loaded = random_objects(manager, 150, seed=17, device="cuda")
    want_caches = reference_load(manager, loaded, caches, host)
    prep.load(loaded, dev)
    _check(manager, caches, loaded, want_caches, None)
    assert small
