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
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError
from kvgroups_core.formats.catalogue import EngineKVFormat
from kvgroups_core.formats.layout import num_layers_of
from kvgroups_core.tensors.descriptors import TensorDesc, TensorSpec


class Memory(NamedTuple):
    """Where an array's bytes are: ``[address, address + extent)``; ``writable`` False when
    they are read-only; ``host`` True for CPU memory (where read-only mappings exist);
    ``row_stride`` the bytes between rows of a 2-D array (None otherwise), ``row_bytes`` the
    bytes of one row, ``rows`` the row count."""

    address: int
    extent: int
    writable: bool
    host: bool = True
    rows: int = 1
    row_stride: int | None = None
    row_bytes: int = 0


# --- binding -----------------------------------------------------------------------------


def check_bind_inputs(manager: Any, kv_caches: Any) -> None:
    """Before binding ``kv_caches`` to ``manager``: one tensor per layer of the manager, and
    the manager marked in use (its layout can no longer change, see ``enable_full_sw_kv``)."""
    manager.mark_in_use()
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


def copy_structure(structure: Any) -> Any:
    """``structure`` with its lists and tuples copied and its leaves shared: one read of the
    engine's structure, from which a binding and its :class:`CacheGuard` are both derived. A
    list is copied in one step (``list(x)`` holds the GIL throughout), so another thread
    replacing entries meanwhile leaves either the old or the new entry, never a binding made
    of one and a guard of the other."""
    if type(structure) is list:
        snap = list(structure)
        for x in snap:
            if isinstance(x, (list, tuple)):
                return [copy_structure(x) if isinstance(x, (list, tuple)) else x for x in snap]
        return snap
    if isinstance(structure, (list, tuple)):
        items = [copy_structure(x) if isinstance(x, (list, tuple)) else x for x in list(structure)]
        return items if isinstance(structure, list) else tuple(items)
    return structure


def _snapshot(structure: Any) -> Any:
    """The structure's containers as tuples, leaves as they are (compared by identity)."""
    if isinstance(structure, (list, tuple)):
        return tuple(_snapshot(x) for x in structure)
    return structure


def _first_change(structure: Any, snap: Any, where: str = "kv_caches") -> str | None:
    if isinstance(snap, tuple):
        if not isinstance(structure, (list, tuple)) or len(structure) != len(snap):
            return f"{where} changed length or type"
        for i, (x, s) in enumerate(zip(structure, snap)):
            found = _first_change(x, s, f"{where}[{i}]")
            if found:
                return found
        return None
    return None if structure is snap else f"{where} was replaced by another tensor"


def _numpy_memory(x: np.ndarray) -> Memory:
    # NumPy 2 moved byte_bounds to np.lib.array_utils; NumPy 1.x has it at the top level.
    start, end = getattr(np.lib, "array_utils", np).byte_bounds(x)
    if x.ndim == 2:
        return Memory(
            start,
            end - start,
            bool(x.flags.writeable),
            True,
            x.shape[0],
            x.strides[0],
            x.shape[1] * x.itemsize,
        )
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


def _keys_function(backend: Any) -> Callable[[list], Any] | None:
    """The fingerprint of the bound caches: the backend's ``buffer_keys(arrays)`` (torch:
    address, shape, strides, dtype and requires_grad of each), for NumPy the same read here;
    None when the runtime needs none (JAX arrays never change in place: replacement is
    noticed by identity)."""
    if hasattr(backend, "buffer_keys"):
        return backend.buffer_keys

    def numpy_keys(xs: list) -> Any:
        # The whole layout and the writeable flag: an array changed in place (or another
        # array at the same address, see kvgroups_core.transfer.fast.reuse) is bound again, and a
        # load
        # into one made read-only is refused as on a first call.
        out: list[tuple | None] = []
        for x in xs:
            if isinstance(x, np.ndarray):
                ai = x.__array_interface__
                out.append((ai["data"][0], ai["shape"], ai["strides"], x.dtype, x.flags.writeable))
            else:
                out.append(None)
        return out

    return numpy_keys


def _match_function(
    backend: Any, keys_of: Callable[[list], Any] | None
) -> Callable[[list, Any], bool] | None:
    """``match(arrays, keys)``: whether ``arrays`` still have the fingerprints ``keys`` (the
    backend's ``buffer_keys_match`` when it has a cheaper check than computing them again)."""
    if keys_of is None:
        return None
    found = getattr(backend, "buffer_keys_match", None)
    if found is not None:
        return found
    return lambda xs, keys: keys_of(xs) == keys


class CacheGuard:
    """What a binding was made from, to notice on each call that the caches changed.

    ``changed(kv_caches)`` compares the structure's tensors by identity (a flat list: one
    ``is`` per entry) and each concrete bound tensor's fingerprint (the backend's
    ``buffer_keys``); it returns a sentence naming the first change, or None. Abstract
    (traced) tensors are not fingerprinted.

    ``kv_caches`` given to the guard is the caller's private copy of the engine's structure
    (:func:`copy_structure`), the very one the binding was made from: :attr:`source`.
    """

    def __init__(self, backend: Any, kv_caches: Any, tensors: Sequence[TensorDesc]) -> None:
        self._keys_of = _keys_function(backend)
        self._keys_match = _match_function(backend, self._keys_of)
        self.objects_memo: Any = None  # the last passing call's objects (check_call_memory)
        self.backend = backend
        self.reset(kv_caches, [d.obj for d in tensors], tensors)

    def reset(
        self, kv_caches: Any, objs: Sequence[Any], tensors: Sequence[TensorDesc] | None = None
    ) -> None:
        """Take ``kv_caches`` (bound tensors ``objs`` by tensor_index) as the current state."""
        self.objects_memo = None
        self._flat = type(kv_caches) is list and not any(
            isinstance(x, (list, tuple)) for x in kv_caches
        )
        self.source = kv_caches  # the structure the binding was made from
        self._snap = list(kv_caches) if self._flat else _snapshot(kv_caches)
        if tensors is not None:
            concrete = [
                (i, d.obj) for i, d in enumerate(tensors) if d.obj is not None and not d.is_abstract
            ]
        else:
            concrete = list(enumerate(objs))
        self._concrete = [x for _, x in concrete]
        self._tensor_indices = [i for i, _ in concrete]
        self._where: dict[int, int] | None = None  # tensor index -> position in _concrete (watch)
        keys_of = self._keys_of
        self._keys = keys_of(self._concrete) if keys_of is not None else None
        self._memory: list[tuple[int, int]] | None = None  # cache byte ranges, sorted
        self._writable: bool | None = None

    def adopt(self, kv_caches: Any, objs: Sequence[Any]) -> None:
        """After a load returned new arrays for the bound ones (JAX), one for one: the cheap
        form of :meth:`reset` (same structure, same layouts)."""
        if self._flat and type(kv_caches) is list:
            self._snap = self.source = list(kv_caches)
        else:
            self._flat = False
            self.source = copy_structure(kv_caches)
            self._snap = _snapshot(self.source)
        self._concrete = list(objs)
        self._tensor_indices = list(range(len(self._concrete)))
        self._where = None
        if self._keys is not None:  # then _keys_of is set (see reset)
            self._keys = self._keys_of(self._concrete)  # type: ignore[misc]
        self._memory = None

    def release(self) -> None:
        """Let go of the caches while a one-shot binding waits for its next call
        (:mod:`kvgroups_core.transfer.fast.reuse`); the fingerprints stay, to be compared then."""
        # None while parked: restore sets them before anything reads them again.
        self._snap = self._concrete = self.source = None  # type: ignore[assignment]

    def restore(self, kv_caches: Any, objs: Sequence[Any]) -> None:
        """Take back the same structure and tensors (``objs`` in tensor_index order) after
        :meth:`release`: :meth:`changed` then compares the fingerprints taken before.
        ``kv_caches`` is the caller's private copy whose leaves were compared with the
        released ones (:func:`kvgroups_core.transfer.fast.reuse.take`)."""
        self.source = kv_caches
        self._snap = list(kv_caches) if self._flat else _snapshot(kv_caches)
        self._concrete = [objs[i] for i in self._tensor_indices]

    def changed(self, kv_caches: Any) -> str | None:
        if self._flat:
            snap = self._snap
            if (
                type(kv_caches) is not list
                or len(kv_caches) != len(snap)
                or not all(map(operator.is_, kv_caches, snap))
            ):
                return _first_change(kv_caches, tuple(snap)) or "kv_caches changed"
        else:
            found = _first_change(kv_caches, self._snap)
            if found:
                return found
        return self.reallocated()

    def reallocated(self) -> str | None:
        """The half of :meth:`changed` after the structure's identity check: a sentence
        naming the first bound tensor resized or reallocated in place, or None."""
        keys = self._keys
        # keys is set only with _keys_of and _keys_match (see reset)
        if keys is None or self._keys_match(self._concrete, keys):  # type: ignore[misc]
            return None
        now = self._keys_of(self._concrete)  # type: ignore[misc]
        n = next((i for i, (a, b) in enumerate(zip(keys, now)) if a != b), 0)
        return (
            f"the bound tensor at index {self._tensor_indices[n]} was resized or reallocated, "
            f"or changed in place ({_describe_change(keys[n], now[n])})"
        )

    def same_entries(self, kv_caches: Any) -> bool:
        """Whether the structure still holds the bound tensors (identity only: the cheap
        half of :meth:`changed`)."""
        if self._flat:
            snap = self._snap
            return (
                type(kv_caches) is list
                and len(kv_caches) == len(snap)
                and all(map(operator.is_, kv_caches, snap))
            )
        return _first_change(kv_caches, self._snap) is None

    def positions_of(self, tensors: Sequence[Any]) -> tuple[int, ...] | None:
        """Where a flat list holds these bound tensors (by identity), for
        :meth:`same_entries_at`; None where the whole structure is checked (another
        structure, no concrete tensor, or every entry)."""
        if not self._flat or self._snap is None or not tensors:
            return None
        wanted = {id(x) for x in tensors}
        positions = tuple(i for i, x in enumerate(self._snap) if id(x) in wanted)
        return None if len(positions) == len(self._snap) else positions

    def same_entries_at(self, kv_caches: Any, positions: tuple[int, ...] | None) -> bool:
        """:meth:`same_entries` restricted to the list positions :meth:`positions_of` gave: a
        call touching only those tensors needs nothing else of the structure (a replaced
        entry elsewhere is noticed by the first call that touches it). ``positions`` None:
        the whole structure."""
        if positions is None:
            return self.same_entries(kv_caches)
        snap = self._snap
        if type(kv_caches) is not list or len(kv_caches) != len(snap):
            return False
        for i in positions:
            if kv_caches[i] is not snap[i]:
                return False
        return True

    def watch(self, indices: Sequence[int]) -> tuple[list, Any]:
        """``(tensors, keys)``: the concrete bound tensors at these tensor indices and their
        current fingerprints (``keys`` None when the runtime has none); a call touching only
        these tensors is current while ``keys_match(tensors, keys)`` and :meth:`same_entries`."""
        where = self._where
        if where is None:
            where = self._where = {index: n for n, index in enumerate(self._tensor_indices)}
        tensors = [self._concrete[where[i]] for i in indices if i in where]
        keys = self._keys_of(tensors) if self._keys_of is not None and tensors else None
        return tensors, keys

    @property
    def keys_of(self) -> Callable[[list], Any] | None:
        return self._keys_of

    @property
    def keys_match(self) -> Callable[[list, Any], bool] | None:
        return self._keys_match

    def raise_if_unusable(self) -> None:
        """Raise the backend's typed error for a bound array no call may use any more (a
        deleted or donated JAX array): how a runtime's own dispatch error is explained."""
        for n, x in enumerate(self._concrete):
            memory_of(self.backend, x, f"kv_caches (bound array {self._tensor_indices[n]})")

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
                if (
                    mem is not None
                    and mem.extent
                    and not (mem.writable and (not mem.host or host_range_writable(mem)))
                ):
                    ok = False
                    break
            self._writable = ok
        return self._writable


def _describe_key(key: Any) -> str:
    if isinstance(key, tuple) and len(key) >= 2:
        read_only = ", read-only" if len(key) > 2 and key[-1] is False else ""
        return f"address {key[0]:#x}, shape {tuple(key[1])}{read_only}"
    if isinstance(key, int):
        return f"address {key:#x}"
    return repr(key)


def _describe_change(old: Any, new: Any) -> str:
    """``"FIELD old -> new, ..."`` for a backend's named fingerprints (torch: address, shape,
    strides, dtype, requires_grad), else both fingerprints described."""
    fields = getattr(old, "_fields", None)
    if fields and getattr(new, "_fields", None) == fields:
        parts = []
        for name, a, b in zip(fields, old, new):
            if a != b:
                show = (lambda v: f"{v:#x}") if name == "address" else repr
                parts.append(f"{name} {show(a)} -> {show(b)}")
        return ", ".join(parts)
    return f"{_describe_key(old)} -> {_describe_key(new)}"


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

_MAPS_MEMO: dict[tuple[int, int], bool] = {}


def host_range_writable(mem: Memory) -> bool:
    """Whether every page of a host byte range is mapped writable (Linux: /proc/self/maps;
    elsewhere assumed writable). A framework cannot always tell: a torch tensor made from a
    read-only mapping writes (and crashes) like any other."""
    key = (mem.address, mem.extent)
    hit = _MAPS_MEMO.get(key)
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
    if len(_MAPS_MEMO) > 1024:
        _MAPS_MEMO.clear()
    if not ok:
        return False  # not remembered: the mapping may become writable
    _MAPS_MEMO[key] = True
    return True


# --- per-call object checks ------------------------------------------------------------------

_FRAMEWORK_OF: dict[tuple[int, type], bool] = {}


def _resolve_class(qualified: str) -> type | None:
    """The class named ``qualified`` when its module is already imported (never imports)."""
    module_name, _, cls_name = qualified.rpartition(".")
    module = sys.modules.get(module_name)
    cls = getattr(module, cls_name, None) if module is not None else None
    return cls if isinstance(cls, type) else None


def _is_backend_array(backend: Any, x: Any) -> bool:
    """Whether ``x`` is an array type ``backend`` handles (its ``array_types``)."""
    t = type(x)
    key = (id(backend), t)
    hit = _FRAMEWORK_OF.get(key)
    if hit is None:
        hit = False
        for qualified in backend.array_types:
            cls = _resolve_class(qualified)
            if cls is not None and issubclass(t, cls):
                hit = True
                break
        _FRAMEWORK_OF[key] = hit
    return hit


def _leaves(objects: Sequence[Any]) -> list[tuple[Any, int, int]]:
    """``(array, object group, chunk or -1)`` of every object buffer."""
    out: list[tuple[Any, int, int]] = []
    for g, entry in enumerate(objects):
        if isinstance(entry, (list, tuple)):
            out.extend((x, g, c) for c, x in enumerate(entry))
        else:
            out.append((entry, g, -1))
    return out


def _name(g: int, c: int) -> str:
    return f"objects[{g}]" if c < 0 else f"objects[{g}][{c}]"


def check_object_types(backend: Any, objects: Any) -> None:
    """Every object is an array of the call's framework (or a descriptor of one)."""
    if not isinstance(objects, (list, tuple)):
        raise KVGroupsTypeError(
            f"objects: expected a list with one entry per object group, got "
            f"{type(objects).__name__}"
        )
    if not backend.array_types:
        return  # a backend that names no array type judges its objects itself
    for x, g, c in _leaves(objects):
        arr = x.obj if isinstance(x, TensorDesc) else x
        if isinstance(x, TensorSpec) or arr is None or not _is_backend_array(backend, arr):
            raise KVGroupsTypeError(
                f"{_name(g, c)}: expected a uint8 array of the {backend.name!r} backend "
                f"({', '.join(backend.array_types)}), got {type(arr).__name__}"
            )


def check_call_memory(guard: CacheGuard, plan: Any, objects: Sequence[Any]) -> None:
    """The objects of one call: the call's framework, writable when stored into, no two
    sharing a byte, none sharing a byte with the caches; caches writable for a load."""
    if not isinstance(objects, (list, tuple)) or len(objects) != len(plan.object_nbytes):
        return  # the count is check_objects' to report, in its words
    # Engines pass the same object buffers call after call (one per layer of a layer-wise
    # save): a call whose objects are the very arrays of the last passing call, at the same
    # addresses and shapes, against the same caches, needs no second look.
    memo = _memo_key(guard, plan, objects)
    if memo is not None and memo == guard.objects_memo:
        return
    _check_call_memory(guard, plan, objects)
    guard.objects_memo = memo


def _memo_key(guard: CacheGuard, plan: Any, objects: Sequence[Any]) -> Any:
    """``(direction, (id, address, shape, strides) per object)`` for plain (not per-chunk)
    objects of a backend with cheap address reads; None when the call is not memoised."""
    keys_of = guard._keys_of
    if keys_of is None or any(isinstance(o, (list, tuple, TensorDesc)) for o in objects):
        return None
    shape_of = guard.backend.shape_of
    try:
        addresses = keys_of(list(objects))
        if any(a is None for a in addresses):
            return None  # no address to compare (JAX: a donated object must be re-checked)
        flags = [getattr(o, "flags", None) for o in objects]  # NumPy's writeable can flip
        return (
            plan.direction,
            tuple(
                (id(o), a, shape_of(o), f is not None and f.writeable)
                for o, a, f in zip(objects, addresses, flags)
            ),
        )
    except Exception:  # noqa: BLE001 - anything unreadable: the full check decides
        return None


def objects_key(backend: Any, objects: Sequence[Any]) -> Any:
    """A hashable signature of plain (not per-chunk) objects: equal signatures mean equal
    verdicts of every object check for one direction and chunk count (type, dtype, shape,
    strides, address, writability: what :func:`_memo_key` compares). The backend's
    ``objects_key(objects)`` when it has one (torch: one attribute read per fact), for NumPy
    arrays read here; None when there is none (JAX: donated objects are checked every call).
    """
    keyer = getattr(backend, "objects_key", None)
    if keyer is not None:
        return keyer(objects)
    return numpy_objects_key(objects)


def numpy_objects_key(objects: Sequence[Any]) -> Any:
    """:func:`objects_key` of NumPy arrays (None for anything else)."""
    out = []
    for a in objects:
        if type(a) is not np.ndarray:
            return None
        out.append(
            (
                id(a),
                a.__array_interface__["data"][0],
                a.dtype,
                a.shape,
                a.strides,
                a.flags.writeable,
            )
        )
    return tuple(out)


def _check_call_memory(guard: CacheGuard, plan: Any, objects: Sequence[Any]) -> None:
    backend = guard.backend
    check_object_types(backend, objects)
    if len(objects) != len(plan.object_nbytes):
        return  # the object check that follows names the expected count
    store = plan.direction == "store"
    if not store and not guard.caches_writable():
        raise KVGroupsValueError(
            "kv_caches: expected writable memory for a load, got read-only memory"
        )
    leaves = _leaves(objects)
    if len(leaves) > 1 and len({id(x) for x, _, _ in leaves}) < len(leaves):
        seen: dict[int, str] = {}
        for x, g, c in leaves:
            if id(x) in seen:
                raise KVGroupsValueError(
                    f"{_name(g, c)}: expected its own buffer, got the array of {seen[id(x)]}"
                )
            seen[id(x)] = _name(g, c)
    ranges: list[tuple[int, int, int, int]] = []
    for x, g, c in leaves:
        arr = x.obj if isinstance(x, TensorDesc) else x
        mem = memory_of(backend, arr, _name(g, c))
        if mem is None or not mem.extent:
            continue
        if mem.row_stride is not None and mem.rows > 1 and not mem.row_stride >= mem.row_bytes:
            raise KVGroupsValueError(
                f"{_name(g, c)}: expected rows of their own (row stride >= {mem.row_bytes} "
                f"bytes), got a row stride of {mem.row_stride} bytes"
            )
        if store and not (mem.writable and (not mem.host or host_range_writable(mem))):
            raise KVGroupsValueError(
                f"{_name(g, c)}: expected writable memory to store into, got read-only memory"
            )
        ranges.append((mem.address, mem.address + mem.extent, g, c))
    if not ranges:
        return
    if len(ranges) > 1:
        ranges.sort()
        for (_, e0, g0, c0), (s1, _, g1, c1) in zip(ranges, ranges[1:]):
            if s1 < e0:
                raise KVGroupsValueError(
                    f"{_name(g1, c1)}: expected memory of its own, got bytes of {_name(g0, c0)}"
                )
    caches = guard.cache_ranges()
    for start, end, g, c in ranges:
        if _overlaps(caches, start, end):
            raise KVGroupsValueError(
                f"{_name(g, c)}: expected memory apart from the caches, got bytes of a cache tensor"
            )
