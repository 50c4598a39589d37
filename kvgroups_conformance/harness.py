"""The harness protocol: what the conformance suite needs from a backend under test.

A harness makes the backend's arrays from NumPy arrays, reads them back bit-exactly, and names
the registered backend that moves them. Every other operation (objects, store, load, handing
arrays between backends) has a default built on those three, so a backend author usually
writes::

    class MyHarness(Harness):
        def __init__(self):
            super().__init__("my-backend", "my_backend")   # test id, registered name

        def from_numpy(self, a):              # a NumPy array (bfloat16 / float8 via ml_dtypes)
            return MyArray.from_bytes(a)

        def to_numpy(self, x, like):          # like: a NumPy array of the wanted dtype
            return x.as_numpy().view(like.dtype)

or nothing at all: the defaults go through the backend's own :meth:`Backend.from_numpy` and
:meth:`Backend.to_numpy` (the registry's array plumbing), so ``Harness("x", "x")`` tests a
backend that implements them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import numpy as np

from kvgroups_conformance.caches import copy_keeping_strides
from kvgroups_core import get_backend
from kvgroups_core.transfer.api import load, store

#: Entry point group where a backend package may name its harness (a Harness subclass or a
#: factory returning a Harness), under the backend's registered name.
HARNESS_ENTRY_POINTS = "kvgroups.conformance"

#: NumPy dtypes a backend's from_numpy takes directly; others travel as raw bits + a name.
_NATIVE_KINDS = "biuf"


def _is_native(dtype: np.dtype) -> bool:
    return dtype.kind in _NATIVE_KINDS and not dtype.name.startswith(("bfloat", "float8"))


@dataclass
class Harness:
    """How the suite drives one backend.

    ``id`` names the harness in test ids and reports; ``backend`` is the registered backend
    name passed as ``backend=`` to every store and load; ``placements`` are the object
    placements the round trips try (``None``: next to the caches; ``"pinned"`` for a GPU
    backend with pinned host objects).
    """

    id: str
    backend: str
    placements: tuple[str | None, ...] = (None,)
    #: True when from_numpy keeps a padded array's strides and to_numpy returns the padding
    #: too: the padded-block case then also checks that no padding byte changed.
    keeps_padding: bool = False
    #: ``"full"`` (the whole matrix) or ``"small"`` (every format, dtype and feature at least
    #: once: :mod:`kvgroups_conformance.cases`). None: what the backend declares in its
    #: ``conformance_cases`` attribute (an interpreter whose every new program compiles for
    #: seconds says ``"small"``), else ``"full"``. ``--cases`` overrides it.
    cases: str | None = None

    # The three operations a backend author may override -----------------------------------
    def from_numpy(self, a: np.ndarray) -> Any:
        """A new array of the backend holding ``a``'s bytes, shape and dtype."""
        be = get_backend(self.backend)
        if _is_native(a.dtype):
            return be.from_numpy(np.ascontiguousarray(a))
        bits = np.ascontiguousarray(a).view(f"uint{a.dtype.itemsize * 8}")
        return be.from_numpy(bits, dtype=a.dtype.name)

    def to_numpy(self, x: Any, like: np.ndarray) -> np.ndarray:
        """A host copy of ``x``, bit-exact, viewed as ``like``'s dtype."""
        out = np.asarray(get_backend(self.backend).to_numpy(x))
        if out.dtype != like.dtype and out.dtype.itemsize == like.dtype.itemsize:
            out = out.view(like.dtype)
        return out

    def case_set(self) -> str:
        """The cases this harness runs by default: ``"full"`` or ``"small"``."""
        if self.cases is not None:
            return self.cases
        return getattr(get_backend(self.backend), "conformance_cases", "full")

    def supports(self, fmt: Any, dtype: str) -> bool:
        """False for a configuration the backend cannot run: the suite then asserts that
        store raises a NotImplementedError subclass (``UnsupportedConfigError``) for it."""
        return True

    # Defaults built on them -----------------------------------------------------------------
    def zeros_objects(
        self, nbytes: tuple[int, ...], num_chunks: int, placement: str | None
    ) -> list:
        """One zeroed ``[num_chunks, n]`` uint8 object array per object group."""
        return [self.from_numpy(np.zeros((num_chunks, n), np.uint8)) for n in nbytes]

    def adopt(self, x: Any) -> Any:
        """Take an array another backend made (objects handed between runtimes)."""
        return get_backend(self.backend).import_foreign(x)

    def store(self, manager, caches, ids, objects=None, layers=None):
        return store(manager, caches, ids, objects, backend=self.backend, layers=layers)

    def load(self, manager, objects, caches, ids, skip=0, layers=None):
        return load(
            manager,
            objects,
            caches,
            ids,
            skip_first_n_tokens=skip,
            backend=self.backend,
            layers=layers,
        )

    # Structure helpers ------------------------------------------------------------------------
    def convert(self, structure: Any) -> Any:
        """``from_numpy`` over a nested list/tuple structure of arrays."""
        if isinstance(structure, list):
            return [self.convert(x) for x in structure]
        if isinstance(structure, tuple):
            return tuple(self.convert(x) for x in structure)
        return self.from_numpy(structure)

    def read(self, structure: Any, like: Any) -> Any:
        """``to_numpy`` over a nested structure (lists come back for tuples too)."""
        if isinstance(structure, (list, tuple)):
            return [self.read(x, y) for x, y in zip(structure, like)]
        return self.to_numpy(structure, like)


class ReferenceHarness(Harness):
    """The NumPy reference backend, with padded caches kept padded."""

    def __init__(self) -> None:
        super().__init__("numpy-ref", "numpy", keeps_padding=True)

    def from_numpy(self, a: np.ndarray) -> np.ndarray:
        return copy_keeping_strides(a)

    def to_numpy(self, x: np.ndarray, like: np.ndarray) -> np.ndarray:
        out = copy_keeping_strides(x)
        return out.view(like.dtype) if out.dtype != like.dtype else out


def reference_harness() -> Harness:
    """The NumPy reference backend: the other side of every cross-backend pair."""
    return ReferenceHarness()


def _load_object(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"harness: expected 'module:attribute', got {spec!r}")
    return getattr(importlib.import_module(module_name), attr)


def _instantiate(obj: Any, backend: str) -> Harness:
    harness = obj() if callable(obj) and not isinstance(obj, Harness) else obj
    if not isinstance(harness, Harness):
        raise TypeError(
            f"harness for {backend!r}: expected a Harness, got {type(harness).__name__}"
        )
    return harness


def harness_for(backend: str, spec: str | None = None) -> Harness:
    """The harness that tests registered backend ``backend``.

    ``spec`` (``"module:attr"``) names a Harness subclass, instance or factory; otherwise the
    backend package's entry point in :data:`HARNESS_ENTRY_POINTS` under the same name is
    used, else the default ``Harness(backend, backend)``.
    """
    get_backend(backend)  # a clear BackendNotFoundError, listing what is registered, comes first
    if spec:
        return _instantiate(_load_object(spec), backend)
    for ep in entry_points(group=HARNESS_ENTRY_POINTS):
        if ep.name == backend:
            return _instantiate(ep.load(), backend)
    return Harness(backend, backend)
