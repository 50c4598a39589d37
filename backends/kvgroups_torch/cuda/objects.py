"""Object addressing for the page-copy kernels, and staging of pinned host objects.

Where the chunks of one object group live (one strided tensor, inline chunk addresses, or a
device table of them), and device stand-ins for pinned host objects when they are staged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from kvgroups_cuda import params as P

from kvgroups_core.errors import KVGroupsValueError
from kvgroups_core.formats.segments import widest_unit

from . import device_tables


@dataclass
class ObjectAddresses:
    """Where the chunks of one object group live for one call."""

    mode: int
    base: int = 0
    stride: int = 0
    chunk_addresses: tuple[int, ...] = ()
    table: Any = None  # OBJ_TABLE: a device_tables.DeviceTable of the chunk addresses
    unit: int = 16
    num_chunks: int = 0


def check_object_placement(t: torch.Tensor, device_index: int, what: str) -> None:
    """The kernels' guard on an object's memory: on ``device_index`` or in pinned host memory
    (the object rule itself, uint8 ``[num_chunks, nbytes]`` with contiguous rows, is the core's
    ``check_objects``, which every entry point runs first)."""
    if t.is_cuda:
        if t.get_device() != device_index:
            raise KVGroupsValueError(
                f"{what}: expected a tensor on cuda:{device_index} or in pinned host memory, "
                f"got {t.device}"
            )
    elif not t.is_pinned():
        # The kernel addresses host memory directly (UVA): only pinned pages are mapped.
        raise KVGroupsValueError(
            f"{what}: expected a tensor on cuda:{device_index} or in pinned host memory, got "
            "pageable host memory (use pin_memory())"
        )


def object_addresses(entry: Any, device_index: int, what: str) -> ObjectAddresses:
    """Object addressing of one object group, checked by the core's ``check_objects``: a
    ``[num_chunks, nbytes]`` uint8 tensor, or a sequence of ``num_chunks`` 1-D uint8
    tensors, anywhere on the device or in pinned host memory."""
    if isinstance(entry, torch.Tensor):
        check_object_placement(entry, device_index, what)
        base, stride = entry.data_ptr(), entry.stride(0)
        unit = widest_unit([base, stride] if entry.shape[0] > 1 else [base])
        return ObjectAddresses(
            P.OBJ_STRIDED, base=base, stride=stride, unit=unit, num_chunks=entry.shape[0]
        )
    addresses = []
    for c, t in enumerate(entry):
        check_object_placement(t, device_index, f"{what}[{c}]")
        addresses.append(t.data_ptr())
    unit = widest_unit(addresses)
    if len(addresses) <= P.INLINE_OBJS:
        return ObjectAddresses(
            P.OBJ_INLINE, chunk_addresses=tuple(addresses), unit=unit, num_chunks=len(addresses)
        )
    table = to_table(np.asarray(addresses, dtype=np.int64), device_index)
    return ObjectAddresses(
        P.OBJ_TABLE,
        table=table,
        chunk_addresses=tuple(addresses),
        unit=unit,
        num_chunks=len(addresses),
    )


# Tables kept across calls (plane and object tables), readable from any stream.
to_table = device_tables.upload


def to_device(array: np.ndarray, device_index: int) -> torch.Tensor:
    """Host -> device copy ordered on the current stream, without blocking the host (for what
    one launch on that stream reads, such as host ids too many to pass inline)."""
    host = torch.from_numpy(np.ascontiguousarray(array)).pin_memory()
    return host.to(f"cuda:{device_index}", non_blocking=True)


def object_plane(plane: Any, position: int) -> int:
    """The plane's index in its kernel group's object region (``PlaneRef.object_plane``; a
    whole-model plan's planes are in object order, so older plans fall back to position)."""
    found = getattr(plane, "object_plane", None)
    return position if found is None else found


def region_spans(plan: Any, object_group: int) -> list[tuple[int, int]]:
    """Byte ranges ``[start, stop)`` of each chunk's object that the plan's groups touch,
    merged: a staged store copies back only these (other bytes stay untouched). Each plane
    owns ``slots * row_bytes`` bytes at its object plane, so a layer-subset plan copies back
    only its layers' rows."""
    spans = []
    for g in plan.groups:
        if g.object_group_idx != object_group:
            continue
        rows = g.slots * g.row_bytes
        for p, plane in enumerate(g.planes):
            start = g.region_offset + object_plane(plane, p) * rows
            spans.append((start, start + rows))
    spans.sort()
    merged: list[tuple[int, int]] = []
    for start, stop in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(stop, merged[-1][1]))
        else:
            merged.append((start, stop))
    return merged


def stage(
    entry: Any,
    direction: str,
    device_index: int,
    spans: list[tuple[int, int]],
    copies_after: list[tuple[torch.Tensor, torch.Tensor]],
) -> Any:
    """Device stand-ins for pinned host objects: the touched regions are copied in before a
    load and out after a store, each copy one contiguous pinned range (asynchronous, and
    capturable in a CUDA graph)."""
    if isinstance(entry, (list, tuple)):
        return [stage(t, direction, device_index, spans, copies_after) for t in entry]
    if not isinstance(entry, torch.Tensor) or entry.is_cuda:
        return entry
    check_object_placement(entry, device_index, "objects")  # pinned: before any copy
    staging = torch.empty(entry.shape, dtype=entry.dtype, device=f"cuda:{device_index}")
    row = entry.shape[-1]
    if entry.is_contiguous() and spans == [(0, row)]:
        pairs = [(entry, staging)]  # whole objects: one bulk copy
    else:  # one copy per chunk and region: a strided host copy would go through pageable memory
        rows = [(entry, staging)] if entry.dim() == 1 else list(zip(entry, staging))
        pairs = [(h[a:b], d[a:b]) for h, d in rows for a, b in spans]
    for host_part, dev_part in pairs:
        if direction == "load":
            dev_part.copy_(host_part, non_blocking=True)
        else:
            copies_after.append((host_part, dev_part))
    return staging
