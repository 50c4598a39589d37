"""The same transfers in plain PyTorch: byte views and ``index_select`` / ``index_copy_``.

Used for CPU tensors, and as the baseline the CUDA kernels are measured against. Every
layout the segment runs describe is handled the same way: for each plane and run, a uint8
``as_strided`` view over the backing tensor's storage shaped ``[num_blocks, block_size,
count, nbytes]`` (block stride, token stride, piece step, 1 in bytes; padded blocks
included), and one over the objects shaped ``[num_chunks, kept, block_size, count, nbytes]``.
A store gathers whole pages with ``index_select`` on the block axis; a load scatters them
with ``index_copy_``. No Python loop over blocks: only over planes and runs (and chunks when
the objects are separate per-chunk buffers).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError


def byte_storage(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A 1-D uint8 tensor over ``t``'s whole storage, and ``t``'s first byte in it."""
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
    return flat, t.data_ptr() - storage.data_ptr()


def _items(group: Any, device: torch.device, ids: Any = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(chunk, pos, block_id)`` int64 tensors of the moved items on ``device``."""
    if ids is None:
        ids = group.block_ids
    if isinstance(ids, torch.Tensor):
        start = group.first_item
        i = torch.arange(start, group.num_chunks * group.kept_per_chunk, device=ids.device)
        chunk = torch.div(i, group.kept_per_chunk, rounding_mode="floor")
        pos = i - chunk * group.kept_per_chunk
        where = chunk * group.blocks_per_chunk + (group.blocks_per_chunk - group.kept_per_chunk) + pos
        block = ids.to(torch.int64).index_select(0, where)
        return chunk.to(device), pos.to(device), block.to(device)
    if ids is not group.block_ids:
        i = np.arange(group.first_item, group.num_chunks * group.kept_per_chunk, dtype=np.int64)
        chunk, pos = i // group.kept_per_chunk, i % group.kept_per_chunk
        where = chunk * group.blocks_per_chunk + (group.blocks_per_chunk - group.kept_per_chunk) + pos
        block = np.asarray(ids, dtype=np.int64)[where]
    else:
        chunk, pos, block = group.items()
    return (torch.from_numpy(chunk).to(device), torch.from_numpy(pos).to(device),
            torch.from_numpy(np.ascontiguousarray(block, dtype=np.int64)).to(device))


def _cache_view(flat: torch.Tensor, start: int, group: Any, run: Any, plane: Any) -> torch.Tensor:
    # [num_blocks, block_size, count, nbytes] bytes of one run of one plane.
    return torch.as_strided(
        flat,
        (group.num_blocks, group.block_size, run.count, run.nbytes),
        (group.block_stride_bytes, run.token_stride, run.cache_step, 1),
        start + plane.byte_offset + run.cache_offset,
    )


def _object_view(flat: torch.Tensor, start: int, chunk_stride: int, num_chunks: int,
                 group: Any, run: Any, p: int) -> torch.Tensor:
    # [num_chunks, kept, block_size, count, nbytes] bytes of one run of plane p.
    row = group.row_bytes
    return torch.as_strided(
        flat,
        (num_chunks, group.kept_per_chunk, group.block_size, run.count, run.nbytes),
        (chunk_stride, group.block_size * row, row, run.obj_step, 1),
        start + group.region_offset + p * group.slots * row + run.obj_offset,
    )


def _check_object(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise KVGroupsTypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8:
        raise KVGroupsTypeError(f"{what}: expected a uint8 tensor, got {t.dtype}")
    return t


def _object_parts(entry: Any, num_chunks: int, what: str) -> list[tuple[torch.Tensor, int, int, int, int]]:
    """``(flat, start, chunk_stride, first_chunk, chunks)`` spans covering the chunks."""
    if isinstance(entry, torch.Tensor):
        t = _check_object(entry, what)
        if t.dim() != 2 or t.shape[0] < num_chunks or (t.shape[1] > 1 and t.stride(1) != 1):
            raise KVGroupsValueError(
                f"{what}: expected a [>= {num_chunks}, nbytes] tensor with contiguous rows, got "
                f"shape {tuple(t.shape)} strides {t.stride()}"
            )
        flat, start = byte_storage(t)
        return [(flat, start, t.stride(0), 0, num_chunks)]
    if not isinstance(entry, (list, tuple)) or len(entry) < num_chunks:
        raise KVGroupsValueError(f"{what}: expected a tensor or a list of {num_chunks} per-chunk tensors")
    parts = []
    for c in range(num_chunks):
        flat, start = byte_storage(_check_object(entry[c], f"{what}[{c}]"))
        parts.append((flat, start, 0, c, 1))
    return parts


def run_plan(plan: Any, caches: Sequence[torch.Tensor], objects: Sequence[Any],
             block_ids: Sequence[Any] | None = None) -> None:
    """Execute ``plan`` with torch indexing ops (in place on ``caches`` or ``objects``).

    Parameters
    ----------
    plan : TransferPlan
    caches : sequence of torch.Tensor
        Backing tensors in ``plan.tensor_specs`` order (any dtype; bytes are moved).
    objects : sequence
        Per object group, a ``[num_chunks, nbytes]`` uint8 tensor or a list of per-chunk 1-D
        uint8 tensors.
    block_ids : sequence, optional
        One block-id array per group of ``plan`` replacing ``group.block_ids``.
    """
    store = plan.direction == "store"
    storages = [byte_storage(t) for t in caches]
    for i, group in enumerate(plan.groups):
        if group.num_items <= 0:
            continue
        device = caches[group.planes[0].tensor_slot].device
        chunk, pos, block = _items(group, device, None if block_ids is None else block_ids[i])
        parts = _object_parts(objects[group.object_group_idx], group.num_chunks,
                              f"objects[{group.object_group_idx}]")
        spans = []
        for oflat, ostart, ostride, first_chunk, n in parts:
            if len(parts) == 1:
                spans.append((oflat, ostart, ostride, n, chunk, pos, block))
            else:  # separate per-chunk buffers: this buffer's items only
                mask = chunk == first_chunk
                spans.append((oflat, ostart, ostride, n, chunk[mask] - first_chunk, pos[mask],
                              block[mask]))
        for p, plane in enumerate(group.planes):
            flat, start = storages[plane.tensor_slot]
            for run in group.runs:
                cache = _cache_view(flat, start, group, run, plane)
                for oflat, ostart, ostride, n, c_idx, p_idx, b_idx in spans:
                    if b_idx.numel() == 0:
                        continue
                    obj = _object_view(oflat, ostart, ostride, n, group, run, p)
                    if store:
                        obj[c_idx, p_idx] = cache.index_select(0, b_idx)
                    else:
                        cache.index_copy_(0, b_idx, obj[c_idx, p_idx])
