"""Memory objects: the byte layout of one chunk of one object group (docs/SEMANTICS.md section 6).

One object holds, in the object group's kernel-group order, one region per kernel group shaped
``[kv_size, nl, slots, nh * hs]`` of that group's dtype, where ``slots`` is
``manager.get_slots_per_chunk_in_sw(k)``. Token ``t`` of layer ``l`` of plane ``kv`` is row
``(kv * nl + l) * slots + t`` of its region.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvgroups_core.errors import (
    KVGroupsError,
    KVGroupsIndexError,
    KVGroupsTypeError,
    KVGroupsValueError,
)
from kvgroups_core.grouping.tensor_parallel import (
    CANONICAL,
    TP_NATIVE,
    tp_native_nbytes,
    tp_native_regions,
)
from kvgroups_core.tensors.dtypes import DType


@dataclass(frozen=True, kw_only=True)
class Region:
    """Where kernel group ``kernel_group_idx`` lives inside its object group's objects."""

    kernel_group_idx: int
    offset: int
    shape: tuple[int, int, int, int]  # [kv_size, nl, slots, nh * hs]
    dtype: DType

    @property
    def row_bytes(self) -> int:
        return self.shape[3] * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        kv, nl, slots, _ = self.shape
        return kv * nl * slots * self.row_bytes


def _check_object_group(manager: Any, object_group_idx: int) -> None:
    n = manager.num_object_groups
    if not isinstance(object_group_idx, (int, np.integer)) or isinstance(object_group_idx, bool):
        raise KVGroupsTypeError(
            f"object_group_idx: expected an int, got {type(object_group_idx).__name__}"
        )
    if not 0 <= object_group_idx < n:
        raise KVGroupsIndexError(
            f"object_group_idx: expected an index in [0, {n}), got {object_group_idx}"
        )


def object_regions(manager: Any, object_group_idx: int) -> list[Region]:
    """The regions of one object group's objects, in layout order."""
    _check_object_group(manager, object_group_idx)
    regions = []
    offset = 0
    for k in manager.object_groups[object_group_idx].kernel_group_indices:
        group = manager.kernel_groups[k]
        sd = group.shape_desc
        region = Region(
            kernel_group_idx=k,
            offset=offset,
            shape=(sd.kv_size, sd.nl, manager.get_slots_per_chunk_in_sw(k), sd.nh * sd.hs),
            dtype=group.dtype,
        )
        regions.append(region)
        offset += region.nbytes
    if getattr(manager, "object_layout", CANONICAL) == TP_NATIVE:
        return tp_native_regions(manager, regions)  # each rank's part inside the shared object
    return regions


def object_nbytes(manager: Any, object_group_idx: int) -> int:
    """Bytes of one chunk's object of ``object_group_idx``."""
    regions = object_regions(manager, object_group_idx)
    if getattr(manager, "object_layout", CANONICAL) == TP_NATIVE:
        return tp_native_nbytes(manager, regions)  # the whole model's bytes, all ranks' parts
    return sum(r.nbytes for r in regions)


def region_of(manager: Any, kernel_group_idx: int) -> tuple[int, Region]:
    """``(object_group_idx, region)`` of a kernel group."""
    for og_idx, og in enumerate(manager.object_groups):
        if kernel_group_idx in og.kernel_group_indices:
            for region in object_regions(manager, og_idx):
                if region.kernel_group_idx == kernel_group_idx:
                    return og_idx, region
    raise KVGroupsIndexError(
        f"kernel_group_idx: expected an index in [0, {manager.num_kernel_groups}), "
        f"got {kernel_group_idx}"
    )


def numpy_dtype(dtype: DType) -> np.dtype:
    """The NumPy dtype for ``dtype`` (ml_dtypes for bfloat16/float8 when installed, else the
    same-width unsigned type)."""
    try:
        return np.dtype(dtype.name)
    except TypeError:
        pass
    try:  # bfloat16 and float8 live in ml_dtypes (a JAX dependency), when installed.
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, dtype.name))
    except (ImportError, AttributeError):
        return np.dtype(dtype.uint_view_name)


def region_view(manager: Any, obj: np.ndarray, kernel_group_idx: int) -> np.ndarray:
    """View kernel group ``kernel_group_idx``'s region of a NumPy object as
    ``[kv_size, nl, slots, nh * hs]`` of the group's dtype (zero-copy).

    ``obj`` is one chunk's object (1-D uint8, ``object_nbytes`` long) or a batch
    ``[num_chunks, object_nbytes]`` (the view then gains a leading chunk axis). bfloat16 and
    float8 views need ``ml_dtypes``; without it the view has the same-width unsigned type.
    """
    og_idx, region = region_of(manager, kernel_group_idx)
    nbytes = object_nbytes(manager, og_idx)
    arr = np.asarray(obj)
    if arr.dtype != np.uint8 or arr.ndim not in (1, 2) or arr.shape[-1] != nbytes:
        raise KVGroupsValueError(
            f"obj: expected uint8 [{nbytes}] or [num_chunks, {nbytes}], got {arr.dtype} {arr.shape}"
        )
    piece = arr[..., region.offset : region.offset + region.nbytes]
    return piece.view(numpy_dtype(region.dtype)).reshape(arr.shape[:-1] + region.shape)


def check_objects(
    plan: Any, objects: Sequence[Any], shape_of: Any, *, store_creates: bool = False
) -> None:
    """The one object rule, for every entry point (the core's calls, and backend entry
    points that take a plan directly): one entry per object group, each a uint8
    ``[num_chunks, object_nbytes]`` array with contiguous rows, or a list of ``num_chunks``
    1-D uint8 buffers of ``object_nbytes`` each (``plan`` gives ``num_chunks`` and
    ``object_nbytes``; zero chunks: ``[0, nbytes]``). Backends add only what concerns their
    memory (devices, pinned host memory, shardings).

    ``shape_of(x) -> (dtype name, shape, strides)`` reads an array (``Backend.shape_of``).
    ``store_creates``: a None entry of a store is an object the backend creates itself
    (``kvgroups_jax.execute_plan``).
    """
    if not isinstance(objects, (list, tuple)):
        raise KVGroupsTypeError(
            f"objects: expected a list with one entry per object group, got "
            f"{type(objects).__name__}"
        )
    if len(objects) != len(plan.object_nbytes):
        raise KVGroupsValueError(
            f"objects: expected {len(plan.object_nbytes)} entries (one per object group), got "
            f"{len(objects)}"
        )
    created = store_creates and plan.direction == "store"
    for og, (obj, nbytes) in enumerate(zip(objects, plan.object_nbytes)):
        if obj is None and created:
            continue
        if isinstance(obj, (list, tuple)):
            if len(obj) != plan.num_chunks:
                raise KVGroupsValueError(
                    f"objects[{og}]: expected {plan.num_chunks} per-chunk buffers, got {len(obj)}"
                )
            for c, buf in enumerate(obj):
                _check_buffer(shape_of, buf, (nbytes,), f"objects[{og}][{c}]")
        else:
            _check_buffer(shape_of, obj, (plan.num_chunks, nbytes), f"objects[{og}]")


def _check_buffer(shape_of: Any, x: Any, shape: tuple[int, ...], what: str) -> None:
    try:
        dtype, got_shape, strides = shape_of(x)
    except KVGroupsError as exc:  # the backend refused the array itself: name which one
        text = str(exc)
        for generic in ("objects: ", "tensor: "):
            text = text.removeprefix(generic)
        raise type(exc)(f"{what}: {text}") from None
    if dtype != "uint8" or tuple(got_shape) != shape:
        raise KVGroupsValueError(
            f"{what}: expected uint8 {list(shape)}, got {dtype} {list(got_shape)}"
        )
    if strides[-1] != 1 and shape[-1] > 1 and 0 not in shape:  # an empty buffer has no rows
        raise KVGroupsValueError(f"{what}: expected contiguous rows, got strides {tuple(strides)}")
