"""What to move for one request: chunks, byte ranges and descriptors (framework-free).

- :func:`chunks_to_read`: per object group, the chunks of a request a load reads. A
  full-attention group needs every chunk the reader lacks; a sliding-window group of ``w``
  chunks only the last ``w`` (its load skips the others, SEMANTICS.md section 7), so they are
  never moved.
- :func:`pull_copies`: the descriptors of one writer rank's share (a
  :class:`~kvgroups_core.tp_reshard.ObjectReads`): one per (chunk, object group) when the
  reader needs whole objects, merged into one per run of chunks whose entries are consecutive
  on both sides; one per (chunk, byte range) otherwise (heterogeneous TP, layer streaming).
- :func:`layer_byte_ranges`: which bytes of an object are "layer ``i``".
- :func:`nixl_connector_descriptors`: what vLLM's NixlConnector posts for the same request,
  the baseline the benchmark reports beside ours.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvgroups_core import object_regions
from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError
from kvgroups_core.grouping.manager import check_manager
from kvgroups_core.transfer.tp_reshard import ObjectReads, coalesce

from .base import Copy, checked_int


def chunks_to_read(manager: Any, num_chunks: int, first_chunk: int = 0) -> list[list[int]]:
    """Per object group, the chunks in ``[first_chunk, num_chunks)`` a load of the request's
    chunks reads (``first_chunk``: the chunks the reader already holds)."""
    manager = check_manager(manager)
    num_chunks = checked_int(num_chunks, "num_chunks", 0, 1 << 31)
    first_chunk = checked_int(first_chunk, "first_chunk", 0)
    if not 0 <= first_chunk <= num_chunks:
        raise KVGroupsValueError(
            f"first_chunk: expected 0 <= first_chunk <= num_chunks ({num_chunks}), got "
            f"{first_chunk}"
        )
    out = []
    for og in manager.object_groups:
        window = og.sw_size_chunks if not manager.full_sw_kv else -1
        start = max(first_chunk, num_chunks - window) if window >= 1 else first_chunk
        out.append(list(range(start, num_chunks)))
    return out


def _entries(values: Any, what: str) -> list[int]:
    """Pool entries as plain ints >= 0 (floats, strings and bools refused, not coerced)."""
    if not isinstance(values, (list, tuple, range)):
        raise KVGroupsTypeError(f"{what}: expected a list of ints, got {type(values).__name__}")
    return [checked_int(v, f"{what}[{i}]", 0, 1 << 62) for i, v in enumerate(values)]


def _runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(remote_entry, local_entry, length)`` of each run consecutive on both sides."""
    runs: list[list[int]] = []
    for remote, local in pairs:
        if runs and remote == runs[-1][0] + runs[-1][2] and local == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([remote, local, 1])
    return [(a, b, n) for a, b, n in runs]


def pull_copies(
    reads: ObjectReads,
    src_rank: int,
    remote_entries: Sequence[int],
    local_entries: Sequence[int],
    layers: Sequence[int] | None = None,
) -> list[Copy]:
    """The descriptors moving writer rank ``src_rank``'s share of one object group.

    ``remote_entries[i]`` / ``local_entries[i]``: the writer's and the reader's entry of the i-th
    chunk to move. ``layers``: move only those layers' rows (layer streaming).
    """
    remote_entries = _entries(remote_entries, "remote_entries")
    local_entries = _entries(local_entries, "local_entries")
    if len(remote_entries) != len(local_entries):
        raise KVGroupsValueError(
            f"local_entries: expected one per remote entry ({len(remote_entries)}), got "
            f"{len(local_entries)}"
        )
    ranges = (
        reads.ranges.get(src_rank, ()) if layers is None else reads.layer_ranges(src_rank, layers)
    )
    og = reads.object_group_idx
    pairs = list(zip(remote_entries, local_entries))
    if ranges == ((0, reads.src_nbytes),):
        return [
            Copy(
                object_group=og,
                remote_entry=r,
                remote_offset=0,
                local_entry=loc,
                local_offset=0,
                nbytes=n * reads.src_nbytes,
            )
            for r, loc, n in _runs(pairs)
        ]
    return [
        Copy(
            object_group=og,
            remote_entry=r,
            remote_offset=o,
            local_entry=loc,
            local_offset=o,
            nbytes=n,
        )
        for r, loc in pairs
        for o, n in ranges
    ]


def layer_byte_ranges(
    manager: Any, object_group_idx: int, layer: int
) -> tuple[tuple[int, int], ...]:
    """``(offset, nbytes)`` ranges of one chunk's object holding layer ``layer`` (a manager
    layer index): in its kernel group's region ``[kv_size, nl, slots, row]``, the ``slots``
    rows of the layer's position ``j`` in each plane, at rows ``(kv * nl + j) * slots``. One
    range per plane (two for K and V, one for MLA); empty when the object group does not hold
    the layer. For a TP-native manager, this rank's part only."""
    spans = []
    for region in object_regions(manager, object_group_idx):
        layers = list(manager.kernel_groups[region.kernel_group_idx].layer_indices)
        if layer not in layers:
            continue
        kv, nl, slots, _ = region.shape
        j = layers.index(layer)
        for plane in range(kv):
            spans.append(
                (
                    region.offset + (plane * nl + j) * slots * region.row_bytes,
                    slots * region.row_bytes,
                )
            )
    return coalesce(spans)


def nixl_connector_descriptors(num_blocks: int, num_layers: int, kv_planes: int = 2) -> int:
    """Descriptors vLLM's NixlConnector prepares for a request of ``num_blocks`` blocks:
    one per (block, layer, K/V plane) before NIXL merges consecutive ones."""
    return int(num_blocks) * int(num_layers) * int(kv_planes)
