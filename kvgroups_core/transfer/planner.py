"""Build :class:`~kvgroups_core.transfer.plan.TransferPlan` s from a manager, caches and block ids.

Everything here works on descriptors: bare TensorSpecs plan exactly like real tensors. All
validation of user input happens here, before any backend sees the call, so a rejected call
moves no byte.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvgroups_core.errors import KVGroupsIndexError, KVGroupsTypeError, KVGroupsValueError
from kvgroups_core.formats.layout import LayerLayout, layer_layout
from kvgroups_core.tensors.descriptors import TensorDesc

from .block_ids import (
    DEVICE_ID_DTYPES,
    BlockIds,
    IdsSpec,
    describe_value,
    normalize_block_ids,
)
from .checks import check_bind_inputs
from .objects import object_nbytes, object_regions
from .plan import Direction, GroupTransfer, PlaneRef, TransferPlan, skip_first_item
from .transfer_path import check_path


def _chunk_windows(manager: Any, k: int) -> int:
    """The kernel group's window in chunks (-1 = full attention), honouring full-SW mode
    (which never applies to recurrent state: a snapshot serves its own position only)."""
    if manager.kernel_groups[k].recurrent_state:
        return 1
    if manager.full_sw_kv:
        return -1
    sw = manager.kernel_groups[k].sw_size_tokens
    if sw == -1:
        return -1
    chunk = manager.lmcache_tokens_per_chunk
    return max(1, -(-sw // chunk))


def bind_caches(
    manager: Any, kv_caches: Any
) -> tuple[list[list[LayerLayout]], list[TensorDesc], dict[tuple, int]]:
    """Read the call's tensors into per-group layer layouts and one list of backing tensors
    (plus each tensor's index in it, by identity key).

    The call's tensors must match what the manager was built from (shape, dtype and layout of
    every grouped layer); a tensor shared by several layers or planes is listed once.
    """
    formats = manager.engine_kv_formats
    group_layouts: list[list[LayerLayout]] = []
    for k, group in enumerate(manager.kernel_groups):
        sd = group.shape_desc
        layouts: list[LayerLayout] = []
        for layer in group.layer_indices:
            lay = layer_layout(kv_caches, formats[layer], layer)
            got = (
                lay.kv_size,
                lay.num_blocks,
                lay.block_size,
                lay.num_heads,
                lay.head_size,
                lay.dtype,
            )
            want = (sd.kv_size, sd.nb, sd.bs, sd.nh, sd.hs, group.dtype)
            if got != want:
                raise KVGroupsValueError(
                    f"kv_caches layer {layer}: expected (kv_size, nb, bs, nh, hs, dtype) = "
                    f"{want} as the manager was built with, got {got}"
                )
            if layouts and not layouts[0].same_geometry(lay):
                raise KVGroupsValueError(
                    f"kv_caches layer {layer}: expected the block stride and row layout of layer "
                    f"{group.layer_indices[0]} (kernel group {k}), got a different layout"
                )
            layouts.append(lay)
        group_layouts.append(layouts)

    tensors: list[TensorDesc] = []
    seen: dict[tuple, int] = {}
    for layouts in group_layouts:
        for lay in layouts:
            for desc, _ in lay.planes:
                key = _tensor_key(desc)
                if key not in seen:
                    seen[key] = len(tensors)
                    tensors.append(desc)
    _check_devices(tensors)
    return group_layouts, tensors, seen


def _tensor_key(desc: TensorDesc) -> tuple:
    # Identity within one bind only (never remembered across calls or traces).
    return (id(desc.obj) if desc.obj is not None else id(desc), desc.spec, desc.byte_offset)


def _check_devices(tensors: list[TensorDesc]) -> None:
    devices = {d.device for d in tensors}
    if len(devices) > 1:
        raise KVGroupsValueError(
            f"kv_caches: expected every tensor on one device, got {sorted(devices)}"
        )


def _num_chunks(binding: "Binding", ids: BlockIds) -> int:
    chunk = binding.manager.lmcache_tokens_per_chunk
    found: dict[int, int] = {}
    for template, engine_group in zip(binding.templates, binding.engine_groups):
        bpc = template.blocks_per_chunk
        n = ids.lengths[engine_group]
        if n % bpc:
            tpb = binding.manager.kernel_groups[template.kernel_group_idx].tokens_per_block
            raise KVGroupsValueError(
                f"block_ids[{engine_group}]: expected a multiple of {bpc} ids (whole chunks of "
                f"{chunk} tokens at {tpb} tokens per block), got {n}"
            )
        found[engine_group] = n // bpc
    counts = set(found.values())
    if len(counts) > 1:
        raise KVGroupsValueError(
            f"block_ids: expected every engine group to cover the same number of chunks, got "
            f"{found} chunks per engine group"
        )
    return counts.pop() if counts else 0


@dataclass(frozen=True, eq=False)
class Binding:
    """A manager bound to one set of cache tensors: everything about a transfer that does not
    depend on the block ids, computed once. ``templates`` are the per-group transfers with
    empty ids; ``tensors`` the backing tensors (the plan's ``tensor_index`` indexes them).

    ``flat_group`` is the engine group id when there is only one (flat ids allowed), else
    None; ``uniform_bpc`` the blocks per chunk every group shares (0 if they differ);
    ``layer_planes`` maps each grouped layer to its kernel group and its position ``l`` in
    it. ``skeletons`` caches the id-independent part of plans (see :func:`plan_call`).
    """

    manager: Any
    tensors: tuple[TensorDesc, ...]
    templates: tuple[GroupTransfer, ...]
    object_nbytes: tuple[int, ...]
    tensor_specs: tuple = ()
    engine_groups: tuple[int, ...] = ()
    flat_group: int | None = None
    uniform_bpc: int = 0
    layer_planes: dict = field(default_factory=dict, repr=False)
    skeletons: dict = field(default_factory=dict, repr=False)

    @property
    def distinct_engine_groups(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.engine_groups)))

    def host_id_checks(
        self, direction: Direction, num_chunks: int, skip: Any, layers: tuple[int, ...] | None
    ) -> tuple[tuple[Any, int], ...] | None:
        """The id checks of a planned call shape with host ids: ``(used, num_blocks)`` per
        range, where ``used`` indexes the call's flat int64 ids and every id it picks must be
        in ``[0, num_blocks)`` (:func:`ids_out_of_range`); None when no call of this shape
        was planned on this binding."""
        sk = self.skeletons.get((direction, num_chunks, skip, layers))
        if sk is None:
            return None
        return tuple((used, num_blocks) for _, _, used, num_blocks in sk.checks)


def bind(manager: Any, kv_caches: Any) -> Binding:
    """Validate ``kv_caches`` against ``manager`` and precompute the per-group geometry."""
    check_bind_inputs(manager, kv_caches)
    group_layouts, tensors, tensor_index = bind_caches(manager, kv_caches)
    regions = {}
    object_sizes = []
    for og_idx in range(manager.num_object_groups):
        for region in object_regions(manager, og_idx):
            regions[region.kernel_group_idx] = (og_idx, region)
        object_sizes.append(object_nbytes(manager, og_idx))
    chunk = manager.lmcache_tokens_per_chunk
    empty = np.zeros(0, dtype=np.int64)
    templates = []
    layer_planes = {}
    for k in range(manager.num_kernel_groups):
        layouts = group_layouts[k]
        first = layouts[0]
        nl = len(layouts)
        planes = tuple(
            PlaneRef(
                tensor_index=tensor_index[_tensor_key(lay.planes[kv][0])],
                byte_offset=lay.planes[kv][1],
                object_plane=kv * nl + pos,
            )
            for kv in range(first.kv_size)
            for pos, lay in enumerate(layouts)
        )
        for pos, layer in enumerate(manager.kernel_groups[k].layer_indices):
            layer_planes[layer] = (k, pos)
        og_idx, region = regions[k]
        templates.append(
            GroupTransfer(
                kernel_group_idx=k,
                object_group_idx=og_idx,
                region_offset=region.offset,
                row_bytes=first.row_bytes,
                block_size=first.block_size,
                slots=region.shape[2],
                planes=planes,
                block_stride_bytes=first.block_stride_bytes,
                num_blocks=first.num_blocks,
                runs=first.runs,
                unit_bytes=min(lay.unit_bytes for lay in layouts),
                itemsize=first.dtype.itemsize,
                block_ids=empty,
                blocks_per_chunk=manager.calculate_num_blocks(k, chunk),
                kept_per_chunk=manager.calculate_num_blocks(
                    k, manager.get_subchunk_sw_size_tokens(k)
                ),
                first_item=0,
                num_chunks=0,
                tokens_per_block=manager.kernel_groups[k].effective_tokens_per_block,
                engine_group_idx=manager.kernel_groups[k].engine_group_idx,
            )
        )
    engine_groups = tuple(g.engine_group_idx for g in manager.kernel_groups)
    distinct = set(engine_groups)
    bpcs = {t.blocks_per_chunk for t in templates}
    return Binding(
        manager,
        tuple(tensors),
        tuple(templates),
        tuple(object_sizes),
        tuple(d.spec for d in tensors),
        engine_groups,
        flat_group=next(iter(distinct)) if len(distinct) == 1 else None,
        uniform_bpc=bpcs.pop() if len(bpcs) == 1 and len(distinct) == 1 else 0,
        layer_planes=layer_planes,
    )


@dataclass(frozen=True, eq=False)
class _Skeleton:
    """The id-independent part of one plan shape ``(direction, num_chunks, skip, layers)``:
    per group the template's fields with the item range (and, for a layer subset, the planes)
    filled in, the id ranges to check, and the plan's own fields. Built once per shape; a
    call then only adds its ids."""

    groups: tuple[tuple[dict, int], ...]  # (GroupTransfer.shape_fields, engine group)
    checks: tuple[tuple[dict, int, Any, int], ...]  # (group fields, engine group, used, nb)
    plan: dict  # every TransferPlan field, the call's own ones at their defaults


_from_shape = GroupTransfer.from_shape  # one attribute lookup less per group and call
_MAX_SKELETONS = 4096  # layer-wise engines: layers x directions x chunk counts
_SMALL_IDS = 32
DEVICE_SKIP = "device"  # the skeleton key of a device / traced skip


def _selected_planes(binding: Binding, layers: tuple[int, ...] | None) -> dict[int, tuple]:
    """Per kernel group, the planes a call moves (all of them without ``layers``); groups
    with none of the layers are left out."""
    if layers is None:
        return {k: t.planes for k, t in enumerate(binding.templates)}
    positions: dict[int, list[int]] = {}
    for layer in layers:
        k, pos = binding.layer_planes[layer]
        positions.setdefault(k, []).append(pos)
    out = {}
    for k in sorted(positions):
        t = binding.templates[k]
        nl = len(binding.manager.kernel_groups[k].layer_indices)
        keep = sorted(positions[k])
        out[k] = tuple(t.planes[kv * nl + pos] for kv in range(len(t.planes) // nl) for pos in keep)
    return out


def _skeleton(
    binding: Binding,
    direction: Direction,
    num_chunks: int,
    skip: Any,
    layers: tuple[int, ...] | None,
) -> _Skeleton:
    manager = binding.manager
    chunk = manager.lmcache_tokens_per_chunk
    groups = []
    checks = []
    seen = set()
    for k, planes in _selected_planes(binding, layers).items():
        template = binding.templates[k]
        bpc, kept = template.blocks_per_chunk, template.kept_per_chunk
        first_item = 0
        if direction == "load":
            window = _chunk_windows(manager, k)
            skip_chunks = max(0, num_chunks - window) if window >= 1 else 0
            first_item = min(skip_chunks * kept, num_chunks * kept)
            if skip != DEVICE_SKIP and skip:
                first_item = skip_first_item(
                    skip=skip,
                    lower_bound=first_item,
                    tokens_per_block=template.tokens_per_block,
                    blocks_per_chunk=bpc,
                    kept_per_chunk=kept,
                    total_items=num_chunks * kept,
                    covered_tokens=num_chunks * chunk,
                )
        fields = template.shape_fields(first_item=first_item, num_chunks=num_chunks, planes=planes)
        engine_group = binding.engine_groups[k]
        groups.append((fields, engine_group))
        if num_chunks * kept - first_item <= 0:
            continue  # moves nothing: its ids are not read
        if kept == bpc:
            used: Any = slice(first_item, num_chunks * bpc)  # item i is id i
            key: Any = (first_item, num_chunks * bpc)
        else:
            i = np.arange(first_item, num_chunks * kept, dtype=np.int64)
            used = (i // kept) * bpc + (bpc - kept) + i % kept
            key = used.tobytes()
        # Groups reading the same ids against the same bound need one check (the first).
        if (engine_group, key, template.num_blocks) not in seen:
            seen.add((engine_group, key, template.num_blocks))
            checks.append((fields, engine_group, used, template.num_blocks))
    plan = dict(
        direction=direction,
        num_chunks=num_chunks,
        object_nbytes=binding.object_nbytes,
        groups=(),
        tensor_specs=binding.tensor_specs,
        device_ids=False,
        skip_tokens=None,
        layers=layers,
        max_ctas=None,
        path="auto",
    )
    if len(binding.skeletons) >= _MAX_SKELETONS:
        binding.skeletons.clear()
    sk = binding.skeletons[(direction, num_chunks, skip, layers)] = _Skeleton(
        tuple(groups), tuple(checks), plan
    )
    return sk


def ids_out_of_range(used: np.ndarray, num_blocks: int) -> bool:
    """Whether any int64 id is outside ``[0, num_blocks)``: one pass, since as uint64 a
    negative id is at least 2**63. Small arrays are cheaper through Python ints."""
    u = used.view(np.uint64)
    if len(u) <= _SMALL_IDS:
        return max(u.tolist()) >= num_blocks
    return int(u.max()) >= num_blocks


def _flat_ids(binding: Binding, block_ids: Any) -> np.ndarray | None:
    """The common case, a signed-integer ndarray of flat ids for a one-engine-group manager,
    as int64; None for anything else (then :func:`normalize_block_ids` validates it)."""
    if (
        binding.flat_group is None
        or type(block_ids) is not np.ndarray
        or block_ids.ndim != 1
        or block_ids.dtype.kind != "i"
    ):
        return None
    return block_ids.astype(np.int64, copy=False)


def _flat_device_ids(binding: Binding, block_ids: Any, ids_spec: IdsSpec | None) -> int | None:
    """The engine's hot case on the device, flat int32/int64 device ids of whole chunks for a
    one-engine-group manager: their chunk count; None for anything else (then
    :func:`normalize_block_ids` validates it and raises the precise error)."""
    bpc = binding.uniform_bpc
    if (
        ids_spec is None
        or not bpc
        or binding.flat_group is None
        or isinstance(block_ids, (list, tuple, range, np.ndarray, Mapping))
    ):
        return None
    spec = ids_spec(block_ids)
    if spec is None or spec[0] not in ("int32", "int64") or len(spec[1]) != 1 or spec[1][0] % bpc:
        return None
    return spec[1][0] // bpc


def _skip_arg(skip: Any, ids_spec: IdsSpec | None) -> tuple[Any, bool]:
    """``(skip, on_device)``: a host skip as a Python int, or a device / traced scalar as is."""
    if isinstance(skip, (bool, np.bool_)) or "bool" in str(getattr(skip, "dtype", "")):
        raise KVGroupsTypeError(f"skip_first_n_tokens: expected an int, got {skip!r}")
    if not isinstance(skip, (int, np.integer)):
        try:
            ndim = getattr(skip, "ndim", 0)
        except Exception:  # noqa: BLE001 - arrays without a rank (nested tensors)
            ndim = None
        if ndim != 0:  # a skip is a scalar: one-element arrays are not taken for one
            raise KVGroupsTypeError(
                f"skip_first_n_tokens: expected an int or a 0-d integer array, got "
                f"{describe_value(skip)}"
            )
    if ids_spec is not None and not isinstance(skip, (int, np.integer)):
        spec = ids_spec(skip)
        if spec is not None:
            dtype, shape = spec
            if dtype not in DEVICE_ID_DTYPES or tuple(shape) != ():
                raise KVGroupsTypeError(
                    f"skip_first_n_tokens: expected an int32/int64 scalar, got {dtype} of "
                    f"shape {tuple(shape)}"
                )
            return skip, True
    try:
        return operator.index(skip), False
    except Exception:  # noqa: BLE001 - floats, strings, tensors that refuse (meta ...)
        raise KVGroupsTypeError(
            f"skip_first_n_tokens: expected an int or a 0-d integer array, got "
            f"{describe_value(skip)}"
        ) from None


def check_layers(binding: Binding, layers: Any) -> tuple[int, ...] | None:
    """``layers=`` as a sorted tuple of distinct grouped layer indices (None: all)."""
    return check_layer_indices(layers, binding.layer_planes)


def check_layer_indices(layers: Any, known: Collection[int]) -> tuple[int, ...] | None:
    """``layers`` as a sorted tuple of distinct indices among ``known`` (a manager's grouped
    layers), None for None."""
    if layers is None:
        return None
    if type(layers) is list and len(layers) == 1 and type(layers[0]) is int and layers[0] in known:
        return (layers[0],)  # the layer-wise hot path: one known layer per call
    if (
        isinstance(layers, (str, bytes, Mapping))
        or not hasattr(layers, "__iter__")
        or getattr(layers, "ndim", 1) == 0
    ):
        raise KVGroupsTypeError(
            f"layers: expected a sequence of layer indices, got {describe_value(layers)}"
        )
    out = []
    try:
        items = list(layers)
    except Exception as exc:  # noqa: BLE001 - an iterable that refuses to iterate
        raise KVGroupsTypeError(
            f"layers: expected a sequence of layer indices, got {describe_value(layers)} ({exc})"
        ) from exc
    for layer in items:
        if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)):
            raise KVGroupsTypeError(
                f"layers: expected int layer indices, got {type(layer).__name__} {layer!r}"
            )
        out.append(int(layer))
    if not out:
        raise KVGroupsValueError("layers: expected at least one layer index, got none")
    unknown = [x for x in out if x not in known]
    if unknown:
        raise KVGroupsIndexError(
            f"layers: expected indices of the manager's grouped layers {sorted(known)}, got "
            f"{unknown}"
        )
    if len(set(out)) != len(out):
        raise KVGroupsValueError(f"layers: expected distinct layer indices, got {out}")
    return tuple(sorted(out))


def plan_call(
    binding: Binding,
    block_ids: Any,
    direction: Direction,
    *,
    skip_first_n_tokens: Any = 0,
    to_host: Any = None,
    ids_spec: IdsSpec | None = None,
    layers: Any = None,
    max_ctas: int | None = None,
    path: str | None = None,
    paths: tuple[str, ...] = ("auto", "kernel"),
) -> TransferPlan:
    """Validate the per-call inputs and return the plan (docs/SEMANTICS.md section 7).

    ``to_host`` converts a framework's host ids (``Backend.to_host_ids``); ``ids_spec``
    (``Backend.device_ids_spec``) recognises device / traced ids and skips, which are only
    checked statically and end up in the plan as they are (``TransferPlan.device_ids``,
    ``skip_tokens``). ``layers`` restricts the plan to those layers' planes; ``max_ctas``
    (a positive int) is passed to the backend as :attr:`TransferPlan.max_ctas`; ``path`` (one
    of the backend's ``paths``) as :attr:`TransferPlan.path`.

    This is the per-call host path of a prepared transfer, so the work that depends only on
    ``(direction, num_chunks, skip_first_n_tokens, layers)`` is memoised on the binding, and plan
    objects are made from those memoised fields by the plan classes' per-call constructors
    (:meth:`GroupTransfer.from_shape`, :meth:`TransferPlan.from_fields`).
    """
    if direction != "store" and direction != "load":
        raise KVGroupsValueError(f"direction: expected 'store' or 'load', got {direction!r}")
    flat = _flat_ids(binding, block_ids)
    bpc = binding.uniform_bpc
    on_device = False
    if flat is not None and bpc and len(flat) % bpc == 0:
        ids: dict[Any, Any] = {binding.flat_group: flat}  # engine group id -> its ids
        num_chunks = len(flat) // bpc
    elif (device := _flat_device_ids(binding, block_ids, ids_spec)) is not None:
        ids, num_chunks, on_device = {binding.flat_group: block_ids}, device, True
    else:
        found = normalize_block_ids(binding.distinct_engine_groups, block_ids, to_host, ids_spec)
        ids, on_device = found.ids, found.device
        num_chunks = _num_chunks(binding, found)
    skip = skip_first_n_tokens
    skip_on_device = False
    if type(skip) is not int:
        skip, skip_on_device = _skip_arg(skip, ids_spec)
    if skip_on_device:
        if direction == "store":
            raise KVGroupsValueError(
                "skip_first_n_tokens: expected 0 for store (store never trims), got a device value"
            )
        key_skip: Any = DEVICE_SKIP
    else:
        key_skip = skip
        if skip:
            covered = num_chunks * binding.manager.lmcache_tokens_per_chunk
            if not 0 <= skip <= covered:
                raise KVGroupsValueError(
                    f"skip_first_n_tokens: expected a value in [0, {covered}] (the tokens the "
                    f"block ids cover), got {skip}"
                )
            if direction == "store":
                raise KVGroupsValueError(
                    f"skip_first_n_tokens: expected 0 for store (store never trims), got {skip}"
                )
    if layers is not None:
        layers = check_layers(binding, layers)
    sk = binding.skeletons.get((direction, num_chunks, key_skip, layers))
    if sk is None:
        sk = _skeleton(binding, direction, num_chunks, key_skip, layers)
    if not on_device:
        for fields, engine_group, used, num_blocks in sk.checks:
            if ids_out_of_range(ids[engine_group][used], num_blocks):
                _check_ids(_from_shape(fields, ids[engine_group]), engine_group)  # raises
    fields = sk.plan.copy()
    fields["groups"] = tuple([_from_shape(f, ids[engine_group]) for f, engine_group in sk.groups])
    if on_device:
        fields["device_ids"] = True
    if skip_on_device:
        fields["skip_tokens"] = skip
    if max_ctas is not None:
        fields["max_ctas"] = _check_max_ctas(max_ctas)
    if path is not None and path != "auto":
        fields["path"] = check_path(path, paths)
    return TransferPlan.from_fields(fields)


def _check_max_ctas(max_ctas: Any) -> int:
    if isinstance(max_ctas, bool) or not isinstance(max_ctas, (int, np.integer)):
        raise KVGroupsTypeError(
            f"max_ctas: expected a positive int or None, got {type(max_ctas).__name__}"
        )
    if max_ctas < 1:
        raise KVGroupsValueError(f"max_ctas: expected a positive int or None, got {max_ctas}")
    return int(max_ctas)


def build_plan(
    manager: Any,
    kv_caches: Any,
    block_ids: Any,
    direction: Direction,
    *,
    skip_first_n_tokens: Any = 0,
    to_host: Any = None,
    ids_spec: IdsSpec | None = None,
    layers: Any = None,
) -> tuple[TransferPlan, list[TensorDesc]]:
    """Validate a call and return its plan plus the backing tensors in tensor_index order."""
    binding = bind(manager, kv_caches)
    plan = plan_call(
        binding,
        block_ids,
        direction,
        skip_first_n_tokens=skip_first_n_tokens,
        to_host=to_host,
        ids_spec=ids_spec,
        layers=layers,
    )
    return plan, list(binding.tensors)


def _check_ids(t: GroupTransfer, engine_group: int) -> None:
    """Every id the transfer will touch must be a block of the group's tensors."""
    if t.num_items == 0:
        return
    if t.kept_per_chunk == t.blocks_per_chunk:
        used = t.block_ids[t.first_item :]  # every id from the first moved item on
    else:
        _, _, used = t.items()
    lo, hi = int(used.min()), int(used.max())
    if lo >= 0 and hi < t.num_blocks:
        return
    bad = (used < 0) | (used >= t.num_blocks)
    if bad.any():
        first_bad = int(used[np.argmax(bad)])
        raise KVGroupsIndexError(
            f"block_ids[{engine_group}]: expected ids in [0, {t.num_blocks}) for kernel group "
            f"{t.kernel_group_idx}, got {first_bad} ({int(bad.sum())} out of range)"
        )
