"""Plain XLA page copy: the fallback for every platform and the baseline the kernels must beat.

Same operands and results as :func:`kvgroups_jax.lowerings.triton.copy_group`. When a block-plane is
one contiguous span (NHD rows, cross-layer NHD, MLA) it is the engine-natural ``take`` / ``.at[]
.set`` over ``[rows, span]`` views; otherwise every element is addressed through an index array
(correct for any layout, slower). Items past the runtime count scatter out of bounds and are
dropped, so the same bucketing applies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvgroups_core.errors import UnsupportedConfigError
from kvgroups_jax.geometry import MAX_INDEX, GroupGeometry


def _box_offsets(geom: GroupGeometry) -> tuple[np.ndarray, np.ndarray]:
    """Element offsets of a whole block-plane: ``(cache_offsets, object_offsets)``."""
    cache, obj = [], []
    for box in geom.boxes:
        grids = np.indices(box.shape, dtype=np.int64)
        cache.append(
            (box.cache_offset + sum(g * s for g, s in zip(grids, box.cache_strides))).ravel()
        )
        obj.append((box.obj_offset + sum(g * s for g, s in zip(grids, box.obj_strides))).ravel())
    return np.concatenate(cache).astype(np.int32), np.concatenate(obj).astype(np.int32)


def _rows_ok(geom: GroupGeometry, span: int | None, obj_elems: int) -> bool:
    if span is None:
        return False
    values = list(geom.plane_offsets) + [
        geom.block_stride,
        geom.region_offset,
        geom.slots * geom.row,
        obj_elems,
    ]
    values += list(geom.operand_sizes)
    return all(v % span == 0 for v in values)


def check_index_range(geom: GroupGeometry, n_chunks: int, obj_elems: int, rows: bool) -> None:
    """Raise :class:`UnsupportedConfigError` (at trace time, before anything runs or is donated)
    when an index this path computes would pass int32 (JAX indexes with int32 unless x64 is
    on). The row path indexes rows of ``span`` elements, so it serves caches of up to
    2**31 - 1 rows; the element path up to 2**31 - 1 elements of ``geom.unit`` bytes."""
    span = geom.span if rows else 1
    need = max(list(geom.operand_sizes) + [obj_elems]) // span
    need = max(need, n_chunks * (obj_elems // span) if rows else n_chunks)
    if need > MAX_INDEX:
        what = f"rows of {span * geom.unit} bytes" if rows else f"elements of {geom.unit} bytes"
        raise UnsupportedConfigError(
            f"cache array: expected at most {MAX_INDEX} {what} for the XLA path (int32 "
            f"indexing), got {need}"
        )


def copy_group(direction, geom: GroupGeometry, grid_items, meta, ids, obj, caches, **_):
    """Move one kernel group's pages with XLA gathers and scatters (arguments as
    :func:`kvgroups_jax.lowerings.triton.copy_group`)."""
    kept, bpc = geom.kept_per_chunk, geom.blocks_per_chunk
    n_chunks, obj_elems = obj.shape
    rows_ok = _rows_ok(geom, geom.span, obj_elems)
    check_index_range(geom, n_chunks, obj_elems, rows_ok)
    if isinstance(obj, jax.ShapeDtypeStruct):  # a fresh store: XLA fuses the fill
        obj = jnp.zeros(obj.shape, obj.dtype)
    i = jnp.arange(grid_items, dtype=jnp.int32)
    item = meta[0] + i
    chunk = jnp.clip(item // kept, 0, n_chunks - 1)
    pos = item % kept
    where = jnp.clip(chunk * bpc + (bpc - kept) + pos, 0, ids.shape[0] - 1)
    raw = ids[where]
    # Out-of-range (traced) ids move nothing: their items count as invalid and scatter out of
    # bounds (dropped); the clipped block only keeps the gathers in bounds.
    valid = (i < meta[1]) & (raw >= 0) & (raw < geom.num_blocks)
    block = jnp.clip(raw, 0, geom.num_blocks - 1)
    caches = list(caches)
    span = geom.span
    if rows_ok:
        obj_rows = obj.reshape(n_chunks * (obj_elems // span), span)
        for plane in range(geom.num_planes):
            op = geom.plane_operands[plane]
            cache_rows = caches[op].reshape(-1, span)
            # In rows, not elements: block * block_stride passes int32 on caches of more
            # than 2**31 elements and would wrap to another block.
            crow = geom.plane_offsets[plane] // span + block * (geom.block_stride // span)
            orow = chunk * (obj_elems // span) + geom.object_base(plane, 0) // span + pos
            if direction == "store":
                dst = jnp.where(valid, orow, obj_rows.shape[0])
                obj_rows = obj_rows.at[dst].set(cache_rows[crow], mode="drop")
            else:
                dst = jnp.where(valid, crow, cache_rows.shape[0])
                caches[op] = cache_rows.at[dst].set(obj_rows[orow], mode="drop").reshape(-1)
        if direction == "store":
            return obj_rows.reshape(n_chunks, obj_elems)
        return tuple(caches)
    off_c, off_o = _box_offsets(geom)
    for plane in range(geom.num_planes):
        op = geom.plane_operands[plane]
        cbase = geom.plane_offsets[plane] + block * geom.block_stride
        obase = geom.object_base(plane, 0) + pos * (geom.block_size * geom.row)
        cidx = cbase[:, None] + jnp.asarray(off_c)[None, :]
        oidx = obase[:, None] + jnp.asarray(off_o)[None, :]
        rows = chunk[:, None]
        if direction == "store":
            rows = jnp.where(valid[:, None], rows, n_chunks)
            obj = obj.at[rows, oidx].set(caches[op][cidx], mode="drop")
        else:
            cidx_dst = jnp.where(valid[:, None], cidx, caches[op].shape[0])
            caches[op] = caches[op].at[cidx_dst].set(obj[rows, oidx], mode="drop")
    return obj if direction == "store" else tuple(caches)
