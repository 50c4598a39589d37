"""``torch.compile`` of engine code that calls the public transfers.

Dynamo cannot trace the core's planning (NumPy, dataclasses, ctypes) and must not: planning is
host work that depends only on shapes and dtypes. So the public calls (``store``, ``load`` and
the prepared ``store`` / ``load``) are *substituted* for Dynamo (``substitute_in_graph``) by
thin polyfills that hand everything to a ``nonstrict_trace`` function: Dynamo puts one opaque
call in its graph, and AOTAutograd runs the real call on fake tensors. There the core plans
from abstract descriptors (no data pointers; the ids and a device skip stay fake tensors in
the plan), and the backend, instead of launching, records one custom op
(:mod:`kvgroups_torch.compile.ops`) whose handle names a plan *template*: the plan with its per-call
tensors taken out. At run time the op's implementation puts the real id and skip tensors back
and runs the plan (CUDA: the page-copy kernels, ids read on the device; CPU: ``cpu_copy``,
with eager typed errors). A new chunk count is a new id shape, hence a new trace; new ids of
the same shape reuse the graph.

Installed when ``kvgroups_torch`` is imported: import it before compiling (the registry would
otherwise import it lazily during the trace).
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any, Sequence

import numpy as np
import torch
import torch.utils._pytree as pytree

from kvgroups_core.errors import KVGroupsIndexError, KVGroupsValueError, UnsupportedConfigError
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_core.transfer import api as transfer

from . import ops

_is_functional = torch._is_functional_tensor


def is_traced(x: Any) -> bool:
    """Whether ``x`` is a tensor of a ``torch.compile`` trace (fake or functional wrapper).

    Judged from the tensor alone, never from ``torch.compiler.is_compiling()``: Dynamo runs
    the non-strictly traced calls on fake tensors with that flag unset (torch 2.11), and a
    fake taken for a real tensor would be read (``.numpy()``) or launched on."""
    if not isinstance(x, torch.Tensor):
        return False
    if type(x) is torch.Tensor and not _is_functional(x):
        return False  # an eager tensor: two cheap checks, no subclass walk
    return torch._subclasses.fake_tensor.is_fake(x)


def any_traced(tensors: Sequence[Any]) -> bool:
    """Whether a call runs inside a trace (any of its tensors is fake)."""
    for t in tensors:
        if is_traced(t):
            return True
    return False


# --- trace time: the plan becomes a template and one custom op ---------------------------


class PlanTemplate:
    """A plan without its per-call tensors, run by the ops with the real ones."""

    def __init__(self, plan: Any, pinned: str) -> None:
        self.device_ids = bool(getattr(plan, "device_ids", False))
        self.has_skip = getattr(plan, "skip_tokens", None) is not None
        groups = tuple(
            replace(g, block_ids=np.zeros(0, np.int64)) if self.device_ids else g
            for g in plan.groups
        )
        self.plan = (
            replace(plan, groups=groups, skip_tokens=None)
            if self.has_skip
            else replace(plan, groups=groups)
        )
        self.pinned = pinned

    def execute(
        self,
        caches: Sequence[torch.Tensor],
        objects: Sequence[torch.Tensor],
        block_ids: Sequence[torch.Tensor],
        skip: Any,
    ) -> None:
        from kvgroups_torch import cpu as cpu_copy
        from kvgroups_torch.cuda import execute as cuda_execute

        plan = self.plan
        if self.device_ids:
            if len(block_ids) != len(plan.groups):
                raise KVGroupsValueError(
                    f"block_ids: expected {len(plan.groups)} id tensors (one per group "
                    f"transfer), got {len(block_ids)}"
                )
            plan = replace(
                plan,
                groups=tuple(replace(g, block_ids=ids) for g, ids in zip(plan.groups, block_ids)),
            )
        if self.has_skip:
            plan = replace(plan, skip_tokens=skip)
        device = caches[0].device
        if device.type == "cuda":
            cuda_execute.execute_plan(plan, caches, objects, device.index, pinned=self.pinned)
        else:
            cpu_copy.execute_plan(host_plan(plan), caches, objects)


_templates: dict[tuple, int] = {}
_templates_lock = threading.Lock()


def _template_key(plan: Any, pinned: str) -> tuple | None:
    """A value key of a plan's geometry (host ids included), so every trace of one call site
    shares one handle; None when the plan has host ids too large to key cheaply."""
    groups = []
    for g in plan.groups:
        fields = dict(g.__dict__)
        ids = fields.pop("block_ids")
        if isinstance(ids, np.ndarray):
            if ids.size > 4096:
                return None
            fields["block_ids"] = ids.tobytes()
        groups.append(tuple(sorted(fields.items())))
    top = {k: v for k, v in plan.__dict__.items() if k not in ("groups", "skip_tokens")}
    return (
        pinned,
        tuple(groups),
        getattr(plan, "skip_tokens", None) is not None,
        tuple(sorted((k, repr(v)) for k, v in top.items())),
    )


def handle_for(plan: Any, pinned: str) -> int:
    """The ops handle of ``plan``'s template (registered for the process's life: compiled
    graphs hold only the integer)."""
    key = _template_key(plan, pinned)
    with _templates_lock:
        found = _templates.get(key) if key is not None else None
        if found is None:
            found = ops.register(PlanTemplate(plan, pinned), keep=True)
            if key is not None:
                _templates[key] = found
    return found


def record(plan: Any, caches: Sequence[torch.Tensor], objects: Sequence[Any], pinned: str) -> None:
    """Inside a trace: record ``plan`` as one ``kvgroups::store_pages`` / ``load_pages``."""
    flat = []
    for g, entry in enumerate(objects):
        if not isinstance(entry, torch.Tensor):
            raise UnsupportedConfigError(
                f"objects[{g}]: expected one [num_chunks, nbytes] tensor per object group "
                f"inside torch.compile, got {type(entry).__name__} (per-chunk buffers are "
                "eager only)"
            )
        flat.append(entry)
    ids = [g.block_ids for g in plan.groups] if getattr(plan, "device_ids", False) else []
    skip = getattr(plan, "skip_tokens", None)
    op = ops.store_pages if plan.direction == "store" else ops.load_pages
    op(handle_for(plan, pinned), list(caches), flat, ids, skip)


# --- run time on the CPU: device-id plans with host semantics ----------------------------


def host_plan(plan: Any) -> Any:
    """A device-id / device-skip plan made host again: CPU tensors read, every id checked
    (a typed error before any byte moves), the skip applied to each ``first_item``."""
    skip = getattr(plan, "skip_tokens", None)
    if not getattr(plan, "device_ids", False) and skip is None:
        return plan
    if skip is not None:
        skip = int(skip)
    groups = []
    for g in plan.groups:
        ids = g.block_ids
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().to("cpu").numpy()
        ids = np.asarray(ids).astype(np.int64, copy=False)
        first = g.first_item
        if skip is not None:
            covered = g.num_chunks * g.blocks_per_chunk * g.tokens_per_block
            if not 0 <= skip <= covered:
                raise KVGroupsValueError(
                    f"skip_first_n_tokens: expected a value in [0, {covered}] (the tokens the "
                    f"block ids cover), got {skip}"
                )
            from kvgroups_core.transfer.plan import first_item_for_skip

            first = int(first_item_for_skip(g, skip))
        g = replace(g, block_ids=ids, first_item=first)
        if g.num_items > 0:
            _, _, used = g.items()
            bad = (used < 0) | (used >= g.num_blocks)
            if bad.any():
                engine_group = getattr(g, "engine_group_idx", 0)
                raise KVGroupsIndexError(
                    f"block_ids[{engine_group}]: expected ids in [0, {g.num_blocks}) for "
                    f"kernel group {g.kernel_group_idx}, got {int(used[np.argmax(bad)])} "
                    f"({int(bad.sum())} out of range)"
                )
        groups.append(g)
    out = replace(plan, groups=tuple(groups), device_ids=False)
    return replace(out, skip_tokens=None) if skip is not None else out


# --- Dynamo: the public calls as opaque, non-strictly traced calls -----------------------


def _options(**kw: Any) -> dict:
    # nonstrict_trace refuses None arguments: optional ones travel in a dict, when given.
    return {k: v for k, v in kw.items() if v is not None}


# What a nonstrict_trace function returns must be graphable on every torch we support: a
# plain list of tensors (possibly empty). The polyfills rebuild the public return values.
def _traced_store(
    manager: Any, kv_caches: Any, block_ids: Any, options: dict
) -> list[torch.Tensor]:
    objects = options.get("objects")
    out = transfer.store(manager, kv_caches, block_ids, objects, **_call_kw(options))
    return [t for t in out] if objects is None else []


def _traced_load(
    manager: Any, objects: Any, kv_caches: Any, block_ids: Any, options: dict
) -> list[torch.Tensor]:
    transfer.load(
        manager,
        objects,
        kv_caches,
        block_ids,
        skip_first_n_tokens=options.get("skip_first_n_tokens", 0),
        **_call_kw(options),
    )
    return []


def _call_kw(options: dict) -> dict:
    return {k: options[k] for k in ("backend", "layers", "max_ctas", "path") if k in options}


_installed = False


def install() -> None:
    """Teach Dynamo the public calls (idempotent; run when ``kvgroups_torch`` is imported)."""
    global _installed
    if _installed:
        return
    _installed = True
    store_nt = torch._dynamo.nonstrict_trace(_traced_store)
    load_nt = torch._dynamo.nonstrict_trace(_traced_load)
    pytree.register_constant(KVLayerGroupsManager)  # guarded by identity (its __eq__)
    substitute = torch.compiler.substitute_in_graph

    @substitute(transfer.store, skip_signature_check=True)
    def _store(
        manager,
        kv_caches,
        block_ids,
        objects=None,
        *,
        backend=None,
        layers=None,
        max_ctas=None,
        path=None,
    ):
        out = store_nt(
            manager,
            kv_caches,
            block_ids,
            _options(objects=objects, backend=backend, layers=layers, max_ctas=max_ctas, path=path),
        )
        return out if objects is None else list(objects)

    @substitute(transfer.load, skip_signature_check=True)
    def _load(
        manager,
        objects,
        kv_caches,
        block_ids,
        *,
        skip_first_n_tokens=0,
        backend=None,
        layers=None,
        max_ctas=None,
        path=None,
    ):
        if not isinstance(objects, (list, tuple)):
            objects = [objects]
        load_nt(
            manager,
            objects,
            kv_caches,
            block_ids,
            _options(
                skip_first_n_tokens=skip_first_n_tokens,
                backend=backend,
                layers=layers,
                max_ctas=max_ctas,
                path=path,
            ),
        )
        return kv_caches

    @substitute(transfer.prepared_store, skip_signature_check=True)
    def _prepared_store(
        prepared, block_ids, objects=None, *, layers=None, max_ctas=None, path=None
    ):
        out = store_nt(
            prepared.manager,
            prepared.kv_caches,
            block_ids,
            _options(
                objects=objects,
                backend=prepared.backend.name,
                layers=layers,
                max_ctas=max_ctas,
                path=path,
            ),
        )
        return out if objects is None else list(objects)

    @substitute(transfer.prepared_load, skip_signature_check=True)
    def _prepared_load(
        prepared,
        objects,
        block_ids,
        *,
        skip_first_n_tokens=0,
        layers=None,
        max_ctas=None,
        path=None,
    ):
        load_nt(
            prepared.manager,
            objects,
            prepared.kv_caches,
            block_ids,
            _options(
                skip_first_n_tokens=skip_first_n_tokens,
                backend=prepared.backend.name,
                layers=layers,
                max_ctas=max_ctas,
                path=path,
            ),
        )
        return prepared.kv_caches
