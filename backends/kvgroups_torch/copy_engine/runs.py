"""The byte ranges a group transfer moves, as a list of ``(dst, src, nbytes)`` copies.

The copy-engine path (:mod:`.batch`) hands the GPU's DMA engines one list of plain
copies instead of launching a kernel. This module computes that list on the host, from the
same page model the kernels use (docs/DESIGN.md). Where a whole page is one byte range on
both sides and consecutive blocks and positions follow each other (NHD and MLA pages of
per-layer caches), the items are coalesced into runs of consecutive block ids first
(:func:`kvgroups_core.block_runs.block_runs`, shared with the TPU lowering): one copy per run
and plane. Otherwise per item (chunk, position, block id), per plane, per segment run of
:func:`~.geometry.group_shape`, per token and piece, one copy of the piece's bytes between its
place in the cache block and its place in the object row; copies that continue each other on
both sides (the tokens of an NHD page, the heads of a token) are merged into one.

Addresses are plain integers, so the whole computation runs (and is tested) without a GPU:
``plane_bases`` and ``chunk_bases`` may be fake addresses of host buffers.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from kvgroups_cuda.geometry import group_shape

from kvgroups_core.errors import UnsupportedConfigError
from kvgroups_core.transfer.block_runs import block_runs
from kvgroups_core.transfer.plan import PlaneRef

#: Copies one call may hand the driver per group: beyond it (scattered heads of many
#: chunks) the host list alone costs more than a kernel launch ever would.
MAX_COPIES = 1 << 22


def object_plane(plane: PlaneRef, position: int) -> int:
    """The object plane of ``plane`` (its position in ``planes`` unless set)."""
    p = getattr(plane, "object_plane", None)
    return position if p is None or p < 0 else p


def copy_bytes(group: Any) -> int:
    """Bytes of one copy of ``group`` before merging consecutive blocks: a whole page for
    contiguous pages, a token's pieces when they are packed on both sides, else a piece.
    The smallest over the group's runs; what the path chooser compares."""
    shape = group_shape(group)
    if shape.contiguous:
        return shape.page_bytes
    sizes = []
    for run in shape.runs:
        packed = run.count == 1 or (run.cache_step == run.nbytes and run.obj_step == run.nbytes)
        token = run.count * run.nbytes if packed else run.nbytes
        rows_follow = packed and token == group.row_bytes and run.token_stride == token
        sizes.append(token * shape.block_size if rows_follow else token)
    return min(sizes)


def _merge(dst: np.ndarray, src: np.ndarray, nbytes: int) -> tuple[np.ndarray, ...]:
    """Merge runs of copies of ``nbytes`` bytes that continue each other on both sides."""
    n = dst.size
    if n <= 1:
        return dst, src, np.full(n, nbytes, dtype=np.int64)
    breaks = (dst[1:] != dst[:-1] + nbytes) | (src[1:] != src[:-1] + nbytes)
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    sizes = np.diff(np.append(starts, n)) * nbytes
    return dst[starts], src[starts], sizes


def _run_copies(
    group: Any,
    shape: Any,
    runs: Any,
    direction: str,
    planes: np.ndarray,
    rows: np.ndarray,
    chunk_bases: np.ndarray,
) -> tuple[np.ndarray, ...]:
    """One copy per (plane, run) of whole pages: ``length`` pages that follow each other in
    the cache (blocks ``src ..``) and in the object (positions ``dst % kept ..``)."""
    chunk, pos = np.divmod(runs.dst, group.kept_per_chunk)
    cache = planes[:, None] + shape.runs[0].cache_offset + (runs.src * shape.block_stride)[None, :]
    obj = (chunk_bases[chunk] + shape.region_offset + pos * shape.page_obj_stride)[None, :] + (
        rows * shape.plane_obj_stride
    )[:, None]
    sizes = np.broadcast_to(runs.length * shape.page_bytes, cache.shape)
    dst, src = (obj, cache) if direction == "store" else (cache, obj)
    if dst.size > MAX_COPIES:
        raise UnsupportedConfigError(
            f"path: expected at most {MAX_COPIES} copies per group for 'copy_engine', got "
            f"{dst.size} (use path='kernel')"
        )
    return dst.reshape(-1), src.reshape(-1), sizes.reshape(-1).copy()


def group_copies(
    group: Any,
    direction: str,
    plane_bases: Sequence[int],
    chunk_bases: Sequence[int],
    block_ids: Any = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dst, src, nbytes)`` int64 arrays of what ``group`` moves in ``direction``.

    Parameters
    ----------
    group : GroupTransfer
        A host-id group of the plan (``first_item`` is the real first item).
    direction : {"store", "load"}
        Store copies cache -> object, load object -> cache.
    plane_bases : sequence of int
        Address of each plane of ``group.planes`` (its tensor's address plus ``byte_offset``).
    chunk_bases : sequence of int
        Address of each chunk's object row (``num_chunks`` entries).
    block_ids : array, optional
        Host ids replacing ``group.block_ids``.
    """
    shape = group_shape(group)
    ids = group.block_ids if block_ids is None else block_ids
    start, total = group.first_item, group.num_chunks * group.kept_per_chunk
    empty = np.empty(0, dtype=np.int64)
    if start >= total:
        return empty, empty, empty
    planes = np.asarray(plane_bases, dtype=np.int64)
    rows = np.asarray([object_plane(p, i) for i, p in enumerate(group.planes)], dtype=np.int64)
    if shape.contiguous and shape.block_stride == shape.page_bytes == shape.page_obj_stride:
        return _run_copies(
            group,
            shape,
            block_runs(group, block_ids=ids),
            direction,
            planes,
            rows,
            np.asarray(chunk_bases, dtype=np.int64),
        )
    item = np.arange(start, total, dtype=np.int64)
    chunk, pos = np.divmod(item, group.kept_per_chunk)
    bpc, kept = group.blocks_per_chunk, group.kept_per_chunk
    block = np.asarray(ids, dtype=np.int64)[chunk * bpc + (bpc - kept) + pos]
    # Per (plane, item): the block's address in the cache and the page's in the object.
    cache_page = planes[:, None] + (block * shape.block_stride)[None, :]
    obj_page = (
        np.asarray(chunk_bases, dtype=np.int64)[chunk]
        + shape.region_offset
        + pos * shape.page_obj_stride
    )[None, :] + (rows * shape.plane_obj_stride)[:, None]
    count = planes.size * item.size * sum(shape.block_size * r.count for r in shape.runs)
    if count > MAX_COPIES * 8:
        raise UnsupportedConfigError(
            f"path: expected at most {MAX_COPIES * 8} pieces per group for 'copy_engine', got "
            f"{count} (scattered pieces: use path='kernel')"
        )
    dsts, srcs, sizes = [], [], []
    tokens = np.arange(shape.block_size, dtype=np.int64)
    for run in shape.runs:
        pieces = np.arange(run.count, dtype=np.int64)
        # [plane, item, token, piece], in object order within each plane.
        cache_in = (
            run.cache_offset + tokens[:, None] * run.token_stride + pieces[None, :] * run.cache_step
        )
        obj_in = run.obj_offset + tokens[:, None] * shape.row_bytes + pieces[None, :] * run.obj_step
        cache = (cache_page[:, :, None, None] + cache_in[None, None]).reshape(-1)
        obj = (obj_page[:, :, None, None] + obj_in[None, None]).reshape(-1)
        dst, src = (obj, cache) if direction == "store" else (cache, obj)
        d, s, n = _merge(dst, src, run.nbytes)
        dsts.append(d)
        srcs.append(s)
        sizes.append(n)
    out = tuple(np.concatenate(x) if len(x) > 1 else x[0] for x in (dsts, srcs, sizes))
    if out[0].size > MAX_COPIES:
        raise UnsupportedConfigError(
            f"path: expected at most {MAX_COPIES} copies per group for 'copy_engine', got "
            f"{out[0].size} (scattered pieces: use path='kernel')"
        )
    return out
