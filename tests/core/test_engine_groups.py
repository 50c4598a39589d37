import dataclasses

import numpy as np
import pytest

from kvgroups_core import (
    EngineGroupInfo,
    KVGroupsTypeError,
    KVGroupsValueError,
    expand_engine_block_ids,
    get_engine_group_indices,
    slice_block_ids_per_group,
)


def test_engine_group_info_defaults_and_keywords():
    info = EngineGroupInfo(engine_group_id=1, layer_indices=[3, 4])
    assert info.layer_indices == (3, 4)
    assert info.tokens_per_block == 0
    assert info.sw_size_tokens == -1
    assert info.recurrent_state is False


def test_engine_group_info_accepts_positional_fields_in_spec_order():
    info = EngineGroupInfo(2, (0, 1), 256, 128)
    assert (
        info.engine_group_id,
        info.layer_indices,
        info.tokens_per_block,
        info.sw_size_tokens,
    ) == (2, (0, 1), 256, 128)


def test_engine_group_info_is_immutable_and_hashable():
    info = EngineGroupInfo(engine_group_id=0, layer_indices=(0,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.engine_group_id = 1  # type: ignore[misc]
    assert hash(info) == hash(EngineGroupInfo(engine_group_id=0, layer_indices=[0]))
    assert info == EngineGroupInfo(engine_group_id=0, layer_indices=[0])


def test_engine_group_info_accepts_numpy_integers():
    info = EngineGroupInfo(engine_group_id=np.int64(1), layer_indices=np.arange(3))
    assert info.layer_indices == (0, 1, 2)
    assert type(info.layer_indices[0]) is int


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"engine_group_id": -1}, "engine_group_id"),
        ({"tokens_per_block": -4}, "tokens_per_block"),
        ({"sw_size_tokens": 0}, "sw_size_tokens"),
        ({"sw_size_tokens": -2}, "sw_size_tokens"),
    ],
)
def test_engine_group_info_rejects_bad_values(kwargs, match):
    base = {"engine_group_id": 0, "layer_indices": (0,)}
    with pytest.raises(KVGroupsValueError, match=match):
        EngineGroupInfo(**{**base, **kwargs})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"engine_group_id": "0"},
        {"layer_indices": "01"},
        {"layer_indices": (0.5,)},
        {"tokens_per_block": 1.5},
        {"layer_indices": (True,)},
    ],
)
def test_engine_group_info_rejects_bad_types(kwargs):
    base = {"engine_group_id": 0, "layer_indices": (0,)}
    with pytest.raises(TypeError):
        EngineGroupInfo(**{**base, **kwargs})


def test_get_engine_group_indices_is_none_without_infos_or_layers():
    assert get_engine_group_indices([], 4) is None
    assert get_engine_group_indices((), 0) is None
    assert (
        get_engine_group_indices([EngineGroupInfo(engine_group_id=0, layer_indices=())], 0) is None
    )


def test_get_engine_group_indices_marks_unmentioned_layers_excluded():
    infos = [
        EngineGroupInfo(engine_group_id=0, layer_indices=(0, 2)),
        EngineGroupInfo(engine_group_id=1, layer_indices=(1,)),
    ]
    assert get_engine_group_indices(infos, 4) == [0, 1, 0, -1]


@pytest.mark.parametrize("layer", [4, 10, -1])
def test_get_engine_group_indices_rejects_layers_outside_range(layer):
    infos = [EngineGroupInfo(engine_group_id=0, layer_indices=(0, layer))]
    with pytest.raises(ValueError, match="outside registered layer range"):
        get_engine_group_indices(infos, 4)


def test_expand_engine_block_ids_copies_each_kernel_groups_engine_group_list():
    infos = [
        EngineGroupInfo(engine_group_id=1, layer_indices=(0,)),
        EngineGroupInfo(engine_group_id=0, layer_indices=(1,)),
        EngineGroupInfo(engine_group_id=1, layer_indices=(2,)),
    ]
    per_engine = [[10, 11], [20, 21, 22]]
    out = expand_engine_block_ids(infos, per_engine)
    assert out == [[20, 21, 22], [10, 11], [20, 21, 22]]
    assert out[0] is not per_engine[1]
    assert out[0] is not out[2]


def test_expand_engine_block_ids_treats_a_flat_list_as_the_single_groups():
    infos = [
        EngineGroupInfo(engine_group_id=0, layer_indices=(0,)),
        EngineGroupInfo(engine_group_id=0, layer_indices=(1,)),
    ]
    assert expand_engine_block_ids(infos, [5, 6, 7]) == [[5, 6, 7], [5, 6, 7]]
    assert expand_engine_block_ids(infos, np.array([5, 6])) == [[5, 6], [5, 6]]


def test_expand_engine_block_ids_without_infos_is_one_kernel_group():
    assert expand_engine_block_ids([], [1, 2]) == [[1, 2]]
    assert expand_engine_block_ids([], [[1, 2], [3]]) == [[1, 2]]


def test_expand_engine_block_ids_with_no_ids_gives_empty_lists():
    infos = [
        EngineGroupInfo(engine_group_id=0, layer_indices=(0,)),
        EngineGroupInfo(engine_group_id=1, layer_indices=(1,)),
    ]
    assert expand_engine_block_ids(infos, []) == [[], []]


def test_expand_engine_block_ids_accepts_a_mapping():
    infos = [EngineGroupInfo(engine_group_id=2, layer_indices=(0,))]
    assert expand_engine_block_ids(infos, {2: [9, 8]}) == [[9, 8]]


def test_expand_engine_block_ids_names_a_missing_engine_group():
    infos = [EngineGroupInfo(engine_group_id=1, layer_indices=(0,))]
    with pytest.raises(KVGroupsValueError, match="engine group 1"):
        expand_engine_block_ids(infos, [[1, 2]])
    with pytest.raises(KVGroupsValueError, match="engine group 1"):
        expand_engine_block_ids(infos, [1, 2])
    with pytest.raises(KVGroupsValueError, match="engine group 1"):
        expand_engine_block_ids(infos, {0: [1]})


def test_slice_block_ids_per_group_divides_the_token_range_by_each_groups_tokens_per_block():
    allocated = {0: list(range(100, 108)), 1: [200, 201]}
    out = slice_block_ids_per_group(allocated, [64, 256], 0, 256)
    assert out == [[100, 101, 102, 103], [200]]
    assert slice_block_ids_per_group(allocated, [64, 256], 256, 512) == [
        [104, 105, 106, 107],
        [201],
    ]


def test_slice_block_ids_per_group_gives_an_empty_list_for_a_missing_group():
    assert slice_block_ids_per_group({1: [7, 8]}, [16, 16, 16], 0, 32) == [[], [7, 8], []]


def test_slice_block_ids_per_group_accepts_numpy_ids():
    out = slice_block_ids_per_group({0: np.arange(10)}, [2], 4, 8)
    assert out == [[2, 3]]
    assert all(type(b) is int for b in out[0])


@pytest.mark.parametrize("start, end", [(32, 256), (0, 100), (16, 48)])
def test_slice_block_ids_per_group_rejects_unaligned_bounds(start, end):
    with pytest.raises(ValueError, match="does not align"):
        slice_block_ids_per_group({0: list(range(8))}, [16, 64], start, end)


def test_slice_block_ids_per_group_rejects_nonpositive_tokens_per_block():
    with pytest.raises(KVGroupsValueError, match="tokens_per_block_per_group"):
        slice_block_ids_per_group({0: [1]}, [0], 0, 0)


def test_slice_block_ids_per_group_rejects_a_reversed_range():
    with pytest.raises(KVGroupsValueError, match="start_tok"):
        slice_block_ids_per_group({0: [1, 2]}, [16], 32, 16)


def test_slice_block_ids_per_group_rejects_non_integer_bounds():
    with pytest.raises(KVGroupsTypeError, match="end_tok"):
        slice_block_ids_per_group({0: [1, 2]}, [16], 0, 16.0)


@pytest.mark.parametrize("flag", [np.array([1, 2]), 1, None, np.True_])
def test_engine_group_info_takes_recurrent_state_only_as_a_bool(flag):
    with pytest.raises(KVGroupsTypeError, match="recurrent_state: expected a bool"):
        EngineGroupInfo(engine_group_id=0, layer_indices=[0], recurrent_state=flag)


@pytest.mark.parametrize(
    "allocated, tpb, end, text",
    [
        ({True: 5}, [4, 4], 0, "engine group id key"),  # True would look up group 1
        ({1: "abc"}, [4, 4], 16, "allocated[1]: expected a sequence of block ids"),
        ({0: 5}, [4], 4, "allocated[0]"),
        ({0: [1, 2.5]}, [4], 8, "allocated[0][1]"),
        ({0: [1, True]}, [4], 8, "allocated[0][1]"),
        ([[1, 2]], [4], 8, "allocated: expected a mapping"),
        ({0: [1, 2]}, None, 8, "tokens_per_block_per_group: expected a sequence"),
    ],
)
def test_slice_block_ids_per_group_names_a_malformed_argument(allocated, tpb, end, text):
    with pytest.raises(KVGroupsTypeError) as info:
        slice_block_ids_per_group(allocated, tpb, 0, end)
    assert text in str(info.value)
