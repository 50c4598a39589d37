"""Kernel groups: which layers one transfer-kernel launch can move (docs/SEMANTICS.md sections 1-2).

A *kernel group* is a set of registered layers with one identity
``(kv_size, num_heads, head_size, block_size, engine_group_idx, dtype, engine_kv_format)``.
One launch moves a whole group with one :class:`PageBufferShapeDesc`. Grouping reads every
size from :func:`kvgroups_core.formats.layout.layer_layouts`, so it works on any structure of
framework tensors, :class:`~kvgroups_core.tensors.descriptors.TensorSpec` s or
:class:`~kvgroups_core.tensors.descriptors.TensorDesc` s.
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError
from kvgroups_core.formats.catalogue import EngineKVFormat
from kvgroups_core.formats.layout import (
    LayerLayout,
    describe_named,
    layer_layout,
    layer_tensors,
    num_layers_of,
)
from kvgroups_core.tensors.dtypes import DType

from .engine_groups import EXCLUDED_ENGINE_GROUP

__all__ = [
    "EXCLUDED_ENGINE_GROUP",
    "KernelGroupIdentity",
    "KernelGroupInfo",
    "ObjectGroupInfo",
    "PageBufferShapeDesc",
    "group_layers_by_identity",
    "normalize_formats",
]


class KernelGroupIdentity(NamedTuple):
    """What makes two layers movable by one kernel launch (hashable, immutable).

    ``kv_size`` is 2 for split K/V and 1 for MLA-class, CS-packed and indexer formats;
    ``num_heads`` the format's NH (1 without a head axis); ``head_size`` the head size (CS for
    packed formats, 132 for the indexer); ``block_size`` physical slots per block;
    ``engine_group_idx`` the engine's block-id space; ``dtype`` a :class:`DType`. The format
    is part of the identity, so equal geometry in two layouts (NHD and HND with NH == BS)
    still makes two groups.
    """

    kv_size: int
    num_heads: int
    head_size: int
    block_size: int
    engine_group_idx: int
    dtype: DType
    engine_kv_format: EngineKVFormat


@dataclass(frozen=True, kw_only=True)
class PageBufferShapeDesc:
    """The shape one kernel launch works with: a kernel group's geometry.

    Attributes
    ----------
    kv_size : int
        Planes per layer (2 = K and V, 1 = one latent or packed plane).
    nl : int
        Layers in the group.
    nb : int
        Blocks per plane (the group's engine group's block count).
    bs : int
        Physical slots per block.
    nh, hs : int
        Heads and head size; a token row of one plane is ``nh * hs`` elements.
    element_size : int
        Bytes per element.
    block_stride_elems : int
        Elements between consecutive blocks when the engine pads blocks; 0 means tight.
    dtype : DType or None
        Element type (``element_size`` alone cannot tell float16 from bfloat16).
    """

    kv_size: int
    nl: int
    nb: int
    bs: int
    nh: int
    hs: int
    element_size: int
    block_stride_elems: int = 0
    dtype: DType | None = None


@dataclass(frozen=True)
class KernelGroupInfo:
    """One transfer-kernel dispatch unit: layers sharing one :class:`KernelGroupIdentity`.

    Attributes
    ----------
    layer_indices : list of int
        The group's layers, ascending (the order a kernel walks them).
    shape_desc : PageBufferShapeDesc
        Geometry shared by every layer of the group.
    dtype : DType
        Element type of the group's tensors.
    engine_kv_format : EngineKVFormat or None
        The group's format; ``None`` only for groups parsed from a shape spec.
    tokens_per_block : int
        Logical tokens one block id covers; 0 = unknown (treated as ``slots_per_block``).
        Larger than ``slots_per_block`` for compressed groups (64 slots holding 256 tokens).
    engine_group_idx : int
        The engine group (block-id space) of the layers.
    sw_size_tokens : int
        Sliding window in tokens, -1 = full attention; ``tokens_per_block`` for a recurrent
        state group (a window of one block).
    recurrent_state : bool
        The layers hold recurrent state (docs/SEMANTICS.md section 9): a block is one state
        slot and a chunk keeps the snapshot at its end.
    conv_projections : tuple of (int, int)
        A conv-state group's sub-projections in the whole model (see ``EngineGroupInfo``).
    """

    layer_indices: list[int]
    shape_desc: PageBufferShapeDesc
    dtype: DType
    engine_kv_format: EngineKVFormat | None = None
    tokens_per_block: int = 0
    engine_group_idx: int = 0
    sw_size_tokens: int = -1
    recurrent_state: bool = False
    conv_projections: tuple[tuple[int, int], ...] = ()

    @property
    def num_layers(self) -> int:
        """Layers in the group."""
        return len(self.layer_indices)

    @property
    def hidden_dim_size(self) -> int:
        """Elements of one token row of one plane (``nh * hs``)."""
        return self.shape_desc.nh * self.shape_desc.hs

    @property
    def slots_per_block(self) -> int:
        """Physical token slots in one block (``shape_desc.bs``)."""
        return self.shape_desc.bs

    @property
    def effective_tokens_per_block(self) -> int:
        """``tokens_per_block``, or ``slots_per_block`` when it is unknown (0)."""
        return self.tokens_per_block if self.tokens_per_block > 0 else self.slots_per_block

    @property
    def compress_ratio(self) -> int:
        """Logical tokens per physical slot (1 for an uncompressed group)."""
        return self.effective_tokens_per_block // self.slots_per_block

    def calculate_slots(self, num_tokens: int) -> int:
        """Physical slots holding ``num_tokens`` logical tokens (assumed block-aligned):
        ``num_tokens * slots_per_block // tokens_per_block``."""
        return num_tokens * self.slots_per_block // self.effective_tokens_per_block

    def __repr__(self) -> str:
        sd = self.shape_desc
        layers = f"{self.layer_indices[0]}-{self.layer_indices[-1]}" if self.layer_indices else "[]"
        fmt = self.engine_kv_format.name if self.engine_kv_format is not None else None
        return (
            f"KernelGroupInfo(layers={self.num_layers}, indices={layers}, "
            f"shape_desc=(kv={sd.kv_size}, nl={sd.nl}, nb={sd.nb}, bs={sd.bs}, nh={sd.nh}, "
            f"hs={sd.hs}, element_size={sd.element_size}, "
            f"block_stride_elems={sd.block_stride_elems}), dtype={self.dtype}, format={fmt}, "
            f"tokens_per_block={self.tokens_per_block}, "
            f"slots_per_block={self.slots_per_block}, "
            f"engine_group_idx={self.engine_group_idx}, sw_size_tokens={self.sw_size_tokens}"
            + (", recurrent_state=True" if self.recurrent_state else "")
            + ")"
        )


@dataclass
class ObjectGroupInfo:
    """Kernel groups whose KV is stored together in one memory object per chunk.

    Attributes
    ----------
    kernel_group_indices : list of int
        Kernel groups in the object, in their memory order.
    sw_size_chunks : int
        Window in chunks shared by the kernel groups, -1 = full attention.
    recurrent_state : bool
        The object group holds recurrent-state snapshots (window 1 chunk; docs/SEMANTICS.md
        section 9).
    """

    kernel_group_indices: list[int]
    sw_size_chunks: int = -1
    recurrent_state: bool = False


def normalize_formats(kv_caches: Any, engine_kv_formats: Any) -> tuple[EngineKVFormat, ...]:
    """One :class:`EngineKVFormat` per layer.

    ``engine_kv_formats`` is a per-layer sequence, or a single format (or its name) that is
    repeated for every layer of ``kv_caches``.
    """
    if isinstance(engine_kv_formats, (EngineKVFormat, str)):
        fmt = _as_format(engine_kv_formats, "engine_kv_formats")
        if isinstance(kv_caches, (list, tuple)) and len(kv_caches) == 0:
            return ()
        return (fmt,) * num_layers_of(kv_caches, fmt)
    if not isinstance(engine_kv_formats, Sequence):
        raise KVGroupsTypeError(
            "engine_kv_formats: expected an EngineKVFormat or a sequence of them, got "
            f"{type(engine_kv_formats).__name__}"
        )
    return tuple(_as_format(f, f"engine_kv_formats[{i}]") for i, f in enumerate(engine_kv_formats))


def _as_format(value: Any, what: str) -> EngineKVFormat:
    if isinstance(value, EngineKVFormat):
        return value
    if isinstance(value, str):
        try:
            return EngineKVFormat[value]
        except KeyError:
            raise KVGroupsValueError(
                f"{what}: expected an EngineKVFormat name, got {value!r}"
            ) from None
    raise KVGroupsTypeError(f"{what}: expected an EngineKVFormat, got {value!r}")


def per_layer_engine_groups(
    num_layers: int, per_layer_engine_group_idx: Sequence[int] | None
) -> list[int]:
    """Check and copy the per-layer engine group ids (all 0 when ``None``)."""
    if per_layer_engine_group_idx is None:
        return [0] * num_layers
    if len(per_layer_engine_group_idx) != num_layers:
        raise KVGroupsValueError(
            f"per_layer_engine_group_idx: expected {num_layers} entries (one per entry of "
            f"engine_kv_formats), got {len(per_layer_engine_group_idx)}"
        )
    out = []
    for i, g in enumerate(per_layer_engine_group_idx):
        try:
            value = operator.index(g)
        except TypeError:
            raise KVGroupsTypeError(
                f"per_layer_engine_group_idx[{i}]: expected an int, got {g!r}"
            ) from None
        if value < EXCLUDED_ENGINE_GROUP:
            raise KVGroupsValueError(
                f"per_layer_engine_group_idx[{i}]: expected an engine group id >= 0 or "
                f"{EXCLUDED_ENGINE_GROUP} (excluded), got {value}"
            )
        out.append(value)
    return out


def identity_of(layout: LayerLayout, engine_group_idx: int) -> KernelGroupIdentity:
    """The :class:`KernelGroupIdentity` of a layer with ``layout``."""
    return KernelGroupIdentity(
        kv_size=layout.kv_size,
        num_heads=layout.num_heads,
        head_size=layout.head_size,
        block_size=layout.block_size,
        engine_group_idx=engine_group_idx,
        dtype=layout.dtype,
        engine_kv_format=layout.format,
    )


def group_by_identity(
    identities: Sequence[KernelGroupIdentity | None],
) -> list[tuple[KernelGroupIdentity, list[int]]]:
    """Bucket layers by identity (``None`` = excluded), ordered by each bucket's first layer.

    Layers are visited in ascending order, so a dict keeps buckets in first-layer order and
    every bucket's indices ascending without sorting.
    """
    buckets: dict[KernelGroupIdentity, list[int]] = {}
    for layer, identity in enumerate(identities):
        if identity is not None:
            buckets.setdefault(identity, []).append(layer)
    return list(buckets.items())


def describe_tree(x: Any, where: str = "kv_caches") -> Any:
    """The same structure with every tensor described once (descriptors pass through, and
    ``None`` placeholders, which only excluded layers may use, stay ``None``). A leaf that is
    no tensor is refused naming its place in the structure (``kv_caches[3][1]``)."""
    if isinstance(x, (list, tuple)):
        items = [describe_tree(item, f"{where}[{i}]") for i, item in enumerate(x)]
        return tuple(items) if isinstance(x, tuple) else items
    return None if x is None else describe_named(x, where)


def layouts_and_identities(
    kv_caches: Any, formats: Sequence[EngineKVFormat], engine_groups: Sequence[int]
) -> tuple[list[LayerLayout | None], list[KernelGroupIdentity | None]]:
    """Each layer's layout and kernel-group identity (``None`` for excluded layers).

    A layout depends only on the format and the tensors' specs (plus the layer's index in a
    cross-layer tensor), so layers sharing them reuse one computed layout with their own plane
    tensors swapped in: a 1,024-layer model lays out a handful of layers, not 1,024.
    """
    # key -> (the template's fields except planes, [(tensor index, byte offset)] per plane,
    # {engine group: identity}); one dict lookup per layer.
    templates: dict[tuple, tuple[dict[str, Any], list[tuple[int, int]], dict]] = {}
    flat = {fmt: not fmt.is_cross_layer and fmt.groupable for fmt in set(formats)}
    layouts: list[LayerLayout | None] = []
    idents: list[KernelGroupIdentity | None] = []
    for layer, (fmt, gid) in enumerate(zip(formats, engine_groups)):
        if gid == EXCLUDED_ENGINE_GROUP:
            layouts.append(None)
            idents.append(None)
            continue
        if not flat[fmt]:
            layout = layer_layout(kv_caches, fmt, layer)
            layouts.append(layout)
            idents.append(identity_of(layout, gid))
            continue
        tensors, index = layer_tensors(kv_caches, fmt, layer)
        key = (fmt, index, *[t.spec for t in tensors])
        template = templates.get(key)
        if template is None:
            layout = layer_layout(kv_caches, fmt, layer)
            # Which of the layer's tensors backs each plane (by identity: the structure was
            # described once, so layer_layout saw these very descriptors).
            indices = [
                (next((i for i, t in enumerate(tensors) if t is tensor), -1), offset)
                for tensor, offset in layout.planes
            ]
            by_group: dict[int, KernelGroupIdentity] = {}
            if all(index >= 0 for index, _ in indices):
                fields = {
                    f.name: getattr(layout, f.name)
                    for f in dataclasses.fields(layout)
                    if f.name != "planes"
                }
                templates[key] = (fields, indices, by_group)
        else:
            fields, indices, by_group = template
            planes = tuple([(tensors[index], offset) for index, offset in indices])
            layout = LayerLayout(**fields, planes=planes)
        identity = by_group.get(gid)
        if identity is None:
            identity = by_group[gid] = identity_of(layout, gid)
        layouts.append(layout)
        idents.append(identity)
    return layouts, idents


def group_layers_by_identity(
    kv_caches: Any,
    engine_kv_formats: Sequence[EngineKVFormat] | EngineKVFormat,
    per_layer_engine_group_idx: Sequence[int] | None = None,
) -> list[tuple[KernelGroupIdentity, list[int]]]:
    """Partition layers by :class:`KernelGroupIdentity`.

    Parameters
    ----------
    kv_caches : structure of tensors
        The engine's registered KV cache structure (tensor, list, list of lists) of framework
        tensors, TensorSpecs or TensorDescs.
    engine_kv_formats : sequence of EngineKVFormat, or one EngineKVFormat
        One format per layer (its length is the layer count), or one format for every layer.
    per_layer_engine_group_idx : sequence of int, optional
        Engine group id per layer; ``None`` puts every layer in engine group 0. Layers with
        :data:`EXCLUDED_ENGINE_GROUP` (-1) are left out of every group and never read.

    Returns
    -------
    list of (KernelGroupIdentity, list of int)
        Groups sorted by their first layer; each group's layers ascending.

    Raises
    ------
    KVGroupsValueError
        ``per_layer_engine_group_idx`` and ``engine_kv_formats`` differ in length.
    """
    kv_caches = describe_tree(kv_caches)
    formats = normalize_formats(kv_caches, engine_kv_formats)
    engine_groups = per_layer_engine_groups(len(formats), per_layer_engine_group_idx)
    _, identities = layouts_and_identities(kv_caches, formats, engine_groups)
    return group_by_identity(identities)


#: Old LMCache names -> (new name, object); reachable with a DeprecationWarning.
DEPRECATED_ALIASES = {
    "LayerGroupIdentity": ("KernelGroupIdentity", KernelGroupIdentity),
    "KVLayerGroupInfo": ("KernelGroupInfo", KernelGroupInfo),
}


def __getattr__(name: str) -> Any:
    # Old LMCache names stay importable but say what replaced them.
    if name in DEPRECATED_ALIASES:
        new_name, obj = DEPRECATED_ALIASES[name]
        warnings.warn(
            f"{name} is a deprecated alias of {new_name}", DeprecationWarning, stacklevel=2
        )
        return obj
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
