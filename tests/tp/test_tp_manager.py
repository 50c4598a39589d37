"""The manager of one rank's shard: its place, replicated groups, fingerprints, bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvgroups_core import (
    EngineGroupInfo,
    EngineKVFormat,
    KVGroupsError,
    KVGroupsTypeError,
    KVGroupsValueError,
    KVLayerGroupsManager,
    TensorSpec,
    UnsupportedConfigError,
    merge_shards,
    object_regions,
    split_canonical,
    store,
)
from tests.support.tp_models import MODELS, block_ids, make_model_caches, manager, shard_caches

F = EngineKVFormat
ROOT = Path(__file__).resolve().parents[2]


def specs(shape, n, dtype="float16"):
    return [TensorSpec(shape, dtype) for _ in range(n)]


def shard_manager(model_name, rank, size, **kw):
    model = MODELS[model_name]
    full = make_model_caches(model, np.random.default_rng(0))
    return manager(model, shard_caches(model, full, rank, size), rank, size, **kw)


def test_defaults_are_one_rank_holding_everything():
    m = KVLayerGroupsManager(specs((2, 8, 16, 4, 32), 2), F.NL_X_TWO_NB_BS_NH_HS)
    assert (m.tp_rank, m.tp_size, m.object_layout) == (0, 1, "canonical")
    shard = m.tp_shard(0)
    assert (shard.total_heads, shard.rank_heads, shard.num_parts, shard.part) == (4, 4, 1, 0)
    assert not m.is_replicated(0) and shard.is_owner


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_sharded_group_knows_its_heads_of_the_whole_model(rank):
    m = KVLayerGroupsManager(
        specs((2, 8, 16, 2, 32), 3), F.NL_X_TWO_NB_BS_NH_HS, tp_rank=rank, tp_size=4
    )
    shard = m.tp_shard(0)
    assert (shard.total_heads, shard.rank_heads, shard.head_start) == (8, 2, 2 * rank)
    assert (shard.num_parts, shard.replicas, shard.part) == (4, 1, rank)
    assert not m.is_replicated(0)


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_mla_latents_and_indexer_are_replicated_on_every_rank(rank):
    model = MODELS["mla-indexer"]
    m = manager(model, make_model_caches(model, np.random.default_rng(0)), rank, 4)
    assert m.num_kernel_groups == 2
    for k in range(2):
        shard = m.tp_shard(k)
        assert m.is_replicated(k)
        assert (shard.total_heads, shard.num_parts, shard.replicas) == (1, 1, 4)
        assert shard.is_owner == (rank == 0)


@pytest.mark.parametrize("rank,head", [(0, 0), (1, 0), (2, 0), (3, 0), (4, 1), (7, 1)])
def test_fewer_heads_than_ranks_replicates_each_head_like_vllm(rank, head):
    m = KVLayerGroupsManager(
        specs((2, 8, 16, 1, 32), 2),
        F.NL_X_TWO_NB_BS_NH_HS,
        tp_rank=rank,
        tp_size=8,
        total_num_kv_heads=2,
    )
    shard = m.tp_shard(0)
    assert m.is_replicated(0)
    assert (shard.replicas, shard.num_parts, shard.head_start) == (4, 2, head)
    assert shard.is_owner == (rank % 4 == 0)


def test_hybrid_model_marks_only_its_two_head_group_replicated_at_tp4():
    m = shard_manager("hybrid-full-sw-gqa2", 1, 4)
    assert [m.is_replicated(k) for k in range(m.num_kernel_groups)] == [False, False, True]
    assert [m.tp_shard(k).total_heads for k in range(3)] == [8, 8, 2]


def test_tp_shard_index_out_of_range_is_an_index_error():
    m = KVLayerGroupsManager(
        specs((2, 8, 16, 2, 32), 1), F.NL_X_TWO_NB_BS_NH_HS, tp_rank=0, tp_size=2
    )
    with pytest.raises(IndexError, match="kernel_group_idx"):
        m.tp_shard(1)


def test_repr_names_the_rank_when_sharded():
    m = shard_manager("mha-nhd", 1, 2, object_layout="tp_native")
    assert "tp_rank=1, tp_size=2" in repr(m) and "tp_native" in repr(m)


# --- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(tp_size=0), "tp_size: expected a rank count >= 1, got 0"),
        (dict(tp_size=-2), "tp_size: expected a rank count >= 1, got -2"),
        (dict(tp_rank=-1, tp_size=2), r"tp_rank: expected a rank in \[0, 2\), got -1"),
        (dict(tp_rank=2, tp_size=2), r"tp_rank: expected a rank in \[0, 2\), got 2"),
        (dict(tp_rank=1), r"tp_rank: expected a rank in \[0, 1\), got 1"),
        (dict(object_layout="page_head"), "object_layout: expected one of"),
        (dict(tp_size=2, total_num_kv_heads=[8]), "expected one head count per layer"),
        (dict(tp_size=2, total_num_kv_heads=0), "total_num_kv_heads"),
    ],
)
def test_bad_tp_arguments_raise_typed_value_errors(kw, match):
    with pytest.raises(KVGroupsValueError, match=match) as info:
        KVLayerGroupsManager(specs((2, 8, 16, 2, 32), 2), F.NL_X_TWO_NB_BS_NH_HS, **kw)
    assert isinstance(info.value, ValueError) and isinstance(info.value, KVGroupsError)


@pytest.mark.parametrize("kw", [dict(tp_rank="0"), dict(tp_size=2.0), dict(tp_rank=True)])
def test_non_integer_rank_or_size_is_a_type_error(kw):
    with pytest.raises(KVGroupsTypeError):
        KVLayerGroupsManager(specs((2, 8, 16, 2, 32), 2), F.NL_X_TWO_NB_BS_NH_HS, **kw)


def test_tp_arguments_are_keyword_only():
    with pytest.raises(TypeError):
        KVLayerGroupsManager(
            specs((2, 8, 16, 2, 32), 1), F.NL_X_TWO_NB_BS_NH_HS, (), 256, True, 0, 2
        )


@pytest.mark.parametrize(
    "heads,size,total,match",
    [
        (3, 2, 8, "8 KV heads split evenly over 2 ranks"),  # shard does not hold 8 / 2 heads
        (2, 4, 6, "6 KV heads split evenly over 4 ranks"),  # 6 heads do not split over 4
        (1, 8, 3, "tp_size 8 to be a multiple of its 3 KV heads"),
        (2, 8, 2, "got a shard of 2 heads"),  # with 2 heads over 8 ranks each rank holds 1
    ],
)
def test_shard_that_does_not_fit_the_degree_is_a_value_error(heads, size, total, match):
    with pytest.raises(KVGroupsValueError, match=match):
        KVLayerGroupsManager(
            specs((2, 8, 16, heads, 32), 2),
            F.NL_X_TWO_NB_BS_NH_HS,
            tp_rank=0,
            tp_size=size,
            total_num_kv_heads=total,
        )


def test_layers_one_shard_cannot_tell_apart_are_unsupported():
    # At TP 4 a 4-head layer and a 2-head layer both leave 1 head per rank: one kernel group
    # on the rank, two in the whole model.
    with pytest.raises(UnsupportedConfigError, match="mixes total head counts"):
        KVLayerGroupsManager(
            specs((2, 8, 16, 1, 32), 2),
            F.NL_X_TWO_NB_BS_NH_HS,
            tp_rank=0,
            tp_size=4,
            total_num_kv_heads=[4, 2],
        )


def test_merge_and_split_reject_bad_input_before_building_anything():
    model = MODELS["hybrid-full-sw-gqa2"]
    rng = np.random.default_rng(0)
    full = make_model_caches(model, rng)
    ids = block_ids(model, 2, rng)
    shards = [shard_caches(model, full, r, 2) for r in range(2)]
    ms = [manager(model, shards[r], r, 2) for r in range(2)]
    objs = [store(ms[r], shards[r], ids, backend="numpy") for r in range(2)]
    with pytest.raises(KVGroupsValueError, match="expected 2 managers"):
        merge_shards(ms + ms[:1], objs + objs[:1])
    with pytest.raises(KVGroupsValueError, match="2 shards' objects side by side"):
        merge_shards(ms[:1], objs[:1])  # one manager: objects of every shard, side by side
    with pytest.raises(KVGroupsValueError, match=r"managers\[0\].tp_rank: expected 0, got 1"):
        merge_shards(ms[::-1], objs)
    other = manager(MODELS["hybrid-full-sw-gqa2"], shards[1], 1, 2, object_layout="tp_native")
    with pytest.raises(KVGroupsValueError, match=r"managers\[1\]: expected the grouping"):
        merge_shards([ms[0], other], objs)
    with pytest.raises(KVGroupsTypeError, match="managers"):
        merge_shards(ms[0], objs)
    with pytest.raises(KVGroupsValueError, match="objects_per_rank: expected 2 entries"):
        merge_shards(ms, objs[:1])
    with pytest.raises(KVGroupsValueError, match=r"objects_per_rank\[1\]: expected 2 entries"):
        merge_shards(ms, [objs[0], objs[1][:1]])
    bad = [objs[0], [objs[1][0], objs[1][1][:, :-1]]]
    with pytest.raises(KVGroupsValueError, match=r"objects_per_rank\[1\]\[1\]: expected uint8"):
        merge_shards(ms, bad)
    with pytest.raises(KVGroupsValueError, match="one chunk count"):
        merge_shards(ms, [objs[0], [o[:1] for o in objs[1]]])
    with pytest.raises(KVGroupsValueError, match=r"objects\[0\]: expected uint8"):
        split_canonical(ms[0], objs[0])  # a rank's objects are not canonical ones
    with pytest.raises(KVGroupsValueError, match=r"objects\[0\]: expected uint8"):
        split_canonical(ms[0], [o.view(np.int8) for o in objs[0]])
    with pytest.raises(KVGroupsTypeError, match="objects: expected a list"):
        split_canonical(ms[0], objs[0][0])


# --- fingerprints -----------------------------------------------------------------------


def test_ranks_of_one_tp_group_share_a_fingerprint():
    for name in MODELS:
        prints = {shard_manager(name, r, 4).fingerprint() for r in range(4)}
        assert len(prints) == 1, name
        assert len(prints.pop()) == 64


def test_fingerprint_across_degrees_is_the_same_for_every_degree_and_layout():
    for name in ("mha-nhd", "hybrid-full-sw-gqa2", "mla-indexer"):
        prints = {
            shard_manager(name, r, t, object_layout=layout).fingerprint(across_degrees=True)
            for t in (1, 2, 4, 8)
            for r in range(t)
            for layout in ("canonical", "tp_native")
        }
        assert len(prints) == 1, name


def _mha(fmt=F.NL_X_TWO_NB_BS_NH_HS, shape=(2, 8, 16, 2, 32), dtype="float16", n=2, **kw):
    kw.setdefault("tp_size", 4)
    return KVLayerGroupsManager(specs(shape, n, dtype), fmt, **kw)


def test_fingerprint_changes_with_grouping_chunk_formats_dtypes_layout_and_degree():
    base = _mha().fingerprint()
    variants = {
        "chunk": _mha(lmcache_tokens_per_chunk=128),
        "format": _mha(F.NL_X_TWO_NB_NH_BS_HS, (2, 8, 2, 16, 32)),  # same sizes, HND
        "dtype": _mha(dtype="bfloat16"),
        "layout": _mha(object_layout="tp_native"),
        "degree": _mha(shape=(2, 8, 16, 1, 32), tp_size=8),
        "grouping": _mha(
            engine_group_infos=[
                EngineGroupInfo(engine_group_id=0, layer_indices=(0,)),
                EngineGroupInfo(engine_group_id=1, layer_indices=(1,)),
            ]
        ),
        "layers": _mha(n=3),
        "head_size": _mha(shape=(2, 8, 16, 2, 64)),
        "replicated": _mha(shape=(2, 8, 16, 1, 32), tp_size=8, total_num_kv_heads=4),
    }
    prints = {name: m.fingerprint() for name, m in variants.items()}
    assert base not in prints.values()
    assert len(set(prints.values())) == len(prints)
    # ... and not with the rank or the block count (ranks may size their pools alike or not).
    assert _mha(tp_rank=3).fingerprint() == base
    assert _mha(shape=(2, 64, 16, 2, 32)).fingerprint() == base


def test_fingerprint_changes_with_full_sw_mode_and_object_group_separation():
    model = MODELS["hybrid-full-sw-gqa2"]
    full = make_model_caches(model, np.random.default_rng(0))
    base = manager(model, full).fingerprint()
    assert manager(model, full, separate_object_groups=False).fingerprint() != base
    m = manager(model, full)
    m.enable_full_sw_kv()
    assert m.fingerprint() != base


def test_fingerprint_is_stable_across_processes():
    code = (
        "from kvgroups_core import KVLayerGroupsManager, TensorSpec, EngineKVFormat as F;"
        "print(KVLayerGroupsManager([TensorSpec((2, 8, 16, 2, 32), 'float16')] * 2, "
        "F.NL_X_TWO_NB_BS_NH_HS, tp_rank=1, tp_size=4).fingerprint())"
    )
    env_path = f"{ROOT}:{ROOT / 'backends'}"
    outs = set()
    for seed in ("1", "2"):
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={"PYTHONPATH": env_path, "PYTHONHASHSEED": seed},
            check=True,
        )
        outs.add(done.stdout.strip())
    assert outs == {_mha(tp_rank=1).fingerprint()}


def test_merge_of_two_frameworks_is_a_type_error():
    torch = pytest.importorskip("torch")
    model = MODELS["mha-nhd"]
    rng = np.random.default_rng(0)
    full = make_model_caches(model, rng)
    ids = block_ids(model, 1, rng)
    shards = [shard_caches(model, full, r, 2) for r in range(2)]
    ms = [manager(model, shards[r], r, 2) for r in range(2)]
    objs = [store(ms[r], shards[r], ids, backend="numpy") for r in range(2)]
    with pytest.raises(KVGroupsTypeError, match=r"one framework, got \['numpy', 'torch'\]"):
        merge_shards(ms, [objs[0], [torch.from_numpy(o) for o in objs[1]]])


def test_check_replicas_names_a_rank_whose_replicated_copy_differs():
    model = MODELS["hybrid-full-sw-gqa2"]  # its 2-head layer is replicated by 2 ranks at TP 4
    rng = np.random.default_rng(0)
    full = make_model_caches(model, rng)
    ids = block_ids(model, 2, rng)
    shards = [shard_caches(model, full, r, 4) for r in range(4)]
    ms = [manager(model, shards[r], r, 4) for r in range(4)]
    objs = [store(ms[r], shards[r], ids, backend="numpy") for r in range(4)]
    good = merge_shards(ms, objs, check_replicas=True)
    og, region = next(
        (og, reg)
        for og in range(ms[0].num_object_groups)
        for reg in object_regions(ms[3], og)
        if ms[3].is_replicated(reg.kernel_group_idx)
    )
    objs[3][og][1, region.offset + 5] ^= 0xFF  # rank 3 holds head 1 after rank 2
    assert all(np.array_equal(a, b) for a, b in zip(merge_shards(ms, objs), good))  # owner's
    with pytest.raises(KVGroupsValueError, match=r"objects_per_rank\[3\].*rank 2's copy"):
        merge_shards(ms, objs, check_replicas=True)
