"""Caches owned by another framework (torch) and imported into JAX through DLPack.

On GPU a donated, aliased kernel writes straight into the imported memory. The CPU client
instead copies buffers it does not own when they are donated: the load lands in a new buffer
and the owner never sees it. We detect that by comparing buffer pointers before and after the
call: the input pointer changed and the input was consumed. Caches imported with
:func:`import_dlpack` are then written back (only the moved blocks). Any other such cache gets
an :class:`InPlaceCopyWarning`: the CPU client also aliases NumPy arrays given to
``jax.device_put`` and copies them the same way, where the returned arrays are the result and
nothing is lost, so pointers alone cannot tell a lost torch write from that; the warning says
so instead of staying silent. On GPU a copied foreign cache raises :class:`InPlaceWriteLostError`.
"""

from __future__ import annotations

import ctypes
import warnings
import weakref
from typing import Any

import jax
import numpy as np

from kvgroups_core.errors import KVGroupsError

# JAX buffer pointer -> (weak reference to the producer or the producer itself, the
# producer's own pointer: equal unless the import had to copy, e.g. misaligned memory)
_IMPORTED: dict[int, tuple[Any, int]] = {}


class InPlaceWriteLostError(KVGroupsError, RuntimeError):
    """A load into foreign memory landed in a copy that the owner cannot see.

    ``caches`` holds the new JAX arrays (with the loaded bytes) in tensor_index order.
    """

    def __init__(self, message: str, caches: list | None = None):
        super().__init__(message)
        self.caches = caches


class InPlaceCopyWarning(RuntimeWarning):
    """A donated cache was copied instead of written in place (CPU client, memory that XLA
    does not own); the returned arrays hold the result, the original memory does not."""


def import_dlpack(x: Any) -> jax.Array:
    """Import ``x`` (a torch tensor or any DLPack producer) zero-copy, remembering its owner so
    a CPU load can write back into it.

    Parameters
    ----------
    x : a contiguous tensor exposing ``__dlpack__`` (export fp8 torch tensors as uint8 views).

    Returns
    -------
    jax.Array sharing ``x``'s memory.
    """
    from kvgroups_core.tensors.descriptors import describe_dlpack

    owner_ptr = describe_dlpack(x).address
    arr = jax.dlpack.from_dlpack(x)
    ptr = arr.unsafe_buffer_pointer() if arr.size else 0
    try:
        owner: Any = weakref.ref(x)
    except TypeError:
        owner = x  # not weak-referenceable: keep it alive while registered
    _IMPORTED[ptr] = (owner, owner_ptr)
    return arr


def any_imported(pointers: list[int]) -> bool:
    """Whether any of these buffer pointers is an :func:`import_dlpack` of a live registry
    entry (such caches may need a CPU load written back: :func:`check_in_place`)."""
    return bool(_IMPORTED) and not _IMPORTED.keys().isdisjoint(pointers)


def _owner_alive(ptr: int) -> bool:
    entry = _IMPORTED.get(ptr)
    if entry is None:
        return False
    owner = entry[0]
    return owner() is not None if isinstance(owner, weakref.ref) else True


def block_extents(plan, index: int) -> list[tuple[int, int]]:
    """``(byte_start, byte_stop)`` of every block the load wrote in tensor ``index``."""
    spans = []
    for group in plan.groups:
        lo = min(r.cache_offset for r in group.runs)
        hi = max(
            r.cache_offset
            + (r.count - 1) * r.cache_step
            + (group.block_size - 1) * r.token_stride
            + r.nbytes
            for r in group.runs
        )
        _, _, block_ids = group.items()
        for plane in group.planes:
            if plane.tensor_index != index:
                continue
            for b in np.asarray(block_ids, dtype=np.int64):
                start = plane.byte_offset + int(b) * group.block_stride_bytes
                spans.append((start + lo, start + hi))
    return spans


def check_in_place(plan, before: list[int], inputs: list, outputs: list) -> None:
    """After a load: write back or raise where a cache was copied instead of written in place.

    ``before`` are the input buffer pointers (0 for abstract values, which are skipped).
    """
    lost, copied = [], []
    for index, (ptr, x, y) in enumerate(zip(before, inputs, outputs)):
        if not ptr or not isinstance(y, jax.Array) or isinstance(y, jax.core.Tracer):
            continue
        new_ptr = y.unsafe_buffer_pointer()
        on_cpu = next(iter(y.devices())).platform == "cpu"
        if _owner_alive(ptr):
            owner_ptr = _IMPORTED[ptr][1]
            if new_ptr == owner_ptr:
                continue
            if not on_cpu:
                lost.append(index)
                continue
            y.block_until_ready()
            for start, stop in block_extents(plan, index):
                ctypes.memmove(owner_ptr + start, new_ptr + start, stop - start)
            continue
        if not x.is_deleted():
            continue  # donation refused (an external reference): plain JAX semantics
        if new_ptr == ptr:
            continue
        if on_cpu:
            copied.append(index)
        else:
            lost.append(index)
    if copied:
        warnings.warn(
            f"caches {copied}: the load wrote new buffers, not the donated ones (the CPU client "
            "copies memory it does not own: NumPy arrays it aliased, or DLPack imports). Use "
            "the returned caches; to write a torch CPU tensor in place import it with "
            "kvgroups_jax.import_dlpack",
            InPlaceCopyWarning,
            stacklevel=4,
        )
    if lost:
        raise InPlaceWriteLostError(
            f"caches {lost}: expected the load to write the donated buffers in place, got new "
            "buffers (the runtime copied memory it does not own); load such caches with their "
            "owner's backend. The loaded arrays are in this error's .caches",
            caches=list(outputs),
        )


#: Old names, deprecated (before every error class ended in ``Error``).
DEPRECATED_ALIASES = {"InPlaceWriteLost": "InPlaceWriteLostError"}


def __getattr__(name: str) -> Any:
    from kvgroups_core.errors import deprecated_alias

    return deprecated_alias(__name__, name, DEPRECATED_ALIASES, globals())
