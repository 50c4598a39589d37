"""Checks of the memory a transfer touches, made before any byte moves.

The planner checks ids, sizes and geometry; this module checks what those cannot see:

- the caches a prepared transfer was bound to are still the ones it moves (:class:`CacheGuard`:
  a replaced list entry, a resized or reallocated tensor is noticed on the next call, which
  then binds again or raises naming what changed);
- objects are arrays of the call's framework, writable where a call writes them, and overlap
  neither each other nor the caches (:func:`check_call_memory`);
- the cache structure has one tensor per layer of the manager (:func:`check_bind_inputs`).

Per-framework facts (an array's address, byte extent, writability) come from a backend's
optional ``memory_of(x)`` (see :class:`Memory`); NumPy arrays are read here. Backends whose
arrays cannot alias (JAX: every buffer is XLA's own) return None and only identity checks run.
"""

from __future__ import annotations

import bisect
import operator
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .descriptors import TensorDesc, TensorSpec
from .errors import KVGroupsTypeError, KVGroupsValueError
from .formats import EngineKVFormat
from .layout import num_layers_of


@dataclass(frozen=True)
class Memory:
    """Where an array's bytes are: ``[address, address + extent)``; ``writable`` False when
    they are read-only; ``host`` True for CPU memory (where read-only mappings exist)."""

    address: int
    extent: int
    writable: bool
    host: bool = True


# --- binding -----------------------------------------------------------------------------


def check_bind_inputs(manager: Any, kv_caches: Any) -> None:
    """Before binding ``kv_caches`` to ``manager``: one tensor per layer of the manager, and
    the manager marked in use (its layout can no longer change, see ``enable_full_sw_kv``)."""
    manager._in_use = True
    formats = manager.engine_kv_formats
    if kv_caches is None or isinstance(kv_caches, (str, bytes, dict)):
        raise KVGroupsTypeError(
            f"kv_caches: expected the engine's structure of cache tensors, got "
            f"{type(kv_caches).__name__}"
        )
    for fmt in dict.fromkeys(formats):
        if not isinstance(fmt, EngineKVFormat) or not fmt.groupable:
            continue
        try:
            have = num_layers_of(kv_caches, fmt)
        except (TypeError, IndexError, KeyError, AttributeError) as exc:
            raise KVGroupsTypeError(
                f"kv_caches: expected a structure of {len(formats)} layers as {fmt.name}, got "
                f"{type(kv_caches).__name__} ({exc})"
            ) from exc
        if have != len(formats):
            raise KVGroupsValueError(
                f"kv_caches: expected {len(formats)} layers as the manager was built with "
                f"({fmt.name}), got {have}"
            )


def _snapshot(structure: Any) -> Any:
    """The structure's containers as tuples, leaves as they are (compared by identity)."""
    if isinstance(structure, (list, tuple)):
        return tuple(_snapshot(x) for x in structure)
    return structure


def _first_change(structure: Any, snap: Any, path: str = "kv_caches") -> str | None:
    if isinstance(snap, tuple):
        if not isinstance(structure, (list, tuple)) or len(structure) != len(snap):
            return f"{path} changed length or type"
        for i, (x, s) in enumerate(zip(structure, snap)):
            found = _first_change(x, s, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if structure is snap else f"{path} was replaced by another tensor"


def _numpy_memory(x: np.ndarray) -> Memory:
    start, end = np.lib.array_utils.byte_bounds(x) if hasattr(np.lib, "array_utils") \
        else np.byte_bounds(x)
    return Memory(start, end - start, bool(x.flags.writeable))


def memory_of(backend: Any, x: Any, what: str = "tensor") -> Memory | None:
    """:class:`Memory` of ``x`` (a TensorDesc's array, or an array), None when the framework
    reports none (arrays that cannot alias, abstract values). A backend's ``memory_of(x,
    what)`` also refuses arrays no transfer may use (torch meta or autograd tensors, deleted
    JAX arrays) with a typed error naming ``what``."""
    if isinstance(x, TensorDesc):
        x = x.obj
    if isinstance(x, np.ndarray):
        return _numpy_memory(x)
    reader = getattr(backend, "memory_of", None)
    return None if reader is None else reader(x, what)


def _key_function(backend: Any) -> Callable[[Any], Any]:
    """A cheap per-call fingerprint of a bound cache: the backend's ``buffer_key`` when it has
    one (pointer, shape, strides), for NumPy the same read here."""
    key = getattr(backend, "buffer_key", None)
    if key is not None:
        return key

    def default(x: Any) -> Any:
        if isinstance(x, np.ndarray):
            return x.__array_interface__["data"][0], x.shape, x.strides
        return None  # unknown runtime: replacement is still noticed by identity

    return default


class CacheGuard:
    """What a binding was made from, to notice on each call that the caches changed.

    ``changed(kv_caches)`` compares the structure's tensors by identity (a flat list: one
    ``is`` per entry) and each concrete bound tensor's ``(pointer, shape, strides)``; it
    returns a sentence naming the first change, or None. Abstract (traced) tensors are not
    fingerprinted.
    """

    def __init__(self, backend: Any, kv_caches: Any, slots: Sequence[TensorDesc]) -> None:
        self._key = _key_function(backend)
        self.backend = backend
        self.reset(kv_caches, [d.obj for d in slots], slots)

    def reset(self, kv_caches: Any, objs: Sequence[Any],
              slots: Sequence[TensorDesc] | None = None) -> None:
        """Take ``kv_caches`` (bound tensors ``objs`` in slot order) as the current state."""
        self._flat = type(kv_caches) is list and not any(
            isinstance(x, (list, tuple)) for x in kv_caches)
        self._snap = list(kv_caches) if self._flat else _snapshot(kv_caches)
        if slots is not None:
            concrete = [(i, d.obj) for i, d in enumerate(slots)
                        if d.obj is not None and not d.is_abstract]
        else:
            concrete = list(enumerate(objs))
        key = self._key
        self._concrete = [x for _, x in concrete]
        self._slot_index = [i for i, _ in concrete]
        self._keys = [key(x) for x in self._concrete]
        self._memory: list[tuple[int, int]] | None = None  # cache byte ranges, sorted
        self._writable: bool | None = None

    def changed(self, kv_caches: Any) -> str | None:
        if self._flat:
            snap = self._snap
            if type(kv_caches) is not list or len(kv_caches) != len(snap) or not all(
                    map(operator.is_, kv_caches, snap)):
                return _first_change(kv_caches, tuple(snap)) or "kv_caches changed"
        else:
            found = _first_change(kv_caches, self._snap)
            if found:
                return found
        key = self._key
        keys = self._keys
        for n, x in enumerate(self._concrete):
            now = key(x)
            if now != keys[n]:
                slot = self._slot_index[n]
                if now is True:  # buffer_key of runtimes whose arrays are only ever deleted
                    return f"the bound array of slot {slot} was deleted or donated"
                return (f"the bound tensor of slot {slot} was resized or reallocated "
                        f"({_describe_key(keys[n])} -> {_describe_key(now)})")
        return None

    # Memory facts of the caches, read once per binding on first need.
    def cache_ranges(self) -> list[tuple[int, int]]:
        if self._memory is None:
            ranges = []
            for x in self._concrete:
                mem = memory_of(self.backend, x, "kv_caches")
                if mem is not None and mem.extent:
                    ranges.append((mem.address, mem.address + mem.extent))
            self._memory = _merge(ranges)
        return self._memory

    def caches_writable(self) -> bool:
        if self._writable is None:
            ok = True
            for x in self._concrete:
                mem = memory_of(self.backend, x, "kv_caches")
                if mem is not None and mem.extent and not (
                        mem.writable and (not mem.host or host_range_writable(mem))):
                    ok = False
                    break
            self._writable = ok
        return self._writable


def _describe_key(key: Any) -> str:
    if isinstance(key, tuple) and len(key) >= 2:
        return f"address {key[0]:#x}, shape {tuple(key[1])}"
    return repr(key)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _overlaps(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether ``[start, end)`` meets any of the sorted, disjoint ``ranges``."""
    i = bisect.bisect_right(ranges, (start, sys.maxsize))
    if i and ranges[i - 1][1] > start:
        return True
    return i < len(ranges) and ranges[i][0] < end


# --- read-only host memory ----------------------------------------------------------------

_MAPS_CACHE: dict[tuple[int, int], bool] = {}


def host_range_writable(mem: Memory) -> bool:
    """Whether every page of a host byte range is mapped writable (Linux: /proc/self/maps;
    elsewhere assumed writable). A framework cannot always tell: a torch tensor made from a
    read-only mapping writes (and crashes) like any other."""
    key = (mem.address, mem.extent)
    hit = _MAPS_CACHE.get(key)
    if hit is not None:
        return hit
    try:
        with open("/proc/self/maps", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return True
    start, end = mem.address, mem.address + mem.extent
    covered = start
    ok = True
    for line in lines:
        fields = line.split()
        lo, hi = (int(v, 16) for v in fields[0].split(b"-"))
        if hi <= covered or lo >= end:
            continue
        if lo > covered:
            break  # a hole: not memory we can judge; leave it to the framework
        if b"w" not in fields[1]:
            ok = False
            break
        covered = hi
        if covered >= end:
            break
    if len(_MAPS_CACHE) > 1024:
        _MAPS_CACHE.clear()
    if not ok:
        return False  # not cached: the mapping may become writable
    _MAPS_CACHE[key] = True
    return True


# --- per-call object checks ------------------------------------------------------------------

_FRAMEWORK_OF: dict[tuple[int, type], bool] = {}


def _is_backend_array(backend: Any, x: Any) -> bool:
    """Whether ``x`` is an array type ``backend`` handles (its ``array_types``)."""
    t = type(x)
    key = (id(backend), t)
    hit = _FRAMEWORK_OF.get(key)
    if hit is None:
        from .registry import _resolve_class  # registry imports the planner, which imports us

        hit = False
        for qualified in backend.array_types:
            cls = _resolve_class(qualified)
            if cls is not None and issubclass(t, cls):
                hit = True
                break
        _FRAMEWORK_OF[key] = hit
    return hit


def _leaves(objects: Sequence[Any]) -> list[tuple[str, Any]]:
    out = []
    for g, entry in enumerate(objects):
        if isinstance(entry, (list, tuple)):
            out.extend((f"objects[{g}][{c}]", x) for c, x in enumerate(entry))
        else:
            out.append((f"objects[{g}]", entry))
    return out


def check_object_types(backend: Any, objects: Any) -> None:
    """Every object is an array of the call's framework (or a descriptor of one)."""
    if not isinstance(objects, (list, tuple)):
        raise KVGroupsTypeError(
            f"objects: expected a list with one entry per object group, got "
            f"{type(objects).__name__}"
        )
    if not backend.array_types:
        return  # a backend that names no array type judges its objects itself
    for what, x in _leaves(objects):
        arr = x.obj if isinstance(x, TensorDesc) else x
        if isinstance(x, TensorSpec) or arr is None or not _is_backend_array(backend, arr):
            raise KVGroupsTypeError(
                f"{what}: expected a uint8 array of the {backend.name!r} backend "
                f"({', '.join(backend.array_types)}), got {type(arr).__name__}"
            )


def check_call_memory(guard: CacheGuard, plan: Any, objects: Sequence[Any]) -> None:
    """The objects of one call: the call's framework, writable when stored into, no two
    sharing a byte, none sharing a byte with the caches; caches writable for a load."""
    backend = guard.backend
    check_object_types(backend, objects)
    store = plan.direction == "store"
    if not store and not guard.caches_writable():
        raise KVGroupsValueError(
            "kv_caches: expected writable memory for a load, got read-only memory"
        )
    leaves = _leaves(objects)
    seen: dict[int, str] = {}
    ranges: list[tuple[int, int, str]] = []
    for what, x in leaves:
        arr = x.obj if isinstance(x, TensorDesc) else x
        other = seen.get(id(arr))
        if other is not None:
            raise KVGroupsValueError(f"{what}: expected its own buffer, got the array of {other}")
        seen[id(arr)] = what
        mem = memory_of(backend, arr, what)
        if mem is None or not mem.extent:
            continue
        _check_rows(backend, arr, what)
        if store and not (mem.writable and (not mem.host or host_range_writable(mem))):
            raise KVGroupsValueError(
                f"{what}: expected writable memory to store into, got read-only memory"
            )
        ranges.append((mem.address, mem.address + mem.extent, what))
    if not ranges:
        return
    ranges.sort()
    for (_, e0, w0), (s1, _, w1) in zip(ranges, ranges[1:]):
        if s1 < e0:
            raise KVGroupsValueError(f"{w1}: expected memory of its own, got bytes of {w0}")
    caches = guard.cache_ranges()
    for start, end, what in ranges:
        if _overlaps(caches, start, end):
            raise KVGroupsValueError(
                f"{what}: expected memory apart from the caches, got bytes of a cache tensor"
            )


def _check_rows(backend: Any, arr: Any, what: str) -> None:
    """A ``[num_chunks, nbytes]`` object's rows must not overlap (stride-0 or short row
    strides would make two chunks share bytes)."""
    _, shape, strides = backend.shape_of(arr)
    if len(shape) == 2 and shape[0] > 1 and shape[1] > 0 and not strides[0] >= shape[1]:
        raise KVGroupsValueError(
            f"{what}: expected rows of their own (row stride >= {shape[1]} bytes), got "
            f"strides {tuple(strides)}"
        )
    if any(s < 0 for s in strides):
        raise KVGroupsValueError(f"{what}: expected non-negative strides, got {tuple(strides)}")

