import numpy as np
import pytest

import kvgroups_core as kc
from kvgroups_conformance.caches import make_caches
from kvgroups_core.engine_groups import EngineGroupInfo
from kvgroups_core.formats import EngineKVFormat as F
from kvgroups_core.manager import KVLayerGroupsManager
from kvgroups_core.objects import object_nbytes

CHUNK, BS, NB = 16, 4, 12


@pytest.fixture
def setup(harness):
    rng = np.random.default_rng(9)
    caches_np, formats = make_caches(F.NL_X_TWO_NB_BS_NH_HS, nl=2, nb=NB, bs=BS, nh=2, hs=8,
                                     dtype="float16", rng=rng)
    manager = KVLayerGroupsManager(caches_np, formats, lmcache_tokens_per_chunk=CHUNK)
    objects_np = [rng.integers(0, 256, (2, object_nbytes(manager, 0)), dtype=np.uint8)]
    return manager, caches_np, objects_np


def _unchanged(harness, caches, caches_np, objects, objects_np):
    for got, want in zip(harness.read(caches, caches_np), caches_np):
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(harness.to_numpy(objects[0], objects_np[0]), objects_np[0])


BAD_IDS = [
    ([0, 1, 2, 3, 4, 5, 6, NB], kc.KVGroupsIndexError, "expected ids in"),
    ([0, 1, 2, -1, 4, 5, 6, 7], kc.KVGroupsIndexError, "expected ids in"),
    ([0, 1, 2, 3, 4], kc.KVGroupsValueError, "multiple of 4"),
    ([0, 1, 2, 3], kc.KVGroupsValueError, "uint8 [1,"),  # one chunk for two-chunk objects
    ([[0, 1], [2, 3]], kc.KVGroupsValueError, "missing"),
]


@pytest.mark.parametrize("ids,error,text", BAD_IDS)
def test_bad_block_ids_raise_before_any_byte_moves(harness, setup, ids, error, text):
    manager, caches_np, objects_np = setup
    caches, objects = harness.convert(caches_np), harness.convert(objects_np)
    ids = ids if isinstance(ids[0], list) else np.array(ids)
    if isinstance(ids, list):
        ids = {1: ids[0]}
    for call in (lambda: harness.store(manager, caches, ids, objects),
                 lambda: harness.load(manager, objects, caches, ids)):
        with pytest.raises(error, match=r"(?i)" + __import__("re").escape(text)):
            call()
        _unchanged(harness, caches, caches_np, objects, objects_np)


def test_bad_object_shapes_and_dtypes_are_rejected(harness, setup):
    manager, caches_np, objects_np = setup
    caches = harness.convert(caches_np)
    ids = np.arange(8)
    nbytes = object_nbytes(manager, 0)
    for bad in ([np.zeros((2, nbytes + 1), np.uint8)], [np.zeros((2, nbytes // 2), np.uint16)],
                [np.zeros((3, nbytes), np.uint8)], []):
        bad_objects = harness.convert(bad)
        with pytest.raises(kc.KVGroupsValueError, match="objects"):
            harness.load(manager, bad_objects, caches, ids)
        with pytest.raises(kc.KVGroupsValueError, match="objects"):
            harness.store(manager, caches, ids, bad_objects)
    for got, want in zip(harness.read(caches, caches_np), caches_np):
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_skip_outside_the_covered_tokens_is_rejected(harness, setup):
    manager, caches_np, objects_np = setup
    caches, objects = harness.convert(caches_np), harness.convert(objects_np)
    for skip in (-1, 2 * CHUNK + 1):
        with pytest.raises(kc.KVGroupsValueError, match="skip_first_n_tokens"):
            harness.load(manager, objects, caches, np.arange(8), skip=skip)
    _unchanged(harness, caches, caches_np, objects, objects_np)


def test_caches_that_do_not_match_the_manager_are_rejected(harness, setup):
    manager, caches_np, objects_np = setup
    other_np, _ = make_caches(F.NL_X_TWO_NB_BS_NH_HS, nl=2, nb=NB, bs=BS, nh=4, hs=8,
                              dtype="float16", rng=np.random.default_rng(1))
    other, objects = harness.convert(other_np), harness.convert(objects_np)
    with pytest.raises(kc.KVGroupsValueError, match="as the manager was built with"):
        harness.load(manager, objects, other, np.arange(8))
    _unchanged(harness, other, other_np, objects, objects_np)


def test_flat_ids_need_a_single_engine_group(harness):
    rng = np.random.default_rng(2)
    caches_np, formats = make_caches(F.NL_X_TWO_NB_BS_NH_HS, nl=2, nb=NB, bs=BS, nh=2, hs=8,
                                     dtype="float16", rng=rng)
    infos = (EngineGroupInfo(engine_group_id=0, layer_indices=(0,)),
             EngineGroupInfo(engine_group_id=1, layer_indices=(1,)))
    manager = KVLayerGroupsManager(caches_np, formats, infos, lmcache_tokens_per_chunk=CHUNK)
    with pytest.raises(kc.KVGroupsValueError, match="one id list per engine group"):
        harness.store(manager, harness.convert(caches_np), np.arange(4))
