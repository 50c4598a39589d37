"""Pallas page copy, Mosaic TPU lowering: every page of a kernel group moved by DMAs.

One ``pallas_call`` per kernel group, one grid step. The group's items are first coalesced on
the device into runs of consecutive block ids (:func:`run_table`, the device twin of
:func:`kvgroups_core.block_runs.block_runs`); the table is scalar-prefetched into SMEM. The
caches and the object stay in HBM (``memory_space=pl.ANY``) and the kernel starts one DMA per
run, plane and unrolled window of :mod:`.tpu_windows` (a whole run of pages per DMA wherever
the layout allows), all on one DMA semaphore, then waits for every one of them in the same
order. A load writes the caches in place (``input_output_aliases``, with the executor's
donation); a store writes the object it is given, or creates it (a kernel output, no fill).

Ids outside ``[0, num_blocks)`` (traced ids the host never saw) never reach a DMA: the run
table leaves them out, and the executor reports them through checkify
(:mod:`kvgroups_jax.id_checks`). ``lowering="tpu-interpret"`` runs the same kernel in Pallas'
TPU interpret mode (``pltpu.InterpretParams``: DMA semaphores, in-place aliasing and
out-of-bounds reads modelled on any platform), which is how CI certifies it without a TPU.

Reference: :func:`kvgroups_core.transfer.reference.execute_group` (the NumPy oracle).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvgroups_jax.geometry import GroupGeometry

from .manual_axes import joined_manual_axes, out_struct
from .tpu_windows import DmaPlan, Family, plan_dmas, window


def run_table(meta: jax.Array, ids: jax.Array, geom: GroupGeometry, grid_items: int):
    """``[1 + 4 * grid_items]`` int32: the run count, then per run its chunk, kept position,
    first block and length (the first ``count`` entries of each field are used).

    Items ``[meta[0], meta[0] + meta[1])`` are moved; an item whose id lies outside
    ``[0, num_blocks)`` is left out and ends its run, a run never crosses a chunk (the same
    runs as :func:`kvgroups_core.block_runs.block_runs` with ``num_blocks``).
    """
    kept, bpc = geom.kept_per_chunk, geom.blocks_per_chunk
    i = jnp.arange(grid_items, dtype=jnp.int32)
    item = meta[0] + i
    chunk = item // kept
    pos = item - chunk * kept
    # Items past the count may index past the ids: clipped, then left out as invalid.
    block = ids[jnp.clip(chunk * bpc + (bpc - kept) + pos, 0, ids.shape[0] - 1)]
    valid = (i < meta[1]) & (block >= 0) & (block < geom.num_blocks)
    prev_valid = jnp.concatenate([jnp.zeros(1, bool), valid[:-1]])
    prev_block = jnp.concatenate([jnp.full(1, -2, block.dtype), block[:-1]])
    follows = prev_valid & (pos != 0) & (block == prev_block + 1)
    start = valid & ~follows
    run = jnp.cumsum(start.astype(jnp.int32)) - 1
    length = (
        jnp.zeros(grid_items, jnp.int32).at[jnp.where(valid, run, grid_items)].add(1, mode="drop")
    )
    first = jnp.nonzero(start, size=grid_items, fill_value=0)[0]
    count = jnp.sum(start.astype(jnp.int32))
    return jnp.concatenate(
        [count[None], chunk[first], pos[first], block[first].astype(jnp.int32), length]
    ).astype(jnp.int32)


def _ref_window(ref, lead: tuple, side, k: int, family: Family, move, length):
    """The DMA window of iteration ``k`` of ``family`` on one side's ref."""
    index = list(lead)
    for entry in window(side, k, family, move, length):
        index.append(pl.ds(*entry) if isinstance(entry, tuple) else entry)
    return ref.at[tuple(index)]


def _dma_kernel(
    table_ref, *refs, plan: DmaPlan, direction: str, fresh: bool, grid_items: int, count_dmas: bool
):
    # table_ref: SMEM [1 + 4 * grid_items] int32 (run count; chunk, position, block, length).
    # refs (HBM): [obj_in] (not for a store creating its object), cache inputs (one per
    # operand, viewed as plan.cache_views), outputs (store: the object [chunks, *obj_view];
    # load: the caches), [dma counter (SMEM [1] int32)], the DMA semaphore.
    num_ops = len(plan.cache_views)
    obj_in = None if fresh else refs[0]
    refs = refs if fresh else refs[1:]
    caches_in, outs = refs[:num_ops], refs[num_ops:-1]
    sem = refs[-1]
    counter = outs[-1] if count_dmas else None
    if count_dmas:
        outs = outs[:-1]
        counter[0] = 0

    def copy(family: Family, chunk, pos, block, length, start: bool):
        for k in range(family.dmas):
            cache_win = (caches_in if direction == "store" else outs)[family.operand]
            c = _ref_window(cache_win, (), family.cache, k, family, block, length)
            o = _ref_window(
                outs[0] if direction == "store" else obj_in,
                (chunk,),
                family.obj,
                k,
                family,
                pos,
                length,
            )
            src, dst = (c, o) if direction == "store" else (o, c)
            dma = pltpu.make_async_copy(src, dst, sem)
            if start:
                dma.start()
                if counter is not None:
                    counter[0] += 1
            else:
                dma.wait()

    def every_dma(start: bool):
        @pl.loop(0, table_ref[0])
        def _(r):
            chunk = table_ref[1 + r]
            pos = table_ref[1 + grid_items + r]
            block = table_ref[1 + 2 * grid_items + r]
            length = table_ref[1 + 3 * grid_items + r]
            for family in plan.families:
                if family.run_dim is not None:  # the whole run in one window
                    copy(family, chunk, pos, block, length, start)
                    continue

                @pl.loop(0, length)
                def _(i, family=family):  # one item at a time
                    copy(family, chunk, pos + i, block + i, 1, start)

    every_dma(True)  # every DMA of the launch is in flight before the first wait
    every_dma(False)


def _interpret_params(interpret):
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret or False


def _dma_copy(direction, geom, grid_items, table, obj, caches, *, interpret, count_dmas):
    plan = plan_dmas(geom)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    fresh = isinstance(obj, jax.ShapeDtypeStruct)
    chunks = obj.shape[0]
    obj_shape = (chunks,) + plan.obj_view.shape
    views = tuple(c.reshape(v.shape) for c, v in zip(caches, plan.cache_views))
    # Inside shard_map with check_vma, every output must say over which mesh axes it varies:
    # as every operand together (a page moves between the shards' own arrays).
    mat = joined_manual_axes(table, *views, obj)
    if direction == "store":
        out_shape = [out_struct(obj_shape, obj.dtype, mat)]
        out_specs = [any_spec]
        aliases = {} if fresh else {1: 0}  # operand 0 is the run table
    else:
        out_shape = [out_struct(v.shape, v.dtype, mat) for v in views]
        out_specs = [any_spec] * len(views)
        aliases = {2 + k: k for k in range(len(views))}
    if count_dmas:
        out_shape.append(out_struct((1,), jnp.int32, mat))
        out_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    operands = () if fresh else (obj.reshape(obj_shape),)
    operands += views
    kernel = functools.partial(
        _dma_kernel,
        plan=plan,
        direction=direction,
        fresh=fresh,
        grid_items=grid_items,
        count_dmas=count_dmas,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(1,),
            in_specs=[any_spec] * len(operands),
            out_specs=tuple(out_specs),
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        input_output_aliases=aliases,
        interpret=_interpret_params(interpret),
        name=f"kvgroups_{direction}_pages_tpu",
    )(table, *operands)
    out = list(out)
    counted = out.pop() if count_dmas else None
    if direction == "store":
        result = out[0].reshape(chunks, geom.object_row_elems)
    else:
        result = tuple(o.reshape(c.shape) for o, c in zip(out, caches))
    return (result, counted) if count_dmas else result


def copy_group(
    direction: str,
    geom: GroupGeometry,
    grid_items: int,
    meta: jax.Array,
    ids: jax.Array,
    obj,
    caches: tuple[jax.Array, ...],
    *,
    interpret=False,
    count_dmas: bool = False,
    **_,
):
    """Move one kernel group's pages with TPU DMAs (traceable; the caller jits and donates).

    Arguments and results as :func:`kvgroups_jax.lowerings.triton.copy_group`. ``interpret``:
    ``True`` or a ``pltpu.InterpretParams`` runs the kernel in TPU interpret mode (any
    platform). ``count_dmas`` (a test instrument) also returns the number of DMAs the launch
    started, as an int32 ``[1]`` array.
    """
    if direction not in ("store", "load"):
        raise ValueError(f"direction: expected 'store' or 'load', got {direction!r}")
    if len(caches) != len(geom.operand_indices):
        raise ValueError(
            f"caches: expected {len(geom.operand_indices)} operands, got {len(caches)}"
        )
    table = run_table(jnp.asarray(meta, jnp.int32), jnp.asarray(ids, jnp.int32), geom, grid_items)
    fresh = isinstance(obj, jax.ShapeDtypeStruct)

    def launch(table, *arrays):
        given = obj if fresh else arrays[0]
        return _dma_copy(
            direction,
            geom,
            grid_items,
            table,
            given,
            arrays[0 if fresh else 1 :],
            interpret=interpret,
            count_dmas=count_dmas,
        )

    return _one_launch_per_batch_element(launch)(table, *(() if fresh else (obj,)), *caches)


def _one_launch_per_batch_element(launch):
    """``launch`` under ``jax.vmap`` as one launch per batch element (``lax.map``): a batched
    ``pallas_call`` would block the HBM refs along the batch axis, which DMA kernels on
    ``pl.ANY`` refs do not take."""
    batched = jax.custom_batching.custom_vmap(launch)

    @batched.def_vmap
    def _(axis_size, in_batched, *args):
        args = [
            a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
            for a, b in zip(args, in_batched)
        ]
        out = jax.lax.map(lambda xs: launch(*xs), args)
        return out, jax.tree_util.tree_map(lambda _: True, out)

    return batched


def check_supported(geom: GroupGeometry) -> None:
    """Raise UnsupportedConfigError when no DMA plan fits ``geom`` (see :mod:`.tpu_windows`)."""
    plan_dmas(geom)


__all__ = ["check_supported", "copy_group", "run_table"]
