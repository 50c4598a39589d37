"""Pallas page copy, Triton lowering (GPU) and interpret mode (CPU tests).

One launch moves one kernel group: grid ``(item_bucket, num_planes)``, one program per (item,
plane) by default (:data:`TUNING` groups planes per program or swaps the axes). Items past the runtime count are masked, so every request whose item count falls in the
same power-of-two bucket reuses the compilation. Caches are flat unsigned views, one operand per
backing array (the plane picks its operand statically under ``pl.when``); the object is
``[num_chunks, object_elems]``. Triton rules (docs/DESIGN.md, Backends): power-of-two array ops, no
scalar prefetch (ids are read inside the kernel), static grid, explicit ``compiler_params``.

Reference: :func:`kvgroups_core.reference.run_group` (the NumPy oracle).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .geometry import Box, GroupGeometry


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
#: defaults are the fastest measured on the H200 (benchmarks/sweep_jax_kernel.py).
#: ``read_first``: load every box of a program before the first store, so the loads are in
#: flight together instead of one load-store round trip per box.
#: ``planes_per_program``: planes one program moves (fewer, larger programs).
#: ``items_major``: grid ``(items, planes)``; False gives ``(planes, items)``.
TUNING = {"read_first": True, "planes_per_program": 1, "items_major": True}


def _copy_kernel(meta_ref, ids_ref, *refs, geom: GroupGeometry, direction: str,
                 read_first: bool, per_program: int, items_axis: int, fresh: bool):
    # meta_ref: [2] int32 (first_item, num_items); ids_ref: [ids_bucket] int32 engine block ids
    # then (unless ``fresh``) obj_ref: [num_chunks, object_elems]; cache inputs [size_k] per
    # operand, then outputs (store: the object [num_chunks, object_elems]; load: the caches).
    # ``fresh``: a store whose object is a new output (not an aliased input).
    num_ops = len(geom.operand_slots)
    obj_ref = None if fresh else refs[0]
    refs = refs if fresh else refs[1:]
    cache_in, outs = refs[:num_ops], refs[num_ops:]
    i = pl.program_id(items_axis)
    plane_group = pl.program_id(1 - items_axis)
    kept, bpc = geom.kept_per_chunk, geom.blocks_per_chunk

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
           read_first, per_program):
    obj_row0 = geom.region_offset + pos * (geom.block_size * geom.row)
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


def default_warps(geom: GroupGeometry) -> int:
    """Warps per program: 8 once a box holds 16 KiB (so each thread keeps <= 8 16-byte
    vectors of it in flight), else 4."""
    largest = max((math.prod(box.shape) for box in geom.boxes), default=0)
    return 8 if largest * geom.unit >= 16384 else 4


def _pallas_copy(direction, geom, grid_items, meta, ids, obj, caches, *, interpret, num_warps):
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
    kernel = functools.partial(_copy_kernel, geom=geom, direction=direction,
                               read_first=bool(TUNING["read_first"]), per_program=per_program,
                               items_axis=0 if items_major else 1, fresh=fresh)
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
