"""Transfer plans: plain data that every backend executes (docs/SEMANTICS.md sections 6-7).

A plan is built from a manager, block ids and the caches' descriptors alone, with no framework
and no data pointers, so it can be made under ``jax.jit`` as well as eagerly. Backends receive
the plan plus the backing tensors in ``plan.tensor_specs`` order and move the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from .segments import SegmentRun

Direction = Literal["store", "load"]


@dataclass(frozen=True, kw_only=True)
class PlaneRef:
    """Where plane ``p = kv * nl + l`` of a kernel group starts.

    ``tensor_slot`` indexes the plan's backing tensors; ``byte_offset`` is counted from that
    tensor's first element (``data_ptr + byte_offset`` of its descriptor) to block 0 of the
    plane.
    """

    tensor_slot: int
    byte_offset: int


@dataclass(frozen=True, kw_only=True)
class GroupTransfer:
    """The work of one kernel group: one kernel launch.

    Items ``i`` in ``[first_item, num_chunks * kept_per_chunk)`` are moved; item ``i`` is chunk
    ``c = i // kept_per_chunk``, kept position ``j = i % kept_per_chunk``, engine block id
    ``block_ids[c * blocks_per_chunk + blocks_per_chunk - kept_per_chunk + j]``. For each item
    and each plane ``p``, token ``t < block_size`` of the block is object row
    ``p * slots + j * block_size + t`` of chunk ``c``'s object, starting ``region_offset``
    bytes into the object.
    """

    kernel_group_idx: int
    object_group_idx: int
    region_offset: int
    row_bytes: int
    block_size: int
    slots: int
    planes: tuple[PlaneRef, ...]
    block_stride_bytes: int
    num_blocks: int
    runs: tuple[SegmentRun, ...]
    unit_bytes: int
    itemsize: int
    block_ids: np.ndarray
    blocks_per_chunk: int
    kept_per_chunk: int
    first_item: int
    num_chunks: int

    @property
    def num_planes(self) -> int:
        return len(self.planes)

    @property
    def num_items(self) -> int:
        return self.num_chunks * self.kept_per_chunk - self.first_item

    @property
    def region_nbytes(self) -> int:
        return self.num_planes * self.slots * self.row_bytes

    def items(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(chunk, position, block_id)`` int64 arrays of the moved items, in item order."""
        i = np.arange(self.first_item, self.num_chunks * self.kept_per_chunk, dtype=np.int64)
        chunk = i // self.kept_per_chunk
        pos = i % self.kept_per_chunk
        where = chunk * self.blocks_per_chunk + (self.blocks_per_chunk - self.kept_per_chunk) + pos
        return chunk, pos, np.asarray(self.block_ids, dtype=np.int64)[where]


@dataclass(frozen=True, kw_only=True)
class TransferPlan:
    """Everything a backend needs to run one ``store`` or ``load`` call."""

    direction: Direction
    num_chunks: int
    object_nbytes: tuple[int, ...]
    groups: tuple[GroupTransfer, ...]
    tensor_specs: tuple  # tuple[TensorSpec, ...]: the backing tensors, in slot order
