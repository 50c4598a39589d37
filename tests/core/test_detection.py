import ctypes
import math

import numpy as np
import pytest

from kvgroups_core import EngineKVFormat as F
from kvgroups_core import (
    KVGroupsTypeError,
    KVGroupsValueError,
    TensorDesc,
    TensorSpec,
    describe,
    detect_format,
    normalize_and_discover_per_layer_formats,
)
from kvgroups_core.formats.layout import layer_layouts

NB, NL, BS, NH, HS = 7, 5, 3, 2, 4


def encoded(shape, dtype=np.float16, start=0):
    # Position-encoded contents: every element of one array has distinct bytes.
    n = math.prod(shape)
    words = (np.arange(start, start + n) % 65521).astype(np.uint16)
    dtype = np.dtype(dtype)
    if dtype.itemsize == 1:
        return (words % 251).astype(np.uint8).view(dtype).reshape(shape)
    return words.view(dtype).reshape(shape)


def layers(shape, dtype=np.float16, n=NL):
    return [encoded(shape, dtype, start=i * math.prod(shape)) for i in range(n)]


def spec(*shape, dtype="float16"):
    return TensorSpec(shape, dtype)


def page_model_row(layout, kv, block, token):
    tensor, plane_offset = layout.planes[kv]
    start = tensor.address + plane_offset + block * layout.block_stride_bytes
    row = bytearray(layout.row_bytes)
    for run in layout.runs:
        for piece in range(run.count):
            src = start + run.cache_offset + piece * run.cache_step + token * run.token_stride
            dst = run.obj_offset + piece * run.obj_step
            row[dst : dst + run.nbytes] = ctypes.string_at(src, run.nbytes)
    return bytes(row)


def assert_rows(normalized, formats, row, nb=NB, bs=BS, points=None):
    # Page-model bytes of (layer, kv, block, token) equal row(...) from NumPy indexing.
    for layer, layout in enumerate(layer_layouts(normalized, formats)):
        for kv in range(layout.kv_size):
            for b, t in points or [(b, t) for b in range(nb) for t in range(bs)]:
                assert page_model_row(layout, kv, b, t) == row(layer, kv, b, t), (layer, kv, b, t)


def heads(rows):
    return b"".join(np.ascontiguousarray(r).tobytes() for r in rows)


# --- vLLM --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,hints,fmt",
    [
        ((2, NB, BS, NH, HS), None, F.NL_X_TWO_NB_BS_NH_HS),
        ((2, NB, BS, NH, HS), {"kv_layout": "NHD"}, F.NL_X_TWO_NB_BS_NH_HS),
        ((2, NB, NH, BS, HS), {"kv_layout": "HND"}, F.NL_X_TWO_NB_NH_BS_HS),
        ((2, NB, NH, BS, HS), {"kv_layout": "hnd"}, F.NL_X_TWO_NB_NH_BS_HS),
        ((NB, 2, BS, NH, HS), None, F.NL_X_NB_TWO_BS_NH_HS),
        ((NB, 2, NH, BS, HS), {"kv_layout": "HND"}, F.NL_X_NB_TWO_NH_BS_HS),
        ((NB, BS, NH, 2 * HS), None, F.NL_X_NB_BS_NH_CS),
        ((NB, NH, BS, 2 * HS), {"kv_layout": "HND"}, F.NL_X_NB_NH_BS_CS),
        ((NB, BS, HS), None, F.NL_X_NB_BS_HS),
        ((2, NB, NH, 1, BS, HS), None, F.NL_X_TWO_NB_NH_ONE_BS_HS),
    ],
)
def test_vllm_per_layer_lists(shape, hints, fmt):
    got, normalized = detect_format([spec(*shape)] * NL, hints=hints)
    assert got is fmt
    assert len(normalized) == NL
    assert all(isinstance(d, TensorDesc) and d.shape == shape for d in normalized)


def test_vllm_uint8_rows_of_132_bytes_are_the_indexer_cache():
    fmt, _ = detect_format([spec(NB, BS, 132, dtype="uint8")] * NL)
    assert fmt is F.NL_X_NB_BSV_BSS
    assert detect_format([spec(NB, BS, 132)] * NL)[0] is F.NL_X_NB_BS_HS
    assert detect_format([spec(NB, BS, 128, dtype="uint8")] * NL)[0] is F.NL_X_NB_BS_HS


@pytest.mark.parametrize(
    "hints,fmt",
    [
        (None, F.NB_NL_TWO_BS_NH_HS),
        ({"kv_layout": "HND"}, F.NB_NL_TWO_NH_BS_HS),
    ],
)
def test_vllm_bare_rank_6_is_the_cross_layer_layout(hints, fmt):
    got, normalized = detect_format(spec(NB, NL, 2, BS, NH, HS), hints=hints)
    assert got is fmt
    assert isinstance(normalized, TensorDesc)


@pytest.mark.parametrize(
    "hints,fmt",
    [
        ({"tokens_per_block": BS, "kv_layout": "HND"}, F.NL_X_NB_BS_NH_CS),
        ({"num_kv_heads": NH}, F.NL_X_NB_BS_NH_CS),
    ],
)
def test_packed_cs_order_follows_the_axis_matching_the_block_size_or_heads(hints, fmt):
    assert detect_format([spec(NB, BS, NH, 2 * HS)] * NL, hints=hints)[0] is fmt


def test_packed_cs_heads_first_found_from_tokens_per_block():
    fmt, _ = detect_format([spec(NB, NH, BS, 2 * HS)] * NL, hints={"tokens_per_block": BS})
    assert fmt is F.NL_X_NB_NH_BS_CS


def test_packed_cs_with_an_odd_row_is_rejected():
    with pytest.raises(KVGroupsValueError, match=r"kv_caches\[0\].*CS = 2\*HS"):
        detect_format([spec(NB, BS, NH, 9)])


def test_ascend_list_of_k_v_pairs():
    pairs = [(spec(NB, BS, NH, HS), spec(NB, BS, NH, HS)) for _ in range(NL)]
    fmt, normalized = detect_format(pairs)
    assert fmt is F.NL_X_TWO_X_NB_BS_NH_HS
    assert all(isinstance(p, tuple) and len(p) == 2 for p in normalized)
    assert len(layer_layouts(normalized, [fmt] * NL)) == NL


def test_ascend_pair_of_different_shapes_is_rejected():
    with pytest.raises(KVGroupsValueError, match=r"kv_caches\[0\]\[0\] and kv_caches\[0\]\[1\]"):
        detect_format([(spec(NB, BS, NH, HS), spec(NB, BS, NH, 2 * HS))])


@pytest.mark.parametrize(
    "caches,where,expected,actual",
    [
        ([spec(3, 4)], r"kv_caches\[0\]", "rank 3, 4 or 5", r"\(3, 4\)"),
        ([spec(NB, BS, NH, HS)] * 2 + [spec(12)], r"kv_caches\[2\]", "rank 3, 4 or 5", r"\(12,\)"),
        ([spec(3, NB, BS, NH, HS)], r"kv_caches\[0\]", "size 2", r"\(3, 7, 3, 2, 4\)"),
        (spec(2, NB, BS, NH, HS), "kv_caches", "rank-6", r"\(2, 7, 3, 2, 4\)"),
        (spec(NB, BS), "kv_caches", "rank-6", r"\(7, 3\)"),
    ],
)
def test_unreadable_shapes_name_argument_expected_and_actual(caches, where, expected, actual):
    with pytest.raises(KVGroupsValueError, match=f"{where}.*{expected}.*{actual}"):
        detect_format(caches)


def test_errors_are_value_errors():
    with pytest.raises(ValueError):
        detect_format([spec(3, 4)])


def test_empty_structure():
    with pytest.raises(KVGroupsValueError, match="at least one layer"):
        detect_format([])
    assert normalize_and_discover_per_layer_formats([]) == ([], [])


def test_a_dict_of_layers_is_a_type_error():
    with pytest.raises(KVGroupsTypeError, match="values"):
        detect_format({"layer.0": spec(2, NB, BS, NH, HS)})


def test_a_non_tensor_entry_is_a_type_error_naming_it():
    with pytest.raises(KVGroupsTypeError, match=r"kv_caches\[1\]"):
        detect_format([spec(2, NB, BS, NH, HS), 42])


@pytest.mark.parametrize(
    "engine,hints,match",
    [
        ("vllm2", None, "engine"),
        (["vllm"], None, "engine"),
        ("vllm", {"kv_layot": "HND"}, "kv_layot"),
        ("vllm", {"kv_layout": "HDN"}, "kv_layout"),
        ("vllm", {"tokens_per_block": 0}, "tokens_per_block"),
        ("vllm", {"head_dim": 2.5}, "head_dim"),
    ],
)
def test_bad_engine_or_hints(engine, hints, match):
    with pytest.raises(KVGroupsValueError, match=match):
        detect_format([spec(2, NB, BS, NH, HS)], engine=engine, hints=hints)


def test_hints_must_be_a_mapping():
    with pytest.raises(KVGroupsTypeError, match="hints"):
        detect_format([spec(2, NB, BS, NH, HS)], hints=[("kv_layout", "HND")])


# --- inputs: NumPy arrays, bare TensorSpecs, TensorDescs, mixed ----------------------------


def test_numpy_arrays_normalize_to_descs_of_the_same_memory():
    arrays = layers((2, NB, BS, NH, HS))
    fmt, normalized = detect_format(arrays)
    assert fmt is F.NL_X_TWO_NB_BS_NH_HS
    assert [d.data_ptr for d in normalized] == [a.ctypes.data for a in arrays]
    assert_rows(normalized, [fmt] * NL, lambda ly, kv, b, t: arrays[ly][kv, b, t].tobytes())


def test_bare_tensor_specs_need_no_data():
    fmt, normalized = detect_format([spec(NB, 2, BS, NH, HS)] * NL)
    assert fmt is F.NL_X_NB_TWO_BS_NH_HS
    assert all(d.is_abstract for d in normalized)


def test_mixed_numpy_specs_and_descs():
    array = encoded((2, NB, BS, NH, HS))
    caches = [array, spec(2, NB, BS, NH, HS), describe(array), TensorDesc(spec(2, NB, BS, NH, HS))]
    fmt, normalized = detect_format(caches)
    assert fmt is F.NL_X_TWO_NB_BS_NH_HS
    assert all(isinstance(d, TensorDesc) for d in normalized)
    assert normalized[2] is caches[2]


# --- permutation recovery and padding ------------------------------------------------------


@pytest.mark.parametrize("hints", [None, {"kv_layout": "HND"}])
def test_hnd_cache_exposed_as_nhd_view_is_recovered_zero_copy(hints):
    memory = layers((2, NB, NH, BS, HS))
    views = [m.transpose(0, 1, 3, 2, 4) for m in memory]  # logical [2, NB, BS, NH, HS]
    fmt, normalized = detect_format(views, hints=hints)
    assert fmt is F.NL_X_TWO_NB_NH_BS_HS
    for d, m in zip(normalized, memory):
        assert d.data_ptr == m.ctypes.data
        assert d.shape == (2, NB, NH, BS, HS) and d.spec.is_contiguous
    assert_rows(
        normalized,
        [fmt] * NL,
        lambda ly, kv, b, t: heads(views[ly][kv, b, t, h] for h in range(NH)),
    )


def test_flashinfer_hnd_view_is_recovered():
    memory = layers((NB, 2, NH, BS, HS))
    views = [m.transpose(0, 1, 3, 2, 4) for m in memory]
    fmt, normalized = detect_format(views)
    assert fmt is F.NL_X_NB_TWO_NH_BS_HS
    assert normalized[0].data_ptr == memory[0].ctypes.data
    assert_rows(
        normalized,
        [fmt] * NL,
        lambda ly, kv, b, t: heads(views[ly][b, kv, t, h] for h in range(NH)),
    )


def test_flashinfer_memory_exposed_as_flashattention_view_is_recovered():
    memory = layers((NB, 2, BS, NH, HS))
    views = [m.transpose(1, 0, 2, 3, 4) for m in memory]  # logical [2, NB, BS, NH, HS]
    fmt, normalized = detect_format(views)
    assert fmt is F.NL_X_NB_TWO_BS_NH_HS
    assert_rows(normalized, [fmt] * NL, lambda ly, kv, b, t: views[ly][kv, b, t].tobytes())


def test_permuted_cross_layer_tensor_is_recovered():
    memory = encoded((NB, NL, 2, NH, BS, HS))
    view = memory.transpose(0, 1, 2, 4, 3, 5)
    fmt, normalized = detect_format(view)
    assert fmt is F.NB_NL_TWO_NH_BS_HS
    assert normalized.data_ptr == memory.ctypes.data
    assert_rows(
        normalized, [fmt] * NL, lambda ly, kv, b, t: heads(view[b, ly, kv, t, h] for h in range(NH))
    )


def test_memory_order_of_no_format_is_rejected():
    memory = np.zeros((NB, BS, 2, NH, HS), np.float16)
    with pytest.raises(KVGroupsValueError, match=r"memory order.*NB BS TWO NH HS"):
        detect_format([memory.transpose(2, 0, 1, 3, 4)])


def test_non_permutation_strides_are_rejected():
    sliced = np.zeros((2, NB + 1, BS, NH, HS), np.float16)[:, 1:]
    with pytest.raises(KVGroupsValueError, match="contiguous"):
        detect_format([sliced])
    broadcast = np.broadcast_to(np.zeros((1, BS, NH, HS), np.float16), (2, NB, BS, NH, HS))
    with pytest.raises(ValueError):
        detect_format([broadcast])


def test_padding_on_the_block_axis_is_accepted():
    base = np.zeros((NL, NB, BS * HS + 16), np.float16)
    padded = [base[i, :, : BS * HS].reshape(NB, BS, HS) for i in range(NL)]
    fmt, normalized = detect_format(padded)
    assert fmt is F.NL_X_NB_BS_HS
    assert layer_layouts(normalized, [fmt] * NL)[0].block_stride_elems == BS * HS + 16


def test_padded_and_permuted_blocks_are_recovered():
    inner = 2 * NH * BS * HS
    base = encoded((NB, inner + 8))
    memory = base[:, :inner].reshape(NB, 2, NH, BS, HS)
    view = memory.transpose(0, 1, 3, 2, 4)
    fmt, normalized = detect_format([view])
    assert fmt is F.NL_X_NB_TWO_NH_BS_HS
    assert layer_layouts(normalized, [fmt])[0].block_stride_elems == inner + 8
    assert_rows(normalized, [fmt], lambda ly, kv, b, t: heads(view[b, kv, t, h] for h in range(NH)))


def test_padding_on_a_k_v_axis_first_is_rejected():
    base = np.zeros((2, NB * BS * NH * HS + 8), np.float16)
    padded = base[:, : NB * BS * NH * HS].reshape(2, NB, BS, NH, HS)
    with pytest.raises(KVGroupsValueError, match="padded on dim 0"):
        detect_format([padded])


# --- SGLang --------------------------------------------------------------------------------


def test_sglang_flat_list_is_split_into_k_and_v_views():
    flat = layers((NB * BS, NH, HS), n=2 * NL)
    fmt, normalized = detect_format(flat, engine="sglang", hints={"tokens_per_block": BS})
    assert fmt is F.TWO_X_NL_X_NB_BS_NH_HS
    ks, vs = normalized
    assert len(ks) == len(vs) == NL
    assert [k.data_ptr for k in ks] == [a.ctypes.data for a in flat[:NL]]
    assert [v.data_ptr for v in vs] == [a.ctypes.data for a in flat[NL:]]
    assert ks[0].shape == (NB, BS, NH, HS)
    assert_rows(
        normalized, [fmt] * NL, lambda ly, kv, b, t: flat[kv * NL + ly][b * BS + t].tobytes()
    )


def test_sglang_page_axis_not_divisible_names_the_numbers():
    flat = [spec(10, NH, HS)] * (2 * NL)
    with pytest.raises(KVGroupsValueError, match=r"kv_caches\[0\].*10.*tokens_per_block \(3\)"):
        detect_format(flat, engine="sglang", hints={"tokens_per_block": 3})


def test_sglang_flat_list_without_tokens_per_block_cannot_be_grouped():
    with pytest.raises(KVGroupsValueError, match="cannot be grouped"):
        detect_format([spec(NB * BS, NH, HS)] * (2 * NL), engine="sglang")


def test_sglang_flat_list_of_odd_length_is_rejected():
    with pytest.raises(KVGroupsValueError, match="2\\*NL"):
        detect_format([spec(NB * BS, NH, HS)] * 3, engine="sglang", hints={"tokens_per_block": BS})


def test_sglang_k_and_v_lists():
    caches = [[spec(NB, BS, NH, HS)] * NL, [spec(NB, BS, NH, HS)] * NL]
    fmt, normalized = detect_format(caches, engine="sglang")
    assert fmt is F.TWO_X_NL_X_NB_BS_NH_HS
    assert len(normalized) == 2 and len(normalized[0]) == NL


def test_sglang_page_folded_k_and_v_lists():
    caches = [[spec(NB * BS, NH, HS)] * NL, [spec(NB * BS, NH, HS)] * NL]
    fmt, normalized = detect_format(caches, engine="sglang")
    assert fmt is F.TWO_X_NL_X_NBBS_NH_HS
    with pytest.raises(KVGroupsValueError, match="cannot be grouped"):
        layer_layouts(normalized, [fmt] * NL)
    fmt, normalized = detect_format(caches, engine="sglang", hints={"tokens_per_block": BS})
    assert fmt is F.TWO_X_NL_X_NB_BS_NH_HS
    assert normalized[1][0].shape == (NB, BS, NH, HS)


def test_sglang_mla_pages():
    caches = layers((NB * BS, 1, HS))
    assert detect_format(caches, engine="sglang")[0] is F.NL_X_NBBS_ONE_HS
    fmt, normalized = detect_format(caches, engine="sglang", hints={"tokens_per_block": BS})
    assert fmt is F.NL_X_NB_BS_HS
    assert normalized[0].shape == (NB, BS, HS)
    assert_rows(normalized, [fmt] * NL, lambda ly, kv, b, t: caches[ly][b * BS + t].tobytes())


def test_sglang_indexer_rows_are_viewed_per_slot():
    caches = layers((NB, BS * 132), np.uint8)
    fmt, normalized = detect_format(caches, engine="sglang")
    assert fmt is F.NL_X_NB_BSV_BSS
    assert normalized[0].shape == (NB, BS, 132)

    def row(ly, kv, b, t):
        block = caches[ly][b]
        return block[t * 128 : (t + 1) * 128].tobytes() + block[BS * 128 + 4 * t :][:4].tobytes()

    assert_rows(normalized, [fmt] * NL, row)


def test_sglang_view_whose_memory_is_heads_outermost():
    memory = [encoded((NH, NB, BS, HS), start=i * 1000) for i in range(2 * NL)]
    views = [m.transpose(1, 2, 0, 3) for m in memory]  # logical [NB, BS, NH, HS]
    fmt, normalized = detect_format([views[:NL], views[NL:]], engine="sglang")
    assert fmt is F.TWO_X_NL_X_NH_NB_BS_HS
    assert normalized[0][0].shape == (NH, NB, BS, HS)
    assert_rows(normalized, [fmt] * NL, lambda ly, kv, b, t: views[kv * NL + ly][b, t].tobytes())


# --- TRT-LLM -------------------------------------------------------------------------------


def test_trtllm_pool():
    pool = spec(NB, NL, 2, NH, BS, HS)
    assert detect_format(pool, engine="trtllm")[0] is F.NB_NL_TWO_NH_BS_HS
    assert detect_format([pool], engine="trtllm")[0] is F.NB_NL_TWO_NH_BS_HS


def test_trtllm_rank_4_pool_is_viewed_through_hints():
    pool = encoded((NB, NL, 2, NH * BS * HS))
    hints = {"num_kv_heads": NH, "tokens_per_block": BS, "head_dim": HS}
    fmt, normalized = detect_format(pool, engine="trtllm", hints=hints)
    assert fmt is F.NB_NL_TWO_NH_BS_HS
    assert normalized.shape == (NB, NL, 2, NH, BS, HS)
    assert normalized.data_ptr == pool.ctypes.data
    full = pool.reshape(NB, NL, 2, NH, BS, HS)
    assert_rows(
        normalized, [fmt] * NL, lambda ly, kv, b, t: heads(full[b, ly, kv, h, t] for h in range(NH))
    )


def test_trtllm_rank_4_pool_without_hints_names_the_missing_ones():
    with pytest.raises(KVGroupsValueError, match="head_dim"):
        detect_format(
            spec(NB, NL, 2, NH * BS * HS),
            engine="trtllm",
            hints={"num_kv_heads": NH, "tokens_per_block": BS},
        )


def test_trtllm_rank_4_pool_of_the_wrong_size():
    with pytest.raises(KVGroupsValueError, match=r"dim 3.*= 24.*25"):
        detect_format(
            spec(NB, NL, 2, 25),
            engine="trtllm",
            hints={"num_kv_heads": NH, "tokens_per_block": BS, "head_dim": HS},
        )


def test_trtllm_other_structures_are_rejected():
    with pytest.raises(KVGroupsValueError, match="rank-6"):
        detect_format(spec(NB, NL, 2, BS, HS), engine="trtllm")
    with pytest.raises(KVGroupsValueError, match="1-element"):
        detect_format([spec(NB, NL, 2, NH, BS, HS)] * 2, engine="trtllm")


# --- JAX serving engines -------------------------------------------------------------------


def jax_pages(nh, dtype, packing, n=NL):
    return layers((NB, BS, 2 * nh // packing, packing, HS), dtype, n)


def interleaved_row(raw, packing, nh):
    def row(ly, kv, b, t):
        c = [2 * h + kv for h in range(nh)]  # heads are K0, V0, K1, V1, ...
        return heads(raw[ly][b, t, i // packing, i % packing] for i in c)

    return row


@pytest.mark.parametrize("engine", ["tpu_inference", "vllm_tpu", "sglang_jax"])
def test_jax_engines_bf16_packing_2(engine):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    raw = jax_pages(NH, ml_dtypes.bfloat16, 2)
    fmt, normalized = detect_format(raw, engine=engine)
    assert fmt is F.NL_X_NB_BS_NH_TWO_HS
    assert normalized[0].shape == (NB, BS, NH, 2, HS)
    assert normalized[0].dtype.name == "bfloat16"
    assert [d.data_ptr for d in normalized] == [r.ctypes.data for r in raw]
    layout = layer_layouts(normalized, [fmt] * NL)[0]
    assert (layout.kv_size, layout.num_heads, layout.head_size) == (2, NH, HS)
    assert_rows(normalized, [fmt] * NL, interleaved_row(raw, 2, NH))


def test_jax_engines_fp8_packing_4():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    nh = 4
    raw = jax_pages(nh, ml_dtypes.float8_e4m3fn, 4)
    fmt, normalized = detect_format(raw, engine="tpu_inference")
    assert fmt is F.NL_X_NB_BS_NH_TWO_HS
    assert normalized[0].shape == (NB, BS, nh, 2, HS)
    assert layer_layouts(normalized, [fmt] * NL)[0].num_heads == nh
    assert_rows(normalized, [fmt] * NL, interleaved_row(raw, 4, nh))


def test_jax_engines_rank_4_variant_without_packing_axis():
    raw = layers((NB, BS, 2 * NH, HS))
    fmt, normalized = detect_format(raw, engine="sglang_jax")
    assert fmt is F.NL_X_NB_BS_NH_TWO_HS
    assert_rows(
        normalized,
        [fmt] * NL,
        lambda ly, kv, b, t: heads(raw[ly][b, t, 2 * h + kv] for h in range(NH)),
    )


def test_jax_engines_packing_must_match_the_dtype():
    with pytest.raises(KVGroupsValueError, match=r"packing.*= 2 .*got 4"):
        detect_format([spec(NB, BS, 1, 4, HS, dtype="bfloat16")], engine="tpu_inference")


def test_jax_engines_need_a_list():
    with pytest.raises(KVGroupsTypeError, match="a list"):
        detect_format(spec(NB, BS, NH, 2, HS, dtype="bfloat16"), engine="tpu_inference")


def test_maxtext_k_and_v_lists_heads_outermost():
    ks, vs = layers((NH, NB, BS, HS)), layers((NH, NB, BS, HS))
    vs = [v + 7 for v in vs]
    fmt, normalized = detect_format([ks, vs], engine="maxtext")
    assert fmt is F.TWO_X_NL_X_NH_NB_BS_HS
    assert normalized[0][0].data_ptr == ks[0].ctypes.data
    assert_rows(
        normalized,
        [fmt] * NL,
        lambda ly, kv, b, t: heads((ks, vs)[kv][ly][h, b, t] for h in range(NH)),
    )


def test_maxtext_other_structures_are_rejected():
    with pytest.raises(KVGroupsValueError, match=r"\[K list, V list\]"):
        detect_format([spec(NH, NB, BS, HS)] * 2, engine="maxtext")
    with pytest.raises(KVGroupsValueError, match=r"kv_caches\[0\]\[0\].*\[num_kv_heads"):
        detect_format([[spec(NB, BS, HS)], [spec(NB, BS, HS)]], engine="maxtext")
    with pytest.raises(KVGroupsValueError, match="K and V of one shape"):
        detect_format([[spec(NH, NB, BS, HS)], [spec(NB, BS, HS)]], engine="maxtext")


# --- mixed models: per bucket, per engine group -------------------------------------------


def test_main_cache_plus_indexer_cache_get_their_own_formats():
    caches = [spec(2, NB, BS, NH, HS), spec(NB, BS, 132, dtype="uint8")] * 3
    normalized, formats = normalize_and_discover_per_layer_formats(caches)
    assert formats == [F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_BSV_BSS] * 3
    layouts = layer_layouts(normalized, formats)
    assert [lay.kv_size for lay in layouts] == [2, 1] * 3


def test_detect_format_on_a_mixed_model_points_to_the_per_layer_function():
    caches = [spec(2, NB, BS, NH, HS), spec(NB, BS, HS)]
    with pytest.raises(
        KVGroupsValueError,
        match=r"NL_X_TWO_NB_BS_NH_HS: layers \[0\].*NL_X_NB_BS_HS: layers \[1\]"
        r".*normalize_and_discover_per_layer_formats",
    ):
        detect_format(caches)


def test_layers_of_two_head_sizes_share_a_format_with_their_own_geometry():
    caches = [spec(2, NB, BS, NH, HS), spec(2, NB, BS, NH, 2 * HS)] * 2
    fmt, normalized = detect_format(caches)
    assert fmt is F.NL_X_TWO_NB_BS_NH_HS
    assert [lay.head_size for lay in layer_layouts(normalized, [fmt] * 4)] == [HS, 2 * HS] * 2


def test_a_reshape_is_applied_only_to_tensors_of_its_own_shape():
    raw = [
        encoded((NB, BS, NH, 2, HS)),
        encoded((NB, BS, 2 * NH, 2, HS), start=999),
        encoded((NB, BS, NH, 2, HS), start=5000),
    ]
    normalized, formats = normalize_and_discover_per_layer_formats(raw, engine="tpu_inference")
    assert [d.shape for d in normalized] == [
        (NB, BS, NH, 2, HS),
        (NB, BS, 2 * NH, 2, HS),
        (NB, BS, NH, 2, HS),
    ]
    assert [d.data_ptr for d in normalized] == [r.ctypes.data for r in raw]
    assert [lay.num_heads for lay in layer_layouts(normalized, formats)] == [NH, 2 * NH, NH]


def test_sglang_flat_list_with_two_head_counts():
    shapes = [(NB * BS, NH, HS), (NB * BS, 2 * NH, HS)]
    flat = [encoded(shapes[i % 2], start=i * 500) for i in range(2 * 2)]
    normalized, formats = normalize_and_discover_per_layer_formats(
        flat, engine="sglang", hints={"tokens_per_block": BS}
    )
    assert formats == [F.TWO_X_NL_X_NB_BS_NH_HS] * 2
    assert [k.shape for k in normalized[0]] == [(NB, BS, NH, HS), (NB, BS, 2 * NH, HS)]
    assert_rows(normalized, formats, lambda ly, kv, b, t: flat[kv * 2 + ly][b * BS + t].tobytes())


def test_permuted_and_plain_layers_of_one_shape_are_separate_buckets():
    plain = encoded((2, NB, BS, NH, HS))
    permuted = encoded((2, NB, NH, BS, HS), start=3000).transpose(0, 1, 3, 2, 4)
    normalized, formats = normalize_and_discover_per_layer_formats([plain, permuted, plain])
    assert formats == [F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS, F.NL_X_TWO_NB_BS_NH_HS]
    assert normalized[1].shape == (2, NB, NH, BS, HS)


def test_engine_groups_are_detected_separately():
    caches = [
        spec(2, NB, BS, NH, HS),
        spec(NB, BS, HS),
        spec(2, 2 * NB, BS, NH, HS),
        spec(NB, BS, HS),
        spec(2, NB, BS, NH, HS),
    ]
    normalized, formats = normalize_and_discover_per_layer_formats(caches, [[0, 1], [2, 3]])
    assert formats == [
        F.NL_X_TWO_NB_BS_NH_HS,
        F.NL_X_NB_BS_HS,
        F.NL_X_TWO_NB_BS_NH_HS,
        F.NL_X_NB_BS_HS,
        F.NL_X_TWO_NB_BS_NH_HS,
    ]
    assert [lay.num_blocks for lay in layer_layouts(normalized, formats)] == [
        NB,
        NB,
        2 * NB,
        NB,
        NB,
    ]


def test_engine_groups_outside_the_layer_range_or_overlapping():
    caches = [spec(2, NB, BS, NH, HS)] * 3
    with pytest.raises(KVGroupsValueError, match="outside registered layer range"):
        normalize_and_discover_per_layer_formats(caches, [[0, 1], [3]])
    with pytest.raises(KVGroupsValueError, match="layer 1 in groups 0 and 1"):
        normalize_and_discover_per_layer_formats(caches, [[0, 1], [1, 2]])
    with pytest.raises(KVGroupsValueError, match="outside registered layer range"):
        normalize_and_discover_per_layer_formats(spec(NB, 3, 2, BS, NH, HS), [[0, 1, 2, 3]])


def test_empty_engine_groups_mean_one_group():
    caches = [spec(2, NB, BS, NH, HS)] * 3
    assert normalize_and_discover_per_layer_formats(caches, [])[1] == [F.NL_X_TWO_NB_BS_NH_HS] * 3


def test_cross_layer_tensor_gives_one_format_per_layer():
    normalized, formats = normalize_and_discover_per_layer_formats(spec(NB, NL, 2, BS, NH, HS))
    assert isinstance(normalized, TensorDesc)
    assert formats == [F.NB_NL_TWO_BS_NH_HS] * NL


def test_kv_list_engines_give_one_format_per_layer():
    caches = [[spec(NH, NB, BS, HS)] * NL, [spec(NH, NB, BS, HS)] * NL]
    normalized, formats = normalize_and_discover_per_layer_formats(
        caches, [[0, 1], [2, 3, 4]], engine="maxtext"
    )
    assert formats == [F.TWO_X_NL_X_NH_NB_BS_HS] * NL
    assert len(normalized[0]) == len(normalized[1]) == NL


def test_normalized_mixed_model_builds_a_manager():
    from kvgroups_core import KVLayerGroupsManager

    caches = [spec(2, NB, 16, NH, HS), spec(NB, 16, 132, dtype="uint8")] * 2
    normalized, formats = normalize_and_discover_per_layer_formats(caches)
    manager = KVLayerGroupsManager(normalized, formats)
    assert [g.layer_indices for g in manager.kernel_groups] == [[0, 2], [1, 3]]
