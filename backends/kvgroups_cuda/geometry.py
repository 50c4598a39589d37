"""What a page-copy launch needs from a group's geometry, pointers aside.

:func:`group_shape` reduces a :class:`~kvgroups_core.transfer.plan.GroupTransfer` to the numbers the
kernel takes, and detects the fast path: a page that is one contiguous byte range in both the
cache block and the object (NHD rows), moved as a single run of ``block_size * row_bytes``
bytes with no (token, piece) decomposition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgroups_core.errors import UnsupportedConfigError
from kvgroups_core.formats.segments import SegmentRun, widest_unit

from .params import MAX_RUNS, MAX_TILE

#: Bytes one CTA aims to move: enough to amortise its start, few enough for many CTAs.
TARGET_CTA_BYTES = 32768
_MAX_PAGE_BYTES = 2**31 - 1

#: Contiguous pages of at least this many bytes whose launch moves 16-byte vectors run the
#: warp kernels (``kvg_*_v16_warp``: one warp per 8 KiB segment, no barrier, a grid of every
#: segment), the others the classic kernel. The smallest page that fills a segment: below it
#: lanes of a warp would idle. (Tests set 0, which turns them off, to run the classic kernel
#: on the same pages; launch state made before keeps its kernel.)
WARP_MIN_PAGE_BYTES = 8192


@dataclass(frozen=True)
class GroupShape:
    """Kernel-facing geometry: ``runs`` as the kernel moves them (one synthetic run for a
    contiguous page, with ``block_size`` 1), strides in bytes, ``unit`` the widest vector
    dividing every size, offset and stride."""

    contiguous: bool
    runs: tuple[SegmentRun, ...]
    block_size: int
    block_stride: int
    num_blocks: int
    region_offset: int
    row_bytes: int
    plane_obj_stride: int
    page_obj_stride: int
    page_bytes: int
    unit: int


def is_contiguous_page(group: Any) -> bool:
    """True when every token row of a block is one byte range, rows follow each other in
    the cache exactly as in the object, and the run covers the whole object row."""
    if len(group.runs) != 1:
        return False
    run = group.runs[0]
    row = run.count * run.nbytes
    pieces_packed = run.count == 1 or (run.cache_step == run.nbytes and run.obj_step == run.nbytes)
    return (
        pieces_packed
        and row == group.row_bytes
        and run.obj_offset == 0
        and (run.token_stride == row or group.block_size == 1)
    )


def group_shape(group: Any) -> GroupShape:
    """The :class:`GroupShape` of a group transfer."""
    if not 1 <= len(group.runs) <= MAX_RUNS:
        raise UnsupportedConfigError(
            f"runs: expected 1..{MAX_RUNS} segment runs per kernel group, got {len(group.runs)}"
        )
    bs, row = group.block_size, group.row_bytes
    contiguous = is_contiguous_page(group)
    if contiguous:
        page = bs * row
        runs = (
            SegmentRun(
                count=1,
                nbytes=page,
                obj_offset=0,
                obj_step=0,
                cache_offset=group.runs[0].cache_offset,
                cache_step=0,
                token_stride=0,
            ),
        )
        block_size = 1
    else:
        runs = tuple(group.runs)
        block_size = bs
    values = [group.unit_bytes, group.region_offset, row, group.block_stride_bytes]
    for run in runs:
        values += [
            run.nbytes,
            run.obj_offset,
            run.obj_step,
            run.cache_offset,
            run.cache_step,
            run.token_stride,
        ]
    page_bytes = max(block_size * run.count * run.nbytes for run in runs)
    if page_bytes > _MAX_PAGE_BYTES:
        raise UnsupportedConfigError(
            f"page: expected at most {_MAX_PAGE_BYTES} bytes per block and plane, got {page_bytes}"
        )
    return GroupShape(
        contiguous=contiguous,
        runs=runs,
        block_size=block_size,
        block_stride=group.block_stride_bytes,
        num_blocks=group.num_blocks,
        region_offset=group.region_offset,
        row_bytes=row,
        plane_obj_stride=group.slots * row,
        page_obj_stride=bs * row,
        page_bytes=page_bytes,
        unit=widest_unit(values),
    )


def items_per_cta(page_bytes: int, num_items: int, planes_x_runs: int, num_sms: int) -> int:
    """Items one CTA moves: about :data:`TARGET_CTA_BYTES`, but at least ~4 CTAs per SM."""
    ipc = max(1, min(MAX_TILE, TARGET_CTA_BYTES // max(page_bytes, 1)))
    while ipc > 1 and -(-num_items // ipc) * planes_x_runs < 4 * num_sms:
        ipc //= 2
    return ipc


def uses_warp_kernel(shape: GroupShape) -> bool:
    """Whether a group of ``shape`` runs the warp kernels when its launch moves 16-byte
    vectors (the vector width also depends on the objects' alignment, known per call)."""
    return shape.contiguous and shape.unit % 16 == 0 and 0 < WARP_MIN_PAGE_BYTES <= shape.page_bytes


#: Work units (segments) a warp-kernel launch may have: the kernel counts them in 32 bits.
WARP_MAX_UNITS = 2**31 - 1


def warp_sizing(
    page_bytes: int,
    num_items: int,
    num_planes: int,
    unroll: int,
    warps_per_cta: int,
    first_item: int = 0,
    kept_per_chunk: int = 1,
) -> tuple[int, int] | None:
    """``(segs_per_page, ctas)`` of a warp-kernel launch (one warp per segment of
    ``32 * unroll`` 16-byte vectors of every page), or None when its units would not fit the
    kernel's 32-bit count (the classic kernel takes it).

    The kernel walks whole chunks (every plane's kept pages of a chunk, then the next chunk),
    so its units cover the chunks from the one holding item ``first_item`` to the one holding
    the last item, ``kept_per_chunk`` positions each (those outside the items exit at once).
    """
    segs = -(-(page_bytes // 16) // (32 * unroll))
    lead = first_item % kept_per_chunk
    rows = -(-(lead + num_items) // kept_per_chunk)
    units = segs * rows * kept_per_chunk * num_planes
    if units > WARP_MAX_UNITS:
        return None
    return segs, -(-units // warps_per_cta)
