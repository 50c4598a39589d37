"""``torch.library`` custom ops, so bound plans run inside ``torch.compile`` code.

``kvgroups::store_pages`` (mutates the objects) and ``kvgroups::load_pages`` (mutates the
caches) take the integer handle of a :class:`~kvgroups_torch.bound_plan.BoundPlan` (the
plan's geometry stays on the Python side) plus the tensors. Their fake implementations do
nothing: both ops write in place and return nothing, so tracing needs no shapes.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

import torch

from kvgroups_core.errors import KVGroupsValueError

_prepared: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_handles = itertools.count(1)
_lock = threading.Lock()


def register(prepared: Any) -> int:
    """Give ``prepared`` a handle the ops can carry (held weakly)."""
    with _lock:
        handle = next(_handles)
        _prepared[handle] = prepared
    return handle


def lookup(handle: int) -> Any:
    found = _prepared.get(handle)
    if found is None:
        raise KVGroupsValueError(
            f"handle: expected a live BoundPlan handle, got {handle} (it was released)"
        )
    return found


@torch.library.custom_op("kvgroups::store_pages", mutates_args=("objects",))
def store_pages(handle: int, caches: list[torch.Tensor], objects: list[torch.Tensor],
                block_ids: list[torch.Tensor]) -> None:
    """Gather the pages of bound plan ``handle`` from ``caches`` into ``objects``."""
    lookup(handle).execute(caches, objects, block_ids)


@store_pages.register_fake
def _store_pages_fake(handle, caches, objects, block_ids) -> None:
    return None


@torch.library.custom_op("kvgroups::load_pages", mutates_args=("caches",))
def load_pages(handle: int, caches: list[torch.Tensor], objects: list[torch.Tensor],
               block_ids: list[torch.Tensor]) -> None:
    """Scatter the pages of bound plan ``handle`` from ``objects`` into ``caches``."""
    lookup(handle).execute(caches, objects, block_ids)


@load_pages.register_fake
def _load_pages_fake(handle, caches, objects, block_ids) -> None:
    return None
