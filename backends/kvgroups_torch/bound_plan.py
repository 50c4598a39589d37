"""A plan bound to its tensors ahead of time: for ``torch.compile`` and CUDA graphs.

:class:`BoundPlan` does all host work once (kernel compile/load, plane pointer tables
on the device, object addresses, packed launch parameters), so :meth:`BoundPlan.run` is
one kernel launch per kernel group. With block ids given as CUDA tensors it reads them
on the device, which makes it capturable with ``torch.cuda.graph``: update the id tensors in
place and replay.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError
from kvgroups_core.transfer.objects import check_objects

from . import cpu as cpu_copy
from .backend import DEFAULT_PINNED_MODE, cache_device, tensor_of
from .compile import ops
from .cuda import execute as cuda_execute
from .cuda import objects as cuda_objects
from .describe import shape_of


class BoundPlan:
    """``plan`` bound to ``caches`` and ``objects``.

    Parameters
    ----------
    plan : TransferPlan
        From the core (``direction`` "store" or "load").
    caches : sequence of torch.Tensor or TensorDesc
        Backing tensors in ``plan.tensor_specs`` order.
    objects : sequence of torch.Tensor
        One ``[num_chunks, object_nbytes]`` uint8 tensor per object group (GPU or pinned).
    pinned : {"direct", "staged"}
        How pinned host objects are reached (see :func:`cuda_execute.execute_plan`).
    """

    def __init__(
        self,
        plan: Any,
        caches: Sequence[Any],
        objects: Sequence[Any],
        *,
        pinned: str = DEFAULT_PINNED_MODE,
    ) -> None:
        self.plan = plan
        # The core's object rule at addresses; then this class's own limit: one tensor (or
        # DLPack producer) per object group, no per-chunk buffers.
        check_objects(plan, objects, lambda x: shape_of(tensor_of(x, "objects")))
        self.caches = [tensor_of(c, f"caches[{i}]") for i, c in enumerate(caches)]
        self.objects = [tensor_of(o, f"objects[{i}]") for i, o in enumerate(objects)]
        self.device = cache_device(self.caches)
        self.pinned = pinned
        self._addresses: dict[int, cuda_objects.ObjectAddresses] | None = None
        self._device_caches: cuda_execute.DeviceCaches | None = None
        if self.device.type == "cuda":
            index = self.device.index
            self._device_caches = cuda_execute.DeviceCaches(self.caches, index)  # loads kernels
            self._addresses = {
                g: cuda_objects.object_addresses(o, index, f"objects[{g}]")
                for g, o in enumerate(self.objects)
            }
            for group in plan.groups:  # pointer tables and packed parameters, now
                addresses = self._addresses[group.object_group_idx]
                self._device_caches.launch_for(group).prepare(plan.direction, addresses)
            # Staged pinned objects need their copies every call: only execute_plan does those.
            self._direct = pinned == "direct" or all(o.is_cuda for o in self.objects)
        self.handle = ops.register(self)

    def _ids(self, block_ids: Any) -> list[torch.Tensor]:
        if block_ids is None:
            return []
        groups = len(self.plan.groups)
        if isinstance(block_ids, (torch.Tensor, np.ndarray)):
            block_ids = [block_ids] * groups
        if len(block_ids) != groups:
            raise KVGroupsValueError(
                f"block_ids: expected one array per group ({groups}), got {len(block_ids)}"
            )
        out = []
        for i, ids in enumerate(block_ids):
            if isinstance(ids, np.ndarray):
                ids = torch.from_numpy(ids)
            if not isinstance(ids, torch.Tensor):
                raise KVGroupsTypeError(
                    f"block_ids[{i}]: expected a torch.Tensor or ndarray, got {type(ids).__name__}"
                )
            out.append(ids)
        return out

    def run(self, block_ids: Any = None) -> None:
        """Enqueue the transfer on the current stream (the custom op under ``torch.compile``).

        Parameters
        ----------
        block_ids : torch.Tensor or sequence of torch.Tensor, optional
            Replaces the plan's ids: one 1-D int32/int64 tensor for every group, or one per
            group. CUDA tensors are read by the kernel at run time (graph replays see their
            current content); host ids are copied into the launch parameters (a captured
            graph then keeps the values of capture time).
        """
        ids = self._ids(block_ids)
        if not torch.compiler.is_compiling():
            # Eager: skip the custom-op dispatch (tens of microseconds of host time).
            self.execute(self.caches, self.objects, ids)
            return
        op = ops.store_pages if self.plan.direction == "store" else ops.load_pages
        op(self.handle, self.caches, self.objects, ids)

    __call__ = run

    def execute(
        self,
        caches: Sequence[torch.Tensor],
        objects: Sequence[torch.Tensor],
        block_ids: Sequence[torch.Tensor],
        skip: Any = None,
    ) -> None:
        """The ops' implementation: run the plan on these tensors (no custom-op dispatch)."""
        ids = list(block_ids) if len(block_ids) else None
        if self.device.type == "cuda":
            if caches is self.caches and objects is self.objects and self._direct:
                # Eager :meth:`run`: everything but the ids was bound at construction.
                self._device_caches.execute(self.plan, self._addresses, ids)
                return
            same = len(objects) == len(self.objects) and all(
                a is b for a, b in zip(objects, self.objects)
            )
            # Other objects than the bound ones are checked there (the core's rule).
            cuda_execute.execute_plan(
                self.plan,
                caches,
                objects,
                self.device.index,
                pinned=self.pinned,
                block_ids=ids,
                addresses=self._addresses if same else None,
            )
        else:
            if objects is not self.objects:
                check_objects(self.plan, objects, shape_of)
            cpu_copy.execute_plan(self.plan, caches, objects, block_ids=ids)
