"""Layer subsets (``layers=``): only the chosen layers' planes move; the objects keep their
full size and every other byte of them, and of the caches, stays as it was."""

import zlib

import numpy as np
import pytest

from kvgroups_conformance.caches import TRANSFER_FORMATS, all_blocks, expected_object, make_caches
from kvgroups_conformance.cases import every_nth
from kvgroups_conformance.compare import assert_blocks_match, assert_objects_match, moved_blocks
from kvgroups_conformance.suite.test_roundtrip import declared_unsupported
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_core.transfer.objects import object_nbytes, object_regions

GEOMETRY = dict(nl=3, nb=16, bs=4, nh=2, hs=16)
CHUNK, CHUNKS = 8, 2
SUBSETS = [[1], [0, 2]]


def small_case(name: str, params: dict) -> bool:
    """The small case set: every third format, the two subsets taking turns."""
    k = TRANSFER_FORMATS.index(params["fmt"])
    return (
        every_nth(params["fmt"], TRANSFER_FORMATS, 3)
        and SUBSETS.index(params["layers"]) == (k // 3) % 2
    )


def _selected_bytes(manager, og, layers) -> np.ndarray:
    """Mask of the object bytes that belong to ``layers``' planes."""
    mask = np.zeros(object_nbytes(manager, og), bool)
    for region in object_regions(manager, og):
        group = manager.kernel_groups[region.kernel_group_idx]
        kv_size, nl, slots, _ = region.shape
        plane_bytes = slots * region.row_bytes
        for kv in range(kv_size):
            for li, layer in enumerate(group.layer_indices):
                if layer in layers:
                    start = region.offset + (kv * nl + li) * plane_bytes
                    mask[start : start + plane_bytes] = True
    return mask


@pytest.mark.parametrize("layers", SUBSETS, ids=lambda s: "layers" + "-".join(map(str, s)))
@pytest.mark.parametrize("fmt", TRANSFER_FORMATS, ids=lambda f: f.name)
def test_a_layer_subset_moves_only_those_layers(harness, fmt, layers):
    if declared_unsupported(harness, fmt, "bfloat16"):
        return
    rng = np.random.default_rng(zlib.crc32(f"{fmt.name}/{layers}".encode()))
    src_np, formats = make_caches(fmt, dtype="bfloat16", rng=rng, **GEOMETRY)
    dst_np, _ = make_caches(fmt, dtype="bfloat16", rng=rng, zero=True, **GEOMETRY)
    manager = KVLayerGroupsManager(src_np, formats, lmcache_tokens_per_chunk=CHUNK)
    bpc = CHUNK // GEOMETRY["bs"]
    ids_a = rng.permutation(GEOMETRY["nb"])[: CHUNKS * bpc]
    ids_b = rng.permutation(GEOMETRY["nb"])[: CHUNKS * bpc]
    sentinel = [
        rng.integers(0, 256, (CHUNKS, object_nbytes(manager, og)), dtype=np.uint8)
        for og in range(manager.num_object_groups)
    ]

    objects = harness.store(
        manager, harness.convert(src_np), ids_a, harness.convert(sentinel), layers=layers
    )
    for og in range(manager.num_object_groups):
        full = np.stack(
            [
                expected_object(manager, src_np, og, {0: ids_a[c * bpc : (c + 1) * bpc]})
                for c in range(CHUNKS)
            ]
        )
        want = np.where(_selected_bytes(manager, og, layers)[None, :], full, sentinel[og])
        assert_objects_match(
            harness.to_numpy(objects[og], sentinel[og]),
            want,
            manager,
            og,
            what=f"store with layers={layers}: object bytes",
            ids={0: ids_a},
            source_caches=src_np,
            formats=formats,
        )

    # A load of the subset from whole objects writes only those layers' blocks.
    whole = harness.store(manager, harness.convert(src_np), ids_a)
    dst = harness.load(manager, whole, harness.convert(dst_np), ids_b, layers=layers)
    before = all_blocks(src_np, formats)
    untouched = all_blocks(dst_np, formats)
    moved = dict(zip(ids_b.tolist(), ids_a.tolist()))
    want = moved_blocks(before, untouched, moved)
    want = {key: (rows if key[0] in layers else untouched[key]) for key, rows in want.items()}
    assert_blocks_match(
        harness.read(dst, dst_np) if isinstance(dst_np, list) else harness.to_numpy(dst, dst_np),
        formats,
        want,
        what=f"load with layers={layers}",
        source=before,
        expected_source=moved,
    )
