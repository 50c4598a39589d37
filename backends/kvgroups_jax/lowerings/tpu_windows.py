"""The DMA windows of the TPU lowering: one kernel group's page copies as N-d windows.

A TPU DMA copies between two windows of the same shape, each a box of an N-d array in HBM
(``ref.at[i, pl.ds(j, n), ...]``): strided in as many dimensions as the array has axes, but
only along its axes, and never transposing. The page model (docs/DESIGN.md) gives every
segment run of a block-plane as a strided box (:class:`~kvgroups_jax.geometry.Segment`), and
a run of ``L`` consecutive blocks (:mod:`kvgroups_core.block_runs`) adds one more dimension:
block stride in the cache, one page of object rows in the object. This module finds, per
kernel group and once per plan shape, N-d *views* of the caches and of the object in which
those boxes are windows, and which dimensions must instead be looped (one DMA each).

The cache views, in order of preference:

1. the array's own shape (in view elements): no reshape, so on a TPU no relayout of a cache;
2. a chain of the strides the copies need (a reshape the caches' own shape lacks, e.g. the
   indexer's 128-byte value rows inside 132-byte token rows);
3. flat: one axis, where only contiguous stretches are windows.

The first view that fits is taken unless another needs over :data:`NATURAL_SLACK` times fewer
DMAs (a cache's own shape with per-token DMAs against one flat DMA per run).

The object (``[num_chunks, elems]``) is viewed as ``[num_chunks, *chain]`` with a chain of the
strides its side of the chosen windows needs. A dimension is a window dimension when its
stride is an axis stride on both sides, the window dimensions are in the same order on both
sides, and every window fits its axis (no carry into the next axis) for every block, position
and plane the launch can meet; the other dimensions are looped, statically unrolled. Among the
plans of one view the one with the fewest DMAs per run wins. Everything here is plain Python,
computed while tracing; ``tests/jax_backend/test_tpu_windows.py`` replays plans on NumPy arrays.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from kvgroups_core.errors import UnsupportedConfigError
from kvgroups_jax.geometry import GroupGeometry

#: DMA sites (planes x segments x unrolled loop iterations) one launch may unroll; beyond it a
#: layout is refused (``"auto"`` then takes the XLA path).
MAX_DMA_SITES = 4096
#: Options per segment carried into the joint search over a group's segments.
_OPTIONS_PER_SEGMENT = 16


@dataclass(frozen=True)
class View:
    """A buffer seen as an N-d row-major array (sizes in view elements)."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @staticmethod
    def of_shape(shape: tuple[int, ...]) -> "View":
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        return View(tuple(shape), tuple(reversed(strides)))

    @staticmethod
    def chain(size: int, strides) -> "View | None":
        """The view whose axis strides are ``strides`` (plus 1), or None when they do not
        divide one another and ``size``."""
        ts = sorted(set(int(s) for s in strides) | {1}, reverse=True)
        if size <= 0 or size % ts[0] or any(a % b for a, b in zip(ts, ts[1:])):
            return None
        return View((size // ts[0],) + tuple(a // b for a, b in zip(ts, ts[1:])), tuple(ts))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_of(self, stride: int) -> int | None:
        """The axis of exactly ``stride`` (the outermost of equal ones: the others are 1 long)."""
        for a, s in enumerate(self.strides):
            if s == stride:
                return a
        return None

    def host(self, stride: int) -> tuple[int, int]:
        """``(axis, scale)``: a step of ``stride`` elements moves that axis' index by
        ``scale`` (the outermost axis whose stride divides it)."""
        for a, s in enumerate(self.strides):
            if stride % s == 0:
                return a, stride // s
        raise AssertionError("stride 1 divides everything")  # pragma: no cover

    def digits(self, offset: int) -> tuple[int, ...] | None:
        """The index of element ``offset`` (None past the end)."""
        if not 0 <= offset < self.size:
            return None
        out = []
        for a, (n, s) in enumerate(zip(self.shape, self.strides)):
            d = offset // s
            out.append(d if a == 0 else d % n)
        return tuple(out)


@dataclass(frozen=True)
class Side:
    """Where one DMA family's windows lie in one side's view.

    ``starts[k]`` is the window's first index on every axis for unrolled iteration ``k``;
    ``window_axes`` the axis of each window dimension (window order); the item's block (cache
    side) or kept position (object side) adds ``move_scale`` per unit to axis ``move_axis``.
    """

    starts: tuple[tuple[int, ...], ...]
    window_axes: tuple[int, ...]
    move_axis: int
    move_scale: int


@dataclass(frozen=True)
class Family:
    """The DMAs of one (plane, segment run): per run (or per item), one DMA per iteration.

    ``sizes`` are the window's dimensions; the run dimension ``run_dim`` (None: one DMA per
    item) is ``length * sizes[run_dim]`` long for a run of ``length`` blocks.
    """

    operand: int
    sizes: tuple[int, ...]
    run_dim: int | None
    cache: Side
    obj: Side

    @property
    def dmas(self) -> int:
        """DMAs per run (per item when ``run_dim`` is None)."""
        return len(self.cache.starts)


@dataclass(frozen=True)
class DmaPlan:
    """A kernel group's DMA plan: views (per cache operand; the object's one chunk row) and
    families (planes x segment runs)."""

    cache_views: tuple[View, ...]
    obj_view: View
    families: tuple[Family, ...]
    view_kind: str

    @property
    def coalesces(self) -> bool:
        """Whether every family moves a whole run per DMA (no per-item loop)."""
        return all(f.run_dim is not None for f in self.families)

    def dmas_per_run(self) -> int:
        """DMAs one run of blocks costs when every family coalesces (else per item)."""
        return sum(f.dmas for f in self.families)


@dataclass(frozen=True)
class _Dim:
    n: int
    cs: int  # cache stride (view elements)
    os: int  # object stride


@dataclass(frozen=True)
class _Option:
    """One way to cut a segment: which dims are windows, how the run of blocks travels."""

    window: tuple[_Dim, ...]  # window order (cache strides descending), run dim included
    run_dim: int | None  # index into window of the dim that grows with the run
    run_mult: int  # window elements per block along the run dim (1: its own axis)
    loops: tuple[_Dim, ...]
    cost: int


def _split(dim: _Dim, view: View) -> list[_Dim]:
    """``dim`` cut (outer to inner) wherever a whole number of its elements reaches a stride
    that is one of ``view``'s axis strides: the pieces are what can become windows."""
    for m in range(2, dim.n):
        if dim.n % m == 0 and view.axis_of(dim.cs * m) is not None:
            return _split(_Dim(dim.n // m, dim.cs * m, dim.os * m), view) + [
                _Dim(m, dim.cs, dim.os)
            ]
    return [dim]


def _options(geom: GroupGeometry, segment, view: View) -> list[_Option]:
    dims: list[_Dim] = []
    for n, cs, os in segment.dims:
        dims += _split(_Dim(n, cs, os), view)
    bs_row = geom.block_size * geom.row
    windowable = [k for k, d in enumerate(dims) if view.axis_of(d.cs) is not None]
    out = []
    for r in range(len(windowable), 0, -1):
        for subset in itertools.combinations(windowable, r):
            chosen = sorted((dims[k] for k in subset), key=lambda d: -d.cs)
            loops = tuple(d for k, d in enumerate(dims) if k not in subset)
            loop_cost = math.prod(d.n for d in loops)
            modes = []
            if view.axis_of(geom.block_stride) is not None:
                run = _Dim(0, geom.block_stride, bs_row)
                window = sorted(chosen + [run], key=lambda d: -d.cs)
                modes.append((tuple(window), window.index(run), 1))
            outer = chosen[0]
            if geom.block_stride == outer.n * outer.cs and bs_row == outer.n * outer.os:
                modes.append((tuple(chosen), 0, outer.n))
            modes.append((tuple(chosen), None, 0))
            for window, run_dim, mult in modes:
                objs = [d.os for d in window]
                if any(a <= b for a, b in zip(objs, objs[1:])):
                    continue  # the two sides would order the window differently
                cost = loop_cost * (geom.kept_per_chunk if run_dim is None else 1)
                out.append(_Option(window, run_dim, mult, loops, cost))
    out.sort(key=lambda o: (o.cost, o.run_dim is None, len(o.loops)))
    return out[:_OPTIONS_PER_SEGMENT]


def _place(
    view: View,
    offset: int,
    option: _Option,
    cache_side: bool,
    geom: GroupGeometry,
) -> Side | None:
    """The :class:`Side` of one family on one side, or None where a window does not fit."""
    stride = (lambda d: d.cs) if cache_side else (lambda d: d.os)
    # How far the item's block (or position) can move the window: b + L <= num_blocks,
    # pos + L <= kept_per_chunk.
    reach = geom.num_blocks if cache_side else geom.kept_per_chunk
    axes, extents = [], []
    for k, d in enumerate(option.window):
        a = view.axis_of(stride(d))
        if a is None or (axes and a <= axes[-1]):
            return None
        axes.append(a)
        extents.append(reach * option.run_mult if k == option.run_dim else d.n)
    if option.run_dim is None:
        step = geom.block_stride if cache_side else geom.block_size * geom.row
        move_axis, move_scale = view.host(step)
        move_extent = (reach - 1) * move_scale
    else:
        move_axis, move_scale, move_extent = axes[option.run_dim], option.run_mult, 0
    starts = []
    for index in itertools.product(*(range(d.n) for d in option.loops)):
        digits = view.digits(offset + sum(i * stride(d) for i, d in zip(index, option.loops)))
        if digits is None:
            return None
        top = list(digits)
        for a, e in zip(axes, extents):
            top[a] += e - 1
        top[move_axis] += move_extent
        if any(t >= n for t, n in zip(top, view.shape)):
            return None
        starts.append(digits)
    return Side(tuple(starts), tuple(axes), move_axis, move_scale)


def _cache_views(geom: GroupGeometry) -> list[tuple[str, tuple[View, ...]]]:
    sizes = geom.operand_sizes
    out = []
    shapes = geom.operand_shapes
    if shapes and len(set(View.of_shape(s).strides for s in shapes)) == 1:
        out.append(("natural", tuple(View.of_shape(s) for s in shapes)))
    wanted = {geom.block_stride} | {cs for seg in geom.segments for _, cs, _ in seg.dims}
    chain: list[int] = []
    for s in sorted(wanted, reverse=True):
        if (not chain and all(n % s == 0 for n in sizes)) or (chain and chain[-1] % s == 0):
            chain.append(s)
    views = tuple(View.chain(n, chain) for n in sizes)
    if chain and all(v is not None for v in views):
        out.append(("chain", views))
    out.append(("flat", tuple(View((n,), (1,)) for n in sizes)))
    seen, unique = set(), []
    for kind, views in out:
        if views not in seen:
            seen.add(views)
            unique.append((kind, views))
    return unique


def _families(
    geom: GroupGeometry, views: tuple[View, ...], obj_view: View, options: tuple[_Option, ...]
) -> list[Family] | None:
    fams = []
    for plane in range(geom.num_planes):
        op = geom.plane_operands[plane]
        obj_base = geom.region_offset + geom.object_plane(plane) * geom.slots * geom.row
        for segment, option in zip(geom.segments, options):
            cache = _place(
                views[op], geom.plane_offsets[plane] + segment.cache_offset, option, True, geom
            )
            obj = cache and _place(obj_view, obj_base + segment.obj_offset, option, False, geom)
            if obj is None:
                return None
            sizes = tuple(
                option.run_mult if k == option.run_dim else d.n for k, d in enumerate(option.window)
            )
            fams.append(Family(op, sizes, option.run_dim, cache, obj))
    return fams


def window(side: Side, k: int, family: Family, move, length) -> list:
    """Iteration ``k``'s window on ``side``, per axis: an index, or ``(start, size)`` of a
    window dimension. ``move`` is the item's block (cache side) or kept position (object
    side), ``length`` the run's block count; Python ints or traced scalars alike."""
    starts = list(side.starts[k])
    starts[side.move_axis] = starts[side.move_axis] + move * side.move_scale
    out = []
    for a, start in enumerate(starts):
        if a in side.window_axes:
            j = side.window_axes.index(a)
            size = family.sizes[j]
            out.append((start, size * length if j == family.run_dim else size))
        else:
            out.append(start)
    return out


#: The caches keep their own shape unless another view needs this many times fewer DMAs
#: (a reshape of a cache is a relayout copy of it on a TPU, where HBM arrays are tiled).
NATURAL_SLACK = 4


@functools.lru_cache(maxsize=256)
def plan_dmas(geom: GroupGeometry) -> DmaPlan:
    """The :class:`DmaPlan` of ``geom`` (raises UnsupportedConfigError when none fits)."""
    if not geom.segments:
        raise UnsupportedConfigError("layout: expected segment runs for the TPU lowering, got none")
    found = [
        p
        for p in (_plan_for(geom, kind, views) for kind, views in _cache_views(geom))
        if p is not None
    ]
    if not found:
        raise UnsupportedConfigError(
            f"layout: expected DMA windows of at most {MAX_DMA_SITES} unrolled copies per "
            f"launch for the TPU lowering, got a group of {geom.num_planes} planes whose pages "
            "need more"
        )
    best = min(found, key=lambda p: p[0])
    first = found[0]  # the most preferred view that fits (the caches' own shape first)
    return first[1] if first[0] <= NATURAL_SLACK * best[0] else best[1]


def _plan_for(geom: GroupGeometry, kind: str, views) -> tuple[int, DmaPlan] | None:
    """``(DMAs per run, plan)`` of the cheapest plan on cache views ``views``, or None."""
    bs_row = geom.block_size * geom.row
    per_segment = [_options(geom, seg, views[0]) for seg in geom.segments]
    combos = sorted(
        itertools.product(*per_segment),
        key=lambda c: (sum(o.cost for o in c), sum(o.run_dim is None for o in c)),
    )
    for combo in combos:
        strides = {d.os for o in combo for d in o.window if d.n} | {
            bs_row for o in combo if o.run_dim is not None and o.run_mult == 1
        }
        for extra in ((), (bs_row,)):
            obj_view = View.chain(geom.object_row_elems, strides | set(extra))
            if obj_view is None:
                continue
            fams = _families(geom, views, obj_view, combo)
            if fams is not None and sum(f.dmas for f in fams) <= MAX_DMA_SITES:
                cost = geom.num_planes * sum(o.cost for o in combo)
                return cost, DmaPlan(views, obj_view, tuple(fams), kind)
    return None


__all__ = ["DmaPlan", "Family", "MAX_DMA_SITES", "Side", "View", "plan_dmas", "window"]
