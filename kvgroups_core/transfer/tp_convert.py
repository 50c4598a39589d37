"""Convert memory objects between a TP group's ranks and the whole model (canonical objects).

``merge_shards`` assembles the objects a TP=1 store of the whole cache gives from the objects
of every rank of a TP group; ``split_canonical`` cuts canonical objects into the objects one
rank's ``load`` takes. Both work for either object layout (:mod:`.tensor_parallel`).

The arrays are the caller's (NumPy, torch, JAX, on the host or a device) and never leave their
framework: the conversion is written with what every one of them has, ``x[:, a:b]`` slicing,
the ``.reshape(shape)`` and ``.swapaxes(a, b)`` methods and the array namespace's ``concat``.
The namespace comes from the array (``__array_namespace__``: NumPy >= 2, JAX) or, for torch
(which has none), from the module already loaded in ``sys.modules`` that defines its type, so
the core imports no framework. Each region is moved by one slice-reshape per head set and one
``concat``, over every chunk at once: no Python loop over chunks.
"""

from __future__ import annotations

import sys
from typing import Any

from kvgroups_core.errors import KVGroupsError, KVGroupsTypeError, KVGroupsValueError
from kvgroups_core.grouping.engine_groups import as_bool, as_int
from kvgroups_core.grouping.manager import check_manager, check_managers
from kvgroups_core.grouping.state_tp import merge_conv, split_conv
from kvgroups_core.grouping.tensor_parallel import TP_NATIVE, canonical_region_nbytes

from .objects import object_nbytes, object_regions


def _namespace(x: Any) -> Any:
    get = getattr(x, "__array_namespace__", None)
    if get is not None:
        return get()
    module = sys.modules.get(type(x).__module__.partition(".")[0])
    if module is None or not hasattr(module, "concat"):
        raise KVGroupsTypeError(
            f"objects: expected NumPy, torch or JAX arrays (or any array with "
            f"__array_namespace__), got {type(x).__name__}"
        )
    return module


def _concat(parts: list, axis: int) -> Any:
    if len(parts) == 1:
        return parts[0]
    return _namespace(parts[0]).concat(parts, axis=axis)


def _whole(x: Any) -> Any:
    """A concrete JAX array spread over a mesh, replicated over that mesh; anything else as it
    is. A merge interleaves every shard's bytes in each token row, so it needs them all, and
    JAX refuses eager slices across a sharded axis; under ``jit`` slicing works as it is."""
    sharding = getattr(x, "sharding", None)
    if sharding is None or not hasattr(sharding, "mesh") or len(sharding.device_set) <= 1:
        return x
    jax = sys.modules.get("jax")  # loaded when x is one of its arrays
    if jax is None or isinstance(x, jax.core.Tracer):
        return x
    return jax.device_put(
        x, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    )


def _join(pieces: list, fresh: list[bool]) -> Any:
    """The pieces side by side in each chunk's row, as a new array (a lone piece that is
    still a view of the input is copied, so results never alias the caller's objects)."""
    if len(pieces) == 1 and not fresh[0]:
        return _namespace(pieces[0]).asarray(pieces[0], copy=True)
    return _concat(pieces, axis=1)


def _is_deleted(x: Any) -> bool:
    """A JAX array that was deleted or donated (a tracer has no buffer to ask about)."""
    deleted = getattr(x, "is_deleted", None)
    try:
        return bool(callable(deleted) and deleted())
    except Exception:  # noqa: BLE001 - tracers refuse: they are never deleted
        return False


def _check_object(x: Any, nbytes: int, what: str) -> int:
    """``x`` must be uint8 ``[num_chunks, nbytes]`` with its bytes readable; returns
    num_chunks."""
    if _is_deleted(x):
        raise KVGroupsValueError(
            f"{what}: expected a live array, got a deleted (or donated) JAX array"
        )
    if getattr(x, "is_meta", False) is True:
        raise KVGroupsValueError(f"{what}: expected an array with memory, got a meta tensor")
    dtype = str(getattr(x, "dtype", None)).rpartition(".")[2]
    shape = tuple(getattr(x, "shape", ()))
    if dtype != "uint8" or len(shape) != 2 or shape[1] != nbytes:
        raise KVGroupsValueError(
            f"{what}: expected uint8 [num_chunks, {nbytes}], got {dtype} {list(shape)}"
        )
    return int(shape[0])


def _check_list(objects: Any, count: int, what: str) -> list:
    if not isinstance(objects, (list, tuple)):
        raise KVGroupsTypeError(
            f"{what}: expected a list with one object array per object group, got "
            f"{type(objects).__name__}"
        )
    if len(objects) != count:
        raise KVGroupsValueError(
            f"{what}: expected {count} entries (one per object group), got {len(objects)}"
        )
    return list(objects)


def _region_rows(region: Any) -> tuple[int, int]:
    """``(rows, row_bytes)`` of a region seen as byte rows."""
    kv, nl, slots, _ = region.shape
    return kv * nl * slots, region.row_bytes


def merge_shards(managers: Any, objects_per_rank: Any, *, check_replicas: bool = False) -> list:
    """The canonical objects (a TP=1 store of the whole cache) from every rank's objects.

    Parameters
    ----------
    managers : list of KVLayerGroupsManager
        One per rank of the TP group, in rank order (``managers[r].tp_rank == r``), with equal
        fingerprints.
    objects_per_rank : list
        ``objects_per_rank[r]`` is what rank ``r``'s store returned: one uint8
        ``[num_chunks, object_nbytes]`` array per object group. With the TP-native layout
        every rank may pass the same shared buffers (each rank's part is read from its own).

    One manager and ``[objects]`` whose arrays hold every shard's objects side by side
    (shard ``r`` in columns ``[r * n, (r + 1) * n)``) is also accepted:

    - a rank's manager (``tp_size > 1``, canonical layout) with ``[num_chunks, tp_size * n]``
      arrays, ``n`` its own ``object_nbytes``;
    - the manager of caches sharded over a JAX mesh (built from the global arrays, so
      ``tp_size == 1``) with the objects its store returns: a global array sharded on the byte
      axis, each of the ``s`` shards the object of ``1 / s`` of every group's heads (the
      sharding says ``s``; an unsharded array is a TP=1 store and merges to itself).

    check_replicas : bool, keyword-only, default False
        Also compare every replica of a replicated group with its owner's copy (one manager
        per rank only; eager, it reads the comparison back) and raise naming the first rank
        that differs. Off by default: replicas are written from identical caches.

    Returns
    -------
    list
        One uint8 ``[num_chunks, canonical_nbytes]`` array per object group, of the inputs'
        framework and device, new arrays (never views of the inputs). Replicated groups take
        their owner rank's copy.
    """
    as_bool(check_replicas, "check_replicas")
    if isinstance(managers, (list, tuple)) and len(managers) == 1:
        ref = check_manager(managers[0], "managers[0]")
        objs = _check_list(objects_per_rank, 1, "objects_per_rank")[0]
        objs = _check_list(objs, ref.num_object_groups, "objects_per_rank[0]")
        if ref.tp_size > 1:
            return _merge(*_side_by_side_rank(ref, objs))
        shards = {_byte_axis_shards(x) for x in objs}
        if shards != {1}:
            return _merge(*_side_by_side_mesh(ref, objs, shards))
    managers = check_managers(managers)
    chunk_counts, plans = _from_ranks(managers, objects_per_rank)
    if check_replicas:
        _check_replicas(managers, objects_per_rank)
    return _merge(chunk_counts, plans)


def _check_replicas(managers: list, per_rank: list) -> None:
    ref = managers[0]
    for og in range(ref.num_object_groups):
        regions = [object_regions(m, og) for m in managers]
        for i, region in enumerate(regions[0]):
            shard = ref.tp_shard(region.kernel_group_idx)
            for r in range(ref.tp_size):
                owner = shard.owner_of_part(r // shard.replicas)
                if r == owner:
                    continue
                a, b = regions[r][i], regions[owner][i]
                mine = per_rank[r][og][:, a.offset : a.offset + a.nbytes]
                theirs = per_rank[owner][og][:, b.offset : b.offset + b.nbytes]
                if not bool((mine == theirs).all()):
                    raise KVGroupsValueError(
                        f"objects_per_rank[{r}][{og}]: expected kernel group "
                        f"{region.kernel_group_idx}'s replicated bytes to equal rank {owner}'s "
                        f"copy, got different bytes"
                    )


# A merge plan: per object group, its chunk count and per region (rows, part row bytes, parts),
# each part an (array, byte offset) whose next rows * row bytes bytes of every chunk's row are
# one head set's region, in head order.
_Plan = list


def _one_device(arrays: list, what: str) -> None:
    """Torch tensors of one call on one device (torch refuses to combine others; JAX arrays
    may sit on several devices of one mesh and are moved by JAX itself)."""
    devices = {str(x.device) for x in arrays if type(x).__module__.startswith("torch")}
    if len(devices) > 1:
        raise KVGroupsValueError(f"{what}: expected tensors on one device, got {sorted(devices)}")


def _framework_refusal(what: str, exc: Exception) -> KVGroupsValueError:
    """A framework's own refusal to slice or combine the arrays, as a typed error naming the
    argument (everything checkable was checked before; this is what is left)."""
    return KVGroupsValueError(
        f"{what}: expected arrays the framework can slice and combine, got a refusal: "
        f"{type(exc).__name__}: {exc}"
    )


def _merge(chunk_counts: list[int], plans: _Plan) -> list:
    # A region is (rows, row bytes, parts[, conv split]): its parts are at index 2.
    arrays = [x for regions in plans for region in regions for x, _ in region[2]]
    kinds = {type(x).__module__.partition(".")[0] for x in arrays}
    if len(kinds) > 1:
        raise KVGroupsTypeError(
            f"objects_per_rank: expected arrays of one framework, got {sorted(kinds)}"
        )
    for og, regions in enumerate(plans):  # the arrays one object group's merge combines
        _one_device([x for region in regions for x, _ in region[2]], f"objects_per_rank[*][{og}]")
    try:
        return _merge_checked(chunk_counts, plans)
    except (RuntimeError, ValueError) as exc:
        if isinstance(exc, KVGroupsError):
            raise
        raise _framework_refusal("objects_per_rank", exc) from exc


def _merge_checked(chunk_counts: list[int], plans: _Plan) -> list:
    out = []
    whole: dict[int, Any] = {}  # one replica of each sharded input, however many parts read it
    for chunks, regions in zip(chunk_counts, plans):
        pieces, fresh = [], []
        for rows, row_bytes, parts, *conv in regions:
            for x, _ in parts:
                if id(x) not in whole:
                    whole[id(x)] = _whole(x)
            if conv:  # a conv state: rank parts joined per sub-projection
                ranks = [whole[id(x)][:, o : o + rows * row_bytes] for x, o in parts]
                pieces.append(merge_conv(conv[0], ranks, chunks, rows, _concat))
                fresh.append(False)
                continue
            views = [
                whole[id(x)][:, o : o + rows * row_bytes].reshape((chunks, rows, 1, row_bytes))
                for x, o in parts
            ]
            merged = _concat(views, axis=2)  # head sets side by side in each token row
            pieces.append(merged.reshape((chunks, rows * row_bytes * len(parts))))
            fresh.append(len(parts) > 1)
        out.append(_join(pieces, fresh))
    return out


def _from_ranks(managers: list, objects_per_rank: Any) -> tuple[list[int], _Plan]:
    ref = managers[0]
    per_rank = _check_list(objects_per_rank, ref.tp_size, "objects_per_rank")
    per_rank = [
        _check_list(objs, ref.num_object_groups, f"objects_per_rank[{r}]")
        for r, objs in enumerate(per_rank)
    ]
    chunk_counts, plans = [], []
    for og in range(ref.num_object_groups):  # every input checked before anything is built
        counts = {
            _check_object(per_rank[r][og], object_nbytes(m, og), f"objects_per_rank[{r}][{og}]")
            for r, m in enumerate(managers)
        }
        if len(counts) > 1:
            raise KVGroupsValueError(
                f"objects_per_rank[*][{og}]: expected one chunk count for every rank, got "
                f"{sorted(counts)}"
            )
        chunk_counts.append(counts.pop())
        regions = [object_regions(m, og) for m in managers]
        plan: list[tuple] = []  # (rows, row bytes, parts[, conv split]) per region
        for i, region in enumerate(regions[0]):
            shard = _convertible_shard(ref, region.kernel_group_idx)
            if shard.conv is not None:
                plan.append(
                    _region_rows(region)
                    + (
                        [(per_rank[r][og], regions[r][i].offset) for r in range(ref.tp_size)],
                        shard.conv,
                    )
                )
                continue
            owners = [shard.owner_of_part(p) for p in range(shard.num_parts)]
            plan.append(
                _region_rows(region) + ([(per_rank[r][og], regions[r][i].offset) for r in owners],)
            )
        plans.append(plan)
    return chunk_counts, plans


def _side_by_side_rank(manager: Any, objs: list) -> tuple[list[int], _Plan]:
    """Every rank's objects side by side, described by one rank's manager."""
    if manager.object_layout == TP_NATIVE:
        raise KVGroupsValueError(
            "managers: expected one manager per rank for TP-native objects (or one manager "
            "of the canonical layout for side-by-side shard objects), got one TP-native manager"
        )
    size = manager.tp_size
    chunk_counts, plans = [], []
    for og, obj in enumerate(objs):
        n = object_nbytes(manager, og)
        chunk_counts.append(
            _check_object(
                obj,
                size * n,
                f"objects_per_rank[0][{og}] (the {size} shards' objects side by side)",
            )
        )
        plan: list[tuple] = []  # (rows, row bytes, parts[, conv split]) per region
        for region in object_regions(manager, og):
            shard = _convertible_shard(manager, region.kernel_group_idx)
            if shard.conv is not None:
                plan.append(
                    _region_rows(region)
                    + ([(obj, r * n + region.offset) for r in range(size)], shard.conv)
                )
                continue
            owners = [shard.owner_of_part(p) for p in range(shard.num_parts)]
            plan.append(_region_rows(region) + ([(obj, r * n + region.offset) for r in owners],))
        plans.append(plan)
    return chunk_counts, plans


def _byte_axis_shards(x: Any) -> int:
    """How many shards split a (JAX) array's axis 1; 1 for unsharded arrays and other types."""
    shard_shape = getattr(getattr(x, "sharding", None), "shard_shape", None)
    shape = tuple(getattr(x, "shape", ()))
    if shard_shape is None or len(shape) != 2 or shape[1] == 0:
        return 1
    return shape[1] // shard_shape(shape)[1]


def _side_by_side_mesh(manager: Any, objs: list, shards: set[int]) -> tuple[list[int], _Plan]:
    """Per-shard objects of a mesh-sharded store, described by the global manager."""
    if len(shards) > 1:
        raise KVGroupsValueError(
            f"objects_per_rank[0]: expected every object group's array split into one number "
            f"of shards on its byte axis, got {sorted(shards)}"
        )
    s = shards.pop()
    chunk_counts, plans = [], []
    for og, obj in enumerate(objs):
        n = object_nbytes(manager, og)
        chunk_counts.append(_check_object(obj, n, f"objects_per_rank[0][{og}]"))
        plan = []
        for region in object_regions(manager, og):
            rows, row_bytes = _region_rows(region)
            heads = region.shape[3] // manager.kernel_groups[region.kernel_group_idx].shape_desc.hs
            if heads % s:
                raise KVGroupsValueError(
                    f"objects_per_rank[0][{og}]: expected kernel group "
                    f"{region.kernel_group_idx}'s {heads} KV heads split evenly over the "
                    f"{s} shards of the byte axis, got a remainder of {heads % s}"
                )
            plan.append(
                (rows, row_bytes // s, [(obj, r * (n // s) + region.offset // s) for r in range(s)])
            )
        plans.append(plan)
    return chunk_counts, plans


def _convertible_shard(manager: Any, kernel_group_idx: int) -> Any:
    """The group's TPShard, refusing a conv state whose sub-projections are unknown."""
    shard = manager.tp_shard(kernel_group_idx)
    if shard.needs_conv_projections:
        raise KVGroupsValueError(
            f"manager: kernel group {kernel_group_idx} is a conv state split over "
            f"{shard.tp_size} ranks, expected its EngineGroupInfo to give conv_projections "
            "(each sub-projection's channels and units) to merge or split it, got none"
        )
    return shard


def canonical_nbytes(manager: Any, object_group_idx: int) -> int:
    """Bytes of one chunk's canonical (whole-model) object of ``object_group_idx``."""
    check_manager(manager)
    regions = object_regions(manager, object_group_idx)
    for r in regions:
        _convertible_shard(manager, r.kernel_group_idx)
    return sum(canonical_region_nbytes(manager, r) for r in regions)


def split_canonical(manager: Any, objects: Any, *, shards: int = 1) -> list:
    """This rank's objects, which ``load(manager, ...)`` takes, from canonical objects.

    Parameters
    ----------
    manager : KVLayerGroupsManager
        The rank's manager (``tp_rank``, ``tp_size``, ``object_layout``).
    objects : list
        Canonical objects, one uint8 ``[num_chunks, canonical_nbytes]`` array per object group
        (what a TP=1 store, or :func:`merge_shards`, gives).
    shards : int, keyword-only, default 1
        With the manager of caches sharded over a JAX mesh (built from the global arrays,
        ``tp_size == 1``): the shards the heads are split over. The result then holds every
        shard's objects side by side, shard ``r`` in columns ``[r * n / s, (r + 1) * n / s)``;
        ``jax.device_put(x, NamedSharding(mesh, P(None, heads_axis)))`` makes it the objects
        a load of those caches takes (the inverse of :func:`merge_shards` for them).

    Returns
    -------
    list
        Canonical layout: the rank's own objects (its heads of every region). TP-native
        layout: the whole TP-native object, the same for every rank of the group (each rank's
        load reads its own byte ranges), so one conversion serves the whole group.
    """
    manager = check_manager(manager)
    s = as_int(shards, "shards")  # before comparing: True == 1
    objects = _check_list(objects, manager.num_object_groups, "objects")
    try:
        if s != 1:
            return _split_side_by_side(manager, objects, s)
        return _split(manager, objects)
    except (RuntimeError, ValueError) as exc:
        if isinstance(exc, KVGroupsError):
            raise
        raise _framework_refusal("objects", exc) from exc


def _split(manager: Any, objects: list) -> list:
    native = manager.object_layout == TP_NATIVE
    chunk_counts = [
        _check_object(objects[og], canonical_nbytes(manager, og), f"objects[{og}]")
        for og in range(manager.num_object_groups)
    ]
    out = []
    for og, chunks in enumerate(chunk_counts):
        full = objects[og]
        pieces, fresh = [], []
        offset = 0
        for region in object_regions(manager, og):
            shard = _convertible_shard(manager, region.kernel_group_idx)
            rows, row_bytes = _region_rows(region)
            parts = shard.num_parts
            if shard.conv is not None:  # a conv state: cut per sub-projection
                nbytes = canonical_region_nbytes(manager, region)
                canonical = full[:, offset : offset + nbytes]
                offset += nbytes
                ranks = range(parts) if native else [manager.tp_rank]
                cut = [split_conv(shard.conv, canonical, chunks, rows, r, _concat) for r in ranks]
                pieces.append(_concat(cut, axis=1))
                fresh.append(False)
                continue
            nbytes = region.nbytes * parts
            whole = full[:, offset : offset + nbytes].reshape((chunks, rows, parts * row_bytes))
            offset += nbytes
            if native and parts > 1:
                # [chunks, rows, parts, row] -> [chunks, parts, rows, row]: heads outermost.
                piece = whole.reshape((chunks, rows, parts, row_bytes)).swapaxes(1, 2)
                pieces.append(piece.reshape((chunks, nbytes)))
                fresh.append(rows > 1)  # a real transposition: reshape had to copy
                continue
            if native or parts == 1:
                pieces.append(whole.reshape((chunks, nbytes)))
            else:
                start = shard.part * row_bytes
                piece = whole[:, :, start : start + row_bytes]
                pieces.append(piece.reshape((chunks, rows * row_bytes)))
            fresh.append(False)  # reshape may or may not have copied: copy to be sure
        out.append(_join(pieces, fresh))
    return out


def _split_side_by_side(manager: Any, objects: list, s: int) -> list:
    if s < 1 or manager.tp_size != 1 or manager.object_layout == TP_NATIVE:
        raise KVGroupsValueError(
            f"shards: expected >= 1 with a manager of the global caches (tp_size 1, canonical "
            f"layout), got shards={s} with tp_size {manager.tp_size}, layout "
            f"{manager.object_layout!r}"
        )
    regions_per_og = [object_regions(manager, og) for og in range(manager.num_object_groups)]
    chunk_counts = []
    for og, regions in enumerate(regions_per_og):  # every input checked before anything moves
        chunk_counts.append(
            _check_object(objects[og], object_nbytes(manager, og), f"objects[{og}]")
        )
        for region in regions:
            heads = region.shape[3] // manager.kernel_groups[region.kernel_group_idx].shape_desc.hs
            if heads % s:
                raise KVGroupsValueError(
                    f"shards: expected kernel group {region.kernel_group_idx}'s {heads} KV "
                    f"heads to split evenly over {s} shards, got a remainder of {heads % s}"
                )
    out = []
    for og, (chunks, regions) in enumerate(zip(chunk_counts, regions_per_og)):
        pieces = []
        for region in regions:
            rows, row_bytes = _region_rows(region)
            whole = objects[og][:, region.offset : region.offset + region.nbytes]
            # [chunks, rows, s, row / s] -> [chunks, s, rows * row / s]: shard-major.
            piece = whole.reshape((chunks, rows, s, row_bytes // s)).swapaxes(1, 2)
            pieces.append(piece.reshape((chunks, s, rows * row_bytes // s)))
        joined = _concat(pieces, axis=2)
        n = object_nbytes(manager, og)
        out.append(_join([joined.reshape((chunks, n))], [len(pieces) > 1]))
    return out


def rank_byte_ranges(manager: Any, object_group_idx: int) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` per region: the bytes of one chunk's TP-native object that this
    rank's store writes and its load reads (its own part of each region).

    Slice a shared ``[num_chunks, object_nbytes]`` buffer with them (``buf[:, o:o + n]``) to
    see this rank's share; the ranges of the ranks of a TP group tile the object, replicas of
    a replicated group sharing theirs.
    """
    if check_manager(manager).object_layout != TP_NATIVE:
        raise KVGroupsValueError(
            f"manager.object_layout: expected {TP_NATIVE!r} for TP-native byte ranges, got "
            f"{manager.object_layout!r}"
        )
    return [(r.offset, r.nbytes) for r in object_regions(manager, object_group_idx)]
