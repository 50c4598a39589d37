"""Recurrent-state layers (docs/SEMANTICS.md section 9) on every backend: a GDN-like hybrid
(conv + temporal state per recurrent layer, mixed dtypes, padded engine pages, attention
beside), both conv orientations; bytes checked against the kit's NumPy-indexing oracle."""

import numpy as np
import pytest

from kvgroups_conformance.caches import expected_object
from kvgroups_conformance.state_caches import (
    ATTN_GROUP,
    STATE_GROUP,
    HybridShape,
    expected_state_object,
    hybrid_caches,
    hybrid_infos,
    slot_bytes,
)
from kvgroups_core.formats.catalogue import EngineKVFormat as F
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_core.transfer.objects import object_nbytes

CHUNK = 8  # two 4-token blocks per chunk: each chunk keeps its second state id
SHAPES = {
    "SD": HybridShape(page_bytes=2048),
    "DS": HybridShape(conv=(24, 3), conv_format=F.NL_X_NB_CD_CW, page_bytes=2048),
    "fp16-tight": HybridShape(
        conv=(3, 16),
        temporal=(4, 2, 6),
        conv_dtype="float16",
        temporal_dtype="float16",
        attn_dtype="float16",
    ),
}
STATE_IDS = [0, 5, 0, 9, 0, 2]  # chunk c's snapshot is in its last id: 5, 9, 2
ATTN_IDS = [3, 7, 1, 11, 4, 6]


def _case(harness, shape, *, load_ids, skip=0, layers=None):
    rng = np.random.default_rng(7)
    src_np, formats, _ = hybrid_caches(shape, rng)
    dst_np, _, _ = hybrid_caches(shape, rng)
    manager = KVLayerGroupsManager(
        src_np, formats, hybrid_infos(formats, shape.bs), lmcache_tokens_per_chunk=CHUNK
    )
    ids = {STATE_GROUP: STATE_IDS, ATTN_GROUP: ATTN_IDS}
    objects = harness.store(manager, harness.convert(src_np), ids)
    got_objects = [harness.to_numpy(o, np.zeros(0, np.uint8)) for o in objects]
    dst = harness.load(
        manager, objects, harness.convert(dst_np), load_ids, skip=skip, layers=layers
    )
    return manager, formats, src_np, dst_np, got_objects, harness.read(dst, dst_np)


def _check_objects(manager, src_np, objects, what):
    nbytes = [object_nbytes(manager, og) for og in range(manager.num_object_groups)]
    assert [o.shape for o in objects] == [(3, n) for n in nbytes], what
    for c, last in enumerate(STATE_IDS[1::2]):
        want = expected_state_object(manager, src_np, last)
        assert objects[0][c].tobytes() == want.tobytes(), f"{what}: state object, chunk {c}"
        attn = expected_object(
            manager, src_np, 1, {ATTN_GROUP: np.asarray(ATTN_IDS[2 * c : 2 * c + 2])}
        )
        assert objects[1][c].tobytes() == attn.tobytes(), f"{what}: attention object, chunk {c}"


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_state_snapshots_store_per_chunk_and_load_into_the_request_slot(harness, name):
    shape = SHAPES[name]
    load_ids = {STATE_GROUP: [0, 0, 0, 0, 0, 10], ATTN_GROUP: [8, 2, 5, 0, 9, 10]}
    manager, formats, src, dst, objects, after = _case(harness, shape, load_ids=load_ids)
    _check_objects(manager, src, objects, f"{harness.id} {name} store")
    for layer, fmt in enumerate(formats):
        nb = shape.nb
        if fmt.is_recurrent_state:
            moved = {10: 2}  # the last chunk's snapshot, into the last id's slot
        else:
            moved = dict(zip(load_ids[ATTN_GROUP], ATTN_IDS))
        for slot in range(nb):
            want = src[layer][moved[slot]] if slot in moved else dst[layer][slot]
            assert (
                np.ascontiguousarray(after[layer][slot]).tobytes()
                == np.ascontiguousarray(want).tobytes()
            ), f"{harness.id} {name}: layer {layer} ({fmt.name}) slot {slot}"


@pytest.mark.parametrize("skip,state_written", [(17, True), (24, False)])
def test_state_loads_skip_like_attention(harness, skip, state_written):
    shape = SHAPES["SD"]
    load_ids = {STATE_GROUP: [0, 1, 0, 3, 0, 10], ATTN_GROUP: [8, 2, 5, 0, 9, 10]}
    _, formats, src, dst, _, after = _case(harness, shape, load_ids=load_ids, skip=skip)
    for layer, fmt in enumerate(formats):
        if not fmt.is_recurrent_state:
            continue
        for slot in range(shape.nb):
            want = src[layer][2] if (slot == 10 and state_written) else dst[layer][slot]
            assert (
                slot_bytes(after[layer], slot).tobytes()
                == np.ascontiguousarray(want).reshape(-1).view(np.uint8).tobytes()
            ), f"{harness.id}: skip {skip}, layer {layer} slot {slot}"


def test_state_layer_subsets_move_only_their_layers(harness):
    shape = SHAPES["DS"]
    load_ids = {STATE_GROUP: [0, 0, 0, 0, 0, 10], ATTN_GROUP: [8, 2, 5, 0, 9, 10]}
    _, formats, src, dst, _, after = _case(harness, shape, load_ids=load_ids, layers=[1, 5])
    for layer in range(len(formats)):
        for slot in range(shape.nb):
            if layer == 1 and slot == 10:
                want = src[1][2]
            elif layer == 5 and slot in load_ids[ATTN_GROUP]:
                want = src[5][ATTN_IDS[load_ids[ATTN_GROUP].index(slot)]]
            else:
                want = dst[layer][slot]
            assert (
                np.ascontiguousarray(after[layer][slot]).tobytes()
                == np.ascontiguousarray(want).tobytes()
            ), f"{harness.id}: layer {layer} slot {slot}"
