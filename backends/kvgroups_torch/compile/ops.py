"""``torch.library`` custom ops: how a transfer appears inside a ``torch.compile`` graph.

``kvgroups::store_pages`` (mutates the objects) and ``kvgroups::load_pages`` (mutates the
caches) take the integer handle of a *runner* (the plan's geometry stays on the Python side:
a :class:`~kvgroups_torch.bound_plan.BoundPlan`, or a plan template the public calls made
while being traced, :mod:`kvgroups_torch.compile.dynamo`) plus the tensors: the caches, the
objects, one block-id tensor per group transfer (empty when the ids are baked into the
plan) and the load's device skip. Both ops write in place and return nothing, so their fake
implementations do nothing and tracing needs no shapes; the ``mutates_args`` annotations
tell functionalization which inputs change.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Optional

import torch

from kvgroups_core.errors import KVGroupsValueError

_weak: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_strong: dict[int, Any] = {}
_handles = itertools.count(1)
_lock = threading.Lock()


def register(runner: Any, *, keep: bool = False) -> int:
    """Give ``runner`` (an object with ``execute(caches, objects, block_ids, skip)``) a
    handle the ops can carry. Held weakly, or for the process's life with ``keep`` (plan
    templates of compiled graphs: the graph holds only the integer)."""
    with _lock:
        handle = next(_handles)
        (_strong if keep else _weak)[handle] = runner
    return handle


def lookup(handle: int) -> Any:
    found = _strong.get(handle)
    if found is None:
        found = _weak.get(handle)
    if found is None:
        raise KVGroupsValueError(
            f"handle: expected a live transfer handle, got {handle} (it was released)"
        )
    return found


@torch.library.custom_op("kvgroups::store_pages", mutates_args=("objects",))
def store_pages(
    handle: int,
    caches: list[torch.Tensor],
    objects: list[torch.Tensor],
    block_ids: list[torch.Tensor],
    skip: Optional[torch.Tensor] = None,
) -> None:
    """Gather the pages of runner ``handle`` from ``caches`` into ``objects``."""
    lookup(handle).execute(caches, objects, block_ids, skip)


@store_pages.register_fake
def _store_pages_fake(handle, caches, objects, block_ids, skip=None) -> None:
    return None


@torch.library.custom_op("kvgroups::load_pages", mutates_args=("caches",))
def load_pages(
    handle: int,
    caches: list[torch.Tensor],
    objects: list[torch.Tensor],
    block_ids: list[torch.Tensor],
    skip: Optional[torch.Tensor] = None,
) -> None:
    """Scatter the pages of runner ``handle`` from ``objects`` into ``caches``."""
    lookup(handle).execute(caches, objects, block_ids, skip)


@load_pages.register_fake
def _load_pages_fake(handle, caches, objects, block_ids, skip=None) -> None:
    return None
