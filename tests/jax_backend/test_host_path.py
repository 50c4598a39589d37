"""The executor's per-call host path: cached programs, device-resident metas, shared ids."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kvgroups_jax import execute_plan, executor, trace_count

from kvgroups_core.errors import KVGroupsValueError
from tests.support.jax_checks import run_and_check
from tests.support.jax_layouts import make_group, make_plan


def _nbytes(g):
    return g.num_planes * g.slots * g.row_bytes


def test_one_plan_shape_gives_one_program_object():
    arrays, g = make_group("nhd", "bfloat16", num_chunks=2)
    plan = make_plan("store", [g], arrays, [_nbytes(g)])
    p1 = executor.program_for(plan, "xla", "cpu", 4)
    # A call of the same shape with other ids (what plan_call makes from one binding).
    other = dataclasses.replace(plan, groups=(dataclasses.replace(g, block_ids=g.block_ids[::-1]),))
    assert executor.program_for(other, "xla", "cpu", 4) is p1
    # Another lowering, or an item count in another bucket, is another program.
    assert executor.program_for(plan, "interpret", "cpu", 4) != p1
    fewer = dataclasses.replace(plan, groups=(dataclasses.replace(g, num_chunks=1),))
    assert executor.program_for(fewer, "xla", "cpu", 4) != p1


def test_programs_of_equal_hand_built_plans_are_equal_and_hash_alike():
    arrays, g = make_group("hnd", "float16")
    a = make_plan("load", [g], arrays, [_nbytes(g)])
    arrays, g2 = make_group("hnd", "float16")  # new planes / runs objects, same values
    b = make_plan("load", [g2], arrays, [_nbytes(g2)])
    pa = executor.program_for(a, "xla", "cpu", 4)
    pb = executor.program_for(b, "xla", "cpu", 4)
    assert pa is not pb and pa == pb and hash(pa) == hash(pb)


def test_fresh_plan_objects_of_a_known_shape_do_not_recompile():
    arrays, g = make_group("nhd", "bfloat16", nb=16, num_chunks=2, seed=3)
    run_and_check("store", [g], arrays, [_nbytes(g)], lowering="xla")
    before = trace_count()
    for seed in (4, 5):
        arrays, g = make_group("nhd", "bfloat16", nb=16, num_chunks=2, seed=seed)
        run_and_check("store", [g], arrays, [_nbytes(g)], lowering="xla")
    assert trace_count() == before


def test_metas_of_committed_caches_are_cached_on_their_device():
    device = jax.devices()[0]
    first = executor._meta(3, 5, device)
    assert executor._meta(3, 5, device) is first
    assert first.devices() == {device} and np.asarray(first).tolist() == [3, 5]
    assert np.asarray(executor._meta(0, -2, device)).tolist() == [0, 0]
    uncommitted = executor._meta(3, 5, "default")
    assert not uncommitted._committed
    assert isinstance(executor._meta(3, 5, None), np.ndarray)  # traced callers: constants


def test_groups_reading_one_id_array_share_one_runtime_array():
    arrays, g = make_group("nhd", "float32", num_chunks=2, seed=1)
    g2 = dataclasses.replace(g, kernel_group_idx=1, region_offset=_nbytes(g))
    plan = make_plan("store", [g, g2], arrays, [2 * _nbytes(g)])
    program, metas, idss = executor.build_program(plan, "xla", "cpu")
    assert program.id_indices == (0, 0) and len(idss) == 1 and len(metas) == 2
    objs = [jnp.zeros((plan.num_chunks, 2 * _nbytes(g)), jnp.uint8)]
    _, out = execute_plan(plan, [jnp.asarray(a) for a in arrays], objs, lowering="xla")
    half = np.asarray(out[0]).reshape(plan.num_chunks, 2, -1)
    np.testing.assert_array_equal(half[:, 0], half[:, 1])  # both groups copied the same pages


def test_padded_ids_copy_check_and_pad():
    ids = np.array([5, 1, 7], np.int64)
    out = executor._padded_ids(ids)
    assert out.dtype == np.int32 and out.tolist() == [5, 1, 7, 0]
    same = np.arange(4, dtype=np.int32)
    padded = executor._padded_ids(same)
    same[0] = 99  # the caller reusing its array must not change what was handed to JAX
    assert padded.tolist() == [0, 1, 2, 3]
    for bad in (np.array([0, 2**31]), np.array([-(2**31) - 1] + [0] * 100)):
        with pytest.raises(KVGroupsValueError, match="int32"):
            executor._padded_ids(bad)
