"""The public transfer API: ``store`` (engine caches -> memory objects) and ``load`` (objects ->
caches, in place), docs/SEMANTICS.md sections 6-7 and docs/API.md "Transfers".

The backend is found from the tensors (or named with ``backend=``); the core validates every
input and builds the plan before the backend moves or donates anything.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any, Sequence, cast

from kvgroups_core.errors import KVGroupsError
from kvgroups_core.grouping.manager import check_manager
from kvgroups_core.tensors.arrays import backend_for_tensors
from kvgroups_core.tensors.descriptors import TensorDesc, TensorSpec

from .backend import Backend, BoundCaches
from .checks import CacheGuard, check_call_memory, copy_structure
from .fast import reuse
from .fast.call_memo import CallMemo, call_key
from .objects import check_objects
from .plan import Direction
from .planner import Binding, bind, plan_call


def _leaves(structure: Any) -> list[Any]:
    if isinstance(structure, (list, tuple)):
        out: list[Any] = []
        for item in structure:
            out.extend(_leaves(item))
        return out
    return [] if structure is None else [structure]


def _replace_leaves(structure: Any, new_by_id: dict[int, Any]) -> Any:
    if isinstance(structure, (list, tuple)):
        # Plain leaves inline: this runs after every JAX load, over every layer's tensor.
        items = [
            _replace_leaves(x, new_by_id)
            if isinstance(x, (list, tuple, TensorDesc))
            else new_by_id.get(id(x), x)
            for x in structure
        ]
        return items if isinstance(structure, list) else tuple(items)
    key = id(structure.obj) if isinstance(structure, TensorDesc) else id(structure)
    return new_by_id.get(key, structure)


class PreparedTransfer:
    """A manager bound to one set of caches, for repeated transfers with little host work.

    Binding (reading every tensor's layout and checking it against the manager, and the
    backend's own per-cache work) happens once; each :meth:`store` / :meth:`load` then only
    validates its block ids and objects. Use it on hot paths (one chunk per call). Runtimes
    whose loads return new cache arrays (JAX) stay bound too: the backend adopts the results
    (:meth:`BoundCaches.adopt_results`) and :attr:`binding` describes them when read.
    """

    def __init__(
        self, manager: Any, kv_caches: Any, *, backend: "str | Backend | None" = None
    ) -> None:
        self.manager = check_manager(manager)
        self.kv_caches = kv_caches
        # The registry holds transfer backends; ArrayBackend is the part of them it reads.
        self.backend: Backend = (
            backend
            if isinstance(backend, Backend)
            else cast(Backend, backend_for_tensors(_leaves(kv_caches), backend, what="kv_caches"))
        )
        self._to_host = self.backend.to_host_ids  # one bound method, not one per call
        # Backends without device ids (the default hook) skip the per-call probe.
        self._ids_spec = (
            None
            if type(self.backend).device_ids_spec is Backend.device_ids_spec
            else self.backend.device_ids_spec
        )
        self._ids_key = (
            None
            if type(self.backend).device_ids_key is Backend.device_ids_key
            else self.backend.device_ids_key
        )
        self._plans: Binding  # the binding without its descriptors: all planning reads
        self._described: Binding | None  # the binding of the current caches, made when read
        self._bound: BoundCaches
        self._objs: list  # the bound tensors in tensor_index order (what kv_caches holds now)
        self._guard: CacheGuard  # notices replaced or reallocated caches (stale layouts)
        self._memo: CallMemo  # validated call signatures of this binding (call_memo.py)
        # One call at a time: a JAX load replaces the bound caches with its results, and two
        # interleaved calls would each donate or read the same buffers (blocks lost).
        self._lock = threading.RLock()
        self._rebind()

    @property
    def binding(self) -> Binding:
        """The binding of the current caches (after a JAX load: described when read)."""
        if self._described is None:
            tensors = tuple(self.backend.describe(x) for x in self._objs)
            self._described = replace(self._plans, tensors=tensors)
        return self._described

    def store(
        self,
        block_ids: Any,
        objects: Any = None,
        *,
        layers: Any = None,
        max_ctas: int | None = None,
        path: str | None = None,
    ) -> list:
        """Gather the pages of ``block_ids`` into objects; see :func:`store`."""
        return prepared_store(self, block_ids, objects, layers=layers, max_ctas=max_ctas, path=path)

    def load(
        self,
        objects: Any,
        block_ids: Any,
        *,
        skip_first_n_tokens: Any = 0,
        layers: Any = None,
        max_ctas: int | None = None,
        path: str | None = None,
    ) -> Any:
        """Scatter objects back into the caches; see :func:`load`."""
        return prepared_load(
            self,
            objects,
            block_ids,
            skip_first_n_tokens=skip_first_n_tokens,
            layers=layers,
            max_ctas=max_ctas,
            path=path,
        )

    def check_load(
        self,
        objects: Any,
        block_ids: Any,
        *,
        skip_first_n_tokens: Any = 0,
        layers: Any = None,
        max_ctas: int | None = None,
        path: str | None = None,
    ) -> None:
        """Every check :meth:`load` makes of these arguments (the same refusal, first error
        first), moving no byte: for a caller that issues several transfers and must refuse a
        bad one before any of them moves (a layer-wise step's loads)."""
        with self._lock:
            self._check_current()
            plan = _plan(self, "load", block_ids, skip_first_n_tokens, layers, max_ctas, path)
            _check_call_objects(self, plan, objects)

    def check_store(
        self,
        block_ids: Any,
        objects: Any = None,
        *,
        layers: Any = None,
        max_ctas: int | None = None,
        path: str | None = None,
    ) -> None:
        """Every check :meth:`store` makes of these arguments, moving no byte (see
        :meth:`check_load`)."""
        with self._lock:
            self._check_current()
            plan = _plan(self, "store", block_ids, 0, layers, max_ctas, path)
            if objects is not None:  # None: the call allocates them
                _check_call_objects(self, plan, objects)

    def _nothing_to_move(self, plan: Any, objects: Any) -> list:
        """Zero chunks: the objects are checked like any others (``[0, nbytes]``) and no
        backend runs, so every backend behaves the same (nothing moved, nothing donated)."""
        check_objects(plan, objects, self.backend.shape_of)
        self.backend.validate_objects(plan, self._bound.caches, objects)
        return list(objects)

    def _empty_objects(self, plan: Any) -> list:
        """``[0, nbytes]`` objects of the caches' framework for a zero-chunk store (a backend's
        prepared allocation may hand out placeholders that only its programs fill)."""
        caches = self._bound.caches
        return self.backend.allocate_objects(plan, caches[0]) if caches else []

    def _run(self, plan: Any, objects: Any) -> tuple:
        try:
            return self._bound.execute(plan, objects)
        except RuntimeError as exc:
            if isinstance(exc, KVGroupsError):
                raise
            # A runtime refusing a bound array at dispatch (JAX: deleted or donated, which
            # is not checked per call): the typed error instead, nothing has moved.
            self._guard.raise_if_unusable()
            raise

    def _check_current(self) -> None:
        """Bind again when the caches changed since the last call (a replaced entry, a
        resized or reallocated tensor), so no byte moves with an old layout."""
        changed = self._guard.changed(self.kv_caches)
        if changed is not None:
            self._rebind(changed)

    def _rebind(self, changed: str | None = None) -> None:
        if changed is None:
            return self._bind()
        try:
            self._bind()
        except KVGroupsError as exc:
            raise type(exc)(
                f"kv_caches changed since the transfer was prepared ({changed}); "
                f"binding them again failed: {exc}"
            ) from exc

    def _bind(self) -> None:
        # One read of the structure: the binding and the guard both come from this copy, so
        # a thread replacing entries meanwhile cannot leave a binding of some old tensors
        # under a guard that holds the new ones (the next call sees the difference).
        source = copy_structure(self.kv_caches)
        binding = bind(self.manager, source)
        self._plans = replace(binding, tensors=())  # shares the plan-shape caches
        self._described = binding
        self._objs = [d.obj for d in binding.tensors]
        self._bound = self.backend.bind_caches(binding.tensors)
        self._bound.bind_source(self.manager, source)
        self._guard = CacheGuard(self.backend, source, binding.tensors)
        self._memo = CallMemo(self.backend, self._plans, self._bound, self._guard)
        self._abstract = any(d.is_abstract for d in binding.tensors)  # never parked
        # A flat list of bound tensors (one per layer, the usual engine structure): the slot
        # of each entry, so a load's results are put in place by index.
        self._positions: list[int] | None = None
        if type(source) is list:
            slot_of = {id(x): k for k, x in enumerate(self._objs)}
            positions = [slot_of.get(id(x), -1) for x in source]
            if -1 not in positions and len(slot_of) == len(self._objs):
                self._positions = positions

    # --- kept between one-shot calls (kvgroups_core.transfer.fast.reuse) -----------------

    @property
    def bound_tensors(self) -> list | None:
        """The bound tensors in tensor_index order (what :attr:`kv_caches` holds now; None while
        released)."""
        return self._objs

    @property
    def bound_structure(self) -> Any:
        """The private copy of the engine's structure the binding was made from (or last took
        back): what a kept binding compares the next one-shot call's caches with."""
        return self._guard.source

    def release_caches(self) -> bool:
        """Let go of every cache tensor, keeping what was derived from them (False, and
        nothing changed, when the backend's hold cannot, or the caches are abstract)."""
        if self._abstract or not self._bound.release():
            return False
        # None while parked: _restore sets them before anything reads them again.
        self.kv_caches = self._objs = self._described = None  # type: ignore[assignment]
        self._guard.release()
        self._memo.release()  # its references to the released tensors (signatures stay)
        return True

    def restore_caches(self, kv_caches: Any, objs: list, source: Any) -> None:
        """Take back the caches :meth:`release_caches` let go of: ``kv_caches`` is the
        engine's structure, ``source`` the private copy of it whose leaves matched the
        released ones, ``objs`` its bound tensors in tensor_index order. The next call compares
        their fingerprints (:meth:`reallocated`) before trusting the binding."""
        self.kv_caches, self._objs = kv_caches, objs
        self._bound.restore(objs)
        self._guard.restore(source, objs)

    def reallocated(self) -> str | None:
        """A sentence naming the first bound tensor resized, reallocated or changed in place
        since it was bound, or None (the structure itself is not compared)."""
        return self._guard.reallocated()


def _plan(
    prepared: PreparedTransfer,
    direction: Direction,
    block_ids: Any,
    skip_first_n_tokens: Any,
    layers: Any,
    max_ctas: int | None,
    path: str | None,
) -> Any:
    """The plan of one prepared call, its per-call inputs validated (planner.plan_call)."""
    return plan_call(
        prepared._plans,
        block_ids,
        direction,
        skip_first_n_tokens=skip_first_n_tokens,
        to_host=prepared._to_host,
        ids_spec=prepared._ids_spec,
        layers=layers,
        max_ctas=max_ctas,
        path=path,
        paths=prepared.backend.transfer_paths,
    )


def _check_call_objects(prepared: PreparedTransfer, plan: Any, objects: Any) -> None:
    """The object checks a prepared call makes before its backend runs, in its order: memory
    (check_call_memory), then the object rule and the backend's (BoundCaches.execute)."""
    check_call_memory(prepared._guard, plan, objects)
    check_objects(plan, objects, prepared.backend.shape_of)
    prepared.backend.validate_objects(plan, prepared._bound.caches, objects)


# The prepared calls' bodies are module functions (the methods above delegate): a runtime's
# compiler can then substitute them by identity (kvgroups_torch.compile.dynamo does, for Dynamo).
def prepared_store(
    prepared: PreparedTransfer,
    block_ids: Any,
    objects: Any = None,
    *,
    layers: Any = None,
    max_ctas: int | None = None,
    path: str | None = None,
) -> list:
    """:meth:`PreparedTransfer.store`."""
    with prepared._lock:
        key = None
        if objects is not None:  # a repeated call of a validated signature: see call_memo
            key = call_key(prepared._ids_key, "store", block_ids, layers, max_ctas, 0, path)
            if key is not None:
                done = prepared._memo.call(key, block_ids, objects, prepared.kv_caches)
                if done is not None:
                    return done[1]
        prepared._check_current()
        return _store_locked(prepared, block_ids, objects, layers, max_ctas, key, path)


def _store_locked(
    prepared: PreparedTransfer,
    block_ids: Any,
    objects: Any,
    layers: Any,
    max_ctas: int | None,
    key: tuple | None = None,
    path: str | None = None,
) -> list:
    plan = _plan(prepared, "store", block_ids, 0, layers, max_ctas, path)
    if objects is None:
        if plan.num_chunks == 0:  # real, empty arrays: no backend program runs
            return prepared._empty_objects(plan)
        objects = prepared._bound.allocate_objects(plan)
    else:
        check_call_memory(prepared._guard, plan, objects)
    if plan.num_chunks == 0:
        return prepared._nothing_to_move(plan, objects)
    new_caches, out = prepared._run(plan, objects)
    if key is not None and new_caches is None:
        prepared._memo.record(key, plan, block_ids, objects)
    return out


def prepared_load(
    prepared: PreparedTransfer,
    objects: Any,
    block_ids: Any,
    *,
    skip_first_n_tokens: Any = 0,
    layers: Any = None,
    max_ctas: int | None = None,
    path: str | None = None,
) -> Any:
    """:meth:`PreparedTransfer.load`."""
    with prepared._lock:
        key = call_key(
            prepared._ids_key, "load", block_ids, layers, max_ctas, skip_first_n_tokens, path
        )
        if key is not None:  # a repeated call of a validated signature: see call_memo
            done = prepared._memo.call(key, block_ids, objects, prepared.kv_caches)
            if done is not None:
                return _adopt_load_results(prepared, done[0])
        prepared._check_current()
        return _load_locked(
            prepared, objects, block_ids, skip_first_n_tokens, layers, max_ctas, key, path
        )


def _load_locked(
    prepared: PreparedTransfer,
    objects: Any,
    block_ids: Any,
    skip_first_n_tokens: Any,
    layers: Any,
    max_ctas: int | None,
    key: tuple | None = None,
    path: str | None = None,
) -> Any:
    plan = _plan(prepared, "load", block_ids, skip_first_n_tokens, layers, max_ctas, path)
    check_call_memory(prepared._guard, plan, objects)
    if plan.num_chunks == 0:
        prepared._nothing_to_move(plan, objects)
        return prepared.kv_caches
    new_caches, _ = prepared._run(plan, objects)
    if new_caches is None and key is not None:
        prepared._memo.record(key, plan, block_ids, objects)
    return _adopt_load_results(prepared, new_caches)


def _adopt_load_results(prepared: PreparedTransfer, new_caches: Any) -> Any:
    """The caches after a load: the same ones (written in place), or the runtime's new arrays
    put in the engine's structure and bound (JAX)."""
    if new_caches is None:
        return prepared.kv_caches
    if prepared._positions is not None:
        prepared.kv_caches = [new_caches[i] for i in prepared._positions]
    else:
        new_by_id = {id(x): new for x, new in zip(prepared._objs, new_caches)}
        prepared.kv_caches = _replace_leaves(prepared.kv_caches, new_by_id)
    if prepared._bound.adopt_results(new_caches):
        # Same layouts one for one: the plans stay valid; the descriptors (which would
        # keep the replaced arrays alive) are dropped and remade only if read.
        prepared._objs = list(new_caches)
        prepared._described = None
        prepared._guard.adopt(prepared.kv_caches, prepared._objs)
        prepared._memo.clear()  # its fingerprints are of the replaced arrays
    else:
        prepared._rebind()
    return prepared.kv_caches


def prepare(manager: Any, kv_caches: Any, *, backend: str | None = None) -> PreparedTransfer:
    """Bind ``manager`` to ``kv_caches`` once for repeated :meth:`PreparedTransfer.store` /
    :meth:`PreparedTransfer.load` calls (each takes ``layers=`` too)."""
    return PreparedTransfer(manager, kv_caches, backend=backend)


def _one_shot(
    manager: Any, kv_caches: Any, objects: Any, backend: str | None
) -> tuple[PreparedTransfer, Any]:
    """The binding of a one-shot call: the backend is found once (from the caches and the
    objects, so two frameworks are refused) and the caches are bound once, or taken back
    from the manager's last one-shot call on the same caches
    (:mod:`kvgroups_core.transfer.fast.reuse`)
    when none of them was resized or reallocated since. The transfer is this call's own
    (nobody else holds it): the call runs it without its lock."""
    parked = reuse.take(manager, kv_caches)
    if parked is not None:
        entry, leaves, objs, source = parked
        # The leaves are the ones that passed this check before (one framework): the first
        # stands for them all against the objects.
        try:
            found = backend_for_tensors(
                leaves[:1] + _leaves(objects), backend, lambda i: _call_name(i, 1, objects)
            )
        except KVGroupsError:  # objects of another framework: refused, the park stays
            reuse.put_back(manager, entry)
            raise
        if found is entry.prepared.backend:
            prepared = reuse.restore(entry, kv_caches, objs, source)
            if prepared.reallocated() is None:  # take() compared the identities
                return prepared, entry
            # Changed in place: bound afresh below, refused (if so) as a first call is.
    check_manager(manager)  # before the caches are read (a parked call had a manager)
    cache_leaves = _leaves(kv_caches)
    found = backend_for_tensors(
        cache_leaves + _leaves(objects),
        backend,
        lambda i: _call_name(i, len(cache_leaves), objects),
        what="kv_caches",
    )
    return PreparedTransfer(manager, kv_caches, backend=cast(Backend, found)), None


def _call_name(i: int, num_caches: int, objects: Any) -> str:
    """The argument a one-shot call's tensor ``i`` came from (its caches' leaves, then its
    objects' in :func:`_leaves` order), for a refusal of two frameworks in one call."""
    if i < num_caches:
        return "kv_caches"
    names: list[str] = []
    for g, entry in enumerate(objects or ()):
        if isinstance(entry, (list, tuple)):
            names.extend(f"objects[{g}][{c}]" for c, x in enumerate(entry) if x is not None)
        elif entry is not None:
            names.append(f"objects[{g}]")
    i -= num_caches
    return names[i] if i < len(names) else "objects"


def _park_after_refusal(
    manager: Any, prepared: PreparedTransfer, entry: Any, kv_caches: Any
) -> None:
    """A refused call (bad ids or objects) moved nothing and left the binding as it was:
    kept for the next call, unless the transfer no longer holds the caches it was given."""
    if prepared.kv_caches is kv_caches:
        reuse.park(manager, prepared, entry)


def store(
    manager: Any,
    kv_caches: Any,
    block_ids: Any,
    objects: Sequence[Any] | None = None,
    *,
    backend: str | None = None,
    layers: Sequence[int] | None = None,
    max_ctas: int | None = None,
    path: str | None = None,
) -> list:
    """Copy the pages of ``block_ids`` from ``kv_caches`` into memory objects.

    Parameters
    ----------
    manager : KVLayerGroupsManager
        The grouping of these caches.
    kv_caches
        The engine's structure (tensor / list / list of lists) of framework tensors, matching
        what ``manager`` was built from.
    block_ids
        Flat ids (one engine group only), or one 1-D sequence per engine group (list indexed by
        engine group id, or a mapping), covering whole chunks.
    objects : list, optional
        One ``[num_chunks, object_nbytes]`` uint8 array per object group (or a list of
        per-chunk buffers) to fill; allocated on the caches' device when omitted.
    backend : str, optional
        A registered backend name; by default the caches' framework.
    layers : sequence of int, optional
        Move only these layers' planes (indices of the manager's grouped layers), into their
        regions of full-size objects; every other byte of the objects stays as it was.
    max_ctas : int, optional
        Cap on the concurrent work units (CUDA: CTAs) of each kernel launch, leaving the rest
        of the GPU to concurrent work such as the forward pass; backends without such a
        knob ignore it.
    path : str, optional
        How the bytes move: ``"auto"`` (default, the backend's choice), ``"kernel"``, or a
        backend's other mechanism (torch: ``"copy_engine"``); see docs/DESIGN.md.

    Returns
    -------
    list
        The objects, one per object group (new arrays in their donated buffers for JAX).
    """
    if objects is not None and not isinstance(objects, (list, tuple)):
        objects = [objects]
    prepared, entry = _one_shot(manager, kv_caches, objects, backend)
    try:
        key = None
        if objects is not None:  # a repeated call of a validated signature: see call_memo
            key = call_key(prepared._ids_key, "store", block_ids, layers, max_ctas, 0, path)
            # A taken-back binding (entry) compared every fingerprint in _one_shot.
            done = (
                None
                if key is None
                else prepared._memo.call(
                    key, block_ids, objects, prepared.kv_caches, entry is not None
                )
            )
            if done is not None:
                reuse.park(manager, prepared, entry)
                return done[1]
        out = _store_locked(prepared, block_ids, objects, layers, max_ctas, key, path)
    except KVGroupsError:
        _park_after_refusal(manager, prepared, entry, kv_caches)
        raise
    reuse.park(manager, prepared, entry)
    return out


def load(
    manager: Any,
    objects: Sequence[Any],
    kv_caches: Any,
    block_ids: Any,
    *,
    skip_first_n_tokens: Any = 0,
    backend: str | None = None,
    layers: Sequence[int] | None = None,
    max_ctas: int | None = None,
    path: str | None = None,
) -> Any:
    """Write memory objects back into the pages of ``block_ids``, in place.

    Skips, per kernel group, the chunks outside its attention window and the first
    ``skip_first_n_tokens`` tokens (whole blocks, rounded down) already in the engine (a host
    int, or a device / traced integer scalar applied on the device). ``layers`` restricts
    the load to those layers' planes, read from their regions of the full objects;
    ``max_ctas`` caps each launch's CTAs and ``path`` picks the copy mechanism as for
    :func:`store`.

    Returns
    -------
    The caches: the same objects for runtimes that write in place (torch, NumPy); new arrays
    reusing the donated input buffers for JAX (the caches passed in are consumed).
    """
    if not isinstance(objects, (list, tuple)):
        objects = [objects]
    prepared, entry = _one_shot(manager, kv_caches, objects, backend)
    try:
        # A repeated call of a validated signature: see call_memo.
        key = call_key(
            prepared._ids_key, "load", block_ids, layers, max_ctas, skip_first_n_tokens, path
        )
        done = (
            None
            if key is None
            else prepared._memo.call(key, block_ids, objects, prepared.kv_caches, entry is not None)
        )
        if done is not None:
            out = _adopt_load_results(prepared, done[0])
            reuse.park(manager, prepared, entry)
            return out
        out = _load_locked(
            prepared, objects, block_ids, skip_first_n_tokens, layers, max_ctas, key, path
        )
    except KVGroupsError:
        _park_after_refusal(manager, prepared, entry, kv_caches)
        raise
    reuse.park(manager, prepared, entry)
    return out


__all__ = [
    "PreparedTransfer",
    "load",
    "prepare",
    "prepared_load",
    "prepared_store",
    "store",
    "TensorSpec",
]
