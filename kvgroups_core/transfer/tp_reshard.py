"""Objects stored at one tensor-parallel degree, read by a rank of another degree.

A prefill engine at TP=p and a decode engine at TP=d hold the same model's KV heads split
differently. :func:`plan_reads` says, for one rank of the reading side, which byte ranges of
which source rank's objects hold its heads, and how they make its own objects;
:func:`assemble` builds those objects from the ranges once they have landed. Nothing is
gathered that the rank does not need except whole source regions: a reader at a higher degree
than the writer (d > p) reads the region of the one source rank holding its heads, ``d / p``
times its own share, because its heads are a column slice of every token row there (one
descriptor per region instead of one per row).

Both sides may use either object layout (:mod:`.tensor_parallel`):

- canonical: source rank ``r``'s objects are those of its shard; a reader of the same degree
  and rank reads them whole and they are its objects byte for byte (no conversion, see
  :attr:`ObjectReads.identity_rank`);
- TP-native: every rank's objects are full size and its parts sit heads outermost, so a
  reader at ``d <= p`` finds all its heads of a region in one contiguous byte range.

Which source layout a publication uses is a fact of the writer (its degree and layout); the
reader computes the writer's regions from its own manager (:func:`degree_view`), which is
sound once the two managers' ``fingerprint(across_degrees=True)`` agree: that digest fixes
every region's geometry at every degree.

Framework-free: plans are plain data; :func:`assemble` uses only slicing, ``reshape`` and the
array namespace's ``concat`` / ``zeros``, so it runs on NumPy, torch and JAX arrays.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any, Mapping

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError
from kvgroups_core.grouping.engine_groups import as_int
from kvgroups_core.grouping.manager import check_manager
from kvgroups_core.grouping.tensor_parallel import OBJECT_LAYOUTS, shard_groups
from kvgroups_core.transfer.objects import object_nbytes, object_regions


class DegreeView:
    """A manager's grouping seen at another TP degree, rank and object layout.

    It answers what :func:`~kvgroups_core.object_regions` and
    :func:`~kvgroups_core.object_nbytes` read (kernel groups with that degree's head counts,
    object groups, slots per chunk, the layout and each group's :class:`TPShard`), so the
    regions of a writer at any degree come from the same code that lays out every object.
    """

    def __init__(
        self,
        manager: Any,
        tp_size: int,
        tp_rank: int,
        object_layout: str,
        size_name: str = "tp_size",
    ) -> None:
        self._manager = manager
        self.tp_size, self.tp_rank, self.object_layout = tp_size, tp_rank, object_layout
        groups, totals = [], {}
        for k, group in enumerate(manager.kernel_groups):
            total = manager.tp_shard(k).total_heads
            heads = _heads_at(k, total, tp_size, group, size_name)
            groups.append(replace(group, shape_desc=replace(group.shape_desc, nh=heads)))
            for layer in group.layer_indices:
                totals[layer] = total
        num_layers = max(totals, default=-1) + 1
        per_layer = [totals.get(i) for i in range(num_layers)]
        self._kernel_groups = groups
        self._shards = (
            shard_groups(groups, num_layers, per_layer, tp_rank, tp_size) if groups else ()
        )

    @property
    def kernel_groups(self) -> list:
        return self._kernel_groups

    @property
    def num_kernel_groups(self) -> int:
        return len(self._kernel_groups)

    @property
    def object_groups(self) -> list:
        return self._manager.object_groups

    @property
    def num_object_groups(self) -> int:
        return self._manager.num_object_groups

    @property
    def lmcache_tokens_per_chunk(self) -> int:
        return self._manager.lmcache_tokens_per_chunk

    def get_slots_per_chunk_in_sw(self, kernel_group_idx: int) -> int:
        return self._manager.get_slots_per_chunk_in_sw(kernel_group_idx)  # not head-dependent

    def tp_shard(self, kernel_group_idx: int) -> Any:
        return self._shards[kernel_group_idx]


def _has_head_axis(group: Any) -> bool:
    fmt = group.engine_kv_format
    return fmt is not None and "NH" in fmt.facts.axes


def _heads_at(k: int, total: int, size: int, group: Any, size_name: str) -> int:
    """A rank's head count of kernel group ``k`` at degree ``size`` (typed error if none)."""
    if not _has_head_axis(group):
        return group.shape_desc.nh
    if total >= size and total % size == 0:
        return total // size
    if total < size and size % total == 0:
        return 1
    raise KVGroupsValueError(
        f"{size_name}: expected a degree that divides kernel group {k}'s {total} KV heads or "
        f"is a multiple of them, got {size}"
    )


def degree_view(
    manager: Any,
    tp_size: Any,
    tp_rank: Any = 0,
    object_layout: str | None = None,
    *,
    size_name: str = "tp_size",
) -> DegreeView:
    """``manager``'s grouping at TP degree ``tp_size``, rank ``tp_rank`` (default: rank 0),
    in ``object_layout`` (default: the manager's own). ``size_name`` is how errors name
    ``tp_size`` (the argument of the caller that passed it on)."""
    manager = check_manager(manager)
    size, rank = as_int(tp_size, size_name), as_int(tp_rank, "tp_rank")
    if size < 1:
        raise KVGroupsValueError(f"{size_name}: expected a rank count >= 1, got {size}")
    if not 0 <= rank < size:
        raise KVGroupsValueError(f"tp_rank: expected a rank in [0, {size}), got {rank}")
    layout = manager.object_layout if object_layout is None else object_layout
    if layout not in OBJECT_LAYOUTS:
        raise KVGroupsValueError(
            f"object_layout: expected one of {list(OBJECT_LAYOUTS)}, got {layout!r}"
        )
    return DegreeView(manager, size, rank, layout, size_name)


# --- plans ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Piece:
    """Columns ``[col_start, col_start + col_bytes)`` of every row of one source region part,
    which land at column ``dst_col`` of the destination region's rows."""

    src_rank: int
    src_offset: int
    src_row_bytes: int
    col_start: int
    col_bytes: int
    dst_col: int


@dataclass(frozen=True, kw_only=True)
class RegionReads:
    """How one destination region (``[kv_size, nl, slots, row]`` of one kernel group) is
    made: ``pieces`` in destination column order, every one ``rows`` rows."""

    kernel_group_idx: int
    layers: tuple[int, ...]
    kv_size: int
    slots: int
    dst_offset: int
    dst_row_bytes: int
    pieces: tuple[Piece, ...]

    @property
    def rows(self) -> int:
        return self.kv_size * len(self.layers) * self.slots

    def layer_rows(self, layer: int) -> list[int]:
        """First row of each plane's ``slots`` rows of ``layer`` (empty: not in the group)."""
        if layer not in self.layers:
            return []
        j = self.layers.index(layer)
        return [(kv * len(self.layers) + j) * self.slots for kv in range(self.kv_size)]


@dataclass(frozen=True, kw_only=True)
class ObjectReads:
    """What one rank reads of one object group's objects (per chunk) and how it assembles
    its own object from them.

    ``ranges[r]``: ``(offset, nbytes)`` byte ranges of source rank ``r``'s object, ascending
    and coalesced. ``identity_rank``: the source rank whose object is this rank's object byte
    for byte over every range this rank's load reads (same degree and rank, same layout), or
    None; then :func:`assemble` returns the staged array itself.
    """

    object_group_idx: int
    src_nbytes: int
    dst_nbytes: int
    ranges: Mapping[int, tuple[tuple[int, int], ...]]
    regions: tuple[RegionReads, ...]
    identity_rank: int | None

    def layer_ranges(self, src_rank: int, layers: Any) -> tuple[tuple[int, int], ...]:
        """``ranges[src_rank]`` cut to the rows of ``layers`` (manager layer indices): the
        bytes a layer-by-layer load of those layers reads, coalesced."""
        wanted = set(layers)
        spans = []
        for region in self.regions:
            for piece in region.pieces:
                if piece.src_rank != src_rank:
                    continue
                for layer in sorted(wanted & set(region.layers)):
                    for row in region.layer_rows(layer):
                        spans.append(
                            (
                                piece.src_offset + row * piece.src_row_bytes,
                                region.slots * piece.src_row_bytes,
                            )
                        )
        return coalesce(spans)


@dataclass(frozen=True, kw_only=True)
class ReadPlan:
    """One rank's reads of a request's objects written at degree ``src_tp_size``."""

    src_tp_size: int
    src_object_layout: str
    objects: tuple[ObjectReads, ...]

    @property
    def src_ranks(self) -> tuple[int, ...]:
        """The source ranks this rank reads from, ascending."""
        return tuple(sorted({r for o in self.objects for r in o.ranges}))


def coalesce(spans: Any) -> tuple[tuple[int, int], ...]:
    """``(offset, nbytes)`` spans sorted, deduplicated and merged where they touch."""
    out: list[list[int]] = []
    for offset, nbytes in sorted(set((int(o), int(n)) for o, n in spans if n > 0)):
        if out and offset <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], offset + nbytes - out[-1][0])
        else:
            out.append([offset, nbytes])
    return tuple((o, n) for o, n in out)


def _region_by_group(regions: list) -> dict[int, Any]:
    return {r.kernel_group_idx: r for r in regions}


def _choose(holders: range, used: set[int], preferred: int) -> int:
    """The source rank to read a head from: one already read from (fewest source ranks),
    else the reader's counterpart, else the first holder."""
    reused = [r for r in used if r in holders]
    if reused:
        return min(reused)
    return preferred if preferred in holders else holders.start


def _holders(shard: Any, head: int) -> range:
    """The source ranks holding ``head`` of a group whose rank-0 shard is ``shard``: the
    ``replicas`` ranks of the head set containing it (every rank's shard has rank 0's
    ``rank_heads`` and ``replicas``, see :class:`TPShard`)."""
    first = head // shard.rank_heads * shard.replicas
    return range(first, first + shard.replicas)


def plan_reads(manager: Any, src_tp_size: Any, src_object_layout: str = "canonical") -> ReadPlan:
    """This rank's reads of objects written by the ranks of a TP=``src_tp_size`` group.

    Parameters
    ----------
    manager : KVLayerGroupsManager
        The reading rank's manager (its ``tp_rank``, ``tp_size``, ``object_layout``).
    src_tp_size : int
        The writers' degree; writer rank ``r`` holds the objects of its own shard.
    src_object_layout : {"canonical", "tp_native"}
        The writers' object layout.

    Returns
    -------
    ReadPlan
        Per object group, the byte ranges of each source rank's per-chunk object to read and
        how :func:`assemble` makes this rank's objects of them.

    Raises
    ------
    KVGroupsValueError
        ``src_tp_size`` does not fit a group's heads, or an unknown layout.
    """
    view0 = degree_view(manager, src_tp_size, 0, src_object_layout, size_name="src_tp_size")
    p, layout = view0.tp_size, view0.object_layout
    # Views and regions only of the source ranks read from, so the cost does not grow with
    # p (a publication's tp_size comes from another process).
    views = {0: view0}
    regions_of: dict[tuple[int, int], dict[int, Any]] = {}

    def source_regions(r: int, og: int) -> dict[int, Any]:
        if r not in views:
            views[r] = DegreeView(manager, p, r, layout, "src_tp_size")
        if (r, og) not in regions_of:
            regions_of[r, og] = _region_by_group(object_regions(views[r], og))
        return regions_of[r, og]

    preferred = manager.tp_rank * p // manager.tp_size
    objects = []
    for og in range(manager.num_object_groups):
        used: set[int] = set()
        spans: dict[int, list[tuple[int, int]]] = {}
        regions = []
        for region in object_regions(manager, og):
            k = region.kernel_group_idx
            group = manager.kernel_groups[k]
            dst = manager.tp_shard(k)
            head_bytes = region.row_bytes // dst.rank_heads
            lo, hi = dst.head_start, dst.head_start + dst.rank_heads
            pieces = []
            while lo < hi:
                holders = _holders(view0.tp_shard(k), lo)
                if holders.stop > p:  # the reader counts more heads than p writers hold
                    raise KVGroupsValueError(
                        f"src_tp_size: expected writers holding head {lo} of kernel group {k}, "
                        f"got {p} writer ranks holding heads [0, "
                        f"{view0.tp_shard(k).num_parts * view0.tp_shard(k).rank_heads})"
                    )
                r = _choose(holders, used, preferred)
                used.add(r)
                part = source_regions(r, og)[k]
                src = views[r].tp_shard(k)
                end = min(hi, src.head_start + src.rank_heads)
                pieces.append(
                    Piece(
                        src_rank=r,
                        src_offset=part.offset,
                        src_row_bytes=part.row_bytes,
                        col_start=(lo - src.head_start) * head_bytes,
                        col_bytes=(end - lo) * head_bytes,
                        dst_col=(lo - dst.head_start) * head_bytes,
                    )
                )
                spans.setdefault(r, []).append((part.offset, part.nbytes))
                lo = end
            regions.append(
                RegionReads(
                    kernel_group_idx=k,
                    layers=tuple(group.layer_indices),
                    kv_size=region.shape[0],
                    slots=region.shape[2],
                    dst_offset=region.offset,
                    dst_row_bytes=region.row_bytes,
                    pieces=tuple(pieces),
                )
            )
        src_nbytes = object_nbytes(view0, og)
        dst_nbytes = object_nbytes(manager, og)
        ranges = {r: coalesce(s) for r, s in sorted(spans.items())}
        objects.append(
            ObjectReads(
                object_group_idx=og,
                src_nbytes=src_nbytes,
                dst_nbytes=dst_nbytes,
                ranges=ranges,
                regions=tuple(regions),
                identity_rank=_identity(regions, src_nbytes, dst_nbytes),
            )
        )
    return ReadPlan(src_tp_size=p, src_object_layout=layout, objects=tuple(objects))


def _identity(regions: list[RegionReads], src_nbytes: int, dst_nbytes: int) -> int | None:
    """The source rank whose object already is this rank's object, if any."""
    ranks = {p.src_rank for r in regions for p in r.pieces}
    if len(ranks) != 1 or src_nbytes != dst_nbytes:
        return None
    for region in regions:
        if len(region.pieces) != 1:
            return None
        piece = region.pieces[0]
        if (
            piece.src_offset != region.dst_offset
            or piece.col_start != 0
            or piece.col_bytes != piece.src_row_bytes
            or piece.src_row_bytes != region.dst_row_bytes
        ):
            return None
    return ranks.pop()


# --- assembly ---------------------------------------------------------------------------


def _namespace(x: Any) -> Any:
    """The array namespace of ``x`` (NumPy >= 2 and JAX have ``__array_namespace__``; torch
    is found as its already-imported module, so nothing is imported here)."""
    get = getattr(x, "__array_namespace__", None)
    if get is not None:
        return get()
    module = sys.modules.get(type(x).__module__.partition(".")[0])
    if module is None or not hasattr(module, "concat"):
        raise KVGroupsTypeError(
            f"staged: expected NumPy, torch or JAX arrays, got {type(x).__name__}"
        )
    return module


def assemble(reads: ObjectReads, staged: Mapping[int, Any]) -> Any:
    """This rank's objects of one object group from the source ranks' staged objects.

    Parameters
    ----------
    reads : ObjectReads
        One entry of :attr:`ReadPlan.objects`.
    staged : mapping of source rank -> array
        uint8 ``[num_chunks, reads.src_nbytes]`` per source rank the plan reads, laid out as
        the source objects (bytes outside ``reads.ranges`` are never read).

    Returns
    -------
    array
        uint8 ``[num_chunks, reads.dst_nbytes]``, what this rank's ``load`` takes; the staged
        array itself when :attr:`ObjectReads.identity_rank` is set, else a new array of the
        staged arrays' framework and device (TP-native destinations: zero outside this
        rank's ranges).
    """
    if not isinstance(reads, ObjectReads):
        raise KVGroupsTypeError(
            f"reads: expected an ObjectReads (an entry of ReadPlan.objects), got "
            f"{type(reads).__name__} {reads!r}"
        )
    if not isinstance(staged, Mapping):
        raise KVGroupsTypeError(
            f"staged: expected a mapping source rank -> array, got {type(staged).__name__}"
        )
    chunks: Any = None  # the staged arrays' first dimension (the framework's integer)
    for r in reads.ranges:
        if r not in staged:
            raise KVGroupsValueError(
                f"staged: expected source rank {r}'s objects (the plan reads from ranks "
                f"{sorted(reads.ranges)}), got ranks {sorted(staged)}"
            )
        x = staged[r]
        dtype = str(getattr(x, "dtype", None)).rpartition(".")[2]
        shape = tuple(getattr(x, "shape", ()))
        if (
            dtype != "uint8"
            or len(shape) != 2
            or shape[1] != reads.src_nbytes
            or (chunks is not None and shape[0] != chunks)
        ):
            raise KVGroupsValueError(
                f"staged[{r}]: expected uint8 [{'num_chunks' if chunks is None else chunks}, "
                f"{reads.src_nbytes}], got {dtype} {list(shape)}"
            )
        chunks = shape[0]
    if reads.identity_rank is not None:
        return staged[reads.identity_rank]
    first = staged[next(iter(reads.ranges))]
    xp = _namespace(first)
    parts, cursor = [], 0
    for region in sorted(reads.regions, key=lambda g: g.dst_offset):
        if region.dst_offset > cursor:
            parts.append(_zeros(xp, first, (chunks, region.dst_offset - cursor)))
        columns = []
        for piece in region.pieces:
            block = staged[piece.src_rank][
                :, piece.src_offset : piece.src_offset + region.rows * piece.src_row_bytes
            ]
            block = block.reshape((chunks, region.rows, piece.src_row_bytes))
            columns.append(block[:, :, piece.col_start : piece.col_start + piece.col_bytes])
        joined = columns[0] if len(columns) == 1 else xp.concat(columns, axis=2)
        parts.append(joined.reshape((chunks, region.rows * region.dst_row_bytes)))
        cursor = region.dst_offset + region.rows * region.dst_row_bytes
    if reads.dst_nbytes > cursor:
        parts.append(_zeros(xp, first, (chunks, reads.dst_nbytes - cursor)))
    if len(parts) == 1:
        return xp.asarray(parts[0], copy=True)  # never a view of the staged bytes
    return xp.concat(parts, axis=1)


def _zeros(xp: Any, like: Any, shape: tuple[int, int]) -> Any:
    device = getattr(like, "device", None)
    if device is None or callable(device):
        return xp.zeros(shape, dtype=xp.uint8)
    return xp.zeros(shape, dtype=xp.uint8, device=device)
