"""vLLM's KV cache description -> a kvgroups manager, and vLLM's block ids -> ours.

vLLM (v1) describes its cache with a ``KVCacheConfig``: KV cache groups (one block table
each, so one *engine group* each for kvgroups), every group with one spec (or a
``UniformTypeKVCacheSpecs`` holding one spec per layer), and ``KVCacheTensor`` backing
allocations. The worker registers one tensor per attention layer, the logical
``[blocks, heads, tokens, content]`` view of vLLM >= 0.32 (``content`` = K and V of one
head side by side, or one MLA latent), or the older rank-5 FlashAttention/FlashInfer tensors.

:func:`from_kv_cache_config` reads both and returns a :class:`VllmKVLayout`: the manager
(one :class:`EngineGroupInfo` per kernel group, windows from the specs, tokens per block from
the group's block size), the tensors in manager layer order, and the mapping of layer names.
Without tensors (the scheduler process has none) it plans from TensorSpecs derived from the
config alone, which gives the same groups, windows and object sizes.

Attention windows: vLLM frees a sliding-window group's blocks that no future token attends
(``num_computed - sliding_window + 1 - extra_retained_tokens`` tokens are skipped), so a
sliding group needs only the last ``sliding_window - 1 + extra_retained_tokens`` tokens before
a resume point; that count, rounded up to whole blocks, is the group's window. A chunked-local
group needs nothing across a cache-chunk boundary when its local chunk divides the cache
chunk: its layers are then left out (excluded); otherwise it counts as a window of
``attention_chunk_size - 1`` tokens.

vLLM's KV cache groups have separate block tables (one block pool, ids allocated per group),
so layers of identical shape in two groups are two kernel groups and two launches; they share
one object group when their windows match. That is what the block tables require, not a
missed fusion.

Recurrent state (``MambaSpec``, docs/SEMANTICS.md section 9): only ``mamba_cache_mode="align"``
keeps reusable snapshots (block ``i`` of a request's Mamba group holds the state after token
``(i + 1) * block_size`` when vLLM kept it). vLLM registers such a layer as one int8 tensor
``[NB, 1, 1, C]``, its page holding the spec's ``shapes`` back to back in its ``dtypes``
(padded to the block stride); the adapter views each sub-state as its own manager layer (conv
in the orientation of ``VLLM_SSM_CONV_STATE_LAYOUT``, "SD" unless it says "DS", then the
temporal state), by the spec, never by the tensor's shape.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvgroups_core import (
    EXCLUDED_ENGINE_GROUP,
    EngineGroupInfo,
    EngineKVFormat,
    KVLayerGroupsManager,
    TensorSpec,
    conv_format,
    detect_format,
    group_layers_by_identity,
    state_page_offsets,
)
from kvgroups_core.errors import (
    KVGroupsIndexError,
    KVGroupsTypeError,
    KVGroupsValueError,
    UnsupportedConfigError,
)
from kvgroups_core.formats.layout import layer_layout
from kvgroups_core.transfer.block_ids import host_id_array

#: vLLM spec classes the adapter understands, by class name (checked exactly, so a new
#: subclass with unknown semantics is refused rather than misread).
FULL_SPECS = ("FullAttentionSpec", "SinkFullAttentionSpec")
MLA_SPECS = ("MLAAttentionSpec",)
SLIDING_SPECS = ("SlidingWindowSpec",)
SLIDING_MLA_SPECS = ("SlidingWindowMLASpec",)
CHUNKED_SPECS = ("ChunkedLocalAttentionSpec",)
STATE_SPECS = ("MambaSpec",)
KNOWN_SPECS = (
    FULL_SPECS + MLA_SPECS + SLIDING_SPECS + SLIDING_MLA_SPECS + CHUNKED_SPECS + STATE_SPECS
)
#: Mamba backends whose spec ``shapes`` are (conv state, temporal state).
CONV_TEMPORAL_TYPES = ("MAMBA1", "MAMBA2", "GDN_ATTN")

_LAYOUT_ALIASES = {"NHD": "NHD", "HND": "HND"}


def natural_key(name: str) -> list[Any]:
    """Sort key putting ``layers.10`` after ``layers.9`` (model order of vLLM layer names)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _layout_of(value: Any) -> str | None:
    """'NHD' / 'HND' from our names or from vLLM's KVCacheLayout (name or member)."""
    if value is None:
        return None
    name = getattr(value, "name", value)
    if not isinstance(name, str):
        raise KVGroupsTypeError(
            f"kv_cache_layout: expected 'NHD', 'HND' or a vLLM layout, got {value!r}"
        )
    name = name.upper()
    if name in _LAYOUT_ALIASES:
        return name
    # vLLM >= 0.32 names the physical order of [L, B, H, N, C]: the per-layer block interior
    # is heads-outer (HND) when H comes before N.
    if len(name) == 5 and set(name) == set("LBHNC"):
        return "HND" if name.index("H") < name.index("N") else "NHD"
    raise KVGroupsValueError(
        f"kv_cache_layout: expected 'NHD', 'HND' or a vLLM KVCacheLayout name, got {value!r}"
    )


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _itemsize(dtype: Any) -> int:
    size = getattr(dtype, "itemsize", None)
    if size is None:
        raise KVGroupsTypeError(f"spec dtype: expected a torch dtype, got {dtype!r}")
    return int(size)


@dataclass(frozen=True)
class LayerSpec:
    """What the adapter needs from one layer's vLLM spec."""

    name: str
    group_id: int
    kind: str  # "attention", "mla" or "state"
    block_size: int
    window_tokens: int  # -1 = full attention; 0 = needs nothing across a chunk boundary
    spec: Any = field(repr=False, compare=False, default=None)


def _spec_for_layer(group_id: int, group: Any, name: str) -> Any:
    spec = group.kv_cache_spec
    if type(spec).__name__ == "UniformTypeKVCacheSpecs":
        per_layer = spec.kv_cache_specs
        if name not in per_layer:
            raise KVGroupsValueError(
                f"kv_cache_groups[{group_id}]: layer {name!r} has no spec in its "
                f"UniformTypeKVCacheSpecs (specs for {sorted(per_layer)})"
            )
        spec = per_layer[name]
    return spec


def _spec_int(spec: Any, attr: str, where: str, minimum: int) -> int:
    """An int field of a vLLM spec, at least ``minimum`` (a zero block size or chunk, a
    negative window: vLLM's dataclasses take them; the adapter refuses them by name)."""
    value = getattr(spec, attr, None)
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVGroupsTypeError(
            f"{where}: {type(spec).__name__}.{attr}: expected an int, got {value!r}"
        )
    if value < minimum:
        raise KVGroupsValueError(
            f"{where}: {type(spec).__name__}.{attr}: expected an int >= {minimum}, got {value}"
        )
    return value


def _window_tokens(spec: Any, kind_name: str, chunk: int, where: str) -> int:
    bs = _spec_int(spec, "block_size", where, 1)
    if kind_name in SLIDING_SPECS + SLIDING_MLA_SPECS:
        window = _spec_int(spec, "sliding_window", where, 1)
        extra = getattr(spec, "extra_retained_tokens", 0)
        if extra:
            extra = _spec_int(spec, "extra_retained_tokens", where, 0)
        needed = max(window - 1 + extra, 1)
        return -(-needed // bs) * bs if needed < chunk else needed
    if kind_name in CHUNKED_SPECS:
        local = _spec_int(spec, "attention_chunk_size", where, 1)
        if chunk % local == 0:
            return 0
        needed = local - 1
        return -(-needed // bs) * bs if needed < chunk else needed
    return -1


def read_layer_specs(kv_cache_config: Any, chunk: int) -> dict[str, LayerSpec]:
    """Every layer of every KV cache group, keyed by layer name.

    Raises UnsupportedConfigError (a NotImplementedError) naming the group and layer for spec types
    the adapter does not know (cross-attention, ...) or a MambaSpec it cannot cache (a
    ``mamba_cache_mode`` other than "align"), and KVGroupsValueError for a layer
    listed in two groups.
    """
    out: dict[str, LayerSpec] = {}
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is None:
        raise KVGroupsTypeError(
            f"kv_cache_config: expected a vLLM KVCacheConfig, got {type(kv_cache_config).__name__}"
        )
    for gid, group in enumerate(groups):
        if not getattr(group, "enable_kv_transfer", True):
            continue
        for name in group.layer_names:
            spec = _spec_for_layer(gid, group, name)
            kind_name = type(spec).__name__
            if kind_name not in KNOWN_SPECS:
                raise UnsupportedConfigError(
                    f"kv_cache_groups[{gid}] layer {name!r}: spec type {kind_name} is not "
                    f"supported (expected one of {', '.join(KNOWN_SPECS)})"
                )
            if name in out:
                raise KVGroupsValueError(
                    f"kv_cache_groups[{gid}]: layer {name!r} is already in group "
                    f"{out[name].group_id}"
                )
            if kind_name in STATE_SPECS:
                _check_state_spec(gid, name, spec)
                out[name] = LayerSpec(name, gid, "state", int(spec.block_size), -1, spec)
                continue
            kind = "mla" if kind_name in MLA_SPECS + SLIDING_MLA_SPECS else "attention"
            where = f"kv_cache_groups[{gid}] layer {name!r}"
            window = _window_tokens(spec, kind_name, chunk, where)
            out[name] = LayerSpec(name, gid, kind, int(spec.block_size), window, spec)
    return out


def _check_state_spec(gid: int, name: str, spec: Any) -> None:
    """A MambaSpec kvgroups can cache: align mode, one conv and one temporal state."""
    what = f"kv_cache_groups[{gid}] layer {name!r}"
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        raise UnsupportedConfigError(
            f"{what}: MambaSpec with mamba_cache_mode={mode!r} keeps no reusable state "
            "snapshots; expected mamba_cache_mode='align' (vLLM's default with prefix caching "
            "enabled)"
        )
    mamba_type = getattr(getattr(spec, "mamba_type", None), "name", str(spec.mamba_type))
    if mamba_type not in CONV_TEMPORAL_TYPES or len(spec.shapes) != 2:
        raise UnsupportedConfigError(
            f"{what}: MambaSpec mamba_type {mamba_type} with {len(spec.shapes)} state shapes is "
            f"not supported (expected one of {', '.join(CONV_TEMPORAL_TYPES)}: a conv state "
            "and a temporal state)"
        )
    if int(getattr(spec, "num_heads", 1)) != 1 or int(getattr(spec, "tokens_per_state", -1)) > 0:
        raise UnsupportedConfigError(
            f"{what}: MambaSpec with num_heads {spec.num_heads} / tokens_per_state "
            f"{spec.tokens_per_state} is not supported (expected one whole state per block)"
        )


def _conv_layout(value: Any) -> str:
    """The conv state orientation: the argument, else vLLM's environment variable, else SD."""
    layout = value or os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT") or "SD"
    conv_format(layout, "conv_layout")  # refuses anything but DS / SD
    return str(layout).upper()


def _state_formats(conv_layout: str) -> tuple[EngineKVFormat, EngineKVFormat]:
    return conv_format(conv_layout), EngineKVFormat.NL_X_NB_SH_SS


def _spec_state_layers(
    kv_cache_config: Any, lspec: LayerSpec, conv_layout: str
) -> list[tuple[TensorSpec, EngineKVFormat]]:
    """The sub-state TensorSpecs of one MambaSpec layer, from the config alone."""
    spec = lspec.spec
    tensor = _layer_tensor(kv_cache_config, lspec)
    num_blocks = (
        kv_cache_config.num_blocks_of(tensor)
        if hasattr(kv_cache_config, "num_blocks_of")
        else kv_cache_config.num_blocks
    )
    stride = int(tensor.block_stride)
    out = []
    for shape, dtype, fmt in zip(spec.shapes, spec.dtypes, _state_formats(conv_layout)):
        item = _itemsize(dtype)
        rest = _row_major(tuple(int(n) for n in shape))
        out.append(
            (
                TensorSpec(
                    (num_blocks, *shape), _dtype_name(dtype), strides=(stride // item, *rest)
                ),
                fmt,
            )
        )
    return out


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def _state_views(x: Any, lspec: LayerSpec, conv_layout: str) -> list[tuple[Any, EngineKVFormat]]:
    """One registered MambaSpec layer as its sub-state views (zero-copy).

    vLLM >= 0.26 registers ``[NB, 1, 1, C]`` int8 (the unified page); older versions a list
    with one tensor per sub-state. Anything else is refused: the spec, not the shape, says
    what the tensor is (a GDN state can have an attention layout's shape).
    """
    spec = lspec.spec
    formats = _state_formats(conv_layout)
    if isinstance(x, (list, tuple)):
        if len(x) != len(spec.shapes) or any(
            tuple(t.shape[1:]) != tuple(s) for t, s in zip(x, spec.shapes)
        ):
            raise KVGroupsValueError(
                f"layer {lspec.name!r}: expected one tensor per MambaSpec shape "
                f"{[tuple(s) for s in spec.shapes]}, got shapes {[tuple(t.shape) for t in x]}"
            )
        return list(zip(x, formats))
    content = int(spec.state_content_size_bytes)
    shape = tuple(x.shape)
    if (
        len(shape) != 4
        or shape[1:] != (1, 1, content)
        or x.element_size() != 1
        or x.stride(3) != 1
        or (shape[0] > 1 and x.stride(0) < content)
    ):
        raise KVGroupsValueError(
            f"layer {lspec.name!r}: expected vLLM's unified MambaSpec page [num_blocks, 1, 1, "
            f"{content}] of 1-byte elements (the state of shapes "
            f"{[tuple(s) for s in spec.shapes]}), got {x.dtype} {shape} with strides "
            f"{tuple(x.stride())}; a state tensor is never read by its shape"
        )
    page = x[:, 0, 0, :]
    views = []
    offsets = state_page_offsets(
        spec.shapes, [_dtype_name(d) for d in spec.dtypes], f"layer {lspec.name!r}"
    )
    for (offset, nbytes), sub, dtype, fmt in zip(offsets, spec.shapes, spec.dtypes, formats):
        view = page[:, offset : offset + nbytes].view(dtype).view(shape[0], *sub)
        views.append((view, fmt))
    return views


def _layer_tensor(kv_cache_config: Any, lspec: LayerSpec) -> Any:
    tensors = [t for t in kv_cache_config.kv_cache_tensors if lspec.name in t.layers]
    if not tensors:
        raise KVGroupsValueError(
            f"kv_cache_config: layer {lspec.name!r} (group {lspec.group_id}) has no KVCacheTensor"
        )
    return tensors[0]


def _spec_layer(
    kv_cache_config: Any, lspec: LayerSpec, layout: str
) -> tuple[TensorSpec, EngineKVFormat]:
    """The TensorSpec (and format) of one layer as the adapter would view vLLM's tensor,
    from the config alone: [B, H, N, C] HND, its [B, N, H, C] NHD view, or MLA [B, N, C]."""
    spec = lspec.spec
    tensor = _layer_tensor(kv_cache_config, lspec)
    num_blocks = (
        kv_cache_config.num_blocks_of(tensor)
        if hasattr(kv_cache_config, "num_blocks_of")
        else kv_cache_config.num_blocks
    )
    item = _itemsize(spec.dtype)
    heads = int(spec.num_heads)
    rows = int(spec.num_states) if hasattr(spec, "num_states") else int(spec.block_size)
    content_bytes = int(spec.state_content_size_bytes)
    block_stride = int(tensor.block_stride)
    if content_bytes % item or block_stride % item:
        raise UnsupportedConfigError(
            f"layer {lspec.name!r}: content {content_bytes} B or block stride {block_stride} B "
            f"is not a whole number of {_dtype_name(spec.dtype)} elements"
        )
    content, bstride, dtype = content_bytes // item, block_stride // item, _dtype_name(spec.dtype)
    if lspec.kind == "mla":
        return (
            TensorSpec((num_blocks, rows, content), dtype, strides=(bstride, content, 1)),
            EngineKVFormat.NL_X_NB_BS_HS,
        )
    _check_content(lspec, content)
    if layout == "HND":
        return (
            TensorSpec(
                (num_blocks, heads, rows, content),
                dtype,
                strides=(bstride, rows * content, content, 1),
            ),
            EngineKVFormat.NL_X_NB_NH_BS_CS,
        )
    return (
        TensorSpec(
            (num_blocks, rows, heads, content),
            dtype,
            strides=(bstride, heads * content, content, 1),
        ),
        EngineKVFormat.NL_X_NB_BS_NH_CS,
    )


def _check_content(lspec: LayerSpec, content: int) -> None:
    spec = lspec.spec
    head_size = int(spec.head_size)
    head_size_v = int(getattr(spec, "head_size_v", head_size) or head_size)
    if head_size_v != head_size or content != 2 * head_size:
        raise UnsupportedConfigError(
            f"layer {lspec.name!r}: expected K and V of {head_size} elements side by side "
            f"(content {2 * head_size}), got content {content} with head_size_v {head_size_v}"
        )


def _is_heads_outer(x: Any) -> bool | None:
    """True if the per-block interior is [H, N, C] in memory, False if [N, H, C], None if
    one of H, N has length 1 (both readings are the same bytes)."""
    shape, strides = tuple(x.shape), tuple(x.stride())
    if shape[1] == 1 or shape[2] == 1:
        return None
    return strides[1] > strides[2]


#: Ranks of a registered layer per kind: vLLM >= 0.32's logical [B, H, N, C] view (4), and
#: the older FlashAttention/FlashInfer K/V tensors (5) or MLA latents [B, N, C] (3).
_RANKS = {"attention": (4, 5), "mla": (3, 4)}


def _as_kvgroups_layer(
    x: Any, lspec: LayerSpec, layout: str | None, declared: str, hints: dict
) -> tuple[Any, EngineKVFormat]:
    """One registered layer as (tensor or view, kvgroups format), checked against its spec:
    the worker must read each block as the scheduler plans it from the config alone."""
    x, fmt = _read_layer(x, lspec, layout, declared, hints)
    _check_page(x, fmt, lspec)
    return x, fmt


def _read_layer(
    x: Any, lspec: LayerSpec, layout: str | None, declared: str, hints: dict
) -> tuple[Any, EngineKVFormat]:
    """``layout``: the caller's explicit one (checked against the strides); ``declared``:
    the layout the scheduler plans with (explicit, else the config's, else HND), which
    decides when the strides cannot (one head or one token per block: both orders are the
    same bytes, but the two formats have different fingerprints)."""
    ndim = len(x.shape)
    if ndim not in _RANKS[lspec.kind]:
        spec_name = type(lspec.spec).__name__
        raise KVGroupsValueError(
            f"kv_caches[{lspec.name!r}]: expected a tensor of rank "
            f"{' or '.join(map(str, _RANKS[lspec.kind]))} for its {spec_name} (group "
            f"{lspec.group_id}), got shape {tuple(x.shape)}"
        )
    if ndim != 4:
        # Older vLLM: rank-5 FlashAttention/FlashInfer or rank-3 MLA tensors; the catalogue's
        # detection knows them (NHD unless told HND).
        fmt, _ = detect_format([x], engine="vllm", hints={**hints, "kv_layout": layout or "NHD"})
        return x, fmt
    if lspec.kind == "mla":
        if x.shape[1] != 1:
            raise KVGroupsValueError(
                f"layer {lspec.name!r}: expected an MLA cache [blocks, 1, tokens, latent], "
                f"got shape {tuple(x.shape)}"
            )
        return x[:, 0], EngineKVFormat.NL_X_NB_BS_HS
    _check_content(lspec, int(x.shape[3]))
    outer = _is_heads_outer(x)
    if outer is not None and layout is not None and outer != (layout == "HND"):
        raise KVGroupsValueError(
            f"layer {lspec.name!r}: kv_cache_layout {layout} disagrees with the tensor's "
            f"strides {tuple(x.stride())} ({'HND' if outer else 'NHD'} in memory)"
        )
    if outer is None:
        outer = declared == "HND"
    if outer:
        return x, EngineKVFormat.NL_X_NB_NH_BS_CS
    return x.permute(0, 2, 1, 3), EngineKVFormat.NL_X_NB_BS_NH_CS


def _check_page(x: Any, fmt: EngineKVFormat, lspec: LayerSpec) -> None:
    """The layer's tensor, read as ``fmt``, holds each block as its spec says: the spec's
    token rows (states) and its unpadded page bytes. Otherwise the worker's objects would not
    be the ones the scheduler sized from the config (a rank-3 tensor of a full-attention layer
    read as MLA latents gave 17,408-byte objects against the scheduler's 32,768)."""
    spec = lspec.spec
    lay = layer_layout([x], fmt, 0)
    got_rows = lay.block_size
    got_bytes = lay.kv_size * lay.block_size * lay.row_bytes
    want_rows = int(spec.num_states) if hasattr(spec, "num_states") else lspec.block_size
    want_bytes = getattr(spec, "real_page_size_bytes", None)
    if want_bytes is None:
        want_bytes = getattr(spec, "page_size_bytes", got_bytes)
    if (got_rows, got_bytes) != (want_rows, int(want_bytes)):
        raise KVGroupsValueError(
            f"kv_caches[{lspec.name!r}]: expected blocks of {want_rows} token rows and "
            f"{int(want_bytes)} bytes as its {type(spec).__name__} (group {lspec.group_id}) "
            f"says, got shape {tuple(x.shape)} read as {fmt.name}: {got_rows} rows of "
            f"{got_bytes} bytes"
        )


@dataclass
class VllmKVLayout:
    """A vLLM KV cache as kvgroups sees it.

    Attributes
    ----------
    manager : KVLayerGroupsManager
        Kernel groups (one per vLLM group and shape), object groups (one per window).
    kv_caches : list
        The tensors (or TensorSpecs) in manager layer order, as the manager reads them.
    layer_names : list of str
        Manager layer index -> vLLM layer name (model order).
    excluded_layers : dict of str to str
        Layers left out, with the reason (KV shared with another layer; a chunked-local group
        that needs nothing across a chunk boundary; a group with transfer disabled).
    group_block_sizes : dict of int to int
        Tokens per block of every vLLM group the manager moves (by vLLM group id).
    state_groups : dict of int to int
        The vLLM groups holding recurrent state (``MambaSpec``), each with its
        ``num_speculative_blocks``.
    state_layers : list of int
        Manager indices of the state layers (a recurrent layer's conv and temporal states).
    """

    manager: KVLayerGroupsManager
    kv_caches: list
    layer_names: list[str]
    excluded_layers: dict[str, str]
    group_block_sizes: dict[int, int]
    num_vllm_groups: int
    state_groups: dict[int, int] = field(default_factory=dict)
    state_layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        # A recurrent layer is several manager layers (its sub-states); a name maps to the
        # first, indices_of gives them all.
        self.layer_index: dict[str, int] = {}
        for i, name in enumerate(self.layer_names):
            self.layer_index.setdefault(name, i)

    def indices_of(self, layer_name: str) -> list[int]:
        """Every manager layer of a vLLM layer (one, or a recurrent layer's sub-states)."""
        first = self.index_of(layer_name)
        return [i for i in range(first, len(self.layer_names)) if self.layer_names[i] == layer_name]

    @property
    def chunk_size(self) -> int:
        return self.manager.lmcache_tokens_per_chunk

    def index_of(self, layer_name: str) -> int:
        """Manager layer index of a vLLM layer (KVGroupsIndexError naming unknown layers)."""
        try:
            return self.layer_index[layer_name]
        except KeyError:
            why = self.excluded_layers.get(layer_name)
            extra = f" (excluded: {why})" if why else ""
            raise KVGroupsIndexError(
                f"layer_name: expected one of the {len(self.layer_names)} registered layers, "
                f"got {layer_name!r}{extra}"
            ) from None

    def block_ids(
        self, per_group: Any, num_chunks: int | None = None, first_chunk: int = 0
    ) -> dict[int, list[int]]:
        """vLLM's per-group block ids -> the ids ``store`` / ``load`` take.

        Parameters
        ----------
        per_group : tuple/list indexed by vLLM group id, or mapping group id -> ids
            What vLLM hands out (``KVCacheBlocks.get_block_ids()``, ``NewRequestData.block_ids``).
            Groups the manager does not move may be present; every group it moves must be.
        num_chunks, first_chunk : int
            Cut each group's list to the blocks of chunks ``[first_chunk, first_chunk +
            num_chunks)`` (by that group's block size). None: the whole list, which must then
            cover whole chunks.

        Raises
        ------
        KVGroupsIndexError
            A mapping names a group id vLLM's config does not have.
        KVGroupsValueError
            A group the manager moves has no ids, or too few for the chunks asked.
        """
        num_chunks = _chunk_arg(num_chunks, "num_chunks", allow_none=True)
        first_chunk = _chunk_arg(first_chunk, "first_chunk", allow_none=False)
        if isinstance(per_group, Mapping):
            lookup = dict(per_group)
            for gid in lookup:
                if (
                    isinstance(gid, bool)
                    or not isinstance(gid, int)
                    or not 0 <= gid < self.num_vllm_groups
                ):
                    raise KVGroupsIndexError(
                        f"block_ids: expected vLLM KV cache group ids in [0, "
                        f"{self.num_vllm_groups}), got group {gid!r}"
                    )
        elif isinstance(per_group, Sequence) and not isinstance(per_group, (str, bytes)):
            if len(per_group) > self.num_vllm_groups:
                raise KVGroupsIndexError(
                    f"block_ids: expected at most {self.num_vllm_groups} group lists, got "
                    f"{len(per_group)} (group {self.num_vllm_groups} is unknown)"
                )
            lookup = dict(enumerate(per_group))
        else:
            raise KVGroupsTypeError(
                "block_ids: expected per-group lists (tuple or mapping), "
                f"got {type(per_group).__name__}"
            )
        chunk = self.chunk_size
        out: dict[int, list[int]] = {}
        for gid, bs in self.group_block_sizes.items():
            if gid not in lookup or lookup[gid] is None:
                raise KVGroupsValueError(
                    f"block_ids: expected block ids for vLLM KV cache group {gid}, got none"
                )
            ids = _group_ids(lookup[gid], gid)
            if num_chunks is not None:
                per_chunk = chunk // bs
                lo, hi = first_chunk * per_chunk, (first_chunk + num_chunks) * per_chunk
                if len(ids) < hi:
                    raise KVGroupsValueError(
                        f"block_ids: vLLM group {gid} has {len(ids)} blocks, expected at least "
                        f"{hi} for chunks [{first_chunk}, {first_chunk + num_chunks}) of "
                        f"{chunk} tokens"
                    )
                ids = ids[lo:hi]
            out[gid] = ids
        return out


def _chunk_arg(value: Any, what: str, *, allow_none: bool) -> int | None:
    """``num_chunks`` / ``first_chunk``: a non-negative int (a negative one sliced from the
    end, a bool or float was taken for an int)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise KVGroupsTypeError(
            f"{what}: expected a non-negative int{' or None' if allow_none else ''}, got "
            f"{type(value).__name__} {value!r}"
        )
    if value < 0:
        raise KVGroupsValueError(f"{what}: expected a non-negative int, got {int(value)}")
    return int(value)


def _group_ids(ids: Any, gid: int) -> list[int]:
    """One vLLM group's block ids as Python ints: a sequence (or array) of integers, never
    floats (1.9 became block 1), bools or digit strings."""
    what = f"block_ids[{gid}]"
    if isinstance(ids, (str, bytes, Mapping)) or not hasattr(ids, "__len__"):
        raise KVGroupsTypeError(
            f"{what}: expected a sequence of block ids, got {type(ids).__name__}"
        )
    return host_id_array(list(ids) if not isinstance(ids, np.ndarray) else ids, what).tolist()


def from_kv_cache_config(
    kv_cache_config: Any,
    kv_caches: Mapping[str, Any] | None = None,
    *,
    kv_cache_layout: Any = None,
    chunk_size: int = 256,
    separate_object_groups: bool = True,
    tp_rank: int = 0,
    tp_size: int = 1,
    total_num_kv_heads: int | None = None,
    conv_layout: str | None = None,
) -> VllmKVLayout:
    """Build a :class:`VllmKVLayout` from vLLM's ``KVCacheConfig`` and registered caches.

    Parameters
    ----------
    kv_cache_config : vllm.v1.kv_cache_interface.KVCacheConfig
    kv_caches : dict of layer name -> tensor, optional
        What vLLM passes to ``register_kv_caches``. Several names may map to one tensor (KV
        sharing: only the first in model order is moved). A layer in the dict but in no
        group must share a grouped layer's tensor. None: plan from the config alone
        (TensorSpecs with the config's strides; the scheduler process does this).
    kv_cache_layout : 'NHD', 'HND', a vLLM ``KVCacheLayout`` or its name, optional
        The block interior order. Default: read from the tensors' strides, and the config's
        ``kv_cache_layout`` where they allow both (one KV head or one token per block) or
        without tensors, so the workers' managers are the scheduler's. Given explicitly, it
        must agree with the strides.
    chunk_size : int, default 256
        Tokens per cache chunk (a multiple of every group's block size).
    separate_object_groups : bool, default True
    tp_rank, tp_size, total_num_kv_heads : keyword-only
        This worker's place in its tensor-parallel group and the model's KV heads
        (``ModelConfig.get_total_num_kv_heads()``); vLLM's config holds one rank's heads, so
        these make ``manager.fingerprint(across_degrees=True)`` the whole model's, which a
        prefill and a decode engine of different degrees compare (docs/PD.md).
    conv_layout : {"SD", "DS"}, optional
        The orientation of MambaSpec conv states; default ``VLLM_SSM_CONV_STATE_LAYOUT`` (which
        vLLM's platforms set), else vLLM's default "SD".

    Raises
    ------
    UnsupportedConfigError (NotImplementedError)
        A spec type the adapter does not know, naming the group and layer; a MambaSpec whose
        ``mamba_cache_mode`` is not "align" (naming it), or of an unsupported ``mamba_type``.
    KVGroupsValueError
        A grouped layer missing from ``kv_caches``, a registered layer in no group that shares
        no grouped tensor, a layout that disagrees with the strides, a chunk size that is not a
        multiple of a group's block size (naming the group).
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise KVGroupsValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    layout = _layout_of(kv_cache_layout)
    specs = read_layer_specs(kv_cache_config, chunk_size)
    state_layout = (
        _conv_layout(conv_layout) if any(ls.kind == "state" for ls in specs.values()) else "SD"
    )
    num_groups = len(kv_cache_config.kv_cache_groups)
    excluded: dict[str, str] = {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        if not getattr(group, "enable_kv_transfer", True):
            for name in group.layer_names:
                excluded[name] = f"group {gid} has enable_kv_transfer=False"

    names = sorted(specs, key=natural_key)
    # The block interior order the scheduler plans with (no tensors); the worker reads it
    # from the strides and takes this one where they allow both (one head or token a block).
    declared = layout or _layout_of(getattr(kv_cache_config, "kv_cache_layout", None)) or "HND"
    tensors: dict[str, Any] = {}
    if kv_caches is None:
        for name in names:
            if specs[name].kind == "state":
                tensors[name] = _spec_state_layers(kv_cache_config, specs[name], state_layout)
            else:
                tensors[name] = _spec_layer(kv_cache_config, specs[name], declared)
    else:
        if not isinstance(kv_caches, Mapping):
            raise KVGroupsTypeError(
                f"kv_caches: expected the dict vLLM passes to register_kv_caches, got "
                f"{type(kv_caches).__name__}"
            )
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise KVGroupsValueError(
                f"kv_caches: expected a tensor for every layer of kv_cache_config, layer "
                f"{missing[0]!r} (group {specs[missing[0]].group_id}) is missing "
                f"({len(missing)} missing)"
            )
        # vLLM's hybrid allocator overlays its groups on one buffer (layer i of every group
        # has the same view), so equal views in different groups are different layers. In
        # one group, an equal view is KV sharing (a layer reading another's cache): move once.
        grouped_ptrs: dict[tuple, str] = {}
        for name in names:
            t = _registered(name, kv_caches[name], specs[name])
            key = _tensor_key(t)
            owner = grouped_ptrs.get((specs[name].group_id, key))
            if owner is not None:
                excluded[name] = f"shares its KV cache with {owner!r}"
                continue
            grouped_ptrs[(specs[name].group_id, key)] = name
            grouped_ptrs.setdefault((None, key), name)
            tensors[name] = t
        for name in sorted(kv_caches, key=natural_key):
            if name in specs or name in excluded:
                continue
            owner = grouped_ptrs.get((None, _tensor_key(kv_caches[name])))
            if owner is None:
                raise KVGroupsValueError(
                    f"kv_caches: layer {name!r} is in no KV cache group of kv_cache_config "
                    "and shares no grouped layer's tensor"
                )
            excluded[name] = f"shares its KV cache with {owner!r}"

    layer_names: list[str] = []
    caches: list[Any] = []
    formats: list[EngineKVFormat] = []
    per_layer_group: list[int] = []
    block_sizes: dict[int, int] = {}
    windows: dict[int, int] = {}
    state_groups: dict[int, int] = {}
    state_layers: list[int] = []
    for name in names:
        lspec = specs[name]
        if name not in tensors:
            continue
        if lspec.window_tokens == 0:
            excluded[name] = (
                f"chunked-local group {lspec.group_id} needs no KV across a "
                f"{chunk_size}-token chunk boundary"
            )
            continue
        if chunk_size % lspec.block_size:
            raise KVGroupsValueError(
                f"chunk_size: expected a multiple of vLLM group {lspec.group_id}'s block size "
                f"{lspec.block_size}, got {chunk_size}"
            )
        if lspec.kind == "state":
            parts = (
                tensors[name]
                if kv_caches is None
                else _state_views(tensors[name], lspec, state_layout)
            )
            state_groups[lspec.group_id] = int(getattr(lspec.spec, "num_speculative_blocks", 0))
            state_layers += range(len(caches), len(caches) + len(parts))
        elif kv_caches is None:
            parts = [tensors[name]]
        else:
            parts = [_as_kvgroups_layer(tensors[name], lspec, layout, declared, {})]
        for x, fmt in parts:
            layer_names.append(name)
            caches.append(x)
            formats.append(fmt)
            per_layer_group.append(lspec.group_id)
        block_sizes[lspec.group_id] = lspec.block_size
        windows[lspec.group_id] = lspec.window_tokens

    infos = []
    if caches:
        for identity, layers in group_layers_by_identity(caches, formats, per_layer_group):
            gid = identity.engine_group_idx
            if gid == EXCLUDED_ENGINE_GROUP:
                continue
            infos.append(
                EngineGroupInfo(
                    engine_group_id=gid,
                    layer_indices=tuple(layers),
                    tokens_per_block=block_sizes[gid],
                    sw_size_tokens=windows[gid],
                    recurrent_state=gid in state_groups,
                )
            )
        # vLLM's group order, not the kernel groups': the manager matches infos by layers.
        infos.sort(key=lambda i: (i.engine_group_id, i.layer_indices))
    manager = KVLayerGroupsManager(
        caches,
        formats,
        infos,
        lmcache_tokens_per_chunk=chunk_size,
        separate_object_groups=separate_object_groups,
        tp_rank=tp_rank,
        tp_size=tp_size,
        total_num_kv_heads=total_num_kv_heads if tp_size > 1 else None,
    )
    return VllmKVLayout(
        manager, caches, layer_names, excluded, block_sizes, num_groups, state_groups, state_layers
    )


def _registered(name: str, value: Any, lspec: LayerSpec) -> Any:
    """A grouped layer's entry of ``kv_caches``: a torch tensor (a list of them, one per
    sub-state, only for a recurrent layer of older vLLM)."""
    state = lspec.kind == "state"
    items = value if state and isinstance(value, (list, tuple)) and value else [value]
    if not all(isinstance(t, torch.Tensor) for t in items):
        kind = (
            "a torch tensor (or a list of them, one per MambaSpec shape)"
            if state
            else ("a torch tensor")
        )
        got = type(value).__name__
        if isinstance(value, (list, tuple)):
            got += f" of {[type(t).__name__ for t in value]}"
        raise KVGroupsTypeError(
            f"kv_caches[{name!r}]: expected {kind} for its {type(lspec.spec).__name__} (group "
            f"{lspec.group_id}), got {got}"
        )
    return value


def _tensor_key(t: Any) -> tuple:
    if isinstance(t, (list, tuple)):  # older vLLM: a recurrent layer's sub-state tensors
        return tuple(_tensor_key(x) for x in t)
    try:
        return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype))
    except AttributeError:
        raise KVGroupsTypeError(
            f"kv_caches: expected torch tensors, got {type(t).__name__}"
        ) from None


def manager_from_kv_cache_config(
    kv_cache_config: Any,
    kv_caches: Mapping[str, Any] | None = None,
    *,
    kv_cache_layout: Any = None,
    chunk_size: int = 256,
    separate_object_groups: bool = True,
    conv_layout: str | None = None,
) -> KVLayerGroupsManager:
    """The manager alone; see :func:`from_kv_cache_config` (its ``kv_caches`` attribute holds
    the tensors in manager layer order, which ``store`` / ``load`` need)."""
    return from_kv_cache_config(
        kv_cache_config,
        kv_caches,
        kv_cache_layout=kv_cache_layout,
        chunk_size=chunk_size,
        separate_object_groups=separate_object_groups,
        conv_layout=conv_layout,
    ).manager
