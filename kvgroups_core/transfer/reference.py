"""The NumPy reference backend: the oracle every other backend is tested against.

It executes plans on NumPy arrays with explicit byte index arithmetic straight from the page
model (``docs/DESIGN.md``), favouring obviousness over speed: every byte's source and
destination address is computed, bounds-checked against the tensor it belongs to, and copied.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace
from typing import Any, Sequence, cast

import numpy as np

from kvgroups_core.errors import KVGroupsIndexError, KVGroupsTypeError, KVGroupsValueError
from kvgroups_core.tensors.arrays import backend_for_object
from kvgroups_core.tensors.descriptors import TensorDesc, TensorSpec, describe_numpy
from kvgroups_core.tensors.dtypes import as_dtype

from .backend import Backend
from .objects import numpy_dtype
from .plan import GroupTransfer, TransferPlan, first_item_for_skip


def byte_view(desc: TensorDesc, writable: bool) -> np.ndarray:
    """A 1-D uint8 view over every byte a NumPy-backed tensor addresses."""
    arr = desc.obj
    if not isinstance(arr, np.ndarray):
        raise KVGroupsTypeError(
            f"tensor: expected a numpy.ndarray for the numpy backend, got {type(arr).__name__}"
        )
    if writable and not arr.flags.writeable:
        raise KVGroupsValueError("tensor: expected a writable array, got a read-only one")
    extent = desc.spec.extent_elems() * desc.dtype.itemsize
    if extent == 0:
        return np.zeros(0, dtype=np.uint8)
    raw = (ctypes.c_uint8 * extent).from_address(desc.address)
    # A ctypes array is a buffer; NumPy's stubs name buffer types one by one before 3.12.
    view = np.frombuffer(raw, dtype=np.uint8)  # type: ignore[call-overload]
    return view


def _object_rows(obj: Any, chunk: int) -> np.ndarray:
    row = obj[chunk]
    if not isinstance(row, np.ndarray) or row.dtype != np.uint8:
        raise KVGroupsTypeError(f"objects: expected uint8 numpy arrays, got {type(row).__name__}")
    return row


def execute_group(
    t: GroupTransfer,
    store: bool,
    caches: Sequence[np.ndarray],
    objects: Any,
    first_item: int | None = None,
    keep: np.ndarray | None = None,
) -> None:
    """Move the bytes of one kernel group between ``caches`` (1-D byte views, by tensor_index) and
    ``objects`` (the object group's ``[num_chunks, nbytes]`` array or per-chunk list).

    ``first_item`` overrides the group's (a device skip resolved on the host); ``keep``, a
    boolean mask over the moved items, drops the others (out-of-range device ids)."""
    chunks, positions, ids = t.items(first_item)
    if keep is not None:
        chunks, positions, ids = chunks[keep], positions[keep], ids[keep]
    tokens = np.arange(t.block_size, dtype=np.int64)
    for chunk in np.unique(chunks):
        sel = chunks == chunk
        pos, bid = positions[sel], ids[sel]
        obj = _object_rows(objects, int(chunk))
        for plane in t.planes:
            p = plane.object_plane  # the plane's rows in the region, whatever subset moves
            cache = caches[plane.tensor_index]
            block_start = plane.byte_offset + bid * t.block_stride_bytes
            row_start = (
                t.region_offset
                + (p * t.slots + pos[:, None] * t.block_size + tokens[None, :]) * t.row_bytes
            )
            for run in t.runs:
                piece = np.arange(run.count, dtype=np.int64)
                u = np.arange(run.nbytes, dtype=np.int64)
                # [items, tokens, pieces, bytes]
                cache_idx = (
                    block_start[:, None, None, None]
                    + run.cache_offset
                    + piece[None, None, :, None] * run.cache_step
                    + tokens[None, :, None, None] * run.token_stride
                    + u[None, None, None, :]
                )
                obj_idx = (
                    row_start[:, :, None, None]
                    + run.obj_offset
                    + piece[None, None, :, None] * run.obj_step
                    + u[None, None, None, :]
                )
                _check_bounds(cache_idx, cache.size, "cache")
                _check_bounds(obj_idx, obj.size, "object")
                if store:
                    obj[obj_idx] = cache[cache_idx]
                else:
                    cache[cache_idx] = obj[obj_idx]


def _check_bounds(idx: np.ndarray, size: int, what: str) -> None:
    # The planner validated everything; this guards the oracle itself against layout bugs.
    if idx.size and (idx.min() < 0 or idx.max() >= size):
        raise KVGroupsValueError(
            f"{what} bytes: expected indices in [0, {size}), got [{idx.min()}, {idx.max()}]"
        )


def host_ids(ids: Any) -> np.ndarray:
    """A plan's block ids as int64 NumPy (device ids of a CPU test: torch CPU tensors, JAX
    arrays; anything NumPy can read)."""
    return np.asarray(ids).astype(np.int64, copy=False)


def host_skip(skip: Any) -> int:
    """A plan's device / traced skip read on the host (tests on CPU)."""
    return int(np.asarray(skip))


def execute_plan(
    plan: TransferPlan,
    caches: Sequence[Any],
    objects: Sequence[Any],
    *,
    drop_out_of_range: bool = False,
) -> set[int]:
    """Run ``plan`` on NumPy ``caches`` (arrays or TensorDescs in tensor_index order) and NumPy
    ``objects``, the reference of what every backend does with the same plan.

    A device plan (``plan.device_ids`` / ``plan.skip_tokens``) is resolved on the host: the
    skip through :func:`~kvgroups_core.transfer.plan.first_item_for_skip`, the ids with NumPy. With
    ``drop_out_of_range`` an item whose id is outside its group's blocks moves nothing
    (every other item moves) and the bad ids are returned: the device-id contract of the
    backends. Without it a bad id raises :class:`KVGroupsIndexError` before any byte moves.
    """
    store = plan.direction == "store"
    descs = [c if isinstance(c, TensorDesc) else describe_numpy(c) for c in caches]
    work = []
    bad: set[int] = set()
    for t in plan.groups:
        first = t.first_item
        if plan.skip_tokens is not None:
            first = int(first_item_for_skip(t, host_skip(plan.skip_tokens)))
        if t.num_chunks * t.kept_per_chunk - first <= 0:
            continue
        if not isinstance(t.block_ids, np.ndarray):
            t = replace(t, block_ids=host_ids(t.block_ids))
        _, _, ids = t.items(first)
        ok = (ids >= 0) & (ids < t.num_blocks)
        if not ok.all():
            if not drop_out_of_range:
                raise KVGroupsIndexError(
                    f"block_ids: expected ids in [0, {t.num_blocks}) for kernel group "
                    f"{t.kernel_group_idx}, got {int(ids[~ok][0])}"
                )
            bad.update(int(x) for x in ids[~ok])
        work.append((t, first, None if ok.all() else ok))
    views = [byte_view(d, writable=not store) for d in descs]
    for t, first, keep in work:
        execute_group(t, store, views, objects[t.object_group_idx], first, keep)
    return bad


def _leaf_arrays(objects: Any) -> list:
    out: list = []
    for o in objects:
        out.extend(o if isinstance(o, (list, tuple)) else [o])
    return out


class NumpyBackend(Backend):
    """Executes plans on NumPy arrays (caches and objects on the host)."""

    name = "numpy"
    array_types = ("numpy.ndarray",)

    def describe(self, x: Any) -> TensorDesc:
        return describe_numpy(x)

    def shape_of(self, x: Any) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        # Read, not described: the object rule names an object of any other dtype (object,
        # complex, ...) as not uint8, which describing would refuse without naming it.
        if not isinstance(x, np.ndarray):
            return super().shape_of(x)
        itemsize = x.dtype.itemsize or 1
        return x.dtype.name, x.shape, tuple(s // itemsize for s in x.strides)

    def allocate_objects(
        self, plan: TransferPlan, like: TensorDesc, placement: str | None = None
    ) -> list:
        if placement not in (None, "cpu", "host"):
            raise KVGroupsValueError(
                f"placement: expected None or 'cpu' for the numpy backend, got {placement!r}"
            )
        return [np.zeros((plan.num_chunks, n), dtype=np.uint8) for n in plan.object_nbytes]

    def from_numpy(self, a: Any, device: str | None = None, dtype: Any = None) -> Any:
        """A copy of ``a``; reinterpreted as ``dtype`` when given. Without a NumPy dtype for
        it (bfloat16 and float8 need ml_dtypes) the copy is returned as a TensorDesc of
        ``dtype`` over the raw bits, which every core API accepts."""
        if device not in (None, "cpu"):
            raise KVGroupsValueError(
                f"device: expected 'cpu' for the numpy backend, got {device!r}"
            )
        a = np.array(a, copy=True)
        if dtype is None:
            return a
        dt = as_dtype(dtype)
        if dt.itemsize != a.dtype.itemsize:
            raise KVGroupsValueError(
                f"dtype: expected the {a.dtype.itemsize}-byte width of the array, got {dt.name}"
            )
        np_dtype = numpy_dtype(dt)
        if np_dtype.name == dt.name or np_dtype.itemsize == dt.itemsize and np_dtype.kind != "u":
            return a.view(np_dtype)
        d = describe_numpy(a)
        return TensorDesc(TensorSpec(d.shape, dt, d.strides, "cpu"), d.data_ptr, 0, a, "numpy")

    def to_numpy(self, x: Any) -> np.ndarray:
        if isinstance(x, TensorDesc):
            x = x.obj
        return np.array(x, copy=True)

    def import_foreign(self, x: Any) -> np.ndarray:
        """Host arrays are adopted zero-copy through DLPack; device arrays are copied to the
        host by their own backend (NumPy cannot address device memory)."""
        if isinstance(x, np.ndarray):
            return x
        device_type, _ = x.__dlpack_device__()
        if int(device_type) == 1:  # kDLCPU
            return np.from_dlpack(x)
        owner = backend_for_object(x)
        if owner is None:
            raise KVGroupsTypeError(
                f"x: expected a host array or one of a registered backend, got "
                f"{type(x).__name__} on DLPack device type {device_type}"
            )
        return np.asarray(cast(Backend, owner).to_numpy(x))  # the registry's are Backends

    def validate_objects(
        self, plan: TransferPlan, caches: Sequence[TensorDesc], objects: Sequence[Any]
    ) -> None:
        writes_objects = plan.direction == "store"
        targets = _leaf_arrays(objects) if writes_objects else [d.obj for d in caches]
        for arr in targets:
            if isinstance(arr, np.ndarray) and not arr.flags.writeable:
                what = "objects" if writes_objects else "kv_caches"
                raise KVGroupsValueError(f"{what}: expected writable arrays, got a read-only one")

    def execute(
        self, plan: TransferPlan, caches: Sequence[TensorDesc], objects: Sequence[Any]
    ) -> tuple[None, list]:
        execute_plan(plan, caches, objects)
        return None, list(objects)
