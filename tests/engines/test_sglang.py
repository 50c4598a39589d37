"""SGLang pools (stand-ins with SGLang's attribute names) -> manager, page ids, transfers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvgroups_torch.sglang import (  # noqa: E402
    from_sglang_mamba_pool,
    from_sglang_pool,
    pages_from_token_slots,
)

from kvgroups_core import EngineKVFormat, load, store  # noqa: E402
from tests.support.sglang_standins import (  # noqa: E402
    MambaPool,
    MambaPoolHost,
    MHATokenToKVPool,
    MLATokenToKVPool,
    SWAKVPool,
)

PS = 64  # page size; chunk 256 = 4 pages


def slots_of(pages, ps=PS):
    return [p * ps + j for p in pages for j in range(ps)]


def page_rows(buf, page, ps=PS):
    return buf[page * ps : (page + 1) * ps].view(torch.uint8).clone()


def snapshot(bufs):
    return [b.clone() for b in bufs]


def assert_only_pages_changed(before, after, pages, ps=PS):
    for b, a in zip(before, after):
        changed = (b.view(torch.uint8) != a.view(torch.uint8)).reshape(b.shape[0], -1).any(1)
        rows = set(changed.nonzero().flatten().tolist())
        assert rows <= {p * ps + j for p in pages for j in range(ps)}


def test_mha_pool_pages_round_trip_and_nothing_else_moves():
    src = MHATokenToKVPool(
        size=16 * PS,
        page_size=PS,
        dtype=torch.bfloat16,
        head_num=4,
        head_dim=64,
        layer_num=3,
        seed=1,
    )
    dst = MHATokenToKVPool(
        size=16 * PS,
        page_size=PS,
        dtype=torch.bfloat16,
        head_num=4,
        head_dim=64,
        layer_num=3,
        seed=2,
    )
    a, b = from_sglang_pool(src), from_sglang_pool(dst)
    assert a.manager.num_kernel_groups == 1
    assert a.manager.kernel_groups[0].engine_kv_format is EngineKVFormat.TWO_X_NL_X_NB_BS_NH_HS
    src_pages, dst_pages = [3, 9, 1, 12], [5, 2, 14, 8]
    objs = store(a.manager, a.kv_caches, a.block_ids(slots_of(src_pages)))
    before = snapshot(dst.k_buffer + dst.v_buffer)
    load(b.manager, objs, b.kv_caches, b.block_ids(torch.tensor(slots_of(dst_pages))))
    for buf_s, buf_d in zip(src.k_buffer + src.v_buffer, dst.k_buffer + dst.v_buffer):
        for s, d in zip(src_pages, dst_pages):
            assert torch.equal(page_rows(buf_d, d), page_rows(buf_s, s))
    assert_only_pages_changed(before, dst.k_buffer + dst.v_buffer, dst_pages)


def test_mla_pool_is_one_latent_per_slot():
    src = MLATokenToKVPool(
        size=8 * PS,
        page_size=PS,
        dtype=torch.bfloat16,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        layer_num=2,
        seed=1,
    )
    dst = MLATokenToKVPool(
        size=8 * PS,
        page_size=PS,
        dtype=torch.bfloat16,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        layer_num=2,
        seed=2,
    )
    a, b = from_sglang_pool(src), from_sglang_pool(dst)
    g = a.manager.kernel_groups[0]
    assert g.engine_kv_format is EngineKVFormat.NL_X_NB_BS_HS and g.shape_desc.hs == 576
    objs = store(a.manager, a.kv_caches, a.block_ids(slots_of([1, 2, 3, 4])))
    before = snapshot(dst.kv_buffer)
    load(b.manager, objs, b.kv_caches, b.block_ids(slots_of([8, 7, 6, 5])))
    for buf_s, buf_d in zip(src.kv_buffer, dst.kv_buffer):
        for s, d in zip([1, 2, 3, 4], [8, 7, 6, 5]):
            assert torch.equal(page_rows(buf_d, d), page_rows(buf_s, s))
    assert_only_pages_changed(before, dst.kv_buffer, [8, 7, 6, 5])


def swa_pool(seed):
    return SWAKVPool(
        size=16 * PS,
        size_swa=8 * PS,
        page_size=PS,
        dtype=torch.float16,
        head_num=2,
        head_dim=64,
        swa_attention_layer_ids=[0, 1, 3, 4],
        full_attention_layer_ids=[2, 5],
        seed=seed,
    )


def test_swa_pool_two_page_spaces_and_the_window_rule():
    src, dst = swa_pool(1), swa_pool(2)
    a, b = from_sglang_pool(src, sliding_window=100), from_sglang_pool(dst, sliding_window=100)
    m = a.manager
    assert a.layer_ids == [0, 1, 2, 3, 4, 5]
    assert [(g.engine_group_idx, g.sw_size_tokens) for g in m.kernel_groups] == [(1, 128), (0, -1)]
    assert [g.layer_indices for g in m.kernel_groups] == [[0, 1, 3, 4], [2, 5]]
    assert list(m.get_attn_desc().num_chunks_in_sw) == [1, -1]
    full_s, swa_s = list(range(1, 9)), [1, 2, 3, 4, 5, 6, 7, 8]  # two chunks
    full_d, swa_d = list(range(9, 17)), [8, 7, 6, 5, 4, 3, 2, 1]
    objs = store(m, a.kv_caches, a.block_ids(slots_of(full_s), slots_of(swa_s)))
    before = snapshot(dst.swa_kv_pool.k_buffer)
    load(b.manager, objs, b.kv_caches, b.block_ids(slots_of(full_d), slots_of(swa_d)))
    for buf_s, buf_d in zip(src.full_kv_pool.k_buffer, dst.full_kv_pool.k_buffer):
        for s, d in zip(full_s, full_d):
            assert torch.equal(page_rows(buf_d, d), page_rows(buf_s, s))
    # Sliding layers: only the last two pages (128 tokens) of the last chunk are written.
    for buf_s, buf_d in zip(src.swa_kv_pool.k_buffer, dst.swa_kv_pool.k_buffer):
        for s, d in zip(swa_s[-2:], swa_d[-2:]):
            assert torch.equal(page_rows(buf_d, d), page_rows(buf_s, s))
    assert_only_pages_changed(before, dst.swa_kv_pool.k_buffer, swa_d[-2:])


def test_slots_must_be_whole_aligned_pages():
    assert pages_from_token_slots(slots_of([4, 2]), PS) == [4, 2]
    with pytest.raises(ValueError, match="whole pages"):
        pages_from_token_slots(list(range(PS + 1)), PS)
    with pytest.raises(ValueError, match="page 1 holds"):
        pages_from_token_slots(slots_of([1]) + [x + 1 for x in slots_of([3])], PS)


def test_pool_errors_are_typed():
    with pytest.raises(TypeError, match="SGLang"):
        from_sglang_pool(object())
    with pytest.raises(ValueError, match="sliding_window"):
        from_sglang_pool(swa_pool(0))
    layout = from_sglang_pool(swa_pool(0), sliding_window=64)
    with pytest.raises(ValueError, match="swa_slots"):
        layout.block_ids(slots_of([1, 2, 3, 4]))


# --- recurrent state: MambaPool and MambaPoolHost ------------------------------------------

CONV, TEMPORAL = (96, 3), (4, 8, 8)  # GDN: [Q|K|V] channels x (kernel - 1); (H, Dv, Dk)


def mamba_pool(seed, size=10):
    return MambaPool(
        size=size, conv_shapes=[CONV], temporal_shape=TEMPORAL, num_mamba_layers=3, seed=seed
    )


def state_bytes(pool, layer, slot):
    """A slot's conv then temporal bytes, read by the pool's own indexing."""
    if isinstance(pool, MambaPoolHost):
        pick = (
            (lambda b: b[slot, layer, 0])
            if pool.layout != "layer_first"
            else (lambda b: b[layer, slot])
        )
        bufs = pool.conv_buffer + [pool.temporal_buffer]
    else:
        pick = lambda b: b[layer, slot]  # noqa: E731
        bufs = pool.mamba_cache.conv + [pool.mamba_cache.temporal]
    return torch.cat([pick(b).contiguous().view(torch.uint8).reshape(-1) for b in bufs])


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first", "page_first_direct"])
def test_mamba_snapshots_offload_to_a_host_pool_of_either_layout(host_layout):
    device = mamba_pool(seed=1)
    host = MambaPoolHost(mamba_pool(seed=9), size=12, layout=host_layout, seed=3)
    a, b = from_sglang_mamba_pool(device, chunk_size=256), from_sglang_mamba_pool(host)
    assert [
        (g.engine_kv_format, g.recurrent_state, g.tokens_per_block) for g in a.manager.kernel_groups
    ] == [(EngineKVFormat.NL_X_NB_CD_CW, True, 256), (EngineKVFormat.NL_X_NB_SH_SS, True, 256)]
    # A request whose state after chunks 1, 2, 3 sits in device slots 4, 7, 2 (snapshots).
    objs = store(a.manager, a.kv_caches, a.block_ids(None, state_slots=[4, 7, 2]))
    assert objs[0].shape == (3, 3 * (96 * 3 * 2 + 4 * 8 * 8 * 4))
    before = [state_bytes(host, layer, s) for layer in range(3) for s in range(12)]
    load(b.manager, objs, b.kv_caches, b.block_ids(None, state_slots=[0, 0, 11]))
    for layer in range(3):  # the last chunk's snapshot, into host slot 11; nothing else moved
        assert torch.equal(state_bytes(host, layer, 11), state_bytes(device, layer, 2))
        for s in range(11):
            assert torch.equal(state_bytes(host, layer, s), before[layer * 12 + s])


def test_a_hybrid_pool_and_its_mamba_pool_form_one_manager():
    kv = MHATokenToKVPool(
        size=16 * PS,
        page_size=PS,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=32,
        layer_num=2,
        seed=1,
    )
    states = mamba_pool(seed=2)
    layout = from_sglang_pool(kv, mamba_pool=states)
    m = layout.manager
    assert layout.state_layers == [2, 3, 4, 5, 6, 7]
    assert [o.recurrent_state for o in m.object_groups] == [False, True]
    assert m.get_attn_desc().num_chunks_in_sw == [-1, 1]
    # The attention objects are those of the pool alone (registered per layer here).
    alone = from_sglang_pool(kv)
    pages = slots_of([3, 9, 1, 12, 5, 6, 7, 8])
    both = store(m, layout.kv_caches, layout.block_ids(pages, state_slots=[5, 8]))
    assert torch.equal(both[0], store(alone.manager, alone.kv_caches, alone.block_ids(pages))[0])
    with pytest.raises(ValueError, match="one slot per 256 tokens"):
        layout.block_ids(pages, state_slots=[5])
    with pytest.raises(ValueError, match="state_slots"):
        layout.block_ids(pages)
