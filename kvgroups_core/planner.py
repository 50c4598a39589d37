"""Build :class:`~kvgroups_core.plan.TransferPlan` s from a manager, caches and block ids.

Everything here works on descriptors: bare TensorSpecs plan exactly like real tensors. All
validation of user input happens here, before any backend sees the call, so a rejected call
moves no byte.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .descriptors import TensorDesc
from .errors import KVGroupsIndexError, KVGroupsTypeError, KVGroupsValueError
from .layout import LayerLayout, layer_layout
from .objects import object_nbytes, object_regions
from .plan import Direction, GroupTransfer, PlaneRef, TransferPlan
from .validate import check_bind_inputs


def _chunk_windows(manager: Any, k: int) -> int:
    """The kernel group's window in chunks (-1 = full attention), honouring full-SW mode."""
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
    """Read the call's tensors into per-group layer layouts and one list of backing tensors.

    The call's tensors must match what the manager was built from (shape, dtype and layout of
    every grouped layer); tensors shared by several layers or planes become one slot.
    """
    formats = manager.engine_kv_formats
    group_layouts: list[list[LayerLayout]] = []
    for k, group in enumerate(manager.kernel_groups):
        sd = group.shape_desc
        layouts = []
        for layer in group.layer_indices:
            lay = layer_layout(kv_caches, formats[layer], layer)
            got = (lay.kv_size, lay.num_blocks, lay.block_size, lay.num_heads, lay.head_size,
                   lay.dtype)
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

    slots: list[TensorDesc] = []
    seen: dict[tuple, int] = {}
    for layouts in group_layouts:
        for lay in layouts:
            for desc, _ in lay.planes:
                key = _slot_key(desc)
                if key not in seen:
                    seen[key] = len(slots)
                    slots.append(desc)
    _check_devices(slots)
    return group_layouts, slots, seen


def _slot_key(desc: TensorDesc) -> tuple:
    return (id(desc.obj) if desc.obj is not None else id(desc), desc.spec, desc.byte_offset)


def _check_devices(slots: list[TensorDesc]) -> None:
    devices = {d.device for d in slots}
    if len(devices) > 1:
        raise KVGroupsValueError(
            f"kv_caches: expected every tensor on one device, got {sorted(devices)}"
        )


def _as_id_array(ids: Any, what: str, to_host: Any) -> np.ndarray:
    if to_host is not None and not isinstance(ids, (list, tuple, np.ndarray, range)):
        ids = to_host(ids)
    try:
        arr = np.asarray(ids)
    except Exception as exc:  # noqa: BLE001 - re-raised typed, with the cause attached
        raise KVGroupsTypeError(f"{what}: expected a 1-D sequence of ints, got {ids!r}") from exc
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer)):
        raise KVGroupsTypeError(
            f"{what}: expected a 1-D sequence of ints, got {arr.dtype} array of shape {arr.shape}"
        )
    return arr.astype(np.int64, copy=False)


def normalize_block_ids(manager: Any, block_ids: Any, to_host: Any = None,
                        group_engine_ids: tuple[int, ...] | None = None) -> dict[int, np.ndarray]:
    """Block ids per engine group id, as int64 NumPy arrays.

    Flat ids are allowed only when the manager has one engine group; otherwise a list indexed
    by engine group id or a mapping engine group id -> ids.
    """
    if group_engine_ids is None:
        group_engine_ids = tuple(g.engine_group_idx for g in manager.kernel_groups)
    engine_ids = sorted(set(group_engine_ids))
    if isinstance(block_ids, np.ndarray) and block_ids.ndim == 1 and len(engine_ids) == 1 \
            and block_ids.dtype.kind in "iu":
        return {engine_ids[0]: block_ids.astype(np.int64, copy=False)}
    if isinstance(block_ids, Mapping):
        out = {int(g): _as_id_array(v, f"block_ids[{g}]", to_host) for g, v in block_ids.items()}
    else:
        if isinstance(block_ids, (list, tuple)) and block_ids and not np.isscalar(block_ids[0]) \
                and not isinstance(block_ids[0], np.integer):
            out = {g: _as_id_array(v, f"block_ids[{g}]", to_host) for g, v in enumerate(block_ids)}
        else:
            if len(engine_ids) > 1:
                raise KVGroupsValueError(
                    f"block_ids: expected one id list per engine group (the manager has engine "
                    f"groups {engine_ids}), got a flat list"
                )
            out = {engine_ids[0] if engine_ids else 0: _as_id_array(block_ids, "block_ids",
                                                                     to_host)}
    missing = [g for g in engine_ids if g not in out]
    if missing:
        raise KVGroupsValueError(
            f"block_ids: expected ids for engine groups {engine_ids}, missing {missing}"
        )
    return out


def _num_chunks(binding: "Binding", ids: dict[int, np.ndarray]) -> int:
    chunk = binding.manager.lmcache_tokens_per_chunk
    found: dict[int, int] = {}
    for template, engine_group in zip(binding.templates, binding.engine_groups):
        bpc = template.blocks_per_chunk
        n = len(ids[engine_group])
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
    empty ids; ``slots`` the backing tensors in slot order.

    ``flat_group`` is the engine group id when there is only one (flat ids allowed), else
    None; ``uniform_bpc`` the blocks per chunk every group shares (0 if they differ).
    ``skeletons`` caches the id-independent part of plans (see :func:`plan_call`).
    """

    manager: Any
    slots: tuple[TensorDesc, ...]
    templates: tuple[GroupTransfer, ...]
    object_nbytes: tuple[int, ...]
    tensor_specs: tuple = ()
    engine_groups: tuple[int, ...] = ()
    flat_group: int | None = None
    uniform_bpc: int = 0
    skeletons: dict = field(default_factory=dict, repr=False)


def bind(manager: Any, kv_caches: Any) -> Binding:
    """Validate ``kv_caches`` against ``manager`` and precompute the per-group geometry."""
    check_bind_inputs(manager, kv_caches)
    group_layouts, slots, slot_index = bind_caches(manager, kv_caches)
    regions = {}
    object_sizes = []
    for og_idx in range(manager.num_object_groups):
        for region in object_regions(manager, og_idx):
            regions[region.kernel_group_idx] = (og_idx, region)
        object_sizes.append(object_nbytes(manager, og_idx))
    chunk = manager.lmcache_tokens_per_chunk
    empty = np.zeros(0, dtype=np.int64)
    templates = []
    for k in range(manager.num_kernel_groups):
        layouts = group_layouts[k]
        first = layouts[0]
        planes = tuple(
            PlaneRef(tensor_slot=slot_index[_slot_key(lay.planes[kv][0])],
                     byte_offset=lay.planes[kv][1])
            for kv in range(first.kv_size)
            for lay in layouts
        )
        og_idx, region = regions[k]
        templates.append(GroupTransfer(
            kernel_group_idx=k, object_group_idx=og_idx, region_offset=region.offset,
            row_bytes=first.row_bytes, block_size=first.block_size, slots=region.shape[2],
            planes=planes, block_stride_bytes=first.block_stride_bytes,
            num_blocks=first.num_blocks, runs=first.runs,
            unit_bytes=min(lay.unit_bytes for lay in layouts), itemsize=first.dtype.itemsize,
            block_ids=empty, blocks_per_chunk=manager.calculate_num_blocks(k, chunk),
            kept_per_chunk=manager.calculate_num_blocks(k, manager.get_subchunk_sw_size_tokens(k)),
            first_item=0, num_chunks=0,
        ))
    engine_groups = tuple(g.engine_group_idx for g in manager.kernel_groups)
    distinct = set(engine_groups)
    bpcs = {t.blocks_per_chunk for t in templates}
    return Binding(manager, tuple(slots), tuple(templates), tuple(object_sizes),
                   tuple(d.spec for d in slots), engine_groups,
                   flat_group=next(iter(distinct)) if len(distinct) == 1 else None,
                   uniform_bpc=bpcs.pop() if len(bpcs) == 1 and len(distinct) == 1 else 0)


@dataclass(frozen=True, eq=False)
class _Skeleton:
    """The id-independent part of one plan shape ``(direction, num_chunks, skip)``: per group
    the template's fields with the item range filled in, the id ranges to check, and the
    plan's own fields. Built once per shape; a call then only adds its ids."""

    groups: tuple[tuple[dict, int], ...]  # (GroupTransfer fields but block_ids, engine group)
    checks: tuple[tuple[int, int, Any, int], ...]  # (group index, engine group, used, nb)
    plan: dict


_MAX_SKELETONS = 256
_SMALL_IDS = 32


def _skeleton(binding: Binding, direction: Direction, num_chunks: int, skip: int) -> _Skeleton:
    manager = binding.manager
    groups = []
    checks = []
    seen = set()
    for k, template in enumerate(binding.templates):
        bpc, kept = template.blocks_per_chunk, template.kept_per_chunk
        first_item = 0
        if direction == "load":
            window = _chunk_windows(manager, k)
            skip_chunks = max(0, num_chunks - window) if window >= 1 else 0
            s = manager.calculate_num_blocks(k, skip)
            prefix_items = (s // bpc) * kept + max(0, s % bpc - (bpc - kept))
            first_item = min(max(skip_chunks * kept, prefix_items), num_chunks * kept)
        fields = dict(template.__dict__, first_item=first_item, num_chunks=num_chunks)
        del fields["block_ids"]
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
            checks.append((k, engine_group, used, template.num_blocks))
    plan = dict(direction=direction, num_chunks=num_chunks, object_nbytes=binding.object_nbytes,
                tensor_specs=binding.tensor_specs)
    if len(binding.skeletons) >= _MAX_SKELETONS:
        binding.skeletons.clear()
    sk = binding.skeletons[(direction, num_chunks, skip)] = _Skeleton(
        tuple(groups), tuple(checks), plan)
    return sk


def _out_of_range(used: np.ndarray, num_blocks: int) -> bool:
    """Whether any int64 id is outside ``[0, num_blocks)``: one pass, since as uint64 a
    negative id is at least 2**63. Small arrays are cheaper through Python ints."""
    u = used.view(np.uint64)
    if len(u) <= _SMALL_IDS:
        return max(u.tolist()) >= num_blocks
    return int(u.max()) >= num_blocks


def _flat_ids(binding: Binding, block_ids: Any) -> np.ndarray | None:
    """The common case, an integer ndarray of flat ids for a one-engine-group manager, as int64;
    None for anything else (then :func:`normalize_block_ids` validates it)."""
    if binding.flat_group is None or type(block_ids) is not np.ndarray or block_ids.ndim != 1 \
            or block_ids.dtype.kind not in "iu":
        return None
    return block_ids.astype(np.int64, copy=False)


def plan_call(
    binding: Binding,
    block_ids: Any,
    direction: Direction,
    *,
    skip_first_n_tokens: int = 0,
    to_host: Any = None,
) -> TransferPlan:
    """Validate the per-call inputs and return the plan (SEMANTICS.md section 7).

    This is the per-call host path of a prepared transfer, so the work that depends only on
    ``(direction, num_chunks, skip_first_n_tokens)`` is cached on the binding, and plan
    objects are filled from those cached fields instead of going through ``__init__``.
    """
    if direction != "store" and direction != "load":
        raise KVGroupsValueError(f"direction: expected 'store' or 'load', got {direction!r}")
    flat = _flat_ids(binding, block_ids)
    bpc = binding.uniform_bpc
    if flat is not None and bpc and len(flat) % bpc == 0:
        ids = {binding.flat_group: flat}
        num_chunks = len(flat) // bpc
    else:
        if flat is not None:
            ids = {binding.flat_group: flat}
        else:
            ids = normalize_block_ids(binding.manager, block_ids, to_host, binding.engine_groups)
        num_chunks = _num_chunks(binding, ids)
    skip = skip_first_n_tokens
    if type(skip) is not int:
        if isinstance(skip, bool) or not isinstance(skip, (int, np.integer)):
            raise KVGroupsTypeError(
                f"skip_first_n_tokens: expected an int, got {type(skip).__name__}"
            )
        skip = int(skip)
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
    sk = binding.skeletons.get((direction, num_chunks, skip))
    if sk is None:
        sk = _skeleton(binding, direction, num_chunks, skip)
    for k, engine_group, used, num_blocks in sk.checks:
        if _out_of_range(ids[engine_group][used], num_blocks):
            fields, _ = sk.groups[k]
            _check_ids(_transfer(fields, ids[engine_group]), engine_group)  # raises, with detail
    transfers = []
    for fields, engine_group in sk.groups:
        transfers.append(_transfer(fields, ids[engine_group]))
    # Frozen dataclasses: fill the instance dict directly (``__init__`` would run
    # ``object.__setattr__`` per field, a sizeable share of a one-chunk call).
    plan = object.__new__(TransferPlan)
    plan.__dict__.update(sk.plan)
    plan.__dict__["groups"] = tuple(transfers)
    return plan


def _transfer(fields: dict, ids: np.ndarray) -> GroupTransfer:
    new = object.__new__(GroupTransfer)
    new.__dict__.update(fields)
    new.__dict__["block_ids"] = ids
    return new


def build_plan(
    manager: Any,
    kv_caches: Any,
    block_ids: Any,
    direction: Direction,
    *,
    skip_first_n_tokens: int = 0,
    to_host: Any = None,
) -> tuple[TransferPlan, list[TensorDesc]]:
    """Validate a call and return its plan plus the backing tensors in slot order."""
    binding = bind(manager, kv_caches)
    plan = plan_call(binding, block_ids, direction, skip_first_n_tokens=skip_first_n_tokens,
                     to_host=to_host)
    return plan, list(binding.slots)


def _check_ids(t: GroupTransfer, engine_group: int) -> None:
    """Every id the transfer will touch must be a block of the group's tensors."""
    if t.num_items == 0:
        return
    if t.kept_per_chunk == t.blocks_per_chunk:
        used = t.block_ids[t.first_item:]  # every id from the first moved item on
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


def check_objects(plan: TransferPlan, objects: Sequence[Any], shape_of: Any) -> None:
    """Objects must be one entry per object group: uint8 ``[num_chunks, object_nbytes]`` with
    contiguous rows, or a list of ``num_chunks`` 1-D uint8 buffers of ``object_nbytes`` each.

    ``shape_of(x) -> (dtype name, shape, strides)`` reads an array (``Backend.shape_of``).
    """
    if not isinstance(objects, (list, tuple)):
        raise KVGroupsTypeError(
            f"objects: expected a list with one entry per object group, got "
            f"{type(objects).__name__}"
        )
    if len(objects) != len(plan.object_nbytes):
        raise KVGroupsValueError(
            f"objects: expected {len(plan.object_nbytes)} entries (one per object group), got "
            f"{len(objects)}"
        )
    for og, (obj, nbytes) in enumerate(zip(objects, plan.object_nbytes)):
        if isinstance(obj, (list, tuple)):
            if len(obj) != plan.num_chunks:
                raise KVGroupsValueError(
                    f"objects[{og}]: expected {plan.num_chunks} per-chunk buffers, got {len(obj)}"
                )
            for c, buf in enumerate(obj):
                _check_buffer(shape_of(buf), (nbytes,), f"objects[{og}][{c}]")
        else:
            _check_buffer(shape_of(obj), (plan.num_chunks, nbytes), f"objects[{og}]")


def _check_buffer(found: tuple, shape: tuple[int, ...], what: str) -> None:
    dtype, got_shape, strides = found
    if dtype != "uint8" or tuple(got_shape) != shape:
        raise KVGroupsValueError(
            f"{what}: expected uint8 {list(shape)}, got {dtype} {list(got_shape)}"
        )
    if strides[-1] != 1 and shape[-1] > 1:
        raise KVGroupsValueError(f"{what}: expected contiguous rows, got strides {tuple(strides)}")
