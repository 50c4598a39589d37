"""The copy-engine path: a plan's pages moved by the GPU's DMA engines, not by a kernel.

The host computes every group's ``(dst, src, nbytes)`` copies (:mod:`.runs`) and hands
them to the driver in one ``cuMemcpyBatchAsync`` call on PyTorch's current stream: no SM is
used, which leaves the GPU to the forward pass, and the copy engines reach pinned host memory
at the link's rate. It needs host ids and a host skip (the copy list is built from them), so
device ids run the kernel (``path="auto"``) or are refused (``path="copy_engine"``).

The driver call is a thin ctypes layer; which groups take it is decided by
:func:`copy_groups` (the measured table of :mod:`.paths` under ``"auto"``).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any, Sequence

import numpy as np
import torch
from kvgroups_cuda import params as P

from kvgroups_core.errors import KVGroupsIndexError, KVGroupsValueError, UnsupportedConfigError
from kvgroups_torch.cuda.driver import check, driver_version, libcuda, primary_context

from .paths import table_for
from .runs import group_copies

# CUmemcpySrcAccessOrder / CUmemLocationType values of cuda.h (CUDA 12.8+).
_SRC_ACCESS_ORDER_STREAM = 1
_LOCATION_DEVICE = 1
_LOCATION_HOST = 2
_STREAM_PER_THREAD = 2  # CU_STREAM_PER_THREAD: batches refuse the legacy NULL stream
# CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE: keep the copies on the copy engines (the
# driver may otherwise run a device-to-device copy as a kernel on the SMs).
_FLAGS = 1


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes``: how the copies of one stretch of the batch are ordered and
    where their two sides live."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


@functools.cache
def batch_function() -> tuple[Any, bool]:
    """The driver's batched copy and whether it takes ``failIdx``.

    CUDA 12.8 added ``cuMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, attrsIdxs,
    numAttrs, failIdx, stream)``; CUDA 13.0 dropped ``failIdx`` and exports that signature as
    ``cuMemcpyBatchAsync_v2`` (the unversioned symbol keeps the 12.8 one)."""
    lib = libcuda()
    version = driver_version()
    if version < 12080:
        raise UnsupportedConfigError(
            f"path: expected a CUDA driver >= 12.8 for 'copy_engine' (cuMemcpyBatchAsync), got "
            f"{version // 1000}.{version % 1000 // 10}"
        )
    vp, size, ptr = ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)
    if version >= 13000 and hasattr(lib, "cuMemcpyBatchAsync_v2"):
        fn, with_fail = lib.cuMemcpyBatchAsync_v2, False
        fn.argtypes = [vp, vp, vp, size, vp, vp, size, vp]
    else:
        fn, with_fail = lib.cuMemcpyBatchAsync, True
        fn.argtypes = [vp, vp, vp, size, vp, vp, size, ptr, vp]
    fn.restype = ctypes.c_int
    return fn, with_fail


def available() -> bool:
    """Whether this machine's driver has the batched copy."""
    try:
        batch_function()
    except (OSError, UnsupportedConfigError):
        return False
    return True


class BatchBuffers:
    """Reusable host arrays of one thread's batches (grown, never shrunk)."""

    def __init__(self) -> None:
        self.arrays = np.empty((3, 0), dtype=np.int64)
        self.attrs = (MemcpyAttributes * 2)()
        self.attr_index = (ctypes.c_size_t * 2)()
        self.fail = ctypes.c_size_t()
        self.current = ctypes.c_void_p()

    def reserve(self, count: int) -> np.ndarray:
        if self.arrays.shape[1] < count:
            self.arrays = np.empty((3, max(count, 2 * self.arrays.shape[1])), dtype=np.int64)
        return self.arrays


_local = threading.local()


def _buffers() -> BatchBuffers:
    found = getattr(_local, "buffers", None)
    if found is None:
        found = _local.buffers = BatchBuffers()
    return found


def enqueue(
    pieces: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
    host_sides: Sequence[bool],
    direction: str,
    device_index: int,
    stream: int,
) -> int:
    """One ``cuMemcpyBatchAsync`` of every copy in ``pieces`` on ``stream``.

    ``host_sides[k]`` says whether the object side of ``pieces[k]`` is pinned host memory
    (the cache side is always ``device_index``'s memory). Copies read their sources in
    stream order. Returns how many copies were enqueued."""
    count = sum(p[0].size for p in pieces)
    if not count:
        return 0
    fn, with_fail = batch_function()
    buf = _buffers()
    arrays = buf.reserve(count)
    # Device-side objects first, host-side after: one attribute entry per stretch.
    order = sorted(range(len(pieces)), key=lambda k: host_sides[k])
    at, stretches = 0, []
    for k in order:
        n = pieces[k][0].size
        if n:
            if not stretches or stretches[-1][1] != host_sides[k]:
                stretches.append((at, host_sides[k]))
            for row in range(3):
                arrays[row, at : at + n] = pieces[k][row]
            at += n
    for i, (start, host) in enumerate(stretches):
        cache = _MemLocation(_LOCATION_DEVICE, device_index)
        obj = _MemLocation(_LOCATION_HOST, 0) if host else cache
        a = buf.attrs[i]
        a.srcAccessOrder = _SRC_ACCESS_ORDER_STREAM
        a.srcLocHint, a.dstLocHint = (cache, obj) if direction == "store" else (obj, cache)
        a.flags = _FLAGS
        buf.attr_index[i] = start
    args = [
        arrays[0].ctypes.data,
        arrays[1].ctypes.data,
        arrays[2].ctypes.data,
        count,
        ctypes.addressof(buf.attrs),
        ctypes.addressof(buf.attr_index),
        len(stretches),
    ]
    if with_fail:
        args.append(ctypes.byref(buf.fail))
    submit(fn, args, stream or _STREAM_PER_THREAD, device_index, buf)
    return count


def submit(fn: Any, args: list, stream: int, device_index: int, buf: BatchBuffers) -> None:
    """Call the batched copy in the device's primary context (PyTorch's), restoring the
    thread's current context after."""
    lib = libcuda()
    context = primary_context(device_index)
    lib.cuCtxGetCurrent(ctypes.byref(buf.current))
    previous = buf.current.value
    if previous != context:
        check(lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    try:
        check(fn(*args, stream), f"cuMemcpyBatchAsync({args[3]} copies)")
    finally:
        if previous != context:
            lib.cuCtxSetCurrent(previous)


def chunk_addresses(addresses: Any) -> list[int]:
    """Address of each chunk's object row of one object group's
    ``kvgroups_torch.cuda.objects.ObjectAddresses``."""
    if addresses.mode == P.OBJ_STRIDED:
        return [addresses.base + c * addresses.stride for c in range(addresses.num_chunks)]
    return list(addresses.chunk_addresses)


def object_on_host(entry: Any) -> bool:
    """Whether an object group's entry (a tensor or per-chunk tensors) has pinned host
    memory in it."""
    if isinstance(entry, torch.Tensor):
        return not entry.is_cuda
    return any(isinstance(t, torch.Tensor) and not t.is_cuda for t in entry)


def _device_ids(plan: Any, block_ids: Sequence[Any] | None) -> bool:
    """Whether the plan's ids or skip live on the device (the host cannot list the copies)."""
    if getattr(plan, "device_ids", False) or getattr(plan, "skip_tokens", None) is not None:
        return True
    return block_ids is not None and any(
        isinstance(b, torch.Tensor) and b.is_cuda for b in block_ids
    )


def refuse_device_ids(plan: Any, block_ids: Sequence[Any] | None = None) -> None:
    """The typed error of ``path="copy_engine"`` with device (or traced) ids or skip."""
    if _device_ids(plan, block_ids):
        what = (
            "a device skip_first_n_tokens"
            if getattr(plan, "skip_tokens", None) is not None
            else "device block_ids (CUDA or traced tensors)"
        )
        raise KVGroupsValueError(
            "path: expected host block ids and a host skip_first_n_tokens for 'copy_engine' "
            f"(its copy list is computed on the host), got {what}; use path='kernel' or "
            "'auto'"
        )


def copy_groups(
    plan: Any, device_index: int, block_ids: Sequence[Any] | None = None, on_host: Any = None
) -> frozenset[int]:
    """Indices of the groups of ``plan`` the copy engines move (the rest launch kernels).

    ``path="kernel"``: none. ``"copy_engine"``: all (device ids or a device skip are
    refused, before anything moves). ``"auto"``: by the measured table of
    :mod:`.paths` for this GPU, per object group (its groups all take one path, so a
    staged pinned object is never half written by each); none without a table, with device
    ids, or while a CUDA graph is being captured. ``on_host(g)`` says whether object group
    ``g`` is in pinned host memory (default: never)."""
    path = getattr(plan, "path", "auto")
    if path == "kernel" or not plan.groups:
        return _NONE
    if path == "copy_engine":
        refuse_device_ids(plan, block_ids)
        batch_function()  # UnsupportedConfigError on drivers without it, before anything moves
        return frozenset(range(len(plan.groups)))
    table = table_for(device_index)
    if table is None or _device_ids(plan, block_ids) or torch.cuda.is_current_stream_capturing():
        return _NONE
    by_object: dict[int, list[int]] = {}
    for i, group in enumerate(plan.groups):
        by_object.setdefault(group.object_group_idx, []).append(i)
    chosen: set[int] = set()
    for g, members in by_object.items():
        placement = "pinned" if on_host is not None and on_host(g) else "device"
        if all(
            table.choose(plan.direction, placement, plan.groups[i], plan.num_chunks)
            == "copy_engine"
            for i in members
        ):
            chosen.update(members)
    if chosen and not available():
        return _NONE
    return frozenset(chosen)


_NONE: frozenset[int] = frozenset()


def _checked_ids(ids: Any, group: Any, i: int) -> np.ndarray:
    """Host ids replacing a group's (``BoundPlan.run``): the kernel drops a bad id on the
    device, a copy list would address outside the cache, so they are range-checked here."""
    ids = ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    needed = group.num_chunks * group.blocks_per_chunk
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.shape[0] < needed:
        raise KVGroupsValueError(
            f"block_ids[{i}]: expected a 1-D integer array of at least {needed} ids, got "
            f"{ids.dtype} of shape {ids.shape}"
        )
    ids = ids[:needed].astype(np.int64, copy=False)
    bad = (ids < 0) | (ids >= group.num_blocks)
    if bad.any():
        raise KVGroupsIndexError(
            f"block_ids[{i}]: expected ids in [0, {group.num_blocks}) for kernel group "
            f"{group.kernel_group_idx}, got {int(ids[bad][0])}"
        )
    return ids


def build_copies(
    plan: Any,
    indices: frozenset[int],
    plane_addresses: Any,
    addresses: dict[int, Any],
    on_host: Any = None,
    block_ids: Sequence[Any] | None = None,
) -> tuple[list, list]:
    """The copies of the groups ``indices`` of ``plan`` and, per group, whether its object
    side is pinned host memory (for :func:`enqueue`); ``plane_addresses(group)`` gives a
    group's plane base addresses, ``addresses[g]`` object group ``g``'s ObjectAddresses. Raises
    before anything is enqueued."""
    pieces, host_sides = [], []
    for i in sorted(indices):
        group = plan.groups[i]
        ids = None
        if block_ids is not None:
            ids = _checked_ids(block_ids[i], group, i)
        g = group.object_group_idx
        chunks = chunk_addresses(addresses[g])
        if len(chunks) < group.num_chunks:
            raise KVGroupsValueError(
                f"objects[{g}]: expected at least {group.num_chunks} chunks, got {len(chunks)}"
            )
        pieces.append(
            group_copies(
                group, plan.direction, plane_addresses(group), chunks[: group.num_chunks], ids
            )
        )
        host_sides.append(bool(on_host is not None and on_host(g)))
    return pieces, host_sides
