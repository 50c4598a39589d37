"""NumPy reference of the page model, straight from the byte formulas of ``docs/DESIGN.md``.

It shares no code with the kernels' geometry (no box cutting, no unit views): every byte is
addressed with the formula a ``GroupTransfer`` documents, so the kernel tests compare against an
independent computation. Buffers are 1-D uint8 NumPy arrays (the caches' and objects' bytes).
"""

from __future__ import annotations

import numpy as np


def _byte_pairs(group, plane: int, block_id: int, chunk: int, pos: int, object_nbytes: int):
    """``(cache_byte_index, object_byte_index)`` arrays of one block-plane of one item."""
    cache_idx = []
    obj_idx = []
    block_start = group.planes[plane].byte_offset + block_id * group.block_stride_bytes
    t = np.arange(group.block_size, dtype=np.int64)[:, None, None]
    for run in group.runs:
        c = np.arange(run.count, dtype=np.int64)[None, :, None]
        u = np.arange(run.nbytes, dtype=np.int64)[None, None, :]
        cache_idx.append(
            (block_start + run.cache_offset + c * run.cache_step + t * run.token_stride + u).ravel()
        )
        rows = plane * group.slots + pos * group.block_size + t
        obj_idx.append(
            (chunk * object_nbytes + group.region_offset + rows * group.row_bytes
             + run.obj_offset + c * run.obj_step + u).ravel()
        )
    return np.concatenate(cache_idx), np.concatenate(obj_idx)


def reference_transfer(
    direction: str,
    group,
    caches: list[np.ndarray],
    objects: np.ndarray,
    object_nbytes: int,
) -> None:
    """Move one ``GroupTransfer`` in place between uint8 buffers.

    Parameters
    ----------
    direction : "store" (caches -> objects) or "load" (objects -> caches).
    group : kvgroups_core.plan.GroupTransfer
    caches : list of 1-D uint8 arrays, one per plan tensor slot (the slots' bytes).
    objects : 1-D uint8 array ``[num_chunks * object_nbytes]`` of the group's object group.
    object_nbytes : bytes of one chunk's object.
    """
    chunks, positions, block_ids = group.items()
    for chunk, pos, block_id in zip(chunks, positions, block_ids):
        for plane in range(group.num_planes):
            cache = caches[group.planes[plane].tensor_slot]
            ci, oi = _byte_pairs(group, plane, int(block_id), int(chunk), int(pos), object_nbytes)
            if direction == "store":
                objects[oi] = cache[ci]
            else:
                cache[ci] = objects[oi]
