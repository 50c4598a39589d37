"""Tensor parallelism of conv states: split and merge by sub-projection (docs/SEMANTICS.md
section 9, docs/TENSOR_PARALLEL.md).

A conv state's channels are the concatenation of the layer's input projections (Mamba2
``x | B | C``, GDN ``Q | K | V``, Mamba1 ``x``), and a tensor-parallel rank holds its part of
*each*: ``[x_r | B_r | C_r]``. So rank objects are not byte ranges of the whole-model
(canonical) object, and plain head concatenation would interleave them wrongly. A
:class:`ConvSplit` says which channels of each projection a rank holds; :func:`merge_conv` and
:func:`split_conv` move whole projection pieces between rank regions and the canonical region,
over every chunk and layer at once (one slice per projection and rank, no loop over chunks),
with the arrays' own operations, so any framework's arrays work (see ``tp_convert``).

A projection with fewer units (heads or groups) than ranks is replicated: rank ``r`` holds
unit ``r // (t / units)``, as vLLM extends Mamba2's groups when ``n_groups < tp``; merging
takes the first rank holding each unit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvgroups_core.errors import KVGroupsValueError


@dataclass(frozen=True)
class ConvSplit:
    """How one rank's conv state relates to the whole model's.

    ``channels`` / ``rank_channels``: per projection, its channels in the whole model and on
    one rank; ``parts``: distinct channel sets of the projection over the ranks
    (``min(units, tp_size)``); ``window``: the conv window (kernel - 1); ``dim_first``: the
    "DS" orientation (channels outer, a projection piece is ``rank channels x window``
    contiguous elements) rather than "SD" (window rows of every projection's channels).
    """

    tp_size: int
    channels: tuple[int, ...]
    rank_channels: tuple[int, ...]
    parts: tuple[int, ...]
    window: int
    itemsize: int
    dim_first: bool

    @property
    def replicated(self) -> bool:
        """Some projection is held whole by several ranks."""
        return any(p < self.tp_size for p in self.parts)

    @property
    def fully_replicated(self) -> bool:
        return all(p == 1 for p in self.parts)

    @property
    def repeats(self) -> int:
        """Rows of channels per state: the window in "SD", 1 in "DS"."""
        return 1 if self.dim_first else self.window

    def piece_bytes(self, channels: int) -> int:
        """Bytes of ``channels`` channels of one projection in one repeat."""
        return channels * self.itemsize * (self.window if self.dim_first else 1)

    @property
    def rank_row_bytes(self) -> int:
        return self.repeats * sum(self.piece_bytes(c) for c in self.rank_channels)

    @property
    def canonical_row_bytes(self) -> int:
        return self.repeats * sum(self.piece_bytes(c) for c in self.channels)

    def owner(self, projection: int, part: int) -> int:
        """The first rank holding part ``part`` of a projection."""
        return part * (self.tp_size // self.parts[projection])

    def part_of(self, projection: int, rank: int) -> int:
        return rank // (self.tp_size // self.parts[projection])


def conv_split(
    projections: Sequence[tuple[int, int]],
    tp_size: int,
    rank_nh: int,
    rank_hs: int,
    itemsize: int,
    dim_first: bool,
    what: str,
) -> ConvSplit:
    """The :class:`ConvSplit` of a rank's conv kernel group (``rank_nh`` / ``rank_hs``: its
    layout's heads and head size: ``CD, CW`` in "DS", ``1, CW * CD`` in "SD")."""
    channels, rank_channels, parts = [], [], []
    for j, (c, units) in enumerate(projections):
        if units % tp_size and tp_size % units:
            raise KVGroupsValueError(
                f"{what}: conv_projections[{j}] has {units} units, expected a multiple or a "
                f"divisor of tp_size {tp_size}"
            )
        p = min(units, tp_size)
        channels.append(c)
        rank_channels.append(c // p)
        parts.append(p)
    rank_total = sum(rank_channels)
    if dim_first:
        window, ok = rank_hs, rank_nh == rank_total
    else:
        window, ok = rank_hs // rank_total, rank_hs % rank_total == 0
    if not ok:
        raise KVGroupsValueError(
            f"{what}: conv_projections {tuple(projections)} give {rank_total} channels per rank "
            f"at tp_size {tp_size}, expected the rank's conv state to hold them, got a "
            f"{'(channels, window)' if dim_first else '(window, channels)'} state of "
            f"{rank_nh if dim_first else 'window x channels ='} "
            f"{rank_nh if dim_first else rank_hs} elements per {'row' if dim_first else 'slot'}"
        )
    return ConvSplit(
        tp_size, tuple(channels), tuple(rank_channels), tuple(parts), window, itemsize, dim_first
    )


Concat = Callable[[list, int], Any]


def merge_conv(
    split: ConvSplit, rank_regions: Sequence[Any], chunks: int, rows: int, concat: Concat
) -> Any:
    """The canonical conv region ``[chunks, rows * canonical_row_bytes]`` from every rank's
    region (``rank_regions[r]``: ``[chunks, rows * rank_row_bytes]`` uint8)."""
    shape = (chunks, rows, split.repeats, split.rank_row_bytes // split.repeats)
    views = [x.reshape(shape) for x in rank_regions]
    pieces, start = [], 0
    for j, c in enumerate(split.rank_channels):
        width = split.piece_bytes(c)
        for part in range(split.parts[j]):
            pieces.append(views[split.owner(j, part)][..., start : start + width])
        start += width
    return concat(pieces, 3).reshape((chunks, rows * split.canonical_row_bytes))


def split_conv(
    split: ConvSplit, canonical: Any, chunks: int, rows: int, rank: int, concat: Concat
) -> Any:
    """Rank ``rank``'s conv region ``[chunks, rows * rank_row_bytes]`` from the canonical
    region ``[chunks, rows * canonical_row_bytes]``."""
    view = canonical.reshape(
        (chunks, rows, split.repeats, split.canonical_row_bytes // split.repeats)
    )
    pieces, start = [], 0
    for j, c in enumerate(split.rank_channels):
        width = split.piece_bytes(c)
        offset = start + split.part_of(j, rank) * width
        pieces.append(view[..., offset : offset + width])
        start += width * split.parts[j]
    return concat(pieces, 3).reshape((chunks, rows * split.rank_row_bytes))
