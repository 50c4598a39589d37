"""The public calls a user makes, as timed callables for the benchmark runner.

Each measured case is one of :data:`CALLS` with block ids kept on the host (NumPy) or on the
device (the runtime's own arrays), through ``kvgroups_core.store`` / ``load`` / ``prepare``:

``store`` / ``load``
    The one-shot calls (the record's ``call`` is its direction).
``prepared``
    ``prepare(manager, caches).store`` / ``.load``.
``layerwise``
    The prepared call once per layer (``layers=[l]``), all layers summed: the whole model
    moved as a layer-by-layer engine moves it.
``jit`` (JAX), ``graph`` (torch CUDA)
    Asked of the kit (:meth:`jit_call` / :meth:`graph_call`): the call inside ``jax.jit`` with
    traced ids, or a CUDA-graph replay of a prepared call with device ids.

Ids a backend would read to the host anyway (torch CPU tensors, concrete JAX arrays) are not
device ids: such a case is refused (:class:`Refused`) and recorded as skipped, never labelled
``device``. A kernel path is chosen as a user chooses it: the default backend, or a backend
instance registered under a name (``register_backend("jax-mosaic", JaxBackend("mosaic"))``)
and passed as ``backend=``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import kvgroups_core as kc
from kvgroups_core.tensors.arrays import backend_for_tensors

#: Every call a record can name; ``internal`` marks the engine's own entry points.
CALLS = ("store", "load", "prepared", "jit", "graph", "layerwise")
IDS = ("host", "device")


class Refused(Exception):
    """A case that cannot be measured honestly here; the message says why."""


def applies(call: str, direction: str) -> bool:
    """One-shot calls are named by their direction; the others run both directions."""
    return call == direction if call in ("store", "load") else True


@dataclass
class Case:
    """What a public call acts on: the manager, the workload (``wl.caches`` in the engine's
    structure), one id structure per rotation, the backend name (None: the default)."""

    manager: Any
    wl: Any
    ids: list
    backend: str | None
    direction: str
    layers: int
    rotate: int  # object sets (and id sets) the calls cycle through


def adopt(wl: Any, new_caches: Any) -> None:
    """Put a load's results in place (JAX returns new arrays; torch the same tensors), keeping
    the tensor_index-ordered list the engine's internal paths use in step."""
    new = list(new_caches)
    for i, (old, x) in enumerate(zip(wl.caches, new)):
        if x is not old:
            wl.tensors[wl.positions[i]] = x
    wl.caches = new


def check_device_ids(case: Case, ids: Any) -> None:
    """Refuse ids the backend would convert to host ids (then they are not device ids)."""
    leaf = next(iter(ids.values())) if isinstance(ids, dict) else ids
    backend = backend_for_tensors(case.wl.caches[:1], case.backend)
    if backend.device_ids_spec(leaf) is None:
        raise Refused(
            f"ids: the {getattr(backend, 'name', backend)} backend reads "
            f"{type(leaf).__name__} ids to the "
            "host (they are host ids here)"
        )


def eager_call(case: Case, call: str) -> Callable[[int], None]:
    """``fn(i)``: rotation ``i % n`` of a one-shot, prepared or layer-wise call."""
    wl, m, ids, be = case.wl, case.manager, case.ids, case.backend
    n = len(ids)
    store = case.direction == "store"
    if call in ("store", "load"):
        if store:

            def fn(i: int) -> None:
                r = i % n
                wl.objects[r] = list(kc.store(m, wl.caches, ids[r], wl.objects[r], backend=be))
        else:

            def fn(i: int) -> None:
                r = i % n
                adopt(wl, kc.load(m, wl.objects[r], wl.caches, ids[r], backend=be))

        return fn
    prep = kc.prepare(m, wl.caches, backend=be)
    layer_sets = [[k] for k in range(case.layers)] if call == "layerwise" else [None]
    if store:

        def fn(i: int) -> None:
            r = i % n
            for layers in layer_sets:
                wl.objects[r] = list(prep.store(ids[r], wl.objects[r], layers=layers))
    else:

        def fn(i: int) -> None:
            r = i % n
            for layers in layer_sets:
                adopt(wl, prep.load(wl.objects[r], ids[r], layers=layers))

    return fn


def make_call(kit: Any, case: Case, call: str, ids_kind: str) -> Callable[[int], None]:
    """The timed callable of ``call`` with ``ids_kind`` ids, or :class:`Refused`."""
    if ids_kind == "device":
        case.ids = [kit.device_ids(x) for x in case.ids]
        if call not in ("jit", "graph"):  # traced there: device ids by construction
            check_device_ids(case, case.ids[0])
    if call == "jit":
        return kit.jit_call(case, ids_kind)
    if call == "graph":
        return kit.graph_call(case, ids_kind)
    return eager_call(case, call)
