"""The Mosaic GPU page copy run in JAX's Mosaic GPU interpreter on the CPU.

The interpreter executes the same kernel body (TMA copies, barriers, the double-buffered
pieces, masking of items past the runtime count) on host memory, so the indexing is checked bit
for bit against the NumPy reference without a GPU. It does not check TMA box limits (the
abstract-H200 lowering in test_lowering.py does) nor real asynchrony.
"""

import functools
import importlib.util
from dataclasses import replace
from unittest import mock

import jax
import numpy as np
import pytest
from kvgroups_jax.executor import _padded_ids
from kvgroups_jax.geometry import bucket, group_geometry
from kvgroups_jax.lowerings import mosaic as pallas_mosaic
from kvgroups_jax.views import flat_view, object_unview, object_view, unflat_view

from tests.support.jax_checks import as_bytes, reference_transfer
from tests.support.jax_layouts import make_group, make_plan

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("absl") is None,
    reason="Mosaic GPU imports absl: pip install absl-py",
)


def _nbytes(g):
    return g.num_planes * g.slots * g.row_bytes


def run_interpreted(direction, g, arrays, seed=7):
    """Move one group with the interpreted kernel; compare with the oracle; return pieces."""
    nbytes = _nbytes(g)
    plan = make_plan(direction, [g], arrays, [nbytes])
    geom = group_geometry(g, plan.tensor_specs, nbytes)
    pieces = pallas_mosaic.mosaic_pieces(geom)
    obj = np.random.default_rng(seed).integers(0, 256, (g.num_chunks, nbytes), dtype=np.uint8)
    exp_c = [a.copy().view(np.uint8).reshape(-1) for a in arrays]
    exp_o = obj.copy().reshape(-1)
    reference_transfer(direction, g, exp_c, exp_o, nbytes)

    meta = np.array([g.first_item, g.num_items], np.int32)
    ids = _padded_ids(g.block_ids)

    @functools.partial(jax.jit, donate_argnums=(0,) if direction == "load" else (1,))
    def run(caches, obj, meta, ids):
        views = tuple(flat_view(caches[s], geom.unit) for s in geom.operand_indices)
        out = pallas_mosaic.copy_group(
            direction,
            geom,
            bucket(g.num_items),
            meta,
            ids,
            object_view(obj, geom.unit),
            views,
            interpret=True,
        )
        if direction == "store":
            return object_unview(out, geom.unit)
        return tuple(
            unflat_view(v, caches[s].shape, caches[s].dtype, geom.unit)
            for s, v in zip(geom.operand_indices, out)
        )

    out = run(tuple(jax.numpy.asarray(a) for a in arrays), jax.numpy.asarray(obj), meta, ids)
    if direction == "store":
        np.testing.assert_array_equal(as_bytes(out), exp_o)
    else:
        for k, (c, e) in enumerate(zip(out, exp_c)):
            np.testing.assert_array_equal(as_bytes(c), e, err_msg=f"cache slot {k}")
    return pieces


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("layout", ["nhd", "flashinfer_nhd", "cross_layer"])
def test_interpreted_tma_copy_is_bit_exact(layout, direction):
    # 5 of 8 bucketed items on load: the masked programs must not write anything.
    arrays, g = make_group(
        layout,
        "bfloat16",
        nb=8,
        bs=4,
        nh=2,
        hs=128,
        num_chunks=3,
        bpc=2,
        first_item=1 if direction == "load" else 0,
    )
    assert run_interpreted(direction, g, arrays) == (4, 1)


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize(
    "bs, nh, hs, budget, pieces",
    [
        (8, 2, 128, 2048, (2, 4)),
        (12, 2, 128, 4096, (4, 3)),
        (12, 2, 128, 3072, (3, 4)),  # a piece of 3 rows: any divisor, not only powers of two
        (4, 1, 576, 4096, (3, 3)),  # MLA-like 576-wide rows: 9 rows of 256 in three pieces
    ],
)
def test_spans_cut_into_pieces_use_both_buffers(bs, nh, hs, budget, pieces, direction):
    # A small shared-memory budget forces several pieces per span through two buffers (an odd
    # count too, so the last piece lands in the first buffer).
    with mock.patch.object(pallas_mosaic, "MAX_SMEM_BYTES", budget):
        arrays, g = make_group(
            "nhd",
            "bfloat16",
            nb=8,
            bs=bs,
            nh=nh,
            hs=hs,
            num_chunks=2,
            bpc=2,
            first_item=1 if direction == "load" else 0,
        )
        assert run_interpreted(direction, g, arrays) == pieces


@pytest.mark.parametrize("dtype", ["float32", "uint8", "float8_e4m3fn"])
def test_other_widths_and_a_sliding_window(dtype):
    for direction in ("store", "load"):
        arrays, g = make_group(
            "nhd",
            dtype,
            nb=8,
            bs=4,
            nh=2,
            hs=256,
            num_chunks=3,
            bpc=2,
            kept=1,
            first_item=1 if direction == "load" else 0,
            seed=3,
        )
        run_interpreted(direction, g, arrays)


def _mosaic(direction, g, arrays, obj, ids, fresh=False):
    nbytes = _nbytes(g)
    plan = make_plan(direction, [g], arrays, [nbytes])
    geom = group_geometry(g, plan.tensor_specs, nbytes)
    meta = np.array([g.first_item, g.num_items], np.int32)

    @jax.jit
    def run(caches, obj, ids):
        views = tuple(flat_view(caches[s], geom.unit) for s in geom.operand_indices)
        target = (
            jax.ShapeDtypeStruct((obj.shape[0], obj.shape[1] // geom.unit), views[0].dtype)
            if fresh
            else object_view(obj, geom.unit)
        )
        out = pallas_mosaic.copy_group(
            direction, geom, bucket(g.num_items), meta, ids, target, views, interpret=True
        )
        if direction == "store":
            return object_unview(out, geom.unit)
        return tuple(
            unflat_view(v, caches[s].shape, caches[s].dtype, geom.unit)
            for s, v in zip(geom.operand_indices, out)
        )

    return run(
        tuple(jax.numpy.asarray(a) for a in arrays),
        jax.numpy.asarray(obj),
        jax.numpy.asarray(ids, jax.numpy.int32),
    )


def test_interpreted_tma_store_can_create_its_object():
    arrays, g = make_group("nhd", "bfloat16", nb=8, bs=4, nh=2, hs=128, num_chunks=2, bpc=2)
    obj = np.zeros((2, _nbytes(g)), np.uint8)
    exp_c = [a.copy().view(np.uint8).reshape(-1) for a in arrays]
    exp_o = obj.copy().reshape(-1)
    reference_transfer("store", g, exp_c, exp_o, _nbytes(g))
    out = _mosaic("store", g, arrays, obj, g.block_ids, fresh=True)
    np.testing.assert_array_equal(as_bytes(out), exp_o)


def test_interpreted_tma_load_drops_out_of_range_ids():
    arrays, g = make_group("nhd", "bfloat16", nb=8, bs=4, nh=2, hs=128, num_chunks=2, bpc=2)
    obj = np.random.default_rng(2).integers(0, 256, (2, _nbytes(g)), np.uint8)
    good = np.array([2, 3, 6, 7])
    exp_c = [a.copy().view(np.uint8).reshape(-1) for a in arrays]
    reference_transfer(
        "load", replace(g, block_ids=good), exp_c, obj.copy().reshape(-1), _nbytes(g)
    )
    out = _mosaic("load", g, arrays, obj, np.array([2, 3, 6, 99]))
    block = 4 * 2 * 128 * 2
    for c, before, moved in zip(out, arrays, exp_c):
        got, before = as_bytes(c), before.view(np.uint8).reshape(-1)
        for kv in range(2):
            for blk in range(8):
                lo = (kv * 8 + blk) * block
                want = moved if blk in (2, 3, 6) else before
                np.testing.assert_array_equal(got[lo : lo + block], want[lo : lo + block])
