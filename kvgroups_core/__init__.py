"""kvgroups_core: framework-free KV layer grouping and page-transfer planning.

Imports no framework, ever (NumPy only). Backends for PyTorch and JAX live in the separate
packages ``kvgroups_torch`` and ``kvgroups_jax`` and are found from the tensors you pass.
"""

from .descriptors import TensorDesc, TensorSpec, describe
from .dtypes import DTYPE_MAP, DType
from .errors import (
    BackendNotFound,
    CompileForbidden,
    KernelCompileError,
    KVGroupsError,
    KVGroupsIndexError,
    KVGroupsTypeError,
    KVGroupsValueError,
    UnsupportedConfig,
)
from .formats import MUST_HAVE_FORMATS, EngineKVFormat
from .registry import Backend, get_backend, register_backend, unregister_backend

__version__ = "0.1.0"

__all__ = [
    "DTYPE_MAP",
    "MUST_HAVE_FORMATS",
    "Backend",
    "BackendNotFound",
    "CompileForbidden",
    "DType",
    "EngineKVFormat",
    "KVGroupsError",
    "KVGroupsIndexError",
    "KVGroupsTypeError",
    "KVGroupsValueError",
    "KernelCompileError",
    "TensorDesc",
    "TensorSpec",
    "UnsupportedConfig",
    "describe",
    "get_backend",
    "register_backend",
    "unregister_backend",
]
