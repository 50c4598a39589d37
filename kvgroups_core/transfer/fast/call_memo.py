"""The validated call signatures of one prepared transfer (docs/DESIGN.md "Repeated calls").

An engine calls the same prepared transfer thousands of times per second with calls that differ
only in values: new block ids of the same shape, the same object buffers, the same layer. What
the core's checks conclude about such a call depends on its *signature*, not on those values,
so a call whose signature passed before needs none of that work again:

- the plan signature ``(direction, ids, layers, skip, max_ctas)``, where ``ids`` is the host
  ids' dtype and shape, or the backend's
  :meth:`~kvgroups_core.transfer.backend.Backend.device_ids_key`
  of device ids (dtype, shape, device: a plan never depends on device id values), maps to the
  plan, the bound tensors its planes touch (with their fingerprints) and the backend's repeater
  of that plan (:meth:`~kvgroups_core.transfer.backend.BoundCaches.repeater`);
- the objects signature (type, identity, address, dtype, shape, strides and writability of
  each object: :func:`~kvgroups_core.transfer.checks.objects_key`) is remembered per direction and
  chunk count once the objects passed every check, so the layer-wise calls of one request
  check its objects once.

A hit still checks what may have changed since: by identity, the entries of the cache
structure that hold the tensors this plan touches (in a flat list, those positions; any other
structure whole), the fingerprints of those tensors (a layer-subset call does not look at
other layers' tensors: its launches address none of their bytes; an entry replaced elsewhere
is noticed by the first call that touches it), and host ids' values against every used
block. Anything else, and any doubt, is a miss: the call takes the full path
(which raises the cold call's error, rebinds, or passes and records). Only calls that moved
bytes in place (no new cache arrays) with plain objects and one engine group's flat ids are
recorded; a rebind starts a new memo. One-shot calls use the memo of the binding they take
back (``kvgroups_core.transfer.fast.reuse``): parking drops the memo's references to the tensors,
not its
signatures.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvgroups_core.transfer.checks import CacheGuard, numpy_objects_key
from kvgroups_core.transfer.planner import ids_out_of_range

_MAX_PLANS = 1024  # signatures: layers x directions x chunk counts x id dtypes
_MAX_OBJECTS = 64  # object sets (an engine cycles through a few buffers)


def call_key(
    ids_key: Any,
    direction: str,
    block_ids: Any,
    layers: Any,
    max_ctas: Any,
    skip: Any,
    path: Any = None,
) -> tuple | None:
    """The plan signature of a call, or None when the call is not memoised (ids of another
    form, a device skip, arguments whose hash could confuse values: ``True == 1``)."""
    if type(block_ids) is np.ndarray:
        if block_ids.ndim != 1 or block_ids.dtype.kind != "i":
            return None
        ids: Any = ("host", block_ids.dtype, block_ids.shape)
    else:
        found = ids_key(block_ids) if ids_key is not None else None
        if found is None:
            return None
        ids = ("device", type(block_ids), found)
    if layers is not None:
        if type(layers) is not list and type(layers) is not tuple:
            return None
        for layer in layers:
            if type(layer) is not int:
                return None
        layers = tuple(layers)
    if (max_ctas is not None and type(max_ctas) is not int) or type(skip) is not int:
        return None
    if path is not None and type(path) is not str:
        return None
    return (direction, ids, layers, skip, max_ctas, path)


class _Entry:
    """One validated plan signature."""

    __slots__ = ("scope", "checks", "indices", "positions", "keys", "run")

    def __init__(
        self,
        scope: tuple,
        checks: tuple | None,
        indices: tuple,
        positions: tuple | None,
        keys: Any,
        run: Any,
    ) -> None:
        self.scope = scope  # (direction, num_chunks): what the objects were validated for
        self.checks = checks  # host ids: (used ids, num_blocks) to check per call; else None
        self.indices = indices  # the tensor indices of the bound tensors the plan's planes touch
        self.positions = positions  # where a flat structure holds them (None: check it whole)
        self.keys = keys  # their fingerprints when recorded (None: no fingerprints)
        self.run = run  # BoundCaches.repeater(plan, ...)


class CallMemo:
    """The memo of one binding (made by each bind; cleared when a JAX load adopts results)."""

    def __init__(self, backend: Any, binding: Any, bound: Any, guard: CacheGuard) -> None:
        self._binding = binding
        self._bound = bound
        self._guard = guard
        self._keys_match = guard.keys_match
        self._objects_key = getattr(backend, "objects_key", None) or numpy_objects_key
        self._plans: dict[tuple, _Entry] = {}
        self._objects: dict[tuple, bool] = {}
        # The bound tensors each entry touches, by entry (an identity hash): the only
        # references the memo holds to caches, dropped in one step when the binding lets go
        # of its tensors (a parked one-shot binding, once per one-shot call).
        self._held: dict[_Entry, list] = {}

    def clear(self) -> None:
        self._plans.clear()
        self._objects.clear()
        self._held = {}

    def release(self) -> None:
        """The binding let go of its tensors (a parked one-shot binding): drop the references
        and keep the signatures. After the binding takes its tensors back (the very same
        objects: :mod:`kvgroups_core.transfer.fast.reuse`), a hit looks them up from the guard
        again and
        compares their fingerprints with the recorded ones, as every hit does."""
        self._held = {}

    def call(
        self,
        key: tuple,
        block_ids: Any,
        objects: Any,
        kv_caches: Any,
        fingerprints_checked: bool = False,
    ) -> Any:
        """Run a call of a recorded signature: the repeater's result, or None (a miss: nothing
        has moved, the caller takes the full path). ``fingerprints_checked``: the caller has
        just compared every bound tensor's fingerprint with the binding's (a one-shot call
        taking its binding back does), so the touched ones need no second look."""
        entry = self._plans.get(key)
        if entry is None or not self._guard.same_entries_at(kv_caches, entry.positions):
            return None
        if entry.keys is not None and not fingerprints_checked:
            tensors = self._held.get(entry)
            if tensors is None:
                tensors = self._held[entry] = self._guard.watch(entry.indices)[0]
            # entry.keys is recorded only by a guard with fingerprints: keys_match is set
            if not self._keys_match(tensors, entry.keys):  # type: ignore[misc]
                return None  # a touched tensor was reallocated: the full path rebinds or raises
        if type(objects) is not list and type(objects) is not tuple:
            return None
        okey = self._objects_key(objects)
        if okey is None or (entry.scope, okey) not in self._objects:
            return None
        if entry.checks is not None:  # host ids: their values are checked every call
            block_ids = block_ids.astype(np.int64, copy=False)
            for used, num_blocks in entry.checks:
                if ids_out_of_range(block_ids[used], num_blocks):
                    return None  # the full path raises the precise error
        return entry.run(block_ids, objects, okey)

    def record(self, key: tuple, plan: Any, block_ids: Any, objects: Any) -> None:
        """After a full-path call of signature ``key`` passed and moved its bytes in place."""
        binding = self._binding
        if plan.num_chunks == 0 or plan.skip_tokens is not None or binding.flat_group is None:
            return
        okey = (
            self._objects_key(objects) if type(objects) is list or type(objects) is tuple else None
        )
        if okey is None:
            return
        scope = (plan.direction, plan.num_chunks)
        if len(self._objects) >= _MAX_OBJECTS:
            self._objects.clear()
        self._objects[(scope, okey)] = True
        if key in self._plans:
            return
        host = key[1][0] == "host"
        if host == bool(plan.device_ids):
            return  # the planner read the ids otherwise than the key says: never memoised
        checks = None
        if host:
            checks = binding.host_id_checks(plan.direction, plan.num_chunks, key[3], plan.layers)
            if checks is None:
                return
            block_ids = block_ids.astype(np.int64, copy=False)
        indices = tuple(sorted({p.tensor_index for g in plan.groups for p in g.planes}))
        tensors, keys = self._guard.watch(indices)
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
            self._held = {}
        entry = self._plans[key] = _Entry(
            scope,
            checks,
            indices,
            self._guard.positions_of(tensors),
            keys,
            self._bound.repeater(plan, block_ids),
        )
        self._held[entry] = tensors
