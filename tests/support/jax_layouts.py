"""Hand-built kernel groups of every page-model layout, for the JAX backend tests.

Each builder returns the backing arrays (NumPy, random bit patterns so every float dtype carries
NaN payloads) and the plan of one kernel group, written from the format's definition in
docs/FORMATS.md (the JAX serving engines), independently of the core's planner.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from kvgroups_core.formats.segments import SegmentRun, widest_unit
from kvgroups_core.tensors.descriptors import TensorSpec
from kvgroups_core.transfer.plan import GroupTransfer, PlaneRef, TransferPlan

DTYPES = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "uint8": np.dtype(np.uint8),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
}

LAYOUTS = (
    "nhd",
    "hnd",
    "flashinfer_nhd",
    "interleaved",
    "heads_outer",
    "indexer",
    "cross_layer",
    "cs_hnd",
)


def random_array(rng, shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    x = rng.integers(0, 256, nbytes, dtype=np.uint8).view(dtype).reshape(shape)
    if dtype.itemsize == 2:
        # Quiet and signalling NaN payloads must survive bit for bit.
        flat = x.reshape(-1).view(np.uint16)
        flat[:4] = [0x7FC1, 0xFF81, 0x7F81, 0x7E55]
    return x


def _run(count, nbytes, obj_offset, obj_step, cache_offset, cache_step, token_stride):
    return SegmentRun(
        count=count,
        nbytes=nbytes,
        obj_offset=obj_offset,
        obj_step=obj_step,
        cache_offset=cache_offset,
        cache_step=cache_step,
        token_stride=token_stride,
    )


def build(layout, dtype="bfloat16", *, nl=2, nb=8, bs=4, nh=2, hs=8, seed=0):
    """``(arrays, planes, block_stride_bytes, runs, row_bytes, dtype)`` of one layout."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    e = dt.itemsize
    row = nh * hs * e
    if layout == "nhd":  # vLLM FlashAttention NHD: list[NL] of [2, NB, BS, NH, HS]
        arrays = [random_array(rng, (2, nb, bs, nh, hs), dt) for _ in range(nl)]
        planes = [(layer, kv * nb * bs * row) for kv in range(2) for layer in range(nl)]
        stride = bs * row
        runs = [_run(1, row, 0, 0, 0, 0, row)]
    elif layout == "hnd":  # [2, NB, NH, BS, HS]
        arrays = [random_array(rng, (2, nb, nh, bs, hs), dt) for _ in range(nl)]
        planes = [(layer, kv * nb * bs * row) for kv in range(2) for layer in range(nl)]
        stride = bs * row
        runs = [_run(nh, hs * e, 0, hs * e, 0, bs * hs * e, hs * e)]
    elif layout == "flashinfer_nhd":  # [NB, 2, BS, NH, HS]
        arrays = [random_array(rng, (nb, 2, bs, nh, hs), dt) for _ in range(nl)]
        planes = [(layer, kv * bs * row) for kv in range(2) for layer in range(nl)]
        stride = 2 * bs * row
        runs = [_run(1, row, 0, 0, 0, 0, row)]
    elif layout == "interleaved":  # tpu-inference [NB, BS, 2*NH/packing, packing, HS]
        packing = max(1, 4 // e)
        arrays = [
            random_array(rng, (nb, bs, 2 * nh // packing, packing, hs), dt) for _ in range(nl)
        ]
        planes = [(layer, kv * hs * e) for kv in range(2) for layer in range(nl)]
        stride = bs * 2 * row
        runs = [_run(nh, hs * e, 0, hs * e, 0, 2 * hs * e, 2 * row)]
    elif layout == "heads_outer":  # MaxText: K and V arrays [NH, NB, BS, HS] per layer
        arrays = [random_array(rng, (nh, nb, bs, hs), dt) for _ in range(2 * nl)]
        planes = [(kv * nl + layer, 0) for kv in range(2) for layer in range(nl)]
        stride = bs * hs * e
        runs = [_run(nh, hs * e, 0, hs * e, 0, nb * bs * hs * e, hs * e)]
    elif layout == "indexer":  # uint8 [NB, BS, 132], blocked values then scales
        dt = DTYPES["uint8"]
        arrays = [random_array(rng, (nb, bs, 132), dt) for _ in range(nl)]
        planes = [(layer, 0) for layer in range(nl)]
        stride = bs * 132
        row = 132
        runs = [_run(1, 128, 0, 0, 0, 0, 128), _run(1, 4, 128, 0, bs * 128, 0, 4)]
    elif layout == "cross_layer":  # one [NB, NL, 2, BS, NH, HS]
        arrays = [random_array(rng, (nb, nl, 2, bs, nh, hs), dt)]
        planes = [(0, (layer * 2 + kv) * bs * row) for kv in range(2) for layer in range(nl)]
        stride = nl * 2 * bs * row
        runs = [_run(1, row, 0, 0, 0, 0, row)]
    elif layout == "cs_hnd":  # vLLM unified K/V per head, HND: [NB, NH, BS, CS], kv_size 1
        arrays = [random_array(rng, (nb, nh, bs, hs), dt) for _ in range(nl)]
        planes = [(layer, 0) for layer in range(nl)]
        stride = bs * row
        runs = [_run(nh, hs * e, 0, hs * e, 0, bs * hs * e, hs * e)]
    else:
        raise ValueError(f"layout: unknown {layout!r}")
    return arrays, planes, stride, runs, row, dt


def make_group(
    layout,
    dtype="bfloat16",
    *,
    direction="store",
    num_chunks=2,
    bpc=2,
    kept=None,
    first_item=0,
    region_offset=0,
    object_nbytes=None,
    object_group=0,
    ids=None,
    nl=2,
    nb=8,
    bs=4,
    nh=2,
    hs=8,
    seed=0,
    index_base=0,
):
    """One GroupTransfer (and its arrays) of ``layout``; ids are random distinct blocks."""
    arrays, planes, stride, runs, row, dt = build(
        layout, dtype, nl=nl, nb=nb, bs=bs, nh=nh, hs=hs, seed=seed
    )
    kept = bpc if kept is None else kept
    rng = np.random.default_rng(seed + 1)
    if ids is None:
        ids = rng.permutation(nb)[: num_chunks * bpc].astype(np.int64)
    plane_refs = tuple(PlaneRef(tensor_index=index_base + s, byte_offset=o) for s, o in planes)
    values = [stride, row] + [o for _, o in planes]
    for r in runs:
        values += list(r.as_tuple()[1:])
    group = GroupTransfer(
        kernel_group_idx=0,
        object_group_idx=object_group,
        region_offset=region_offset,
        row_bytes=row,
        block_size=bs,
        slots=kept * bs,
        planes=plane_refs,
        block_stride_bytes=stride,
        num_blocks=nb,
        runs=tuple(runs),
        unit_bytes=widest_unit(values),
        itemsize=dt.itemsize,
        block_ids=np.asarray(ids),
        blocks_per_chunk=bpc,
        kept_per_chunk=kept,
        first_item=first_item,
        num_chunks=num_chunks,
    )
    return arrays, group


def make_plan(direction, groups, arrays, object_nbytes):
    specs = tuple(TensorSpec(a.shape, a.dtype) for a in arrays)
    return TransferPlan(
        direction=direction,
        num_chunks=groups[0].num_chunks,
        object_nbytes=tuple(object_nbytes),
        groups=tuple(groups),
        tensor_specs=specs,
    )
