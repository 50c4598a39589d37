"""The Triton small-page kernel on a GPU, bit-exact against the NumPy reference: 512 B,
1 KiB and 2 KiB pages, NHD and HND, store and load (in place), a load skip, a layer subset,
a store creating its objects, out-of-range traced ids dropped, and the swept items per
program. Skipped without a GPU (tests/jax_backend/conftest.py)."""

from dataclasses import replace

import jax
import numpy as np
import pytest
from kvgroups_jax.executor import execute_plan
from kvgroups_jax.lowerings import triton as pallas_copy
from kvgroups_jax.lowerings.tuning import LoweringTuning

from kvgroups_core.transfer import reference
from tests.support.jax_checks import as_bytes, run_and_check
from tests.support.jax_layouts import make_plan
from tests.support.jax_small_cases import PAGES, object_nbytes, select_small_kernel, small_group

pytestmark = pytest.mark.gpu


@pytest.fixture(params=[4, 16])
def small(request, monkeypatch):
    yield from select_small_kernel(monkeypatch, request.param)


@pytest.mark.parametrize("page", sorted(PAGES))
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_gpu_small_pages_are_bit_exact_and_in_place(small, page, layout):
    gpu = jax.devices("gpu")[0]
    for direction in ("store", "load"):
        # 37 chunks of 3 kept blocks out of 4 (111 items: full and partial programs), a load
        # skipping 5 items.
        arrays, g = small_group(
            page,
            layout,
            direction=direction,
            nb=200,
            num_chunks=37,
            bpc=4,
            kept=3,
            nl=3,
            first_item=5 if direction == "load" else 0,
            seed=page,
        )
        caches, objs, new_c, new_o, ptrs, optrs = run_and_check(
            direction,
            [g],
            arrays,
            [object_nbytes(g)],
            lowering="triton",
            device=gpu,
            tuning=small.tuning,
        )
        if direction == "load":
            assert [c.unsafe_buffer_pointer() for c in new_c] == ptrs
        else:
            assert [o.unsafe_buffer_pointer() for o in new_o] == optrs
    assert small and all(ipp > 1 for ipp in small)


@pytest.mark.parametrize("direction", ["store", "load"])
def test_gpu_layer_subset(small, direction):
    gpu = jax.devices("gpu")[0]
    arrays, g = small_group(1024, direction=direction, nb=64, num_chunks=9, bpc=4, nl=3)
    planes = tuple(replace(p, object_plane=i) for i, p in enumerate(g.planes) if i in (1, 4))
    run_and_check(
        direction,
        [replace(g, planes=planes)],
        arrays,
        [object_nbytes(g)],
        lowering="triton",
        device=gpu,
        tuning=small.tuning,
    )
    assert small


def test_gpu_store_that_creates_its_objects(small):
    gpu = jax.devices("gpu")[0]
    arrays, g = small_group(512, nb=64, num_chunks=12, bpc=4)
    plan = make_plan("store", [g], arrays, [object_nbytes(g)])
    want = np.zeros((12, object_nbytes(g)), np.uint8)
    reference.execute_plan(plan, [a.copy() for a in arrays], [want])
    _, objs = execute_plan(
        plan,
        [jax.device_put(a, gpu) for a in arrays],
        [None],
        lowering="triton",
        tuning=small.tuning,
    )
    np.testing.assert_array_equal(np.asarray(objs[0]), want)
    assert small


@pytest.mark.parametrize("direction", ["store", "load"])
def test_gpu_out_of_range_traced_ids_move_nothing(small, direction):
    gpu = jax.devices("gpu")[0]
    arrays, g = small_group(2048, direction=direction, nb=48, num_chunks=8, bpc=4)
    plan = make_plan(direction, [g], arrays, [object_nbytes(g)])
    obj = np.random.default_rng(8).integers(0, 256, (8, object_nbytes(g)), np.uint8)
    bad = np.random.default_rng(9).permutation(48)[:32].astype(np.int32)
    bad[[2, 17, 30]] = [48, -1, 2**30]

    def step(caches, obj, ids):
        traced = replace(plan, groups=(replace(plan.groups[0], block_ids=ids),))
        return execute_plan(traced, caches, [obj], lowering="triton", tuning=small.tuning)

    new_c, new_o = jax.jit(step)(
        [jax.device_put(a, gpu) for a in arrays], jax.device_put(obj, gpu), jax.device_put(bad, gpu)
    )
    want_c = [a.copy() for a in arrays]
    want_o = obj.copy()
    host = replace(plan, groups=(replace(plan.groups[0], block_ids=bad.astype(np.int64)),))
    assert reference.execute_plan(host, want_c, [want_o], drop_out_of_range=True) == {48, -1, 2**30}
    if direction == "store":
        np.testing.assert_array_equal(as_bytes(new_o[0]), want_o.reshape(-1))
    else:
        for got, want in zip(new_c, want_c):
            np.testing.assert_array_equal(as_bytes(got), want.view(np.uint8).reshape(-1))
    assert small


def test_gpu_small_kernel_is_not_used_when_off(monkeypatch):
    seen = []
    monkeypatch.setattr(pallas_copy, "_pallas_copy_small", lambda *a, **k: seen.append(a))
    jax.clear_caches()
    arrays, g = small_group(512, nb=64, num_chunks=4, bpc=4)
    run_and_check(
        "store",
        [g],
        arrays,
        [object_nbytes(g)],
        lowering="triton",
        device=jax.devices("gpu")[0],
        tuning=LoweringTuning(small_page_bytes=0),
    )
    assert not seen
    jax.clear_caches()
