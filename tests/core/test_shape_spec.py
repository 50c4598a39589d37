import pytest

from kvgroups_core import (
    DTYPE_MAP,
    EngineKVFormat,
    KernelGroupInfo,
    KVGroupsValueError,
    PageBufferShapeDesc,
    format_kvcache_shape_spec,
    manager_from_shape_spec,
    parse_kvcache_shape_spec,
)
from kvgroups_core.grouping.shape_spec import SPEC_DTYPES

F = EngineKVFormat


def test_parse_one_group():
    (group,) = parse_kvcache_shape_spec("(2,1024,16,8,128):float16:32")
    assert isinstance(group, KernelGroupInfo)
    assert group.layer_indices == list(range(32))
    assert group.shape_desc == PageBufferShapeDesc(
        kv_size=2,
        nl=32,
        nb=1024,
        bs=16,
        nh=8,
        hs=128,
        element_size=2,
        block_stride_elems=0,
        dtype=DTYPE_MAP["float16"],
    )
    assert group.dtype == DTYPE_MAP["float16"]
    assert group.engine_kv_format is None
    assert group.tokens_per_block == 0


def test_parse_assigns_layers_consecutively_across_groups():
    groups = parse_kvcache_shape_spec("(2,1024,16,8,128):float16:30;(1,1024,16,4,64):bfloat16:2")
    assert [g.layer_indices for g in groups] == [list(range(30)), [30, 31]]
    assert groups[1].dtype == DTYPE_MAP["bfloat16"]
    assert groups[1].shape_desc.kv_size == 1


def test_parse_is_case_insensitive_and_ignores_whitespace_and_blank_groups():
    groups = parse_kvcache_shape_spec(
        " ( 2, 8, 16, 8, 128 ):BFloat16: 3 ;; ;(1,8,16,1,576):UINT8:1;"
    )
    assert [g.dtype.name for g in groups] == ["bfloat16", "uint8"]
    assert groups[0].shape_desc.nh == 8
    assert groups[1].layer_indices == [3]


@pytest.mark.parametrize("name", SPEC_DTYPES)
def test_parse_accepts_every_spec_dtype(name):
    (group,) = parse_kvcache_shape_spec(f"(2,8,16,8,128):{name}:1")
    assert group.dtype == DTYPE_MAP[name]
    assert group.shape_desc.element_size == DTYPE_MAP[name].itemsize


def test_spec_dtypes_are_exactly_the_six_of_the_spec():
    assert set(SPEC_DTYPES) == {
        "float16",
        "bfloat16",
        "float32",
        "uint8",
        "float8_e4m3fn",
        "float8_e5m2",
    }


@pytest.mark.parametrize("name", ["float64", "int8", "fp16", "half", "bf16", "bool"])
def test_parse_rejects_other_dtypes(name):
    with pytest.raises(ValueError, match="Unrecognized dtype"):
        parse_kvcache_shape_spec(f"(2,8,16,8,128):{name}:1")


@pytest.mark.parametrize(
    "spec, match",
    [
        ("", "cannot be empty"),
        ("2,8,16,8,128):float16:1", "Invalid group spec"),
        ("(2,8,16,8,128)float16:1", "Invalid group spec"),
        ("(2,8,16,8,128):float16", "Invalid group spec"),
        ("(2,8,16,8,128):float16:1:2", "Invalid group spec"),
        ("(2,8,16,8,128):float64:x", "Unrecognized dtype"),
        ("(2,8,16,8,x):float16:1", "Invalid number"),
        ("(2,8,16,8,128):float16:one", "Invalid number"),
        ("(2,8,16,8):float16:x", "Invalid number"),
        ("(2,8,16,8):float16:1", "Shape must be a 5-tuple"),
        ("(2,8,16,8,128,1):float16:1", "Shape must be a 5-tuple"),
        ("(2,8,16,8,128):float16:0", "must be positive"),
        ("(2,8,16,8,128):float16:-3", "must be positive"),
        ("(2,-8,16,8,128):float16:1", "Invalid number"),
        (";", "No valid layer groups"),
        ("  ", "No valid layer groups"),
        ("(2,8,16,8,128):float16:1;bad", "Invalid group spec"),
    ],
)
def test_parse_errors_in_the_spec_order(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_kvcache_shape_spec(spec)


def test_parse_errors_are_kvgroups_value_errors():
    with pytest.raises(KVGroupsValueError):
        parse_kvcache_shape_spec("")


def test_parse_rejects_non_strings():
    with pytest.raises(TypeError):
        parse_kvcache_shape_spec(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "spec",
    [
        "(2,1024,16,8,128):float16:32",
        "(2,1024,16,8,128):float16:30;(1,1024,16,4,64):bfloat16:2",
        "(2,1024,16,8,128):uint8:32",
        "(1,64,64,1,132):uint8:61;(1,64,64,1,576):float8_e4m3fn:61;(2,9,3,2,4):float8_e5m2:1",
    ],
)
def test_format_is_the_inverse_of_parse(spec):
    assert format_kvcache_shape_spec(parse_kvcache_shape_spec(spec)) == spec


def test_format_writes_no_whitespace_and_lowercase_dtypes():
    groups = parse_kvcache_shape_spec(" (2, 8, 16, 8, 128):Float32 : 4 ")
    assert format_kvcache_shape_spec(groups) == "(2,8,16,8,128):float32:4"


def test_format_rejects_an_empty_list():
    with pytest.raises(ValueError, match="empty"):
        format_kvcache_shape_spec([])


def test_format_rejects_a_dtype_the_parser_does_not_know():
    desc = PageBufferShapeDesc(kv_size=2, nl=1, nb=8, bs=16, nh=8, hs=128, element_size=8)
    group = KernelGroupInfo(layer_indices=[0], shape_desc=desc, dtype=DTYPE_MAP["float64"])
    with pytest.raises(KVGroupsValueError, match="float64"):
        format_kvcache_shape_spec([group])


def test_manager_from_spec_uses_split_kv_tensors_for_kv_size_two():
    m = manager_from_shape_spec("(2,1024,16,8,128):bfloat16:32")
    (group,) = m.kernel_groups
    assert group.engine_kv_format is F.NL_X_TWO_NB_BS_NH_HS
    assert (
        group.shape_desc.nb,
        group.shape_desc.bs,
        group.shape_desc.nh,
        group.shape_desc.hs,
        group.shape_desc.nl,
    ) == (1024, 16, 8, 128, 32)
    assert m.get_slots_per_chunk_in_sw(0) == 256


def test_manager_from_spec_uses_mla_tensors_for_one_head_kv_size_one():
    m = manager_from_shape_spec("(1,64,64,1,576):bfloat16:61")
    (group,) = m.kernel_groups
    assert group.engine_kv_format is F.NL_X_NB_BS_HS
    assert (group.shape_desc.kv_size, group.shape_desc.nh, group.shape_desc.hs) == (1, 1, 576)


def test_manager_from_spec_uses_packed_tensors_for_multi_head_kv_size_one():
    m = manager_from_shape_spec("(1,64,16,4,64):float16:2")
    (group,) = m.kernel_groups
    assert group.engine_kv_format is F.NL_X_NB_BS_NH_CS
    assert (group.shape_desc.kv_size, group.shape_desc.nh, group.shape_desc.hs) == (1, 4, 64)


def test_manager_from_spec_merges_equal_geometry_without_windows():
    m = manager_from_shape_spec(
        "(2,8,16,8,128):float16:2;(2,8,16,4,128):float16:1;(2,8,16,8,128):float16:2"
    )
    assert [g.layer_indices for g in m.kernel_groups] == [[0, 1, 3, 4], [2]]


def test_manager_from_spec_with_windows_keeps_each_spec_group_apart():
    m = manager_from_shape_spec(
        "(2,8,16,16,128):bfloat16:5;(2,8,16,16,128):bfloat16:1", sw_size_tokens=[1024, -1]
    )
    assert [g.layer_indices for g in m.kernel_groups] == [[0, 1, 2, 3, 4], [5]]
    assert [g.sw_size_tokens for g in m.kernel_groups] == [1024, -1]
    assert m.get_attn_desc().num_chunks_in_sw == [4, -1]


def test_manager_from_spec_with_tokens_per_block():
    m = manager_from_shape_spec(
        "(1,8,64,1,64):float16:1;(1,8,2,1,64):float16:1", tokens_per_block=[256, 256]
    )
    assert [m.get_slots_per_chunk_in_sw(k) for k in range(2)] == [64, 2]


def test_manager_from_spec_accepts_parsed_groups_and_options():
    groups = parse_kvcache_shape_spec("(2,8,16,8,128):float16:2")
    m = manager_from_shape_spec(groups, lmcache_tokens_per_chunk=64, separate_object_groups=False)
    assert m.lmcache_tokens_per_chunk == 64
    assert m.get_slots_per_chunk_in_sw(0) == 64


def test_manager_from_spec_rejects_a_per_group_list_of_the_wrong_length():
    with pytest.raises(KVGroupsValueError, match="sw_size_tokens"):
        manager_from_shape_spec(
            "(2,8,16,8,128):float16:2;(2,8,16,4,128):float16:1", sw_size_tokens=[1, 2, 3]
        )


@pytest.mark.parametrize(
    "spec, match",
    [
        ("(3,8,16,8,128):float16:1", "kv_size"),
        ("(2,0,16,8,128):float16:1", "nb"),
        ("(1,8,0,1,64):float16:1", "bs"),
    ],
)
def test_manager_from_spec_rejects_impossible_geometry(spec, match):
    with pytest.raises(KVGroupsValueError, match=match):
        manager_from_shape_spec(spec)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("(2,4,16,8,128):float16:1000000000000", "Layer count too large"),
        ("(2,4,16,8,128):float16:40000;(2,4,16,8,128):float16:40000", "Layer count too large"),
        ("(2," + "9" * 4000 + ",16,8,128):float16:2", "Invalid number"),
        ("(2,9223372036854775808,16,8,128):float16:2", "below 2\\*\\*63"),
    ],
)
def test_specs_past_the_bounds_are_refused_cheaply(spec, match):
    # Refused before any list is built (a 10**12-layer spec raised MemoryError) and with a
    # message that can be printed (no 4,000-digit number in it).
    with pytest.raises(KVGroupsValueError, match=match) as info:
        parse_kvcache_shape_spec(spec)
    assert len(str(info.value)) < 400
