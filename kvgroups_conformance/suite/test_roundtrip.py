"""Round trips for every must-have format and dtype; canonical object bytes; padded blocks."""

import zlib

import numpy as np
import pytest

from kvgroups_conformance.caches import TRANSFER_FORMATS, all_blocks, expected_object, make_caches
from kvgroups_conformance.cases import every_nth
from kvgroups_conformance.compare import assert_blocks_match, assert_objects_match, moved_blocks
from kvgroups_conformance.report import Mismatch, raise_if_any
from kvgroups_core.errors import UnsupportedConfigError
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_core.transfer.objects import object_nbytes

GEOMETRY = dict(nl=3, nb=24, bs=4, nh=2, hs=16)
CHUNK = 8  # tokens: 2 blocks of 4 per chunk
ROUND_TRIP_DTYPES = ["float16", "bfloat16", "float32", "float8_e4m3fn"]
PADDED_FORMATS = [f for f in TRANSFER_FORMATS if f.block_axis_first]
#: The small case set (kvgroups_conformance.cases): every format round-trips in bfloat16 (the
#: programs of its canonical-layout case), each other dtype on one layout whose pieces are
#: element-width sized (HND heads, heads outermost, K/V interleaved heads); every 4th padded
#: format.
SMALL_DTYPE_FORMATS = {
    "float16": "NL_X_TWO_NB_NH_BS_HS",
    "float32": "TWO_X_NL_X_NH_NB_BS_HS",
    "float8_e4m3fn": "NL_X_NB_BS_NH_TWO_HS",
}


def small_case(name: str, params: dict) -> bool:
    fmt = params.get("fmt")
    if name == "test_round_trip_moves_blocks_and_leaves_others_untouched":
        dtype = params["dtype"]
        return dtype == "bfloat16" or SMALL_DTYPE_FORMATS.get(dtype) == fmt.name
    if name == "test_padded_blocks_round_trip_and_keep_padding":
        return every_nth(fmt, PADDED_FORMATS, 4)
    return True


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

    src_after = (
        harness.read(src, src_np) if isinstance(src_np, list) else harness.to_numpy(src, src_np)
    )
    dst_after = (
        harness.read(dst, dst_np) if isinstance(dst_np, list) else harness.to_numpy(dst, dst_np)
    )
    return manager, formats, src_np, dst_np, src_after, dst_after, ids_a, ids_b, objects


def declared_unsupported(harness, fmt, dtype) -> bool:
    """True (after checking it) when the harness declares ``(fmt, dtype)`` unsupported: the
    backend must then refuse it with a NotImplementedError subclass (STYLE point 5: never a
    silent skip, never wrong bytes)."""
    if harness.supports(fmt, dtype):
        return False
    rng = np.random.default_rng(0)
    src_np, formats = make_caches(fmt, dtype=dtype, rng=rng, **GEOMETRY)
    manager = KVLayerGroupsManager(src_np, formats, lmcache_tokens_per_chunk=CHUNK)
    with pytest.raises(UnsupportedConfigError):
        harness.store(manager, harness.convert(src_np), np.arange(CHUNK // GEOMETRY["bs"]))
    return True


@pytest.mark.parametrize("fmt", TRANSFER_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", ROUND_TRIP_DTYPES)
def test_round_trip_moves_blocks_and_leaves_others_untouched(harness, fmt, dtype):
    if declared_unsupported(harness, fmt, dtype):
        return
    rng = np.random.default_rng(zlib.crc32(f"{fmt.name}/{dtype}".encode()))
    for placement in harness.placements:
        (manager, formats, src_np, dst_np, src_after, dst_after, ids_a, ids_b, _) = _round_trip(
            harness, fmt, dtype, placement, rng
        )
        src_blocks = all_blocks(src_np, formats)
        moved = dict(zip(ids_b.tolist(), ids_a.tolist()))
        want = moved_blocks(src_blocks, all_blocks(dst_np, formats), moved)
        assert_blocks_match(
            dst_after,
            formats,
            want,
            what=f"store + load (placement {placement})",
            source=src_blocks,
            expected_source=moved,
        )
        # The source is only read.
        assert_blocks_match(src_after, formats, src_blocks, what="store changed its source caches")


@pytest.mark.parametrize("fmt", PADDED_FORMATS, ids=lambda f: f.name)
def test_padded_blocks_round_trip_and_keep_padding(harness, fmt):
    if declared_unsupported(harness, fmt, "float16"):
        return
    rng = np.random.default_rng(7)
    (manager, formats, src_np, dst_np, _, dst_after, ids_a, ids_b, _) = _round_trip(
        harness, fmt, "float16", harness.placements[0], rng, pad=40
    )
    assert manager.kernel_groups[0].shape_desc.block_stride_elems > 0
    src_blocks = all_blocks(src_np, formats)
    moved = dict(zip(ids_b.tolist(), ids_a.tolist()))
    want = moved_blocks(src_blocks, all_blocks(dst_np, formats), moved)
    assert_blocks_match(
        dst_after,
        formats,
        want,
        what="store + load of padded blocks",
        source=src_blocks,
        expected_source=moved,
    )
    if not harness.keeps_padding:
        return  # the backend's arrays are unpadded copies: there is no padding to check
    # The padding between blocks still holds its sentinel.
    arrays = dst_after if isinstance(dst_after, list) else [dst_after]
    mismatches = []
    checked = 0
    for layer, arr in enumerate(arrays):
        arr = arr[0] if isinstance(arr, list) else arr
        raw = np.lib.stride_tricks.as_strided(
            arr.view(np.uint8) if arr.dtype.itemsize == 1 else arr,
            shape=(arr.shape[0], arr.strides[0] // arr.dtype.itemsize),
            strides=(arr.strides[0], arr.dtype.itemsize),
        )
        inner = int(np.prod(arr.shape[1:]))
        # The last block's padding lies past the array's extent: not the backend's memory.
        pad = np.ascontiguousarray(raw[:-1, inner:]).view(np.uint8)
        checked += pad.size
        wrong = np.argwhere(pad != 0xA5)
        if len(wrong):
            block, byte = (int(v) for v in wrong[0])
            mismatches.append(
                Mismatch(
                    what="padding between blocks was overwritten",
                    format=fmt.name,
                    dtype="float16",
                    layer=layer,
                    plane=0,
                    plane_name="padding",
                    block=block,
                    byte=byte,
                    token=-1,
                    expected=0xA5,
                    actual=int(pad[block, byte]),
                    differing_blocks=len({int(b) for b, _ in wrong}),
                )
            )
    raise_if_any(mismatches)
    assert checked, f"{harness.id} declares keeps_padding, but its arrays came back unpadded"


@pytest.mark.parametrize("fmt", TRANSFER_FORMATS, ids=lambda f: f.name)
def test_stored_objects_equal_the_canonical_layout(harness, fmt):
    if declared_unsupported(harness, fmt, "bfloat16"):
        return
    rng = np.random.default_rng(11)
    (manager, formats, src_np, _, _, _, ids_a, _, objects) = _round_trip(
        harness, fmt, "bfloat16", harness.placements[0], rng
    )
    bpc = CHUNK // GEOMETRY["bs"]
    for og in range(manager.num_object_groups):
        got = harness.to_numpy(objects[og], np.zeros(0, np.uint8))
        want = np.stack(
            [
                expected_object(manager, src_np, og, {0: ids_a[c * bpc : (c + 1) * bpc]})
                for c in range(got.shape[0])
            ]
        )
        assert_objects_match(
            got,
            want,
            manager,
            og,
            what="store: object bytes",
            ids={0: ids_a},
            source_caches=src_np,
            formats=formats,
        )
