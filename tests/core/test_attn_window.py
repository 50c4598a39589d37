import numpy as np
import pytest

from kvgroups_core import AttnWindowDesc, KVGroupsTypeError, KVGroupsValueError


def _present(num_chunks, *chunk_sets):
    arr = np.zeros((num_chunks, len(chunk_sets)), dtype=bool)
    for g, chunks in enumerate(chunk_sets):
        arr[list(chunks), g] = True
    return arr


def test_attn_window_desc_keeps_windows_and_world_size():
    desc = AttnWindowDesc([-1, 2], world_size=4)
    assert desc.num_chunks_in_sw == [-1, 2]
    assert desc.world_size == 4
    assert desc.num_object_groups == 2
    assert desc.is_full_attention(0) and not desc.is_full_attention(1)


def test_attn_window_desc_is_hashable_and_compares_by_value():
    assert AttnWindowDesc((-1, 3)) == AttnWindowDesc([-1, 3])
    assert hash(AttnWindowDesc((-1, 3))) == hash(AttnWindowDesc([-1, 3]))
    assert AttnWindowDesc([-1]) != AttnWindowDesc([-1], world_size=2)


@pytest.mark.parametrize("windows", [[0], [-2], [-1, 0], [3, -5]])
def test_attn_window_desc_rejects_zero_and_below_minus_one(windows):
    with pytest.raises(ValueError, match="num_chunks_in_sw"):
        AttnWindowDesc(windows)


@pytest.mark.parametrize("world_size", [0, -1])
def test_attn_window_desc_rejects_world_size_below_one(world_size):
    with pytest.raises(KVGroupsValueError, match="world_size"):
        AttnWindowDesc([-1], world_size=world_size)


def test_attn_window_desc_rejects_non_integer_windows():
    with pytest.raises(KVGroupsTypeError):
        AttnWindowDesc([1.5])
    with pytest.raises(KVGroupsTypeError):
        AttnWindowDesc("12")


def test_hit_full_attention_prefix_of_present_chunks():
    assert AttnWindowDesc([-1]).hit_chunks(_present(4, {0, 1, 2})) == 3


def test_hit_full_attention_stops_at_the_first_gap():
    assert AttnWindowDesc([-1]).hit_chunks(_present(4, {0, 1, 3})) == 2


def test_hit_full_plus_window_two_over_five_chunks():
    present = _present(5, {0, 1, 2, 3}, {2, 3, 4})
    assert AttnWindowDesc([-1, 2]).hit_chunks(present) == 4


def test_hit_window_group_needs_only_its_last_chunks():
    present = _present(6, {0, 1, 2, 3, 4, 5}, {4, 5})
    assert AttnWindowDesc([-1, 2]).hit_chunks(present) == 6


def test_hit_window_one_needs_only_the_last_chunk():
    present = _present(4, {0, 1, 2, 3}, {3})
    assert AttnWindowDesc([-1, 1]).hit_chunks(present) == 4


def test_hit_is_the_highest_servable_prefix_not_the_first_gap():
    desc = AttnWindowDesc([2])
    present = _present(6, {0, 1, 4, 5})
    servable = desc.servable(present)
    assert servable.tolist() == [True, True, True, False, False, False, True]
    assert desc.hit_chunks(present) == 6


def test_hit_is_zero_when_nothing_is_present():
    assert AttnWindowDesc([-1, 2]).hit_chunks(np.zeros((3, 2), dtype=bool)) == 0
    assert AttnWindowDesc([-1]).hit_chunks(np.zeros((0, 1), dtype=bool)) == 0


def test_hit_counts_a_chunk_only_when_every_shard_is_present():
    present = np.ones((3, 1, 2), dtype=bool)
    present[1, 0, 1] = False
    assert AttnWindowDesc([-1], world_size=2).hit_chunks(present) == 1


def test_hit_with_shards_and_a_window():
    present = np.ones((4, 2, 2), dtype=bool)
    present[0, 1, 0] = False  # window group's chunk 0 misses one shard: outside its window
    assert AttnWindowDesc([-1, 2], world_size=2).hit_chunks(present) == 4


def test_hit_accepts_integer_arrays_and_nested_lists():
    assert AttnWindowDesc([-1]).hit_chunks([[1], [1], [0]]) == 2


def test_hit_rejects_a_wrong_number_of_object_groups():
    with pytest.raises(KVGroupsValueError, match="present"):
        AttnWindowDesc([-1, 2]).hit_chunks(np.ones((3, 1), dtype=bool))


def test_hit_rejects_a_wrong_world_size():
    with pytest.raises(KVGroupsValueError, match="present"):
        AttnWindowDesc([-1], world_size=2).hit_chunks(np.ones((3, 1, 3), dtype=bool))


def test_hit_rejects_a_wrong_rank():
    with pytest.raises(KVGroupsValueError, match="2-D"):
        AttnWindowDesc([-1]).hit_chunks(np.ones(3, dtype=bool))


def test_hit_rejects_float_arrays():
    with pytest.raises(KVGroupsTypeError, match="boolean"):
        AttnWindowDesc([-1]).hit_chunks(np.ones((3, 1)))


def test_windows_longer_than_any_int64_serve_like_full_attention():
    present = _present(6, {0, 1, 2, 4, 5}, {0, 1, 2, 3, 4, 5})
    huge = AttnWindowDesc([10**20, 2**63 + 5])
    assert huge.hit_chunks(present) == AttnWindowDesc([-1, -1]).hit_chunks(present) == 3
    np.testing.assert_array_equal(
        huge.servable(present), AttnWindowDesc([-1, -1]).servable(present)
    )
    assert AttnWindowDesc([10**20]).hit_chunks(np.ones((6, 1), bool)) == 6
