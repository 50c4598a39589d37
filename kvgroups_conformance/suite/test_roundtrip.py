import numpy as np
import pytest

from kvgroups_conformance.caches import TRANSFER_FORMATS, all_blocks, expected_object, make_caches
from kvgroups_core.manager import KVLayerGroupsManager
from kvgroups_core.objects import object_nbytes

GEOMETRY = dict(nl=3, nb=24, bs=4, nh=2, hs=16)
CHUNK = 8  # tokens: 2 blocks of 4 per chunk


def _ids(rng, nb, n):
    return rng.permutation(nb)[:n].astype(np.int64)


def _round_trip(harness, fmt, dtype, placement, rng, pad=0, geometry=GEOMETRY):
    src_np, formats = make_caches(fmt, dtype=dtype, rng=rng, pad=pad, **geometry)
    dst_np, _ = make_caches(fmt, dtype=dtype, rng=rng, pad=pad, zero=True, **geometry)
    manager = KVLayerGroupsManager(src_np, formats, lmcache_tokens_per_chunk=CHUNK)
    nb, bs = geometry["nb"], geometry["bs"]
    num_chunks = 3
    ids_a = _ids(rng, nb, num_chunks * CHUNK // bs)
    ids_b = _ids(rng, nb, num_chunks * CHUNK // bs)

    src = harness.convert(src_np)
    dst = harness.convert(dst_np)
    nbytes = tuple(object_nbytes(manager, og) for og in range(manager.num_object_groups))
    objects = harness.zeros_objects(nbytes, num_chunks, placement)
    objects = harness.store(manager, src, ids_a, objects)
    dst = harness.load(manager, objects, dst, ids_b)

    src_after = harness.read(src, src_np) if isinstance(src_np, list) else harness.to_numpy(
        src, src_np)
    dst_after = harness.read(dst, dst_np) if isinstance(dst_np, list) else harness.to_numpy(
        dst, dst_np)
    return manager, formats, src_np, dst_np, src_after, dst_after, ids_a, ids_b, objects


@pytest.mark.parametrize("fmt", TRANSFER_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float8_e4m3fn"])
def test_round_trip_moves_blocks_and_leaves_others_untouched(harness, fmt, dtype):
    rng = np.random.default_rng(hash((fmt.name, dtype)) % 2**32)
    for placement in harness.placements:
        (manager, formats, src_np, dst_np, src_after, dst_after,
         ids_a, ids_b, _) = _round_trip(harness, fmt, dtype, placement, rng)
        src_blocks = all_blocks(src_np, formats)
        dst_blocks = all_blocks(dst_after, formats)
        moved = dict(zip(ids_b.tolist(), ids_a.tolist()))
        for (layer, kv, b), rows in dst_blocks.items():
            if b in moved:
                np.testing.assert_array_equal(rows, src_blocks[(layer, kv, moved[b])],
                                              err_msg=f"layer {layer} kv {kv} block {b}")
            else:
                assert not rows.any(), f"untouched block {b} of layer {layer} kv {kv} changed"
        # The source is only read.
        for key, rows in all_blocks(src_after, formats).items():
            np.testing.assert_array_equal(rows, src_blocks[key])


@pytest.mark.parametrize("fmt", [f for f in TRANSFER_FORMATS if f.block_axis_first],
                         ids=lambda f: f.name)
def test_padded_blocks_round_trip_and_keep_padding(harness, fmt):
    rng = np.random.default_rng(7)
    (manager, formats, src_np, dst_np, _, dst_after,
     ids_a, ids_b, _) = _round_trip(harness, fmt, "float16", harness.placements[0], rng, pad=40)
    assert manager.kernel_groups[0].shape_desc.block_stride_elems > 0
    src_blocks = all_blocks(src_np, formats)
    moved = dict(zip(ids_b.tolist(), ids_a.tolist()))
    for (layer, kv, b), rows in all_blocks(dst_after, formats).items():
        want = src_blocks[(layer, kv, moved[b])] if b in moved else np.zeros_like(rows)
        np.testing.assert_array_equal(rows, want)
    # The padding between blocks still holds its sentinel.
    arrays = dst_after if isinstance(dst_after, list) else [dst_after]
    for arr in arrays:
        arr = arr[0] if isinstance(arr, list) else arr
        raw = np.lib.stride_tricks.as_strided(
            arr.view(np.uint8) if arr.dtype.itemsize == 1 else arr,
            shape=(arr.shape[0], arr.strides[0] // arr.dtype.itemsize),
            strides=(arr.strides[0], arr.dtype.itemsize))
        inner = int(np.prod(arr.shape[1:]))
        pad = raw[:, inner:].view(np.uint8)
        assert (pad == 0xA5).all()


@pytest.mark.parametrize("fmt", TRANSFER_FORMATS, ids=lambda f: f.name)
def test_stored_objects_equal_the_canonical_layout(harness, fmt):
    rng = np.random.default_rng(11)
    (manager, formats, src_np, _, _, _, ids_a, _, objects) = _round_trip(
        harness, fmt, "bfloat16", harness.placements[0], rng)
    bpc = CHUNK // GEOMETRY["bs"]
    for og in range(manager.num_object_groups):
        got = harness.to_numpy(objects[og], np.zeros(0, np.uint8))
        for c in range(got.shape[0]):
            want = expected_object(manager, src_np, og, {0: ids_a[c * bpc:(c + 1) * bpc]})
            np.testing.assert_array_equal(got[c], want, err_msg=f"chunk {c}")
