"""Recurrent state across tensor-parallel degrees (docs/SEMANTICS.md section 9): temporal states
split by heads, conv states by sub-projection (GDN ``Q|K|V``, Mamba2 ``x|B|C`` with B and C
replicated when ``n_groups < tp``). The shards are cut here, independently of kvgroups, from
whole-model caches; a TP=2 store merged must equal the TP=1 store byte for byte."""

import ml_dtypes
import numpy as np
import pytest

from kvgroups_core import (
    EngineGroupInfo,
    KVLayerGroupsManager,
    merge_shards,
    split_canonical,
    store,
)
from kvgroups_core import EngineKVFormat as F
from kvgroups_core.errors import UnsupportedConfigError

NB, CHUNK, TPB, W = 10, 8, 4, 3
BF16 = np.dtype(ml_dtypes.bfloat16)


def _bits(shape, dtype, rng):
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def gdn(k_heads=4, v_heads=4, dk=8, dv=8):
    """(projections, temporal heads and head shape): GDN conv = [Q | K | V]."""
    return ((k_heads * dk, k_heads), (k_heads * dk, k_heads), (v_heads * dv, v_heads)), (
        v_heads,
        (dv, dk),
    )


def mamba2(heads=4, head_dim=16, groups=1, state=16):
    """Mamba2 conv = [x | B | C], B and C of ``groups`` groups of ``state`` channels."""
    return ((heads * head_dim, heads), (groups * state, groups), (groups * state, groups)), (
        heads,
        (head_dim, state),
    )


def _rank_channels(projections, t, r):
    """Channel indices of rank r: its part of every projection (a projection with fewer units
    than ranks is held whole-unit by rank groups: unit r // (t / units))."""
    out, start = [], 0
    for channels, units in projections:
        parts = min(units, t)
        width = channels // parts
        part = r // (t // parts)
        out.extend(range(start + part * width, start + (part + 1) * width))
        start += channels
    return np.asarray(out)


def whole_model(kind, orientation, rng):
    projections, (heads, head) = kind
    d = sum(c for c, _ in projections)
    conv_shape = (d, W) if orientation == "DS" else (W, d)
    layers = []
    for _ in range(2):
        layers.append(_bits((NB,) + conv_shape, BF16, rng))
        layers.append(_bits((NB, heads) + head, np.dtype(np.float32), rng))
        layers.append(_bits((NB, 4, TPB, 16), np.dtype(np.float16), rng))  # attention, 4 heads
    return layers


def shard(layers, kind, orientation, t, r):
    projections, (heads, _) = kind
    idx = _rank_channels(projections, t, r)
    out = []
    for i, x in enumerate(layers):
        if i % 3 == 0:
            part = x[:, idx, :] if orientation == "DS" else x[:, :, idx]
        else:
            h = x.shape[1] // t
            part = x[:, r * h : (r + 1) * h]
        out.append(np.ascontiguousarray(part))
    return out


def manager(caches, kind, orientation, t=1, r=0, *, projections=True, **kw):
    conv_fmt = F.NL_X_NB_CD_CW if orientation == "DS" else F.NL_X_NB_CW_CD
    formats = [conv_fmt, F.NL_X_NB_SH_SS, F.NL_X_NB_NH_BS_CS] * 2
    infos = [
        EngineGroupInfo(
            0, (0, 3), TPB, recurrent_state=True, conv_projections=kind[0] if projections else ()
        ),
        EngineGroupInfo(0, (1, 4), TPB, recurrent_state=True),
        EngineGroupInfo(1, (2, 5), TPB),
    ]
    return KVLayerGroupsManager(
        caches, formats, infos, lmcache_tokens_per_chunk=CHUNK, tp_rank=r, tp_size=t, **kw
    )


IDS = {0: [0, 3, 0, 7, 0, 1], 1: [2, 5, 8, 9, 4, 6]}
CASES = [
    ("gdn", gdn(), "DS"),
    ("gdn", gdn(), "SD"),
    ("mamba2-groups<tp", mamba2(), "DS"),
    ("mamba2-groups<tp", mamba2(), "SD"),
    ("mamba2-4-groups", mamba2(groups=4), "SD"),
]


@pytest.mark.parametrize(
    "name,kind,orientation", CASES, ids=lambda x: x if isinstance(x, str) else None
)
@pytest.mark.parametrize("t", [2, 4])
def test_a_merged_tp_store_is_the_tp1_store_and_splits_back(name, kind, orientation, t):
    rng = np.random.default_rng(3)
    whole = whole_model(kind, orientation, rng)
    canonical = store(manager(whole, kind, orientation), whole, IDS, backend="numpy")
    ranks = [shard(whole, kind, orientation, t, r) for r in range(t)]
    managers = [manager(ranks[r], kind, orientation, t, r) for r in range(t)]
    per_rank = [store(m, c, IDS, backend="numpy") for m, c in zip(managers, ranks)]
    assert managers[0].fingerprint(across_degrees=True) == manager(
        whole, kind, orientation
    ).fingerprint(across_degrees=True)
    merged = merge_shards(managers, per_rank)
    for got, want in zip(merged, canonical):
        assert got.shape == want.shape and np.array_equal(got, want)
    for m, objs in zip(managers, per_rank):
        for got, want in zip(split_canonical(m, canonical), objs):
            assert np.array_equal(got, want)


def test_tp_native_objects_of_a_gdn_state_merge_and_split():
    rng = np.random.default_rng(4)
    kind, t = gdn(), 2
    whole = whole_model(kind, "DS", rng)
    canonical = store(manager(whole, kind, "DS"), whole, IDS, backend="numpy")
    ranks = [shard(whole, kind, "DS", t, r) for r in range(t)]
    managers = [manager(ranks[r], kind, "DS", t, r, object_layout="tp_native") for r in range(t)]
    shared = None
    for m, c in zip(managers, ranks):
        shared = store(m, c, IDS, shared, backend="numpy")  # each rank fills its own ranges
    for got, want in zip(merge_shards(managers, [shared] * t), canonical):
        assert np.array_equal(got, want)
    for got, want in zip(split_canonical(managers[1], canonical), shared):
        assert np.array_equal(got, want)


def test_conv_states_without_projections_move_but_do_not_merge():
    rng = np.random.default_rng(5)
    kind = gdn()
    whole = whole_model(kind, "SD", rng)
    ranks = [shard(whole, kind, "SD", 2, r) for r in range(2)]
    managers = [manager(ranks[r], kind, "SD", 2, r, projections=False) for r in range(2)]
    per_rank = [store(m, c, IDS, backend="numpy") for m, c in zip(managers, ranks)]
    with pytest.raises(ValueError, match="conv_projections"):
        merge_shards(managers, per_rank)
    with pytest.raises(ValueError, match="conv_projections"):
        split_canonical(managers[0], per_rank[0])


def test_projections_must_fit_the_rank_state_and_the_tp_degree():
    rng = np.random.default_rng(6)
    kind = gdn()
    ranks = shard(whole_model(kind, "DS", rng), kind, "DS", 2, 0)
    bad = (((32, 4), (32, 4), (16, 2)),) + kind[1:]
    with pytest.raises(ValueError, match="conv_projections"):
        manager(ranks, bad, "DS", 2, 0)
    odd = (((30, 3), (30, 3), (36, 3)),) + kind[1:]
    with pytest.raises(ValueError, match="multiple or a divisor of tp_size"):
        manager(ranks, odd, "DS", 2, 0)
    m2 = mamba2()
    m2_rank = shard(whole_model(m2, "DS", rng), m2, "DS", 2, 0)
    with pytest.raises(UnsupportedConfigError, match="tp_native"):
        manager(m2_rank, m2, "DS", 2, 0, object_layout="tp_native")


def test_merging_torch_objects_gives_the_numpy_bytes():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    kind, t = gdn(), 2
    whole = whole_model(kind, "SD", rng)
    canonical = store(manager(whole, kind, "SD"), whole, IDS, backend="numpy")
    ranks = [shard(whole, kind, "SD", t, r) for r in range(t)]
    managers = [manager(ranks[r], kind, "SD", t, r) for r in range(t)]
    per_rank = [
        [torch.from_numpy(o) for o in store(m, c, IDS, backend="numpy")]
        for m, c in zip(managers, ranks)
    ]
    merged = merge_shards(managers, per_rank)
    assert all(isinstance(x, torch.Tensor) for x in merged)
    for got, want in zip(merged, canonical):
        assert np.array_equal(got.numpy(), want)
