import ctypes
import math

import numpy as np
import pytest

from kvgroups_core import EngineKVFormat as F
from kvgroups_core import KVGroupsValueError, TensorSpec
from kvgroups_core.formats.layout import layer_layouts, num_layers_of

NB, NL, BS, NH, HS = 7, 5, 3, 2, 4


class Counter:
    def __init__(self):
        self.next = 0

    def array(self, shape, dtype=np.float16):
        # Position-encoded: every element of every array of one case has distinct bytes.
        dtype = np.dtype(dtype)
        n = math.prod(shape)
        words = (np.arange(self.next, self.next + n) % 65521).astype(np.uint16)
        self.next += n
        if dtype.itemsize == 1:
            return (words % 251).astype(np.uint8).view(dtype).reshape(shape)
        return words.view(dtype).reshape(shape)


def _heads(rows):
    return b"".join(np.ascontiguousarray(r).tobytes() for r in rows)


def build(fmt, nb=NB, nl=NL, bs=BS, nh=NH, hs=HS):
    # (caches in the format, row(layer, kv, b, t) -> the object row bytes), written from the
    # format's definition in docs/FORMATS.md, independently of the layout code.
    c = Counter()
    per_layer = lambda shape, dt=np.float16: [c.array(shape, dt) for _ in range(nl)]  # noqa: E731
    if fmt is F.NL_X_TWO_NB_BS_NH_HS:
        t = per_layer((2, nb, bs, nh, hs))
        return t, lambda ly, kv, b, s: t[ly][kv, b, s].tobytes()
    if fmt is F.NL_X_TWO_NB_NH_BS_HS:
        t = per_layer((2, nb, nh, bs, hs))
        return t, lambda ly, kv, b, s: _heads(t[ly][kv, b, h, s] for h in range(nh))
    if fmt is F.NL_X_NB_TWO_BS_NH_HS:
        t = per_layer((nb, 2, bs, nh, hs))
        return t, lambda ly, kv, b, s: t[ly][b, kv, s].tobytes()
    if fmt is F.NL_X_NB_TWO_NH_BS_HS:
        t = per_layer((nb, 2, nh, bs, hs))
        return t, lambda ly, kv, b, s: _heads(t[ly][b, kv, h, s] for h in range(nh))
    if fmt is F.NL_X_NB_BS_HS:
        t = per_layer((nb, bs, hs))
        return t, lambda ly, kv, b, s: t[ly][b, s].tobytes()
    if fmt is F.NB_NL_TWO_BS_NH_HS:
        t = c.array((nb, nl, 2, bs, nh, hs))
        return t, lambda ly, kv, b, s: t[b, ly, kv, s].tobytes()
    if fmt is F.NB_NL_TWO_NH_BS_HS:
        t = c.array((nb, nl, 2, nh, bs, hs))
        return t, lambda ly, kv, b, s: _heads(t[b, ly, kv, h, s] for h in range(nh))
    if fmt is F.TWO_X_NL_X_NB_BS_NH_HS:
        t = [per_layer((nb, bs, nh, hs)), per_layer((nb, bs, nh, hs))]
        return t, lambda ly, kv, b, s: t[kv][ly][b, s].tobytes()
    if fmt is F.NL_X_NB_NH_BS_CS:
        t = per_layer((nb, nh, bs, 2 * hs))
        return t, lambda ly, kv, b, s: _heads(t[ly][b, h, s] for h in range(nh))
    if fmt is F.NL_X_NB_BS_NH_CS:
        t = per_layer((nb, bs, nh, 2 * hs))
        return t, lambda ly, kv, b, s: t[ly][b, s].tobytes()
    if fmt is F.NL_X_NB_BSV_BSS:
        t = per_layer((nb, bs, 132), np.uint8)

        def indexer_row(ly, kv, b, s):
            block = t[ly][b].reshape(-1)  # all BS value rows, then all BS scales
            return (
                block[s * 128 : (s + 1) * 128].tobytes() + block[bs * 128 + 4 * s :][:4].tobytes()
            )

        return t, indexer_row
    if fmt is F.NB_NL_NH_BS_CS:
        t = c.array((nb, nl, nh, bs, 2 * hs))
        return t, lambda ly, kv, b, s: _heads(t[b, ly, h, s] for h in range(nh))
    if fmt is F.NB_NL_BS_NH_CS:
        t = c.array((nb, nl, bs, nh, 2 * hs))
        return t, lambda ly, kv, b, s: t[b, ly, s].tobytes()
    if fmt is F.NL_X_NB_BS_NH_TWO_HS:
        # tpu-inference: [NP, PS, 2*NH // 2, 2, HD] fp16, heads K0, V0, K1, V1, ...
        raw = per_layer((nb, bs, nh, 2, hs))
        t = [r.reshape(nb, bs, nh, 2, hs) for r in raw]
        return t, lambda ly, kv, b, s: _heads(
            raw[ly][b, s, (2 * h + kv) // 2, (2 * h + kv) % 2] for h in range(nh)
        )
    if fmt is F.TWO_X_NL_X_NH_NB_BS_HS:
        t = [per_layer((nh, nb, bs, hs)), per_layer((nh, nb, bs, hs))]
        return t, lambda ly, kv, b, s: _heads(t[kv][ly][h, b, s] for h in range(nh))
    if fmt is F.NL_X_TWO_NB_NH_ONE_BS_HS:
        t = per_layer((2, nb, nh, 1, bs, hs))
        return t, lambda ly, kv, b, s: _heads(t[ly][kv, b, h, 0, s] for h in range(nh))
    if fmt is F.NL_X_TWO_X_NB_BS_NH_HS:
        t = [(k, v) for k, v in zip(per_layer((nb, bs, nh, hs)), per_layer((nb, bs, nh, hs)))]
        return t, lambda ly, kv, b, s: t[ly][kv][b, s].tobytes()
    raise AssertionError(fmt)


# Recurrent-state formats hold one whole state per slot (tests/core/test_recurrent_state.py).
GROUPABLE = [f for f in F if f.groupable and not f.is_recurrent_state]


def page_model_row(layout, kv, block, token):
    # The object row of (plane kv, block, token), gathered through the page model.
    tensor, plane_offset = layout.planes[kv]
    start = tensor.address + plane_offset + block * layout.block_stride_bytes
    row = bytearray(layout.row_bytes)
    for run in layout.runs:
        for piece in range(run.count):
            src = start + run.cache_offset + piece * run.cache_step + token * run.token_stride
            dst = run.obj_offset + piece * run.obj_step
            row[dst : dst + run.nbytes] = ctypes.string_at(src, run.nbytes)
    return bytes(row)


def check_every_row(caches, fmt, row, nl=NL, nb=NB, bs=BS):
    layouts = layer_layouts(caches, [fmt] * nl)
    for layer, layout in enumerate(layouts):
        assert sum(run.row_nbytes for run in layout.runs) == layout.row_bytes
        for kv in range(fmt.kv_size):
            for block in range(nb):
                for token in range(bs):
                    got = page_model_row(layout, kv, block, token)
                    assert got == row(layer, kv, block, token), (layer, kv, block, token)


@pytest.mark.parametrize("fmt", GROUPABLE, ids=lambda f: f.name)
def test_page_model_matches_numpy_indexing_for_every_format(fmt):
    caches, row = build(fmt)
    check_every_row(caches, fmt, row)


@pytest.mark.parametrize("fmt", GROUPABLE, ids=lambda f: f.name)
def test_layout_sizes_of_every_format(fmt):
    caches, _ = build(fmt)
    layouts = layer_layouts(caches, [fmt] * NL)
    assert num_layers_of(caches, fmt) == NL
    for layout in layouts:
        assert (layout.num_blocks, layout.block_size, layout.kv_size) == (NB, BS, fmt.kv_size)
        assert layout.block_stride_elems == 0


def test_interleaved_heads_plane_v_starts_one_head_size_after_k():
    caches, _ = build(F.NL_X_NB_BS_NH_TWO_HS)
    layout = layer_layouts(caches, [F.NL_X_NB_BS_NH_TWO_HS] * NL)[0]
    (k, k_off), (v, v_off) = layout.planes
    assert k is v and v_off - k_off == HS * 2
    (run,) = layout.runs
    assert (run.count, run.nbytes, run.cache_step, run.token_stride) == (
        NH,
        HS * 2,
        2 * HS * 2,
        2 * NH * HS * 2,
    )


def test_heads_outermost_run_steps_over_all_pages():
    caches, _ = build(F.TWO_X_NL_X_NH_NB_BS_HS)
    (run,) = layer_layouts(caches, [F.TWO_X_NL_X_NH_NB_BS_HS] * NL)[0].runs
    assert (run.count, run.cache_step, run.token_stride) == (NH, NB * BS * HS * 2, HS * 2)


def test_cross_layer_planes_are_offsets_into_one_tensor():
    spec = TensorSpec((NB, NL, 2, BS, NH, HS), "float16")
    layouts = layer_layouts(spec, [F.NB_NL_TWO_BS_NH_HS] * NL)
    row = BS * NH * HS * 2
    for layer, layout in enumerate(layouts):
        assert [off for _, off in layout.planes] == [(2 * layer + kv) * row for kv in range(2)]
        assert layout.block_stride_bytes == NL * 2 * row


def padded(shape, pad, dtype=np.float16, counter=None):
    # A blocks-first array of `shape` whose blocks lie `pad` elements further apart than tight.
    inner = math.prod(shape[1:])
    base = (counter or Counter()).array((shape[0], inner + pad), dtype)
    return base[:, :inner].reshape(shape)


@pytest.mark.parametrize(
    "fmt,shape,dtype",
    [
        (F.NL_X_NB_BS_HS, (NB, BS, HS), np.float16),
        (F.NL_X_NB_TWO_BS_NH_HS, (NB, 2, BS, NH, HS), np.float16),
        (F.NL_X_NB_BS_NH_CS, (NB, BS, NH, 2 * HS), np.float16),
        (F.NL_X_NB_BSV_BSS, (NB, BS, 132), np.uint8),
    ],
    ids=lambda x: getattr(x, "name", None),
)
def test_padding_on_the_block_axis_sets_block_stride_elems(fmt, shape, dtype):
    counter = Counter()
    caches = [padded(shape, 24, dtype, counter) for _ in range(NL)]
    tight = math.prod(shape[1:])
    for layout in layer_layouts(caches, [fmt] * NL):
        assert layout.block_stride_elems == tight + 24
        assert layout.block_stride_bytes == (tight + 24) * np.dtype(dtype).itemsize


def test_padded_blocks_are_addressed_at_the_padded_stride():
    counter = Counter()
    caches = [padded((NB, BS, HS), 12, counter=counter) for _ in range(NL)]
    check_every_row(caches, F.NL_X_NB_BS_HS, lambda ly, kv, b, s: caches[ly][b, s].tobytes())


def test_padding_on_a_dim_0_that_is_not_the_block_axis_is_rejected():
    caches = [padded((2, NB, BS, NH, HS), 8) for _ in range(NL)]
    with pytest.raises(KVGroupsValueError, match="contiguous"):
        layer_layouts(caches, [F.NL_X_TWO_NB_BS_NH_HS] * NL)


def test_padding_inside_a_block_is_rejected():
    base = np.zeros((NB, BS, HS + 2), np.float16)
    with pytest.raises(ValueError, match=r"strides"):
        layer_layouts([base[:, :, :HS]] * NL, [F.NL_X_NB_BS_HS] * NL)


def test_tight_blocks_report_block_stride_elems_zero():
    spec = TensorSpec((NB, BS, HS), "float16")
    assert layer_layouts([spec] * NL, [F.NL_X_NB_BS_HS] * NL)[0].block_stride_elems == 0


def test_pbs_folded_formats_cannot_be_grouped():
    spec = TensorSpec((NB * BS, 1, HS), "float16")
    with pytest.raises(ValueError, match="cannot be grouped"):
        layer_layouts([spec] * NL, [F.NL_X_NBBS_ONE_HS] * NL)


def test_k_and_v_of_different_shapes_are_rejected():
    k = TensorSpec((NB, BS, NH, HS), "float16")
    v = TensorSpec((NB, BS, NH, 2 * HS), "float16")
    with pytest.raises(ValueError, match="one shape"):
        layer_layouts([[k], [v]], [F.TWO_X_NL_X_NB_BS_NH_HS])


def test_wrong_rank_names_the_expected_axes():
    with pytest.raises(ValueError, match=r"rank-5 tensor \[TWO, NB, BS, NH, HS\]"):
        layer_layouts([TensorSpec((NB, BS, HS), "float16")], [F.NL_X_TWO_NB_BS_NH_HS])
