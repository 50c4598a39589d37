import statistics
import time

import numpy as np
import pytest

from kvgroups_core import (
    DTYPE_MAP,
    AttnWindowDesc,
    EngineGroupInfo,
    EngineKVFormat,
    KernelGroupInfo,
    KVGroupsIndexError,
    KVGroupsTypeError,
    KVGroupsValueError,
    KVLayerGroupsManager,
    PageBufferShapeDesc,
    TensorSpec,
    describe,
)

F = EngineKVFormat
NHD = F.NL_X_TWO_NB_BS_NH_HS


def kv_layer(nh=8, dtype="float16", nb=8, bs=16, hs=64):
    return TensorSpec((2, nb, bs, nh, hs), dtype)


def info(gid, layers, tpb=0, sw=-1):
    return EngineGroupInfo(
        engine_group_id=gid, layer_indices=tuple(layers), tokens_per_block=tpb, sw_size_tokens=sw
    )


# --- empty managers --------------------------------------------------------------------


@pytest.mark.parametrize("caches, formats", [([], []), ([], NHD), ((), ())])
def test_no_layers_gives_an_empty_manager(caches, formats):
    m = KVLayerGroupsManager(caches, formats)
    assert m.kernel_groups == [] and m.num_kernel_groups == 0
    assert m.object_groups == [] and m.num_object_groups == 0
    assert m.num_blocks == 0
    assert m.get_attn_desc() == AttnWindowDesc([])
    assert m.layer_layouts == []


def test_every_layer_excluded_gives_an_empty_manager():
    m = KVLayerGroupsManager([kv_layer()] * 3, NHD, [info(0, [])])
    assert m.num_kernel_groups == 0 and m.num_object_groups == 0
    assert m.layer_layouts == [None, None, None]


# --- worked examples of docs/SEMANTICS.md section 3 --------------------------------------


def test_five_layers_by_heads_and_dtype():
    caches = [
        kv_layer(8, "float16"),
        kv_layer(8, "float32"),
        kv_layer(16, "float16"),
        kv_layer(8, "float16"),
        kv_layer(16, "float32"),
    ]
    m = KVLayerGroupsManager(caches, [NHD] * 5)
    assert [g.layer_indices for g in m.kernel_groups] == [[0, 3], [1], [2], [4]]
    assert m.num_kernel_groups == 4
    assert [(g.kernel_group_indices, g.sw_size_chunks) for g in m.object_groups] == [
        ([0, 1, 2, 3], -1)
    ]
    g0 = m.kernel_groups[0]
    assert g0.shape_desc == PageBufferShapeDesc(
        kv_size=2,
        nl=2,
        nb=8,
        bs=16,
        nh=8,
        hs=64,
        element_size=2,
        block_stride_elems=0,
        dtype=DTYPE_MAP["float16"],
    )
    assert g0.dtype == DTYPE_MAP["float16"]
    assert g0.engine_kv_format is NHD
    assert g0.tokens_per_block == 16
    assert m.kernel_groups[1].shape_desc.element_size == 4


def test_identical_layers_split_by_engine_group_infos():
    m = KVLayerGroupsManager([kv_layer()] * 4, NHD, [info(0, [0, 2]), info(1, [1, 3])])
    assert [g.layer_indices for g in m.kernel_groups] == [[0, 2], [1, 3]]
    assert [g.engine_group_idx for g in m.kernel_groups] == [0, 1]


def test_sub_chunk_windows_and_slots_per_chunk_in_window():
    caches = [kv_layer(8, bs=32), kv_layer(16, bs=32), kv_layer(32, bs=32)]
    infos = [info(0, [0], sw=-1), info(0, [1], sw=64), info(0, [2], sw=512)]
    m = KVLayerGroupsManager(caches, NHD, infos, lmcache_tokens_per_chunk=256)
    assert [m.get_subchunk_sw_size_tokens(k) for k in range(3)] == [256, 64, 256]
    assert [m.get_slots_per_chunk_in_sw(k) for k in range(3)] == [256, 64, 256]
    assert [(g.kernel_group_indices, g.sw_size_chunks) for g in m.object_groups] == [
        ([0], -1),
        ([1], 1),
        ([2], 2),
    ]
    assert m.get_attn_desc().num_chunks_in_sw == [-1, 1, 2]


def _v4_like():
    caches = [
        TensorSpec((2, 8, 64, 1, 64), "float16"),
        TensorSpec((2, 8, 2, 1, 64), "float16"),
        TensorSpec((2, 8, 64, 1, 32), "float16"),
        TensorSpec((2, 8, 4, 1, 128), "float32"),
    ]
    infos = [
        info(0, [0], tpb=256),
        info(0, [1], tpb=256),
        info(1, [2], tpb=64),
        info(2, [3], tpb=4),
    ]
    return KVLayerGroupsManager(caches, NHD, infos)


def test_deepseek_v4_like_compression():
    m = _v4_like()
    groups = m.kernel_groups
    assert [g.tokens_per_block // g.slots_per_block for g in groups] == [4, 128, 1, 1]
    assert groups[0].calculate_slots(256) == 64
    assert groups[1].calculate_slots(256) == 2
    assert [m.get_slots_per_chunk_in_sw(k) for k in range(4)] == [64, 2, 256, 256]
    assert [m.calculate_num_blocks(k, 256) for k in range(4)] == [1, 1, 4, 64]
    assert [g.engine_group_idx for g in groups] == [0, 0, 1, 2]


def test_window_not_a_multiple_of_tokens_per_block_is_rejected():
    with pytest.raises(ValueError, match="sliding window"):
        KVLayerGroupsManager(
            [TensorSpec((2, 32, 256, 8, 64), "float16")], NHD, [info(0, [0], sw=64)]
        )


# --- validation, in the spec's order ---------------------------------------------------


def test_info_naming_a_layer_outside_the_range_is_rejected():
    with pytest.raises(ValueError, match="outside registered layer range"):
        KVLayerGroupsManager([kv_layer()] * 2, NHD, [info(0, [0, 1, 2])])


def test_info_count_must_match_kernel_group_count():
    with pytest.raises(ValueError, match="Got 2 engine group infos for 1 kernel groups"):
        KVLayerGroupsManager([kv_layer()] * 2, NHD, [info(0, [0]), info(0, [1])])


def test_info_layers_must_match_their_kernel_groups_layers():
    caches = [kv_layer(8), kv_layer(16), kv_layer(8)]
    with pytest.raises(ValueError, match="engine group info covers layers"):
        KVLayerGroupsManager(caches, NHD, [info(0, [0]), info(0, [1, 2])])


def test_info_layer_order_does_not_matter():
    m = KVLayerGroupsManager([kv_layer()] * 3, NHD, [info(0, [2, 0, 1])])
    assert m.kernel_groups[0].layer_indices == [0, 1, 2]


def test_infos_may_come_in_the_engines_order_not_the_kernel_groups():
    # vLLM lists sliding-window groups before full attention: infos are matched by layers.
    caches = [kv_layer(8), kv_layer(16), kv_layer(8), kv_layer(16)]
    infos = [info(1, [1, 3], sw=64), info(0, [0, 2])]
    m = KVLayerGroupsManager(caches, NHD, infos)
    assert [g.layer_indices for g in m.kernel_groups] == [[0, 2], [1, 3]]
    assert [g.engine_group_idx for g in m.kernel_groups] == [0, 1]
    assert [g.sw_size_tokens for g in m.kernel_groups] == [-1, 64]


def test_tokens_per_block_must_be_a_multiple_of_slots_per_block():
    with pytest.raises(ValueError, match="must be a multiple of slots_per_block"):
        KVLayerGroupsManager([kv_layer(bs=16)], NHD, [info(0, [0], tpb=24)])


def test_chunk_must_be_a_multiple_of_tokens_per_block():
    with pytest.raises(ValueError, match="lmcache_tokens_per_chunk"):
        KVLayerGroupsManager([kv_layer(bs=16)], NHD, lmcache_tokens_per_chunk=100)


def test_tokens_per_block_check_comes_before_the_chunk_check():
    # tpb 24 breaks both rules with chunk 100; the first rule is reported.
    with pytest.raises(ValueError, match="slots_per_block"):
        KVLayerGroupsManager(
            [kv_layer(bs=16)], NHD, [info(0, [0], tpb=24)], lmcache_tokens_per_chunk=100
        )


def test_chunk_check_comes_before_the_window_check():
    with pytest.raises(ValueError, match="lmcache_tokens_per_chunk"):
        KVLayerGroupsManager(
            [kv_layer(bs=16)], NHD, [info(0, [0], sw=8)], lmcache_tokens_per_chunk=100
        )


def test_info_count_check_comes_before_per_group_validation():
    with pytest.raises(ValueError, match="engine group infos"):
        KVLayerGroupsManager([kv_layer(bs=16)] * 2, NHD, [info(0, [0], tpb=24), info(0, [1])])


def test_coverage_check_comes_before_per_group_validation():
    caches = [kv_layer(8), kv_layer(16)]
    with pytest.raises(ValueError, match="covers layers"):
        KVLayerGroupsManager(caches, NHD, [info(0, [0], tpb=24), info(0, [0, 1])])


def test_windows_at_or_beyond_a_chunk_need_not_align_to_tokens_per_block():
    m = KVLayerGroupsManager([kv_layer(bs=16)], NHD, [info(0, [0], sw=1000)])
    assert m.get_subchunk_sw_size_tokens(0) == 256
    assert m.object_groups[0].sw_size_chunks == 4


def test_layers_of_one_group_with_different_block_counts_are_rejected():
    with pytest.raises(KVGroupsValueError, match="geometry"):
        KVLayerGroupsManager([kv_layer(nb=8), kv_layer(nb=9)], NHD)


def test_engine_groups_keep_their_own_block_counts():
    m = KVLayerGroupsManager([kv_layer(nb=8), kv_layer(nb=12)], NHD, [info(0, [0]), info(1, [1])])
    assert [g.shape_desc.nb for g in m.kernel_groups] == [8, 12]
    assert m.num_blocks == 8


@pytest.mark.parametrize("chunk", [0, -256])
def test_chunk_must_be_positive(chunk):
    with pytest.raises(KVGroupsValueError, match="lmcache_tokens_per_chunk"):
        KVLayerGroupsManager([kv_layer()], NHD, lmcache_tokens_per_chunk=chunk)


def test_chunk_must_be_an_integer():
    with pytest.raises(KVGroupsTypeError, match="lmcache_tokens_per_chunk"):
        KVLayerGroupsManager([kv_layer()], NHD, lmcache_tokens_per_chunk=256.0)


def test_infos_must_be_engine_group_infos():
    with pytest.raises(KVGroupsTypeError, match=r"engine_group_infos\[0\]"):
        KVLayerGroupsManager([kv_layer()], NHD, [(0, (0,))])


def test_formats_must_be_engine_kv_formats():
    with pytest.raises(KVGroupsTypeError, match=r"engine_kv_formats\[1\]"):
        KVLayerGroupsManager([kv_layer()] * 2, [NHD, 3])


def test_format_names_are_accepted():
    m = KVLayerGroupsManager([kv_layer()] * 2, "NL_X_TWO_NB_BS_NH_HS")
    assert m.engine_kv_formats == (NHD, NHD)


def test_format_count_must_match_the_layer_count():
    with pytest.raises(KVGroupsValueError, match="engine_kv_formats"):
        KVLayerGroupsManager([kv_layer()] * 3, [NHD] * 2)


# --- methods ---------------------------------------------------------------------------


def test_get_shape_desc_and_index_errors():
    m = KVLayerGroupsManager([kv_layer(8), kv_layer(16)], NHD)
    assert m.get_shape_desc(1).nh == 16
    for bad in (2, -1, 100):
        with pytest.raises(IndexError):
            m.get_shape_desc(bad)
        with pytest.raises(KVGroupsIndexError):
            m.get_slots_per_chunk_in_sw(bad)
    with pytest.raises(TypeError):
        m.get_shape_desc("0")
    assert m.get_shape_desc(np.int64(0)).nh == 8


def test_full_sw_kv_mode_stores_whole_chunks_and_reports_full_attention():
    caches = [kv_layer(bs=32), kv_layer(16, bs=32)]
    m = KVLayerGroupsManager(caches, NHD, [info(0, [0], sw=64), info(0, [1], sw=512)])
    assert m.full_sw_kv is False
    assert m.get_attn_desc().num_chunks_in_sw == [1, 2]
    m.enable_full_sw_kv()
    assert m.full_sw_kv is True
    assert [m.get_subchunk_sw_size_tokens(k) for k in range(2)] == [256, 256]
    assert m.get_slots_per_chunk_in_sw(0) == 256
    assert m.get_attn_desc() == AttnWindowDesc([-1, -1])


def test_calculate_num_blocks_rounds_down():
    m = KVLayerGroupsManager([kv_layer(bs=16)], NHD, [info(0, [0], tpb=64)])
    assert m.calculate_num_blocks(0, 256) == 4
    assert m.calculate_num_blocks(0, 100) == 1
    assert m.calculate_num_blocks(0, 0) == 0


def test_separation_off_gives_one_full_attention_object_group():
    caches = [kv_layer(8), kv_layer(16), kv_layer(32)]
    infos = [info(0, [0]), info(0, [1], sw=1024), info(0, [2], sw=64)]
    m = KVLayerGroupsManager(caches, NHD, infos, separate_object_groups=False)
    assert [(g.kernel_group_indices, g.sw_size_chunks) for g in m.object_groups] == [
        ([0, 1, 2], -1)
    ]
    assert m.get_attn_desc().num_chunks_in_sw == [-1]
    assert m.get_subchunk_sw_size_tokens(2) == 64


@pytest.mark.parametrize("flag", [np.array([1, 2]), 0, None, "no"])
def test_separate_object_groups_is_taken_only_as_a_bool(flag):
    with pytest.raises(KVGroupsTypeError, match="separate_object_groups: expected a bool"):
        KVLayerGroupsManager([kv_layer()], NHD, separate_object_groups=flag)


def test_object_groups_bucket_by_window_in_chunks_ordered_by_first_kernel_group():
    caches = [kv_layer(4), kv_layer(8), kv_layer(16), kv_layer(32), kv_layer(64)]
    infos = [
        info(0, [0], sw=1024),
        info(0, [1]),
        info(0, [2], sw=64),
        info(0, [3], sw=800),
        info(0, [4], sw=128),
    ]
    m = KVLayerGroupsManager(caches, NHD, infos)
    assert [(g.kernel_group_indices, g.sw_size_chunks) for g in m.object_groups] == [
        ([0, 3], 4),
        ([1], -1),
        ([2, 4], 1),
    ]
    assert m.get_attn_desc().num_chunks_in_sw == [4, -1, 1]


def test_deprecated_aliases_warn():
    m = KVLayerGroupsManager([kv_layer(8), kv_layer(16)], NHD, [info(0, [0], sw=64), info(0, [1])])
    with pytest.warns(DeprecationWarning, match="kernel_groups"):
        assert m.kv_layer_groups is m.kernel_groups
    with pytest.warns(DeprecationWarning, match="num_kernel_groups"):
        assert m.num_groups == 2
    with pytest.warns(DeprecationWarning, match="get_slots_per_chunk_in_sw"):
        assert m.get_slots_per_chunk(0) == 256
    assert m.get_slots_per_chunk_in_sw(0) == 64


def test_kernel_groups_are_kernel_group_infos():
    m = KVLayerGroupsManager([kv_layer()], NHD)
    assert isinstance(m.kernel_groups[0], KernelGroupInfo)
    assert "KVLayerGroupsManager(kernel_groups=1" in repr(m)


# --- inputs ----------------------------------------------------------------------------


def test_planner_facing_attributes():
    caches = [kv_layer(), kv_layer(), kv_layer()]
    m = KVLayerGroupsManager(caches, NHD, [info(0, [0, 2])], lmcache_tokens_per_chunk=128)
    assert m.engine_kv_formats == (NHD, NHD, NHD)
    assert m.lmcache_tokens_per_chunk == 128
    assert m.layer_layouts[1] is None
    assert m.layer_layouts[0].same_geometry(m.layer_layouts[2])
    assert m.layer_layouts[0].num_blocks == 8


def test_layer_layouts_keep_each_layers_own_tensor():
    caches = [describe(np.zeros((2, 4, 16, 2, 8), np.float16)) for _ in range(3)]
    m = KVLayerGroupsManager(caches, NHD)
    for layer, desc in enumerate(caches):
        planes = m.layer_layouts[layer].planes
        assert [t is desc for t, _ in planes] == [True, True]
        assert [off for _, off in planes] == [0, 4 * 16 * 2 * 8 * 2]


def test_numpy_arrays_and_descriptors_mix_freely():
    caches = [
        np.zeros((2, 4, 16, 2, 8), np.float16),
        kv_layer(2, nb=4, hs=8),
        describe(np.zeros((2, 4, 16, 2, 8), np.float16)),
    ]
    m = KVLayerGroupsManager(caches, NHD)
    assert [g.layer_indices for g in m.kernel_groups] == [[0, 1, 2]]


def test_padded_blocks_set_block_stride_elems():
    inner = 16 * 576
    padded = TensorSpec((8, 16, 576), "bfloat16", strides=(inner + 64, 576, 1))
    m = KVLayerGroupsManager([padded] * 2, F.NL_X_NB_BS_HS)
    assert m.get_shape_desc(0).block_stride_elems == inner + 64
    tight = KVLayerGroupsManager([TensorSpec((8, 16, 576), "bfloat16")], F.NL_X_NB_BS_HS)
    assert tight.get_shape_desc(0).block_stride_elems == 0


def test_padded_and_tight_layers_of_one_identity_are_rejected():
    padded = TensorSpec((8, 16, 576), "bfloat16", strides=(16 * 576 + 64, 576, 1))
    tight = TensorSpec((8, 16, 576), "bfloat16")
    with pytest.raises(KVGroupsValueError, match="geometry"):
        KVLayerGroupsManager([padded, tight], F.NL_X_NB_BS_HS)


def test_cross_layer_tensor_manager():
    tensor = TensorSpec((8, 5, 2, 16, 4, 64), "float16")
    m = KVLayerGroupsManager(tensor, F.NB_NL_TWO_BS_NH_HS)
    assert m.kernel_groups[0].layer_indices == [0, 1, 2, 3, 4]
    assert m.get_shape_desc(0).nl == 5
    offsets = [m.layer_layouts[layer].planes[0][1] for layer in range(5)]
    assert offsets == [layer * 2 * 16 * 4 * 64 * 2 for layer in range(5)]


def test_mixed_mla_and_indexer_formats_in_one_engine_group():
    caches = [TensorSpec((8, 64, 576), "bfloat16")] * 2 + [TensorSpec((8, 64, 132), "uint8")] * 2
    formats = [F.NL_X_NB_BS_HS] * 2 + [F.NL_X_NB_BSV_BSS] * 2
    m = KVLayerGroupsManager(caches, formats, [info(0, [0, 1]), info(0, [2, 3])])
    assert [(g.shape_desc.kv_size, g.shape_desc.nh, g.shape_desc.hs) for g in m.kernel_groups] == [
        (1, 1, 576),
        (1, 1, 132),
    ]
    assert m.num_object_groups == 1


def _mixed_model(num_layers):
    sliding = TensorSpec((2, 4096, 16, 16, 128), "bfloat16")
    mla = TensorSpec((4096, 64, 576), "bfloat16")
    kinds = [2 if i % 8 == 7 else 1 if i % 6 == 5 else 0 for i in range(num_layers)]
    caches = [mla if k == 2 else sliding for k in kinds]
    formats = [F.NL_X_NB_BS_HS if k == 2 else NHD for k in kinds]
    order = sorted(set(kinds), key=kinds.index)
    infos = [
        info(
            k,
            [i for i in range(num_layers) if kinds[i] == k],
            tpb=64 if k == 2 else 0,
            sw=1024 if k == 0 else -1,
        )
        for k in order
    ]
    return caches, formats, infos


def test_construction_of_a_1024_layer_mixed_model_is_fast():
    caches, formats, infos = _mixed_model(1024)
    m = KVLayerGroupsManager(caches, formats, infos)
    assert m.num_kernel_groups == 3 and m.num_object_groups == 2
    times = []
    for _ in range(7):
        start = time.perf_counter()
        KVLayerGroupsManager(caches, formats, infos)
        times.append(time.perf_counter() - start)
    assert statistics.median(times) < 0.050


_LAYER = np.zeros((2, 16, 4, 2, 4), np.float16)  # one layer of NL_X_TWO_NB_BS_NH_HS
_K = np.zeros((16, 4, 2, 4), np.float16)  # one layer's K of TWO_X_NL_X_NB_BS_NH_HS


@pytest.mark.parametrize(
    "kv_caches, fmt, error, message",
    [
        (_LAYER, F.NL_X_TWO_NB_BS_NH_HS, KVGroupsTypeError, "expected a list with one entry"),
        (_LAYER, F.NL_X_TWO_X_NB_BS_NH_HS, KVGroupsTypeError, "expected a list with one entry"),
        (_K, F.TWO_X_NL_X_NB_BS_NH_HS, KVGroupsTypeError, r"expected \[K list, V list\]"),
        ([_K, _K], F.TWO_X_NL_X_NB_BS_NH_HS, KVGroupsValueError, r"got \[a tensor, a tensor\]"),
        ([[_K, _K], [_K]], F.TWO_X_NL_X_NB_BS_NH_HS, KVGroupsValueError, "2 K and 1 V"),
        ([[_K], [_K, _K]], F.TWO_X_NL_X_NB_BS_NH_HS, KVGroupsValueError, "1 K and 2 V"),
        ([[_K], []], F.TWO_X_NL_X_NB_BS_NH_HS, KVGroupsValueError, "1 K and 0 V"),
    ],
)
def test_a_structure_that_is_not_the_formats_is_refused_naming_kv_caches(
    kv_caches, fmt, error, message
):
    # The V list longer than the K list was accepted and its extra layers ignored.
    with pytest.raises(error, match=f"^kv_caches: .*{message}"):
        KVLayerGroupsManager(kv_caches, fmt, lmcache_tokens_per_chunk=8)
