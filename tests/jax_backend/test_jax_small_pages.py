"""The Triton small-page kernel (``pallas_copy._small_kernel``: several items per program, ids
read as one vector, masked [items, *box] ops on a flat object) in Pallas interpret mode,
bit-exact against the NumPy reference: 512 B, 1 KiB and 2 KiB pages, store and load, a
layer subset, a load skip, partial programs, a store creating its objects, and out-of-range
traced ids dropped."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kvgroups_jax.executor import execute_plan
from kvgroups_jax.geometry import MAX_BOX_ELEMS, group_geometry
from kvgroups_jax.lowerings import triton as pallas_copy
from kvgroups_jax.lowerings.tuning import LoweringTuning

from kvgroups_core.tensors.descriptors import TensorSpec
from kvgroups_core.transfer import reference
from tests.support.jax_checks import as_bytes, run_and_check
from tests.support.jax_layouts import make_plan
from tests.support.jax_small_cases import PAGES, object_nbytes, select_small_kernel, small_group


@pytest.fixture
def small(monkeypatch):
    """Select the small-page kernel (8 items per program) and count its launches."""
    yield from select_small_kernel(monkeypatch, 8)


@pytest.mark.parametrize("page", sorted(PAGES))
@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_small_pages_are_bit_exact(small, page, direction, layout):
    # 3 chunks of 3 kept blocks out of 4: 9 items, so the second program of 8 is partial.
    arrays, g = small_group(
        page, layout, direction=direction, nb=24, num_chunks=3, bpc=4, kept=3, seed=page
    )
    run_and_check(
        direction, [g], arrays, [object_nbytes(g)], lowering="interpret", tuning=small.tuning
    )
    assert small and all(ipp > 1 for ipp in small)


@pytest.mark.parametrize("page", [512, 2048])
def test_load_skip_moves_only_the_items_after_it(small, page):
    arrays, g = small_group(page, direction="load", nb=24, num_chunks=3, bpc=4, first_item=5)
    run_and_check(
        "load", [g], arrays, [object_nbytes(g)], lowering="interpret", tuning=small.tuning
    )
    assert small


@pytest.mark.parametrize("direction", ["store", "load"])
def test_layer_subset_moves_its_planes_into_their_object_rows(small, direction):
    arrays, g = small_group(1024, direction=direction, nb=16, num_chunks=2, bpc=4, nl=3)
    # Keep layer 1 of 3: planes 1 (K) and 4 (V), at their object planes in full objects.
    keep = (1, 4)
    planes = tuple(replace(p, object_plane=i) for i, p in enumerate(g.planes) if i in keep)
    full = object_nbytes(g)
    sub = replace(g, planes=planes)
    run_and_check(direction, [sub], arrays, [full], lowering="interpret", tuning=small.tuning)
    assert small


def test_store_that_creates_its_objects(small):
    arrays, g = small_group(512, nb=16, num_chunks=2, bpc=4)
    plan = make_plan("store", [g], arrays, [object_nbytes(g)])
    want = np.zeros((2, object_nbytes(g)), np.uint8)
    reference.execute_plan(plan, [a.copy() for a in arrays], [want])
    _, objs = execute_plan(
        plan, [jnp.asarray(a) for a in arrays], [None], lowering="interpret", tuning=small.tuning
    )
    assert objs[0].shape == (2, object_nbytes(g))
    np.testing.assert_array_equal(np.asarray(objs[0]), want)
    assert small


@pytest.mark.parametrize("direction", ["store", "load"])
def test_out_of_range_traced_ids_move_nothing_for_their_items(small, direction):
    arrays, g = small_group(1024, direction=direction, nb=12, num_chunks=2, bpc=4)
    plan = make_plan(direction, [g], arrays, [object_nbytes(g)])
    rng = np.random.default_rng(8)
    obj = rng.integers(0, 256, (2, object_nbytes(g)), np.uint8)
    bad = np.array([3, 12, 0, -1, 7, 2**20, 5, 9], dtype=np.int32)

    def step(caches, obj, ids):
        traced = replace(plan, groups=(replace(plan.groups[0], block_ids=ids),))
        return execute_plan(traced, caches, [obj], lowering="interpret", tuning=small.tuning)

    new_c, new_o = jax.jit(step)(
        [jnp.asarray(a) for a in arrays], jnp.asarray(obj), jnp.asarray(bad)
    )
    want_c = [a.copy() for a in arrays]
    want_o = obj.copy()
    host = replace(plan, groups=(replace(plan.groups[0], block_ids=bad.astype(np.int64)),))
    dropped = reference.execute_plan(host, want_c, [want_o], drop_out_of_range=True)
    assert dropped == {12, -1, 2**20}
    if direction == "store":
        np.testing.assert_array_equal(as_bytes(new_o[0]), want_o.reshape(-1))
    else:
        for got, want in zip(new_c, want_c):
            np.testing.assert_array_equal(as_bytes(got), want.view(np.uint8).reshape(-1))
    assert small


def test_items_per_program_follows_the_tuning_and_the_caps():
    arrays, g = small_group(512, nb=16, num_chunks=2, bpc=4)
    specs = tuple(TensorSpec(a.shape, a.dtype) for a in arrays)
    geom = group_geometry(g, specs, object_nbytes(g))

    def ipp(grid_items, **tuning):
        return pallas_copy.items_per_program(geom, grid_items, 2, LoweringTuning(**tuning))

    assert pallas_copy.items_per_program(geom, 64, 2) == 8  # the default: on up to 1 KiB
    assert ipp(64, small_page_bytes=0) == 1  # off
    assert ipp(64, small_page_bytes=512) == 8
    assert ipp(4, small_page_bytes=512) == 4  # never past the item bucket
    assert ipp(64, small_page_bytes=512, items_per_program=12) == 8  # a power of two
    big = ipp(1 << 20, small_page_bytes=512, items_per_program=1 << 20)
    assert big * max(np.prod(b.shape) for b in geom.boxes) <= MAX_BOX_ELEMS
    assert ipp(64, small_page_bytes=256) == 1  # the page is above the threshold


def test_the_tuning_is_explicit_typed_and_part_of_the_program_key():
    # A JaxBackend's tuning reaches the kernels through the program, never a module global:
    # two tunings of one plan are two programs, and each runs its own kernel.
    from kvgroups_jax import JaxBackend
    from kvgroups_jax.executor import program_for

    from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError

    arrays, g = small_group(512, nb=16, num_chunks=2, bpc=4)
    plan = make_plan("store", [g], arrays, [object_nbytes(g)])
    off = LoweringTuning(small_page_bytes=0)
    assert program_for(plan, "interpret", "cpu", None) != program_for(
        plan, "interpret", "cpu", None, tuning=off
    )
    assert JaxBackend().tuning == LoweringTuning()
    assert JaxBackend(tuning=off).tuning is off
    with pytest.raises(KVGroupsTypeError, match="tuning: expected a LoweringTuning"):
        JaxBackend(tuning={"small_page_bytes": 0})
    with pytest.raises(KVGroupsValueError, match="items_per_program: expected an int >= 1"):
        LoweringTuning(items_per_program=0)
    with pytest.raises(KVGroupsTypeError, match="resident_waves: expected an int"):
        LoweringTuning(resident_waves=1.5)


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("page", sorted(PAGES))
def test_small_page_kernel_lowers_to_triton_for_an_abstract_h200(
    small, monkeypatch, layout, direction, page
):
    # The Pallas -> Triton lowering runs here (no GPU): every op of the kernel (the vector id
    # gather, [items, *box] gathers / scatters, the sum, the fori_loop fallback) must lower.
    from unittest import mock

    from kvgroups_jax import executor
    from kvgroups_jax.lowerings import choice as lowering_choice

    arrays, g = small_group(
        page,
        layout,
        direction=direction,
        nb=64,
        num_chunks=4,
        bpc=4,
        first_item=1 if direction == "load" else 0,
    )
    plan = make_plan(direction, [g], arrays, [object_nbytes(g)])
    caches = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    objects = [jax.ShapeDtypeStruct((4, object_nbytes(g)), jnp.uint8)]
    with mock.patch.object(lowering_choice, "_compute_capability", return_value=(9, 0)):
        text = executor.lower_plan(plan, "triton", caches, objects, tuning=small.tuning).as_text()
    assert "__gpu$xla.gpu.triton" in text
    assert f"kvgroups_{direction}_small_pages" in text
    assert small == [8]
