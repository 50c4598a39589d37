"""The JAX kernels' program order (kvgroups_jax.geometry.chunk_order): every (item, plane group)
once, and about a chunk at a time: the programs started first cover a row of one chunk's items
for every plane group before any later item."""

import itertools

import pytest
from kvgroups_jax.geometry import chunk_order, chunk_row_items


@pytest.mark.parametrize(
    "grid_items,groups,kept",
    [(16, 64, 16), (64, 64, 16), (32, 3, 16), (8, 5, 16), (64, 2, 5), (1, 7, 16), (128, 1, 32)],
)
def test_every_program_moves_one_distinct_item_plane_pair(grid_items, groups, kept):
    got = [chunk_order(k, grid_items, groups, kept) for k in range(grid_items * groups)]
    assert sorted(got) == list(itertools.product(range(grid_items), range(groups)))


def test_programs_go_a_chunk_of_items_at_a_time():
    # 64 items (4 chunks of 16 kept pages) x 8 plane groups: the first 16 * 8 programs move
    # chunk 0's items for every plane group, the next 128 chunk 1's, and so on.
    row = chunk_row_items(64, 16)
    assert row == 16
    for k in range(64 * 8):
        item, group = chunk_order(k, 64, 8, 16)
        assert item // 16 == k // (16 * 8) and group == (k // 16) % 8
    assert chunk_row_items(8, 16) == 8  # capped by the bucket, so it divides it
    assert chunk_row_items(64, 5) == 4  # a power of two at most kept
