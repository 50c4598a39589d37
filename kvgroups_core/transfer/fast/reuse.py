"""The binding of a one-shot call, kept for the next one-shot call on the same caches.

An engine calls ``store(manager, caches, ids)`` / ``load(manager, objects, caches, ids)`` with
the same cache tensors every step; binding them (describing every tensor, checking it against
the manager, the backend's per-cache work) costs far more than the call itself. So after a
one-shot call succeeds, its :class:`~kvgroups_core.transfer.api.PreparedTransfer` is *parked* on
the manager, and the next one-shot call of that manager takes it back when its caches are the
same: the same structure, every leaf the very object the parked binding last moved (after a
JAX load: the arrays it returned). That call then runs exactly as a prepared call does,
checks included: its ids and objects are validated, and the bound caches' fingerprints
(torch: address, shape, strides, dtype, requires_grad; NumPy: address, shape, strides, dtype,
writeable) are compared first, so a cache resized, reallocated or re-viewed in place is bound
afresh (or refused as a first call is). A
repeated signature takes the transfer's call memo (``kvgroups_core.transfer.fast.call_memo``),
which keeps
its signatures while parked and only lets go of the tensors.

Parking holds no cache alive: the parked transfer lets go of every tensor
(``PreparedTransfer.release_caches``) and the park keeps weak references (NumPy arrays: their ids,
see :func:`_refs`); an engine that drops its caches frees them, and the park then misses.
A manager keeps one park (its last caches); a call takes it out under a lock, so two threads
never share one. A refused call (bad ids or objects: nothing moved) puts it back; any other
failure drops it. Abstract values (tracers, fake tensors) are never parked. A manager's
grouping cannot change once it is bound (``KVLayerGroupsManager.enable_full_sw_kv`` refuses),
and ``with_full_sw_kv`` makes a new manager, which a park made for another never serves.
"""

from __future__ import annotations

import operator
import threading
import weakref
from typing import Any

import numpy as np

from kvgroups_core.tensors.descriptors import TensorDesc, TensorSpec
from kvgroups_core.transfer.checks import copy_structure

_LOCK = threading.Lock()


class _Park:
    """A released binding and weak references to what it last moved."""

    __slots__ = ("prepared", "flat", "signature", "leaf_refs", "slot_refs", "taken")

    def __init__(
        self, prepared: Any, flat: bool, signature: Any, leaf_refs: list, slot_refs: list | None
    ) -> None:
        self.prepared = prepared
        self.flat = flat  # kv_caches is a list of tensors: identity per entry says it all
        self.signature = signature  # otherwise: the containers' types and lengths
        self.leaf_refs = leaf_refs
        self.slot_refs = slot_refs  # None: the leaves are the bound tensors, in tensor_index order
        # While a call uses the park: the structure and slot list it was restored with
        # (parking again after a call that kept both reuses the references).
        self.taken: tuple | None = None

    def __reduce__(self) -> tuple:
        # A pickled or deep-copied manager carries no park (a park is this process's cache
        # of live tensors): it comes back as None.
        return (_no_park, ())


def _no_park() -> None:
    return None


def _structure(tree: Any) -> tuple[Any, list]:
    """``(signature, leaves)``: the containers of ``tree`` (types and lengths, where the
    ``None`` entries are) and its leaves in the order ``transfer._leaves`` lists them."""
    leaves: list = []

    def walk(x: Any) -> Any:
        if isinstance(x, (list, tuple)):
            return (type(x), tuple(walk(item) for item in x))
        if x is None:
            return None
        leaves.append(x)
        return 0

    return walk(tree), leaves


def park(manager: Any, prepared: Any, entry: "_Park | None" = None) -> None:
    """After a successful one-shot call: keep ``prepared`` for the manager's next one, unless
    its caches cannot be referenced weakly, are descriptors, or are abstract. ``entry``: the
    park the call was served from (:func:`take`), if any.

    The park refers to the structure the binding was made from (the guard's private copy),
    not to the engine's list as it is now: a thread that replaced an entry since then makes
    the next call miss, instead of parking new leaves over old bound tensors."""
    objs = prepared.bound_tensors
    kv_caches = prepared.bound_structure
    if kv_caches is None:
        kv_caches = prepared.kv_caches
    if entry is not None and entry.taken is not None:
        given, given_objs = entry.taken
        entry.taken = None
        if given is prepared.kv_caches and given_objs is objs:
            # The call kept the caches it was given (stores, in-place loads): the same refs.
            if prepared.release_caches():
                _put(manager, entry)
            return
        # A JAX load returned new arrays in the same structure: new references only.
        leaves = kv_caches if entry.flat else _structure(kv_caches)[1]
        refs = _refs(leaves, objs)
        if refs is not None and prepared.release_caches():
            entry.leaf_refs, entry.slot_refs = refs
            _put(manager, entry)
        return
    flat = type(kv_caches) is list
    if flat:
        leaves, signature = kv_caches, None
        flat = not any(isinstance(x, (list, tuple)) or x is None for x in leaves)
    if not flat:
        signature, leaves = _structure(kv_caches)
    if not leaves or any(isinstance(x, (TensorDesc, TensorSpec)) for x in leaves):
        return
    refs = _refs(leaves, objs)
    if refs is not None and prepared.release_caches():
        _put(manager, _Park(prepared, flat, signature, *refs))


def _refs(leaves: list, objs: list) -> tuple[list, list | None] | None:
    """References to the leaves and to the bound tensors (None: the leaves themselves, in
    slot order, the usual one tensor per layer); None when they cannot be kept.

    Weak references, except for NumPy arrays: NumPy refuses ``ndarray.resize`` on an array
    with a weak reference, so those are kept by ``id`` alone (a tuple ``(id,)``). An id
    may name a new array once the old one is freed; that is sound because a hit still
    compares the bound arrays' fingerprints (address, shape, strides, dtype, writeable:
    everything the binding was derived from) and binds again when any differs."""
    same = len(objs) == len(leaves) and all(map(operator.is_, objs, leaves))
    if type(leaves[0]) is np.ndarray:
        if not same or not all(type(x) is np.ndarray for x in leaves):
            return None
        return [(id(x),) for x in leaves], None
    try:
        leaf_refs = [weakref.ref(x) for x in leaves]
        return leaf_refs, None if same else [weakref.ref(x) for x in objs]
    except TypeError:  # an array type without weak references (or mixed types)
        return None


def put_back(manager: Any, entry: _Park) -> None:
    """Return a park :func:`take` gave out, still released, for the next call."""
    _put(manager, entry)


def _put(manager: Any, entry: _Park) -> None:
    with _LOCK:
        try:
            manager.one_shot_park = entry
        except AttributeError:  # a manager that takes no attributes: nothing kept
            pass


def take(manager: Any, kv_caches: Any) -> tuple[_Park, list, list, Any] | None:
    """The manager's park when ``kv_caches`` are the caches it last moved: ``(park, the
    structure's leaves, the bound tensors in tensor_index order, the copy of the structure those
    leaves were read from)``, its transfer still released (the caller checks the call's
    backend, then calls :func:`restore` with that copy). None otherwise; the park is taken
    out either way, so no other thread uses it meanwhile."""
    with _LOCK:
        entry = getattr(manager, "one_shot_park", None)
        if entry is None:
            return None
        manager.one_shot_park = None
    prepared = entry.prepared
    if prepared.manager is not manager:  # a copy of the manager shares its attributes
        return None
    refs = entry.leaf_refs
    by_id = type(refs[0]) is tuple  # NumPy arrays (see _refs)
    # (None only until the by_id branch below reads the leaves themselves)
    live: list = None if by_id else [r() for r in refs]  # type: ignore[assignment]
    # One read of the structure (see validate.copy_structure): what is compared here is what
    # the guard is given, however other threads change the engine's list meanwhile.
    if entry.flat:
        if type(kv_caches) is not list:
            return None
        source = leaves = list(kv_caches)
        if len(leaves) != len(refs):
            return None
    else:
        source = copy_structure(kv_caches)
        signature, leaves = _structure(source)
        if signature != entry.signature:
            return None
    if by_id:
        if [(id(x),) for x in leaves] != refs or not all(type(x) is np.ndarray for x in leaves):
            return None
        live = list(leaves)
    elif not all(map(operator.is_, leaves, live)):  # a dead reference is None: no leaf
        return None
    if entry.slot_refs is None:
        return entry, live, live, source
    objs = [r() for r in entry.slot_refs]
    if any(x is None for x in objs):
        return None
    return entry, live, objs, source


def restore(entry: _Park, kv_caches: Any, objs: list, source: Any) -> Any:
    """Hand a taken park's transfer its caches back (``source``: the copy :func:`take`
    compared); returns the transfer."""
    entry.taken = (kv_caches, objs)
    entry.prepared.restore_caches(kv_caches, objs, source)
    return entry.prepared
