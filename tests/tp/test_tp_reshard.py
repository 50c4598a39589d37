"""Objects written at TP=p read by a rank of TP=d (kvgroups_core.tp_reshard): each reading
rank reads only the byte ranges its plan names (every other byte of the source objects is
scrambled first) and assembles exactly the objects a split of the canonical objects gives
it; the plan reads whole regions only, and at equal degree and layout it reads the rank's
own object as it is."""

from __future__ import annotations

import numpy as np
import pytest

from kvgroups_core import (
    KVGroupsTypeError,
    KVGroupsValueError,
    load,
    object_nbytes,
    rank_byte_ranges,
    split_canonical,
    store,
)
from kvgroups_core.transfer import tp_reshard
from kvgroups_core.transfer.tp_reshard import assemble, coalesce, degree_view, plan_reads
from tests.support.tp_models import (
    MODELS,
    block_ids,
    make_model_caches,
    manager,
    reference_load,
    reference_store,
    shard_caches,
    to_backend,
    to_numpy,
)

DEGREES = [1, 2, 4, 8]
CHUNKS = 3


def source_objects(model, full, ids, p, layout):
    """What each writer rank's store gives: its shard's objects (canonical), or its parts of a
    fresh full-size object of its own (TP-native, the rest left as 0xEE)."""
    out = []
    for r in range(p):
        shard = shard_caches(model, full, r, p)
        m = manager(model, shard, r, p, object_layout=layout)
        if layout == "canonical":
            out.append(store(m, shard, ids, backend="numpy"))
        else:
            objs = [
                np.full((CHUNKS, object_nbytes(m, og)), 0xEE, np.uint8)
                for og in range(m.num_object_groups)
            ]
            out.append(store(m, shard, ids, objs, backend="numpy"))
    return out


def only_ranges(obj, ranges, rng):
    """A copy of ``obj`` with every byte outside ``ranges`` scrambled."""
    out = rng.integers(0, 256, obj.shape, dtype=np.uint8)
    for offset, nbytes in ranges:
        out[:, offset : offset + nbytes] = obj[:, offset : offset + nbytes]
    return out


def read_bytes(m, og, obj):
    """The bytes of ``obj`` that ``m``'s load reads."""
    if m.object_layout == "canonical":
        return obj
    return np.concatenate([obj[:, o : o + n] for o, n in rank_byte_ranges(m, og)], axis=1)


def check_pair(model_name, p, d, src_layout, dst_layout, backend="numpy"):
    model = MODELS[model_name]
    rng = np.random.default_rng(p * 10 + d)
    full = make_model_caches(model, rng)
    ids = block_ids(model, CHUNKS, rng)
    canonical = reference_store(model, full, ids)
    written = source_objects(model, full, ids, p, src_layout)
    for r in range(d):
        dst = manager(model, shard_caches(model, full, r, d), r, d, object_layout=dst_layout)
        plan = plan_reads(dst, p, src_layout)
        want = split_canonical(dst, canonical)
        for og, reads in enumerate(plan.objects):
            staged = {
                s: to_backend(only_ranges(written[s][og], reads.ranges[s], rng), backend)
                for s in reads.ranges
            }
            got = to_numpy(assemble(reads, staged))
            assert got.shape == (CHUNKS, object_nbytes(dst, og))
            assert np.array_equal(read_bytes(dst, og, got), read_bytes(dst, og, want[og])), (
                model_name,
                p,
                d,
                r,
                og,
            )
            nbytes = sum(n for rs in reads.ranges.values() for _, n in rs)
            assert nbytes >= object_nbytes(dst, og) or dst_layout == "tp_native"
    return plan


@pytest.mark.parametrize("d", DEGREES)
@pytest.mark.parametrize("p", DEGREES)
@pytest.mark.parametrize("model_name", ["hybrid-full-sw-gqa2", "mla-indexer"])
def test_every_degree_pair_assembles_the_split_of_the_canonical_objects(model_name, p, d):
    check_pair(model_name, p, d, "canonical", "canonical")


@pytest.mark.parametrize(("p", "d"), [(1, 4), (4, 1), (2, 8), (8, 2), (4, 4)])
@pytest.mark.parametrize(
    ("src", "dst"),
    [("tp_native", "canonical"), ("canonical", "tp_native"), ("tp_native", "tp_native")],
)
def test_tp_native_writers_and_readers(p, d, src, dst):
    check_pair("hybrid-full-sw-gqa2", p, d, src, dst)


@pytest.mark.parametrize(
    "model_name", ["mha-nhd", "sglang-kv-list", "jax-interleaved", "cross-layer-trtllm"]
)
def test_other_formats_4_to_2_and_2_to_4(model_name):
    check_pair(model_name, 4, 2, "canonical", "canonical")
    check_pair(model_name, 2, 4, "tp_native", "canonical")


def test_torch_staging_assembles_torch_objects():
    pytest.importorskip("torch")
    check_pair("hybrid-full-sw-gqa2", 2, 4, "canonical", "canonical", backend="torch")
    check_pair("hybrid-full-sw-gqa2", 4, 2, "tp_native", "tp_native", backend="torch")


@pytest.mark.parametrize("layout", ["canonical", "tp_native"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_equal_degree_reads_its_own_object_whole_and_returns_it_as_is(tp, layout):
    model = MODELS["hybrid-full-sw-gqa2"]
    full = make_model_caches(model, np.random.default_rng(0))
    for r in range(tp):
        dst = manager(model, shard_caches(model, full, r, tp), r, tp, object_layout=layout)
        plan = plan_reads(dst, tp, layout)
        assert plan.src_ranks == (r,)
        for og, reads in enumerate(plan.objects):
            assert reads.identity_rank == r
            want = (
                ((0, object_nbytes(dst, og)),)
                if layout == "canonical"
                else coalesce(rank_byte_ranges(dst, og))
            )
            assert reads.ranges[r] == want
            staged = {r: np.zeros((2, reads.src_nbytes), np.uint8)}
            assert assemble(reads, staged) is staged[r]


def test_reading_from_a_higher_degree_takes_every_source_rank_once_per_region():
    model = MODELS["mha-nhd"]  # 8 heads
    full = make_model_caches(model, np.random.default_rng(0))
    dst = manager(model, shard_caches(model, full, 1, 2), 1, 2)  # heads 4..7
    plan = plan_reads(dst, 8)
    assert plan.src_ranks == (4, 5, 6, 7)
    (reads,) = plan.objects
    assert all(reads.ranges[r] == ((0, reads.src_nbytes),) for r in plan.src_ranks)


def test_tp_native_sources_give_one_range_per_region_for_a_lower_degree_reader():
    model = MODELS["mha-nhd"]
    full = make_model_caches(model, np.random.default_rng(0))
    dst = manager(model, shard_caches(model, full, 0, 1), 0, 1)
    plan = plan_reads(dst, 4, "tp_native")
    (reads,) = plan.objects
    # One TP-native object holds every rank's part; a TP=1 reader wants all of it, from any
    # one writer's parts: the ranges of the four writers tile the object.
    spans = sorted(s for r in reads.ranges for s in reads.ranges[r])
    assert coalesce(spans) == ((0, reads.src_nbytes),)


def test_layer_ranges_cover_exactly_the_rows_of_those_layers():
    model = MODELS["hybrid-full-sw-gqa2"]
    rng = np.random.default_rng(5)
    full = make_model_caches(model, rng)
    before = make_model_caches(model, rng)
    ids = block_ids(model, CHUNKS, rng)
    m = manager(model, full)
    plan = plan_reads(m, 1)
    objects = store(m, full, ids, backend="numpy")
    caches = [x.copy() for x in before]
    for layer in range(len(model.layers)):
        staged = []
        for og, reads in enumerate(plan.objects):
            ranges = reads.layer_ranges(0, [layer])
            staged.append(only_ranges(objects[og], ranges, rng))
        load(
            manager(model, caches),
            [assemble(r, {0: s}) for r, s in zip(plan.objects, staged)],
            caches,
            ids,
            layers=[layer],
            backend="numpy",
        )
    want = reference_load(model, objects, before, ids)
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(caches, want))


def test_a_degree_that_does_not_fit_the_heads_is_refused():
    model = MODELS["mha-nhd"]  # 8 heads
    m = manager(model, make_model_caches(model, np.random.default_rng(0)))
    with pytest.raises(KVGroupsValueError, match="tp_size: expected a degree that divides"):
        plan_reads(m, 3)
    with pytest.raises(KVGroupsValueError, match="object_layout"):
        degree_view(m, 2, 0, "rows")
    with pytest.raises(KVGroupsValueError, match="tp_rank"):
        degree_view(m, 2, 2)


@pytest.mark.parametrize("p", [0, -1])
def test_a_source_degree_below_one_is_refused_by_name(p):
    model = MODELS["mha-nhd"]
    m = manager(model, make_model_caches(model, np.random.default_rng(0)))
    with pytest.raises(KVGroupsValueError, match="src_tp_size: expected a rank count >= 1"):
        plan_reads(m, p)


@pytest.mark.parametrize("p", [True, 2.0, "2", None])
def test_a_source_degree_that_is_not_an_int_is_refused_by_name(p):
    model = MODELS["mha-nhd"]
    m = manager(model, make_model_caches(model, np.random.default_rng(0)))
    with pytest.raises(KVGroupsTypeError, match="src_tp_size: expected an int"):
        plan_reads(m, p)


def test_plan_reads_of_many_replicated_writers_reads_only_the_ranks_it_needs(monkeypatch):
    # A publication's tp_size comes from another process: a huge degree (every head
    # replicated 2**58 times) must plan as fast as a small one, not build a view per rank.
    views = []
    init = tp_reshard.DegreeView.__init__

    def counted(self, *args, **kwargs):
        views.append(args[2])  # the rank
        assert len(views) <= 16, "plan_reads builds a view per writer rank"
        init(self, *args, **kwargs)

    monkeypatch.setattr(tp_reshard.DegreeView, "__init__", counted)
    model = MODELS["mha-nhd"]  # 8 heads
    full = make_model_caches(model, np.random.default_rng(0))
    dst = manager(model, shard_caches(model, full, 1, 2), 1, 2)  # heads 4..7
    big = 2**61
    plan = plan_reads(dst, big)
    replicas = big // 8
    assert plan.src_tp_size == big
    # The reader's counterpart (rank big / 2 holds head 4) for its first head, and one
    # replica of each following head: the first one, as plan_reads(dst, 16) picks.
    assert plan.src_ranks == (4 * replicas, 5 * replicas, 6 * replicas, 7 * replicas)
    small = plan_reads(dst, 16)
    assert small.src_ranks == (8, 10, 12, 14)
    (a,), (b,) = plan.objects, small.objects
    assert (a.src_nbytes, a.dst_nbytes, a.identity_rank) == (b.src_nbytes, b.dst_nbytes, None)
    assert list(a.ranges.values()) == list(b.ranges.values())
    assert sorted(set(views)) == sorted({0, *plan.src_ranks, *small.src_ranks})


def test_assemble_refuses_what_is_not_a_plan_or_a_mapping():
    model = MODELS["mha-nhd"]
    m = manager(model, make_model_caches(model, np.random.default_rng(0)))
    (reads,) = plan_reads(m, 1).objects
    with pytest.raises(KVGroupsTypeError, match="reads: expected an ObjectReads"):
        assemble(None, {})
    with pytest.raises(KVGroupsTypeError, match="reads: expected an ObjectReads"):
        assemble(plan_reads(m, 1), {})
    with pytest.raises(KVGroupsTypeError, match="staged: expected a mapping"):
        assemble(reads, [np.zeros((1, reads.src_nbytes), np.uint8)])


def test_assemble_refuses_missing_or_misshapen_staging():
    model = MODELS["mha-nhd"]
    full = make_model_caches(model, np.random.default_rng(0))
    dst = manager(model, shard_caches(model, full, 0, 2), 0, 2)
    (reads,) = plan_reads(dst, 4).objects
    with pytest.raises(KVGroupsValueError, match="source rank 1"):
        assemble(reads, {0: np.zeros((1, reads.src_nbytes), np.uint8)})
    with pytest.raises(KVGroupsValueError, match=r"staged\[1\]"):
        assemble(
            reads,
            {
                0: np.zeros((1, reads.src_nbytes), np.uint8),
                1: np.zeros((2, reads.src_nbytes), np.uint8),
            },
        )


@pytest.mark.parametrize("layout", ["canonical", "tp_native"])
@pytest.mark.parametrize("model_name", ["hybrid-full-sw-gqa2", "mla-indexer", "sglang-kv-list"])
def test_a_degree_view_lays_objects_out_as_a_manager_of_that_degree(model_name, layout):
    from kvgroups_core import object_regions

    model = MODELS[model_name]
    full = make_model_caches(model, np.random.default_rng(0))
    reader = manager(model, shard_caches(model, full, 1, 2), 1, 2)
    for tp in DEGREES:
        for r in range(tp):
            real = manager(model, shard_caches(model, full, r, tp), r, tp, object_layout=layout)
            view = degree_view(reader, tp, r, layout)
            for og in range(real.num_object_groups):
                assert object_regions(view, og) == object_regions(real, og)
                assert object_nbytes(view, og) == object_nbytes(real, og)
                assert [view.tp_shard(k) for k in range(real.num_kernel_groups)] == [
                    real.tp_shard(k) for k in range(real.num_kernel_groups)
                ]
