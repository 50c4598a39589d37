"""Pallas page copy, Triton lowering (GPU) and interpret mode (CPU tests).

One launch moves one kernel group: grid ``(item_bucket, num_planes)``, one program per (item,
plane) by default (:data:`TUNING` groups planes per program or swaps the axes). Items past the runtime count are masked, so every request whose item count falls in the
same power-of-two bucket reuses the compilation. Caches are flat unsigned views, one operand per
backing array (the plane picks its operand statically under ``pl.when``); the object is
``[num_chunks, object_elems]``. Triton rules (docs/DESIGN.md, Backends): power-of-two array ops, no
scalar prefetch (ids are read inside the kernel), static grid, explicit ``compiler_params``.

Reference: :func:`kvgroups_core.transfer.reference.run_group` (the NumPy oracle).
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


#: Kernel-shape knobs, read while tracing (so a change needs ``jax.clear_caches()``); the
#: defaults are the fastest measured on the H200 (docs/PERFORMANCE.md).
#: ``read_first``: load every box of a program before the first store, so the loads are in
#: flight together instead of one load-store round trip per box.
#: ``planes_per_program``: planes one program moves (fewer, larger programs).
#: ``items_major``: grid ``(items, planes)``; False gives ``(planes, items)``.
#: ``items_per_program`` / ``small_page_bytes``: groups whose block-plane is at most
#: ``small_page_bytes`` bytes run the small-page kernel, ``items_per_program`` items (a power of
#: two) per program with their ids read as one vector; 1 or 0 bytes keep one item per program.
#: On for block-planes up to 1 KiB, 8 items per program: faster than one item per program in
#: every such cell of the H200 sweep (docs/PERFORMANCE.md; 512 B store
#: 0.15 -> 0.25 of the copy, 1 KiB 0.33 -> 0.41 / 0.46; loads 0.13-0.39 -> 0.14-0.43); 2 KiB
#: stores gained too but its loads were not measured, so 2 KiB keeps the one-item kernel.
#: ``chunk_order`` (with ``items_major``): one-item programs go about a chunk at a time, every
#: plane group of a row of items before the next row (geometry.chunk_order), so objects are
#: walked front to back; False: every item of plane group 0 first, then group 1, ...
TUNING = {"read_first": True, "planes_per_program": 1, "items_major": True,
          "items_per_program": 8, "small_page_bytes": 1024, "chunk_order": True}


def _copy_kernel(meta_ref, ids_ref, *refs, geom: GroupGeometry, direction: str,
                 read_first: bool, per_program: int, items_axis: int, fresh: bool,
                 chunk_rows: tuple[int, int] | None = None):
    # meta_ref: [2] int32 (first_item, num_items); ids_ref: [ids_bucket] int32 engine block ids
    # then (unless ``fresh``) obj_ref: [num_chunks, object_elems]; cache inputs [size_k] per
    # operand, then outputs (store: the object [num_chunks, object_elems]; load: the caches).
    # ``fresh``: a store whose object is a new output (not an aliased input).
    num_ops = len(geom.operand_slots)
    obj_ref = None if fresh else refs[0]
    refs = refs if fresh else refs[1:]
    cache_in, outs = refs[:num_ops], refs[num_ops:]
    kept, bpc = geom.kept_per_chunk, geom.blocks_per_chunk
    if chunk_rows:  # the (items, groups) grid walked about a chunk at a time
        grid_items, groups = chunk_rows
        i, plane_group = chunk_order(pl.program_id(0) + grid_items * pl.program_id(1),
                                     grid_items, groups, kept)
    else:
        i = pl.program_id(items_axis)
        plane_group = pl.program_id(1 - items_axis)

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
            _move_item(cache_in, outs, obj_ref, chunk, pos, block, plane_group, geom=geom,
                       direction=direction, read_first=read_first, per_program=per_program)


def _move_item(cache_in, outs, obj_ref, chunk, pos, block, plane_group, *, geom, direction,
           read_first, per_program, flat_obj=False):
    obj_row0 = geom.region_offset + pos * (geom.block_size * geom.row)
    if flat_obj:  # the object is one [num_chunks * object_elems] array: fold the chunk in
        obj_row0, chunk = obj_row0 + chunk * geom.object_row_elems, None
    for g0 in range(0, geom.num_planes, per_program):
        planes = range(g0, min(g0 + per_program, geom.num_planes))

        # pl.when traces the branch at once; defaults bind this iteration's values.
        @pl.when(plane_group == g0 // per_program)
        def _(planes=planes):
            moves = []
            for plane in planes:
                op = geom.plane_operands[plane]
                cache_base = geom.plane_offsets[plane] + block * geom.block_stride
                obj_base = obj_row0 + geom.object_plane(plane) * geom.slots * geom.row
                moves += [(op, cache_base, obj_base, box) for box in geom.boxes]
            pending = []
            for op, cache_base, obj_base, box in moves:
                if direction == "store":
                    value = _read(cache_in[op], None, cache_base, box, True)
                    pending.append((lambda v, o=obj_base, b=box:
                                    _write(outs[0], chunk, o, b, False, v), value))
                else:
                    value = _read(obj_ref, chunk, obj_base, box, False)
                    pending.append((lambda v, op=op, c=cache_base, b=box:
                                    _write(outs[op], None, c, b, True, v), value))
                if not read_first:
                    write, value = pending.pop()
                    write(value)
            for write, value in pending:
                write(value)


def _item_offsets(bases, box: Box, strides: tuple[int, ...], start: int):
    """``[items, *box.shape]`` int32 indices: ``bases[i] + start + sum_d iota_d * strides[d]``."""
    shape = (bases.shape[0],) + box.shape
    idx = lax.broadcast_in_dim(bases + start, shape, (0,))
    for d, stride in enumerate(strides):
        idx = idx + lax.broadcasted_iota(jnp.int32, shape, d + 1) * stride
    return idx


def items_per_program(geom: GroupGeometry, grid_items: int, num_chunks: int) -> int:
    """Items one program of the small-page kernel moves; 1 means the one-item kernel.

    A power of two: :data:`TUNING` ``items_per_program`` for block-planes of at most
    ``small_page_bytes``, capped so one op moves at most ``MAX_BOX_ELEMS`` elements, by the
    item bucket, and to 1 where the flat object (the kernel indexes it as one array) would
    pass int32 indexing.
    """
    from kvgroups_jax.geometry import MAX_BOX_ELEMS, MAX_INDEX

    wanted = int(TUNING.get("items_per_program", 1))
    page_bytes = geom.block_size * geom.row * geom.unit
    if wanted <= 1 or page_bytes > int(TUNING.get("small_page_bytes", 0)) or not geom.boxes:
        return 1
    if num_chunks * geom.object_row_elems > MAX_INDEX:
        return 1
    largest = max(math.prod(box.shape) for box in geom.boxes)
    ipp = 1 << (wanted.bit_length() - 1)
    while ipp > 1 and (ipp * largest > MAX_BOX_ELEMS or ipp > grid_items):
        ipp //= 2
    return ipp


def _small_kernel(meta_ref, ids_ref, *refs, geom: GroupGeometry, direction: str,
                  read_first: bool, per_program: int, items_axis: int, fresh: bool, ipp: int):
    # As _copy_kernel, but program i moves items [i * ipp, (i + 1) * ipp): their ids are one
    # vector gather, every box is one [ipp, *box] op when all of them move, and the object is
    # one flat [num_chunks * object_elems] array (an item's chunk is a vector).
    num_ops = len(geom.operand_slots)
    obj_ref = None if fresh else refs[0]
    refs = refs if fresh else refs[1:]
    cache_in, outs = refs[:num_ops], refs[num_ops:]
    i = pl.program_id(items_axis)
    plane_group = pl.program_id(1 - items_axis)
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
        obj_item = chunk * geom.object_row_elems + geom.region_offset \
            + pos * (geom.block_size * geom.row)
        for g0 in range(0, geom.num_planes, per_program):
            planes = range(g0, min(g0 + per_program, geom.num_planes))

            @pl.when(plane_group == g0 // per_program)
            def _(planes=planes):
                pending = []
                for plane in planes:
                    op = geom.plane_operands[plane]
                    cache_base = geom.plane_offsets[plane] + block * geom.block_stride
                    obj_base = obj_item + geom.object_plane(plane) * geom.slots * geom.row
                    for box in geom.boxes:
                        c_idx = _item_offsets(cache_base, box, box.cache_strides,
                                              box.cache_offset)
                        o_idx = _item_offsets(obj_base, box, box.obj_strides, box.obj_offset)
                        if direction == "store":
                            pending.append((outs[0], o_idx, cache_in[op][c_idx]))
                        else:
                            pending.append((outs[op], c_idx, obj_ref[o_idx]))
                        if not read_first:
                            dst, idx, value = pending.pop()
                            dst[idx] = value
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
                    _move_item(cache_in, outs, obj_ref, chunk_k, pos_k, block_k, plane_group,
                               geom=geom, direction=direction, read_first=read_first,
                               per_program=per_program, flat_obj=True)

            return carry

        lax.fori_loop(0, ipp, one, 0)


def default_warps(geom: GroupGeometry) -> int:
    """Warps per program: 8 once a box holds 16 KiB (so each thread keeps <= 8 16-byte
    vectors of it in flight), else 4."""
    largest = max((math.prod(box.shape) for box in geom.boxes), default=0)
    return 8 if largest * geom.unit >= 16384 else 4


def _pallas_copy(direction, geom, grid_items, meta, ids, obj, caches, *, interpret, num_warps):
    ipp = items_per_program(geom, grid_items, obj.shape[0])
    if ipp > 1:
        return _pallas_copy_small(direction, geom, grid_items, meta, ids, obj, caches, ipp,
                                  interpret=interpret, num_warps=num_warps)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    num_ops = len(caches)
    fresh = isinstance(obj, jax.ShapeDtypeStruct)  # store into a new output (no zero-fill)
    if direction == "store":
        out_shape = jax.ShapeDtypeStruct(obj.shape, obj.dtype)
        out_specs = any_spec
        aliases = {} if fresh else {2: 0}
    else:
        out_shape = tuple(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches)
        out_specs = tuple(any_spec for _ in caches)
        aliases = {3 + k: k for k in range(num_ops)}
    per_program = max(1, int(TUNING["planes_per_program"]))
    plane_groups = -(-geom.num_planes // per_program)
    items_major = bool(TUNING["items_major"])
    grid = (grid_items, plane_groups) if items_major else (plane_groups, grid_items)
    rows = (grid_items, plane_groups) if items_major and TUNING["chunk_order"] else None
    kernel = functools.partial(_copy_kernel, geom=geom, direction=direction,
                               read_first=bool(TUNING["read_first"]), per_program=per_program,
                               items_axis=0 if items_major else 1, fresh=fresh,
                               chunk_rows=rows)
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


def _pallas_copy_small(direction, geom, grid_items, meta, ids, obj, caches, ipp, *,
                       interpret, num_warps):
    """The small-page kernel: the object flattened to one array (a free reshape), grid
    ``(grid_items // ipp, plane_groups)`` (or swapped), results shaped as _pallas_copy's."""
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    num_ops = len(caches)
    fresh = isinstance(obj, jax.ShapeDtypeStruct)
    flat = jax.ShapeDtypeStruct((math.prod(obj.shape),), obj.dtype)
    if direction == "store":
        out_shape, out_specs = flat, any_spec
        aliases = {} if fresh else {2: 0}
    else:
        out_shape = tuple(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches)
        out_specs = tuple(any_spec for _ in caches)
        aliases = {3 + k: k for k in range(num_ops)}
    per_program = max(1, int(TUNING["planes_per_program"]))
    plane_groups = -(-geom.num_planes // per_program)
    items_major = bool(TUNING["items_major"])
    programs = grid_items // ipp
    grid = (programs, plane_groups) if items_major else (plane_groups, programs)
    kernel = functools.partial(_small_kernel, geom=geom, direction=direction,
                               read_first=bool(TUNING["read_first"]), per_program=per_program,
                               items_axis=0 if items_major else 1, fresh=fresh, ipp=ipp)
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
    **_,
):
    """Move one kernel group's pages (traceable; the caller jits and donates).

    Parameters
    ----------
    direction : "store" or "load".
    geom : the group's static geometry.
    grid_items : power-of-two item bucket (the grid's first axis).
    num_warps : warps per program; None picks :func:`default_warps`.
    meta : ``[2]`` int32, ``(first_item, num_items)`` with ``num_items <= grid_items``.
    ids : ``[ids_bucket]`` int32 engine block ids of the group.
    obj : ``[num_chunks, object_elems]`` unsigned view of the object group's objects, or (store
        only) a ``jax.ShapeDtypeStruct`` of it: the kernel then returns a new object whose
        bytes outside the moved pages are undefined (the executor passes one only when the
        call writes every byte).
    caches : flat unsigned views ``[size_k]``, one per ``geom.operand_slots`` entry.

    Returns
    -------
    store: the new object view (aliasing ``obj``); load: the new cache views (aliasing
    ``caches``).
    """
    if direction not in ("store", "load"):
        raise ValueError(f"direction: expected 'store' or 'load', got {direction!r}")
    if len(caches) != len(geom.operand_slots):
        raise ValueError(
            f"caches: expected {len(geom.operand_slots)} operands, got {len(caches)}"
        )
    out = _pallas_copy(
        direction, geom, grid_items, meta, ids, obj, tuple(caches),
        interpret=interpret, num_warps=num_warps or default_warps(geom),
    )
    return out if direction == "store" else tuple(out)
