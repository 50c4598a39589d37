"""The run loops: a plan's groups enqueued on the current stream.

Every group of a :class:`~kvgroups_core.transfer.plan.TransferPlan`, either from scratch
(:func:`execute_checked_plan`, or :func:`execute_plan` for a plan that bypassed the core's calls)
or on the bound caches of a prepared transfer (:class:`DeviceCaches`), the
copy-engine groups batched beside the kernels.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from kvgroups_cuda import params as P

from kvgroups_core.errors import KVGroupsValueError
from kvgroups_core.formats.segments import widest_unit
from kvgroups_core.transfer.objects import check_objects
from kvgroups_torch.copy_engine import batch as copy_engine
from kvgroups_torch.describe import shape_of

from .device import current_stream, device_state
from .launch import (
    GroupLaunch,
    cache_addresses_of,
    group_launch,
    group_skip,
    plan_options,
    plane_addresses,
)
from .objects import ObjectAddresses, object_addresses, region_spans, stage


class DeviceCaches:
    """Launch state of one bound set of CUDA caches, for the repeated calls of a prepared
    transfer (``kvgroups_core.transfer.api.PreparedTransfer``).

    :func:`execute_checked_plan` redoes per call what depends only on the caches: their addresses,
    the
    device state, the :class:`GroupLaunch` lookups (hashing every cache address). Here those
    are kept from bind time; a call checks its objects with a few tensor attribute reads (the
    derived :class:`ObjectAddresses` is memoised by value, never by tensor identity, so a freed
    and reused buffer is simply re-checked) and launches.
    """

    _MAX_OBJECTS = 64
    _MAX_LAUNCHES = 4096

    def __init__(self, caches: Sequence[Any], device_index: int) -> None:
        self.index = device_index
        self.device = torch.device("cuda", device_index)
        self.state = device_state(device_index)
        self.cache_addresses = cache_addresses_of(caches)
        self._launches: dict[int, tuple[Any, Any, GroupLaunch]] = {}
        self._objects: dict[tuple[int, int, int], ObjectAddresses] = {}

    def device_object_addresses(self, plan: Any, objects: Any) -> list[ObjectAddresses] | None:
        """One ObjectAddresses per object group when every object is a uint8
        ``[num_chunks, nbytes]`` tensor with contiguous rows on this GPU (the hot case,
        recognised rather than checked: it is what the core's ``check_objects`` and
        :meth:`TorchBackend.validate_objects` accept there). None for anything else (pinned
        host, per-chunk buffers, a wrong shape ...): the caller then runs those checks, which
        raise the precise errors, and the generic path."""
        sizes = plan.object_nbytes
        if type(objects) not in (list, tuple) or len(objects) != len(sizes):
            return None
        rows, device, memo = plan.num_chunks, self.device, self._objects
        out = []
        for t, nbytes in zip(objects, sizes):
            if (
                type(t) is not torch.Tensor
                or t.dtype is not torch.uint8
                or t.device != device
                or t.shape != (rows, nbytes)
            ):
                return None
            stride = t.stride()
            if stride[1] != 1 and nbytes > 1:
                return None
            key = (t.data_ptr(), stride[0], rows)
            found = memo.get(key)
            if found is None:
                unit = widest_unit(key[:2] if rows > 1 else key[:1])
                found = ObjectAddresses(
                    P.OBJ_STRIDED, base=key[0], stride=key[1], unit=unit, num_chunks=rows
                )
                if len(memo) >= self._MAX_OBJECTS:
                    memo.clear()
                memo[key] = found
            out.append(found)
        return out

    def known_object_addresses(
        self, objects: Sequence[Any], rows: int
    ) -> list[ObjectAddresses] | None:
        """The ObjectAddresses :meth:`device_object_addresses` made for these objects, looked up by
        address and row stride alone: for objects the core validated for this call's shape.
        None when one was never seen here (pinned host objects, or the memo was cleared)."""
        memo, out = self._objects, []
        for t in objects:
            found = memo.get((t.data_ptr(), t.stride()[0], rows))
            if found is None:
                return None
            out.append(found)
        return out

    def launch_for(self, group: Any) -> GroupLaunch:
        """The group's :class:`GroupLaunch`, looked up by the identity of its ``planes`` and
        ``runs`` (shared by every plan of one binding)."""
        hit = self._launches.get(id(group.planes))
        if hit is None or hit[0] is not group.planes or hit[1] is not group.runs:
            hit = (group.planes, group.runs, group_launch(group, self.cache_addresses, self.state))
            if len(self._launches) >= self._MAX_LAUNCHES:
                self._launches.clear()  # plans of many shapes (layer subsets, skips) came by
            self._launches[id(group.planes)] = hit
        return hit[2]

    def execute(self, plan: Any, addresses: Any, block_ids: Sequence[Any] | None = None) -> None:
        """Enqueue every group of ``plan`` with objects already addressed (``addresses[g]`` for
        object group ``g``); ``block_ids`` as for :func:`execute_checked_plan`."""
        groups = plan.groups
        if getattr(plan, "path", "kernel") != "kernel":
            copy_engine_groups = copy_engine.copy_groups(plan, self.index, block_ids)
            if copy_engine_groups:
                self._execute_mixed(plan, addresses, block_ids, copy_engine_groups)
                return
        launches = [self.launch_for(group) for group in groups]  # may raise: none ran
        stream = current_stream(self.index)
        direction, max_ctas = plan.direction, getattr(plan, "max_ctas", None)
        if (
            getattr(plan, "skip_tokens", None) is None and block_ids is None
        ):  # the hot case, kept lean
            for launch, group in zip(launches, groups):
                launch.launch(
                    direction, group, addresses[group.object_group_idx], stream, max_ctas=max_ctas
                )
            return
        skip, max_ctas = plan_options(plan, self.index)
        for i, group in enumerate(groups):
            launches[i].launch(
                direction,
                group,
                addresses[group.object_group_idx],
                stream,
                None if block_ids is None else block_ids[i],
                skip=None if skip is None else group_skip(skip, group),
                max_ctas=max_ctas,
            )

    def _execute_mixed(
        self,
        plan: Any,
        addresses: Any,
        block_ids: Sequence[Any] | None,
        copy_engine_groups: frozenset[int],
    ) -> None:
        """Groups ``copy_engine_groups`` on the copy engines (one batch), the others as kernels."""
        cache_addresses = self.cache_addresses
        copies = copy_engine.build_copies(
            plan,
            copy_engine_groups,
            lambda g: plane_addresses(g, cache_addresses),
            addresses if isinstance(addresses, dict) else dict(enumerate(addresses)),
            block_ids=block_ids,
        )
        rest = [i for i in range(len(plan.groups)) if i not in copy_engine_groups]
        launches = {i: self.launch_for(plan.groups[i]) for i in rest}
        stream = current_stream(self.index)
        copy_engine.enqueue(*copies, plan.direction, self.index, stream)
        skip, max_ctas = plan_options(plan, self.index)
        for i in rest:
            group = plan.groups[i]
            launches[i].launch(
                plan.direction,
                group,
                addresses[group.object_group_idx],
                stream,
                None if block_ids is None else block_ids[i],
                skip=None if skip is None else group_skip(skip, group),
                max_ctas=max_ctas,
            )


def execute_plan(
    plan: Any,
    caches: Sequence[Any],
    objects: Sequence[Any],
    device_index: int,
    *,
    pinned: str = "direct",
    block_ids: Sequence[Any] | None = None,
    addresses: dict[int, ObjectAddresses] | None = None,
) -> None:
    """Enqueue every group of ``plan`` on the current stream of ``device_index``: the entry
    point for a plan that did not come through the core's calls (:class:`BoundPlan`, the
    compiled ops), so the objects are checked by the core's object rule first; then
    :func:`execute_checked_plan` (whose parameters these are)."""
    check_objects(plan, objects, shape_of)
    execute_checked_plan(
        plan, caches, objects, device_index, pinned=pinned, block_ids=block_ids, addresses=addresses
    )


def execute_checked_plan(
    plan: Any,
    caches: Sequence[Any],
    objects: Sequence[Any],
    device_index: int,
    *,
    pinned: str = "direct",
    block_ids: Sequence[Any] | None = None,
    addresses: dict[int, ObjectAddresses] | None = None,
) -> None:
    """Enqueue every group of ``plan`` on the current stream of ``device_index``, its objects
    checked by the core (``TorchBackend.execute``) or by :func:`execute_plan`.

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
    addresses : dict, optional
        Object addresses prepared ahead (by :class:`~kvgroups_torch.bound_plan.BoundPlan`),
        keyed by object group.
    """
    if pinned not in ("direct", "staged"):
        raise KVGroupsValueError(f"pinned: expected 'direct' or 'staged', got {pinned!r}")
    state = device_state(device_index)
    stream = current_stream(device_index)
    cache_addresses = cache_addresses_of(caches)
    direction = plan.direction
    addresses = {} if addresses is None or pinned == "staged" else dict(addresses)
    copies_after: list[tuple[torch.Tensor, torch.Tensor]] = []
    # Staging buffers live until every launch is enqueued: one freed earlier goes back to the
    # caching allocator, which hands it to the next object group's staging at once (same size,
    # same stream), whose copy then overwrites it before this group's kernel reads it.
    staged: list[Any] = []

    def on_host(g: int) -> bool:
        return copy_engine.object_on_host(objects[g])

    # The copy engines reach pinned objects themselves: their object groups are not staged.
    copy_engine_groups = copy_engine.copy_groups(plan, device_index, block_ids, on_host)
    direct = {plan.groups[i].object_group_idx for i in copy_engine_groups}
    # Address (and check) every object before the first launch: a rejected call moves nothing.
    for group in plan.groups:
        g = group.object_group_idx
        if g not in addresses:
            entry = objects[g]
            if (
                pinned == "staged"
                and g not in direct
                and not (isinstance(entry, torch.Tensor) and entry.is_cuda)
            ):
                spans = region_spans(plan, g)
                entry = stage(entry, direction, device_index, spans, copies_after)
                staged.append(entry)
            addresses[g] = object_addresses(entry, device_index, f"objects[{g}]")
    skip, max_ctas = plan_options(plan, device_index)
    copies = (
        copy_engine.build_copies(
            plan,
            copy_engine_groups,
            lambda g: plane_addresses(g, cache_addresses),
            addresses,
            on_host,
            block_ids,
        )
        if copy_engine_groups
        else None
    )
    launches = [
        None if i in copy_engine_groups else group_launch(group, cache_addresses, state)
        for i, group in enumerate(plan.groups)
    ]
    if copies is not None:
        copy_engine.enqueue(*copies, direction, device_index, stream)
    for i, group in enumerate(plan.groups):
        if i in copy_engine_groups:
            continue
        ids = None if block_ids is None else block_ids[i]
        launches[i].launch(
            direction,
            group,
            addresses[group.object_group_idx],
            stream,
            ids,
            skip=None if skip is None else group_skip(skip, group),
            max_ctas=max_ctas,
        )
    for host, staging in copies_after:
        host.copy_(staging, non_blocking=True)
