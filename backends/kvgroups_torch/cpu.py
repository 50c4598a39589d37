"""The same transfers in plain PyTorch: strided views, ``index_select`` and ``index_copy_``.

Used for CPU tensors, and as the baseline the CUDA kernels are measured against. Every
layout the segment runs describe is handled the same way: for each plane and run, an
``as_strided`` view over the backing tensor's storage shaped ``[num_blocks, block_size,
count, nbytes]`` (block stride, token stride, piece step, 1; padded blocks included) and one
over the objects shaped ``[num_chunks, kept, block_size, count, nbytes]``. A store gathers
whole pages with ``index_select`` on the block axis and writes them to the objects with plain
strided copies; a load reads the objects the same way and scatters with ``index_copy_``.

The moved items are a suffix of ``(chunk, position)`` pairs, so the object side is at most
two plain slices (the rest of the first chunk, then whole chunks): no advanced indexing,
which is slow on the CPU. Views use the widest integer element (up to 8 bytes) dividing
every offset and stride, for the same reason. No Python loop over blocks: only over planes
and runs (and chunks when the objects are separate per-chunk buffers).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError
from kvgroups_core.formats.segments import widest_unit

_ELEMENT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def byte_offset_in_storage(t: torch.Tensor) -> int:
    """Bytes from the start of ``t``'s storage to its first element."""
    return t.data_ptr() - t.untyped_storage().data_ptr()


def storage_view(t: torch.Tensor, unit: int) -> torch.Tensor:
    """A 1-D tensor of ``unit``-byte integers over ``t``'s whole storage."""
    return torch.empty(0, dtype=_ELEMENT[unit], device=t.device).set_(t.untyped_storage())


def _view_end(t: torch.Tensor) -> int:
    """Bytes from the start of ``t``'s storage to just past its last element."""
    end = byte_offset_in_storage(t)
    if t.numel():
        end += (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()
    return end


def _check_storages(plan: Any, caches: Sequence[torch.Tensor], objects: Sequence[Any]) -> None:
    """Raise before any byte moves when a tensor reaches past its storage's end.

    The views below span the whole storage, so a storage shrunk in place after its tensor was
    bound (``untyped_storage().resize_``, which keeps the data pointer on the CPU) would fail
    only at the first plane beyond the new end, after earlier groups had moved their bytes."""
    named: list[tuple[str, torch.Tensor]] = []
    indices = {p.tensor_index for g in plan.groups if g.num_items > 0 for p in g.planes}
    named += [(f"caches[{i}]", caches[i]) for i in sorted(indices)]
    for og, entry in enumerate(objects):
        if isinstance(entry, torch.Tensor):
            named.append((f"objects[{og}]", entry))
        elif isinstance(entry, (list, tuple)):
            named += [
                (f"objects[{og}][{c}]", x)
                for c, x in enumerate(entry)
                if isinstance(x, torch.Tensor)
            ]
    for what, t in named:
        need, have = _view_end(t), t.untyped_storage().nbytes()
        if need > have:
            raise KVGroupsValueError(
                f"{what}: expected a storage of at least {need} bytes (the tensor's offset, "
                f"shape and strides), got {have} bytes (was the storage resized in place?)"
            )


def _item_ids(group: Any, ids: Any, device: torch.device) -> torch.Tensor:
    """Block ids of the moved items, in item order, as an int64 tensor on ``device``."""
    if ids is None:
        ids = group.block_ids
    start, stop = group.first_item, group.num_chunks * group.kept_per_chunk
    bpc, kept = group.blocks_per_chunk, group.kept_per_chunk
    if isinstance(ids, torch.Tensor):
        i = torch.arange(start, stop, device=ids.device)
        chunk = torch.div(i, kept, rounding_mode="floor")
        where = chunk * bpc + (bpc - kept) + (i - chunk * kept)
        return ids.to(torch.int64).index_select(0, where).to(device)
    i = np.arange(start, stop, dtype=np.int64)
    where = (i // kept) * bpc + (bpc - kept) + i % kept
    return torch.from_numpy(np.asarray(ids, dtype=np.int64)[where]).to(device)


def _check_object(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise KVGroupsTypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8:
        raise KVGroupsTypeError(f"{what}: expected a uint8 tensor, got {t.dtype}")
    return t


def _object_buffers(entry: Any, num_chunks: int, what: str) -> list[tuple[torch.Tensor, int]]:
    """``(buffer, chunk_stride)`` per chunk range: one entry for a 2-D tensor, one per chunk
    (stride 0) for separate buffers."""
    if isinstance(entry, torch.Tensor):
        t = _check_object(entry, what)
        if t.dim() != 2 or t.shape[0] < num_chunks or (t.shape[1] > 1 and t.stride(1) != 1):
            raise KVGroupsValueError(
                f"{what}: expected a [>= {num_chunks}, nbytes] tensor with contiguous rows, got "
                f"shape {tuple(t.shape)} strides {t.stride()}"
            )
        return [(t, t.stride(0))]
    if not isinstance(entry, (list, tuple)) or len(entry) < num_chunks:
        raise KVGroupsValueError(
            f"{what}: expected a tensor or a list of {num_chunks} per-chunk tensors"
        )
    return [(_check_object(entry[c], f"{what}[{c}]"), 0) for c in range(num_chunks)]


def _unit(group: Any, caches: Sequence[torch.Tensor], buffers: list) -> int:
    values = [
        group.block_stride_bytes,
        group.row_bytes,
        group.region_offset,
        group.slots * group.row_bytes,
    ]
    for run in group.runs:
        values += [
            run.nbytes,
            run.obj_offset,
            run.obj_step,
            run.cache_offset,
            run.cache_step,
            run.token_stride,
        ]
    for plane in group.planes:
        values += [plane.byte_offset, byte_offset_in_storage(caches[plane.tensor_index])]
    for buf, stride in buffers:
        values += [byte_offset_in_storage(buf), stride]
    return widest_unit(values, limit=8)


def _spans(group: Any, num_buffers: int) -> list[tuple[int, int, int, int, int]]:
    """``(buffer, first_chunk, chunks, first_pos, first_item)``: the moved items as plain
    slices of the object view; item ``first_item`` (counted from the group's first moved
    item) is position ``first_pos`` of chunk ``first_chunk``."""
    kept, n = group.kept_per_chunk, group.num_chunks
    c0, j0 = divmod(group.first_item, kept)
    spans = []
    done = 0
    if j0:  # the rest of a partly skipped chunk
        spans.append((c0 if num_buffers > 1 else 0, c0, 1, j0, done))
        done += kept - j0
        c0 += 1
    if c0 < n:
        if num_buffers > 1:
            for c in range(c0, n):
                spans.append((c, c, 1, 0, done + (c - c0) * kept))
        else:
            spans.append((0, c0, n - c0, 0, done))
    return spans


def execute_plan(
    plan: Any,
    caches: Sequence[torch.Tensor],
    objects: Sequence[Any],
    block_ids: Sequence[Any] | None = None,
) -> None:
    """Execute ``plan`` with torch ops (in place on ``caches`` or ``objects``).

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
    _check_storages(plan, caches, objects)
    for i, group in enumerate(plan.groups):
        if group.num_items <= 0:
            continue
        og = group.object_group_idx
        buffers = _object_buffers(objects[og], group.num_chunks, f"objects[{og}]")
        e = _unit(group, caches, buffers)
        device = caches[group.planes[0].tensor_index].device
        ids = _item_ids(group, None if block_ids is None else block_ids[i], device)
        spans = _spans(group, len(buffers))
        obj_flats = [
            (storage_view(buf, e), byte_offset_in_storage(buf) // e, stride // e)
            for buf, stride in buffers
        ]
        flats = {}
        bs, row, kept = group.block_size, group.row_bytes // e, group.kept_per_chunk
        for plane in group.planes:
            p = plane.object_plane  # the plane's rows in the region (a layer subset skips some)
            index = plane.tensor_index
            if index not in flats:
                flats[index] = storage_view(caches[index], e)
            start = (byte_offset_in_storage(caches[index]) + plane.byte_offset) // e
            for run in group.runs:
                piece = run.nbytes // e
                # [num_blocks, block_size, count, piece]
                cache = torch.as_strided(
                    flats[index],
                    (group.num_blocks, bs, run.count, piece),
                    (group.block_stride_bytes // e, run.token_stride // e, run.cache_step // e, 1),
                    start + run.cache_offset // e,
                )
                pages = cache.index_select(0, ids) if store else None
                if not store:
                    pages = torch.empty(
                        (ids.numel(), bs, run.count, piece), dtype=cache.dtype, device=cache.device
                    )
                for b, c0, nc, j0, k0 in spans:
                    oflat, ostart, ostride = obj_flats[b]
                    first = 0 if len(buffers) > 1 else c0
                    # [chunks, kept - j0, block_size, count, piece] of plane p, run `run`
                    obj = torch.as_strided(
                        oflat,
                        (nc, kept - j0, bs, run.count, piece),
                        (ostride, bs * row, row, run.obj_step // e, 1),
                        ostart
                        + first * ostride
                        + (group.region_offset + p * group.slots * group.row_bytes + run.obj_offset)
                        // e
                        + j0 * bs * row,
                    )
                    part = pages[k0 : k0 + nc * (kept - j0)].view(obj.shape)
                    if store:
                        obj.copy_(part)
                    else:
                        part.copy_(obj)
                if not store:
                    cache.index_copy_(0, ids, pages)
