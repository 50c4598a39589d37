"""Bit-exact comparisons that report where they fail (see :mod:`kvgroups_conformance.report`).

Caches are compared block by block with the independent model of :mod:`.caches` (token rows
read by NumPy indexing of each format's axes). Objects are compared byte for byte; the first
wrong byte is then traced back to its kernel group, plane, layer and engine block through the
object layout of ``kvgroups_core.transfer.objects``, which only names the place: the verdict is the
byte comparison.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from kvgroups_conformance.caches import all_blocks, plane_tensor, token_rows
from kvgroups_conformance.report import Mismatch, raise_if_any
from kvgroups_core.transfer.objects import object_regions

Blocks = dict[tuple[int, int, int], np.ndarray]


def plane_name(kv: int, kv_size: int) -> str:
    if kv_size == 1:
        return "K=V (one plane)"
    return ("K", "V")[kv] if kv < 2 else str(kv)


def _dtype_of(caches: Any, fmt: Any, layer: int) -> str:
    if fmt.is_indexer:
        return "indexer (uint8 values + float32 scales)"
    return plane_tensor(caches, fmt, layer, 0)[0].dtype.name


def _source_hint(
    rows: np.ndarray, layer: int, kv: int, expected_block: int | None, source: Blocks | None
) -> str:
    if not rows.any():
        return "the block holds only zeros: it was not written"
    if source is None:
        return ""
    matches = [
        b
        for (lay, k, b), r in source.items()
        if lay == layer and k == kv and np.array_equal(r, rows)
    ]
    if not matches or expected_block in matches:
        return ""
    named = ", ".join(str(b) for b in matches[:4])
    if expected_block is None:
        return f"it holds the bytes of source block {named}"
    return (
        f"it holds the bytes of source block {named} instead of block "
        f"{expected_block} (an error in block addressing)"
    )


def block_mismatches(
    got: Any,
    formats: Any,
    want: Blocks,
    *,
    what: str,
    source: Blocks | None = None,
    expected_source: dict[int, int] | None = None,
) -> list[Mismatch]:
    """Compare the blocks of cache structure ``got`` (NumPy) with ``want``; one mismatch
    (the first differing block, with the count of all) or none.

    ``source`` (blocks of the caches the bytes came from) and ``expected_source`` (destination
    block -> the source block it should hold) let the report recognise misplaced blocks.
    """
    formats = list(formats)
    got_blocks = all_blocks(got, formats)
    bad = [key for key in sorted(want) if not np.array_equal(got_blocks[key], want[key])]
    if not bad:
        return []
    layer, kv, block = bad[0]
    rows, wanted = got_blocks[bad[0]], want[bad[0]]
    flat = np.flatnonzero(rows.reshape(-1) != wanted.reshape(-1))
    byte = int(flat[0])
    fmt = formats[layer]
    origin = (expected_source or {}).get(block)
    if wanted.any() or origin is not None:
        hint = _source_hint(rows, layer, kv, origin, source)
        elsewhere = [
            b
            for (lay, k, b), r in got_blocks.items()
            if lay == layer and k == kv and b != block and np.array_equal(r, wanted)
        ]
        if elsewhere and wanted.any():
            hint += ("; " if hint else "") + (
                f"its expected bytes were written to block {elsewhere[0]} instead (an error "
                f"in block addressing)"
            )
    else:
        hint = "the block should have stayed untouched (all zeros) but was written"
        if source is not None:
            found = _source_hint(rows, layer, kv, None, source)
            hint += f"; {found}" if found else ""
    return [
        Mismatch(
            what=what,
            format=fmt.name,
            dtype=_dtype_of(got, fmt, layer),
            layer=layer,
            plane=kv,
            plane_name=plane_name(kv, fmt.kv_size),
            block=block,
            byte=byte,
            token=byte // rows.shape[1],
            expected=int(wanted.reshape(-1)[byte]),
            actual=int(rows.reshape(-1)[byte]),
            differing_blocks=len(bad),
            hint=hint,
        )
    ]


def assert_blocks_match(
    got: Any,
    formats: Any,
    want: Blocks,
    *,
    what: str,
    source: Blocks | None = None,
    expected_source: dict[int, int] | None = None,
) -> None:
    """:func:`block_mismatches`, raising :class:`~.report.ConformanceFailure`."""
    raise_if_any(
        block_mismatches(
            got, formats, want, what=what, source=source, expected_source=expected_source
        )
    )


def moved_blocks(source: Blocks, before: Blocks, moved: dict[int, int]) -> Blocks:
    """The blocks a destination should hold after a load: ``before`` everywhere except the
    destination blocks of ``moved`` (destination -> source block), which hold the source's."""
    return {
        (layer, kv, b): (source[(layer, kv, moved[b])] if b in moved else rows)
        for (layer, kv, b), rows in before.items()
    }


def _as_chunks(objects: Any) -> np.ndarray:
    if isinstance(objects, (list, tuple)):
        return np.stack([np.asarray(o).reshape(-1) for o in objects])
    return np.asarray(objects)


def _block_of(manager: Any, k: int, chunk: int, pos: int, ids: Any) -> int | None:
    if ids is None:
        return None
    group = manager.kernel_groups[k]
    chunk_tokens = manager.lmcache_tokens_per_chunk
    bpc = manager.calculate_num_blocks(k, chunk_tokens)
    kept = manager.calculate_num_blocks(k, manager.get_subchunk_sw_size_tokens(k))
    group_ids = ids[group.engine_group_idx] if isinstance(ids, dict) else ids
    where = chunk * bpc + bpc - kept + pos
    return int(np.asarray(group_ids)[where]) if where < len(group_ids) else None


def object_mismatches(
    got: Any,
    want: Any,
    manager: Any,
    object_group: int,
    *,
    what: str,
    ids: Any = None,
    source_caches: Any = None,
    formats: Any = None,
) -> list[Mismatch]:
    """Compare one object group's objects (``[num_chunks, nbytes]`` uint8, or a list of
    per-chunk buffers) with ``want``; one mismatch (the first wrong byte) or none.

    ``ids`` (engine group id -> the call's block ids, or one id array) names the engine block
    of the wrong byte; with ``source_caches`` and ``formats`` too, the report says which
    source block the wrong bytes came from when they are one.
    """
    got_b, want_b = _as_chunks(got), _as_chunks(want)
    if got_b.shape != want_b.shape:
        return [
            Mismatch(
                what=f"{what}: object shape {got_b.shape}, expected {want_b.shape}",
                format="-",
                dtype="uint8",
                layer=-1,
                plane=-1,
                plane_name="-",
                block=None,
                byte=0,
                token=0,
                expected=0,
                actual=0,
            )
        ]
    diff = got_b != want_b
    if not diff.any():
        return []
    chunk, offset = (int(v) for v in np.argwhere(diff)[0])
    for region in object_regions(manager, object_group):
        if region.offset <= offset < region.offset + region.nbytes:
            break
    k = region.kernel_group_idx
    group = manager.kernel_groups[k]
    kv_size, nl, slots, _ = region.shape
    row_bytes, bs = region.row_bytes, group.shape_desc.bs
    row, u = divmod(offset - region.offset, row_bytes)
    plane, slot = divmod(row, slots)
    kv, li = divmod(plane, nl)
    pos, token = divmod(slot, bs)
    layer = group.layer_indices[li]
    block = _block_of(manager, k, chunk, pos, ids)
    # Count the (chunk, plane, block position) units that differ, over the whole group.
    units = 0
    for r in object_regions(manager, object_group):
        part = diff[:, r.offset : r.offset + r.nbytes]
        rbs = manager.kernel_groups[r.kernel_group_idx].shape_desc.bs
        units += (
            int(part.reshape(part.shape[0], -1, rbs * r.row_bytes).any(axis=2).sum())
            if r.shape[2] % rbs == 0
            else int(part.any(axis=1).sum())
        )
    hint = ""
    if source_caches is not None and formats is not None:
        got_rows = got_b[chunk, region.offset + (plane * slots + pos * bs) * row_bytes :][
            : bs * row_bytes
        ].reshape(bs, row_bytes)
        fmt = list(formats)[layer]
        nb = plane_tensor(source_caches, fmt, layer, kv)[0].shape[fmt.facts.axes.index("NB")]
        source = {(layer, kv, b): token_rows(source_caches, fmt, layer, kv, b) for b in range(nb)}
        hint = _source_hint(got_rows, layer, kv, block, source)
    fmt_name = group.engine_kv_format.name if group.engine_kv_format is not None else "?"
    return [
        Mismatch(
            what=what,
            format=fmt_name,
            dtype=group.dtype.name,
            layer=layer,
            plane=kv,
            plane_name=plane_name(kv, kv_size),
            block=block,
            byte=token * row_bytes + u,
            token=token,
            expected=int(want_b[chunk, offset]),
            actual=int(got_b[chunk, offset]),
            differing_blocks=units,
            object_group=object_group,
            chunk=chunk,
            object_byte=offset,
            hint=hint,
        )
    ]


def assert_objects_match(
    got: Any,
    want: Any,
    manager: Any,
    object_group: int,
    *,
    what: str,
    ids: Any = None,
    source_caches: Any = None,
    formats: Any = None,
) -> None:
    """:func:`object_mismatches`, raising :class:`~.report.ConformanceFailure`."""
    raise_if_any(
        object_mismatches(
            got,
            want,
            manager,
            object_group,
            what=what,
            ids=ids,
            source_caches=source_caches,
            formats=formats,
        )
    )


#: Old names, deprecated: ``check_*`` also named the core's object rule.
_RENAMED = {"check_blocks": "assert_blocks_match", "check_objects": "assert_objects_match"}


def __getattr__(name: str) -> Any:
    if name not in _RENAMED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"{__name__}.{name} is deprecated: use {_RENAMED[name]}", DeprecationWarning, stacklevel=2
    )
    return globals()[_RENAMED[name]]
