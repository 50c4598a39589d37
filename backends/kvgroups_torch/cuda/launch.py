"""Launch state of one group transfer on fixed cache addresses, and one launch of it.

One launch per :class:`~kvgroups_core.transfer.plan.GroupTransfer`. What depends only on the group's
geometry and the caches' addresses (the plane pointer table on the device, the packed
``KvgParams`` per vector width, the kernel handle) is built once and memoised; a call then only
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
from kvgroups_cuda import geometry
from kvgroups_cuda import params as P
from kvgroups_cuda.geometry import GroupShape, group_shape, items_per_cta

from kvgroups_core.errors import (
    KVGroupsIndexError,
    KVGroupsTypeError,
    KVGroupsValueError,
    UnsupportedConfigError,
)
from kvgroups_core.formats.segments import widest_unit

from .device import DeviceState, forget_devices
from .driver import Launcher
from .objects import ObjectAddresses, object_plane, to_device, to_table

_INT32_MAX = 2**31 - 1


def reset_caches() -> None:
    """Forget loaded kernels and memoised launch state (tests that change
    ``geometry.WARP_MIN_PAGE_BYTES`` use this)."""
    forget_devices()
    with _memo_lock:
        _by_identity.clear()
        _by_value.clear()


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
            raise UnsupportedConfigError(
                f"planes: expected 1..65535 planes per kernel group, got {self.num_planes}"
            )
        # KvgPlane pairs: cache base, then the object offset of the plane's object rows.
        stride = self.shape.plane_obj_stride
        table = np.empty((self.num_planes, 2), dtype=np.int64)
        table[:, 0] = np.asarray(plane_addresses, dtype=np.uint64).view(np.int64)
        table[:, 1] = [object_plane(plane, p) * stride for p, plane in enumerate(group.planes)]
        self.plane_table = to_table(table.reshape(-1), device.index)
        # The tables every launch of this state reads, and the streams whose launches may
        # read them as they are (device_tables.DeviceTable.readable_on did its part there).
        self.tables = (self.plane_table, device.err_table)
        self.ready: set[int] = set()
        self.base_unit = widest_unit([self.shape.unit, *plane_addresses])
        self.lock = threading.Lock()
        # (direction, vector, warp) -> packed parameters, launcher, kernel handle
        self._variants: dict[tuple[str, int, bool], tuple[P.KvgParams, Launcher, int]] = {}
        # Contiguous pages of 16-byte vectors run the warp kernels (WARP_MIN_PAGE_BYTES).
        self.warp = geometry.uses_warp_kernel(self.shape)
        self._vectors: dict[int, int] = {}  # object alignment -> vector width
        # (items, first item, warp kernel) -> ipc, tiles, work, segments per page
        self._ipc: dict[tuple[int, int, bool], tuple[int, int, int, int]] = {}
        self._steps: dict[tuple, tuple] = {}  # call shape -> what step() returns

    def _variant(
        self, direction: str, vector: int, warp: bool = False
    ) -> tuple[P.KvgParams, Launcher, int]:
        found = self._variants.get((direction, vector, warp))
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
                r.token_stride, r.obj_offset, r.obj_step = (
                    run.token_stride,
                    run.obj_offset,
                    run.obj_step,
                )
                r.units_per_piece = run.nbytes // vector
                r.units_per_token = run.count * r.units_per_piece
                r.page_units = shape.block_size * r.units_per_token
                r.shifts = P.pow2_shifts(r.page_units, r.units_per_token, r.units_per_piece)
            name = P.kernel_name(direction, vector, shape.contiguous, warp=warp)
            function = self.device.kernels.handle(name)
            # A NumPy window on the inline ids: one casting copy per call, no allocation.
            p.inline_view = np.ctypeslib.as_array(p.inline_ids)
            p.last_objects = p.last_step = None  # what launch() last wrote (see there)
            # Every page-copy entry point waits for the kernel before it (page_copy.cu).
            found = (
                p,
                Launcher(self.device.index, ctypes.addressof(p), programmatic=True),
                function,
            )
            self._variants[(direction, vector, warp)] = found
        return found

    def readable_on(self, stream: int) -> None:
        """Before the first launch on ``stream``: order its reads of the tables after their
        upload and keep them alive for it (see :mod:`device_tables`)."""
        for table in self.tables:
            table.readable_on(stream)
        if all(stream in table.ready for table in self.tables):
            self.ready.add(stream)

    def prepare(self, direction: str, objects: ObjectAddresses) -> None:
        """Build the packed parameters (and load the kernel) a launch with ``objects`` uses."""
        with self.lock:
            vector = widest_unit([self.base_unit, objects.unit])
            self._variant(direction, vector, warp=self.warp and vector == 16)

    def step(self, direction: str, group: Any, unit: int, max_ctas: int | None) -> tuple:
        """What a launch of ``group`` with objects of vector ``unit`` needs beside its ids,
        objects and skip: ``(params, launcher, kernel, grid, ids needed, items, ...)`` (items
        0: nothing to move; the rest is :func:`write_step`'s). Computed once per call shape
        (an engine's layer-wise calls repeat a few shapes many times per step)."""
        key = (direction, group.num_chunks, group.first_item, unit, max_ctas)
        found = self._steps.get(key)
        if found is None:
            found = self._step(direction, group, unit, max_ctas)
            if len(self._steps) >= 256:
                self._steps.clear()
            self._steps[key] = found
        return found

    def _step(self, direction: str, group: Any, unit: int, max_ctas: int | None) -> tuple:
        """What a launch of this shape needs beside its ids, objects and skip: the packed
        parameters of its variant and its sizing (``num_items`` 0: nothing to move)."""
        num_chunks = group.num_chunks
        num_items = num_chunks * self.kept_per_chunk - group.first_item
        needed = num_chunks * self.blocks_per_chunk
        if num_items <= 0:
            return (None, None, None, None, needed, 0, 0, 0, 0)
        if needed > _INT32_MAX:
            raise KVGroupsValueError(
                f"block_ids: expected at most {_INT32_MAX} ids per group, got {needed}"
            )
        vector = self._vectors.get(unit)
        if vector is None:
            vector = self._vectors[unit] = widest_unit([self.base_unit, unit])
        warp = self.warp and vector == 16
        sizing = self._ipc.get((num_items, group.first_item, warp))
        if sizing is None:
            runs = len(self.shape.runs)
            fit = (
                geometry.warp_sizing(
                    self.shape.page_bytes,
                    num_items,
                    self.num_planes,
                    P.WARP_UNROLL,
                    P.WARPS_PER_CTA,
                    group.first_item,
                    self.kept_per_chunk,
                )
                if warp
                else None
            )
            if fit is not None:
                (segs, work), ipc, tiles = fit, 0, 0
            else:
                ipc = items_per_cta(
                    self.shape.page_bytes, num_items, self.num_planes * runs, self.device.num_sms
                )
                segs, tiles = 0, -(-num_items // ipc)
                work = tiles * self.num_planes * runs
            sizing = self._ipc[(num_items, group.first_item, warp)] = (ipc, tiles, work, segs)
        ipc, tiles, work, segs = sizing
        grid = (work if max_ctas is None or max_ctas >= work else max_ctas, 1, 1)
        with self.lock:
            p, launcher, function = self._variant(direction, vector, warp=segs > 0)
        return (p, launcher, function, grid, needed, num_items, ipc, tiles, segs)

    def launch(
        self,
        direction: str,
        group: Any,
        objects: ObjectAddresses,
        stream: int,
        block_ids: Any = None,
        *,
        skip: "DeviceSkip | None" = None,
        max_ctas: int | None = None,
    ) -> None:
        """Enqueue the group's copy on ``stream``.

        ``block_ids`` overrides ``group.block_ids``; ``skip`` is a load's device-side
        ``skip_first_n_tokens`` (then ``group.first_item`` is only the static lower bound);
        ``max_ctas`` caps the CTAs of the launch (they loop over the work). An out-of-range
        id is reported against the group's ``engine_group_idx``.
        """
        num_chunks, first_item = group.num_chunks, group.first_item
        step = self._steps.get((direction, num_chunks, first_item, objects.unit, max_ctas))
        if step is None:
            step = self.step(direction, group, objects.unit, max_ctas)
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
            keepalive = write_ids(p, ids, needed, self.shape.num_blocks, self.device.index)
            # Fields equal to the last launch's are not written again (ctypes writes are
            # the bulk of a launch's host time): the object addresses are memoised by value, so the
            # same object buffer comes back as the same ObjectAddresses; every write to ``p`` goes
            # through here, under the lock.
            if p.last_objects is not objects:
                write_objects(p, objects)
            if p.last_step is not step:
                write_step(p, step, first_item)
            if skip is None:
                if p.skip_mode:
                    p.skip_mode = P.SKIP_NONE
            else:
                p.skip_mode, p.skip = skip.mode, skip.address
                p.skip_mul, p.skip_div, p.skip_max = skip.mul, skip.div, skip.limit
            launcher.launch(function, grid, P.THREADS, stream)
        del keepalive  # device copies of ids / tables are stream-ordered: safe to free now


def write_objects(p: P.KvgParams, objects: ObjectAddresses) -> None:
    """Point ``p`` at ``objects`` (under the launch state's lock)."""
    p.obj_mode = mode = objects.mode
    if mode == P.OBJ_STRIDED:
        p.obj_base, p.obj_chunk_stride = objects.base, objects.stride
    elif mode == P.OBJ_INLINE:
        p.inline_objs[: len(objects.chunk_addresses)] = objects.chunk_addresses
    else:
        p.obj_table = objects.table.address
    p.last_objects = objects


def write_step(p: P.KvgParams, step: tuple, first_item: int) -> None:
    """The item range and tiling of ``step`` (what :meth:`GroupLaunch.step` returned)."""
    p.first_item = first_item
    p.num_items, p.items_per_cta, p.num_tiles, segs = step[5:9]
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


def device_skip(
    skip: torch.Tensor, mul: int, div: int, limit: int, device_index: int
) -> DeviceSkip:
    """Check a device skip's static facts (one int32/int64 element on the caches' GPU)."""
    if not on_device(skip, device_index):
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


def on_device(t: torch.Tensor, device_index: int) -> bool:
    """Whether ``t`` lives on the launch's GPU (the CPU launch emulation replaces this)."""
    return t.is_cuda and t.get_device() == device_index


def write_ids(p: P.KvgParams, ids: Any, needed: int, num_blocks: int, device_index: int):
    """Point ``p`` at the block ids: a CUDA tensor is read in place (graph capturable); host
    ids go inline into the parameters when they fit, else to the device."""
    if (
        type(ids) is np.ndarray
        and ids.ndim == 1
        and ids.dtype.kind in "iu"
        and needed <= P.INLINE_IDS
        and needed <= ids.shape[0]
        and num_blocks <= _INT32_MAX
    ):
        # Host ids that fit inline, the common case: one casting copy into the parameters
        # (out-of-int32 values wrap and are still range-checked by the kernel).
        p.inline_view[:needed] = ids[:needed]
        p.ids_mode = P.IDS_INLINE32
        return None
    if (
        type(ids) is torch.Tensor
        and ids.is_cuda
        and ids.dtype in ID_DTYPES
        and ids.get_device() == device_index
        and ids.is_contiguous()
        and ids.numel() >= needed
    ):
        # Device ids read in place (the common case, checks ordered cheapest first).
        p.ids = ids.data_ptr()
        p.ids_mode = P.IDS_DEVICE32 if ids.dtype is torch.int32 else P.IDS_DEVICE64
        return ids
    if isinstance(ids, torch.Tensor) and (ids.is_cuda or on_device(ids, device_index)):
        if not on_device(ids, device_index):
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
    dev = to_device(host[:needed].astype(np.int64, copy=False), device_index)
    p.ids = dev.data_ptr()
    p.ids_mode = P.IDS_DEVICE64
    return dev


ID_DTYPES = (torch.int32, torch.int64)
_MEMO_SIZE = 1024  # layer-wise calls: one launch state per layer subset and group
_by_identity: OrderedDict[tuple, tuple[Any, Any, GroupLaunch]] = OrderedDict()
_by_value: OrderedDict[tuple, GroupLaunch] = OrderedDict()
_memo_lock = threading.Lock()


def _remember(memo: OrderedDict, key: tuple, value: Any) -> None:
    memo[key] = value
    if len(memo) > _MEMO_SIZE:
        memo.popitem(last=False)


def group_launch(group: Any, cache_addresses: tuple[int, ...], device: DeviceState) -> GroupLaunch:
    """The memoised :class:`GroupLaunch` of ``group`` on these cache addresses.

    Looked up by the identity of the plan's ``planes`` / ``runs`` tuples first (free when the
    core reuses them across plans), then by value (hashes every plane).
    """
    scalars = (
        group.block_stride_bytes,
        group.num_blocks,
        group.row_bytes,
        group.block_size,
        group.slots,
        group.region_offset,
        group.unit_bytes,
        device.index,
    )
    ikey = (id(group.planes), id(group.runs), scalars, cache_addresses)
    hit = _by_identity.get(ikey)
    if hit is not None and hit[0] is group.planes and hit[1] is group.runs:
        return hit[2]
    vkey = (group.planes, group.runs, scalars, cache_addresses)
    with _memo_lock:
        launch = _by_value.get(vkey)
        if launch is None:
            plane_addresses = []
            for i, plane in enumerate(group.planes):
                if not 0 <= plane.tensor_index < len(cache_addresses):
                    raise KVGroupsIndexError(
                        f"planes[{i}].tensor_index: expected 0..{len(cache_addresses) - 1}, got "
                        f"{plane.tensor_index}"
                    )
                plane_addresses.append(cache_addresses[plane.tensor_index] + plane.byte_offset)
            launch = GroupLaunch(group, plane_addresses, device)
            _remember(_by_value, vkey, launch)
        _remember(_by_identity, ikey, (group.planes, group.runs, launch))
    return launch


def cache_addresses_of(caches: Sequence[Any]) -> tuple[int, ...]:
    """Address of each backing tensor's first element (TensorDescs or tensors)."""
    if caches and isinstance(caches[0], torch.Tensor):
        return tuple([c.data_ptr() for c in caches])
    return tuple([c.data_ptr + c.byte_offset for c in caches])


def plane_addresses(group: Any, cache_addresses: Sequence[int]) -> list[int]:
    """Address of block 0 of each plane of ``group``."""
    return [cache_addresses[p.tensor_index] + p.byte_offset for p in group.planes]


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
