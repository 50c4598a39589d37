"""Runs of consecutive block ids: one ``(src, dst, length)`` copy instead of ``length`` copies.

A transfer moves blocks one by one in the page model (docs/DESIGN.md), but engines allocate
pages in order more often than not, so neighbouring items of a group transfer often name
neighbouring blocks. Where item ``i`` moves block ``b`` and item ``i + 1`` moves block
``b + 1`` of the same chunk, the two pages sit side by side on both sides (in the cache at the
block stride, in the object one page of rows apart), and a DMA engine moves them as one copy.
:func:`coalesce_runs` finds such runs for any two index sequences; :func:`block_runs` finds
them for a :class:`~kvgroups_core.transfer.plan.GroupTransfer` (its block ids against its object
items).

Users: the torch copy-engine path (one ``cuMemcpyBatchAsync`` entry per run and plane), the
JAX TPU lowering (one DMA per run and plane; its device twin computes the same runs from
traced ids) and a transport pairing a prefill engine's blocks with a decode engine's
(``coalesce_runs(prefill_ids, decode_ids)``).

Not to be confused with :class:`~kvgroups_core.formats.segments.SegmentRun` (where a token row's
bytes lie inside one block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError

from .block_ids import describe_value, host_id_array


@dataclass(frozen=True, eq=False)
class BlockRuns:
    """Maximal runs over which two index sequences both advance by one.

    Run ``r`` pairs ``src[r] + k`` with ``dst[r] + k`` for ``k`` in ``range(length[r])``. All
    three are int64 arrays of the same length (the run count). What ``src`` and ``dst`` index
    is the caller's: :func:`block_runs` gives engine block ids (``src``) and group items
    (``dst``: chunk ``dst // kept_per_chunk``, position ``dst % kept_per_chunk``).
    """

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray

    @property
    def count(self) -> int:
        return int(self.length.size)

    @property
    def total(self) -> int:
        """Pairs covered by all runs together."""
        return int(self.length.sum())

    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """The ``(src, dst)`` pairs the runs cover, in order (the uncoalesced sequences)."""
        k = np.arange(self.total, dtype=np.int64) - np.repeat(
            np.cumsum(self.length) - self.length, self.length
        )
        return np.repeat(self.src, self.length) + k, np.repeat(self.dst, self.length) + k


def _ids(x: Any, what: str) -> np.ndarray:
    # block_runs passes int64 arrays already; anything else is checked like block ids.
    if type(x) is np.ndarray and x.dtype == np.int64 and x.ndim == 1:
        return x
    return host_id_array(x, what)


def _steps(ids: np.ndarray) -> np.ndarray:
    """``ids[i + 1] - ids[i]``, with a wrapped (overflowed) difference never equal to 1."""
    with np.errstate(over="ignore"):
        step = ids[1:] - ids[:-1]
    return np.where(ids[1:] > ids[:-1], step, 0)


def coalesce_runs(src: Any, dst: Any, breaks: Any = None) -> BlockRuns:
    """The runs of ``(src[i], dst[i])`` pairs where both advance by exactly one.

    Parameters
    ----------
    src, dst : 1-D integer sequences of equal length, paired by position.
    breaks : optional 1-D bool sequence of the same length; ``breaks[i]`` starts a new run at
        ``i`` whatever the ids say (a chunk boundary, a boundary of the caller's buffers).

    Returns
    -------
    BlockRuns, in input order; ``total`` equals the input length.
    """
    a, b = _ids(src, "src"), _ids(dst, "dst")
    if a.shape != b.shape:
        raise KVGroupsValueError(f"dst: expected as many entries as src ({a.size}), got {b.size}")
    n = a.size
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return BlockRuns(empty, empty, empty)
    start = np.ones(n, dtype=bool)
    # Compared as differences so that int64's largest id and its smallest (a wrap of a + 1)
    # never count as consecutive.
    start[1:] = (_steps(a) != 1) | (_steps(b) != 1)
    if breaks is not None:
        brk = np.asarray(breaks) if isinstance(breaks, (list, tuple, np.ndarray)) else None
        if brk is None or brk.dtype != np.bool_ or brk.ndim != 1:
            raise KVGroupsTypeError(
                f"breaks: expected a 1-D bool sequence, got {describe_value(breaks)}"
            )
        if brk.shape != a.shape:
            raise KVGroupsValueError(f"breaks: expected {n} entries (one per pair), got {brk.size}")
        start |= brk
    first = np.flatnonzero(start)
    length = np.diff(np.append(first, n))
    return BlockRuns(a[first], b[first], length.astype(np.int64))


def block_runs(
    group: Any,
    first_item: int | None = None,
    *,
    block_ids: Any = None,
    num_blocks: int | None = None,
) -> BlockRuns:
    """The runs of a group transfer: ``src`` = first engine block id, ``dst`` = first item.

    A run never crosses a chunk (a chunk's pages of one plane are contiguous in its object,
    the next chunk's are not). With ``num_blocks``, items whose id lies outside
    ``[0, num_blocks)`` are left out (the device contract for unchecked ids: they move
    nothing) and end the run they interrupt.

    Parameters
    ----------
    group : GroupTransfer (host ids).
    first_item : overrides ``group.first_item`` (a load skip resolved by the caller).
    block_ids : host ids replacing ``group.block_ids``.
    """
    start = group.first_item if first_item is None else int(first_item)
    kept, bpc = group.kept_per_chunk, group.blocks_per_chunk
    item = np.arange(start, group.num_chunks * kept, dtype=np.int64)
    chunk, pos = np.divmod(item, kept)
    ids = group.block_ids if block_ids is None else block_ids
    block = np.asarray(ids, dtype=np.int64)[chunk * bpc + (bpc - kept) + pos]
    breaks = pos == 0
    if num_blocks is not None:
        keep = (block >= 0) & (block < num_blocks)
        if not keep.all():
            # A dropped item breaks the run: the next kept item starts a new one.
            after_gap = np.ones(item.size, dtype=bool)
            after_gap[1:] = ~keep[:-1]
            breaks = (breaks | after_gap)[keep]
            item, block = item[keep], block[keep]
    return coalesce_runs(block, item, breaks)


__all__ = ["BlockRuns", "block_runs", "coalesce_runs"]
