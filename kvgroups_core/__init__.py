"""kvgroups_core: framework-free KV layer grouping and page-transfer planning.

Imports no framework, ever (NumPy only). Backends for PyTorch and JAX live in the separate
packages ``kvgroups_torch`` and ``kvgroups_jax`` and are found from the tensors you pass.
"""

from .attn_window import AttnWindowDesc
from .descriptors import TensorDesc, TensorSpec
from .detection import detect_format, normalize_and_discover_per_layer_formats
from .dtypes import DTYPE_MAP, DType
from .engine_groups import (
    EngineGroupInfo,
    expand_engine_block_ids,
    get_engine_group_indices,
    slice_block_ids_per_group,
)
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
from .formats import MUST_HAVE_FORMATS, STATE_FORMATS, EngineKVFormat
from .grouping import (
    EXCLUDED_ENGINE_GROUP,
    KernelGroupIdentity,
    KernelGroupInfo,
    ObjectGroupInfo,
    PageBufferShapeDesc,
    group_layers_by_identity,
)
from .manager import KVLayerGroupsManager
from .objects import Region, object_nbytes, object_regions, region_view
from .plan import GroupTransfer, PlaneRef, TransferPlan
from .registry import Backend, describe, get_backend, register_backend, unregister_backend
from .shape_spec import (
    format_kvcache_shape_spec,
    manager_from_shape_spec,
    parse_kvcache_shape_spec,
)
from .state_layout import conv_format, state_page_offsets
from .tensor_parallel import OBJECT_LAYOUTS, TPShard
from .tp_convert import canonical_nbytes, merge_shards, rank_byte_ranges, split_canonical
from .transfer import PreparedTransfer, load, prepare, store

__version__ = "0.1.0"

__all__ = [
    "GroupTransfer",
    "OBJECT_LAYOUTS",
    "TPShard",
    "canonical_nbytes",
    "merge_shards",
    "rank_byte_ranges",
    "split_canonical",
    "PlaneRef",
    "PreparedTransfer",
    "Region",
    "TransferPlan",
    "detect_format",
    "load",
    "normalize_and_discover_per_layer_formats",
    "object_nbytes",
    "object_regions",
    "prepare",
    "region_view",
    "store",
    "EXCLUDED_ENGINE_GROUP",
    "AttnWindowDesc",
    "EngineGroupInfo",
    "KVLayerGroupsManager",
    "KernelGroupIdentity",
    "KernelGroupInfo",
    "ObjectGroupInfo",
    "PageBufferShapeDesc",
    "expand_engine_block_ids",
    "format_kvcache_shape_spec",
    "get_engine_group_indices",
    "group_layers_by_identity",
    "manager_from_shape_spec",
    "parse_kvcache_shape_spec",
    "slice_block_ids_per_group",
    "DTYPE_MAP",
    "MUST_HAVE_FORMATS",
    "STATE_FORMATS",
    "conv_format",
    "state_page_offsets",
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


def __getattr__(name: str):
    # Deprecated LMCache aliases (LayerGroupIdentity, KVLayerGroupInfo): grouping.py warns.
    from . import grouping

    if name in grouping.DEPRECATED_ALIASES:
        return getattr(grouping, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
