import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgroups_core import (
    DTYPE_MAP,
    EngineGroupInfo,
    EngineKVFormat,
    KVLayerGroupsManager,
    TensorSpec,
    format_kvcache_shape_spec,
    group_layers_by_identity,
    parse_kvcache_shape_spec,
)
from kvgroups_core.grouping.shape_spec import SPEC_DTYPES

F = EngineKVFormat
NB = 8
CHUNK = 256

# Layer kinds with pairwise different identities: (tensor, format, block size).
KINDS = [
    (TensorSpec((2, NB, 16, 8, 64), "float16"), F.NL_X_TWO_NB_BS_NH_HS, 16),
    (TensorSpec((2, NB, 16, 8, 64), "bfloat16"), F.NL_X_TWO_NB_BS_NH_HS, 16),
    (TensorSpec((2, NB, 16, 4, 64), "float16"), F.NL_X_TWO_NB_BS_NH_HS, 16),
    (TensorSpec((2, NB, 16, 8, 64), "float16"), F.NL_X_TWO_NB_NH_BS_HS, 8),
    (TensorSpec((NB, 64, 576), "bfloat16"), F.NL_X_NB_BS_HS, 64),
    (TensorSpec((NB, 64, 132), "uint8"), F.NL_X_NB_BSV_BSS, 64),
]

layer_kinds = st.lists(st.integers(0, len(KINDS) - 1), min_size=1, max_size=24)
fast = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def model(kinds):
    return [KINDS[k][0] for k in kinds], [KINDS[k][1] for k in kinds]


@st.composite
def models_with_engine_groups(draw):
    kinds = draw(layer_kinds)
    groups = draw(st.lists(st.integers(-1, 2), min_size=len(kinds), max_size=len(kinds)))
    return kinds, groups


@fast
@given(models_with_engine_groups())
def test_groups_partition_the_non_excluded_layers_by_kind_and_engine_group(data):
    kinds, engine_groups = data
    caches, formats = model(kinds)
    groups = group_layers_by_identity(caches, formats, engine_groups)
    expected: dict[tuple[int, int], list[int]] = {}
    for layer, (kind, gid) in enumerate(zip(kinds, engine_groups)):
        if gid != -1:
            expected.setdefault((kind, gid), []).append(layer)
    assert [layers for _, layers in groups] == sorted(expected.values(), key=lambda ls: ls[0])
    for identity, layers in groups:
        assert layers == sorted(layers)
        assert {(kinds[layer], engine_groups[layer]) for layer in layers} == {
            (kinds[layers[0]], identity.engine_group_idx)
        }
    assert len({identity for identity, _ in groups}) == len(groups)


@fast
@given(models_with_engine_groups(), st.randoms(use_true_random=False))
def test_grouping_is_deterministic_and_follows_a_permutation_of_the_layers(data, rnd):
    kinds, engine_groups = data
    caches, formats = model(kinds)
    base = group_layers_by_identity(caches, formats, engine_groups)
    assert group_layers_by_identity(caches, formats, engine_groups) == base
    perm = list(range(len(kinds)))
    rnd.shuffle(perm)
    permuted = group_layers_by_identity(
        [caches[p] for p in perm], [formats[p] for p in perm], [engine_groups[p] for p in perm]
    )
    firsts = [layers[0] for _, layers in permuted]
    assert firsts == sorted(firsts)
    as_original = {frozenset(perm[i] for i in layers) for _, layers in permuted}
    assert as_original == {frozenset(layers) for _, layers in base}
    assert {identity for identity, _ in permuted} == {identity for identity, _ in base}


spec_group = st.tuples(
    st.integers(0, 4),
    st.integers(0, 1 << 20),
    st.integers(0, 512),
    st.integers(0, 64),
    st.integers(0, 1024),
    st.sampled_from(SPEC_DTYPES),
    st.integers(1, 200),
)


@fast
@given(st.lists(spec_group, min_size=1, max_size=6))
def test_format_of_parse_is_the_identity_on_canonical_specs(groups):
    spec = ";".join(
        f"({kv},{nb},{bs},{nh},{hs}):{dt}:{nl}" for kv, nb, bs, nh, hs, dt, nl in groups
    )
    parsed = parse_kvcache_shape_spec(spec)
    assert format_kvcache_shape_spec(parsed) == spec
    assert [g.dtype for g in parsed] == [DTYPE_MAP[g[5]] for g in groups]
    assert parsed[-1].layer_indices[-1] == sum(g[6] for g in groups) - 1


@st.composite
def managed_models(draw):
    kinds, engine_groups = draw(models_with_engine_groups())
    if all(g == -1 for g in engine_groups):
        engine_groups[0] = 0
    caches, formats = model(kinds)
    groups = group_layers_by_identity(caches, formats, engine_groups)
    infos = []
    for identity, layers in groups:
        bs = identity.block_size
        tpb = draw(st.sampled_from([t for t in (8, 16, 32, 64, 128, 256) if t % bs == 0]))
        window = draw(
            st.one_of(
                st.just(-1),
                st.integers(1, CHUNK // tpb - 1).map(lambda n, tpb=tpb: n * tpb)
                if CHUNK // tpb > 1
                else st.just(-1),
                st.integers(CHUNK, 4 * CHUNK),
            )
        )
        infos.append(
            EngineGroupInfo(
                engine_group_id=identity.engine_group_idx,
                layer_indices=tuple(layers),
                tokens_per_block=tpb,
                sw_size_tokens=window,
            )
        )
    return caches, formats, engine_groups, infos


@fast
@given(managed_models(), st.booleans())
def test_manager_invariants(model_data, separate):
    caches, formats, engine_groups, infos = model_data
    m = KVLayerGroupsManager(
        caches, formats, infos, lmcache_tokens_per_chunk=CHUNK, separate_object_groups=separate
    )
    grouped = sorted(layer for g in m.kernel_groups for layer in g.layer_indices)
    assert grouped == [i for i, g in enumerate(engine_groups) if g != -1]
    assert sum(g.shape_desc.nl for g in m.kernel_groups) == len(grouped)
    assert [layout is None for layout in m.layer_layouts] == [g == -1 for g in engine_groups]

    for k, group in enumerate(m.kernel_groups):
        assert group.tokens_per_block == infos[k].tokens_per_block
        bs = group.shape_desc.bs
        assert m.calculate_num_blocks(k, CHUNK) * group.tokens_per_block == CHUNK
        sub = m.get_subchunk_sw_size_tokens(k)
        assert sub == (group.sw_size_tokens if 0 < group.sw_size_tokens < CHUNK else CHUNK)
        slots = m.get_slots_per_chunk_in_sw(k)
        assert slots == m.calculate_num_blocks(k, sub) * bs
        assert 0 < slots <= group.calculate_slots(CHUNK)

    indices = [k for og in m.object_groups for k in og.kernel_group_indices]
    assert sorted(indices) == list(range(m.num_kernel_groups))
    firsts = [og.kernel_group_indices[0] for og in m.object_groups]
    assert firsts == sorted(firsts)
    if not separate:
        assert m.num_object_groups == 1 and m.object_groups[0].sw_size_chunks == -1
    else:
        for og in m.object_groups:
            assert og.kernel_group_indices == sorted(og.kernel_group_indices)
            for k in og.kernel_group_indices:
                sw = m.kernel_groups[k].sw_size_tokens
                assert og.sw_size_chunks == (-1 if sw == -1 else math.ceil(sw / CHUNK))
        assert len({og.sw_size_chunks for og in m.object_groups}) == m.num_object_groups

    windows = m.get_attn_desc().num_chunks_in_sw
    assert len(windows) == m.num_object_groups
    assert all(w == -1 or w >= 1 for w in windows)

    m.enable_full_sw_kv()
    assert all(w == -1 for w in m.get_attn_desc().num_chunks_in_sw)
    for k, group in enumerate(m.kernel_groups):
        assert m.get_slots_per_chunk_in_sw(k) == group.calculate_slots(CHUNK)
