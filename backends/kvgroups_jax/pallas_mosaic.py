"""Pallas page copy, Mosaic GPU lowering (Hopper and newer): TMA through shared memory.

Handles the layouts whose block-plane is one contiguous span on both sides (NHD rows, NHD
cross-layer tensors, MLA and CS rows): each program copies one (item, plane) span global ->
shared -> global with TMA. A TMA box moves at most 256 elements per dimension, so caches are
viewed as ``[rows, 256]`` and a span as ``[span / 256, 256]`` boxes of at most 256 rows; every
offset must then be a whole number of 256-element rows. Other layouts raise
:class:`~kvgroups_core.errors.UnsupportedConfig` and go to the Triton lowering.

Status: lowers for an abstract H200 on jax 0.10.2 (CI test), but on the H200 with jax 0.11.2
``pallas_call`` finds no GPU lowering rule for ``plgpu.CompilerParams`` (AssertionError in
``pallas_call.gpu_lowering``), so ``"auto"`` uses Triton and this path is opt-in until it is
ported to ``plgpu.kernel``.

Reference: :func:`kvgroups_jax.reference.reference_transfer`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvgroups_core.errors import UnsupportedConfig

from .geometry import GroupGeometry

#: TMA moves at most 256 elements per box dimension.
TMA_DIM = 256
#: Shared memory used per program; Hopper has 227 KiB per block, we leave room for occupancy.
MAX_SMEM_BYTES = 64 * 1024


def mosaic_pieces(geom: GroupGeometry) -> tuple[int, int]:
    """``(rows_per_copy, copies)`` of a span, or raise UnsupportedConfig."""
    span = geom.span
    if span is None:
        raise UnsupportedConfig(
            "layout: expected one contiguous span per block and plane for Mosaic GPU (NHD-like), "
            f"got {len(geom.boxes)} strided boxes"
        )
    values = {"span": span, "block_stride": geom.block_stride,
              "region_offset": geom.region_offset, "object_elems": geom.object_row_elems,
              "slots*row": geom.slots * geom.row}
    values.update({f"plane_offset[{p}]": o for p, o in enumerate(geom.plane_offsets)})
    values.update({f"operand_size[{k}]": s for k, s in enumerate(geom.operand_sizes)})
    for name, value in values.items():
        if value % TMA_DIM:
            raise UnsupportedConfig(
                f"{name}: expected a multiple of {TMA_DIM} elements for TMA rows, got {value}"
            )
    rows = span // TMA_DIM
    cap = max(1, min(TMA_DIM, MAX_SMEM_BYTES // (TMA_DIM * geom.unit)))
    per_copy = 1 << (min(rows, cap).bit_length() - 1)
    while rows % per_copy:
        per_copy //= 2
    return per_copy, rows // per_copy


def _tma_kernel(meta_ref, ids_ref, obj_ref, *refs, geom: GroupGeometry, direction: str,
                rows: int, copies: int):
    # meta_ref: [2] int32; ids_ref: [ids_bucket] int32 (GMEM, read as scalars)
    # obj_ref: [num_chunks, object_elems / 256, 256]; caches [size_k / 256, 256]
    # refs: cache inputs, outputs, then scratch smem [rows, 256] and one TMA barrier.
    from jax.experimental.pallas import mosaic_gpu as plgpu

    num_ops = len(geom.operand_slots)
    n_out = 1 if direction == "store" else num_ops
    cache_in = refs[:num_ops]
    outs = refs[num_ops:num_ops + n_out]
    smem, barrier = refs[num_ops + n_out:]
    i = pl.program_id(0)
    plane_id = pl.program_id(1)
    kept, bpc = geom.kept_per_chunk, geom.blocks_per_chunk
    span_rows = geom.span // TMA_DIM

    @pl.when(i < meta_ref[1])
    def _():
        item = meta_ref[0] + i
        chunk = item // kept
        pos = item - chunk * kept
        block = ids_ref[chunk * bpc + (bpc - kept) + pos]
        block = jnp.minimum(jnp.maximum(block, 0), geom.num_blocks - 1)
        for plane in range(geom.num_planes):
            op = geom.plane_operands[plane]

            # pl.when traces the branch at once; defaults bind this iteration's values.
            @pl.when(plane_id == plane)
            def _(plane=plane, op=op):
                crow = (geom.plane_offsets[plane] + block * geom.block_stride) // TMA_DIM
                orow = (geom.region_offset + plane * geom.slots * geom.row) // TMA_DIM
                orow = orow + pos * span_rows
                for k in range(copies):
                    c_win = pl.ds(crow + k * rows, rows)
                    o_win = pl.ds(orow + k * rows, rows)
                    if direction == "store":
                        src = cache_in[op].at[c_win]
                        dst = outs[0].at[chunk, o_win]
                    else:
                        src = obj_ref.at[chunk, o_win]
                        dst = outs[op].at[c_win]
                    plgpu.copy_gmem_to_smem(src, smem, barrier)
                    plgpu.barrier_wait(barrier)
                    plgpu.copy_smem_to_gmem(smem, dst)
                    # The next copy reuses smem: wait until TMA has read it.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        plgpu.wait_smem_to_gmem(0)


def _pallas_tma_copy(direction, geom, grid_items, meta, ids, obj, caches):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    try:
        # jax 0.11 no longer registers the Mosaic GPU pallas_call lowering on import of
        # plgpu; without it pallas_call falls back to asserting on the Triton rule.
        from jax._src.pallas.mosaic_gpu import pallas_call_registration  # noqa: F401
    except ImportError as exc:
        raise UnsupportedConfig(f"lowering: Mosaic GPU is not available in this jax ({exc})") \
            from exc

    rows, copies = mosaic_pieces(geom)
    gmem = pl.BlockSpec(memory_space=plgpu.GMEM)
    num_ops = len(caches)
    if direction == "store":
        out_shape = jax.ShapeDtypeStruct(obj.shape, obj.dtype)
        out_specs = gmem
        aliases = {2: 0}
    else:
        out_shape = tuple(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches)
        out_specs = tuple(gmem for _ in caches)
        aliases = {3 + k: k for k in range(num_ops)}
    return pl.pallas_call(
        functools.partial(_tma_kernel, geom=geom, direction=direction, rows=rows, copies=copies),
        out_shape=out_shape,
        grid=(grid_items, geom.num_planes),
        in_specs=[gmem] * (3 + num_ops),
        out_specs=out_specs,
        scratch_shapes=[plgpu.SMEM((rows, TMA_DIM), obj.dtype), plgpu.Barrier(num_arrivals=1)],
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(),
        name=f"kvgroups_{direction}_pages_tma",
    )(meta, ids, obj, *caches)


def copy_group(direction, geom: GroupGeometry, grid_items, meta, ids, obj, caches, **_):
    """Move one kernel group's pages with TMA (arguments and results as
    :func:`kvgroups_jax.pallas_copy.copy_group`; views are reshaped to 256-wide rows here)."""
    mosaic_pieces(geom)  # raises UnsupportedConfig before tracing anything
    n_chunks, elems = obj.shape
    obj3 = obj.reshape(n_chunks, elems // TMA_DIM, TMA_DIM)
    caches2 = tuple(c.reshape(-1, TMA_DIM) for c in caches)
    out = _pallas_tma_copy(direction, geom, grid_items, meta, ids, obj3, caches2)
    if direction == "store":
        return out.reshape(n_chunks, elems)
    return tuple(c.reshape(-1) for c in out)
