"""The adversarial suite, the vLLM adapter's block ids (issue 35, cause 4); no vLLM needed.

``VllmKVLayout.block_ids(per_group, num_chunks, first_chunk)`` turns vLLM's per-group block
tables into the ids ``store`` / ``load`` take. It truncated float ids (1.9 became block 1),
took bools and digit strings for ids, sliced from the end for a negative ``first_chunk`` and
returned a short list for a negative ``num_chunks``. Each example draws the tables (some
entries broken in one way) and the chunk range; a valid call must return exactly each moved
group's blocks of those chunks, an invalid one must raise a typed error naming the argument.
The adapter reads vLLM's objects by their attributes only, so the layout is built here around
a plain manager (two vLLM groups of 16 and 32 tokens per block, 64-token chunks).
"""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from kvgroups_torch.vllm import VllmKVLayout  # noqa: E402

import kvgroups_core as kc  # noqa: E402

CHUNK = 64
BLOCK_SIZES = {0: 16, 1: 32}  # vLLM group id -> tokens per block (group 2: not moved)
NUM_GROUPS = 3
BUILTINS = (ValueError, TypeError, IndexError)


def _layout() -> VllmKVLayout:
    specs = [
        kc.TensorSpec((2, 64, 16, 1, 8), "float16"),
        kc.TensorSpec((2, 64, 32, 1, 8), "float16"),
    ]
    infos = [
        kc.EngineGroupInfo(engine_group_id=g, layer_indices=(g,), tokens_per_block=bs)
        for g, bs in BLOCK_SIZES.items()
    ]
    manager = kc.KVLayerGroupsManager(
        specs, kc.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, infos, lmcache_tokens_per_chunk=CHUNK
    )
    return VllmKVLayout(
        manager, specs, ["layers.0.attn", "layers.1.attn"], {}, dict(BLOCK_SIZES), NUM_GROUPS
    )


BAD_IDS = {
    "float": 1.9,
    "bool": True,
    "digits": "3",
    "none": None,
    "bytes": b"1",
    "nan": float("nan"),
    "huge": 2**70,
    "list": [1],
}
BAD_CHUNK_ARGS = [-1, -5, 1.0, 2.5, True, False, "1", [1]]


@st.composite
def _calls(draw):
    """``(per_group, num_chunks, first_chunk, broken?)``."""
    tables = {
        g: draw(st.lists(st.integers(0, 10**6), min_size=0, max_size=12)) for g in range(NUM_GROUPS)
    }
    broken = False
    if draw(st.booleans()):
        g = draw(st.sampled_from(sorted(BLOCK_SIZES)))
        if tables[g]:
            kind = draw(st.sampled_from(sorted(BAD_IDS)))
            tables[g][draw(st.integers(0, len(tables[g]) - 1))] = BAD_IDS[kind]
            broken = True
    num_chunks = draw(st.one_of(st.none(), st.integers(0, 3)))
    first_chunk = draw(st.integers(0, 3))
    if draw(st.integers(0, 3)) == 0:
        broken = True
        if draw(st.booleans()):
            num_chunks = draw(st.sampled_from(BAD_CHUNK_ARGS))
        else:
            first_chunk = draw(st.sampled_from(BAD_CHUNK_ARGS))
    form = draw(st.sampled_from(["tuple", "list", "dict", "array"]))
    if form == "dict":
        per_group = {g: ids for g, ids in tables.items()}
    elif form == "array" and not broken:
        per_group = tuple(np.array(ids, dtype=np.int32) for ids in tables.values())
    else:
        per_group = (tuple if form == "tuple" else list)(tables.values())
    return per_group, num_chunks, first_chunk, broken, tables


def _expected(tables, num_chunks, first_chunk):
    """Each moved group's blocks of the chunks asked for, or None when a table is short."""
    out = {}
    for g, bs in BLOCK_SIZES.items():
        ids = [int(x) for x in tables[g]]
        if num_chunks is not None:
            per = CHUNK // bs
            lo, hi = first_chunk * per, (first_chunk + num_chunks) * per
            if len(ids) < hi:
                return None
            ids = ids[lo:hi]
        out[g] = ids
    return out


@settings(max_examples=150, deadline=None, derandomize=True)
@given(_calls())
def test_block_ids_are_exact_or_refused_by_name(call):
    per_group, num_chunks, first_chunk, broken, tables = call
    layout = _layout()
    want = None if broken else _expected(tables, num_chunks, first_chunk)
    if want is None:
        with pytest.raises(kc.KVGroupsError) as info:
            layout.block_ids(per_group, num_chunks=num_chunks, first_chunk=first_chunk)
        assert isinstance(info.value, BUILTINS), repr(info.value)
        assert any(
            name in str(info.value) for name in ("block_ids", "num_chunks", "first_chunk")
        ), str(info.value)
        return
    got = layout.block_ids(per_group, num_chunks=num_chunks, first_chunk=first_chunk)
    assert got == want
    assert all(type(b) is int for ids in got.values() for b in ids)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(first_chunk=-1, num_chunks=1), "first_chunk: expected a non-negative int"),
        (dict(num_chunks=-1), "num_chunks: expected a non-negative int"),
        (dict(num_chunks=1.0), "num_chunks: expected"),
        (dict(first_chunk=True), "first_chunk"),
    ],
)
def test_negative_or_non_int_chunk_ranges_are_refused(kwargs, match):
    tables = ([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12], [])
    with pytest.raises(kc.KVGroupsError, match=match):
        _layout().block_ids(tables, **kwargs)


@pytest.mark.parametrize("bad", [1.9, True, "3", None], ids=repr)
def test_ids_that_are_not_integers_are_refused(bad):
    with pytest.raises(kc.KVGroupsTypeError, match=r"block_ids\[0\]"):
        _layout().block_ids(([1, 2, bad, 4], [5, 6], []))


def test_a_bool_group_key_is_refused():
    with pytest.raises(kc.KVGroupsIndexError, match="group True"):
        _layout().block_ids({0: [1, 2, 3, 4], True: [5, 6]})
