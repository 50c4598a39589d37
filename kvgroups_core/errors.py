"""One error hierarchy: catch ``KVGroupsError`` for everything, or the builtin you expect.

Every leaf also subclasses the builtin a Python user would catch, so ``except ValueError``
keeps working for code written against LMCache.
"""

from __future__ import annotations


class KVGroupsError(Exception):
    """Root of every error kvgroups raises on purpose."""


class KVGroupsValueError(KVGroupsError, ValueError):
    """A bad value, shape or layout (including non-contiguous layouts we cannot undo)."""


class KVGroupsTypeError(KVGroupsError, TypeError):
    """A wrong type, or tensors of two frameworks in one call."""


class KVGroupsIndexError(KVGroupsError, IndexError):
    """An index (kernel group, block id, layer) outside its range."""


class UnsupportedConfig(KVGroupsError, NotImplementedError):
    """A configuration this backend cannot run (the format itself may be valid)."""


class BackendNotFound(KVGroupsError, LookupError):
    """No registered backend can handle the given tensors or name."""


class KernelCompileError(KVGroupsError, RuntimeError):
    """A GPU kernel failed to compile or load."""


class CompileForbidden(KernelCompileError):
    """Compiling was forbidden (``KVGROUPS_NO_COMPILE=1``) and no cached binary exists."""


def mismatch(what: str, expected: object, actual: object) -> str:
    """A uniform message: ``what: expected X, got Y``."""
    return f"{what}: expected {expected}, got {actual}"
