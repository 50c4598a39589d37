"""Recurrent-state groups on the NumPy reference (docs/SEMANTICS.md section 9): grouping by spec,
one unpadded snapshot per chunk, loads into the request's state slot, prefix hits that need the
snapshot, and the refusals."""

import ctypes

import numpy as np
import pytest

from kvgroups_conformance.state_caches import (
    ATTN_GROUP,
    PAD,
    STATE_GROUP,
    HybridShape,
    expected_state_object,
    hybrid_caches,
    hybrid_infos,
    slot_bytes,
)
from kvgroups_core import (
    EngineGroupInfo,
    KVGroupsTypeError,
    KVGroupsValueError,
    KVLayerGroupsManager,
    TensorSpec,
    detect_format,
    load,
    object_nbytes,
    store,
)
from kvgroups_core import EngineKVFormat as F
from kvgroups_core.formats.layout import layer_layouts
from kvgroups_core.formats.state_layout import state_page_offsets

CHUNK = 8  # two 4-token blocks per chunk
SHAPE = HybridShape(page_bytes=2048)  # conv 3x24 bf16 (144 B) + temporal 2x4x8 f32 (256 B)


def _model(shape=SHAPE, seed=0, zero=False, chunk=CHUNK, **kw):
    rng = np.random.default_rng(seed)
    caches, formats, raws = hybrid_caches(shape, rng, zero)
    manager = KVLayerGroupsManager(
        caches, formats, hybrid_infos(formats, shape.bs), lmcache_tokens_per_chunk=chunk, **kw
    )
    return manager, caches, formats, raws


def test_state_layers_group_by_spec_into_one_object_group_of_window_one():
    m, _, formats, _ = _model()
    assert formats[:3] == [F.NL_X_NB_CW_CD, F.NL_X_NB_SH_SS, F.NL_X_NB_NH_BS_CS]
    got = [
        (
            g.layer_indices,
            g.engine_kv_format,
            g.recurrent_state,
            g.sw_size_tokens,
            g.shape_desc.bs,
            g.shape_desc.nh * g.shape_desc.hs,
        )
        for g in m.kernel_groups
    ]
    assert got == [
        ([0, 3], F.NL_X_NB_CW_CD, True, 4, 1, 72),
        ([1, 4], F.NL_X_NB_SH_SS, True, 4, 1, 64),
        ([2, 5], F.NL_X_NB_NH_BS_CS, False, -1, 4, 16),
    ]
    assert [
        (o.kernel_group_indices, o.sw_size_chunks, o.recurrent_state) for o in m.object_groups
    ] == [([0, 1], 1, True), ([2], -1, False)]
    assert m.get_attn_desc().num_chunks_in_sw == [1, -1]
    # Object bytes per chunk: the unpadded states (2 layers x 400 B), not the 2,048 B pages.
    assert object_nbytes(m, 0) == 2 * SHAPE.state_nbytes == 800
    assert m.get_slots_per_chunk_in_sw(0) == 1
    assert (m.calculate_num_blocks(0, CHUNK), m.calculate_num_blocks(0, 4)) == (2, 1)


def test_full_sw_mode_and_unseparated_objects_leave_state_groups_alone():
    full = _model(full_sw_kv=True)[0]
    assert full.get_attn_desc().num_chunks_in_sw == [1, -1]
    assert full.get_subchunk_sw_size_tokens(0) == 4
    one = _model(separate_object_groups=False)[0]
    assert [
        (o.kernel_group_indices, o.sw_size_chunks, o.recurrent_state) for o in one.object_groups
    ] == [([0, 1], 1, True), ([2], -1, False)]


def test_a_store_keeps_each_chunks_last_slot_without_the_page_padding():
    m, caches, _, _ = _model()
    ids = {STATE_GROUP: [0, 7, 0, 2, 0, 9], ATTN_GROUP: [1, 2, 3, 4, 5, 6]}
    objs = store(m, caches, ids, backend="numpy")
    state = objs[0]
    assert state.shape == (3, 800)
    for c, last in enumerate([7, 2, 9]):
        assert state[c].tobytes() == expected_state_object(m, caches, last).tobytes()


def test_a_load_writes_only_the_last_chunks_snapshot_into_the_request_slot():
    src, src_caches, _, _ = _model(seed=1)
    dst, dst_caches, _, dst_raws = _model(seed=2)
    before_raws = [r.copy() for r in dst_raws]
    before_attn = [dst_caches[i].copy() for i in (2, 5)]
    objs = store(
        src,
        src_caches,
        {STATE_GROUP: [0, 3, 0, 5, 0, 8], ATTN_GROUP: [1, 2, 3, 4, 5, 6]},
        backend="numpy",
    )
    load(
        dst,
        objs,
        dst_caches,
        {STATE_GROUP: [0, 0, 0, 0, 0, 10], ATTN_GROUP: [7, 8, 9, 10, 11, 0]},
        backend="numpy",
    )
    # State: only slot 10 changed, to the source's slot 8 (the third chunk's snapshot).
    for raw, before in zip(dst_raws, before_raws):
        changed = np.flatnonzero(np.any(raw != before, axis=1))
        assert changed.tolist() == [10]
        assert raw[10, SHAPE.state_nbytes :].tolist() == [PAD] * (2048 - SHAPE.state_nbytes)
    for layer in (0, 1, 3, 4):
        assert (
            slot_bytes(dst_caches[layer], 10).tobytes()
            == slot_bytes(src_caches[layer], 8).tobytes()
        )
    # Attention: every block of the three chunks, the rest untouched.
    for j, layer in enumerate((2, 5)):
        for s, d in zip([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 0]):
            assert dst_caches[layer][d].tobytes() == src_caches[layer][s].tobytes()
        assert (
            dst_caches[layer][[1, 2, 3, 4, 5, 6]].tobytes()
            == before_attn[j][[1, 2, 3, 4, 5, 6]].tobytes()
        )


@pytest.mark.parametrize("skip,state_written", [(0, True), (20, True), (23, True), (24, False)])
def test_a_prefix_skip_that_covers_every_token_writes_no_state(skip, state_written):
    src, src_caches, _, _ = _model(seed=1)
    dst, dst_caches, _, dst_raws = _model(seed=2)
    before = [r.copy() for r in dst_raws]
    ids = {STATE_GROUP: [0, 3, 0, 5, 0, 8], ATTN_GROUP: [1, 2, 3, 4, 5, 6]}
    objs = store(src, src_caches, ids, backend="numpy")
    load(dst, objs, dst_caches, ids, skip_first_n_tokens=skip, backend="numpy")
    assert (not np.array_equal(dst_raws[0], before[0])) is state_written


def test_layer_subsets_move_only_those_state_layers():
    src, src_caches, _, _ = _model(seed=1)
    ids = {STATE_GROUP: [0, 3, 0, 5], ATTN_GROUP: [1, 2, 3, 4]}
    whole = store(src, src_caches, ids, backend="numpy")
    part = [np.zeros_like(o) for o in whole]
    store(src, src_caches, ids, part, layers=[4], backend="numpy")  # layer 2's temporal state
    region = 2 * 144 + 256  # after the two conv states and layer 0's temporal state
    assert part[0][:, region:].tobytes() == whole[0][:, region:].tobytes()
    assert not part[0][:, :region].any() and not part[1].any()


def test_hits_need_the_snapshot_at_the_hit_length():
    # LMCache #2863: attention hits reported without their state garbled outputs.
    desc = _model()[0].get_attn_desc()  # [state (window 1), attention (full)]

    def hit(attn, state, n=4):
        present = np.zeros((n, 2), bool)
        present[list(state), 0] = True
        present[list(attn), 1] = True
        return desc.hit_chunks(present)

    assert hit({0, 1, 2, 3}, {1}) == 2
    assert hit({0, 1, 2, 3}, {3}) == 4
    assert hit({0, 1, 2, 3}, set()) == 0
    assert hit({0, 1}, {3}) == 0
    assert hit({0, 1, 2, 3}, {0, 1, 2}) == 3


@pytest.mark.parametrize(
    "fmt,shape,nh,hs",
    [
        (F.NL_X_NB_CD_CW, (5, 24, 3), 24, 3),
        (F.NL_X_NB_CW_CD, (5, 3, 24), 1, 72),
        (F.NL_X_NB_SH_SS, (5, 2, 4, 8), 2, 32),
    ],
    ids=lambda x: getattr(x, "name", None),
)
def test_a_slot_is_one_run_of_the_whole_state_at_the_padded_stride(fmt, shape, nh, hs):
    inner = int(np.prod(shape[1:]))
    base = np.arange(5 * (inner + 10), dtype=np.float32).reshape(5, inner + 10)
    arr = base[:, :inner].reshape(shape)
    (layout,) = layer_layouts([arr], [fmt])
    assert (layout.kv_size, layout.block_size, layout.num_heads, layout.head_size) == (1, 1, nh, hs)
    assert (layout.block_stride_bytes, layout.block_stride_elems) == ((inner + 10) * 4, inner + 10)
    (run,) = layout.runs
    assert (run.count, run.nbytes, run.cache_offset) == (1, inner * 4, 0)
    for b in range(5):  # the page model's slot b is arr[b]
        start = layout.planes[0][0].address + b * layout.block_stride_bytes
        assert ctypes.string_at(start, run.nbytes) == arr[b].tobytes()


def test_page_offsets_place_sub_states_back_to_back():
    assert state_page_offsets([(3, 512), (4, 64, 64)], ["bfloat16", "float32"]) == [
        (0, 3072),
        (3072, 65536),
    ]
    with pytest.raises(ValueError, match="not a multiple"):
        state_page_offsets([(3,), (2,)], ["bfloat16", "float32"])


@pytest.mark.parametrize(
    "shapes, dtypes, error, text",
    [
        ([(4, 8)], None, KVGroupsTypeError, "dtypes: expected a sequence"),
        ("ab", ["float16", "float32"], KVGroupsTypeError, "shapes: expected a sequence"),
        ([4, 8], ["float16", "float32"], KVGroupsTypeError, "shapes[0]: expected a shape"),
        ([(4, "8")], ["float16"], KVGroupsTypeError, "shapes[0]: expected int dimensions"),
        ([(4, 1.0)], ["float16"], KVGroupsTypeError, "shapes[0]: expected int dimensions"),
        ([(4, -8)], ["float16"], KVGroupsValueError, "shapes[0]: expected non-negative"),
    ],
)
def test_page_offsets_name_a_malformed_argument(shapes, dtypes, error, text):
    with pytest.raises(error) as info:
        state_page_offsets(shapes, dtypes)
    assert text in str(info.value)


# --- refusals -----------------------------------------------------------------------------


def test_state_layers_need_an_engine_info_saying_recurrent_state():
    _, caches, formats, _ = _model()
    with pytest.raises(ValueError, match="recurrent_state=True.*no engine_group_infos"):
        KVLayerGroupsManager(caches, formats, lmcache_tokens_per_chunk=CHUNK)
    infos = hybrid_infos(formats, 4)
    infos[1] = EngineGroupInfo(STATE_GROUP, infos[1].layer_indices, 4)
    with pytest.raises(ValueError, match="recurrent_state=False"):
        KVLayerGroupsManager(caches, formats, infos, lmcache_tokens_per_chunk=CHUNK)


def test_a_gdn_state_shaped_like_attention_is_never_read_as_attention():
    # LMCache #4094: Qwen3.5 GDN state tensors (711, 2, 544, 1, 512) passed for FlashInfer NHD.
    state = TensorSpec((711, 2, 544, 1, 512), "bfloat16")
    caches, formats = [state, state], [F.NL_X_NB_TWO_BS_NH_HS] * 2
    info = EngineGroupInfo(0, (0, 1), 544, recurrent_state=True)
    with pytest.raises(ValueError, match="recurrent_state=True.*never read as attention"):
        KVLayerGroupsManager(caches, formats, [info], lmcache_tokens_per_chunk=544)
    with pytest.raises(ValueError, match="recurrent_state"):
        detect_format(caches, engine="vllm", hints={"recurrent_state": True})
    # Declared from the spec, the same tensor is a state of 2 heads x 544*512 elements.
    m = KVLayerGroupsManager(caches, [F.NL_X_NB_SH_SS] * 2, [info], lmcache_tokens_per_chunk=544)
    sd = m.kernel_groups[0].shape_desc
    assert (sd.bs, sd.nh, sd.hs, m.kernel_groups[0].recurrent_state) == (1, 2, 544 * 512, True)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(tokens_per_block=0), "tokens_per_block > 0"),
        (dict(sw_size_tokens=8), "sw_size_tokens -1"),
    ],
)
def test_state_infos_need_slot_tokens_and_no_window(kw, match):
    _, caches, formats, _ = _model()
    infos = hybrid_infos(formats, 4)
    fields = dict(tokens_per_block=4, recurrent_state=True) | kw
    infos[0] = EngineGroupInfo(STATE_GROUP, infos[0].layer_indices, **fields)
    with pytest.raises(ValueError, match=match):
        KVLayerGroupsManager(caches, formats, infos, lmcache_tokens_per_chunk=CHUNK)


def test_conv_projections_belong_to_conv_state_groups():
    with pytest.raises(ValueError, match="recurrent_state=False"):
        EngineGroupInfo(0, (0,), 4, conv_projections=((8, 2),))
    with pytest.raises(ValueError, match="whole number of units"):
        EngineGroupInfo(0, (0,), 4, recurrent_state=True, conv_projections=((9, 2),))
    _, caches, formats, _ = _model()
    infos = hybrid_infos(formats, 4)
    infos[1] = EngineGroupInfo(
        STATE_GROUP, infos[1].layer_indices, 4, recurrent_state=True, conv_projections=((8, 2),)
    )
    with pytest.raises(ValueError, match="only for a conv state"):
        KVLayerGroupsManager(caches, formats, infos, lmcache_tokens_per_chunk=CHUNK)


def test_a_state_that_is_not_one_row_major_run_per_slot_is_refused():
    state = np.zeros((4, 24, 3), np.float32).transpose(0, 2, 1)  # (4, 3, 24), not row-major
    info = EngineGroupInfo(0, (0,), 4, recurrent_state=True)
    with pytest.raises(ValueError, match="one row-major state"):
        KVLayerGroupsManager([state], [F.NL_X_NB_CW_CD], [info], lmcache_tokens_per_chunk=8)
    with pytest.raises(ValueError, match="rank-3"):
        KVLayerGroupsManager(
            [np.zeros((4, 3), np.float32)], [F.NL_X_NB_CW_CD], [info], lmcache_tokens_per_chunk=8
        )
