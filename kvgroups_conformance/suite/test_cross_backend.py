"""Pairs of backends: the same objects whoever stores them, loadable by the other; the same
grouping from any backend's arrays."""

import zlib

import numpy as np
import pytest

from kvgroups_conformance.caches import (
    TRANSFER_FORMATS,
    all_blocks,
    expected_object,
    make_caches,
)
from kvgroups_conformance.cases import every_nth
from kvgroups_conformance.compare import assert_blocks_match, assert_objects_match, moved_blocks
from kvgroups_conformance.suite.test_roundtrip import declared_unsupported
from kvgroups_core import describe
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_core.transfer.objects import object_nbytes

GEOMETRY = dict(nl=2, nb=16, bs=4, nh=2, hs=16)
CHUNK = 8
UINT8 = np.zeros(0, np.uint8)


def small_case(name: str, params: dict) -> bool:
    """The small case set: objects handed over for every fourth format (both ways)."""
    if name == "test_store_with_one_backend_load_with_the_other":
        return every_nth(params["fmt"], TRANSFER_FORMATS, 4)
    return True


def _summary(manager):
    return (
        [
            (
                g.layer_indices,
                g.shape_desc,
                g.dtype,
                g.engine_kv_format,
                g.tokens_per_block,
                g.engine_group_idx,
                g.sw_size_tokens,
            )
            for g in manager.kernel_groups
        ],
        [(o.kernel_group_indices, o.sw_size_chunks) for o in manager.object_groups],
        [object_nbytes(manager, o) for o in range(manager.num_object_groups)],
    )


@pytest.mark.parametrize("fmt", TRANSFER_FORMATS, ids=lambda f: f.name)
def test_store_with_one_backend_load_with_the_other(harness_pair, fmt):
    a, b = harness_pair
    if any([declared_unsupported(h, fmt, "bfloat16") for h in (a, b)]):
        return
    rng = np.random.default_rng(zlib.crc32(fmt.name.encode()))
    src_np, formats = make_caches(fmt, dtype="bfloat16", rng=rng, **GEOMETRY)
    dst_np, _ = make_caches(fmt, dtype="bfloat16", rng=rng, zero=True, **GEOMETRY)
    src_a, src_b = a.convert(src_np), b.convert(src_np)
    manager_a = KVLayerGroupsManager(src_a, formats, lmcache_tokens_per_chunk=CHUNK)
    manager_b = KVLayerGroupsManager(src_b, formats, lmcache_tokens_per_chunk=CHUNK)
    assert _summary(manager_a) == _summary(manager_b)

    ids_a = rng.permutation(GEOMETRY["nb"])[:6]
    ids_b = rng.permutation(GEOMETRY["nb"])[:6]
    objects_a = a.store(manager_a, src_a, ids_a)
    objects_b = b.store(manager_b, src_b, ids_a)
    # The same bytes whoever wrote them: both equal the independent model's objects.
    bpc = CHUNK // GEOMETRY["bs"]
    for og in range(manager_a.num_object_groups):
        want = np.stack(
            [
                expected_object(manager_a, src_np, og, {0: ids_a[c * bpc : (c + 1) * bpc]})
                for c in range(len(ids_a) // bpc)
            ]
        )
        for h, objects in ((a, objects_a), (b, objects_b)):
            assert_objects_match(
                h.to_numpy(objects[og], UINT8),
                want,
                manager_a,
                og,
                what=f"objects stored by {h.id}",
                ids=ids_a,
                source_caches=src_np,
                formats=formats,
            )

    handed = [b.adopt(o) for o in objects_a]
    dst = b.load(manager_b, handed, b.convert(dst_np), ids_b)
    before = all_blocks(src_np, formats)
    moved = dict(zip(ids_b.tolist(), ids_a.tolist()))
    want = moved_blocks(before, all_blocks(dst_np, formats), moved)
    assert_blocks_match(
        b.read(dst, dst_np),
        formats,
        want,
        what=f"{b.id} loading objects stored by {a.id}",
        source=before,
        expected_source=moved,
    )


@pytest.mark.parametrize("fmt", TRANSFER_FORMATS, ids=lambda f: f.name)
def test_grouping_is_the_same_from_backend_arrays_numpy_and_bare_specs(harness, fmt):
    src_np, formats = make_caches(fmt, dtype="bfloat16", rng=np.random.default_rng(1), **GEOMETRY)

    def specs(structure):
        if isinstance(structure, (list, tuple)):
            return type(structure)(specs(x) for x in structure)
        return describe(structure).spec

    summaries = [
        _summary(KVLayerGroupsManager(c, formats, lmcache_tokens_per_chunk=CHUNK))
        for c in (harness.convert(src_np), src_np, specs(src_np))
    ]
    assert summaries[0] == summaries[1] == summaries[2]
