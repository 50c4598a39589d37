from pathlib import Path

import pytest

from kvgroups_core import MUST_HAVE_FORMATS, TensorSpec
from kvgroups_core import EngineKVFormat as F
from kvgroups_core.formats.detection import describe_formats_table, formats_table_markdown
from kvgroups_core.formats.layout import layer_layouts, num_layers_of

NB, NL, BS, NH, HS = 7, 5, 3, 2, 4
DOCS = Path(__file__).resolve().parents[2] / "docs" / "FORMATS.md"

# docs/FORMATS.md, "Geometry golden values": per-layer shape, NH, head size, hidden (NH*HS).
GOLDEN = [
    (F.NL_X_TWO_NB_BS_NH_HS, (2, 7, 3, 2, 4), 2, 4, 8),
    (F.NL_X_NB_TWO_BS_NH_HS, (7, 2, 3, 2, 4), 2, 4, 8),
    (F.NL_X_TWO_NB_NH_BS_HS, (2, 7, 2, 3, 4), 2, 4, 8),
    (F.NL_X_NB_BS_HS, (7, 3, 4), 1, 4, 4),
    (F.NB_NL_TWO_BS_NH_HS, (7, 5, 2, 3, 2, 4), 2, 4, 8),
    (F.NL_X_NB_NH_BS_CS, (7, 2, 3, 8), 2, 8, 16),
    (F.NL_X_NB_BS_NH_CS, (7, 3, 2, 8), 2, 8, 16),
]

# The shape of each backing tensor of every groupable format with NB 7, NL 5, BS 3, NH 2, HS 4.
SHAPES = {
    F.NL_X_TWO_NB_BS_NH_HS: ((2, 7, 3, 2, 4), "float16"),
    F.NL_X_TWO_NB_NH_BS_HS: ((2, 7, 2, 3, 4), "float16"),
    F.NL_X_NB_TWO_BS_NH_HS: ((7, 2, 3, 2, 4), "float16"),
    F.NL_X_NB_TWO_NH_BS_HS: ((7, 2, 2, 3, 4), "float16"),
    F.NL_X_NB_BS_HS: ((7, 3, 4), "float16"),
    F.NB_NL_TWO_BS_NH_HS: ((7, 5, 2, 3, 2, 4), "float16"),
    F.NB_NL_TWO_NH_BS_HS: ((7, 5, 2, 2, 3, 4), "float16"),
    F.TWO_X_NL_X_NB_BS_NH_HS: ((7, 3, 2, 4), "float16"),
    F.NL_X_NB_NH_BS_CS: ((7, 2, 3, 8), "float16"),
    F.NL_X_NB_BS_NH_CS: ((7, 3, 2, 8), "float16"),
    F.NL_X_NB_BSV_BSS: ((7, 3, 132), "uint8"),
    F.NB_NL_NH_BS_CS: ((7, 5, 2, 3, 8), "float16"),
    F.NB_NL_BS_NH_CS: ((7, 5, 3, 2, 8), "float16"),
    F.NL_X_NB_BS_NH_TWO_HS: ((7, 3, 2, 2, 4), "float16"),
    F.TWO_X_NL_X_NH_NB_BS_HS: ((2, 7, 3, 4), "float16"),
    F.NL_X_TWO_NB_NH_ONE_BS_HS: ((2, 7, 2, 1, 3, 4), "float16"),
    F.NL_X_TWO_X_NB_BS_NH_HS: ((7, 3, 2, 4), "float16"),
}

# name: (kv_size, is_mla, is_hnd, structure, is_fused_packed, is_indexer, block_axis_first)
FACTS = {
    F.NL_X_TWO_NB_BS_NH_HS: (2, False, False, "layer", False, False, False),
    F.NL_X_TWO_NB_NH_BS_HS: (2, False, True, "layer", False, False, False),
    F.NL_X_NB_TWO_BS_NH_HS: (2, False, False, "layer", False, False, True),
    F.NL_X_NB_TWO_NH_BS_HS: (2, False, True, "layer", False, False, True),
    F.NL_X_NB_BS_HS: (1, True, False, "layer", False, False, True),
    F.NB_NL_TWO_BS_NH_HS: (2, False, False, "cross", False, False, True),
    F.NB_NL_TWO_NH_BS_HS: (2, False, True, "cross", False, False, True),
    F.TWO_X_NL_X_NB_BS_NH_HS: (2, False, False, "kv", False, False, True),
    F.NL_X_NB_NH_BS_CS: (1, False, True, "layer", True, False, True),
    F.NL_X_NB_BS_NH_CS: (1, False, False, "layer", True, False, True),
    F.NL_X_NB_BSV_BSS: (1, True, False, "layer", False, True, True),
    F.NB_NL_NH_BS_CS: (1, False, True, "cross", True, False, True),
    F.NB_NL_BS_NH_CS: (1, False, False, "cross", True, False, True),
    F.NL_X_NB_BS_NH_TWO_HS: (2, False, False, "layer", False, False, True),
    F.TWO_X_NL_X_NH_NB_BS_HS: (2, False, True, "kv", False, False, False),
    F.NL_X_TWO_NB_NH_ONE_BS_HS: (2, False, True, "layer", False, False, False),
    F.NL_X_TWO_X_NB_BS_NH_HS: (2, False, False, "layer", False, False, True),
    F.TWO_X_NL_X_NBBS_NH_HS: (2, False, False, "kv", False, False, False),
    F.NL_X_NBBS_ONE_HS: (1, True, False, "layer", False, False, False),
    F.NL_X_NB_CD_CW: (1, False, False, "layer", False, False, True),
    F.NL_X_NB_CW_CD: (1, False, False, "layer", False, False, True),
    F.NL_X_NB_SH_SS: (1, False, False, "layer", False, False, True),
}

MUST_HAVE_NAMES = {
    "NL_X_TWO_NB_BS_NH_HS",
    "NL_X_TWO_NB_NH_BS_HS",
    "NL_X_NB_TWO_BS_NH_HS",
    "NL_X_NB_TWO_NH_BS_HS",
    "NL_X_NB_BS_HS",
    "NB_NL_TWO_BS_NH_HS",
    "NB_NL_TWO_NH_BS_HS",
    "TWO_X_NL_X_NB_BS_NH_HS",
    "NL_X_NB_NH_BS_CS",
    "NL_X_NB_BS_NH_CS",
    "NL_X_NB_BSV_BSS",
    "NB_NL_NH_BS_CS",
    "NB_NL_BS_NH_CS",
}


def structure_of(fmt, nl=NL):
    shape, dtype = SHAPES[fmt]
    spec = TensorSpec(shape, dtype)
    if fmt.is_cross_layer:
        return spec
    if fmt.is_kv_list:
        return [[spec] * nl, [spec] * nl]
    if fmt is F.NL_X_TWO_X_NB_BS_NH_HS:
        return [(spec, spec)] * nl
    return [spec] * nl


@pytest.mark.parametrize("fmt,shape,nh,hs,hidden", GOLDEN, ids=lambda x: getattr(x, "name", None))
def test_golden_geometry_table(fmt, shape, nh, hs, hidden):
    spec = TensorSpec(shape, "float16")
    caches = spec if fmt.is_cross_layer else [spec] * NL
    assert num_layers_of(caches, fmt) == NL
    for layout in layer_layouts(caches, [fmt] * NL):
        assert (layout.num_heads, layout.head_size) == (nh, hs)
        assert layout.num_heads * layout.head_size == hidden
        assert layout.row_bytes == hidden * 2
        assert (layout.num_blocks, layout.block_size) == (NB, BS)


@pytest.mark.parametrize("fmt", list(SHAPES), ids=lambda f: f.name)
def test_every_groupable_format_reports_7_blocks_3_slots_5_layers(fmt):
    caches = structure_of(fmt)
    assert num_layers_of(caches, fmt) == NL
    layouts = layer_layouts(caches, [fmt] * NL)
    assert len(layouts) == NL
    for layout in layouts:
        assert (layout.num_blocks, layout.block_size, layout.kv_size) == (NB, BS, fmt.kv_size)


def test_shapes_table_covers_every_groupable_attention_format():
    # Recurrent-state formats hold one slot per block (tests/core/test_recurrent_state.py).
    assert set(SHAPES) == {f for f in F if f.groupable and not f.is_recurrent_state}


@pytest.mark.parametrize("fmt", list(F), ids=lambda f: f.name)
def test_facts_of_every_format(fmt):
    kv_size, mla, hnd, structure, packed, indexer, block_first = FACTS[fmt]
    assert fmt.kv_size == kv_size
    assert fmt.is_mla is mla
    assert fmt.is_hnd is hnd
    assert fmt.is_fused_packed is packed
    assert fmt.is_indexer is indexer
    assert fmt.block_axis_first is block_first
    assert (fmt.is_cross_layer, fmt.is_kv_list, fmt.is_layer_list) == (
        structure == "cross",
        structure == "kv",
        structure == "layer",
    )


@pytest.mark.parametrize("fmt", list(F), ids=lambda f: f.name)
def test_exactly_one_of_cross_layer_kv_list_layer_list(fmt):
    assert [fmt.is_cross_layer, fmt.is_kv_list, fmt.is_layer_list].count(True) == 1


@pytest.mark.parametrize("fmt", list(F), ids=lambda f: f.name)
def test_member_facts_match_the_facts_record(fmt):
    facts = fmt.facts
    assert (fmt.kv_size, fmt.is_mla, fmt.is_hnd, fmt.is_indexer) == (
        facts.kv_size,
        facts.is_mla,
        facts.is_hnd,
        facts.is_indexer,
    )


def test_must_have_formats_are_the_spec_table_plus_the_jax_engine_layouts():
    jax = {"NL_X_NB_BS_NH_TWO_HS", "TWO_X_NL_X_NH_NB_BS_HS"}
    assert {f.name for f in MUST_HAVE_FORMATS} == MUST_HAVE_NAMES | jax


def test_jax_engine_formats_are_in_the_catalogue():
    assert F.NL_X_NB_BS_NH_TWO_HS.facts.axes == ("NB", "BS", "NH", "TWO", "HS")
    assert F.TWO_X_NL_X_NH_NB_BS_HS.facts.axes == ("NH", "NB", "BS", "HS")


def test_only_pbs_folded_formats_are_not_groupable():
    assert {f for f in F if not f.groupable} == {F.TWO_X_NL_X_NBBS_NH_HS, F.NL_X_NBBS_ONE_HS}


def test_formats_table_has_one_row_per_format():
    rows = describe_formats_table()
    assert [r.name for r in rows] == [f.name for f in F]
    for row in rows:
        fmt = F[row.name]
        assert row.kv_size == fmt.kv_size
        assert row.producers == fmt.facts.producers
        assert row.facts["is_hnd"] is fmt.is_hnd


def test_formats_table_rows_read_like_the_spec():
    rows = {r.name: r for r in describe_formats_table()}
    assert rows["NL_X_TWO_NB_NH_BS_HS"].structure == "list[NL] of [2, NB, NH, BS, HS]"
    assert rows["NL_X_TWO_NB_NH_BS_HS"].dims == "s1, s3, s2, s4"
    assert rows["NB_NL_TWO_BS_NH_HS"].block == "t[b, l, kv]"
    assert rows["TWO_X_NL_X_NB_BS_NH_HS"].dims == "[0][0]: s0, s1, s2, s3"
    assert rows["NL_X_NB_BS_HS"].dims == "s0, s1, NH=1, s2"
    assert rows["NL_X_NB_BS_NH_TWO_HS"].block == "t[l][b, :, :, kv]"


def test_docs_hold_the_generated_formats_table():
    docs = DOCS.read_text()
    for line in formats_table_markdown().splitlines():
        assert line in docs
