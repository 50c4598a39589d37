"""Caches sharded over a mesh (``NamedSharding``): every shard moves its own pages, no
collective.

Tensor-parallel JAX engines split the KV heads over a mesh axis. Each device's shard is then
a complete cache of the same format with ``NH / shards`` heads, so the transfer runs under
``jax.shard_map`` with the *per-shard* plan (the plan a manager built from one shard's shapes
makes) and the kernels see plain local arrays. The objects follow the same rule: a global
``[num_chunks, object_nbytes]`` uint8 array sharded on its byte axis over the heads' mesh axes,
whose shard ``r`` is exactly the per-shard manager's object of rank ``r`` (see docs/DESIGN.md,
"Sharded caches"; ``merge_shards`` turns them into the canonical TP=1 bytes). Replicated mesh
axes just repeat the work per replica.

Anything else (a sharded block or layer axis, two sharded axes, caches on different meshes,
objects sharded differently) would need communication: it is refused with
:class:`~kvgroups_core.errors.UnsupportedConfigError` naming the sharding, never replicated.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvgroups_core.errors import UnsupportedConfigError
from kvgroups_core.tensors.descriptors import TensorSpec
from kvgroups_core.tensors.dtypes import as_dtype

from .lowerings.tuning import DEFAULT_TUNING, LoweringTuning


@dataclass(frozen=True)
class ShardLayout:
    """How a binding's caches are sharded: the mesh, each cache's PartitionSpec, the mesh
    axes the heads are split over (``heads_axes``, one PartitionSpec entry) and their size."""

    mesh: Any
    cache_specs: tuple
    heads_axes: Any
    shards: int

    @property
    def object_spec(self) -> P:
        return P(None, self.heads_axes)

    def object_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.object_spec)


def _describe_sharding(sharding) -> str:
    return f"{type(sharding).__name__} {getattr(sharding, 'spec', sharding)}"


class UnknownSharding:
    """What :func:`sharding_of` answers for a tracer under ``jax.jit`` over a mesh with Auto
    axes: XLA picks its sharding later, so the trace cannot tell a heads-sharded cache from a
    replicated one."""

    def __init__(self, mesh) -> None:
        self.mesh = mesh

    def __repr__(self) -> str:
        return f"an unknown sharding over {dict(zip(self.mesh.axis_names, self.mesh.axis_sizes))}"


def sharding_of(x) -> Any:
    """The sharding that spreads ``x`` over several devices; None (one device, or a value
    already local: inside ``shard_map``, or a replicated one); or an :class:`UnknownSharding` for a
    tracer whose mesh has Auto axes (the sharding is XLA's to choose, not visible here)."""
    if isinstance(x, jax.core.Tracer):
        try:
            sharding = jax.typeof(x).sharding
        except Exception:  # noqa: BLE001 - no abstract sharding in this JAX: a local value
            return None
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and any(
            t == jax.sharding.AxisType.Auto and n > 1
            for t, n in zip(mesh.axis_types, mesh.axis_sizes)
        ):
            return UnknownSharding(mesh)
        spec = getattr(sharding, "spec", None)
        if spec is None or all(e is None for e in spec):
            return None  # replicated or manual (inside shard_map): the program is per device
        return sharding
    if not isinstance(x, jax.Array):
        return None
    sharding = x.sharding
    return sharding if len(sharding.device_set) > 1 else None


def vouched_shardings(manager, kv_caches) -> dict[int, Any]:
    """``id(array) -> sharding`` for the arrays of ``kv_caches`` that ``manager`` was built
    from sharded copies of (its ``source_placements``, tensor for tensor); empty when the
    structures do not match tensor for tensor."""
    placements = getattr(manager, "source_placements", ())
    if not placements:
        return {}
    leaves: list = []

    def walk(x) -> None:
        if isinstance(x, (list, tuple)):
            for item in x:
                walk(item)
        else:
            leaves.append(getattr(x, "obj", x))

    walk(kv_caches)
    if len(leaves) != len(placements):
        return {}
    return {
        id(x): p
        for x, p in zip(leaves, placements)
        if x is not None and isinstance(p, NamedSharding)
    }


def _vouch(k: int, x, unknown: UnknownSharding, vouched: dict[int, Any]):
    """The manager's sharding for tracer ``x``, checked against the mesh the trace sees."""
    sharding = vouched.get(id(x))
    mesh = unknown.mesh
    if sharding is None:
        raise UnsupportedConfigError(
            f"kv_caches[{k}]: expected a sharding this call can see, got {unknown} inside "
            "jax.jit (a mesh with Auto axes leaves it to XLA, and moving the pages of a cache "
            "whose sharding is unknown would gather it); build the KVLayerGroupsManager from "
            "the sharded arrays themselves, use a mesh with Explicit axes (jax.make_mesh's "
            "default), or call inside jax.shard_map with a per-shard manager"
        )
    if (tuple(sharding.mesh.axis_names), tuple(sharding.mesh.axis_sizes)) != (
        tuple(mesh.axis_names),
        tuple(mesh.axis_sizes),
    ):
        raise UnsupportedConfigError(
            f"kv_caches[{k}]: expected the mesh the manager was built on "
            f"({dict(sharding.mesh.shape)}), got a trace over {unknown}"
        )
    return sharding


def shard_layout(arrays, vouched: dict[int, Any] | None = None) -> ShardLayout | None:
    """The :class:`ShardLayout` of caches spread over several devices (concrete arrays, or
    tracers whose sharding is visible or that ``vouched`` (:func:`vouched_shardings`) names);
    None when the program runs on one device's values (the plain path). Raises
    UnsupportedConfigError for shardings no collective-free transfer can serve, and for tracers of
    an unknown sharding that nothing vouches for."""
    shardings = [sharding_of(x) for x in arrays]
    for k, (x, s) in enumerate(zip(arrays, shardings)):
        if isinstance(s, UnknownSharding):
            shardings[k] = _vouch(k, x, s, vouched or {})
    multi = [s for s in shardings if s is not None]
    if not multi:
        return None
    if len(multi) != len(arrays):
        raise UnsupportedConfigError(
            "kv_caches: expected every cache on the same mesh, got some on one device and some "
            f"sharded ({_describe_sharding(multi[0])})"
        )
    mesh, specs, entries = None, [], set()
    for k, (x, sharding) in enumerate(zip(arrays, shardings)):
        if not isinstance(sharding, NamedSharding):
            raise UnsupportedConfigError(
                f"kv_caches[{k}]: expected a NamedSharding over a mesh (heads split), got "
                f"{_describe_sharding(sharding)}"
            )
        if mesh is None:
            mesh = sharding.mesh
        elif sharding.mesh != mesh:
            raise UnsupportedConfigError(
                f"kv_caches[{k}]: expected the mesh of kv_caches[0] ({dict(mesh.shape)}), got "
                f"{dict(sharding.mesh.shape)}"
            )
        spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
        split = [e for e in spec if e is not None]
        if len(split) > 1:
            raise UnsupportedConfigError(
                f"kv_caches[{k}]: expected at most one sharded axis (the KV heads), got "
                f"PartitionSpec{spec}"
            )
        entries.add(split[0] if split else None)
        specs.append(P(*spec))
    if len(entries) > 1:
        raise UnsupportedConfigError(
            f"kv_caches: expected every cache's heads split over the same mesh axes, got "
            f"{sorted(map(str, entries))}"
        )
    entry = entries.pop()
    names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    shards = math.prod(mesh.shape[n] for n in names)
    return ShardLayout(mesh, tuple(specs), entry, shards)


def _local_tree(tree: Any, shardings: dict[int, Any]) -> Any:
    """``tree`` with every sharded array replaced by the TensorSpec of one shard."""
    if isinstance(tree, (list, tuple)):
        items = [_local_tree(t, shardings) for t in tree]
        return items if isinstance(tree, list) else tuple(items)
    x = getattr(tree, "obj", tree)
    if id(x) in shardings:
        shape = shardings[id(x)].shard_shape(tuple(x.shape))
        return TensorSpec(tuple(shape), as_dtype(x.dtype))
    return tree


def local_binding(manager: Any, kv_caches: Any, arrays: list, layout: ShardLayout):
    """The binding of one shard: a manager built from the shards' shapes (same formats, engine
    groups and chunk size) bound to them. Raises UnsupportedConfigError unless the shard differs
    from the whole only in its head count (a split block, layer or head-size axis)."""
    from kvgroups_core.grouping.engine_groups import EngineGroupInfo
    from kvgroups_core.grouping.manager import KVLayerGroupsManager
    from kvgroups_core.transfer.objects import object_nbytes
    from kvgroups_core.transfer.planner import bind

    local = _local_tree(
        kv_caches,
        {id(x): NamedSharding(layout.mesh, spec) for x, spec in zip(arrays, layout.cache_specs)},
    )
    # A recurrent-state group keeps its kind (its window is implied); a shard's transfers do
    # not need its conv sub-projections.
    infos = [
        EngineGroupInfo(
            engine_group_id=g.engine_group_idx,
            layer_indices=list(g.layer_indices),
            tokens_per_block=g.tokens_per_block,
            sw_size_tokens=-1 if g.recurrent_state else g.sw_size_tokens,
            recurrent_state=g.recurrent_state,
        )
        for g in manager.kernel_groups
    ]
    what = f"kv_caches sharding PartitionSpec{tuple(layout.cache_specs[0])}"
    try:
        shard_manager = KVLayerGroupsManager(
            local,
            list(manager.engine_kv_formats),
            infos,
            lmcache_tokens_per_chunk=manager.lmcache_tokens_per_chunk,
            separate_object_groups=manager.separate_object_groups,
        )
    except Exception as exc:  # noqa: BLE001 - re-raised typed, the cause attached
        raise UnsupportedConfigError(
            f"{what}: a shard is not a cache of the same format ({exc})"
        ) from exc
    if manager.full_sw_kv:
        shard_manager.enable_full_sw_kv()
    for k, (g, s) in enumerate(zip(manager.kernel_groups, shard_manager.kernel_groups)):
        a, b = g.shape_desc, s.shape_desc
        same = (a.kv_size, a.nl, a.nb, a.bs, a.hs) == (b.kv_size, b.nl, b.nb, b.bs, b.hs)
        if not same or b.nh * layout.shards != a.nh:
            raise UnsupportedConfigError(
                f"{what}: expected the KV heads split in {layout.shards} (kernel group {k}: "
                f"{a.nh} heads -> {a.nh // layout.shards} per shard), got a shard of (kv, nl, "
                f"nb, bs, nh, hs) = {(b.kv_size, b.nl, b.nb, b.bs, b.nh, b.hs)} from "
                f"{(a.kv_size, a.nl, a.nb, a.bs, a.nh, a.hs)}; only a heads axis is split "
                "without communication"
            )
    binding = bind(shard_manager, local)
    for og, n in enumerate(binding.object_nbytes):
        whole = object_nbytes(manager, og)
        if n * layout.shards != whole:  # the global object is the shards' objects side by side
            raise UnsupportedConfigError(
                f"{what}: expected object group {og}'s {whole} bytes to split in "
                f"{layout.shards} shards' objects, got {n} bytes per shard"
            )
    return binding


def localize(plan, binding) -> Any:
    """The per-shard plan of ``plan``: the shard binding's geometry with ``plan``'s items."""
    groups = []
    for g in plan.groups:
        t = binding.templates[g.kernel_group_idx]
        index = [getattr(p, "object_plane", i) for i, p in enumerate(g.planes)]
        # The template's own tuple when every plane moves: the executor's program memo keys
        # on its identity.
        planes = (
            t.planes if index == list(range(len(t.planes))) else tuple(t.planes[i] for i in index)
        )
        groups.append(
            replace(
                t,
                planes=planes,
                block_ids=g.block_ids,
                first_item=g.first_item,
                num_chunks=g.num_chunks,
            )
        )
    local = replace(
        plan,
        groups=tuple(groups),
        object_nbytes=binding.object_nbytes,
        tensor_specs=binding.tensor_specs,
    )
    return local


def check_object_sharding(layout: ShardLayout, objects, plan) -> None:
    """Given objects must already be sharded as the store makes them (else moving them to
    the shards would be a collective)."""
    want = layout.object_sharding()
    for k, obj in enumerate(objects):
        if obj is None:
            continue
        if isinstance(obj, jax.core.Tracer):  # under jax.jit: the abstract sharding
            sharding = sharding_of(obj)
            if isinstance(sharding, UnknownSharding) and sharding.mesh.axis_sizes == tuple(
                layout.mesh.axis_sizes
            ):
                # XLA chooses it (Auto axes): shard_map's in_specs state the store's own
                # sharding, which the caches' binding vouches for.
                continue
            spec = tuple(getattr(sharding, "spec", ())) + (None, None)
            ok = (
                sharding is not None
                and sharding.mesh == layout.mesh
                and spec[:2] == (None, layout.heads_axes)
            )
        else:
            sharding = getattr(obj, "sharding", None)
            ok = sharding is not None and sharding.is_equivalent_to(want, 2)
        if not ok:
            raise UnsupportedConfigError(
                f"objects[{k}]: expected uint8 [{plan.num_chunks}, {plan.object_nbytes[k]}] "
                f"sharded as {want.spec} over the caches' mesh (the store's own objects), got "
                f"{type(sharding).__name__} {getattr(sharding, 'spec', sharding)}"
            )


def execute_sharded(
    layout: ShardLayout,
    local_plan,
    arrays: list,
    objects: list,
    *,
    lowering: str,
    num_warps,
    tuning: LoweringTuning = DEFAULT_TUNING,
):
    """Execute ``local_plan`` on every shard under ``jax.shard_map`` (jitted, donated as the
    plain path): ``(new caches or None, objects)``."""
    from . import executor

    platform = _platform(layout.mesh)
    if lowering == "tpu" and not isinstance(layout.mesh, jax.sharding.Mesh):
        platform = executor.TRACED  # under jax.jit: the caller lowers it (for a TPU)
    fresh = executor.fresh_shapes(local_plan, objects)
    program = executor.program_for(local_plan, lowering, platform, num_warps, fresh, tuning)
    metas, idss = executor.runtime_args(local_plan, None)
    fn = _sharded_fn(
        program, layout, len(local_plan.object_nbytes), tuple(o is None for o in objects)
    )
    given = tuple(o for o in objects if o is not None)
    if local_plan.direction == "store":
        return None, list(fn(tuple(arrays), given, metas, idss))
    return list(fn(tuple(arrays), given, metas, idss)), list(objects)


def _platform(mesh) -> str:
    """The mesh's platform; an abstract mesh (under jax.jit) names none: the default one."""
    if isinstance(mesh, jax.sharding.Mesh):
        return next(iter(mesh.devices.flat)).platform
    return jax.default_backend()


@functools.lru_cache(maxsize=64)
def _sharded_fn(program, layout: ShardLayout, num_objects: int, missing: tuple[bool, ...]):
    from . import executor

    store = program.direction == "store"
    obj_specs = tuple(layout.object_spec for _ in range(num_objects))
    given_specs = tuple(s for s, m in zip(obj_specs, missing) if not m)
    out_specs = obj_specs if store else layout.cache_specs

    def body(caches, given, metas, idss):
        it = iter(given)
        objects = [None if m else next(it) for m in missing]
        return executor.program_body(program, caches, objects, metas, idss)

    mapped = jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(layout.cache_specs, given_specs, P(), P()),
        out_specs=out_specs,
        check_vma=False,
    )
    return jax.jit(mapped, donate_argnums=(1,) if store else (0,))
