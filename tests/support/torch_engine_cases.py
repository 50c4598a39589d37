"""Model-shaped caches, managers and block ids for the engine-native tests (CPU and GPU):
random cache bytes, ids that are a random permutation of the blocks, and a reference run of
the same public call on CPU copies."""

from __future__ import annotations

import numpy as np
import torch

import kvgroups_core as kc
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_tools.catalog import MODELS


def model_caches(
    name: str = "llama3-8b",
    *,
    layers: int = 4,
    num_blocks: int = 48,
    device: str = "cpu",
    seed: int = 0,
    chunk: int = 64,
):
    """``(manager, caches)``: ``layers`` float16 layers of catalogue model ``name`` filled
    with random bytes on ``device``."""
    model = MODELS[name].build(num_blocks=num_blocks, layers=layers, dtype="float16")
    rng = np.random.default_rng(seed)
    caches = []
    for spec in model.kv_caches:
        nbytes = int(np.prod(spec.shape)) * spec.dtype.itemsize
        raw = torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8))
        caches.append(raw.view(torch.float16).view(spec.shape).to(device))
    manager = KVLayerGroupsManager(
        caches,
        list(model.formats),
        list(model.engine_group_infos) or None,
        lmcache_tokens_per_chunk=chunk,
    )
    return manager, caches


def ids_for(manager, rng, num_chunks: int, num_blocks: int = 48):
    """Block ids covering ``num_chunks`` chunks: flat for one engine group, else a dict."""
    by_group = {}
    for k, g in enumerate(manager.kernel_groups):
        n = num_chunks * manager.calculate_num_blocks(k, manager.lmcache_tokens_per_chunk)
        by_group.setdefault(g.engine_group_idx, rng.permutation(num_blocks)[:n])
    return by_group if len(by_group) > 1 else next(iter(by_group.values()))


def map_ids(ids, fn):
    """``fn`` applied to every id array of ``ids`` (flat or per engine group)."""
    if isinstance(ids, dict):
        return {g: fn(v) for g, v in ids.items()}
    return fn(ids)


def random_objects(manager, num_chunks: int, seed: int, device: str = "cpu"):
    """One random ``[num_chunks, object_nbytes]`` uint8 tensor per object group."""
    rng = np.random.default_rng(seed)
    return [
        torch.from_numpy(
            rng.integers(0, 256, (num_chunks, kc.object_nbytes(manager, g)), dtype=np.uint8)
        ).to(device)
        for g in range(manager.num_object_groups)
    ]


def cache_bytes(caches) -> list[np.ndarray]:
    return [c.detach().cpu().contiguous().view(torch.uint8).numpy().copy() for c in caches]


def object_bytes(objects) -> list[np.ndarray]:
    return [o.detach().cpu().numpy().copy() for o in objects]


def reference_store(manager, caches, ids, *, layers=None, objects=None) -> list[np.ndarray]:
    """The NumPy reference backend's store of the same call (caches copied to the host)."""
    host = [c.detach().cpu().view(torch.uint8).numpy().view(np.float16).copy() for c in caches]
    if objects is not None:
        objects = object_bytes(objects)
    ids = map_ids(ids, lambda v: np.asarray(v.cpu() if isinstance(v, torch.Tensor) else v))
    kw = {} if layers is None else {"layers": layers}
    out = kc.store(manager, host, ids, objects, backend="numpy", **kw)
    return [np.asarray(o) for o in out]


def reference_load(manager, objects, caches, ids, *, skip=0, layers=None) -> list[np.ndarray]:
    """The NumPy reference backend's load of the same call; returns the caches' bytes."""
    host = [c.detach().cpu().view(torch.uint8).numpy().view(np.float16).copy() for c in caches]
    ids = map_ids(ids, lambda v: np.asarray(v.cpu() if isinstance(v, torch.Tensor) else v))
    kc.load(
        manager,
        object_bytes(objects),
        host,
        ids,
        skip_first_n_tokens=skip,
        backend="numpy",
        **({} if layers is None else {"layers": layers}),
    )
    return [h.view(np.uint8) for h in host]


def reference_with_drops(manager, caches, objects, ids: np.ndarray, direction: str):
    """The NumPy reference of a call whose flat device ids may be out of range: the items
    of bad ids move nothing, every other item moves (``execute_plan``'s drop mode).
    Returns ``(cache bytes, object bytes, the bad ids met)``."""
    from dataclasses import replace

    from kvgroups_core.transfer.planner import bind, plan_call
    from kvgroups_core.transfer.reference import execute_plan

    host = [c.detach().cpu().view(torch.uint8).numpy().view(np.float16).copy() for c in caches]
    host_objects = object_bytes(objects)
    binding = bind(manager, host)
    num_blocks = manager.kernel_groups[0].shape_desc.nb
    plan = plan_call(binding, np.where((ids >= 0) & (ids < num_blocks), ids, 0), direction)
    plan = replace(
        plan,
        device_ids=True,
        groups=tuple(replace(g, block_ids=ids.astype(np.int64)) for g in plan.groups),
    )
    bad = execute_plan(plan, binding.tensors, host_objects, drop_out_of_range=True)
    return [h.view(np.uint8) for h in host], host_objects, bad
