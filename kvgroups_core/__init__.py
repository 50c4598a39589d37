"""kvgroups_core: framework-free KV layer grouping and page-transfer planning.

Imports no framework, ever (NumPy only). Backends for PyTorch and JAX live in the separate
packages ``kvgroups_torch`` and ``kvgroups_jax`` and are found from the tensors you pass.
"""

from . import errors
from .errors import (
    BackendNotFoundError,
    CompileForbiddenError,
    KernelCompileError,
    KVGroupsError,
    KVGroupsIndexError,
    KVGroupsTypeError,
    KVGroupsValueError,
    UnsupportedConfigError,
)
from .formats.catalogue import MUST_HAVE_FORMATS, STATE_FORMATS, EngineKVFormat
from .formats.detection import detect_format, normalize_and_discover_per_layer_formats
from .formats.state_layout import conv_format, state_page_offsets
from .grouping.attn_window import AttnWindowDesc
from .grouping.engine_groups import (
    EngineGroupInfo,
    expand_engine_block_ids,
    get_engine_group_indices,
    slice_block_ids_per_group,
)
from .grouping.identity import (
    EXCLUDED_ENGINE_GROUP,
    KernelGroupIdentity,
    KernelGroupInfo,
    ObjectGroupInfo,
    PageBufferShapeDesc,
    group_layers_by_identity,
)
from .grouping.manager import KVLayerGroupsManager
from .grouping.shape_spec import (
    format_kvcache_shape_spec,
    manager_from_shape_spec,
    parse_kvcache_shape_spec,
)
from .grouping.tensor_parallel import OBJECT_LAYOUTS, TPShard
from .tensors.arrays import describe, get_backend, register_backend, unregister_backend
from .tensors.descriptors import TensorDesc, TensorSpec
from .tensors.dtypes import DTYPE_MAP, DType
from .transfer.api import PreparedTransfer, load, prepare, store
from .transfer.backend import Backend
from .transfer.block_runs import BlockRuns, block_runs, coalesce_runs
from .transfer.objects import Region, object_nbytes, object_regions, region_view
from .transfer.plan import GroupTransfer, PlaneRef, TransferPlan
from .transfer.tp_convert import canonical_nbytes, merge_shards, rank_byte_ranges, split_canonical
from .transfer.tp_reshard import ReadPlan, assemble, degree_view, plan_reads

__version__ = "0.1.0"

__all__ = [
    "BlockRuns",
    "block_runs",
    "coalesce_runs",
    "GroupTransfer",
    "OBJECT_LAYOUTS",
    "TPShard",
    "canonical_nbytes",
    "merge_shards",
    "rank_byte_ranges",
    "split_canonical",
    "ReadPlan",
    "assemble",
    "degree_view",
    "plan_reads",
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
    "BackendNotFoundError",
    "CompileForbiddenError",
    "DType",
    "EngineKVFormat",
    "KVGroupsError",
    "KVGroupsIndexError",
    "KVGroupsTypeError",
    "KVGroupsValueError",
    "KernelCompileError",
    "TensorDesc",
    "TensorSpec",
    "UnsupportedConfigError",
    "describe",
    "get_backend",
    "register_backend",
    "unregister_backend",
]


def __getattr__(name: str):
    # Deprecated LMCache aliases (LayerGroupIdentity, KVLayerGroupInfo): grouping/identity.py warns.
    from .grouping import identity as grouping

    if name in grouping.DEPRECATED_ALIASES:
        return getattr(grouping, name)
    # The error classes' old names (UnsupportedConfig, BackendNotFound, CompileForbidden).
    return errors.deprecated_alias(__name__, name, errors.DEPRECATED_ALIASES, vars(errors))
