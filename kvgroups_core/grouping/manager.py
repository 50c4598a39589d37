"""KVLayerGroupsManager: a model's layers as kernel groups and object groups (docs/SEMANTICS.md
section 3).

The manager is pure metadata built from descriptors: it owns no buffers and moves no bytes.
The transfer planner reads it (``kernel_groups``, ``object_groups``, ``layer_layouts``, the
per-group slot counts) to build a :class:`~kvgroups_core.transfer.plan.TransferPlan`.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any

from kvgroups_core.errors import (
    KVGroupsIndexError,
    KVGroupsTypeError,
    KVGroupsValueError,
    UnsupportedConfigError,
)
from kvgroups_core.formats.catalogue import EngineKVFormat
from kvgroups_core.formats.layout import LayerLayout, num_layers_of

from .attn_window import AttnWindowDesc
from .engine_groups import (
    EXCLUDED_ENGINE_GROUP,
    EngineGroupInfo,
    as_bool,
    as_int,
    get_engine_group_indices,
)
from .identity import (
    KernelGroupIdentity,
    KernelGroupInfo,
    ObjectGroupInfo,
    PageBufferShapeDesc,
    describe_tree,
    group_by_identity,
    layouts_and_identities,
    normalize_formats,
)
from .tensor_parallel import TPShard, check_tp_args, shard_groups
from .tensor_parallel import fingerprint as _fingerprint


def _check_layer_count(kv_caches: Any, formats: Sequence[EngineKVFormat]) -> None:
    for fmt in dict.fromkeys(formats):
        if not fmt.groupable:
            continue  # layer_layout raises the clearer error for these
        have = num_layers_of(kv_caches, fmt)
        if have != len(formats):
            raise KVGroupsValueError(
                f"engine_kv_formats: expected one format per layer of kv_caches ({have} layers "
                f"as {fmt.name}), got {len(formats)} formats"
            )


def _placements(tree: Any) -> tuple:
    """Each described tensor's ``placement`` in depth-first order; ``()`` when all are None."""
    out: list = []

    def walk(x: Any) -> None:
        if isinstance(x, (list, tuple)):
            for item in x:
                walk(item)
        else:
            out.append(None if x is None else x.placement)

    walk(tree)
    return tuple(out) if any(p is not None for p in out) else ()


def _infos_in_group_order(
    infos: tuple[EngineGroupInfo, ...], groups: list[tuple[KernelGroupIdentity, list[int]]]
) -> tuple[EngineGroupInfo, ...]:
    # Engines list their groups in their own order (vLLM: sliding-window groups before full
    # attention); an info belongs to the kernel group with exactly its layers, wherever it is.
    by_layers = {tuple(sorted(info.layer_indices)): info for info in infos}
    ordered = []
    for k, (_, layers) in enumerate(groups):
        info = by_layers.get(tuple(layers))
        if info is None:
            # No info has these layers: report the one in this position, as before.
            raise KVGroupsValueError(
                f"kernel group {k}: engine group info covers layers "
                f"{list(infos[k].layer_indices)}, but the kernel group has layers {layers}"
            )
        ordered.append(info)
    return tuple(ordered)


def _check_recurrent(
    k: int, fmt: EngineKVFormat, layers: list[int], info: EngineGroupInfo | None
) -> bool:
    """Whether kernel group ``k`` is recurrent state: its format and its engine's info must
    say so together (docs/SEMANTICS.md section 9), never a shape alone."""
    state_format = fmt.is_recurrent_state
    declared = info is not None and info.recurrent_state
    if state_format and not declared:
        why = (
            "no engine_group_infos were given"
            if info is None
            else f"its engine group info (engine group {info.engine_group_id}) has "
            "recurrent_state=False"
        )
        raise KVGroupsValueError(
            f"kernel group {k} (layers {layers}): expected an EngineGroupInfo with "
            f"recurrent_state=True for layers in the state format {fmt.name}, but {why}"
        )
    if declared and not state_format:
        assert info is not None  # for mypy: declared says so
        raise KVGroupsValueError(
            f"kernel group {k} (layers {layers}): engine group info {info.engine_group_id} "
            f"says recurrent_state=True, expected a state format (NL_X_NB_CD_CW, "
            f"NL_X_NB_CW_CD or NL_X_NB_SH_SS), got {fmt.name}; a state tensor is never read "
            "as attention KV"
        )
    if not declared:
        if info is not None and info.conv_projections:
            raise KVGroupsValueError(
                f"kernel group {k}: conv_projections given for a group that is not recurrent_state"
            )
        return False
    assert info is not None  # for mypy: declared says so
    if info.tokens_per_block <= 0:
        raise KVGroupsValueError(
            f"kernel group {k} (layers {layers}): expected tokens_per_block > 0 for a "
            f"recurrent_state group (the tokens one state slot id stands for), got "
            f"{info.tokens_per_block}"
        )
    if info.sw_size_tokens not in (-1, info.tokens_per_block):
        raise KVGroupsValueError(
            f"kernel group {k} (layers {layers}): expected sw_size_tokens -1 for a "
            f"recurrent_state group (its window is one block), got {info.sw_size_tokens}"
        )
    if info.conv_projections and fmt not in (
        EngineKVFormat.NL_X_NB_CD_CW,
        EngineKVFormat.NL_X_NB_CW_CD,
    ):
        raise KVGroupsValueError(
            f"kernel group {k} (layers {layers}): conv_projections given for {fmt.name}, "
            "expected them only for a conv state"
        )
    return True


class KVLayerGroupsManager:
    """Partition a model's KV layers into kernel groups and object groups.

    Parameters
    ----------
    kv_caches : structure of tensors
        The engine's KV cache structure of framework tensors, TensorSpecs or TensorDescs
        (planning needs no data, so bare TensorSpecs are enough).
    engine_kv_formats : sequence of EngineKVFormat, or one EngineKVFormat
        One format per layer, or one format repeated for every layer.
    engine_group_infos : sequence of EngineGroupInfo, optional
        One info per kernel group, in any order (each is matched to the kernel group with
        exactly its layers); layers no info mentions are excluded. Empty: every layer is in
        engine group 0.
    lmcache_tokens_per_chunk : int, default 256
        Logical tokens per cache chunk.
    separate_object_groups : bool, default True
        Split kernel groups into one object group per window size (in chunks); False puts
        every kernel group in one full-attention object group.
    full_sw_kv : bool, default False (keyword only)
        Full-SW mode: store every block of sliding-window groups (see
        :meth:`with_full_sw_kv`). Chosen here because a manager never changes once it has
        been used for a transfer: plans and prepared transfers rely on its layout.
    tp_rank, tp_size : int, keyword-only, default 0 and 1
        The rank of a tensor-parallel group whose shard ``kv_caches`` is (``heads / tp_size``
        KV heads of each layer), and the group's size; see
        :mod:`kvgroups_core.grouping.tensor_parallel`.
    total_num_kv_heads : int or sequence of int, keyword-only, optional
        The whole model's KV heads (one count, or one per layer); needed only when a layer has
        fewer KV heads than ranks (each rank then holds one replicated head). By default a
        shard of ``h`` heads is ``h * tp_size`` heads of the model.
    object_layout : {"canonical", "tp_native"}, keyword-only, default "canonical"
        Where a rank's bytes go in its objects: its own objects, or its parts of one object
        shared by the whole TP group (docs/TENSOR_PARALLEL.md).

    Raises
    ------
    KVGroupsValueError
        In this order: an info names a layer outside the registered range; the number of
        infos differs from the number of kernel groups; an info's layers differ from its
        group's; layers of one group differ in geometry (block count, padding); per group,
        ``tokens_per_block`` is not a multiple of ``slots_per_block``, the chunk is not a
        multiple of ``tokens_per_block``, or a sub-chunk sliding window is not a multiple of
        ``tokens_per_block``. Before all of these (before the caches are read): a bad
        ``total_num_kv_heads`` (a count below 1, a non-integer), ``tp_size < 1``, ``tp_rank``
        outside ``[0, tp_size)`` or an unknown ``object_layout``; after them, a
        ``total_num_kv_heads`` list whose length is not the layer count and a shard whose head
        count does not fit ``tp_size`` (and ``total_num_kv_heads``).
    """

    #: Where the transfer layer keeps this manager's last one-shot binding for its next
    #: one-shot call (:mod:`kvgroups_core.transfer.fast.reuse`); the manager never reads it.
    one_shot_park: Any = None

    def __init__(
        self,
        kv_caches: Any,
        engine_kv_formats: Sequence[EngineKVFormat] | EngineKVFormat,
        engine_group_infos: Sequence[EngineGroupInfo] = (),
        lmcache_tokens_per_chunk: int = 256,
        separate_object_groups: bool = True,
        *,
        full_sw_kv: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        total_num_kv_heads: int | Sequence[int] | None = None,
        object_layout: str = "canonical",
    ) -> None:
        self._tp_rank, self._tp_size, self._object_layout = check_tp_args(
            tp_rank, tp_size, object_layout, total_num_kv_heads
        )
        self._tp_shards: tuple[TPShard, ...] = ()
        chunk = as_int(lmcache_tokens_per_chunk, "lmcache_tokens_per_chunk")
        if chunk <= 0:
            raise KVGroupsValueError(
                f"lmcache_tokens_per_chunk: expected a positive token count, got {chunk}"
            )
        infos = tuple(engine_group_infos or ())
        info: EngineGroupInfo | None
        for i, info in enumerate(infos):
            if not isinstance(info, EngineGroupInfo):
                raise KVGroupsTypeError(
                    f"engine_group_infos[{i}]: expected an EngineGroupInfo, got {info!r}"
                )
        self._lmcache_tokens_per_chunk = chunk
        self._separate_object_groups = as_bool(separate_object_groups, "separate_object_groups")
        self._full_sw_kv = as_bool(full_sw_kv, "full_sw_kv")
        # Set when a transfer first binds this manager (mark_in_use); from then on nothing
        # about its layout may change (enable_full_sw_kv refuses).
        self._in_use = False
        self._kernel_groups: list[KernelGroupInfo] = []
        self._object_groups: list[ObjectGroupInfo] = []
        self._identities: list[KernelGroupIdentity] = []
        self._source_placements: tuple = ()

        kv_caches = describe_tree(kv_caches)
        self._source_placements = _placements(kv_caches)
        formats = normalize_formats(kv_caches, engine_kv_formats)
        self.engine_kv_formats: tuple[EngineKVFormat, ...] = formats
        self.layer_layouts: list[LayerLayout | None] = [None] * len(formats)
        num_layers = len(formats)
        if num_layers == 0:
            return
        _check_layer_count(kv_caches, formats)
        per_layer = get_engine_group_indices(infos, num_layers) or [0] * num_layers
        if all(g == EXCLUDED_ENGINE_GROUP for g in per_layer):
            return

        layouts, identities = layouts_and_identities(kv_caches, formats, per_layer)
        self.layer_layouts = layouts
        groups = group_by_identity(identities)
        if infos and len(infos) != len(groups):
            raise KVGroupsValueError(
                f"Got {len(infos)} engine group infos for {len(groups)} kernel groups; "
                "expected one engine group info per kernel group"
            )
        if infos:
            infos = _infos_in_group_order(infos, groups)
        for k, (identity, layers) in enumerate(groups):
            info = infos[k] if infos else None
            self._kernel_groups.append(self._build_group(k, identity, layers, layouts, info))
            self._identities.append(identity)
        self._object_groups = self._detect_object_groups()
        self._tp_shards = shard_groups(
            self._kernel_groups, num_layers, total_num_kv_heads, self._tp_rank, self._tp_size
        )
        for k, shard in enumerate(self._tp_shards):
            if (
                self._object_layout != "canonical"
                and shard.conv is not None
                and shard.conv.replicated
                and not shard.conv.fully_replicated
            ):
                raise UnsupportedConfigError(
                    f"object_layout: kernel group {k} is a conv state with replicated "
                    "sub-projections, which the tp_native layout cannot place; expected "
                    "object_layout='canonical'"
                )

    # --- construction helpers ---------------------------------------------------------

    def _build_group(
        self,
        k: int,
        identity: KernelGroupIdentity,
        layers: list[int],
        layouts: list[LayerLayout | None],
        info: EngineGroupInfo | None,
    ) -> KernelGroupInfo:
        # Grouped layers always have a layout (only excluded layers map to None).
        first: LayerLayout = layouts[layers[0]]  # type: ignore[assignment]
        for layer in layers[1:]:
            other: LayerLayout = layouts[layer]  # type: ignore[assignment]
            if not first.same_geometry(other):
                raise KVGroupsValueError(
                    f"kernel group {k}: expected every layer to share layer {layers[0]}'s "
                    f"geometry (num_blocks {first.num_blocks}, block stride "
                    f"{first.block_stride_bytes} B), got layer {layer} with num_blocks "
                    f"{other.num_blocks}, block stride {other.block_stride_bytes} B; put layers "
                    "with different block pools in different engine groups"
                )
        bs = identity.block_size
        tpb = info.tokens_per_block if info is not None and info.tokens_per_block > 0 else bs
        sw = info.sw_size_tokens if info is not None else -1
        recurrent = _check_recurrent(k, identity.engine_kv_format, layers, info)
        if recurrent:
            sw = tpb  # a window of one block: the snapshot at the chunk's end
        self._validate(k, bs, tpb, sw)
        shape_desc = PageBufferShapeDesc(
            kv_size=identity.kv_size,
            nl=len(layers),
            nb=first.num_blocks,
            bs=bs,
            nh=identity.num_heads,
            hs=identity.head_size,
            element_size=identity.dtype.itemsize,
            block_stride_elems=first.block_stride_elems,
            dtype=identity.dtype,
        )
        return KernelGroupInfo(
            layer_indices=layers,
            shape_desc=shape_desc,
            dtype=identity.dtype,
            engine_kv_format=identity.engine_kv_format,
            tokens_per_block=tpb,
            engine_group_idx=identity.engine_group_idx,
            sw_size_tokens=sw,
            recurrent_state=recurrent,
            conv_projections=info.conv_projections if recurrent and info is not None else (),
        )

    def _validate(self, k: int, slots_per_block: int, tpb: int, sw: int) -> None:
        chunk = self._lmcache_tokens_per_chunk
        if tpb % slots_per_block:
            raise KVGroupsValueError(
                f"kernel group {k}: tokens_per_block {tpb} must be a multiple of "
                f"slots_per_block {slots_per_block}"
            )
        if chunk % tpb:
            raise KVGroupsValueError(
                f"kernel group {k}: lmcache_tokens_per_chunk {chunk} must be a multiple of "
                f"tokens_per_block {tpb}"
            )
        if 0 < sw < chunk and sw % tpb:
            raise KVGroupsValueError(
                f"kernel group {k}: sub-chunk sliding window {sw} tokens must be a multiple "
                f"of tokens_per_block {tpb}"
            )

    def _detect_object_groups(self) -> list[ObjectGroupInfo]:
        # Recurrent-state groups always share one object group of their own (window 1 chunk):
        # a snapshot is never stored or looked up with attention's windows.
        state = "recurrent_state"
        chunk = self._lmcache_tokens_per_chunk
        buckets: dict[Any, list[int]] = {}
        for k, group in enumerate(self._kernel_groups):
            sw = group.sw_size_tokens
            if group.recurrent_state:
                key: Any = state
            elif not self._separate_object_groups:
                key = -1
            else:
                key = -1 if sw == -1 else -(-sw // chunk)  # a sub-chunk window is 1 chunk
            buckets.setdefault(key, []).append(k)
        # Kernel groups are visited in order, so buckets come out ordered by first group.
        return [
            ObjectGroupInfo(ks, 1, recurrent_state=True)
            if key == state
            else ObjectGroupInfo(ks, key)
            for key, ks in buckets.items()
        ]

    def _group(self, kernel_group_idx: int) -> KernelGroupInfo:
        k = as_int(kernel_group_idx, "kernel_group_idx")
        if not 0 <= k < len(self._kernel_groups):
            raise KVGroupsIndexError(
                f"kernel_group_idx: expected 0 <= k < {len(self._kernel_groups)}, got {k}"
            )
        return self._kernel_groups[k]

    # --- public API -------------------------------------------------------------------

    @property
    def kernel_groups(self) -> list[KernelGroupInfo]:
        """One :class:`KernelGroupInfo` per kernel group, ordered by first layer."""
        return self._kernel_groups

    @property
    def num_kernel_groups(self) -> int:
        """Number of kernel groups (0 for a model with no grouped layers)."""
        return len(self._kernel_groups)

    @property
    def kernel_group_identities(self) -> list[KernelGroupIdentity]:
        """The :class:`KernelGroupIdentity` of each kernel group."""
        return self._identities

    @property
    def object_groups(self) -> list[ObjectGroupInfo]:
        """One :class:`ObjectGroupInfo` per object group."""
        return self._object_groups

    @property
    def num_object_groups(self) -> int:
        """Number of object groups."""
        return len(self._object_groups)

    @property
    def num_blocks(self) -> int:
        """The first kernel group's block count (0 without kernel groups)."""
        return self._kernel_groups[0].shape_desc.nb if self._kernel_groups else 0

    @property
    def source_placements(self) -> tuple:
        """How the tensors this manager was built from were spread over devices: one opaque
        token per tensor of ``kv_caches`` (depth first, None for a tensor on one device), or
        ``()`` when none was spread. A backend that cannot see a traced value's placement
        (JAX inside ``jax.jit`` over a mesh with Auto axes) takes this manager's word for
        it."""
        return self._source_placements

    @property
    def lmcache_tokens_per_chunk(self) -> int:
        """Logical tokens per cache chunk."""
        return self._lmcache_tokens_per_chunk

    @property
    def separate_object_groups(self) -> bool:
        """Whether object groups are split by window size."""
        return self._separate_object_groups

    @property
    def full_sw_kv(self) -> bool:
        """True once :meth:`enable_full_sw_kv` was called."""
        return self._full_sw_kv

    def get_shape_desc(self, kernel_group_idx: int) -> PageBufferShapeDesc:
        """The :class:`PageBufferShapeDesc` of a kernel group (IndexError out of range)."""
        return self._group(kernel_group_idx).shape_desc

    def get_subchunk_sw_size_tokens(self, kernel_group_idx: int) -> int:
        """Tokens of each chunk a kernel group stores: the chunk, unless the group's window
        is shorter than a chunk (and full-SW mode is off), then the window."""
        group = self._group(kernel_group_idx)
        sw = group.sw_size_tokens
        chunk = self._lmcache_tokens_per_chunk
        if group.recurrent_state:
            return min(sw, chunk)  # the last block's snapshot, full-SW mode or not
        if self._full_sw_kv or sw == -1 or sw >= chunk:
            return chunk
        return sw

    def get_slots_per_chunk_in_sw(self, kernel_group_idx: int) -> int:
        """Physical slots (object rows per plane) one chunk of the group stores."""
        group = self._group(kernel_group_idx)
        return group.calculate_slots(self.get_subchunk_sw_size_tokens(kernel_group_idx))

    def calculate_num_blocks(self, kernel_group_idx: int, num_tokens: int) -> int:
        """Block ids of a kernel group covering ``num_tokens`` logical tokens (rounded down)."""
        group = self._group(kernel_group_idx)
        return group.calculate_slots(num_tokens) // group.shape_desc.bs

    def with_full_sw_kv(self, enabled: bool = True) -> "KVLayerGroupsManager":
        """A new manager of the same grouping in (or out of) full-SW mode: every block of
        sliding-window groups is stored, so a chunk is reusable at any position, and
        :meth:`get_attn_desc` reports full attention for every group. ``self`` is unchanged
        (transfers prepared with it keep its layout)."""
        enabled = as_bool(enabled, "enabled")
        new = copy.copy(self)  # the group lists are never mutated, so sharing them is safe
        new._full_sw_kv = enabled
        new._in_use = False
        new.one_shot_park = None  # bindings of this manager never serve the new one
        return new

    def mark_in_use(self) -> None:
        """Called when a transfer first binds this manager: its layout is in use from now on,
        so :meth:`enable_full_sw_kv` refuses."""
        self._in_use = True

    def enable_full_sw_kv(self) -> None:
        """LMCache's name for switching to full-SW mode in place (see :meth:`with_full_sw_kv`).

        Allowed only before the manager is first used for a transfer (LMCache calls it right
        after construction): a plan or prepared transfer made before would otherwise move
        objects of the old size. Afterwards it raises; use ``with_full_sw_kv()`` or
        ``KVLayerGroupsManager(..., full_sw_kv=True)`` instead.
        """
        if self._full_sw_kv:
            return
        if self._in_use:
            raise KVGroupsValueError(
                "enable_full_sw_kv: expected a manager not yet used for a transfer, got one "
                "already bound to caches (its object sizes are in use); call "
                "manager.with_full_sw_kv() for a new manager instead"
            )
        self._full_sw_kv = True

    def get_attn_desc(self) -> AttnWindowDesc:
        """Each object group's window in chunks (-1 = full attention), in object-group order."""
        if self._full_sw_kv:
            return AttnWindowDesc([1 if g.recurrent_state else -1 for g in self._object_groups])
        return AttnWindowDesc(
            [g.sw_size_chunks if g.sw_size_chunks >= 1 else -1 for g in self._object_groups]
        )

    # --- tensor parallelism (kvgroups_core.grouping.tensor_parallel) ---------------------------

    @property
    def tp_rank(self) -> int:
        """This shard's rank in its tensor-parallel group."""
        return self._tp_rank

    @property
    def tp_size(self) -> int:
        """Ranks of the tensor-parallel group (1: the whole model)."""
        return self._tp_size

    @property
    def object_layout(self) -> str:
        """``"canonical"`` (the rank's own objects) or ``"tp_native"`` (its parts of a shared
        whole-model object)."""
        return self._object_layout

    def tp_shard(self, kernel_group_idx: int) -> TPShard:
        """Which heads of the whole model kernel group ``kernel_group_idx`` holds."""
        self._group(kernel_group_idx)
        return self._tp_shards[kernel_group_idx]

    def is_replicated(self, kernel_group_idx: int) -> bool:
        """True when other ranks hold the same heads (MLA latents, fewer heads than ranks)."""
        return self.tp_shard(kernel_group_idx).is_replicated

    def fingerprint(self, *, across_degrees: bool = False) -> str:
        """A stable digest of the grouping and object layout: equal on every rank of a TP
        group (``across_degrees=True``: equal for every TP degree of the model)."""
        return _fingerprint(self, across_degrees=across_degrees)

    # Equal only to itself, hashed by identity: a manager is a long-lived, effectively
    # immutable description, so it can key caches and be a compile-time constant (torch's
    # ``torch.compile`` guards such a constant with ``==``; it needs both spelled out).
    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return (
            f"KVLayerGroupsManager(kernel_groups={self.num_kernel_groups}, "
            f"object_groups={self.num_object_groups}, "
            f"chunk={self._lmcache_tokens_per_chunk}, full_sw_kv={self._full_sw_kv}"
            + (f", tp_rank={self._tp_rank}, tp_size={self._tp_size}" if self._tp_size > 1 else "")
            + (
                f", object_layout={self._object_layout!r}"
                if self._object_layout != "canonical"
                else ""
            )
            + ")"
        )

    # --- deprecated LMCache names -----------------------------------------------------

    @property
    def kv_layer_groups(self) -> list[KernelGroupInfo]:
        """Deprecated alias of :attr:`kernel_groups` (the same list object)."""
        warnings.warn(
            "kv_layer_groups is deprecated; use kernel_groups", DeprecationWarning, stacklevel=2
        )
        return self._kernel_groups

    @property
    def num_groups(self) -> int:
        """Deprecated alias of :attr:`num_kernel_groups`."""
        warnings.warn(
            "num_groups is deprecated; use num_kernel_groups", DeprecationWarning, stacklevel=2
        )
        return len(self._kernel_groups)

    def get_slots_per_chunk(self, kernel_group_idx: int) -> int:
        """Deprecated: slots of a whole chunk, ignoring sliding windows; use
        :meth:`get_slots_per_chunk_in_sw`."""
        warnings.warn(
            "get_slots_per_chunk is deprecated (it ignores sliding windows); use "
            "get_slots_per_chunk_in_sw",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._group(kernel_group_idx).calculate_slots(self._lmcache_tokens_per_chunk)


def check_manager(manager: Any, what: str = "manager") -> KVLayerGroupsManager:
    """``manager`` if it is a :class:`KVLayerGroupsManager`, else a typed error naming
    ``what`` (for helpers that take a manager and would otherwise fail on an attribute)."""
    if not isinstance(manager, KVLayerGroupsManager):
        raise KVGroupsTypeError(
            f"{what}: expected a KVLayerGroupsManager, got {type(manager).__name__} {manager!r}"
        )
    return manager


def check_managers(managers: Any) -> list:
    """The managers of one TP group, in rank order and agreeing (for merging)."""
    if not isinstance(managers, (list, tuple)) or not managers:
        raise KVGroupsTypeError(
            f"managers: expected a non-empty list with one manager per rank, got {managers!r}"
        )
    for r, m in enumerate(managers):
        check_manager(m, f"managers[{r}]")
    size = managers[0].tp_size
    if len(managers) != size:
        raise KVGroupsValueError(
            f"managers: expected {size} managers (tp_size of managers[0]), got {len(managers)}"
        )
    expected = managers[0].fingerprint()
    for r, m in enumerate(managers):
        if m.tp_rank != r:
            raise KVGroupsValueError(f"managers[{r}].tp_rank: expected {r}, got {m.tp_rank}")
        if m.fingerprint() != expected:
            raise KVGroupsValueError(
                f"managers[{r}]: expected the grouping of managers[0] (fingerprint "
                f"{expected[:12]}), got fingerprint {m.fingerprint()[:12]}"
            )
    return list(managers)
