"""Run a :class:`~kvgroups_core.plan.TransferPlan` with JAX: one jitted program per plan shape.

The static part of a call (each group's :class:`~kvgroups_core.geometry.GroupGeometry`, the
lowering, the item and id buckets) is the jit key; block ids and item counts are runtime
arrays, so a new request whose page count stays inside its power-of-two bucket reuses the
compiled program (:func:`trace_count` counts compilations). ``load`` donates the caches and every
kernel aliases its outputs to them: the new caches live in the old buffers. ``store`` donates the
objects the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError, UnsupportedConfig

from . import pallas_copy, xla_copy
from .geometry import GroupGeometry, bucket, check_kernel_limits, group_geometry
from .views import flat_view, object_unview, object_view, unflat_view

LOWERINGS = ("auto", "triton", "mosaic", "xla", "interpret")

_TRACES = {"count": 0}


def trace_count() -> int:
    """How many times a transfer program was traced (each trace is one compilation)."""
    return _TRACES["count"]


@dataclass(frozen=True)
class _Program:
    """The jit key: everything static about one plan execution."""

    direction: str
    geoms: tuple[GroupGeometry, ...]
    lowerings: tuple[str, ...]
    object_groups: tuple[int, ...]
    grid_items: tuple[int, ...]
    num_warps: int


def _copy_fn(lowering: str):
    if lowering in ("triton", "interpret"):
        return pallas_copy.copy_group
    if lowering == "mosaic":
        from . import pallas_mosaic

        return pallas_mosaic.copy_group
    return xla_copy.copy_group


def _run(program: _Program, caches, objects, metas, idss):
    _TRACES["count"] += 1
    caches = list(caches)
    objects = list(objects)
    for g, geom in enumerate(program.geoms):
        lowering = program.lowerings[g]
        og = program.object_groups[g]
        unit = geom.unit
        views = tuple(flat_view(caches[s], unit) for s in geom.operand_slots)
        obj = object_view(objects[og], unit)
        out = _copy_fn(lowering)(
            program.direction, geom, program.grid_items[g], metas[g], idss[g], obj, views,
            interpret=lowering == "interpret", num_warps=program.num_warps,
        )
        if program.direction == "store":
            objects[og] = object_unview(out, unit)
        else:
            for s, view in zip(geom.operand_slots, out):
                caches[s] = unflat_view(view, caches[s].shape, caches[s].dtype, unit)
    # Return only what the transfer wrote: returning a non-donated input makes XLA copy it
    # (measured on the H200: every cache copied on store, every object on load).
    return tuple(caches) if program.direction == "load" else tuple(objects)


_store_jit = jax.jit(_run, static_argnums=(0,), donate_argnums=(2,))
_load_jit = jax.jit(_run, static_argnums=(0,), donate_argnums=(1,))


def platform_of(arrays) -> str:
    """``"gpu"``, ``"cpu"`` ... of concrete arrays; the default backend for traced values."""
    for x in arrays:
        if isinstance(x, jax.core.Tracer) or not hasattr(x, "devices"):
            continue
        return next(iter(x.devices())).platform
    return jax.default_backend()


def _compute_capability() -> tuple[int, int]:
    cc = getattr(jax.devices()[0], "compute_capability", "0.0")
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


def resolve_lowering(requested: str, geom: GroupGeometry, platform: str) -> str:
    """The lowering that runs ``geom`` on ``platform`` (``"auto"`` picks the fastest that can).

    Explicit requests that cannot run raise :class:`UnsupportedConfig`.
    """
    if requested not in LOWERINGS:
        raise KVGroupsValueError(f"lowering: expected one of {LOWERINGS}, got {requested!r}")
    if requested in ("xla",):
        return requested
    if requested == "interpret":
        check_kernel_limits(geom)
        return requested
    gpu = platform in ("gpu", "cuda")
    if requested in ("triton", "mosaic") and not gpu:
        raise UnsupportedConfig(
            f"lowering: {requested!r} needs a CUDA GPU, got platform {platform!r}"
        )
    if requested == "triton":
        check_kernel_limits(geom)
        return requested
    if requested == "mosaic":
        _check_mosaic(geom)
        return requested
    if not gpu:
        return "xla"
    # Triton first: it covers every layout and measured fastest; the Mosaic GPU pallas_call
    # did not lower on jax 0.11.2 (see the module docs of pallas_mosaic), so it is opt-in.
    try:
        check_kernel_limits(geom)
        return "triton"
    except UnsupportedConfig:
        return "xla"


def _check_mosaic(geom: GroupGeometry) -> None:
    from .pallas_mosaic import mosaic_pieces

    check_kernel_limits(geom)
    if _compute_capability() < (9, 0):
        raise UnsupportedConfig(
            f"lowering: Mosaic GPU needs compute capability >= 9.0, got {_compute_capability()}"
        )
    mosaic_pieces(geom)


def _padded_ids(block_ids) -> jax.Array | np.ndarray:
    if isinstance(block_ids, jax.Array) and not isinstance(block_ids, np.ndarray):
        n = block_ids.shape[0]
        ids = block_ids.astype(jnp.int32)
        return jnp.pad(ids, (0, bucket(n) - n))
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.size and (ids.min() < np.iinfo(np.int32).min or ids.max() > np.iinfo(np.int32).max):
        raise KVGroupsValueError(f"block_ids: expected int32 values, got range "
                                 f"[{ids.min()}, {ids.max()}]")
    out = np.zeros(bucket(ids.size), np.int32)
    out[: ids.size] = ids
    return out


def _check_objects(plan, objects) -> None:
    if len(objects) != len(plan.object_nbytes):
        raise KVGroupsValueError(
            f"objects: expected {len(plan.object_nbytes)} entries (one per object group), "
            f"got {len(objects)}"
        )
    for k, (obj, nbytes) in enumerate(zip(objects, plan.object_nbytes)):
        if isinstance(obj, (list, tuple)):
            raise KVGroupsTypeError(
                f"objects[{k}]: expected one [num_chunks, {nbytes}] uint8 jax.Array, got a "
                f"list of per-chunk buffers (stack them once, outside the transfer)"
            )
        shape = tuple(getattr(obj, "shape", ()))
        if (len(shape) != 2 or shape[1] != nbytes or shape[0] < plan.num_chunks
                or jnp.dtype(obj.dtype) != jnp.uint8):
            raise KVGroupsValueError(
                f"objects[{k}]: expected uint8 [>= {plan.num_chunks}, {nbytes}], got "
                f"{getattr(obj, 'dtype', type(obj).__name__)} {list(shape)}"
            )


def execute_plan(plan, caches, objects, *, lowering: str = "auto", num_warps: int = 4):
    """Run ``plan`` on JAX arrays.

    Parameters
    ----------
    plan : kvgroups_core.plan.TransferPlan
    caches : list of jax.Array, the backing tensors in ``plan.tensor_specs`` order.
    objects : list of jax.Array, one uint8 ``[num_chunks, object_nbytes]`` per object group
        (more rows are allowed: a preallocated pool; only the first ``num_chunks`` are used).
    lowering : "auto", "triton", "mosaic", "xla" or "interpret" (Pallas interpret mode).

    Returns
    -------
    (caches, objects) : ``load`` returns new caches (donated: they reuse the input buffers) and
    the objects passed in; ``store`` returns the caches passed in and new objects (donated the
    same way).
    """
    if plan.direction not in ("store", "load"):
        raise KVGroupsValueError(f"plan.direction: expected 'store' or 'load', got "
                                 f"{plan.direction!r}")
    if len(caches) != len(plan.tensor_specs):
        raise KVGroupsValueError(
            f"caches: expected {len(plan.tensor_specs)} arrays (plan.tensor_specs), got "
            f"{len(caches)}"
        )
    _check_objects(plan, objects)
    platform = platform_of(list(caches) + list(objects))
    program, metas, idss = build_program(plan, lowering, platform, num_warps=num_warps)
    fn = _store_jit if plan.direction == "store" else _load_jit
    out = fn(program, tuple(caches), tuple(objects), metas, idss)
    return (out, tuple(objects)) if plan.direction == "load" else (tuple(caches), out)


def build_program(plan, lowering: str, platform: str, *, num_warps: int = 4):
    """The static :class:`_Program` of ``plan`` plus its runtime ``(metas, ids)`` arrays."""
    geoms, lowerings, ogs, grids, metas, idss = [], [], [], [], [], []
    for group in plan.groups:
        geom = group_geometry(group, plan.tensor_specs, plan.object_nbytes[group.object_group_idx])
        geoms.append(geom)
        lowerings.append(resolve_lowering(lowering, geom, platform))
        ogs.append(group.object_group_idx)
        grids.append(bucket(group.num_items))
        metas.append(np.array([group.first_item, max(group.num_items, 0)], np.int32))
        idss.append(_padded_ids(group.block_ids))
    program = _Program(plan.direction, tuple(geoms), tuple(lowerings), tuple(ogs), tuple(grids),
                       num_warps)
    return program, tuple(metas), tuple(idss)


def lower_plan(plan, lowering: str, caches, objects, *, platform: str = "cuda",
               num_warps: int = 4):
    """Lower ``plan`` for ``platform`` without running it (no GPU needed).

    ``caches`` and ``objects`` may be ``jax.ShapeDtypeStruct`` s. Lowering runs the Triton or
    Mosaic GPU compilers' front ends, which reject non-power-of-two array ops and oversized
    TMA boxes, so CI catches them on a CPU-only machine. Returns the ``jax.stages.Lowered``.
    """
    program, metas, idss = build_program(plan, lowering, "gpu", num_warps=num_warps)
    fn = _store_jit if plan.direction == "store" else _load_jit
    return fn.trace(program, tuple(caches), tuple(objects), metas, idss).lower(
        lowering_platforms=(platform,)
    )
