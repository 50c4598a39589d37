"""Run a :class:`~kvgroups_core.transfer.plan.TransferPlan` on CUDA tensors with the page-copy kernels.

One launch per :class:`~kvgroups_core.transfer.plan.GroupTransfer`. What depends only on the group's
geometry and the caches' addresses (the plane pointer table on the device, the packed
``KvgParams`` per vector width, the kernel handle) is built once and cached; a call then only
writes the block ids, the object addresses and the item range into the packed parameters and
launches the kernel on PyTorch's current stream (``driver.Launcher``). Nothing here synchronises.
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from kvgroups_cuda import geometry, nvrtc
from kvgroups_cuda import params as P
from kvgroups_cuda.geometry import GroupShape, group_shape, items_per_cta
from kvgroups_cuda.nvrtc import kernel_table

from kvgroups_core.errors import (
    KVGroupsIndexError,
    KVGroupsTypeError,
    KVGroupsValueError,
    UnsupportedConfig,
)
from kvgroups_core.formats.segments import widest_unit

from . import copy_engine, device_tables
from .driver import Launcher

_INT32_MAX = 2**31 - 1


class DeviceState:
    """Per-GPU state: arch, kernels, SM count and the out-of-range block id flag."""

    def __init__(self, index: int) -> None:
        major, minor = torch.cuda.get_device_capability(index)
        self.index = index
        self.arch = f"sm_{major}{minor}"
        self.num_sms = torch.cuda.get_device_properties(index).multi_processor_count
        # The error record kernels write when they meet an out-of-range block id or device
        # skip (page_copy.cu, kvg_report); static address, so graph replays report through it.
        # Launches on any stream write it (device_tables: its zero fill is ordered for them).
        self.err_table = device_tables.zeros(P.ERR_WORDS, index)
        self.err_record = self.err_table.tensor
        self.kernels = kernel_table(self.arch)


_devices: dict[int, DeviceState] = {}
_devices_lock = threading.Lock()


def device_state(index: int) -> DeviceState:
    state = _devices.get(index)
    if state is None:
        with _devices_lock:
            state = _devices.get(index)
            if state is None:
                state = _devices[index] = DeviceState(index)
    return state


def reset_caches() -> None:
    """Forget loaded kernels and cached launch state (after changing ``nvrtc.TUNING`` or
    ``geometry.TARGET_CTA_BYTES``; benchmarks use this)."""
    with _devices_lock, _cache_lock:
        _devices.clear()
        _by_identity.clear()
        _by_value.clear()


def check_device_errors(device: torch.device | int | str | None = None) -> None:
    """Synchronise with ``device`` and raise if a kernel met a bad device-side value.

    Block ids (and a load's ``skip_first_n_tokens``) that live on the GPU are checked by the
    kernels: a bad id moves nothing for its item, a bad skip is clamped, and the first bad
    value is recorded on the device (:data:`DeviceState.err_record`). This reads and clears
    the record; ``kvgroups_torch.check_errors`` is the public name.

    Raises
    ------
    KVGroupsIndexError
        A launch since the last check saw a block id outside ``[0, num_blocks)``; the message
        names the argument (``block_ids[engine group]``), the bound and the first bad value.
    KVGroupsValueError
        A device ``skip_first_n_tokens`` outside ``[0, tokens covered]``.
    """
    index = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    index = torch.device(index).index if not isinstance(index, int) else index
    if index is None:
        index = torch.cuda.current_device()
    state = _devices.get(index)
    if state is None:
        return
    # Every stream's launches write the record: wait for all of them, not only for the
    # current stream (which is all the read below would wait for).
    torch.cuda.synchronize(index)
    raise_recorded(state.err_record, f"cuda:{index}", index)


def check_errors(device: torch.device | int | str | None = None) -> None:
    """The documented check of device-side ids: synchronise with ``device`` (default: every
    GPU a transfer ran on), then raise the first bad id or skip the kernels met since the
    last check (see :func:`check_device_errors`)."""
    if device is not None:
        check_device_errors(device)
        return
    for index in sorted(_devices):
        check_device_errors(index)


def raise_recorded(record: torch.Tensor, where: str, device_index: int | None = None) -> None:
    """Read (synchronising), clear and raise the error ``record`` holds, if any.

    ``device_index``: the record's GPU, synchronised after the clear, so no launch queued
    later on another stream can record into it before the clear lands (and have its
    error wiped)."""
    words = record.tolist()  # the one synchronisation: the point of a check
    if not words[0]:
        return
    record.zero_()
    if device_index is not None:
        torch.cuda.synchronize(device_index)
    value, engine_group, kernel_group, bound, count = (int(w) for w in words[1:6])
    if engine_group < 0:
        raise KVGroupsValueError(
            f"skip_first_n_tokens: expected a value in [0, {bound}] (the tokens the block ids "
            f"cover), got {value} on {where} (clamped; {count} bad value(s) since the last check)"
        )
    raise KVGroupsIndexError(
        f"block_ids[{engine_group}]: expected ids in [0, {bound}) for kernel group "
        f"{kernel_group}, got {value} on {where} (those items were not moved; {count} bad "
        "id(s) since the last check)"
    )


@dataclass
class ObjectBinding:
    """Where the chunks of one object group live for one call."""

    mode: int
    base: int = 0
    stride: int = 0
    addresses: tuple[int, ...] = ()
    table: Any = None  # OBJ_TABLE: a device_tables.DeviceTable of the chunk addresses
    unit: int = 16
    num_chunks: int = 0


def check_object_tensor(t: torch.Tensor, device_index: int, what: str) -> None:
    """Objects the kernels may touch: uint8, on ``device_index`` or in pinned host memory."""
    if t.dtype != torch.uint8:
        raise KVGroupsTypeError(f"{what}: expected a uint8 tensor, got {t.dtype}")
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


def bind_objects(entry: Any, device_index: int, what: str) -> ObjectBinding:
    """Object addressing of one object group: a ``[num_chunks, nbytes]`` uint8 tensor, or a
    sequence of ``num_chunks`` 1-D uint8 tensors anywhere on the device or pinned host."""
    if isinstance(entry, torch.Tensor):
        check_object_tensor(entry, device_index, what)
        if entry.dim() != 2 or (entry.shape[1] > 1 and entry.stride(1) != 1):
            raise KVGroupsValueError(
                f"{what}: expected a [num_chunks, nbytes] tensor with contiguous rows, got "
                f"shape {tuple(entry.shape)} strides {entry.stride()}"
            )
        base, stride = entry.data_ptr(), entry.stride(0)
        unit = widest_unit([base, stride] if entry.shape[0] > 1 else [base])
        return ObjectBinding(P.OBJ_STRIDED, base=base, stride=stride, unit=unit,
                             num_chunks=entry.shape[0])
    if not isinstance(entry, (list, tuple)):
        raise KVGroupsTypeError(
            f"{what}: expected a torch.Tensor or a list of per-chunk tensors, got "
            f"{type(entry).__name__}"
        )
    addresses = []
    for c, t in enumerate(entry):
        if not isinstance(t, torch.Tensor):
            raise KVGroupsTypeError(f"{what}[{c}]: expected a torch.Tensor, got {type(t).__name__}")
        check_object_tensor(t, device_index, f"{what}[{c}]")
        if not t.is_contiguous():
            raise KVGroupsValueError(f"{what}[{c}]: expected a contiguous buffer, got strides {t.stride()}")
        addresses.append(t.data_ptr())
    unit = widest_unit(addresses)
    if len(addresses) <= P.INLINE_OBJS:
        return ObjectBinding(P.OBJ_INLINE, addresses=tuple(addresses), unit=unit,
                             num_chunks=len(addresses))
    table = _to_table(np.asarray(addresses, dtype=np.int64), device_index)
    return ObjectBinding(P.OBJ_TABLE, table=table, addresses=tuple(addresses), unit=unit,
                         num_chunks=len(addresses))


# Tables kept across calls (plane and object tables), readable from any stream.
_to_table = device_tables.upload


def _to_device(array: np.ndarray, device_index: int) -> torch.Tensor:
    """Host -> device copy ordered on the current stream, without blocking the host (for what
    one launch on that stream reads, such as host ids too many to pass inline)."""
    host = torch.from_numpy(np.ascontiguousarray(array)).pin_memory()
    return host.to(f"cuda:{device_index}", non_blocking=True)


class GroupLaunch:
    """Launch state of one group geometry on fixed cache addresses (built once, reused)."""

    def __init__(self, group: Any, plane_addresses: list[int], device: DeviceState) -> None:
        self.planes = group.planes  # kept so identity-keyed lookups stay valid
        self.kernel_group = group.kernel_group_idx
        # Fixed per kernel group (hence per launch state): packed once per variant.
        self.engine_group = getattr(group, "engine_group_idx", 0)
        self.blocks_per_chunk = group.blocks_per_chunk
        self.kept_per_chunk = group.kept_per_chunk
        self.runs = group.runs
        self.shape: GroupShape = group_shape(group)
        self.device = device
        self.num_planes = len(plane_addresses)
        if not 0 < self.num_planes <= 65535:
            raise UnsupportedConfig(
                f"planes: expected 1..65535 planes per kernel group, got {self.num_planes}"
            )
        # KvgPlane pairs: cache base, then the object offset of the plane's object rows.
        stride = self.shape.plane_obj_stride
        table = np.empty((self.num_planes, 2), dtype=np.int64)
        table[:, 0] = np.asarray(plane_addresses, dtype=np.uint64).view(np.int64)
        table[:, 1] = [object_plane(plane, p) * stride for p, plane in enumerate(group.planes)]
        self.plane_table = _to_table(table.reshape(-1), device.index)
        # The tables every launch of this state reads, and the streams whose launches may
        # read them as they are (device_tables.DeviceTable.readable_on did its part there).
        self.tables = (self.plane_table, device.err_table)
        self.ready: set[int] = set()
        self.base_unit = widest_unit([self.shape.unit, *plane_addresses])
        self.lock = threading.Lock()
        # (direction, vector, small, warp) -> packed parameters, launcher, kernel handle
        self._variants: dict[tuple[str, int, bool, bool], tuple[P.KvgParams, Launcher, int]] = {}
        # Small pages run the kvg_*_small kernels (geometry.SMALL_PAGE_BYTES, read once here).
        self.small = geometry.uses_small_pages(self.shape.page_bytes)
        # ... and contiguous pages of 16-byte vectors the warp kernels (WARP_MIN_PAGE_BYTES).
        self.warp = geometry.uses_warp_kernel(self.shape, self.small)
        self._vectors: dict[int, int] = {}  # object alignment -> vector width
        # (items, first item, warp kernel) -> ipc, tiles, work, ppc, segments per page
        self._ipc: dict[tuple[int, int, bool], tuple[int, int, int, int, int]] = {}
        self._steps: dict[tuple, tuple] = {}  # call shape -> what _step returns

    def _variant(self, direction: str, vector: int,
                 warp: bool = False) -> tuple[P.KvgParams, Launcher, int]:
        found = self._variants.get((direction, vector, self.small, warp))
        if found is None:
            shape = self.shape
            p = P.KvgParams()
            p.plane_table = self.plane_table.address
            p.err_record = self.device.err_table.address
            p.err_kernel_group = self.kernel_group
            p.err_engine_group = self.engine_group
            p.num_planes = self.num_planes
            p.blocks_per_chunk = self.blocks_per_chunk
            p.kept_per_chunk = self.kept_per_chunk
            p.block_stride = shape.block_stride
            p.num_blocks = shape.num_blocks
            p.region_offset = shape.region_offset
            p.row_bytes = shape.row_bytes
            p.page_obj_stride = shape.page_obj_stride
            p.num_runs = len(shape.runs)
            for i, run in enumerate(shape.runs):
                r = p.runs[i]
                r.cache_offset, r.cache_step = run.cache_offset, run.cache_step
                r.token_stride, r.obj_offset, r.obj_step = run.token_stride, run.obj_offset, run.obj_step
                r.units_per_piece = run.nbytes // vector
                r.units_per_token = run.count * r.units_per_piece
                r.page_units = shape.block_size * r.units_per_token
                r.shifts = P.pow2_shifts(r.page_units, r.units_per_token, r.units_per_piece)
            name = P.kernel_name(direction, vector, shape.contiguous, self.small, warp=warp)
            function = self.device.kernels.handle(name)
            # A NumPy window on the inline ids: one casting copy per call, no allocation.
            p.inline_view = np.ctypeslib.as_array(p.inline_ids)
            p.last_objects = p.last_step = None  # what launch() last wrote (see there)
            # Every page-copy entry point waits for the kernel before it (page_copy.cu).
            found = (p, Launcher(self.device.index, ctypes.addressof(p), programmatic=True),
                     function)
            self._variants[(direction, vector, self.small, warp)] = found
        return found

    def readable_on(self, stream: int) -> None:
        """Before the first launch on ``stream``: order its reads of the tables after their
        upload and keep them alive for it (see :mod:`device_tables`)."""
        for table in self.tables:
            table.readable_on(stream)
        if all(stream in table.ready for table in self.tables):
            self.ready.add(stream)

    def prepare(self, direction: str, objects: ObjectBinding) -> None:
        """Build the packed parameters (and load the kernel) a launch with ``objects`` uses."""
        with self.lock:
            vector = widest_unit([self.base_unit, objects.unit])
            self._variant(direction, vector, warp=self.warp and vector == 16)

    def _step(self, direction: str, group: Any, unit: int, max_ctas: int | None) -> tuple:
        """What a launch of this shape needs beside its ids, objects and skip: the packed
        parameters of its variant and its sizing (``num_items`` 0: nothing to move)."""
        num_chunks = group.num_chunks
        num_items = num_chunks * self.kept_per_chunk - group.first_item
        needed = num_chunks * self.blocks_per_chunk
        if num_items <= 0:
            return (None, None, None, None, needed, 0, 0, 0, 0, 0)
        if needed > _INT32_MAX:
            raise KVGroupsValueError(
                f"block_ids: expected at most {_INT32_MAX} ids per group, got {needed}")
        vector = self._vectors.get(unit)
        if vector is None:
            vector = self._vectors[unit] = widest_unit([self.base_unit, unit])
        warp = self.warp and vector == 16
        sizing = self._ipc.get((num_items, group.first_item, warp))
        if sizing is None:
            runs = len(self.shape.runs)
            fit = geometry.warp_sizing(self.shape.page_bytes, num_items, self.num_planes,
                                       warp_unroll(), P.WARPS_PER_CTA, group.first_item,
                                       self.kept_per_chunk) if warp else None
            if fit is not None:
                (segs, work), ipc, tiles, ppc = fit, 0, 0, 0
            elif self.small:
                ipc, ppc = geometry.small_page_sizing(self.shape.page_bytes, num_items,
                                                      self.num_planes, runs, self.device.num_sms)
                tiles = -(-num_items // ipc)
                work = tiles * -(-self.num_planes // ppc) * runs
            else:
                ipc = items_per_cta(self.shape.page_bytes, num_items, self.num_planes * runs,
                                    self.device.num_sms)
                ppc, tiles = 0, -(-num_items // ipc)
                work = tiles * self.num_planes * runs
            if fit is None:
                segs = 0
            sizing = self._ipc[(num_items, group.first_item, warp)] = (ipc, tiles, work, ppc,
                                                                    segs)
        ipc, tiles, work, ppc, segs = sizing
        grid = (work if max_ctas is None or max_ctas >= work else max_ctas, 1, 1)
        with self.lock:
            p, launcher, function = self._variant(direction, vector, warp=segs > 0)
        return (p, launcher, function, grid, needed, num_items, ipc, tiles, ppc, segs)

    def launch(self, direction: str, group: Any, objects: ObjectBinding, stream: int,
               block_ids: Any = None, *, skip: "DeviceSkip | None" = None,
               max_ctas: int | None = None) -> None:
        """Enqueue the group's copy on ``stream``.

        ``block_ids`` overrides ``group.block_ids``; ``skip`` is a load's device-side
        ``skip_first_n_tokens`` (then ``group.first_item`` is only the static lower bound);
        ``max_ctas`` caps the CTAs of the launch (they loop over the work). An out-of-range
        id is reported against the group's ``engine_group_idx``.
        """
        # Everything that follows from the call's shape is looked up once per shape: an
        # engine's layer-wise calls repeat a few shapes many times per step.
        num_chunks, first_item = group.num_chunks, group.first_item
        key = (direction, num_chunks, first_item, objects.unit, max_ctas)
        step = self._steps.get(key)
        if step is None:
            step = self._step(direction, group, objects.unit, max_ctas)
            if len(self._steps) >= 256:
                self._steps.clear()
            self._steps[key] = step
        p, launcher, function, grid, needed, num_items = step[:6]
        if not num_items:
            return
        if objects.num_chunks < num_chunks:
            raise KVGroupsValueError(
                f"objects: expected at least {num_chunks} chunks, got {objects.num_chunks}"
            )
        ids = group.block_ids if block_ids is None else block_ids
        if stream not in self.ready:
            self.readable_on(stream)
        if objects.table is not None:
            objects.table.readable_on(stream)
        with self.lock:
            keepalive = _bind_ids(p, ids, needed, self.shape.num_blocks, self.device.index)
            # Fields equal to the last launch's are not written again (ctypes writes are
            # the bulk of a launch's host time): the bindings are memoised by value, so the
            # same object buffer comes back as the same binding; every write to ``p`` goes
            # through here, under the lock.
            if p.last_objects is not objects:
                _write_objects(p, objects)
            if p.last_step is not step:
                _write_step(p, step, first_item)
            if skip is None:
                if p.skip_mode:
                    p.skip_mode = P.SKIP_NONE
            else:
                p.skip_mode, p.skip = skip.mode, skip.address
                p.skip_mul, p.skip_div, p.skip_max = skip.mul, skip.div, skip.limit
            launcher.launch(function, grid, P.THREADS, stream)
        del keepalive  # device copies of ids / tables are stream-ordered: safe to free now


def warp_unroll() -> int:
    """Vectors per lane of a warp-kernel segment: the cubin's ``KVG_WARP_UNROLL``."""
    return int(nvrtc.TUNING.get("KVG_WARP_UNROLL", P.WARP_UNROLL))


def _write_objects(p: P.KvgParams, objects: ObjectBinding) -> None:
    """Point ``p`` at ``objects`` (under the launch state's lock)."""
    p.obj_mode = mode = objects.mode
    if mode == P.OBJ_STRIDED:
        p.obj_base, p.obj_chunk_stride = objects.base, objects.stride
    elif mode == P.OBJ_INLINE:
        p.inline_objs[: len(objects.addresses)] = objects.addresses
    else:
        p.obj_table = objects.table.address
    p.last_objects = objects


def _write_step(p: P.KvgParams, step: tuple, first_item: int) -> None:
    """The item range and tiling of ``step`` (what :meth:`GroupLaunch._step` returned)."""
    p.first_item = first_item
    p.num_items, p.items_per_cta, p.num_tiles, p.planes_per_cta, segs = step[5:10]
    p.segs_per_page = segs
    p.segs_shift = segs.bit_length() - 1 if segs > 0 and segs & (segs - 1) == 0 else 0xFF
    p.last_step = step


@dataclass(frozen=True)
class DeviceSkip:
    """A load's ``skip_first_n_tokens`` held in device memory, for one kernel group: the
    kernel reads it at run time and skips ``s = skip * mul // div`` blocks the way
    ``kvgroups_core.transfer.plan.first_item_for_skip`` does; values outside ``[0, limit]`` are
    reported and clamped."""

    tensor: torch.Tensor
    mode: int
    address: int
    mul: int
    div: int
    limit: int


def device_skip(skip: torch.Tensor, mul: int, div: int, limit: int,
                device_index: int) -> DeviceSkip:
    """Check a device skip's static facts (one int32/int64 element on the caches' GPU)."""
    if not _on_device(skip, device_index):
        raise KVGroupsValueError(
            f"skip_first_n_tokens: expected a tensor on cuda:{device_index}, got {skip.device}"
        )
    if skip.dtype not in (torch.int32, torch.int64) or skip.numel() != 1:
        raise KVGroupsTypeError(
            f"skip_first_n_tokens: expected one int32 or int64 element, got {skip.dtype} of "
            f"shape {tuple(skip.shape)}"
        )
    mode = P.SKIP_DEVICE32 if skip.dtype == torch.int32 else P.SKIP_DEVICE64
    return DeviceSkip(skip, mode, skip.data_ptr(), mul, max(div, 1), limit)


def _on_device(t: torch.Tensor, device_index: int) -> bool:
    """Whether ``t`` lives on the launch's GPU (the CPU launch emulation replaces this)."""
    return t.is_cuda and t.get_device() == device_index


def object_plane(plane: Any, position: int) -> int:
    """The plane's index in its kernel group's object region (``PlaneRef.object_plane``; a
    whole-model plan's planes are in object order, so older plans fall back to position)."""
    found = getattr(plane, "object_plane", None)
    return position if found is None else found


def _bind_ids(p: P.KvgParams, ids: Any, needed: int, num_blocks: int, device_index: int):
    """Point ``p`` at the block ids: a CUDA tensor is read in place (graph capturable); host
    ids go inline into the parameters when they fit, else to the device."""
    if type(ids) is np.ndarray and ids.ndim == 1 and ids.dtype.kind in "iu" \
            and needed <= P.INLINE_IDS and needed <= ids.shape[0] and num_blocks <= _INT32_MAX:
        # Host ids that fit inline, the common case: one casting copy into the parameters
        # (out-of-int32 values wrap and are still range-checked by the kernel).
        p.inline_view[:needed] = ids[:needed]
        p.ids_mode = P.IDS_INLINE32
        return None
    if type(ids) is torch.Tensor and ids.is_cuda and ids.dtype in _ID_DTYPES \
            and ids.get_device() == device_index and ids.is_contiguous() \
            and ids.numel() >= needed:
        # Device ids read in place (the common case, checks ordered cheapest first).
        p.ids = ids.data_ptr()
        p.ids_mode = P.IDS_DEVICE32 if ids.dtype is torch.int32 else P.IDS_DEVICE64
        return ids
    if isinstance(ids, torch.Tensor) and (ids.is_cuda or _on_device(ids, device_index)):
        if not _on_device(ids, device_index):
            raise KVGroupsValueError(
                f"block_ids: expected a tensor on cuda:{device_index}, got {ids.device}"
            )
        if ids.dtype not in (torch.int32, torch.int64):
            raise KVGroupsTypeError(f"block_ids: expected int32 or int64, got {ids.dtype}")
        if ids.dim() != 1 or ids.numel() < needed:
            raise KVGroupsValueError(
                f"block_ids: expected a 1-D tensor of at least {needed} ids, got shape "
                f"{tuple(ids.shape)}"
            )
        ids = ids.contiguous()
        p.ids = ids.data_ptr()
        p.ids_mode = P.IDS_DEVICE32 if ids.dtype == torch.int32 else P.IDS_DEVICE64
        return ids
    host = ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    if host.ndim != 1 or host.dtype.kind not in "iu":
        raise KVGroupsTypeError(
            f"block_ids: expected a 1-D integer array, got {host.dtype} of shape {host.shape}"
        )
    if host.shape[0] < needed:
        raise KVGroupsValueError(f"block_ids: expected at least {needed} ids, got {host.shape[0]}")
    if needed <= P.INLINE_IDS and num_blocks <= _INT32_MAX:
        # Out-of-int32 values wrap to some other int32: still range-checked by the kernel.
        p.inline_view[:needed] = host[:needed].astype(np.int32, copy=False)
        p.ids_mode = P.IDS_INLINE32
        return None
    dev = _to_device(host[:needed].astype(np.int64, copy=False), device_index)
    p.ids = dev.data_ptr()
    p.ids_mode = P.IDS_DEVICE64
    return dev


_ID_DTYPES = (torch.int32, torch.int64)
_CACHE_SIZE = 1024  # layer-wise calls: one launch state per layer subset and group
_by_identity: OrderedDict[tuple, tuple[Any, Any, GroupLaunch]] = OrderedDict()
_by_value: OrderedDict[tuple, GroupLaunch] = OrderedDict()
_cache_lock = threading.Lock()


def _remember(cache: OrderedDict, key: tuple, value: Any) -> None:
    cache[key] = value
    if len(cache) > _CACHE_SIZE:
        cache.popitem(last=False)


def group_launch(group: Any, cache_addresses: tuple[int, ...], device: DeviceState) -> GroupLaunch:
    """The cached :class:`GroupLaunch` of ``group`` on these cache addresses.

    Looked up by the identity of the plan's ``planes`` / ``runs`` tuples first (free when the
    core reuses them across plans), then by value (hashes every plane).
    """
    scalars = (group.block_stride_bytes, group.num_blocks, group.row_bytes, group.block_size,
               group.slots, group.region_offset, group.unit_bytes, device.index)
    ikey = (id(group.planes), id(group.runs), scalars, cache_addresses)
    hit = _by_identity.get(ikey)
    if hit is not None and hit[0] is group.planes and hit[1] is group.runs:
        return hit[2]
    vkey = (group.planes, group.runs, scalars, cache_addresses)
    with _cache_lock:
        launch = _by_value.get(vkey)
        if launch is None:
            plane_addresses = []
            for i, plane in enumerate(group.planes):
                if not 0 <= plane.tensor_slot < len(cache_addresses):
                    raise KVGroupsIndexError(
                        f"planes[{i}].tensor_slot: expected 0..{len(cache_addresses) - 1}, got "
                        f"{plane.tensor_slot}"
                    )
                plane_addresses.append(cache_addresses[plane.tensor_slot] + plane.byte_offset)
            launch = GroupLaunch(group, plane_addresses, device)
            _remember(_by_value, vkey, launch)
        _remember(_by_identity, ikey, (group.planes, group.runs, launch))
    return launch


def cache_addresses_of(caches: Sequence[Any]) -> tuple[int, ...]:
    """Address of each backing tensor's first element (TensorDescs or tensors)."""
    if caches and isinstance(caches[0], torch.Tensor):
        return tuple([c.data_ptr() for c in caches])
    return tuple([c.data_ptr + c.byte_offset for c in caches])


class DeviceCaches:
    """Launch state of one bound set of CUDA caches, for the repeated calls of a prepared
    transfer (``kvgroups_core.transfer.api.PreparedTransfer``).

    :func:`run_plan` redoes per call what depends only on the caches: their addresses, the
    device state, the :class:`GroupLaunch` lookups (hashing every cache address). Here those
    are kept from bind time; a call checks its objects with a few tensor attribute reads (the
    derived :class:`ObjectBinding` is memoised by value, never by tensor identity, so a freed
    and reused buffer is simply re-checked) and launches.
    """

    _MAX_OBJECTS = 64
    _MAX_LAUNCHES = 4096

    def __init__(self, caches: Sequence[Any], device_index: int) -> None:
        self.index = device_index
        self.device = torch.device("cuda", device_index)
        self.state = device_state(device_index)
        self.addresses = cache_addresses_of(caches)
        self._launches: dict[int, tuple[Any, Any, GroupLaunch]] = {}
        self._objects: dict[tuple[int, int, int], ObjectBinding] = {}

    def bind_device_objects(self, plan: Any, objects: Any) -> list[ObjectBinding] | None:
        """One binding per object group when every object is a uint8 ``[num_chunks, nbytes]``
        tensor with contiguous rows on this GPU: the checks of the core's ``check_objects``
        and :meth:`TorchBackend.validate_objects` for that case. None for anything else
        (pinned host, per-chunk buffers, a wrong shape ...): the caller then runs the generic
        checks, which raise the precise errors, and the generic path."""
        sizes = plan.object_nbytes
        if type(objects) not in (list, tuple) or len(objects) != len(sizes):
            return None
        rows, device, memo = plan.num_chunks, self.device, self._objects
        out = []
        for t, nbytes in zip(objects, sizes):
            if type(t) is not torch.Tensor or t.dtype is not torch.uint8 or t.device != device \
                    or t.shape != (rows, nbytes):
                return None
            stride = t.stride()
            if stride[1] != 1 and nbytes > 1:
                return None
            key = (t.data_ptr(), stride[0], rows)
            binding = memo.get(key)
            if binding is None:
                unit = widest_unit(key[:2] if rows > 1 else key[:1])
                binding = ObjectBinding(P.OBJ_STRIDED, base=key[0], stride=key[1], unit=unit,
                                        num_chunks=rows)
                if len(memo) >= self._MAX_OBJECTS:
                    memo.clear()
                memo[key] = binding
            out.append(binding)
        return out

    def device_bindings(self, objects: Sequence[Any], rows: int) -> list[ObjectBinding] | None:
        """The bindings :meth:`bind_device_objects` made for these objects, looked up by
        address and row stride alone: for objects the core validated for this call's shape.
        None when one was never bound here (pinned host objects, or the memo was cleared)."""
        memo, out = self._objects, []
        for t in objects:
            binding = memo.get((t.data_ptr(), t.stride()[0], rows))
            if binding is None:
                return None
            out.append(binding)
        return out

    def launch_for(self, group: Any) -> GroupLaunch:
        """The group's :class:`GroupLaunch`, looked up by the identity of its ``planes`` and
        ``runs`` (shared by every plan of one binding)."""
        hit = self._launches.get(id(group.planes))
        if hit is None or hit[0] is not group.planes or hit[1] is not group.runs:
            hit = (group.planes, group.runs, group_launch(group, self.addresses, self.state))
            if len(self._launches) >= self._MAX_LAUNCHES:
                self._launches.clear()  # plans of many shapes (layer subsets, skips) came by
            self._launches[id(group.planes)] = hit
        return hit[2]

    def run(self, plan: Any, bindings: Any, block_ids: Sequence[Any] | None = None) -> None:
        """Enqueue every group of ``plan`` with objects already bound (``bindings[g]`` for
        object group ``g``); ``block_ids`` as for :func:`run_plan`."""
        groups = plan.groups
        if getattr(plan, "path", "kernel") != "kernel":
            engine = copy_engine.copy_groups(plan, self.index, block_ids)
            if engine:
                self._run_mixed(plan, bindings, block_ids, engine)
                return
        launches = [self.launch_for(group) for group in groups]  # may raise: none ran
        stream = current_stream(self.index)
        direction, max_ctas = plan.direction, getattr(plan, "max_ctas", None)
        if getattr(plan, "skip_tokens", None) is None and block_ids is None:  # the hot case, kept lean
            for launch, group in zip(launches, groups):
                launch.launch(direction, group, bindings[group.object_group_idx], stream,
                              max_ctas=max_ctas)
            return
        skip, max_ctas = plan_options(plan, self.index)
        for i, group in enumerate(groups):
            launches[i].launch(direction, group, bindings[group.object_group_idx], stream,
                               None if block_ids is None else block_ids[i],
                               skip=None if skip is None else group_skip(skip, group),
                               max_ctas=max_ctas)


    def _run_mixed(self, plan: Any, bindings: Any, block_ids: Sequence[Any] | None,
                   engine: frozenset[int]) -> None:
        """Groups ``engine`` on the copy engines (one batch), the others as kernels."""
        addresses = self.addresses
        copies = copy_engine.build_copies(
            plan, engine, lambda g: plane_addresses(g, addresses),
            bindings if isinstance(bindings, dict) else dict(enumerate(bindings)),
            block_ids=block_ids)
        rest = [i for i in range(len(plan.groups)) if i not in engine]
        launches = {i: self.launch_for(plan.groups[i]) for i in rest}
        stream = current_stream(self.index)
        copy_engine.enqueue(*copies, plan.direction, self.index, stream)
        skip, max_ctas = plan_options(plan, self.index)
        for i in rest:
            group = plan.groups[i]
            launches[i].launch(plan.direction, group, bindings[group.object_group_idx], stream,
                               None if block_ids is None else block_ids[i],
                               skip=None if skip is None else group_skip(skip, group),
                               max_ctas=max_ctas)


def plane_addresses(group: Any, cache_addresses: Sequence[int]) -> list[int]:
    """Address of block 0 of each plane of ``group``."""
    return [cache_addresses[p.tensor_slot] + p.byte_offset for p in group.planes]


class PlanRunner:
    """The launches of one plan on one :class:`DeviceCaches`, ready for the repeated calls of
    a validated signature (``kvgroups_core.transfer.fast.call_memo``): a call writes its ids (and, when they
    differ from the last launch's, the objects and the item range) into each group's packed
    parameters and launches. Built after a call of ``plan`` passed every check; later calls
    bring ids of the same dtype, shape, device and contiguity as ``sample_ids`` and objects the
    core validated for ``plan``'s direction and chunk count. Objects that are not device
    objects bound before (pinned host memory) go to ``fallback`` (the generic runner)."""

    _MAX_OBJECTS = 64  # object signatures kept per runner (an engine cycles a few buffers)

    def __init__(self, fast: DeviceCaches, plan: Any, sample_ids: Any, fallback: Any) -> None:
        self.fast = fast
        self.plan = plan
        self.rows = plan.num_chunks
        self.index = fast.index
        self.fallback = fallback
        # Contiguous int32/int64 tensors on the GPU are read in place: only their address
        # changes between calls. Anything else (host ids) goes through _bind_ids.
        self.in_place = isinstance(sample_ids, torch.Tensor) and sample_ids.dtype in _ID_DTYPES \
            and _on_device(sample_ids, self.index) and sample_ids.is_contiguous()
        self.ids_mode = P.IDS_DEVICE32 if getattr(sample_ids, "dtype", None) is torch.int32 \
            else P.IDS_DEVICE64
        self._steps: dict[Any, list[tuple]] = {}  # object vector units -> launch list
        # The core's validated objects signature -> (bindings, launch list): a hit on the
        # signature of the last call's objects needs neither read again.
        self._by_objects: dict[Any, tuple[list[ObjectBinding], list[tuple]]] = {}

    def _bind(self, objects: Sequence[Any]) -> tuple[list, list[tuple]] | None:
        """The device bindings of ``objects`` and the launch list for their alignment; None
        when they are not device objects bound before (pinned host memory)."""
        bindings = self.fast.device_bindings(objects, self.rows)
        if bindings is None:
            return None
        units = bindings[0].unit if len(bindings) == 1 else tuple([b.unit for b in bindings])
        steps = self._steps.get(units)
        if steps is None:
            steps = self._steps[units] = self._launch_list(bindings)
        return bindings, steps

    def _launch_list(self, bindings: list[ObjectBinding]) -> list[tuple]:
        plan, fast = self.plan, self.fast
        out = []
        for group in plan.groups:
            launch = fast.launch_for(group)
            unit = bindings[group.object_group_idx].unit
            key = (plan.direction, group.num_chunks, group.first_item, unit, plan.max_ctas)
            step = launch._steps.get(key)
            if step is None:
                step = launch._steps[key] = launch._step(plan.direction, group, unit,
                                                         plan.max_ctas)
            p, launcher, function, grid, needed, num_items = step[:6]
            if num_items:
                out.append((launch, p, launcher, function, grid, step, group.first_item,
                            group.object_group_idx, needed, launch.shape.num_blocks))
        return out

    def __call__(self, ids: Any, objects: Sequence[Any], objects_key: Any = None) -> tuple:
        """Launch with ``ids`` on ``objects`` (the runner protocol of
        ``kvgroups_core.transfer.backend.BoundCaches.runner``: ``(None, objects)``, nothing replaced).
        ``objects_key``: the core's validated signature of ``objects`` (address, dtype, shape
        and strides of each), so what was bound for it before is bound again."""
        found = self._by_objects.get(objects_key) if objects_key is not None else None
        if found is None:
            found = self._bind(objects)
            if found is None:
                return self.fallback(ids, objects)
            if objects_key is not None:
                if len(self._by_objects) >= self._MAX_OBJECTS:
                    self._by_objects.clear()
                self._by_objects[objects_key] = found
        bindings, steps = found
        stream = current_stream(self.index)
        if self.in_place:
            address, mode = ids.data_ptr(), self.ids_mode
        for launch, p, launcher, function, grid, step, first_item, og, needed, nb in steps:
            objs = bindings[og]
            if stream not in launch.ready:
                launch.readable_on(stream)
            with launch.lock:
                if self.in_place:
                    p.ids = address
                    p.ids_mode = mode
                    keepalive = None
                else:
                    keepalive = _bind_ids(p, ids, needed, nb, self.index)
                if p.last_objects is not objs:
                    _write_objects(p, objs)
                if p.last_step is not step:
                    _write_step(p, step, first_item)
                if p.skip_mode:
                    p.skip_mode = P.SKIP_NONE
                launcher.launch(function, grid, P.THREADS, stream)
            del keepalive  # a device copy of host ids is stream-ordered: safe to free now
        return None, list(objects)


def plan_options(plan: Any, device_index: int) -> tuple[DeviceSkip | None, int | None]:
    """The launch options a plan carries: its device skip (checked once for every group)
    and its CTA cap."""
    skip = getattr(plan, "skip_tokens", None)
    if skip is not None:
        skip = device_skip(skip, 1, 1, 0, device_index)
    max_ctas = getattr(plan, "max_ctas", None)
    return skip, max_ctas


def group_skip(skip: DeviceSkip, group: Any) -> DeviceSkip:
    """``skip`` with the token-to-block rule and the bound of ``group``."""
    tpb = getattr(group, "tokens_per_block", 0) or group.block_size
    covered = group.num_chunks * group.blocks_per_chunk * tpb
    return DeviceSkip(skip.tensor, skip.mode, skip.address, 1, tpb, covered)


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device_index: int) -> int:
    """Raw handle of PyTorch's current stream on ``device_index``."""
    if _raw_stream is not None:  # a plain int, without building a Stream object
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def run_plan(plan: Any, caches: Sequence[Any], objects: Sequence[Any], device_index: int,
             *, pinned: str = "direct", block_ids: Sequence[Any] | None = None,
             bindings: dict[int, ObjectBinding] | None = None) -> None:
    """Enqueue every group of ``plan`` on the current stream of ``device_index``.

    Parameters
    ----------
    plan : TransferPlan
        Validated by the core (geometry, ids, object sizes).
    caches : sequence of TensorDesc or torch.Tensor
        Backing tensors in ``plan.tensor_specs`` order, on ``cuda:device_index``.
    objects : sequence
        One entry per object group: a ``[num_chunks, nbytes]`` uint8 tensor or a list of
        per-chunk 1-D uint8 tensors, on the device or in pinned host memory.
    pinned : {"direct", "staged"}
        How pinned host objects are reached: read/written by the kernel through UVA, or through
        a device staging buffer and one bulk copy per object.
    block_ids : sequence, optional
        One block-id array per group of ``plan`` replacing ``group.block_ids`` (CUDA int32 /
        int64 tensors are read in place by the kernel: nothing to copy, graph capturable).
    bindings : dict, optional
        Object bindings prepared ahead (by :class:`~kvgroups_torch.bound_plan.BoundPlan`),
        keyed by object group.
    """
    if pinned not in ("direct", "staged"):
        raise KVGroupsValueError(f"pinned: expected 'direct' or 'staged', got {pinned!r}")
    state = device_state(device_index)
    stream = current_stream(device_index)
    addresses = cache_addresses_of(caches)
    direction = plan.direction
    bindings = {} if bindings is None or pinned == "staged" else dict(bindings)
    copies_after: list[tuple[torch.Tensor, torch.Tensor]] = []
    # Staging buffers live until every launch is enqueued: one freed earlier goes back to the
    # caching allocator, which hands it to the next object group's staging at once (same size,
    # same stream), whose copy then overwrites it before this group's kernel reads it.
    staged: list[Any] = []

    def on_host(g: int) -> bool:
        return copy_engine.object_on_host(objects[g])

    # The copy engines reach pinned objects themselves: their object groups are not staged.
    engine = copy_engine.copy_groups(plan, device_index, block_ids, on_host)
    direct = {plan.groups[i].object_group_idx for i in engine}
    # Bind (and check) every object before the first launch: a rejected call moves nothing.
    for group in plan.groups:
        g = group.object_group_idx
        if g not in bindings:
            entry = objects[g]
            if pinned == "staged" and g not in direct and not (
                    isinstance(entry, torch.Tensor) and entry.is_cuda):
                spans = _region_spans(plan, g)
                entry = _stage(entry, direction, device_index, spans, copies_after)
                staged.append(entry)
            bindings[g] = bind_objects(entry, device_index, f"objects[{g}]")
    skip, max_ctas = plan_options(plan, device_index)
    copies = copy_engine.build_copies(plan, engine, lambda g: plane_addresses(g, addresses),
                                      bindings, on_host, block_ids) if engine else None
    launches = [None if i in engine else group_launch(group, addresses, state)
                for i, group in enumerate(plan.groups)]
    if copies is not None:
        copy_engine.enqueue(*copies, direction, device_index, stream)
    for i, group in enumerate(plan.groups):
        if i in engine:
            continue
        ids = None if block_ids is None else block_ids[i]
        launches[i].launch(direction, group, bindings[group.object_group_idx], stream, ids,
                           skip=None if skip is None else group_skip(skip, group),
                           max_ctas=max_ctas)
    for host, staging in copies_after:
        host.copy_(staging, non_blocking=True)


def _region_spans(plan: Any, object_group: int) -> list[tuple[int, int]]:
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


def _stage(entry: Any, direction: str, device_index: int, spans: list[tuple[int, int]],
           copies_after: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """Device stand-ins for pinned host objects: the touched regions are copied in before a
    load and out after a store, each copy one contiguous pinned range (asynchronous, and
    capturable in a CUDA graph)."""
    if isinstance(entry, (list, tuple)):
        return [_stage(t, direction, device_index, spans, copies_after) for t in entry]
    if not isinstance(entry, torch.Tensor) or entry.is_cuda:
        return entry
    check_object_tensor(entry, device_index, "objects")  # pinned, uint8: before any copy
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
