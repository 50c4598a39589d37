"""Objects as separate per-chunk buffers; an object region read back as its dtype."""

import numpy as np

from kvgroups_conformance.caches import all_blocks, expected_object, make_caches
from kvgroups_conformance.compare import assert_blocks_match, assert_objects_match, moved_blocks
from kvgroups_core.formats.catalogue import EngineKVFormat as F
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_core.transfer.objects import object_nbytes, region_view

CHUNK, BS, NB = 16, 4, 20


def test_objects_may_be_separate_per_chunk_buffers(harness):
    rng = np.random.default_rng(4)
    src_np, formats = make_caches(
        F.NL_X_NB_TWO_NH_BS_HS, nl=2, nb=NB, bs=BS, nh=2, hs=8, dtype="bfloat16", rng=rng
    )
    dst_np, _ = make_caches(
        F.NL_X_NB_TWO_NH_BS_HS, nl=2, nb=NB, bs=BS, nh=2, hs=8, dtype="bfloat16", rng=rng, zero=True
    )
    manager = KVLayerGroupsManager(src_np, formats, lmcache_tokens_per_chunk=CHUNK)
    nbytes = object_nbytes(manager, 0)
    # Three chunks, each its own buffer, deliberately not adjacent in memory.
    chunks = [harness.from_numpy(np.zeros(nbytes, np.uint8)) for _ in range(3)]
    ids_a, ids_b = rng.permutation(NB)[:12], rng.permutation(NB)[:12]
    out = harness.store(manager, harness.convert(src_np), ids_a, [chunks])
    per_chunk = out[0]
    got = [harness.to_numpy(per_chunk[c], np.zeros(0, np.uint8)) for c in range(3)]
    want = [expected_object(manager, src_np, 0, {0: ids_a[c * 4 : (c + 1) * 4]}) for c in range(3)]
    assert_objects_match(
        got,
        want,
        manager,
        0,
        what="store into per-chunk buffers: object bytes",
        ids={0: ids_a},
        source_caches=src_np,
        formats=formats,
    )
    dst = harness.load(manager, [per_chunk], harness.convert(dst_np), ids_b)
    before = all_blocks(src_np, formats)
    moved = dict(zip(ids_b.tolist(), ids_a.tolist()))
    assert_blocks_match(
        harness.read(dst, dst_np),
        formats,
        moved_blocks(before, all_blocks(dst_np, formats), moved),
        what="load from per-chunk buffers",
        source=before,
        expected_source=moved,
    )


def test_region_view_reads_the_object_as_its_dtype(harness):
    rng = np.random.default_rng(6)
    src_np, formats = make_caches(
        F.NL_X_TWO_NB_BS_NH_HS, nl=3, nb=NB, bs=BS, nh=2, hs=8, dtype="float32", rng=rng
    )
    manager = KVLayerGroupsManager(src_np, formats, lmcache_tokens_per_chunk=CHUNK)
    ids = rng.permutation(NB)[:4]
    objects = harness.store(manager, harness.convert(src_np), ids)
    obj = harness.to_numpy(objects[0], np.zeros(0, np.uint8))
    view = region_view(manager, obj[0], 0)
    assert view.shape == (2, 3, CHUNK, 16) and view.dtype == np.float32
    for kv in range(2):
        for layer in range(3):
            for j, b in enumerate(ids):
                rows = src_np[layer][kv, b].reshape(BS, 16)
                np.testing.assert_array_equal(
                    view[kv, layer, j * BS : (j + 1) * BS].view(np.uint32),
                    rows.view(np.uint32),
                    err_msg=f"region view of object chunk 0: format {formats[0].name}, dtype "
                    f"float32, layer {layer}, plane {kv}, block {b} (position {j})",
                )
