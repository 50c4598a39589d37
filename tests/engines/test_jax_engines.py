"""JAX engines' caches (tpu-inference / sglang-jax per-layer arrays, MaxText K/V page lists)
-> manager and ids, with real JAX transfers on CPU checked page by page."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from kvgroups_jax.engines import (  # noqa: E402
    from_maxtext,
    from_sglang_jax,
    from_sglang_jax_recurrent,
    from_tpu_inference,
    pages_from_page_map,
)

from kvgroups_core import EngineKVFormat, load, store  # noqa: E402

NP_, PS, NH, HD = 12, 64, 2, 32


def tpu_layer(rng, dtype):
    packing = 32 // (np.dtype(dtype).itemsize * 8)
    shape = (NP_, PS, 2 * NH // packing, packing, HD)
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tpu_inference_pages_round_trip(dtype):
    rng = np.random.default_rng(0)
    src = [tpu_layer(rng, dtype) for _ in range(3)]
    dst = [tpu_layer(rng, dtype) for _ in range(3)]
    a, b = from_tpu_inference(src), from_tpu_inference(dst)
    g = a.manager.kernel_groups[0]
    assert g.engine_kv_format is EngineKVFormat.NL_X_NB_BS_NH_TWO_HS
    assert (g.shape_desc.kv_size, g.shape_desc.nh, g.shape_desc.hs, g.shape_desc.bs) == (
        2,
        NH,
        HD,
        PS,
    )
    want = [np.asarray(x) for x in src]
    before = [np.asarray(x) for x in dst]
    objs = store(a.manager, a.kv_caches, [3, 7, 1, 9])
    out = b.to_engine(load(b.manager, objs, b.kv_caches, [2, 5, 11, 4]))
    for i, x in enumerate(out):
        x = np.asarray(x)
        assert x.shape == before[i].shape
        for s, d in zip([3, 7, 1, 9], [2, 5, 11, 4]):
            assert x[d].tobytes() == want[i][s].tobytes()
        rest = [p for p in range(NP_) if p not in (2, 5, 11, 4)]
        assert x[rest].tobytes() == before[i][rest].tobytes()


def test_hybrid_groups_and_windows_for_tpu_inference():
    rng = np.random.default_rng(1)
    src = [tpu_layer(rng, jnp.bfloat16) for _ in range(4)]
    a = from_tpu_inference(src, layer_groups=[[0, 2], [1, 3]], windows=[100, -1])
    m = a.manager
    assert [(g.layer_indices, g.engine_group_idx, g.sw_size_tokens) for g in m.kernel_groups] == [
        ([0, 2], 0, 128),
        ([1, 3], 1, -1),
    ]
    assert list(m.get_attn_desc().num_chunks_in_sw) == [1, -1]
    dst = [tpu_layer(rng, jnp.bfloat16) for _ in range(4)]
    b = from_tpu_inference(dst, layer_groups=[[0, 2], [1, 3]], windows=[100, -1])
    before = [np.asarray(x) for x in dst]
    ids_s = {0: [1, 2, 3, 4, 5, 6, 7, 8], 1: [8, 7, 6, 5, 4, 3, 2, 1]}  # two chunks of 4 pages
    ids_d = {0: [9, 10, 11, 0, 1, 2, 3, 4], 1: [0, 1, 2, 3, 4, 5, 6, 7]}
    objs = store(m, a.kv_caches, ids_s)
    out = [np.asarray(x) for x in b.to_engine(load(b.manager, objs, b.kv_caches, ids_d))]
    # Window of 128 tokens = the last two pages of the last chunk; nothing else written.
    for i in (0, 2):
        changed = [p for p in range(NP_) if out[i][p].tobytes() != before[i][p].tobytes()]
        assert changed == [3, 4]
        assert out[i][3].tobytes() == np.asarray(src[i])[7].tobytes()
    for i in (1, 3):
        for s, d in zip(ids_s[1], ids_d[1]):
            assert out[i][d].tobytes() == np.asarray(src[i])[s].tobytes()


def test_sglang_jax_pool_reads_its_kv_buffer():
    rng = np.random.default_rng(2)
    pool = SimpleNamespace(kv_buffer=[tpu_layer(rng, jnp.bfloat16) for _ in range(2)], page_size=PS)
    layout = from_sglang_jax(pool)
    assert layout.engine == "sglang_jax" and layout.manager.num_kernel_groups == 1


def test_maxtext_key_and_value_pages_round_trip():
    rng = np.random.default_rng(3)
    shape = (NH, NP_, PS, HD)
    ks = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2)]
    vs = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2)]
    a = from_maxtext(ks, vs)
    assert a.manager.kernel_groups[0].engine_kv_format is EngineKVFormat.TWO_X_NL_X_NH_NB_BS_HS
    page_state = SimpleNamespace(
        page_map=np.array([[0, 0, 0, 0], [6, 2, 9, 1]]), num_pages_used=np.array([0, 4])
    )
    ids = pages_from_page_map(page_state, 1)
    assert ids == [6, 2, 9, 1]
    objs = store(a.manager, a.kv_caches, ids)
    dk = [jnp.zeros(shape, jnp.float32) for _ in range(2)]
    dv = [jnp.zeros(shape, jnp.float32) for _ in range(2)]
    b = from_maxtext(dk, dv)
    new_k, new_v = load(b.manager, objs, b.kv_caches, [0, 1, 2, 3])
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(new_k[i])[:, :4], np.asarray(ks[i])[:, ids])
        np.testing.assert_array_equal(np.asarray(new_v[i])[:, :4], np.asarray(vs[i])[:, ids])
        assert not np.asarray(new_k[i])[:, 4:].any()


def test_engine_errors_are_typed():
    rng = np.random.default_rng(4)
    with pytest.raises(ValueError, match=r"kv_caches\[0\]"):
        from_tpu_inference([jnp.zeros((4, PS, NH, HD))])
    with pytest.raises(ValueError, match="one window per engine group"):
        from_tpu_inference([tpu_layer(rng, jnp.bfloat16)], windows=[64, -1])
    with pytest.raises(IndexError, match="layer 5"):
        from_tpu_inference([tpu_layer(rng, jnp.bfloat16)], layer_groups=[[5]])
    with pytest.raises(ValueError, match="value_pages"):
        from_maxtext([jnp.zeros((NH, 4, PS, HD))], [])
    with pytest.raises(IndexError, match="slot"):
        pages_from_page_map(SimpleNamespace(page_map=np.zeros((1, 2)), num_pages_used=[0]), 3)


# --- sglang-jax's RecurrentStatePool (GDN states) --------------------------------------------

SLOTS, CH, H, D = 9, 48, 2, 8  # conv [slots, Q|K|V channels, kernel - 1], temporal [slots, H, D, D]


def recurrent_pool(rng, layers=2):
    conv = [[jnp.asarray(rng.standard_normal((SLOTS, CH, 3)), jnp.bfloat16)] for _ in range(layers)]
    temporal = [
        jnp.asarray(rng.standard_normal((SLOTS, H, D, D)), jnp.float32) for _ in range(layers)
    ]
    return SimpleNamespace(
        recurrent_buffers=temporal,
        conv_buffers=conv,
        linear_recurrent_layer_ids=list(range(layers)),
    )


def test_sglang_jax_recurrent_snapshots_round_trip():
    rng = np.random.default_rng(5)
    src, dst = recurrent_pool(rng), recurrent_pool(rng)
    a, b = from_sglang_jax_recurrent(src), from_sglang_jax_recurrent(dst)
    assert [(g.engine_kv_format, g.recurrent_state) for g in a.manager.kernel_groups] == [
        (EngineKVFormat.NL_X_NB_CD_CW, True),
        (EngineKVFormat.NL_X_NB_SH_SS, True),
    ]
    before_t = [np.asarray(x) for x in dst.recurrent_buffers]
    objs = store(a.manager, a.kv_caches, [3, 7])  # snapshots after chunks 1 and 2
    temporal, conv = b.state_to_engine(load(b.manager, objs, b.kv_caches, [0, 5]))
    for layer in range(2):
        t = np.asarray(temporal[layer])
        assert t[5].tobytes() == np.asarray(src.recurrent_buffers[layer])[7].tobytes()
        assert (
            np.asarray(conv[layer][0])[5].tobytes()
            == np.asarray(src.conv_buffers[layer][0])[7].tobytes()
        )
        rest = [s for s in range(SLOTS) if s != 5]
        assert t[rest].tobytes() == before_t[layer][rest].tobytes()


def test_sglang_jax_kv_and_recurrent_pools_in_one_manager_inside_jit():
    rng = np.random.default_rng(6)
    kv = SimpleNamespace(kv_buffer=[tpu_layer(rng, jnp.bfloat16) for _ in range(2)], page_size=PS)
    layout = from_sglang_jax(kv, recurrent_pool=recurrent_pool(rng))
    m = layout.manager
    assert layout.state_layers == [2, 3, 4, 5]
    assert m.get_attn_desc().num_chunks_in_sw == [-1, 1]
    ids = {0: [1, 2, 3, 4, 5, 6, 7, 8], 1: [4, 6]}  # two chunks: 4 pages each, one slot each
    objs = store(m, layout.kv_caches, ids)
    dst = from_sglang_jax(
        SimpleNamespace(kv_buffer=[tpu_layer(rng, jnp.bfloat16) for _ in range(2)], page_size=PS),
        recurrent_pool=recurrent_pool(rng),
    )

    @jax.jit
    def step(caches, objects, pages, slots):
        return load(dst.manager, objects, caches, {0: pages, 1: slots})

    out = step(dst.kv_caches, objs, jnp.asarray([9, 10, 11, 0, 1, 2, 3, 4]), jnp.asarray([0, 8]))
    temporal, conv = dst.state_to_engine(out)
    src_t = np.asarray(layout.kv_caches[3])  # layer 0's temporal state
    assert np.asarray(temporal[0])[8].tobytes() == src_t[6].tobytes()
    attention = dst.to_engine(out)
    assert (
        np.asarray(attention[1])[4].tobytes()
        == np.asarray(layout.to_engine(layout.kv_caches)[1])[8].tobytes()
    )
