import dataclasses
import subprocess
import sys

import numpy as np
import pytest

import kvgroups_core
from kvgroups_core import (
    DTYPE_MAP,
    EXCLUDED_ENGINE_GROUP,
    EngineKVFormat,
    KernelGroupIdentity,
    KernelGroupInfo,
    KVGroupsTypeError,
    ObjectGroupInfo,
    PageBufferShapeDesc,
    TensorSpec,
    group_layers_by_identity,
)
from kvgroups_core.grouping import identity as grouping

F = EngineKVFormat


def kv_layer(nh=8, dtype="float16", nb=8, bs=16, hs=64):
    return TensorSpec((2, nb, bs, nh, hs), dtype)


def test_identity_fields_are_in_spec_order():
    assert KernelGroupIdentity._fields == (
        "kv_size",
        "num_heads",
        "head_size",
        "block_size",
        "engine_group_idx",
        "dtype",
        "engine_kv_format",
    )


def test_excluded_engine_group_is_minus_one():
    assert EXCLUDED_ENGINE_GROUP == -1


def test_five_layers_by_heads_and_dtype_make_four_groups():
    caches = [
        kv_layer(8, "float16"),
        kv_layer(8, "float32"),
        kv_layer(16, "float16"),
        kv_layer(8, "float16"),
        kv_layer(16, "float32"),
    ]
    groups = group_layers_by_identity(caches, [F.NL_X_TWO_NB_BS_NH_HS] * 5)
    assert [layers for _, layers in groups] == [[0, 3], [1], [2], [4]]
    identity = groups[0][0]
    assert identity == KernelGroupIdentity(
        kv_size=2,
        num_heads=8,
        head_size=64,
        block_size=16,
        engine_group_idx=0,
        dtype=DTYPE_MAP["float16"],
        engine_kv_format=F.NL_X_TWO_NB_BS_NH_HS,
    )
    assert identity.dtype == DTYPE_MAP["float16"]
    assert hash(identity) == hash(tuple(identity))


def test_a_single_format_is_repeated_for_every_layer():
    caches = [kv_layer(8), kv_layer(16), kv_layer(8)]
    groups = group_layers_by_identity(caches, F.NL_X_TWO_NB_BS_NH_HS)
    assert [layers for _, layers in groups] == [[0, 2], [1]]


def test_identical_shapes_in_different_engine_groups_are_different_groups():
    caches = [kv_layer()] * 4
    groups = group_layers_by_identity(caches, [F.NL_X_TWO_NB_BS_NH_HS] * 4, [0, 1, 0, 1])
    assert [layers for _, layers in groups] == [[0, 2], [1, 3]]
    assert [ident.engine_group_idx for ident, _ in groups] == [0, 1]


def test_excluded_layers_are_left_out_and_never_read():
    # Layer 1 is not even a valid tensor for its format: excluded layers are not read.
    caches = [kv_layer(), TensorSpec((3,), "float16"), kv_layer()]
    groups = group_layers_by_identity(caches, [F.NL_X_TWO_NB_BS_NH_HS] * 3, [0, -1, 0])
    assert [layers for _, layers in groups] == [[0, 2]]


def test_excluded_layers_may_be_none_placeholders():
    groups = group_layers_by_identity(
        [kv_layer(), None, kv_layer()], F.NL_X_TWO_NB_BS_NH_HS, [0, -1, 0]
    )
    assert [layers for _, layers in groups] == [[0, 2]]


def test_numpy_arrays_are_grouped_like_their_specs():
    arrays = [np.zeros((2, 4, 16, 2, 8), np.float16), np.zeros((2, 4, 16, 2, 8), np.float32)]
    groups = group_layers_by_identity(arrays, F.NL_X_TWO_NB_BS_NH_HS)
    assert [ident.dtype.name for ident, _ in groups] == ["float16", "float32"]


def test_every_layer_excluded_gives_no_groups():
    groups = group_layers_by_identity([kv_layer()] * 2, [F.NL_X_TWO_NB_BS_NH_HS] * 2, [-1, -1])
    assert groups == []


def test_length_mismatch_names_per_layer_engine_group_idx():
    with pytest.raises(ValueError, match="per_layer_engine_group_idx"):
        group_layers_by_identity([kv_layer()] * 3, [F.NL_X_TWO_NB_BS_NH_HS] * 3, [0, 0])


def test_per_layer_engine_group_idx_rejects_non_integers_and_below_minus_one():
    with pytest.raises(KVGroupsTypeError, match=r"per_layer_engine_group_idx\[1\]"):
        group_layers_by_identity([kv_layer()] * 2, F.NL_X_TWO_NB_BS_NH_HS, [0, "a"])
    with pytest.raises(ValueError, match=r"per_layer_engine_group_idx\[0\]"):
        group_layers_by_identity([kv_layer()] * 2, F.NL_X_TWO_NB_BS_NH_HS, [-2, 0])


def test_nhd_and_hnd_with_equal_geometry_are_different_groups():
    # NH == BS, so the shapes are equal; the format alone tells them apart.
    caches = [TensorSpec((2, 8, 16, 16, 64), "float16")] * 2
    groups = group_layers_by_identity(caches, [F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS])
    assert [layers for _, layers in groups] == [[0], [1]]
    assert groups[0][0][:6] == groups[1][0][:6]


def test_mla_layers_have_kv_size_one_and_one_head():
    caches = [TensorSpec((8, 64, 576), "bfloat16")] * 2
    ((identity, layers),) = group_layers_by_identity(caches, F.NL_X_NB_BS_HS)
    assert (identity.kv_size, identity.num_heads, identity.head_size, identity.block_size) == (
        1,
        1,
        576,
        64,
    )
    assert layers == [0, 1]


def test_indexer_cache_is_its_own_group_beside_the_mla_cache():
    caches = [TensorSpec((8, 64, 576), "bfloat16")] * 2 + [TensorSpec((8, 64, 132), "uint8")] * 2
    formats = [F.NL_X_NB_BS_HS] * 2 + [F.NL_X_NB_BSV_BSS] * 2
    groups = group_layers_by_identity(caches, formats)
    assert [layers for _, layers in groups] == [[0, 1], [2, 3]]
    indexer = groups[1][0]
    assert (indexer.kv_size, indexer.num_heads, indexer.head_size) == (1, 1, 132)
    assert indexer.dtype.itemsize == 1


def test_packed_formats_use_cs_as_head_size():
    caches = [TensorSpec((8, 16, 4, 256), "float16")]
    ((identity, _),) = group_layers_by_identity(caches, F.NL_X_NB_BS_NH_CS)
    assert (identity.kv_size, identity.num_heads, identity.head_size) == (1, 4, 256)


def test_cross_layer_tensor_groups_all_its_layers():
    tensor = TensorSpec((8, 5, 2, 16, 4, 64), "float16")
    ((identity, layers),) = group_layers_by_identity(tensor, F.NB_NL_TWO_BS_NH_HS)
    assert layers == [0, 1, 2, 3, 4]
    assert (identity.kv_size, identity.num_heads, identity.head_size, identity.block_size) == (
        2,
        4,
        64,
        16,
    )


def test_sglang_k_and_v_lists_group_by_layer():
    k = [TensorSpec((8, 16, 4, 64), "float16")] * 3
    v = [TensorSpec((8, 16, 4, 64), "float16")] * 3
    ((identity, layers),) = group_layers_by_identity([k, v], F.TWO_X_NL_X_NB_BS_NH_HS)
    assert layers == [0, 1, 2]
    assert identity.kv_size == 2


def test_groups_are_sorted_by_first_layer():
    caches = [kv_layer(16), kv_layer(8), kv_layer(16), kv_layer(4), kv_layer(8)]
    groups = group_layers_by_identity(caches, F.NL_X_TWO_NB_BS_NH_HS)
    assert [layers for _, layers in groups] == [[0, 2], [1, 4], [3]]


def test_page_buffer_shape_desc_is_frozen_keyword_only_with_defaults():
    desc = PageBufferShapeDesc(kv_size=2, nl=3, nb=8, bs=16, nh=4, hs=64, element_size=2)
    assert desc.block_stride_elems == 0
    assert desc.dtype is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        desc.nl = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        PageBufferShapeDesc(2, 3, 8, 16, 4, 64, 2)  # type: ignore[misc]
    assert hash(desc) == hash(dataclasses.replace(desc))


def _info(tokens_per_block=0, bs=16, nh=4, hs=64):
    desc = PageBufferShapeDesc(
        kv_size=2, nl=3, nb=8, bs=bs, nh=nh, hs=hs, element_size=2, dtype=DTYPE_MAP["float16"]
    )
    return KernelGroupInfo(
        layer_indices=[2, 3, 4],
        shape_desc=desc,
        dtype=DTYPE_MAP["float16"],
        tokens_per_block=tokens_per_block,
    )


def test_kernel_group_info_derived_members():
    info = _info(tokens_per_block=64, bs=16)
    assert info.num_layers == 3
    assert info.hidden_dim_size == 4 * 64
    assert info.slots_per_block == 16
    assert info.compress_ratio == 4
    assert info.calculate_slots(256) == 64
    assert info.engine_kv_format is None
    assert info.engine_group_idx == 0
    assert info.sw_size_tokens == -1


def test_kernel_group_info_with_unknown_tokens_per_block_is_uncompressed():
    info = _info(tokens_per_block=0)
    assert info.calculate_slots(256) == 256
    assert info.compress_ratio == 1


def test_kernel_group_info_repr_is_readable():
    text = repr(_info(tokens_per_block=64))
    assert text.startswith("KernelGroupInfo(layers=3, indices=2-4")
    for part in (
        "kv=2",
        "nl=3",
        "nb=8",
        "bs=16",
        "nh=4",
        "hs=64",
        "element_size=2",
        "dtype=float16",
        "tokens_per_block=64",
        "slots_per_block=16",
        "sw_size_tokens=-1",
    ):
        assert part in text


def test_object_group_info_defaults_to_full_attention():
    group = ObjectGroupInfo(kernel_group_indices=[0, 2])
    assert group.kernel_group_indices == [0, 2]
    assert group.sw_size_chunks == -1


@pytest.mark.parametrize(
    "old, new", [("LayerGroupIdentity", KernelGroupIdentity), ("KVLayerGroupInfo", KernelGroupInfo)]
)
def test_deprecated_aliases_warn_from_the_module_and_the_package(old, new):
    with pytest.warns(DeprecationWarning, match=old):
        assert getattr(grouping, old) is new
    with pytest.warns(DeprecationWarning, match=old):
        assert getattr(kvgroups_core, old) is new


def test_deprecated_alias_import_statement_warns():
    with pytest.warns(DeprecationWarning):
        from kvgroups_core.grouping.identity import LayerGroupIdentity  # noqa: F401


def test_importing_the_package_does_not_warn():
    code = "import kvgroups_core, kvgroups_core.grouping.identity; from kvgroups_core import *"
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True)


def test_unknown_module_attribute_still_raises_attribute_error():
    with pytest.raises(AttributeError):
        grouping.NoSuchName  # noqa: B018
    with pytest.raises(AttributeError):
        kvgroups_core.NoSuchName  # noqa: B018
