"""Static copy geometry of one kernel group, in elements of a same-width unsigned view.

Everything here is plain, hashable Python derived from a
:class:`~kvgroups_core.transfer.plan.GroupTransfer`: it is the static part of a jitted transfer (a
new
value means a new compilation), while the block ids and item counts stay dynamic. The page
model (``docs/DESIGN.md``) says that byte ``u`` of piece ``c`` of token ``t`` of a block lives at
``cache_offset + c*cache_step + t*token_stride + u`` in the block and at
``obj_offset + c*obj_step + u`` in the token's object row. A run is therefore a 3-D strided box
``[tokens, pieces, bytes]`` on both sides; we merge dimensions that are contiguous on both sides
and cut the rest into power-of-two boxes (Triton needs power-of-two array ops).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgroups_core.errors import UnsupportedConfigError

#: Largest box (elements) one kernel op moves: the largest box size that copies as fast as the
#: smaller ones, and the fastest to compile (fewer ops per program; docs/PERFORMANCE.md,
#: "Where the defaults come from").
MAX_BOX_ELEMS = 16384

#: The kernels index with int32: arrays of more elements go to the XLA path.
MAX_INDEX = 2**31 - 1


@dataclass(frozen=True)
class Box:
    """A power-of-two box of one block-plane copy.

    ``shape`` is outer to inner; offsets count elements from the block start of the plane
    (cache side) and from the first object row of the block (object side).
    """

    shape: tuple[int, ...]
    cache_offset: int
    cache_strides: tuple[int, ...]
    obj_offset: int
    obj_strides: tuple[int, ...]

    @property
    def is_contiguous(self) -> bool:
        """One dimension of stride 1 on both sides: a plain slice."""
        return len(self.shape) == 1 and self.cache_strides == (1,) and self.obj_strides == (1,)


@dataclass(frozen=True)
class GroupGeometry:
    """The static description of one kernel group's transfer (all sizes in elements).

    ``operand_indices`` are the plan's tensor indices this group reads or writes, in kernel operand
    order (one operand per backing array: no stacking copies); ``plane_operands[p]`` and
    ``plane_offsets[p]`` say where plane ``p`` starts.
    """

    unit: int
    operand_indices: tuple[int, ...]
    operand_sizes: tuple[int, ...]
    plane_operands: tuple[int, ...]
    plane_offsets: tuple[int, ...]
    block_stride: int
    num_blocks: int
    block_size: int
    slots: int
    row: int
    region_offset: int
    object_row_elems: int
    blocks_per_chunk: int
    kept_per_chunk: int
    boxes: tuple[Box, ...]
    #: ``object_planes[p]``: plane ``p``'s index inside the group's object region (its
    #: ``PlaneRef.object_plane``; a layer subset moves only some planes of a full region).
    object_planes: tuple[int, ...] = ()
    #: Each segment run as one strided copy, uncut (``boxes`` are its power-of-two pieces):
    #: lowerings that copy whole strided windows (the TPU DMAs) read these.
    segments: tuple["Segment", ...] = ()
    #: Each operand's shape in view elements (the array's shape, plus a trailing axis when
    #: the unit is narrower than the dtype): the windows of the TPU DMAs are cut from it.
    operand_shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def num_planes(self) -> int:
        return len(self.plane_offsets)

    @property
    def span(self) -> int | None:
        """Elements of a block-plane when it is one contiguous slice on both sides, else None."""
        if len(self.boxes) == 0:
            return None
        total = self.block_size * self.row
        pos = 0
        for box in self.boxes:
            if not box.is_contiguous or box.cache_offset != pos or box.obj_offset != pos:
                return None
            pos += box.shape[0]
        return total if pos == total else None

    def object_plane(self, plane: int) -> int:
        """Plane ``plane``'s index inside the object region."""
        return self.object_planes[plane] if self.object_planes else plane

    def object_base(self, plane: int, pos: int) -> int:
        """Element offset, inside one chunk's object, of the first row of kept block ``pos``."""
        return (
            self.region_offset
            + (self.object_plane(plane) * self.slots + pos * self.block_size) * self.row
        )


@dataclass(frozen=True)
class Segment:
    """One segment run of a block-plane as a strided copy: ``dims`` are ``(count,
    cache_stride, obj_stride)`` outer to inner, merged where contiguous on both sides and
    ending with a dimension of stride 1 on both; offsets as :class:`Box`'s."""

    dims: tuple[tuple[int, int, int], ...]
    cache_offset: int
    obj_offset: int


def pow2_parts(n: int, cap: int) -> list[tuple[int, int]]:
    """Cut ``range(n)`` into ``(start, size)`` pieces of power-of-two sizes <= ``cap``."""
    parts = []
    start = 0
    while start < n:
        size = 1 << ((n - start).bit_length() - 1)
        size = min(size, cap)
        parts.append((start, size))
        start += size
    return parts


def _merge(dims: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge ``(size, cache_stride, obj_stride)`` dims that are contiguous on both sides."""
    dims = [d for d in dims if d[0] > 1]
    merged = True
    while merged:
        merged = False
        for a in range(len(dims)):
            for b in range(len(dims)):
                if a == b:
                    continue
                na, ca, oa = dims[a]
                nb, cb, ob = dims[b]
                if ca == nb * cb and oa == nb * ob:
                    dims[b] = (na * nb, cb, ob)
                    del dims[a]
                    merged = True
                    break
            if merged:
                break
    # Write the object side in order: outer dims have the larger object strides.
    return sorted(dims, key=lambda d: (d[2], d[1]), reverse=True)


def run_boxes(
    dims: list[tuple[int, int, int]], cache_offset: int, obj_offset: int, max_elems: int
) -> list[Box]:
    """Cut a strided copy ``dims`` (outer to inner) into power-of-two boxes."""
    dims = _merge(dims)
    if not dims or dims[-1][1:] != (1, 1):
        dims.append((1, 1, 1))
    pieces: list[tuple[tuple[int, ...], tuple[int, ...], int]] = [((), (), max_elems)]
    for size, _, _ in reversed(dims):
        pieces = [
            ((start,) + starts, (part,) + sizes, max(cap // part, 1))
            for starts, sizes, cap in pieces
            for start, part in pow2_parts(size, cap)
        ]
    boxes = []
    for starts, sizes, _ in pieces:
        keep = [i for i, s in enumerate(sizes) if s > 1] or [len(sizes) - 1]
        boxes.append(
            Box(
                shape=tuple(sizes[i] for i in keep),
                cache_offset=cache_offset + sum(s * d[1] for s, d in zip(starts, dims)),
                cache_strides=tuple(dims[i][1] for i in keep),
                obj_offset=obj_offset + sum(s * d[2] for s, d in zip(starts, dims)),
                obj_strides=tuple(dims[i][2] for i in keep),
            )
        )
    return boxes


def choose_unit(group, tensor_specs, object_nbytes: int) -> int:
    """Bytes per view element: the dtype's width, narrowed where an offset needs it."""
    from kvgroups_core.formats.segments import widest_unit

    values = [group.block_stride_bytes, group.row_bytes, group.region_offset, object_nbytes]
    for run in group.runs:
        values += [
            run.nbytes,
            run.obj_offset,
            run.obj_step,
            run.cache_offset,
            run.cache_step,
            run.token_stride,
        ]
    for plane in group.planes:
        values.append(plane.byte_offset)
        values.append(tensor_specs[plane.tensor_index].nbytes)
    return widest_unit(values, limit=max(int(group.itemsize), 1))


def group_geometry(
    group, tensor_specs, object_nbytes: int, max_elems: int = MAX_BOX_ELEMS
) -> GroupGeometry:
    """The :class:`GroupGeometry` of a ``GroupTransfer`` (``tensor_specs`` by tensor_index)."""
    unit = choose_unit(group, tensor_specs, object_nbytes)
    indices: list[int] = []
    plane_operands = []
    for plane in group.planes:
        if plane.tensor_index not in indices:
            indices.append(plane.tensor_index)
        plane_operands.append(indices.index(plane.tensor_index))
    sizes = tuple(tensor_specs[i].nbytes // unit for i in indices)
    row = group.row_bytes // unit
    boxes: list[Box] = []
    segments: list[Segment] = []
    for run in group.runs:
        dims = [
            (group.block_size, run.token_stride // unit, row),
            (run.count, run.cache_step // unit, run.obj_step // unit),
            (run.nbytes // unit, 1, 1),
        ]
        boxes += run_boxes(dims, run.cache_offset // unit, run.obj_offset // unit, max_elems)
        merged = _merge(list(dims))
        if not merged or merged[-1][1:] != (1, 1):
            merged.append((1, 1, 1))
        segments.append(Segment(tuple(merged), run.cache_offset // unit, run.obj_offset // unit))
    geom = GroupGeometry(
        unit=unit,
        operand_indices=tuple(indices),
        operand_sizes=sizes,
        plane_operands=tuple(plane_operands),
        plane_offsets=tuple(p.byte_offset // unit for p in group.planes),
        block_stride=group.block_stride_bytes // unit,
        num_blocks=int(group.num_blocks),
        block_size=int(group.block_size),
        slots=int(group.slots),
        row=row,
        region_offset=group.region_offset // unit,
        object_row_elems=object_nbytes // unit,
        blocks_per_chunk=int(group.blocks_per_chunk),
        kept_per_chunk=int(group.kept_per_chunk),
        boxes=tuple(boxes),
        object_planes=tuple(getattr(p, "object_plane", i) for i, p in enumerate(group.planes)),
        segments=tuple(segments),
        operand_shapes=tuple(_unit_shape(tensor_specs[i], unit) for i in indices),
    )
    return geom


def _unit_shape(spec, unit: int) -> tuple[int, ...]:
    """``spec``'s shape in ``unit``-byte elements (a trailing axis splits wider elements)."""
    shape = tuple(int(n) for n in spec.shape)
    itemsize = int(spec.dtype.itemsize)
    if itemsize > unit:
        return shape + (itemsize // unit,)
    if itemsize < unit:  # units wider than the dtype: only the flat extent is meaningful
        return (spec.nbytes // unit,)
    return shape


def check_kernel_limits(geom: GroupGeometry) -> None:
    """Raise :class:`UnsupportedConfigError` when the Pallas kernels cannot index ``geom``."""
    for size in geom.operand_sizes:
        if size > MAX_INDEX:
            raise UnsupportedConfigError(
                f"cache array: expected at most {MAX_INDEX} elements of {geom.unit} bytes for "
                f"the Pallas kernels (int32 indexing), got {size}"
            )
    if geom.object_row_elems > MAX_INDEX:
        raise UnsupportedConfigError(
            f"object: expected at most {MAX_INDEX} elements per chunk, got {geom.object_row_elems}"
        )


def bucket(n: int, minimum: int = 1) -> int:
    """The power-of-two bucket holding ``n`` (a request inside it reuses the compilation)."""
    n = max(int(n), minimum, 1)
    return 1 << (n - 1).bit_length()


def chunk_row_items(grid_items: int, kept_per_chunk: int) -> int:
    """Items per row of the chunk-by-chunk program order (:func:`chunk_order`): the largest
    power of two at most ``kept_per_chunk``, capped at the power-of-two ``grid_items`` (so
    it divides it)."""
    row = 1 << (max(int(kept_per_chunk), 1).bit_length() - 1)
    return min(row, grid_items)


def chunk_order(launch_index, grid_items: int, groups: int, kept_per_chunk: int):
    """``(item, group)`` of the program at ``launch_index`` (0 .. grid_items * groups - 1,
    the order the GPU starts programs in) when programs go about a chunk at a time: a row of
    :func:`chunk_row_items` consecutive items for every plane group, then the next row. A
    chunk's object is then written or read front to back, as a plain copy would, instead of
    one plane's pages of every chunk in turn. A bijection onto
    ``[0, grid_items) x [0, groups)``; works on Python ints and traced int32 scalars."""
    row = chunk_row_items(grid_items, kept_per_chunk)
    pos = launch_index % row
    rest = launch_index // row
    return (rest // groups) * row + pos, rest % groups
