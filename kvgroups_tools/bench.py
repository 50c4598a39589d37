"""Transfer benchmarks: the bandwidth of every page-copy path next to measured ceilings.

The runner is framework-free. It builds managers and plans (plain core data) for the points
of a :class:`~kvgroups_tools.bench_matrix.Matrix` and drives each runtime through a *bench
kit*: a small module per backend (``kvgroups_tools.bench_kits.numpy_kit``, ``torch_kit``,
``jax_kit``), imported by name only when asked
for, that makes caches and objects, runs a path, times it the runtime's way (CUDA events,
``block_until_ready``) and measures the ceilings.

Every figure is bytes read + written per second (``gbps = 2 * bytes / median_s``, ``bytes``
being the payload moved), reported next to the same run's ceiling for the same byte count
(``frac_of_ceiling`` is a ratio of times) and the runtime's plain baseline
(``speedup_vs_baseline = baseline_s / median_s``). Records, one JSON object each, have a
``record`` field: ``meta``, ``ceiling``, ``transfer``, ``manager``, ``skipped``, ``error``,
``summary``. A failing path becomes an ``error`` record and the run goes on.

A kit module exposes ``make_kit(device: str | None)`` returning an object with:

``backend``, ``device`` (``"cpu"`` / ``"cuda"``), ``baseline`` and ``default_path`` (path
names); ``info()`` -> dict; ``paths()`` -> every path offered here; ``default_paths()`` -> those
run unless named; ``path_kind(path)`` -> ``"kernel"`` / ``"baseline"`` / ``"reference"``;
``placements()``; ``check(path, placement)`` -> why it cannot run, or None; ``l2_bytes()``;
``make_caches(specs, seed, fill=True)``; ``alloc_objects(wl, object_nbytes, chunks,
placement, count, seed)`` (sets ``wl.objects``); ``run(path, plan, wl, r)``;
``time(fn, wl, repeats=, warmup=, target_s=, max_calls=)`` -> :class:`Timing`;
``scramble(wl, r)``; ``host_bytes(wl, r)`` -> list of uint8 arrays; ``ceiling(name, nbytes,
rotate, **timing)`` -> :class:`Timing`; ``release(wl)``.
"""

from __future__ import annotations

import importlib
import math
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_core.grouping.shape_spec import format_kvcache_shape_spec
from kvgroups_core.tensors.descriptors import TensorDesc, TensorSpec
from kvgroups_core.transfer.planner import bind, plan_call

from .bench_matrix import Matrix, Point, Shape
from .bench_public import Case, Refused, applies, make_call

#: Every path each kit can offer (which of them run depends on the device), and those that
#: need a GPU: what ``--paths`` is checked against before any kit (framework) is imported.
KIT_PATHS = {
    "numpy": ("take", "reference"),
    "torch": ("index", "cuda", "cuda-staged"),
    "jax": ("xla", "pallas-triton", "pallas-mosaic", "cuda", "interpret"),
}
GPU_PATHS = frozenset({"cuda", "cuda-staged", "pallas-triton", "pallas-mosaic"})
KIT_MODULES = {
    "numpy": "kvgroups_tools.bench_kits.numpy_kit",
    "torch": "kvgroups_tools.bench_kits.torch_kit",
    "jax": "kvgroups_tools.bench_kits.jax_kit",
}
#: Ceiling compared with each placement and direction.
CEILINGS = {
    ("device", "store"): "device_copy",
    ("device", "load"): "device_copy",
    ("pinned", "store"): "pinned_d2h",
    ("pinned", "load"): "pinned_h2d",
}
SCRATCH_FILL = 0xA5


@dataclass(frozen=True)
class Timing:
    """Seconds per call, one entry per repeat (each repeat ``calls`` back-to-back calls)."""

    seconds: tuple[float, ...]
    calls: int
    host_s: float | None = None  # host time per call (dispatch), not waiting for the device
    first_s: float | None = None  # the first warm-up call, waited for: compiles and first touch

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


@dataclass
class Workload:
    """What a kit's calls act on: backing tensors in plan tensor_index order and the objects
    (one list per rotation, one array per object group). Kits replace entries (JAX donation)."""

    tensors: list
    objects: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    caches: list | None = None  # the caches as a user holds them (public calls); flat list
    positions: list = field(default_factory=list)  # caches[i] is tensors[positions[i]]

    def sync_caches(self) -> None:
        """After an internal JAX load replaced tensors: the user-side list follows."""
        if self.caches is not None:
            for i, p in enumerate(self.positions):
                if not isinstance(self.tensors[p], TensorDesc):
                    self.caches[i] = self.tensors[p]


def map_specs(structure: Any, fn: Callable[[TensorSpec, int], Any], _n: list | None = None) -> Any:
    """``fn(spec, i)`` for every TensorSpec of a cache structure (lists kept as lists)."""
    n = [0] if _n is None else _n
    if isinstance(structure, (list, tuple)):
        items = [map_specs(x, fn, n) for x in structure]
        return items if isinstance(structure, list) else tuple(items)
    n[0] += 1
    return fn(structure, n[0])


def calls_for(estimate_s: float, target_s: float, max_calls: int) -> int:
    """Back-to-back calls per repeat so a repeat lasts about ``target_s``."""
    if target_s <= 0 or estimate_s <= 0:
        return 1
    return int(min(max(1, math.ceil(target_s / estimate_s)), max_calls))


def wall_timer(
    fn: Callable[[int], Any],
    sync: Callable[[], None],
    *,
    repeats: int,
    warmup: int,
    target_s: float,
    max_calls: int,
) -> Timing:
    """Wall-clock per-call time of batches of back-to-back ``fn(i)`` calls, ``sync()`` waiting
    for the device once per batch (the host runs ahead, so dispatch hides behind the work)."""
    i, estimate, first = 0, 0.0, None
    for _ in range(max(1, warmup)):
        t0 = time.perf_counter()
        fn(i)
        sync()
        estimate, i = time.perf_counter() - t0, i + 1
        first = estimate if first is None else first
    calls = calls_for(estimate, target_s, max_calls)
    secs, host = [], []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(i)
            i += 1
        t1 = time.perf_counter()
        sync()
        secs.append((time.perf_counter() - t0) / calls)
        host.append((t1 - t0) / calls)
    return Timing(tuple(secs), calls, statistics.median(host), first)


def load_kit(item: str) -> Any:
    """The kit for ``"name[-device]"`` (``"torch"``, ``"torch-cpu"``, ``"jax-cuda"``)."""
    name, _, device = item.partition("-")
    module = importlib.import_module(KIT_MODULES.get(name, f"kvgroups_tools.bench_kits.{name}_kit"))
    return module.make_kit(device or None)


def moved_bytes(plan: Any) -> int:
    """Payload bytes a plan moves (each is read once and written once)."""
    return sum(max(g.num_items, 0) * g.num_planes * g.block_size * g.row_bytes for g in plan.groups)


def call_bytes(
    manager: Any,
    kv_caches: Any,
    block_ids: Any,
    direction: str,
    *,
    layers: Any = None,
    skip_first_n_tokens: int = 0,
) -> int:
    """Payload bytes one public call moves (what its copy ceiling must copy): the call's plan,
    made from host ids without running it."""
    from kvgroups_core.transfer.planner import bind, plan_call

    plan = plan_call(
        bind(manager, kv_caches),
        block_ids,
        direction,
        layers=layers,
        skip_first_n_tokens=skip_first_n_tokens,
    )
    return moved_bytes(plan)


def rotation(nbytes: int, l2_bytes: int, limit: int = 8) -> int:
    """Buffer/id sets to rotate so a call's data left the L2 cache since its last use."""
    return int(min(limit, max(1, math.ceil(3 * l2_bytes / max(2 * nbytes, 1)))))


def shape_info(shape: Shape, manager: KVLayerGroupsManager) -> dict:
    g = manager.kernel_groups[0]
    sd = g.shape_desc
    try:
        spec = format_kvcache_shape_spec(manager.kernel_groups)
    except Exception:  # noqa: BLE001 - some catalogue groups have no spec spelling
        spec = None
    return {
        "shape": shape.label,
        "model": shape.model,
        "layers": len(manager.engine_kv_formats),
        "spec": spec,
        "kernel_groups": manager.num_kernel_groups,
        "num_blocks": sd.nb,
        "block_size": sd.bs,
        "num_heads": sd.nh,
        "head_size": sd.hs,
        "dtype": g.dtype.name,
        "page_bytes": sd.bs * sd.nh * sd.hs * g.dtype.itemsize,
    }


def user_caches(caches: Any, tensors: Sequence[Any]) -> tuple[list | None, list]:
    """The flat cache list public calls take and each entry's tensor index; (None, []) for nested
    structures (public calls are then refused)."""
    if not isinstance(caches, list):
        return None, []
    index_of = {}
    for k, d in enumerate(tensors):
        index_of.setdefault(id(d), k)
        index_of.setdefault(id(getattr(d, "obj", d)), k)
    positions = [index_of.get(id(x)) for x in caches]
    return (None, []) if None in positions else (list(caches), positions)


def _done_key(record: dict, layers: int | None) -> tuple:
    return (
        record.get("backend"),
        record.get("device"),
        record.get("shape"),
        layers,
        record.get("chunks"),
        record.get("placement"),
        record.get("path"),
        record.get("direction"),
        record.get("call", "internal"),
        record.get("ids", "host"),
    )


def _error(exc: BaseException) -> dict:
    tb = traceback.extract_tb(exc.__traceback__)[-3:]
    return {
        "error_type": type(exc).__name__,
        "error": str(exc)[:600],
        "where": [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in tb],
    }


class BenchRun:
    """One run of a matrix over several kits; records go to ``emit`` as they are made.

    Parameters
    ----------
    matrix : Matrix
        The points, in run order (:mod:`kvgroups_tools.bench_matrix`).
    emit : callable
        Called with each record (a JSON-ready dict) as soon as it exists.
    paths : sequence of str, optional
        Paths to report (default: each kit's ``default_paths()``); the baseline always runs.
    directions : sequence of {"store", "load"}
    placements : sequence of {"device", "pinned"}, optional
        Restrict the matrix's placements.
    budget_s : float, optional
        After this many seconds, cases not yet started become ``skipped`` records.
    done : iterable of dict, optional
        Records of an earlier run (``--resume``): a path and direction of a point that already
        has a ``transfer`` record there is not measured again, and a point with nothing left
        is not built at all; likewise ``manager`` records. A matrix cut by a time limit is
        finished this way.
    """

    def __init__(
        self,
        matrix: Matrix,
        emit: Callable[[dict], None],
        *,
        paths: Sequence[str] | None = None,
        directions: Sequence[str] = ("store", "load"),
        placements: Sequence[str] | None = None,
        budget_s: float | None = None,
        seed: int = 0,
        log: Callable[[str], None] | None = None,
        done: Iterable[dict] = (),
    ) -> None:
        self.matrix, self._emit, self.paths = matrix, emit, paths
        self.directions, self.placements = tuple(directions), placements
        self.deadline = time.monotonic() + budget_s if budget_s else None
        self.seed, self.log = seed, log or (lambda s: None)
        self.records: list[dict] = []
        self._ceilings: dict[tuple, float | None] = {}
        done = list(done)
        # A refused public call (device ids a CPU runtime reads to the host) stays refused:
        # done too. Cases cut by a time limit are not.
        self._done = {
            _done_key(r, layers)
            for r in done
            if r.get("record") == "transfer"
            or (
                r.get("record") == "skipped"
                and r.get("call") not in (None, "internal")
                and "time" not in str(r.get("reason"))
            )
            for layers in (r.get("layers"), None)
        }
        self._done_managers = {
            (r.get("backend"), r.get("device"), r.get("model"), r.get("layers"))
            for r in done
            if r.get("record") == "manager"
        }

    def emit(self, record: dict) -> None:
        self.records.append(record)
        self._emit(record)

    def over_budget(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def run(self, backends: Sequence[str]) -> list[dict]:
        for item in backends:
            try:
                kit = load_kit(item)
            except Exception as exc:  # noqa: BLE001 - reported; the other backends still run
                self.emit({"record": "error", "backend": item, "stage": "load kit", **_error(exc)})
                continue
            self.emit(
                {
                    "record": "meta",
                    "backend": kit.backend,
                    "device": kit.device,
                    "matrix": self.matrix.name,
                    "python": platform.python_version(),
                    "numpy": np.__version__,
                    "argv": sys.argv[1:],
                    **kit.info(),
                }
            )
            self.run_managers(kit)  # cheap and host-bound: first, before a budget runs out
            for shape, points in self.matrix.shapes():
                self.run_shape(kit, shape, points)
        self.run_managers(None)
        from .bench_report import summarize

        for record in summarize(self.records):
            self.emit(record)
        return self.records

    # --- transfers -------------------------------------------------------------------------
    def selected_paths(self, kit: Any) -> list[str]:
        return list(self.paths) if self.paths else list(kit.default_paths())

    def is_done(
        self,
        kit: Any,
        shape: Shape,
        chunks: int,
        placement: str,
        path: str,
        direction: str,
        call: str = "internal",
        ids: str = "host",
    ) -> bool:
        """Whether an earlier run (``done``) already measured this case of this point."""
        return (
            kit.backend,
            kit.device,
            shape.label,
            shape.layers,
            chunks,
            placement,
            path,
            direction,
            call,
            ids,
        ) in self._done

    def tasks(self, kit: Any, point: Point) -> list[tuple[str, str, str, str | None]]:
        """``(call, ids, path, backend name)`` measured at ``point``: the internal entry points
        (``call="internal"``: every selected path when the matrix keeps them, else none; the
        baseline runs anyway, for the speedups), then the public calls."""
        m = self.matrix
        out = []
        if m.internal:
            out += [
                ("internal", "host", p, None)
                for p in self.selected_paths(kit)
                if kit.check(p, point.placement) is None
            ]
        calls = point.calls if point.calls is not None else m.calls
        if calls and hasattr(kit, "public_calls"):
            paths = kit.public_paths(point.placement)
            if not (point.all_paths or m.all_paths):
                paths = paths[:1]  # the default path: what a user gets without asking
            if self.paths:
                paths = [pp for pp in paths if pp[0] in self.paths]
            # Layer-wise runs the default path only: the paths are compared on whole calls.
            out += [
                (call, ids, path, name)
                for call in calls
                if call in kit.public_calls()
                for ids in m.ids
                for path, name in (paths[:1] if call == "layerwise" else paths)
            ]
        return out

    def left_to_do(self, kit: Any, point: Point) -> list[tuple]:
        """The tasks that can run here and still miss a direction."""
        return [
            t
            for t in self.tasks(kit, point)
            if not all(
                self.is_done(kit, point.shape, point.chunks, point.placement, t[2], d, t[0], t[1])
                for d in self.directions
                if applies(t[0], d)
            )
        ]

    def run_shape(self, kit: Any, shape: Shape, points: list[Point]) -> None:
        points = [
            p
            for p in points
            if p.placement in kit.placements()
            and (self.placements is None or p.placement in self.placements)
            and self.left_to_do(kit, p)
        ]
        if not points:
            return
        where = {
            "backend": kit.backend,
            "device": kit.device,
            "shape": shape.label,
            "layers": shape.layers,
        }
        if self.over_budget():
            self.emit({"record": "skipped", **where, "reason": "time budget"})
            return
        try:
            self.measure_shape(kit, shape, points, where)
        finally:
            kit.release()  # after measure_shape returned: its caches are garbage by now

    def measure_shape(self, kit: Any, shape: Shape, points: list[Point], where: dict) -> None:
        try:
            chunk = self.matrix.chunk_tokens
            probe = shape.build(1)
            pm = KVLayerGroupsManager(
                probe.kv_caches,
                list(probe.formats),
                probe.engine_group_infos,
                lmcache_tokens_per_chunk=chunk,
            )
            bpc = max(pm.calculate_num_blocks(k, chunk) for k in range(pm.num_kernel_groups))
            nb = max(self.matrix.min_blocks, math.ceil(1.25 * max(p.chunks for p in points) * bpc))
            model = shape.build(nb)
            caches = kit.make_caches(model.kv_caches, self.seed)
            manager = KVLayerGroupsManager(
                caches,
                list(model.formats),
                model.engine_group_infos,
                lmcache_tokens_per_chunk=chunk,
            )
            binding = bind(manager, caches)
            info = shape_info(shape, manager)
        except Exception as exc:  # noqa: BLE001 - reported; the other shapes still run
            self.emit({"record": "error", **where, "stage": "build caches", **_error(exc)})
            return
        wl = Workload(tensors=list(binding.tensors))
        wl.caches, wl.positions = user_caches(caches, binding.tensors)
        del caches
        for point in points:
            try:
                self.run_point(kit, wl, manager, binding, info, point)
            except Exception as exc:  # noqa: BLE001
                self.emit(
                    {
                        "record": "error",
                        **where,
                        "chunks": point.chunks,
                        "placement": point.placement,
                        "stage": "point",
                        **_error(exc),
                    }
                )
            wl.objects = []

    def block_ids(
        self, manager: KVLayerGroupsManager, chunks: int, rng: np.random.Generator
    ) -> dict[int, np.ndarray]:
        """Random distinct blocks per engine group, whole chunks."""
        out: dict[int, np.ndarray] = {}
        chunk = manager.lmcache_tokens_per_chunk
        for k, g in enumerate(manager.kernel_groups):
            need = chunks * manager.calculate_num_blocks(k, chunk)
            nb = min(
                kg.shape_desc.nb
                for kg in manager.kernel_groups
                if kg.engine_group_idx == g.engine_group_idx
            )
            if g.engine_group_idx not in out:
                out[g.engine_group_idx] = rng.permutation(nb)[:need].astype(np.int64)
        return out

    def run_point(
        self, kit: Any, wl: Workload, manager: Any, binding: Any, info: dict, point: Point
    ) -> None:
        m = self.matrix
        rng = np.random.default_rng(self.seed + point.chunks)
        chunk_bytes = sum(binding.object_nbytes)
        rotate = rotation(point.chunks * chunk_bytes, kit.l2_bytes())
        ids = [self.block_ids(manager, point.chunks, rng) for _ in range(rotate)]
        plans = {d: [plan_call(binding, i, d) for i in ids] for d in ("store", "load")}
        verify = point.headline or point.chunks * chunk_bytes <= m.verify_bytes
        # Warm-up touches every rotation once (first-touch page faults, allocator growth).
        timing = dict(
            repeats=m.repeats,
            warmup=max(m.warmup, rotate),
            target_s=m.target_s,
            max_calls=m.max_calls,
        )
        ceilings = {}
        for d in self.directions:
            ceilings[d] = self.ceiling(
                kit, CEILINGS[(point.placement, d)], moved_bytes(plans[d][0]), rotate, timing
            )
        kit.alloc_objects(
            wl, binding.object_nbytes, point.chunks, point.placement, rotate + verify, self.seed
        )
        common = {
            "record": "transfer",
            "backend": kit.backend,
            "device": kit.device,
            "matrix": m.name,
            **info,
            "chunks": point.chunks,
            "chunk_tokens": m.chunk_tokens,
            "bytes_per_chunk": chunk_bytes,
            "placement": point.placement,
            "headline": point.headline,
            "sweeps": list(point.sweeps),
            "rotate": rotate,
        }
        tasks = self.tasks(kit, point)
        internal = [t[2] for t in tasks if t[0] == "internal"]
        order = [kit.baseline] + [p for p in internal if p != kit.baseline]
        for d in self.directions:
            nbytes = moved_bytes(plans[d][0])
            base_s = reference = None
            for path in order:
                done = self.is_done(kit, point.shape, point.chunks, point.placement, path, d)
                if done and path != kit.baseline:
                    continue  # measured by the run being resumed (the baseline still runs)
                rec = {
                    **common,
                    "call": "internal",
                    "ids": "host",
                    "direction": d,
                    "path": path,
                    "path_option": None,
                    "path_kind": kit.path_kind(path),
                    "default_path": path == kit.default_path,
                    "bytes": nbytes,
                    "bytes_rw": 2 * nbytes,
                    "baseline_path": kit.baseline,
                }
                reason = kit.check(path, point.placement)
                if reason is None and self.over_budget():
                    reason = "time budget"
                if reason is not None:
                    if path in internal:
                        self.emit({**rec, "record": "skipped", "reason": reason})
                    continue
                try:
                    if verify:
                        kit.scramble(wl, 0)
                    t = kit.time(
                        lambda i, p=path, d=d: kit.run(p, plans[d][i % rotate], wl, i % rotate),
                        wl,
                        **timing,
                    )
                    verified, reference = self.verify(
                        kit,
                        wl,
                        path == kit.baseline,
                        d,
                        plans,
                        rotate,
                        verify,
                        reference,
                        lambda p=path: kit.run(p, plans["load"][0], wl, 0),
                    )
                except Exception as exc:  # noqa: BLE001 - one path failing must not hide others
                    self.emit({**rec, "record": "error", "stage": "transfer", **_error(exc)})
                    continue
                if path == kit.baseline:
                    base_s = t.median
                if path not in internal or done:
                    continue
                self.emit(self.transfer_record(rec, t, ceilings[d], base_s, verified))
            wl.sync_caches()
            for call, ids_kind, path, name in tasks:
                if (
                    call == "internal"
                    or not applies(call, d)
                    or self.is_done(
                        kit, point.shape, point.chunks, point.placement, path, d, call, ids_kind
                    )
                ):
                    continue
                rec = {
                    **common,
                    "call": call,
                    "ids": ids_kind,
                    "direction": d,
                    "path": path,
                    "path_option": name,
                    "path_kind": kit.path_kind(path),
                    "default_path": name is None,
                    "bytes": nbytes,
                    "bytes_rw": 2 * nbytes,
                    "baseline_path": kit.baseline,
                }
                self.run_public(
                    kit,
                    wl,
                    manager,
                    info,
                    rec,
                    ids,
                    plans,
                    rotate,
                    timing,
                    verify,
                    reference,
                    ceilings[d],
                    base_s,
                )

    def run_public(
        self,
        kit: Any,
        wl: Workload,
        manager: Any,
        info: dict,
        rec: dict,
        ids: list,
        plans: dict,
        rotate: int,
        timing: dict,
        verify: bool,
        reference: list | None,
        ceiling: tuple | None,
        base_s: float | None,
    ) -> None:
        """One public call (:mod:`kvgroups_tools.bench_public`): timed, checked against the
        baseline's bytes, recorded; refused cases become ``skipped`` records."""
        if self.over_budget():
            self.emit({**rec, "record": "skipped", "reason": "time budget"})
            return
        if wl.caches is None:
            self.emit(
                {
                    **rec,
                    "record": "skipped",
                    "reason": "public calls: the bench passes a flat list of caches",
                }
            )
            return
        one = [x[next(iter(x))] if len(x) == 1 else x for x in ids]  # an engine's usual ids
        case = Case(manager, wl, one, rec["path_option"], rec["direction"], info["layers"], rotate)
        try:
            fn = make_call(kit, case, rec["call"], rec["ids"])
        except Refused as exc:
            self.emit({**rec, "record": "skipped", "reason": str(exc)})
            return
        except Exception as exc:  # noqa: BLE001
            self.emit({**rec, "record": "error", "stage": "public call", **_error(exc)})
            return
        try:
            if verify:
                kit.scramble(wl, 0)
            t = kit.time(fn, wl, **timing)
            verified, _ = self.verify(
                kit, wl, False, rec["direction"], plans, rotate, verify, reference, lambda: fn(0)
            )
        except Exception as exc:  # noqa: BLE001
            self.emit({**rec, "record": "error", "stage": "transfer", **_error(exc)})
            return
        finally:
            wl.extra.pop("graphs", None)
        rec["id_sets"] = len(case.ids)
        if rec["call"] == "layerwise":
            rec["calls_per_transfer"] = info["layers"]
        self.emit(self.transfer_record(rec, t, ceiling, base_s, verified))

    def transfer_record(
        self,
        rec: dict,
        t: Timing,
        ceiling: tuple | None,
        base_s: float | None,
        verified: bool | None,
    ) -> dict:
        s, nbytes = t.median, rec["bytes"]
        name, ceil_t = ceiling if ceiling else (None, None)
        out = {
            **rec,
            "runtime": rec["backend"],
            "median_s": s,
            "median_ms": s * 1e3,
            "min_s": min(t.seconds),
            "max_s": max(t.seconds),
            "repeats": len(t.seconds),
            "calls_per_repeat": t.calls,
            "host_s": t.host_s,
            "first_call_s": t.first_s,
            "host_bound": t.host_s is not None and t.host_s >= 0.9 * s,
            "gbps": 2 * nbytes / s / 1e9,
            "link_gbps": nbytes / s / 1e9,
            "ceiling": name,
            "ceiling_gbps": 2 * nbytes / ceil_t / 1e9 if ceil_t else None,
            "frac_of_ceiling": ceil_t / s if ceil_t else None,
            "baseline_gbps": None,
            "speedup_vs_baseline": None,
            "verified": verified,
        }
        if base_s:
            out.update(baseline_gbps=2 * nbytes / base_s / 1e9, speedup_vs_baseline=base_s / s)
        self.log(
            f"{rec['backend']}-{rec['device']} {rec['call']:<9} {rec['ids']:<6} "
            f"{rec['path']:<14} {rec['direction']:<5} "
            f"{rec['shape']} L{rec['layers']} x{rec['chunks']} {rec['placement']:<6} "
            f"{out['gbps']:9.1f} GB/s"
            + (f"  {out['frac_of_ceiling']:.2f} of {name}" if ceil_t else "")
            + (f"  {out['speedup_vs_baseline']:.2f}x base" if base_s else "")
        )
        return out

    def verify(
        self,
        kit: Any,
        wl: Workload,
        baseline: bool,
        d: str,
        plans: dict,
        rotate: int,
        enabled: bool,
        reference: list | None,
        load0: Callable[[], Any],
    ) -> tuple[bool | None, list | None]:
        """Store: rotation 0's objects against the baseline's. Load: store rotation 0's blocks
        back with the baseline into the scratch objects and compare with what was loaded."""
        if not enabled:
            return None, reference
        if d == "store":
            got = kit.host_bytes(wl, 0)
            if baseline or reference is None:
                return None, got
            return all(np.array_equal(a, b) for a, b in zip(got, reference)), reference
        if any(g.first_item for g in plans["load"][0].groups):
            return None, reference  # a window skips items: not every object byte is loaded
        load0()  # rotation 0's load by the path under test
        kit.scramble(wl, rotate)
        kit.run(kit.baseline, plans["store"][0], wl, rotate)
        back, sent = kit.host_bytes(wl, rotate), kit.host_bytes(wl, 0)
        return all(np.array_equal(a, b) for a, b in zip(back, sent)), reference

    def ceiling(
        self, kit: Any, name: str, nbytes: int, rotate: int, timing: dict
    ) -> tuple[str, float] | None:
        """Median seconds of the ceiling copy of ``nbytes`` (measured once per size).

        Measured twice, keeping the faster pass: the first one runs on a cold device (clocks
        ramping up, buffers and allocator pools new), and a ceiling slowed by that would let
        a warm transfer read as more than its ceiling. ``cold_median_s`` keeps the other."""
        cache = self._ceilings
        key = (kit.backend, kit.device, name, nbytes)
        if key not in cache:
            cache[key] = None
            try:
                passes = [kit.ceiling(name, nbytes, rotate, **timing) for _ in range(2)]
                t = min(passes, key=lambda p: p.median)
                cache[key] = t.median
                self.emit(
                    {
                        "record": "ceiling",
                        "backend": kit.backend,
                        "device": kit.device,
                        "ceiling": name,
                        "bytes": nbytes,
                        "bytes_rw": 2 * nbytes,
                        "median_s": t.median,
                        "min_s": min(t.seconds),
                        "repeats": len(t.seconds),
                        "calls_per_repeat": t.calls,
                        "cold_median_s": max(p.median for p in passes),
                        "gbps": 2 * nbytes / t.median / 1e9,
                        "link_gbps": nbytes / t.median / 1e9,
                    }
                )
            except Exception as exc:  # noqa: BLE001
                self.emit(
                    {
                        "record": "error",
                        "backend": kit.backend,
                        "device": kit.device,
                        "stage": f"ceiling {name}",
                        "bytes": nbytes,
                        **_error(exc),
                    }
                )
        return (name, cache[key]) if cache[key] else None

    # --- manager construction --------------------------------------------------------------
    def run_managers(self, kit: Any | None) -> None:
        """Manager construction time versus layers, from the kit's arrays (None: bare specs)."""
        from .catalog import get_model

        for model in self.matrix.manager_models:
            for layers in self.matrix.manager_layers:
                where = {
                    "record": "manager",
                    "backend": kit.backend if kit else "spec",
                    "device": kit.device if kit else None,
                    "model": model,
                    "layers": layers,
                }
                if (where["backend"], where["device"], model, layers) in self._done_managers:
                    continue
                if kit is not None and self.over_budget():  # bare specs: milliseconds
                    self.emit({**where, "record": "skipped", "reason": "time budget"})
                    continue
                try:
                    cm = get_model(model).build(num_blocks=2, layers=layers)
                    caches = kit.make_caches(cm.kv_caches, 0, fill=False) if kit else cm.kv_caches
                    args = (caches, list(cm.formats), cm.engine_group_infos)
                    manager = KVLayerGroupsManager(*args)
                    times = []
                    for _ in range(max(3, self.matrix.repeats)):
                        t0 = time.perf_counter()
                        KVLayerGroupsManager(*args)
                        times.append(time.perf_counter() - t0)
                except Exception as exc:  # noqa: BLE001
                    self.emit({**where, "record": "error", "stage": "manager", **_error(exc)})
                    continue
                med = statistics.median(times)
                self.emit(
                    {
                        **where,
                        "median_s": med,
                        "min_s": min(times),
                        "repeats": len(times),
                        "us_per_layer": med * 1e6 / layers,
                        "kernel_groups": manager.num_kernel_groups,
                        "object_groups": manager.num_object_groups,
                    }
                )
