"""One error hierarchy: catch ``KVGroupsError`` for everything, or the builtin you expect.

Every leaf also subclasses the builtin a Python user would catch, so ``except ValueError``
keeps working for code written against LMCache.
"""

from __future__ import annotations

import warnings
from typing import Any


class KVGroupsError(Exception):
    """Root of every error kvgroups raises on purpose."""


class KVGroupsValueError(KVGroupsError, ValueError):
    """A bad value, shape or layout (including non-contiguous layouts we cannot undo)."""


class KVGroupsTypeError(KVGroupsError, TypeError):
    """A wrong type, or tensors of two frameworks in one call."""


class KVGroupsIndexError(KVGroupsError, IndexError):
    """An index (kernel group, block id, layer) outside its range."""


class UnsupportedConfigError(KVGroupsError, NotImplementedError):
    """A configuration this backend cannot run (the format itself may be valid)."""


class BackendNotFoundError(KVGroupsError, LookupError):
    """No registered backend can handle the given tensors or name."""


class KernelCompileError(KVGroupsError, RuntimeError):
    """A GPU kernel failed to compile or load."""


class CompileForbiddenError(KernelCompileError):
    """Compiling was forbidden (``KVGROUPS_NO_COMPILE=1``) and no cached binary exists."""


def mismatch(what: str, expected: object, actual: object) -> str:
    """A uniform message: ``what: expected X, got Y``."""
    return f"{what}: expected {expected}, got {actual}"


#: Old names of the error classes (before they all ended in ``Error``): importable, with a
#: ``DeprecationWarning``, for at least one minor version.
DEPRECATED_ALIASES = {
    "UnsupportedConfig": "UnsupportedConfigError",
    "BackendNotFound": "BackendNotFoundError",
    "CompileForbidden": "CompileForbiddenError",
}


def deprecated_alias(module: str, name: str, aliases: dict[str, str], namespace: dict) -> Any:
    """The object ``aliases[name]`` names in ``namespace``, with a ``DeprecationWarning`` that
    says what replaced it (the body of a module ``__getattr__``)."""
    if name not in aliases:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new = aliases[name]
    warnings.warn(f"{module}.{name} is deprecated: use {new}", DeprecationWarning, stacklevel=3)
    return namespace[new]


def __getattr__(name: str) -> Any:
    return deprecated_alias(__name__, name, DEPRECATED_ALIASES, globals())
