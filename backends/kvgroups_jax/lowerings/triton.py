"""Pallas page copy, Triton lowering (GPU) and interpret mode (CPU tests).

One launch moves one kernel group: grid ``(item_bucket, num_planes)``, one program per (item,
plane), taken about a chunk at a time (:func:`kvgroups_jax.geometry.chunk_order`); small pages
take several items per program (:class:`~kvgroups_jax.lowerings.tuning.LoweringTuning`). Items
past the runtime count are masked, so every request whose item count falls in the same
power-of-two bucket reuses the compilation. Caches are flat unsigned views, one operand per
backing array (the plane picks its operand statically under ``pl.when``); the object is
``[num_chunks, object_elems]``. Triton rules (docs/DESIGN.md, Backends): power-of-two array ops, no
scalar prefetch (ids are read inside the kernel), static grid, explicit ``compiler_params``.

Reference: :func:`kvgroups_core.transfer.reference.execute_group` (the NumPy oracle).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kvgroups_jax.geometry import Box, GroupGeometry, chunk_order

from .manual_axes import joined_manual_axes, out_struct
from .tuning import DEFAULT_TUNING, LoweringTuning


def _offsets(base, box: Box, strides: tuple[int, ...], start: int):
    """``base + start + sum_d iota_d * strides[d]`` over ``box.shape`` (int32)."""
    idx = base + start
    for d, stride in enumerate(strides):
        idx = idx + lax.broadcasted_iota(jnp.int32, box.shape, d) * stride
    return idx


def _read(ref, chunk, base, box: Box, cache_side: bool):
    strides = box.cache_strides if cache_side else box.obj_strides
    start = box.cache_offset if cache_side else box.obj_offset
    if box.is_contiguous:
        window = pl.ds(base + start, box.shape[0])
        return ref[window] if chunk is None else ref[chunk, window]
    idx = _offsets(base, box, strides, start)
    return ref[idx] if chunk is None else ref[chunk, idx]


def _write(ref, chunk, base, box: Box, cache_side: bool, value) -> None:
    strides = box.cache_strides if cache_side else box.obj_strides
    start = box.cache_offset if cache_side else box.obj_offset
    if box.is_contiguous:
        window = pl.ds(base + start, box.shape[0])
        if chunk is None:
            ref[window] = value
        else:
            ref[chunk, window] = value
        return
    idx = _offsets(base, box, strides, start)
    if chunk is None:
        ref[idx] = value
    else:
        ref[chunk, idx] = value


def _copy_kernel(
    meta_ref, ids_ref, *refs, geom: GroupGeometry, direction: str, fresh: bool, grid_items: int
):
    # meta_ref: [2] int32 (first_item, num_items); ids_ref: [ids_bucket] int32 engine block ids
    # then (unless ``fresh``) obj_ref: [num_chunks, object_elems]; cache inputs [size_k] per
    # operand, then outputs (store: the object [num_chunks, object_elems]; load: the caches).
    # ``fresh``: a store whose object is a new output (not an aliased input).
    num_ops = len(geom.operand_indices)
    obj_ref = None if fresh else refs[0]
    refs = refs if fresh else refs[1:]
    cache_in, outs = refs[:num_ops], refs[num_ops:]
    kept, bpc = geom.kept_per_chunk, geom.blocks_per_chunk
    # The (items, planes) grid walked about a chunk at a time: objects front to back.
    i, plane = chunk_order(
        pl.program_id(0) + grid_items * pl.program_id(1), grid_items, geom.num_planes, kept
    )

    @pl.when(i < meta_ref[1])
    def _():
        item = meta_ref[0] + i
        chunk = item // kept
        pos = item - chunk * kept
        block = ids_ref[chunk * bpc + (bpc - kept) + pos]
        # Traced ids are not checked on the host: an id outside the group's blocks moves
        # nothing (the executor reports it through checkify).
        in_range = jnp.logical_and(block >= 0, block < geom.num_blocks)

        @pl.when(in_range)
        def _():
            _move_item(
                cache_in, outs, obj_ref, chunk, pos, block, plane, geom=geom, direction=direction
            )


def _move_item(
    cache_in, outs, obj_ref, chunk, pos, block, plane_id, *, geom, direction, flat_obj=False
):
    obj_row0 = geom.region_offset + pos * (geom.block_size * geom.row)
    if flat_obj:  # the object is one [num_chunks * object_elems] array: fold the chunk in
        obj_row0, chunk = obj_row0 + chunk * geom.object_row_elems, None
    for plane in range(geom.num_planes):
        # pl.when traces the branch at once; defaults bind this iteration's values.
        @pl.when(plane_id == plane)
        def _(plane=plane):
            op = geom.plane_operands[plane]
            cache_base = geom.plane_offsets[plane] + block * geom.block_stride
            obj_base = obj_row0 + geom.object_plane(plane) * geom.slots * geom.row
            # Every box is loaded before the first store: the loads are in flight together.
            pending = []
            for box in geom.boxes:
                if direction == "store":
                    value = _read(cache_in[op], None, cache_base, box, True)
                    pending.append(
                        (lambda v, b=box: _write(outs[0], chunk, obj_base, b, False, v), value)
                    )
                else:
                    value = _read(obj_ref, chunk, obj_base, box, False)
                    pending.append(
                        (lambda v, b=box: _write(outs[op], None, cache_base, b, True, v), value)
                    )
            for write, value in pending:
                write(value)


def _item_offsets(bases, box: Box, strides: tuple[int, ...], start: int):
    """``[items, *box.shape]`` int32 indices: ``bases[i] + start + sum_d iota_d * strides[d]``."""
    shape = (bases.shape[0],) + box.shape
    idx = lax.broadcast_in_dim(bases + start, shape, (0,))
    for d, stride in enumerate(strides):
        idx = idx + lax.broadcasted_iota(jnp.int32, shape, d + 1) * stride
    return idx


def items_per_program(
    geom: GroupGeometry, grid_items: int, num_chunks: int, tuning: LoweringTuning = DEFAULT_TUNING
) -> int:
    """Items one program of the small-page kernel moves; 1 means the one-item kernel.

    A power of two: ``tuning.items_per_program`` for block-planes of at most
    ``tuning.small_page_bytes``, capped so one op moves at most ``MAX_BOX_ELEMS`` elements, by
    the item bucket, and to 1 where the flat object (the kernel indexes it as one array) would
    pass int32 indexing.
    """
    from kvgroups_jax.geometry import MAX_BOX_ELEMS, MAX_INDEX

    wanted = tuning.items_per_program
    page_bytes = geom.block_size * geom.row * geom.unit
    if wanted <= 1 or page_bytes > tuning.small_page_bytes or not geom.boxes:
        return 1
    if num_chunks * geom.object_row_elems > MAX_INDEX:
        return 1
    largest = max(math.prod(box.shape) for box in geom.boxes)
    ipp = 1 << (wanted.bit_length() - 1)
    while ipp > 1 and (ipp * largest > MAX_BOX_ELEMS or ipp > grid_items):
        ipp //= 2
    return ipp


def _small_kernel(
    meta_ref, ids_ref, *refs, geom: GroupGeometry, direction: str, fresh: bool, ipp: int
):
    # As _copy_kernel, but program i moves items [i * ipp, (i + 1) * ipp): their ids are one
    # vector gather, every box is one [ipp, *box] op when all of them move, and the object is
    # one flat [num_chunks * object_elems] array (an item's chunk is a vector).
    num_ops = len(geom.operand_indices)
    obj_ref = None if fresh else refs[0]
    refs = refs if fresh else refs[1:]
    cache_in, outs = refs[:num_ops], refs[num_ops:]
    i = pl.program_id(0)
    plane_id = pl.program_id(1)
    kept, bpc = geom.kept_per_chunk, geom.blocks_per_chunk
    local = i * ipp + lax.broadcasted_iota(jnp.int32, (ipp,), 0)
    valid = local < meta_ref[1]
    item = meta_ref[0] + local
    chunk = item // kept
    pos = item - chunk * kept
    # Items past the count may index past the ids: read id 0's slot for them instead.
    block = ids_ref[jnp.where(valid, chunk * bpc + (bpc - kept) + pos, 0)]
    # Traced ids are not checked on the host: an id outside the group's blocks moves nothing
    # (the executor reports it through checkify).
    moves = jnp.logical_and(valid, jnp.logical_and(block >= 0, block < geom.num_blocks))
    every = jnp.sum(moves.astype(jnp.int32)) == ipp

    # The common program: every item moves, so every box is one unmasked [ipp, *box] op.
    @pl.when(every)
    def _():
        obj_item = (
            chunk * geom.object_row_elems + geom.region_offset + pos * (geom.block_size * geom.row)
        )
        for plane in range(geom.num_planes):

            @pl.when(plane_id == plane)
            def _(plane=plane):
                op = geom.plane_operands[plane]
                cache_base = geom.plane_offsets[plane] + block * geom.block_stride
                obj_base = obj_item + geom.object_plane(plane) * geom.slots * geom.row
                pending = []  # every load before the first store
                for box in geom.boxes:
                    c_idx = _item_offsets(cache_base, box, box.cache_strides, box.cache_offset)
                    o_idx = _item_offsets(obj_base, box, box.obj_strides, box.obj_offset)
                    if direction == "store":
                        pending.append((outs[0], o_idx, cache_in[op][c_idx]))
                    else:
                        pending.append((outs[op], c_idx, obj_ref[o_idx]))
                for dst, idx, value in pending:
                    dst[idx] = value

    # A program with items that do not move (past the count, before a skip, a bad id): one
    # item at a time, as the one-item kernel moves it (no masked writes, whose lanes could
    # alias a moved page).
    @pl.when(jnp.logical_not(every))
    def _():
        def one(k, carry):
            local_k = i * ipp + k
            item_k = meta_ref[0] + local_k
            chunk_k = item_k // kept
            pos_k = item_k - chunk_k * kept

            @pl.when(local_k < meta_ref[1])
            def _():
                block_k = ids_ref[chunk_k * bpc + (bpc - kept) + pos_k]

                @pl.when(jnp.logical_and(block_k >= 0, block_k < geom.num_blocks))
                def _():
                    _move_item(
                        cache_in,
                        outs,
                        obj_ref,
                        chunk_k,
                        pos_k,
                        block_k,
                        plane_id,
                        geom=geom,
                        direction=direction,
                        flat_obj=True,
                    )

            return carry

        lax.fori_loop(0, ipp, one, 0)


def default_warps(geom: GroupGeometry) -> int:
    """Warps per program: 8 once a box holds 16 KiB (so each thread keeps <= 8 16-byte
    vectors of it in flight), else 4."""
    largest = max((math.prod(box.shape) for box in geom.boxes), default=0)
    return 8 if largest * geom.unit >= 16384 else 4


def _pallas_copy(
    direction, geom, grid_items, meta, ids, obj, caches, *, interpret, num_warps, tuning
):
    ipp = items_per_program(geom, grid_items, obj.shape[0], tuning)
    if ipp > 1:
        return _pallas_copy_small(
            direction,
            geom,
            grid_items,
            meta,
            ids,
            obj,
            caches,
            ipp,
            interpret=interpret,
            num_warps=num_warps,
        )
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    num_ops = len(caches)
    fresh = isinstance(obj, jax.ShapeDtypeStruct)  # store into a new output (no zero-fill)
    axes = joined_manual_axes(meta, ids, obj, *caches)  # inside shard_map (check_vma)
    if direction == "store":
        out_shape = out_struct(obj.shape, obj.dtype, axes)
        out_specs = any_spec
        aliases = {} if fresh else {2: 0}
    else:
        out_shape = tuple(out_struct(c.shape, c.dtype, axes) for c in caches)
        out_specs = tuple(any_spec for _ in caches)
        aliases = {3 + k: k for k in range(num_ops)}
    grid = (grid_items, geom.num_planes)
    kernel = functools.partial(
        _copy_kernel, geom=geom, direction=direction, fresh=fresh, grid_items=grid_items
    )
    operands = (meta, ids) + (() if fresh else (obj,)) + tuple(caches)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=[any_spec] * len(operands),
        out_specs=out_specs,
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"kvgroups_{direction}_pages",
    )(*operands)


def _pallas_copy_small(
    direction, geom, grid_items, meta, ids, obj, caches, ipp, *, interpret, num_warps
):
    """The small-page kernel: the object flattened to one array (a free reshape), grid
    ``(grid_items // ipp, num_planes)``, results shaped as _pallas_copy's."""
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    num_ops = len(caches)
    fresh = isinstance(obj, jax.ShapeDtypeStruct)
    axes = joined_manual_axes(meta, ids, obj, *caches)  # inside shard_map (check_vma)
    flat = out_struct((math.prod(obj.shape),), obj.dtype, axes)
    if direction == "store":
        out_shape, out_specs = flat, any_spec
        aliases = {} if fresh else {2: 0}
    else:
        out_shape = tuple(out_struct(c.shape, c.dtype, axes) for c in caches)
        out_specs = tuple(any_spec for _ in caches)
        aliases = {3 + k: k for k in range(num_ops)}
    grid = (grid_items // ipp, geom.num_planes)
    kernel = functools.partial(_small_kernel, geom=geom, direction=direction, fresh=fresh, ipp=ipp)
    operands = (meta, ids) + (() if fresh else (obj.reshape(-1),)) + tuple(caches)
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=[any_spec] * len(operands),
        out_specs=out_specs,
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"kvgroups_{direction}_small_pages",
    )(*operands)
    return out.reshape(obj.shape) if direction == "store" else out


def copy_group(
    direction: str,
    geom: GroupGeometry,
    grid_items: int,
    meta: jax.Array,
    ids: jax.Array,
    obj: jax.Array,
    caches: tuple[jax.Array, ...],
    *,
    interpret: bool = False,
    num_warps: int | None = None,
    tuning: LoweringTuning = DEFAULT_TUNING,
    **_,
):
    """Move one kernel group's pages (traceable; the caller jits and donates).

    Parameters
    ----------
    direction : "store" or "load".
    geom : the group's static geometry.
    grid_items : power-of-two item bucket (the grid's first axis).
    num_warps : warps per program; None picks :func:`default_warps`.
    tuning : the small-page kernel's choice (:class:`LoweringTuning`).
    meta : ``[2]`` int32, ``(first_item, num_items)`` with ``num_items <= grid_items``.
    ids : ``[ids_bucket]`` int32 engine block ids of the group.
    obj : ``[num_chunks, object_elems]`` unsigned view of the object group's objects, or (store
        only) a ``jax.ShapeDtypeStruct`` of it: the kernel then returns a new object whose
        bytes outside the moved pages are undefined (the executor passes one only when the
        call writes every byte).
    caches : flat unsigned views ``[size_k]``, one per ``geom.operand_indices`` entry.

    Returns
    -------
    store: the new object view (aliasing ``obj``); load: the new cache views (aliasing
    ``caches``).
    """
    if direction not in ("store", "load"):
        raise ValueError(f"direction: expected 'store' or 'load', got {direction!r}")
    if len(caches) != len(geom.operand_indices):
        raise ValueError(
            f"caches: expected {len(geom.operand_indices)} operands, got {len(caches)}"
        )
    out = _pallas_copy(
        direction,
        geom,
        grid_items,
        meta,
        ids,
        obj,
        tuple(caches),
        interpret=interpret,
        num_warps=num_warps or default_warps(geom),
        tuning=tuning,
    )
    return out if direction == "store" else tuple(out)
