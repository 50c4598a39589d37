"""Pallas page copy, Mosaic GPU lowering (Hopper and newer): TMA through shared memory.

Handles the layouts whose block-plane is one contiguous span on both sides (NHD rows, NHD
cross-layer tensors, MLA and CS rows): each program copies one (item, plane) span global ->
shared -> global with the TMA unit's bulk copies (``cp.async.bulk``, no tensor maps: see
:func:`_bulk_load_options`). Caches are viewed as ``[rows, 256]`` and a span as
``[span / 256, 256]``, cut into pieces of at most 256 rows (a TMA box's limit, kept so a
tensor-map copy stays legal too); every offset must then be a whole number of 256-element
rows. Other layouts raise :class:`~kvgroups_core.errors.UnsupportedConfigError` and go to the Triton
lowering.

The kernel is an ``mpmd_map`` over a ``plgpu.Mesh`` (``pl.kernel(body, mesh=plgpu.Mesh(...))``,
the machinery under ``plgpu.kernel``), lowered by Mosaic GPU on jax 0.10.2 and 0.11.x alike;
``pl.pallas_call`` lost its Mosaic GPU lowering in 0.11. ``plgpu.kernel`` itself is not used:
on 0.10.2 it wraps the call in ``custom_vmap``, which drops the positions of Ref write effects
("JaxprInputEffect ... does not have a corresponding jaxpr input"); 0.11 fixed that. Shared
memory and barriers are scoped inside the body with ``pl.run_scoped``, as ``plgpu.kernel`` does.

There is no ``input_output_aliases``: the operand the kernel writes (the object on store, the
caches on load) is passed as a ``jax.new_ref`` and read back with ``ref[...]``; the
``mpmd_map`` discharge rule aliases such a Ref's output to its input, so with the executor's
donation the result lives in the input buffer (no copy of a cache or an object). Read-only
operands are passed as plain arrays: jax 0.10.2 aliases every Ref operand, written or not, and
aliasing a non-donated input makes XLA copy it.

A span that fits 64 KiB of shared memory is one TMA load and one TMA store. A longer one is
cut into pieces that alternate between two buffers, each with its own barrier: the load of
piece ``k + 1`` is issued before waiting for piece ``k`` and storing it, so up to two loads and
the previous store are in flight.

Large pages move as fast as with the Triton kernel; small ones far slower (one serial TMA
round trip per program), so ``"auto"`` uses it for spans of 16 KiB and more
(``kvgroups_jax.lowerings.choice.resolve_lowering``). On a GPU the smoke run
(``tests/jax_backend/mosaic_smoke.py``) checks it bit-exact and in place per layout; CI lowers
it for an abstract compute-capability 9.0 GPU on jax 0.10.2
(``tests/jax_backend/test_lowering.py``) and runs it in the Mosaic GPU interpreter
(``tests/jax_backend/test_mosaic_interpret.py``).

Reference: :func:`kvgroups_core.transfer.reference.execute_group` (the NumPy oracle).
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvgroups_core.errors import UnsupportedConfigError
from kvgroups_jax.geometry import GroupGeometry, chunk_order

#: TMA moves at most 256 elements per box dimension.
TMA_DIM = 256
#: Shared memory used per program (all buffers together); Hopper has 227 KiB per block, we
#: leave room for several programs per SM.
MAX_SMEM_BYTES = 64 * 1024
#: Shared-memory buffers per program when a span takes more than one piece.
NUM_BUFFERS = 2

_ITEM_AXIS = "item"
_PLANE_AXIS = "plane"


def mosaic_pieces(geom: GroupGeometry) -> tuple[int, int]:
    """``(rows_per_copy, copies)`` of a span, or raise UnsupportedConfigError."""
    span = geom.span
    if span is None:
        raise UnsupportedConfigError(
            "layout: expected one contiguous span per block and plane for Mosaic GPU (NHD-like), "
            f"got {len(geom.boxes)} strided boxes"
        )
    values = {
        "span": span,
        "block_stride": geom.block_stride,
        "region_offset": geom.region_offset,
        "object_elems": geom.object_row_elems,
        "slots*row": geom.slots * geom.row,
    }
    values.update({f"plane_offset[{p}]": o for p, o in enumerate(geom.plane_offsets)})
    values.update({f"operand_size[{k}]": s for k, s in enumerate(geom.operand_sizes)})
    for name, value in values.items():
        if value % TMA_DIM:
            raise UnsupportedConfigError(
                f"{name}: expected a multiple of {TMA_DIM} elements for TMA rows, got {value}"
            )
    rows = span // TMA_DIM
    row_bytes = TMA_DIM * geom.unit
    # A span that fits the whole budget is one copy through one buffer; a longer one is cut
    # into pieces that each fit one of NUM_BUFFERS buffers.
    whole = _largest_piece(rows, MAX_SMEM_BYTES // row_bytes)
    if whole == rows:
        return rows, 1
    per_copy = _largest_piece(rows, MAX_SMEM_BYTES // (NUM_BUFFERS * row_bytes))
    return per_copy, rows // per_copy


def _largest_piece(rows: int, cap_rows: int) -> int:
    """The largest divisor of ``rows`` that is at most ``cap_rows`` and TMA_DIM (>= 1).

    Any divisor will do: a bulk copy takes any multiple of 16 bytes and a TMA box any extent
    up to 256. An MLA page (576-wide rows, 64 tokens: 144 rows) is then three copies of 48
    rows, not nine of 16 (each piece is unrolled per operand, so fewer pieces also compile
    faster).
    """
    cap = max(1, min(TMA_DIM, cap_rows, rows))
    return next(d for d in range(cap, 0, -1) if rows % d == 0)


def _plane_row(geom: GroupGeometry, plane_id, planes: list[int]):
    """First cache row (of TMA_DIM elements) of plane ``plane_id`` among ``planes``: a chain
    of scalar selects, since a Mosaic GPU kernel may not close over an array constant."""
    row = geom.plane_offsets[planes[0]] // TMA_DIM
    for p in planes[1:]:
        row = jnp.where(plane_id == p, geom.plane_offsets[p] // TMA_DIM, row)
    return row


def _tma_body(
    meta_ref,
    ids_ref,
    *refs,
    geom: GroupGeometry,
    direction: str,
    rows: int,
    copies: int,
    grid_items: int,
):
    # Operands (all in GMEM): meta [2] int32 (first_item, num_items); ids [ids_bucket] int32;
    # store: the caches [size_k / 256, 256] then the object Ref [chunks, elems / 256, 256];
    # load: the object, then the cache Refs. Scratch: smem [buffers, rows, 256] and as many
    # TMA barriers.

    num_ops = len(geom.operand_indices)
    if direction == "store":
        caches, (obj,) = refs[:num_ops], refs[num_ops : num_ops + 1]
    else:
        (obj,), caches = refs[:1], refs[1 : 1 + num_ops]
    smem, barriers = refs[-2:]
    kept, bpc = geom.kept_per_chunk, geom.blocks_per_chunk
    # The item axis is CUDA's x (started first): walk the grid about a chunk at a time.
    i, plane_id = chunk_order(
        lax.axis_index(_ITEM_AXIS) + grid_items * lax.axis_index(_PLANE_AXIS),
        grid_items,
        geom.num_planes,
        kept,
    )
    span_rows = geom.span // TMA_DIM

    @pl.when(i < meta_ref[1])
    def _():
        item = meta_ref[0] + i
        chunk = item // kept
        pos = item - chunk * kept
        block = ids_ref[chunk * bpc + (bpc - kept) + pos]
        # Traced ids are not checked on the host: an id outside the group's blocks moves
        # nothing (the executor reports it through checkify).
        in_range = jnp.logical_and(block >= 0, block < geom.num_blocks)
        # Every offset is a whole number of TMA rows (checked by mosaic_pieces).
        orow = (
            geom.region_offset // TMA_DIM
            + _object_plane(geom, plane_id) * (geom.slots * geom.row // TMA_DIM)
            + pos * span_rows
        )

        @pl.when(in_range)
        def _():
            _copy_spans(
                caches,
                obj,
                smem,
                barriers,
                chunk,
                block,
                orow,
                plane_id,
                geom=geom,
                direction=direction,
                rows=rows,
                copies=copies,
            )


def _object_plane(geom: GroupGeometry, plane_id):
    """Plane ``plane_id``'s index inside the object region (a select chain, as _plane_row)."""
    planes = [geom.object_plane(p) for p in range(geom.num_planes)]
    if planes == list(range(geom.num_planes)):
        return plane_id
    out = planes[0]
    for p in range(1, geom.num_planes):
        out = jnp.where(plane_id == p, planes[p], out)
    return out


def _copy_spans(
    caches, obj, smem, barriers, chunk, block, orow, plane_id, *, geom, direction, rows, copies
):
    """Copy one item's block-plane span through shared memory, in ``copies`` pieces."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    num_ops = len(geom.operand_indices)
    nbuf = smem.shape[0]
    for op in range(num_ops):
        planes = [p for p, o in enumerate(geom.plane_operands) if o == op]

        # pl.when traces the branch at once; defaults bind this iteration's values.
        @pl.when(_in_planes(plane_id, planes, geom.num_planes))
        def _(op=op, planes=planes):
            crow = _plane_row(geom, plane_id, planes) + block * (geom.block_stride // TMA_DIM)

            def windows(k):
                c_win = pl.ds(crow + k * rows, rows)
                o_win = pl.ds(orow + k * rows, rows)
                if direction == "store":
                    return caches[op].at[c_win], obj.at[chunk, o_win]
                return obj.at[chunk, o_win], caches[op].at[c_win]

            def load(k):
                plgpu.copy_gmem_to_smem(
                    windows(k)[0], smem.at[k % nbuf], barriers.at[k % nbuf], **_bulk_load_options()
                )

            load(0)
            for k in range(copies):
                if k + 1 < copies:
                    if k + 1 >= nbuf:
                        # Buffer (k + 1) % nbuf was last read by the store of piece
                        # k + 1 - nbuf; nbuf - 2 stores were issued after it. Wait
                        # until TMA has read it.
                        plgpu.wait_smem_to_gmem(nbuf - 2, wait_read_only=True)
                    load(k + 1)
                plgpu.barrier_wait(barriers.at[k % nbuf])
                plgpu.copy_smem_to_gmem(smem.at[k % nbuf], windows(k)[1])
            plgpu.wait_smem_to_gmem(0)


@functools.cache
def _bulk_load_options() -> dict:
    """Keyword arguments that make ``copy_gmem_to_smem`` a plain bulk copy.

    A span is contiguous, so no tensor map is needed: with an out-of-bounds mode other than
    ZEROS (the default) Mosaic GPU emits ``cp.async.bulk`` with the byte count clamped to the
    array's end, as it already does for SMEM -> GMEM. The default builds one TMA descriptor per
    source array (33 for a 32-layer store), each initialised on the host at every launch, and
    the compile time grows with their number (docs/PERFORMANCE.md, "Measurements behind the
    design").
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    mode = getattr(plgpu, "OOBFillMode", None)
    params = inspect.signature(plgpu.copy_gmem_to_smem).parameters
    if mode is None or "oob_mode" not in params:
        return {}
    return {"oob_mode": mode.UNDEFINED}


def _in_planes(plane_id, planes: list[int], num_planes: int):
    """Whether ``plane_id`` is one of ``planes`` (always true when they are all the planes)."""
    if len(planes) == num_planes:
        return True
    cond = plane_id == planes[0]
    for p in planes[1:]:
        cond = jnp.logical_or(cond, plane_id == p)
    return cond


def _gpu_interpret_params(interpret):
    """``None`` (compile for the GPU) or the Mosaic GPU interpreter's parameters."""
    if not interpret:
        return None
    if interpret is not True:
        return interpret
    try:  # public from jax 0.11
        from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams
    except ImportError:  # jax 0.10
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


def _tma_copy(direction, geom, grid_items, meta, ids, obj, caches, interpret=None):
    """Run the kernel on ``[rows, 256]`` views; returns the written operand(s)."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError as exc:  # jaxlib without the Mosaic GPU extension
        raise UnsupportedConfigError(
            f"lowering: Mosaic GPU is not available in this jax ({exc})"
        ) from exc

    rows, copies = mosaic_pieces(geom)
    nbuf = min(NUM_BUFFERS, copies)
    name = f"kvgroups_{direction}_pages_tma"
    scratch = (
        plgpu.SMEM((nbuf, rows, TMA_DIM), obj.dtype),
        plgpu.Barrier(num_arrivals=1, num_barriers=nbuf),
    )

    def body(*operands):
        # Shared memory and barriers are scoped inside the body, as plgpu.kernel does: the
        # Mosaic GPU mpmd_map lowering takes no scratch operands.
        pl.run_scoped(
            lambda smem, barriers: _tma_body(
                *operands,
                smem,
                barriers,
                geom=geom,
                direction=direction,
                rows=rows,
                copies=copies,
                grid_items=grid_items,
            ),
            *scratch,
        )

    # Mosaic GPU launches the grid reversed (the last axis is CUDA's x, up to 2**31 - 1
    # blocks; y is limited to 65535): items go last.
    mesh = plgpu.Mesh(
        grid=(geom.num_planes, grid_items), grid_names=(_PLANE_AXIS, _ITEM_AXIS), kernel_name=name
    )
    kernel = pl.kernel(
        body,
        out_type=(),
        mesh=mesh,
        compiler_params=plgpu.CompilerParams(),
        interpret=interpret,
        name=name,
    )
    if direction == "store" and isinstance(obj, jax.ShapeDtypeStruct):
        # A new object as the kernel's output: no zero-filled buffer to alias.
        fresh = pl.kernel(
            body,
            out_type=obj,
            mesh=mesh,
            compiler_params=plgpu.CompilerParams(),
            interpret=interpret,
            name=name,
        )
        return fresh(meta, ids, *caches)
    if direction == "store":
        obj_ref = jax.new_ref(obj, memory_space=plgpu.GMEM)
        kernel(meta, ids, *caches, obj_ref)
        return obj_ref[...]
    cache_refs = [jax.new_ref(c, memory_space=plgpu.GMEM) for c in caches]
    kernel(meta, ids, obj, *cache_refs)
    return tuple(r[...] for r in cache_refs)


def copy_group(
    direction, geom: GroupGeometry, grid_items, meta, ids, obj, caches, *, interpret=False, **_
):
    """Move one kernel group's pages with TMA (arguments and results as
    :func:`kvgroups_jax.lowerings.triton.copy_group`; views are reshaped to 256-wide rows here).

    Traceable; the caller jits and donates the written operands (caches on load, objects on
    store), which the results then reuse. ``interpret`` (``True`` or an ``InterpretGPUParams``)
    runs the kernel in the Mosaic GPU interpreter instead (CPU tests; it does not check TMA
    limits, lowering for an abstract compute-capability 9.0 GPU does).
    """
    if direction not in ("store", "load"):
        raise ValueError(f"direction: expected 'store' or 'load', got {direction!r}")
    if len(caches) != len(geom.operand_indices):
        raise ValueError(
            f"caches: expected {len(geom.operand_indices)} operands, got {len(caches)}"
        )
    mosaic_pieces(geom)  # raises UnsupportedConfigError before tracing anything
    n_chunks, elems = obj.shape
    shape3 = (n_chunks, elems // TMA_DIM, TMA_DIM)
    obj3 = (
        jax.ShapeDtypeStruct(shape3, obj.dtype)
        if isinstance(obj, jax.ShapeDtypeStruct)
        else obj.reshape(shape3)
    )
    caches2 = tuple(c.reshape(-1, TMA_DIM) for c in caches)
    out = _tma_copy(
        direction,
        geom,
        grid_items,
        meta,
        ids,
        obj3,
        caches2,
        interpret=_gpu_interpret_params(interpret),
    )
    if direction == "store":
        return out.reshape(n_chunks, elems)
    return tuple(c.reshape(-1) for c in out)
