"""The ``path=`` argument of the transfer calls: which copy mechanism a backend uses.

Every backend accepts ``"auto"`` (its own choice, the default) and ``"kernel"``; a backend
with another mechanism lists it in ``Backend.transfer_paths`` (torch: ``"copy_engine"``, the
GPU's DMA engines). The core checks the value once, before any byte moves.
"""

from __future__ import annotations

from typing import Any

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError

DEFAULT_PATHS = ("auto", "kernel")


def check_path(path: Any, allowed: tuple[str, ...] = DEFAULT_PATHS) -> str:
    """``path`` when it is one of ``allowed``; a typed error naming ``path`` otherwise."""
    if not isinstance(path, str):
        raise KVGroupsTypeError(
            f"path: expected one of {', '.join(map(repr, allowed))}, got {type(path).__name__}"
        )
    if path not in allowed:
        raise KVGroupsValueError(
            f"path: expected one of {', '.join(map(repr, allowed))}, got {path!r}"
        )
    return path
