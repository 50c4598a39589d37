"""Hand-built GroupTransfers for every run shape, and an independent byte-level oracle.

The oracle walks items, planes, runs, tokens and pieces with plain Python slicing over byte
arrays, straight from the page-model formula of docs/DESIGN.md; it shares no code with the
kernels, the torch path or the core's reference (the tests compare against both).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvgroups_core.formats.segments import SegmentRun, widest_unit
from kvgroups_core.transfer.plan import GroupTransfer, PlaneRef, TransferPlan

TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "uint8": torch.uint8,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "uint8": 1, "float8_e4m3fn": 1}

LAYOUTS = (
    "nhd",
    "nhd_padded",
    "hnd",
    "interleaved",
    "heads_outer",
    "cross_layer",
    "mla",
    "indexer",
)


@dataclass
class Geometry:
    tensor_nbytes: list[int]
    planes: tuple[PlaneRef, ...]
    runs: tuple[SegmentRun, ...]
    block_stride: int
    row_bytes: int


def run(count, nbytes, obj_offset, obj_step, cache_offset, cache_step, token_stride):
    return SegmentRun(
        count=count,
        nbytes=nbytes,
        obj_offset=obj_offset,
        obj_step=obj_step,
        cache_offset=cache_offset,
        cache_step=cache_step,
        token_stride=token_stride,
    )


def geometry(layout: str, *, nl: int, nb: int, bs: int, nh: int, hs: int, e: int) -> Geometry:
    """Backing tensors (bytes per tensor), planes p = kv * nl + l, runs and block stride."""
    row = nh * hs * e
    page = bs * row
    if layout == "nhd":  # list[NL] of [2, NB, BS, NH, HS]
        planes = [
            PlaneRef(tensor_index=layer, byte_offset=kv * nb * page)
            for kv in range(2)
            for layer in range(nl)
        ]
        return Geometry(
            [2 * nb * page] * nl, tuple(planes), (run(1, row, 0, 0, 0, 0, row),), page, row
        )
    if layout == "nhd_padded":  # list[NL] of [NB, 2, BS, NH, HS], blocks padded by 3 elements
        stride = 2 * page + 3 * e
        planes = [
            PlaneRef(tensor_index=layer, byte_offset=kv * page)
            for kv in range(2)
            for layer in range(nl)
        ]
        return Geometry(
            [nb * stride] * nl, tuple(planes), (run(1, row, 0, 0, 0, 0, row),), stride, row
        )
    if layout == "hnd":  # list[NL] of [2, NB, NH, BS, HS]
        planes = [
            PlaneRef(tensor_index=layer, byte_offset=kv * nb * page)
            for kv in range(2)
            for layer in range(nl)
        ]
        return Geometry(
            [2 * nb * page] * nl,
            tuple(planes),
            (run(nh, hs * e, 0, hs * e, 0, bs * hs * e, hs * e),),
            page,
            row,
        )
    if layout == "interleaved":  # list[NL] of [NB, BS, NH, 2, HS]: V plane base + HS*e
        planes = [
            PlaneRef(tensor_index=layer, byte_offset=kv * hs * e)
            for kv in range(2)
            for layer in range(nl)
        ]
        return Geometry(
            [nb * 2 * page] * nl,
            tuple(planes),
            (run(nh, hs * e, 0, hs * e, 0, 2 * hs * e, 2 * row),),
            2 * page,
            row,
        )
    if layout == "heads_outer":  # K list + V list of [NH, NB, BS, HS]
        planes = [
            PlaneRef(tensor_index=kv * nl + layer, byte_offset=0)
            for kv in range(2)
            for layer in range(nl)
        ]
        return Geometry(
            [nh * nb * bs * hs * e] * (2 * nl),
            tuple(planes),
            (run(nh, hs * e, 0, hs * e, 0, nb * bs * hs * e, hs * e),),
            bs * hs * e,
            row,
        )
    if layout == "cross_layer":  # one [NB, NL, 2, BS, NH, HS]
        planes = [
            PlaneRef(tensor_index=0, byte_offset=(layer * 2 + kv) * page)
            for kv in range(2)
            for layer in range(nl)
        ]
        return Geometry(
            [nb * nl * 2 * page], tuple(planes), (run(1, row, 0, 0, 0, 0, row),), nl * 2 * page, row
        )
    if layout == "mla":  # list[NL] of [NB, BS, HS], one plane per layer
        row = hs * e
        planes = [PlaneRef(tensor_index=layer, byte_offset=0) for layer in range(nl)]
        return Geometry(
            [nb * bs * row] * nl, tuple(planes), (run(1, row, 0, 0, 0, 0, row),), bs * row, row
        )
    if layout == "indexer":  # list[NL] of uint8 [NB, BS, 132]: values block, then scales
        planes = [PlaneRef(tensor_index=layer, byte_offset=0) for layer in range(nl)]
        runs = (run(1, 128, 0, 0, 0, 0, 128), run(1, 4, 128, 0, bs * 128, 0, 4))
        return Geometry([nb * bs * 132] * nl, tuple(planes), runs, bs * 132, 132)
    raise ValueError(layout)


@dataclass
class Case:
    plan: TransferPlan
    caches: list[np.ndarray]  # uint8 bytes per backing tensor
    objects: np.ndarray  # uint8 [num_chunks, nbytes]
    dtype: str


def make_case(
    layout: str,
    dtype: str,
    direction: str,
    rng: np.random.Generator,
    *,
    nl: int = 3,
    nb: int = 40,
    bs: int = 4,
    nh: int = 2,
    hs: int = 16,
    num_chunks: int = 3,
    bpc: int = 4,
    kept: int = 4,
    first_item: int = 0,
    region_pad: int = 0,
) -> Case:
    """A random case; ``region_pad`` bytes of another region precede this group's region."""
    e = 1 if layout == "indexer" else ITEMSIZE[dtype]
    if layout == "mla":
        hs = hs * 2
    g = geometry(layout, nl=nl, nb=nb, bs=bs, nh=nh, hs=hs, e=e)
    slots = kept * bs
    region = len(g.planes) * slots * g.row_bytes
    nbytes = region_pad + region + 8  # and a tail nobody writes
    ids = rng.permutation(nb)[: num_chunks * bpc].astype(np.int64)
    values = [g.block_stride, g.row_bytes, region_pad]
    for r in g.runs:
        values += [r.nbytes, r.obj_offset, r.obj_step, r.cache_offset, r.cache_step, r.token_stride]
    values += [p.byte_offset for p in g.planes]
    group = GroupTransfer(
        kernel_group_idx=0,
        object_group_idx=0,
        region_offset=region_pad,
        row_bytes=g.row_bytes,
        block_size=bs,
        slots=slots,
        planes=g.planes,
        block_stride_bytes=g.block_stride,
        num_blocks=nb,
        runs=g.runs,
        unit_bytes=widest_unit(values),
        itemsize=e,
        block_ids=ids,
        blocks_per_chunk=bpc,
        kept_per_chunk=kept,
        first_item=first_item,
        num_chunks=num_chunks,
    )
    plan = TransferPlan(
        direction=direction,
        num_chunks=num_chunks,
        object_nbytes=(nbytes,),
        groups=(group,),
        tensor_specs=(),
    )
    caches = [rng.integers(0, 256, n, dtype=np.uint8) for n in g.tensor_nbytes]
    objects = rng.integers(0, 256, (num_chunks, nbytes), dtype=np.uint8)
    return Case(plan, caches, objects, "uint8" if layout == "indexer" else dtype)


def oracle(case: Case, ids=None) -> tuple[list[np.ndarray], np.ndarray]:
    """Expected (caches, objects) after the transfer, byte by byte from the page model.

    ``ids`` replaces the plan's block ids; items whose id is out of range move nothing."""
    caches = [c.copy() for c in case.caches]
    objects = case.objects.copy()
    store = case.plan.direction == "store"
    for t in case.plan.groups:
        for i in range(t.first_item, t.num_chunks * t.kept_per_chunk):
            c, j = divmod(i, t.kept_per_chunk)
            block_ids = t.block_ids if ids is None else np.asarray(ids)
            b = int(block_ids[c * t.blocks_per_chunk + t.blocks_per_chunk - t.kept_per_chunk + j])
            if not 0 <= b < t.num_blocks:
                continue
            for p, plane in enumerate(t.planes):
                cache = caches[plane.tensor_index]
                for r in t.runs:
                    for tok in range(t.block_size):
                        for k in range(r.count):
                            cs = (
                                plane.byte_offset
                                + b * t.block_stride_bytes
                                + r.cache_offset
                                + k * r.cache_step
                                + tok * r.token_stride
                            )
                            os = (
                                t.region_offset
                                + (p * t.slots + j * t.block_size + tok) * t.row_bytes
                                + r.obj_offset
                                + k * r.obj_step
                            )
                            if store:
                                objects[c, os : os + r.nbytes] = cache[cs : cs + r.nbytes]
                            else:
                                cache[cs : cs + r.nbytes] = objects[c, os : os + r.nbytes]
    return caches, objects


def as_tensor(raw: np.ndarray, dtype: str, device: str, offset_bytes: int = 0) -> torch.Tensor:
    """``raw`` bytes as a 1-D tensor of ``dtype`` that starts ``offset_bytes`` into a larger
    allocation (a storage offset the backends must honour)."""
    e = ITEMSIZE[dtype]
    buf = torch.zeros(raw.size + offset_bytes, dtype=torch.uint8)
    buf[offset_bytes:] = torch.from_numpy(raw)
    t = buf.to(device).view(TORCH_DTYPES[dtype])
    return t[offset_bytes // e :]


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy()


def with_ids(plan: TransferPlan, ids) -> TransferPlan:
    from dataclasses import replace

    return replace(plan, groups=tuple(replace(g, block_ids=ids) for g in plan.groups))
