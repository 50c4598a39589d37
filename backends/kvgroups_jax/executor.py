"""Execute a :class:`~kvgroups_core.transfer.plan.TransferPlan` with JAX: one jitted program per
plan shape.

The static part of a call (each group's :class:`~kvgroups_core.geometry.GroupGeometry`, the
lowering, the item and id buckets) is the jit key; block ids and item counts are runtime
arrays, so a new request whose page count stays inside its power-of-two bucket reuses the
compiled program (:func:`trace_count` counts compilations). ``load`` donates the caches and every
kernel aliases its outputs to them: the new caches live in the old buffers. ``store`` donates the
objects the same way.

Host cost: a call repeats the same plan shape over and over (a prepared binding gives every plan
the same ``planes`` / ``runs`` / ``tensor_specs`` objects), so the static program is looked up by
a cheap key of those identities plus a few ints and built once (:func:`program_for`); the
program hashes in O(1) and one plan shape always yields the same program object, so JAX's
static-argument check is an identity test. The per-call ``(first_item, num_items)`` arrays live
on the device, memoised by value. What is left per call is the ids array and JAX's dispatch.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError
from kvgroups_core.logs import logger
from kvgroups_core.transfer.objects import check_objects

from .geometry import GroupGeometry, bucket, group_geometry
from .id_checks import check_block_ids
from .lowerings import triton as pallas_copy
from .lowerings import xla as xla_copy
from .lowerings.choice import TRACED, resolve_lowering
from .lowerings.tuning import DEFAULT_TUNING, LoweringTuning
from .views import UINT_OF_WIDTH, flat_view, object_unview, object_view, unflat_view

_TRACES = {"count": 0}
_log = logger("jax")


def trace_count() -> int:
    """How many times a transfer program was traced (each trace is one compilation)."""
    return _TRACES["count"]


@dataclass(frozen=True, eq=False)
class _Program:
    """The jit key: everything static about one plan execution.

    ``id_indices[g]`` picks group ``g``'s ids among the call's id arrays (groups of one engine
    group share one array: one host-to-device copy). JAX hashes and compares the static
    argument on every call; nested frozen dataclasses would re-hash every box each time, so the
    hash is computed once and equality tries identity first.
    """

    direction: str
    geoms: tuple[GroupGeometry, ...]
    lowerings: tuple[str, ...]
    object_groups: tuple[int, ...]
    grid_items: tuple[int, ...]
    num_warps: int
    id_indices: tuple[int, ...] = ()
    #: Per object group: ``(num_chunks, nbytes)`` when a store creates it (objects=None),
    #: else None.
    fresh: tuple = ()
    #: Per group: its ids are device values the host never saw (range-checked in the program
    #: for checkify) and the group's kernel group index (named in that check's message).
    device_ids: tuple[bool, ...] = ()
    kernel_groups: tuple[int, ...] = ()
    #: The lowerings' tuning (JaxBackend(tuning=...)): programs of other tunings differ.
    tuning: LoweringTuning = DEFAULT_TUNING
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash(self._key()))

    def _key(self) -> tuple:
        return (
            self.direction,
            self.geoms,
            self.lowerings,
            self.object_groups,
            self.grid_items,
            self.num_warps,
            self.id_indices,
            self.fresh,
            self.device_ids,
            self.kernel_groups,
            self.tuning,
        )

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, _Program) or self._hash != other._hash:
            return False
        return self._key() == other._key()


def _copy_fn(lowering: str):
    if lowering in ("triton", "interpret"):
        return pallas_copy.copy_group
    if lowering == "mosaic":
        from .lowerings import mosaic as pallas_mosaic

        return pallas_mosaic.copy_group
    if lowering == "cuda":
        from .lowerings import cuda as cuda_copy

        return cuda_copy.copy_group
    if lowering in ("tpu", "tpu-interpret"):
        from .lowerings import tpu

        return tpu.copy_group
    return xla_copy.copy_group


def program_body(program: _Program, caches, objects, metas, idss):
    """The transfer program of ``program`` on these arrays: traced once per plan shape
    (jitted and donated by :func:`execute_plan`, or mapped over the shards of a mesh)."""
    _TRACES["count"] += 1
    # Traced once per plan shape; XLA then compiles the program (seconds for Pallas kernels).
    _log.info(
        "tracing a transfer program: %d kernel group(s), lowerings %s",
        len(program.geoms),
        sorted(set(program.lowerings)),
    )
    caches = list(caches)
    objects = list(objects)
    pending = _fresh_objects(program, objects)
    for g, geom in enumerate(program.geoms):
        lowering = program.lowerings[g]
        og = program.object_groups[g]
        unit = geom.unit
        views = tuple(flat_view(caches[s], unit) for s in geom.operand_indices)
        if og in pending:  # the first group to write a new object creates it
            rows, nbytes = pending.pop(og)
            obj = jax.ShapeDtypeStruct((rows, nbytes // unit), UINT_OF_WIDTH[unit])
        else:
            obj = object_view(objects[og], unit)
        ids = idss[program.id_indices[g]] if program.id_indices else idss[g]
        if program.device_ids and program.device_ids[g]:
            # Reported under checkify only (no effect on plain jit: see id_checks).
            ids = check_block_ids(
                ids,
                metas[g],
                num_blocks=geom.num_blocks,
                kept=geom.kept_per_chunk,
                blocks_per_chunk=geom.blocks_per_chunk,
                grid_items=program.grid_items[g],
                kernel_group=program.kernel_groups[g],
            )
        out = _copy_fn(lowering)(
            program.direction,
            geom,
            program.grid_items[g],
            metas[g],
            ids,
            obj,
            views,
            interpret=lowering in ("interpret", "tpu-interpret"),
            num_warps=program.num_warps,
            tuning=program.tuning,
            kernel_group=program.kernel_groups[g] if program.kernel_groups else g,
        )
        if program.direction == "store":
            objects[og] = object_unview(out, unit)
        else:
            for s, view in zip(geom.operand_indices, out):
                caches[s] = unflat_view(view, caches[s].shape, caches[s].dtype, unit)
    for og, shape in pending.items():  # no group of this call writes it (a layer subset)
        objects[og] = jnp.zeros(shape, jnp.uint8)
    # Return only what the transfer wrote: returning a non-donated input makes XLA copy it
    # (every cache on a store, every object on a load).
    if program.direction == "load":
        # The barrier hands the caller each cache as an array of its own shape and dtype. Without
        # it XLA folds the view's bitcasts into the caller's fusions, which then read the
        # kernel's flat integer buffer and slow the engine's own computation over the loaded
        # caches (docs/PERFORMANCE.md, "Measurements behind the design"). It moves nothing.
        return tuple(jax.lax.optimization_barrier(tuple(caches)))
    return tuple(objects)


def _fresh_objects(program: _Program, objects: list) -> dict[int, tuple[int, int]]:
    """Object groups a store creates: those its kernels write completely become kernel
    outputs (returned, for the first group of each to create); the rest start as zeros in
    this program (a layer subset leaves other layers' regions untouched)."""
    pending = {}
    for og, shape in enumerate(program.fresh):
        if shape is None:
            continue
        written = sum(
            geom.num_planes * geom.slots * geom.row * geom.unit
            for geom, o in zip(program.geoms, program.object_groups)
            if o == og
        )
        if written == shape[1] and written:
            pending[og] = shape
        else:
            objects[og] = jnp.zeros(shape, jnp.uint8)
    return pending


_store_jit = jax.jit(program_body, static_argnums=(0,), donate_argnums=(2,))
_load_jit = jax.jit(program_body, static_argnums=(0,), donate_argnums=(1,))


_INT32_MIN, _INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)
_SMALL = 64  # ids up to this many are range-checked through Python ints (cheaper than NumPy)


def _padded_ids(block_ids) -> jax.Array | np.ndarray:
    if isinstance(block_ids, jax.Array) and not isinstance(block_ids, np.ndarray):
        n = block_ids.shape[0]
        ids = block_ids
        if ids.dtype.itemsize > 4:  # int64 ids (x64 mode): no wrap-around into a valid block
            ids = jnp.where((ids < 0) | (ids > _INT32_MAX), -1, ids)
        ids = ids.astype(jnp.int32)
        return jnp.pad(ids, (0, bucket(n) - n))
    ids = np.asarray(block_ids)
    n = ids.size
    if ids.dtype != np.int32:
        ids = ids.astype(np.int64, copy=False)
        if n:
            if n <= _SMALL:
                values = ids.tolist()
                lo, hi = min(values), max(values)
            else:
                lo, hi = int(ids.min()), int(ids.max())
            if lo < _INT32_MIN or hi > _INT32_MAX:
                raise KVGroupsValueError(
                    f"block_ids: expected int32 values, got range [{lo}, {hi}]"
                )
    size = bucket(n)
    if size == n:
        return ids.astype(np.int32)  # always a copy: the caller may reuse its id array
    out = np.zeros(size, np.int32)
    out[:n] = ids
    return out


def _shape_of(x) -> tuple:
    """``(dtype name, shape, strides)`` of a JAX value (always row-major) for the core's
    object rule; a value without a shape reads as its type name and ``[]``."""
    shape = tuple(getattr(x, "shape", ()))
    strides = [1] * len(shape)
    for i in range(len(shape) - 1, 0, -1):
        strides[i - 1] = strides[i] * max(int(shape[i]), 1)
    return str(getattr(x, "dtype", type(x).__name__)), shape, tuple(strides)


def _check_objects(plan, objects) -> None:
    """The core's object rule (a store's None entries are created), and this executor's own
    limit: one stacked array per object group, never per-chunk buffers."""
    check_objects(plan, objects, _shape_of, store_creates=True)
    for k, obj in enumerate(objects):
        if isinstance(obj, (list, tuple)):
            raise KVGroupsTypeError(
                f"objects[{k}]: expected one [num_chunks, {plan.object_nbytes[k]}] uint8 "
                f"jax.Array, got a list of per-chunk buffers (stack them once, outside the "
                f"transfer)"
            )


def _home(arrays) -> tuple[str, object]:
    """``(platform, placement)`` from the first concrete array (the default backend for traced
    values). ``placement`` is where the per-call arrays go: that array's device when it is
    committed to one, ``"default"`` for an uncommitted array (JAX may move such arguments, so
    ours stay uncommitted too), None under tracing (NumPy constants)."""
    for x in arrays:
        if isinstance(x, jax.core.Tracer) or not hasattr(x, "devices"):
            continue
        devices = x.devices()
        device = next(iter(devices))
        if len(devices) != 1:
            return device.platform, None
        return device.platform, (device if getattr(x, "_committed", True) else "default")
    return jax.default_backend(), None


# --- the per-plan-shape memo ---------------------------------------------------------------

#: Every GroupTransfer field the geometry and program read, besides planes, runs and the ids.
_GROUP_STATIC = operator.attrgetter(
    "object_group_idx",
    "region_offset",
    "row_bytes",
    "block_size",
    "slots",
    "block_stride_bytes",
    "num_blocks",
    "itemsize",
    "unit_bytes",
    "blocks_per_chunk",
    "kept_per_chunk",
)
_MAX_PROGRAMS = 512
# key -> (program, the objects whose id() is in the key: held so no id is reused while remembered)
_PROGRAMS: dict[tuple, tuple[_Program, tuple]] = {}
_MAX_METAS = 4096
_METAS: dict[tuple, jax.Array] = {}


def program_for(
    plan,
    lowering: str,
    platform: str,
    num_warps: int,
    fresh: tuple = (),
    tuning: LoweringTuning = DEFAULT_TUNING,
) -> _Program:
    """The interned :class:`_Program` of ``plan``'s shape, built on first sight.

    The key holds ``id()`` s of ``plan.tensor_specs`` and of each group's ``planes`` / ``runs``
    (hashing those by value costs more than the rest of a call) and the memo entry holds the
    objects themselves, so an id in a live key always names the same object. Plans from one
    binding share those objects; hand-built plans just miss and build (then JAX's jit cache
    still finds the value-equal program: no new compilation).
    """
    if type(plan.tensor_specs) is not tuple:
        return _build_static(plan, lowering, platform, num_warps, fresh, tuning)  # mutable
    key = [
        plan.direction,
        lowering,
        platform,
        num_warps,
        id(plan.tensor_specs),
        plan.object_nbytes,
        fresh,
        tuning,
    ]
    seen: dict[int, int] = {}
    for g in plan.groups:
        if type(g.planes) is not tuple or type(g.runs) is not tuple:
            return _build_static(plan, lowering, platform, num_warps, fresh, tuning)
        id_index = seen.setdefault(id(g.block_ids), len(seen))
        key.append(
            (
                id(g.planes),
                id(g.runs),
                _GROUP_STATIC(g),
                bucket(g.num_items),
                id_index,
                _on_device(g.block_ids),
            )
        )
    key = tuple(key)
    hit = _PROGRAMS.get(key)
    if hit is not None:
        return hit[0]
    program = _build_static(plan, lowering, platform, num_warps, fresh, tuning)
    if len(_PROGRAMS) >= _MAX_PROGRAMS:
        _PROGRAMS.clear()
    keep = (plan.tensor_specs,) + tuple((g.planes, g.runs) for g in plan.groups)
    _PROGRAMS[key] = (program, keep)
    return program


def _build_static(
    plan,
    lowering: str,
    platform: str,
    num_warps: int,
    fresh: tuple = (),
    tuning: LoweringTuning = DEFAULT_TUNING,
) -> _Program:
    geoms, lowerings, ogs, grids, id_indices = [], [], [], [], []
    seen: dict[int, int] = {}
    for group in plan.groups:
        geom = group_geometry(group, plan.tensor_specs, plan.object_nbytes[group.object_group_idx])
        geoms.append(geom)
        lowerings.append(resolve_lowering(lowering, geom, platform))
        ogs.append(group.object_group_idx)
        grids.append(bucket(group.num_items))
        id_indices.append(seen.setdefault(id(group.block_ids), len(seen)))
    return _Program(
        plan.direction,
        tuple(geoms),
        tuple(lowerings),
        tuple(ogs),
        tuple(grids),
        num_warps,
        tuple(id_indices),
        fresh,
        tuple(_on_device(g.block_ids) for g in plan.groups),
        tuple(g.kernel_group_idx for g in plan.groups),
        tuning,
    )


def _on_device(ids) -> bool:
    """Ids the planner left on the device (traced or device arrays): not range-checked on the
    host, so the program checks them for checkify."""
    return isinstance(ids, jax.Array)


def _meta(first_item: int, num_items: int, placement) -> jax.Array | np.ndarray:
    """``[first_item, num_items]`` int32: NumPy without a placement, else a memoised device array
    (a handful of values recur: no host-to-device copy per call)."""
    num_items = max(num_items, 0)
    if placement is None:
        return np.array([first_item, num_items], np.int32)
    key = (first_item, num_items, placement)
    meta = _METAS.get(key)
    if meta is None:
        host = np.array([first_item, num_items], np.int32)
        meta = jax.device_put(host, None if placement == "default" else placement)
        if isinstance(meta, jax.core.Tracer):
            # Called while a transformation traces (ids traced, caches concrete): the value
            # belongs to that trace and must never outlive it in a process-wide cache.
            return host
        if len(_METAS) >= _MAX_METAS:
            _METAS.clear()
        _METAS[key] = meta
    return meta


def runtime_args(plan, placement) -> tuple[tuple, tuple]:
    """The call's dynamic arguments: one meta per group, one padded id array per distinct ids
    object (in first-use order, as :func:`_build_static` numbers them)."""
    metas = []
    idss = []
    seen: set[int] = set()
    skip = getattr(plan, "skip_tokens", None)
    for g in plan.groups:
        if skip is None:
            metas.append(_meta(g.first_item, g.num_items, placement))
        else:
            metas.append(_device_meta(g, skip))
        ids = g.block_ids
        if id(ids) not in seen:
            seen.add(id(ids))
            idss.append(_padded_ids(ids))
    return tuple(metas), tuple(idss)


def _device_meta(group, skip) -> jax.Array:
    """``[first_item, num_items]`` of a load whose skip is a device (traced) scalar: the
    planner's formula evaluated on the device; ``group.first_item`` is its static lower bound
    (the window skip), so the grid bucket covers every outcome."""
    from kvgroups_core.transfer.plan import first_item_for_skip

    total = group.num_chunks * group.kept_per_chunk
    skip = jnp.asarray(skip).astype(jnp.int32)
    first = first_item_for_skip(group, skip, jnp.maximum, jnp.minimum)
    first = jnp.clip(jnp.asarray(first, jnp.int32), group.first_item, total)
    return jnp.stack([first, total - first]).astype(jnp.int32)


def execute_plan(
    plan,
    caches,
    objects,
    *,
    lowering: str = "auto",
    num_warps: int | None = None,
    tuning: LoweringTuning = DEFAULT_TUNING,
):
    """Run ``plan`` on JAX arrays.

    Parameters
    ----------
    plan : kvgroups_core.transfer.plan.TransferPlan
    caches : list of jax.Array, the backing tensors in ``plan.tensor_specs`` order.
    objects : list of jax.Array, one uint8 ``[num_chunks, object_nbytes]`` per object group
        (the core's object rule). On store an entry may be None: the program creates that object
        itself, as the
        kernel's output when the plan writes all of it (no zero-filled buffer, no fill pass).
    lowering : "auto", "cuda" (the CUDA kernel of kvgroups_torch, launched by XLA), "triton",
        "mosaic", "xla", "interpret" (Pallas interpret mode), "tpu" (Mosaic TPU DMAs) or
        "tpu-interpret" (the same kernels in Pallas' TPU interpret mode).
    num_warps : warps per Triton program (None: from the page size).
    tuning : the lowerings' launch shapes (:class:`~kvgroups_jax.lowerings.tuning.LoweringTuning`).

    Returns
    -------
    (caches, objects) : ``load`` returns new caches (donated: they reuse the input buffers) and
    the objects passed in; ``store`` returns the caches passed in and new objects (donated the
    same way).
    """
    direction = plan.direction
    if direction != "store" and direction != "load":
        raise KVGroupsValueError(f"plan.direction: expected 'store' or 'load', got {direction!r}")
    if len(caches) != len(plan.tensor_specs):
        raise KVGroupsValueError(
            f"caches: expected {len(plan.tensor_specs)} arrays (plan.tensor_specs), got "
            f"{len(caches)}"
        )
    _check_objects(plan, objects)
    caches = tuple(caches)
    objects = tuple(objects)
    platform, placement = _home(caches + objects)
    if lowering == "tpu" and any(isinstance(x, jax.core.Tracer) for x in caches + objects):
        platform = TRACED  # the caller lowers the trace, for a TPU whatever this machine is
    program = program_for(plan, lowering, platform, num_warps, fresh_shapes(plan, objects), tuning)
    metas, idss = runtime_args(plan, placement)
    if direction == "store":
        return caches, _store_jit(program, caches, objects, metas, idss)
    return _load_jit(program, caches, objects, metas, idss), objects


def writes_every_byte(plan, object_group: int) -> bool:
    """Whether ``plan``'s groups write every byte of each chunk of ``object_group``'s object
    (a whole-model store does; a layer subset does not): then a store may create that object
    rather than update one."""
    written = sum(
        len(g.planes) * g.slots * g.row_bytes
        for g in plan.groups
        if g.object_group_idx == object_group
    )
    return written == plan.object_nbytes[object_group] and written > 0


def fresh_shapes(plan, objects) -> tuple:
    """``_Program.fresh``: the shape of each object a store creates (None entries)."""
    if plan.direction != "store" or all(o is not None for o in objects):
        return ()
    return tuple(
        (plan.num_chunks, n) if o is None else None for o, n in zip(objects, plan.object_nbytes)
    )


def build_program(
    plan,
    lowering: str,
    platform: str,
    *,
    num_warps: int | None = None,
    objects=None,
    tuning: LoweringTuning = DEFAULT_TUNING,
):
    """The static :class:`_Program` of ``plan`` plus its runtime ``(metas, ids)`` arrays (NumPy;
    ``ids`` holds one array per distinct ids object, see ``_Program.id_indices``)."""
    fresh = fresh_shapes(plan, objects) if objects is not None else ()
    return (program_for(plan, lowering, platform, num_warps, fresh, tuning),) + runtime_args(
        plan, None
    )


def lower_plan(
    plan,
    lowering: str,
    caches,
    objects,
    *,
    platform: str = "cuda",
    num_warps: int | None = None,
    tuning: LoweringTuning = DEFAULT_TUNING,
):
    """Lower ``plan`` for ``platform`` without running it (no GPU needed).

    ``caches`` and ``objects`` may be ``jax.ShapeDtypeStruct`` s. Lowering runs the Triton or
    Mosaic GPU compilers' front ends, which reject non-power-of-two array ops and oversized
    TMA boxes, so CI catches them on a CPU-only machine; ``platform="tpu"`` with
    ``lowering="tpu"`` lowers the Mosaic TPU DMA kernels. Returns the ``jax.stages.Lowered``.
    """
    program, metas, idss = build_program(
        plan,
        lowering,
        "tpu" if platform == "tpu" else "gpu",
        num_warps=num_warps,
        objects=objects,
        tuning=tuning,
    )
    fn = _store_jit if plan.direction == "store" else _load_jit
    return fn.trace(program, tuple(caches), tuple(objects), metas, idss).lower(
        lowering_platforms=(platform,)
    )
