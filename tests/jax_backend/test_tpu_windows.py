"""The TPU lowering's DMA plans (kvgroups_jax.lowerings.tpu_windows), replayed on NumPy: every
window a plan names is copied with NumPy slicing of the same views the kernel makes, one copy
per DMA, and the result must be the NumPy oracle's bytes (kvgroups_core.transfer.reference), for
every
page layout, dtype and direction, with scattered and consecutive block ids. This checks the
window maths exhaustively and cheaply; tests/jax_backend/test_tpu_lowering.py runs the kernel."""

import numpy as np
import pytest
from kvgroups_jax.geometry import group_geometry
from kvgroups_jax.lowerings.tpu_windows import View, plan_dmas, window

from kvgroups_core.transfer.block_runs import block_runs
from kvgroups_core.transfer.reference import execute_group
from tests.support.jax_layouts import LAYOUTS, make_group, make_plan

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _np_index(entries):
    return tuple(slice(e[0], e[0] + e[1]) if isinstance(e, tuple) else e for e in entries)


def replay(direction, group, arrays, nbytes, seed=0):
    """Apply the DMA plan of ``group`` with NumPy; returns (plan, runs, DMAs issued)."""
    plan = make_plan(direction, [group], arrays, [nbytes])
    geom = group_geometry(group, plan.tensor_specs, nbytes)
    dmas = plan_dmas(geom)
    u = geom.unit
    rng = np.random.default_rng(seed)
    obj = rng.integers(0, 256, (group.num_chunks, nbytes), dtype=np.uint8)
    want_caches = [a.copy().view(np.uint8).reshape(-1) for a in arrays]
    want_obj = obj.copy()
    execute_group(group, direction == "store", want_caches, want_obj)
    caches = [a.copy().view(np.uint8).reshape(-1).view(UINT[u]) for a in arrays]
    views = [caches[s].reshape(v.shape) for s, v in zip(geom.operand_indices, dmas.cache_views)]
    o = obj.copy().view(UINT[u]).reshape((group.num_chunks,) + dmas.obj_view.shape)
    runs = block_runs(group)
    issued = 0
    for first_block, first_item, length in zip(runs.src, runs.dst, runs.length):
        chunk, pos = divmod(int(first_item), group.kept_per_chunk)
        for fam in dmas.families:
            if fam.run_dim is None:
                steps = [(int(first_block) + i, pos + i, 1) for i in range(length)]
            else:
                steps = [(int(first_block), pos, int(length))]
            for block, p, n in steps:
                for k in range(fam.dmas):
                    c = _np_index(window(fam.cache, k, fam, block, n))
                    w = (chunk,) + _np_index(window(fam.obj, k, fam, p, n))
                    cache = views[fam.operand]
                    assert cache[c].shape == o[w].shape  # a DMA never reshapes
                    if direction == "store":
                        o[w] = cache[c]
                    else:
                        cache[c] = o[w]
                    issued += 1
    for k, (got, want) in enumerate(zip(caches, want_caches)):
        np.testing.assert_array_equal(got.view(np.uint8), want, err_msg=f"cache {k}")
    np.testing.assert_array_equal(o.reshape(group.num_chunks, -1).view(np.uint8), want_obj)
    return dmas, runs, issued


@pytest.mark.parametrize("ids", ["scattered", "consecutive"])
@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float8_e4m3fn"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_replays_the_oracles_bytes(layout, dtype, direction, ids):
    arrays, group = make_group(
        layout,
        dtype,
        num_chunks=3,
        bpc=4,
        kept=3,
        nb=24,
        ids=np.arange(5, 17) if ids == "consecutive" else None,
        first_item=2 if direction == "load" else 0,
    )
    nbytes = group.num_planes * group.slots * group.row_bytes
    plan, runs, issued = replay(direction, group, arrays, nbytes)
    if plan.coalesces:
        assert issued == runs.count * plan.dmas_per_run()
    if ids == "consecutive":
        assert runs.count == 3  # one run per chunk


@pytest.mark.parametrize("layout", ["nhd", "flashinfer_nhd", "interleaved", "cross_layer"])
def test_token_major_pages_move_a_whole_run_per_dma_in_their_own_shape(layout):
    arrays, group = make_group(layout, "bfloat16", num_chunks=2, bpc=4, nb=16)
    nbytes = group.num_planes * group.slots * group.row_bytes
    plan, _, _ = replay("store", group, arrays, nbytes)
    assert plan.view_kind == "natural"  # the caches are not reshaped
    assert [v.shape for v in plan.cache_views] == [a.shape for a in arrays]
    assert plan.coalesces and all(f.dmas == 1 for f in plan.families)


@pytest.mark.parametrize("layout,per_run", [("hnd", 2), ("heads_outer", 2), ("cs_hnd", 2)])
def test_head_major_pages_take_one_dma_per_head_and_run(layout, per_run):
    # A DMA cannot transpose: heads outside tokens in the cache, inside them in the object.
    arrays, group = make_group(layout, "bfloat16", num_chunks=2, bpc=4, nb=16, nh=2)
    nbytes = group.num_planes * group.slots * group.row_bytes
    plan, _, _ = replay("load", group, arrays, nbytes)
    assert plan.view_kind == "natural" and plan.coalesces
    assert all(f.dmas == per_run for f in plan.families)


def test_a_region_offset_inside_a_shared_object_is_honoured():
    # Two kernel groups' regions in one object: this one starts after 3 other rows' bytes.
    arrays, group = make_group("nhd", "bfloat16", num_chunks=2, bpc=2, nb=16, region_offset=3 * 96)
    nbytes = 3 * 96 + group.num_planes * group.slots * group.row_bytes
    for direction in ("store", "load"):
        replay(direction, group, arrays, nbytes)


def test_view_chain_and_digits():
    v = View.chain(96, [24, 4])
    assert v.shape == (4, 6, 4) and v.strides == (24, 4, 1)
    assert v.digits(53) == (2, 1, 1) and v.digits(96) is None
    assert View.chain(96, [24, 5]) is None and View.chain(100, [24]) is None
    assert View.of_shape((2, 1, 3)).axis_of(3) == 0  # the longer of two equal-stride axes
