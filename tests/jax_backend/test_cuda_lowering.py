"""Lowering "cuda" (the CUDA kernel launched by XLA) checked without a GPU.

What is new there is host-side: the parameter blob and which buffer word is which. So the
launch description of real plans is run through a NumPy model of the XLA entry point
(page_copy.cu, "Launches from XLA": the blob's KvgParams, the plane words and offsets, the meta
clamped to the items that exist) and of the warp kernel's page walk, on buffers addressed by
word, every access bounds-checked; the bytes must equal the NumPy reference's and every other
byte stay as it was. The PTX build is checked too (NVRTC needs no GPU): the entry points exist
with the parameter count jaxlib passes. tests/jax_backend/test_gpu.py and test_gpu_engine.py run the
lowering itself on the GPU."""

import ctypes
import re
from dataclasses import replace

import numpy as np
import pytest
from kvgroups_cuda import nvrtc
from kvgroups_cuda import params as P
from kvgroups_jax.geometry import group_geometry
from kvgroups_jax.lowerings import cuda as cuda_copy
from kvgroups_jax.lowerings.choice import resolve_lowering

from kvgroups_core.errors import UnsupportedConfigError
from tests.support.jax_checks import reference_transfer
from tests.support.jax_layouts import make_group, make_plan

SPAN_LAYOUTS = ("nhd", "flashinfer_nhd", "cross_layer")


def _nbytes(g):
    return g.num_planes * g.slots * g.row_bytes


class Words:
    """Buffers addressed as the kernel sees them: word ``i`` is buffer ``i``'s base address."""

    SHIFT = 40

    def __init__(self, buffers):
        self.buffers = [b.view(np.uint8).reshape(-1) for b in buffers]

    def address(self, i):
        return (i + 1) << self.SHIFT

    def at(self, address, nbytes):
        i, off = (address >> self.SHIFT) - 1, address & ((1 << self.SHIFT) - 1)
        buf = self.buffers[i]
        assert 0 <= off and off + nbytes <= buf.size, f"out of buffer {i}: {off}+{nbytes}"
        return buf[off : off + nbytes]


def emulate_xla_launch(blob: bytes, words: Words, store: bool) -> None:
    """kvg_xla_warp_copy + kvg_warp_copy of page_copy.cu, page by page."""
    head = cuda_copy.XlaHead.from_buffer_copy(blob[: ctypes.sizeof(cuda_copy.XlaHead)])
    at = ctypes.sizeof(cuda_copy.XlaHead)
    p = P.KvgParams.from_buffer_copy(blob[at : at + ctypes.sizeof(P.KvgParams)])
    at += ctypes.sizeof(P.KvgParams)
    planes = (cuda_copy.XlaPlane * head.num_planes).from_buffer_copy(blob[at:])
    assert len(blob) == at + ctypes.sizeof(planes)
    assert p.ids_mode == P.IDS_DEVICE32 and p.obj_mode == P.OBJ_STRIDED and p.num_runs == 1
    meta = words.at(words.address(head.meta), 8).view(np.int32)
    total = head.total_items
    first = min(max(int(meta[0]), head.first_lo), total)
    count = min(max(int(meta[1]), 0), total - first)
    run, kept, bpc = p.runs[0], p.kept_per_chunk, p.blocks_per_chunk
    obj = words.address(head.obj)
    words.at(words.address(head.err), 64)  # the error record is a buffer of the call
    for item in range(first, first + count):
        chunk, pos = divmod(item, kept)
        where = chunk * bpc + bpc - kept + pos
        bid = int(words.at(words.address(head.ids) + 4 * where, 4).view(np.int32)[0])
        if not 0 <= bid < p.num_blocks:
            continue
        for pl in planes:
            cache = words.address(pl.word) + pl.offset + bid * p.block_stride + run.cache_offset
            page = (
                obj
                + chunk * p.obj_chunk_stride
                + p.region_offset
                + pl.obj_offset
                + pos * p.page_obj_stride
                + run.obj_offset
            )
            n = run.page_units * 16
            assert cache % 16 == 0 and page % 16 == 0
            src, dst = (cache, page) if store else (page, cache)
            words.at(dst, n)[:] = words.at(src, n)


def _run_emulated(direction, g, arrays, *, meta=None, ids=None, fresh=False):
    nbytes = _nbytes(g)
    plan = make_plan(direction, [g], arrays, [nbytes])
    geom = group_geometry(plan.groups[0], plan.tensor_specs, nbytes)
    ids = np.asarray(g.block_ids if ids is None else ids, np.int32)
    rng = np.random.default_rng(3)
    obj = rng.integers(0, 256, (g.num_chunks, nbytes), np.uint8)
    caches = [np.array(a, copy=True) for a in arrays]
    spec = cuda_copy.launch_spec(
        direction,
        geom,
        g.num_items,
        obj_rows=g.num_chunks,
        obj_elems=nbytes // geom.unit,
        fresh=fresh,
        ids_len=ids.size,
    )
    meta = np.array([g.first_item, g.num_items] if meta is None else meta, np.int32)
    given = {
        "meta": [meta],
        "ids": [ids],
        "obj": [obj],
        "cache": [caches[s] for s in geom.operand_indices],
    }
    operands = [given[k].pop(0) for k in spec.operand_kinds]
    out_obj = obj if not fresh else np.zeros_like(obj)
    made = {
        "obj": [out_obj],
        "cache": [caches[s] for s in geom.operand_indices],
        "err": [np.zeros(64, np.uint8)],
    }
    results = [made[k].pop(0) for k in spec.result_kinds]
    assert spec.buffers == 1 + len(operands) + len(results)
    for op, res in spec.aliases.items():  # an alias is the same buffer on both sides
        assert operands[op - 1] is results[res]
    emulate_xla_launch(spec.blob, Words(operands + results), direction == "store")
    return caches, out_obj, obj, nbytes


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("layout", SPAN_LAYOUTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_launch_blob_moves_the_reference_bytes(layout, direction, dtype):
    arrays, g = make_group(
        layout,
        dtype,
        direction=direction,
        nb=16,
        bs=16,
        nh=2,
        hs=64,
        num_chunks=3,
        bpc=4,
        kept=3,
        first_item=2 if direction == "load" else 0,
    )
    caches, obj, _, nbytes = _run_emulated(direction, g, arrays)
    want_c = [np.array(a, copy=True).view(np.uint8).reshape(-1) for a in arrays]
    want_o = np.random.default_rng(3).integers(0, 256, (g.num_chunks, nbytes), np.uint8)
    want_o = want_o.reshape(-1)
    reference_transfer(direction, g, want_c, want_o, nbytes)
    np.testing.assert_array_equal(obj.reshape(-1), want_o)
    for c, w in zip(caches, want_c):
        np.testing.assert_array_equal(c.view(np.uint8).reshape(-1), w)


def test_traced_meta_past_the_items_is_clamped_and_bad_ids_move_nothing():
    arrays, g = make_group(
        "nhd", "bfloat16", direction="load", nb=16, bs=16, nh=2, hs=64, num_chunks=2, bpc=2
    )
    # A meta past both ends (clamped to the 4 items the ids and objects hold), two bad ids.
    caches, obj, _, nbytes = _run_emulated(
        "load", g, arrays, meta=[-5, 1000], ids=np.array([3, 99, 5, -1], np.int32)
    )
    # The reference with spare blocks 14 and 15 for the bad items, which then keep their bytes.
    want = [np.array(a, copy=True).view(np.uint8).reshape(-1) for a in arrays]
    assert g.first_item == 0 and g.num_items == 4
    reference_transfer(
        "load", replace(g, block_ids=np.array([3, 14, 5, 15])), want, obj.reshape(-1).copy(), nbytes
    )
    page = 16 * 2 * 64 * 2
    for c, before, w in zip(caches, arrays, want):
        before = before.view(np.uint8).reshape(-1)
        for kv in range(2):
            for blk in (14, 15):
                lo = (kv * 16 + blk) * page
                w[lo : lo + page] = before[lo : lo + page]
        np.testing.assert_array_equal(c.view(np.uint8).reshape(-1), w)
        assert not np.array_equal(w, before)  # blocks 3 and 5 did change


@pytest.mark.parametrize("layout", ["hnd", "interleaved"])
def test_layouts_that_are_not_one_span_are_refused_before_anything_moves(layout):
    arrays, g = make_group(layout, "bfloat16", nb=16, bs=16, nh=2, hs=64)
    nbytes = _nbytes(g)
    plan = make_plan("store", [g], arrays, [nbytes])
    geom = group_geometry(plan.groups[0], plan.tensor_specs, nbytes)
    assert "contiguous" in cuda_copy.geometry_unsupported(geom)
    with pytest.raises(UnsupportedConfigError, match="lowering 'cuda'"):
        cuda_copy.launch_spec(
            "store", geom, 4, obj_rows=2, obj_elems=nbytes // geom.unit, fresh=True, ids_len=4
        )
    with pytest.raises(UnsupportedConfigError, match="needs a CUDA GPU"):
        resolve_lowering("cuda", geom, "cpu")


@pytest.mark.parametrize("words", [8, 64])
def test_xla_entry_points_build_with_the_parameters_jaxlib_passes(words):
    pytest.importorskip("cuda.bindings.nvrtc")
    ptx = nvrtc.compile_xla_ptx("sm_90", words)
    for direction in ("store", "load"):
        name = nvrtc.xla_entry_name(direction, words)
        body = ptx[ptx.index(f".entry {name}(") :]
        params = body[: body.index(")")]
        # the blob, the words, jaxlib's two trailing pointers
        assert len(re.findall(r"\.param \.u64", params)) == 1 + words + 2
    assert "griddepcontrol" not in ptx  # no PDL under XLA
    assert "cp.async.bulk.prefetch" not in ptx
    assert nvrtc.xla_words(9) == 16 and nvrtc.xla_words(8) == 8
    with pytest.raises(UnsupportedConfigError, match="buffers"):
        nvrtc.xla_words(nvrtc.XLA_WORD_COUNTS[-1] + 1)


def test_the_ptx_memo_follows_the_isa_override(monkeypatch, tmp_path):
    # The PTX XLA assembles is memoised per ISA override: changing it gets PTX of that version.
    pytest.importorskip("cuda.bindings.nvrtc")
    monkeypatch.setenv(nvrtc.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.setenv(cuda_copy.ENV_PTX_ISA, "8.0")
    old = cuda_copy._ptx("sm_90", 8, cuda_copy._isa_override())
    assert re.search(r"^\.version 8\.0$", old, re.M)
    assert cuda_copy._ptx("sm_90", 8, cuda_copy._isa_override()) is old
    monkeypatch.setenv(cuda_copy.ENV_PTX_ISA, "8.3")
    newer = cuda_copy._ptx("sm_90", 8, cuda_copy._isa_override())
    assert re.search(r"^\.version 8\.3$", newer, re.M) and newer != old
