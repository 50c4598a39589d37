import jax.numpy as jnp
import numpy as np
import pytest
from kvgroups_jax.executor import execute_plan

from kvgroups_core.errors import KVGroupsValueError
from tests.support.jax_checks import run_and_check
from tests.support.jax_layouts import DTYPES, LAYOUTS, make_group, make_plan

LOWERINGS_CPU = ("interpret", "xla", "tpu-interpret")


def _object_nbytes(group):
    return group.num_planes * group.slots * group.row_bytes


@pytest.mark.parametrize("lowering", LOWERINGS_CPU)
@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_is_bit_exact_bf16_with_nan_payloads(layout, direction, lowering):
    arrays, g = make_group(layout, "bfloat16", first_item=1 if direction == "load" else 0)
    run_and_check(direction, [g], arrays, [_object_nbytes(g)], lowering=lowering)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("layout", ["nhd", "interleaved", "heads_outer"])
def test_every_dtype_is_bit_exact_in_interpret_mode(layout, dtype):
    for direction in ("store", "load"):
        arrays, g = make_group(layout, dtype, seed=3)
        run_and_check(direction, [g], arrays, [_object_nbytes(g)], lowering="interpret")


@pytest.mark.parametrize("lowering", LOWERINGS_CPU)
def test_sliding_window_keeps_the_last_blocks_of_each_chunk(lowering):
    arrays, g = make_group("hnd", "float16", num_chunks=3, bpc=2, kept=1, nb=8)
    run_and_check("store", [g], arrays, [_object_nbytes(g)], lowering=lowering)
    arrays, g = make_group("hnd", "float16", num_chunks=3, bpc=2, kept=1, nb=8, first_item=2)
    run_and_check("load", [g], arrays, [_object_nbytes(g)], lowering=lowering)


@pytest.mark.parametrize("lowering", LOWERINGS_CPU)
def test_two_groups_share_one_object_at_their_region_offsets(lowering):
    a1, g1 = make_group("nhd", "bfloat16", nh=2, hs=8)
    n1 = _object_nbytes(g1)
    a2, g2 = make_group(
        "indexer", "uint8", region_offset=n1, index_base=len(a1), seed=4, ids=g1.block_ids
    )
    total = n1 + _object_nbytes(g2)
    for direction in ("store", "load"):
        run_and_check(direction, [g1, g2], a1 + a2, [total], lowering=lowering)


@pytest.mark.parametrize("lowering", LOWERINGS_CPU)
def test_untouched_blocks_and_rows_stay_untouched(lowering):
    arrays, g = make_group("interleaved", "bfloat16", first_item=3, num_chunks=2, bpc=2)
    before = [a.copy() for a in arrays]
    *_, new_c, _new_o, _, _ = run_and_check(
        "load", [g], arrays, [_object_nbytes(g)], lowering=lowering
    )
    _, _, ids = g.items()
    # Only block ids[...] of items >= first_item may change: check the others bit for bit.
    for layer, (old, new) in enumerate(zip(before, new_c)):
        new = np.asarray(new)
        untouched = [b for b in range(old.shape[0]) if b not in set(ids.tolist())]
        np.testing.assert_array_equal(
            new[untouched].view(np.uint8), old[untouched].view(np.uint8), err_msg=f"layer {layer}"
        )


def test_no_items_moves_nothing():
    arrays, g = make_group("nhd", "float32", num_chunks=1, bpc=2, first_item=2)
    assert g.num_items == 0
    run_and_check("load", [g], arrays, [_object_nbytes(g)], lowering="interpret")


def test_an_object_pool_with_more_rows_than_chunks_is_refused_as_by_the_core():
    # One object rule (kvgroups_core.transfer.objects): [num_chunks, nbytes], whoever calls.
    arrays, g = make_group("nhd", "float16")
    plan = make_plan("store", [g], arrays, [_object_nbytes(g)])
    pool = jnp.zeros((g.num_chunks + 2, _object_nbytes(g)), jnp.uint8)
    with pytest.raises(KVGroupsValueError, match=r"objects\[0\]: expected uint8 \["):
        execute_plan(plan, [jnp.asarray(a) for a in arrays], [pool], lowering="interpret")
    assert not pool.is_deleted()
