"""Where the bytes of one token row live inside a block: the runs of the page model.

Every KV layout kvgroups knows is described by at most a few :class:`SegmentRun` s (see
``docs/DESIGN.md``, "The page model"). Kernels of every backend consume this description, so
it is plain integers only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SegmentRun:
    """``count`` equally sized pieces of a token row, all offsets and strides in bytes.

    Byte ``u`` of piece ``c`` of token ``t``:

    - cache side: ``block_start + cache_offset + c * cache_step + t * token_stride + u``
    - object side: ``row_start + obj_offset + c * obj_step + u``
    """

    count: int
    nbytes: int
    obj_offset: int
    obj_step: int
    cache_offset: int
    cache_step: int
    token_stride: int

    def as_tuple(self) -> tuple[int, int, int, int, int, int, int]:
        return (
            self.count,
            self.nbytes,
            self.obj_offset,
            self.obj_step,
            self.cache_offset,
            self.cache_step,
            self.token_stride,
        )

    @property
    def row_nbytes(self) -> int:
        """Bytes this run contributes to one object row."""
        return self.count * self.nbytes


def widest_unit(values: "list[int] | tuple[int, ...]", limit: int = 16) -> int:
    """Largest power of two <= ``limit`` dividing every value (zeros divide by anything)."""
    unit = limit
    for value in values:
        while unit > 1 and value % unit:
            unit //= 2
    return unit
