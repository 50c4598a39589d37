"""Bench kit for PyTorch (``kvgroups bench --backends torch``), driven by
:mod:`kvgroups_tools.bench`.

Paths:

``cuda``
    The NVRTC page-copy kernels (:class:`~kvgroups_torch.TorchBackend`); pinned host objects
    are read and written by the kernel directly through UVA.
``cuda-staged``
    The same kernels with pinned host objects staged through device memory and one bulk copy
    per object (pinned placement only).
``index``
    The plain baseline: ``index_select`` / ``index_copy_`` over strided views
    (:mod:`kvgroups_torch.cpu`); also what the backend itself runs on the CPU.

CUDA work is timed with CUDA events around batches of back-to-back calls on the current
stream; CPU work with the wall clock. Ceilings: ``device_copy`` (``copy_`` of the same byte
count, device to device, or host to host on the CPU), ``pinned_h2d`` and ``pinned_d2h``
(``copy_`` between device and pinned host memory).
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from typing import Any, Callable

import numpy as np
import torch
from kvgroups_torch import cpu as cpu_copy
from kvgroups_torch.backend import TorchBackend, tensor_of
from kvgroups_torch.describe import torch_dtype

import kvgroups_core as kc
from kvgroups_core.errors import UnsupportedConfigError
from kvgroups_core.tensors.arrays import register_backend
from kvgroups_tools.bench import SCRATCH_FILL, Timing, Workload, calls_for, map_specs, wall_timer
from kvgroups_tools.bench_public import Refused

_SLICE = 1 << 30  # random fills in slices: one RNG call stays below 2**31 elements


def fill_random(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fill a contiguous tensor with random bytes, in place."""
    flat = t.view(-1).view(torch.uint8)
    for start in range(0, flat.numel(), _SLICE):
        flat[start : start + _SLICE].random_(0, 256, generator=gen)
    return t


class TorchKit:
    """The PyTorch runtime for the benchmark runner, on one CUDA device or the CPU."""

    backend = "torch"
    baseline = "index"

    def __init__(self, device: str | None) -> None:
        if device in (None, "gpu"):
            device = "cuda" if device == "gpu" or torch.cuda.is_available() else "cpu"
        dev = torch.device(device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise UnsupportedConfigError(
                    f"device: expected a usable CUDA GPU for {device!r}, "
                    "got none (torch.cuda.is_available() is False)"
                )
            dev = torch.device(
                "cuda", torch.cuda.current_device() if dev.index is None else dev.index
            )
        elif dev.type != "cpu":
            raise UnsupportedConfigError(f"device: expected 'cpu' or 'cuda[:N]', got {device!r}")
        self.dev, self.cuda = dev, dev.type == "cuda"
        self.device = "cuda" if self.cuda else "cpu"
        self.default_path = "cuda" if self.cuda else "index"
        self._kernels = {"cuda": TorchBackend("direct"), "cuda-staged": TorchBackend("staged")}

    def info(self) -> dict:
        out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
        if self.cuda:
            props = torch.cuda.get_device_properties(self.dev)
            out.update(
                device_name=props.name,
                sm_count=props.multi_processor_count,
                memory_bytes=props.total_memory,
                l2_bytes=self.l2_bytes(),
                compute_capability=f"{props.major}.{props.minor}",
            )
        else:
            out.update(
                device_name=platform.processor() or platform.machine(),
                cpu_count=os.cpu_count(),
                threads=torch.get_num_threads(),
            )
        return out

    def paths(self) -> tuple[str, ...]:
        return ("index", "cuda", "cuda-staged") if self.cuda else ("index",)

    def default_paths(self) -> tuple[str, ...]:
        return self.paths()

    def path_kind(self, path: str) -> str:
        return "kernel" if path.startswith("cuda") else "baseline"

    def placements(self) -> tuple[str, ...]:
        return ("device", "pinned") if self.cuda else ("device",)

    def check(self, path: str, placement: str) -> str | None:
        if path not in self.paths():
            return f"path: expected one of {self.paths()} on {self.device}, got {path!r}"
        if placement not in self.placements():
            return f"placement: expected one of {self.placements()}, got {placement!r}"
        if path == "cuda-staged" and placement != "pinned":
            return "cuda-staged: differs from cuda only for pinned objects"
        return None

    def l2_bytes(self) -> int:
        if self.cuda:
            return int(
                getattr(torch.cuda.get_device_properties(self.dev), "L2_cache_size", 50 << 20)
            )
        return 32 << 20

    # --- arrays ----------------------------------------------------------------------------
    def make_caches(self, specs: Any, seed: int, fill: bool = True) -> Any:
        gen = torch.Generator(device=self.dev).manual_seed(seed)

        def make(spec: Any, i: int) -> torch.Tensor:
            raw = torch.zeros(spec.nbytes, dtype=torch.uint8, device=self.dev)
            if fill:
                fill_random(raw, gen)
            return raw.view(torch_dtype(spec.dtype)).view(spec.shape)

        return map_specs(specs, make)

    def _buffer(self, shape: tuple, placement: str, gen: torch.Generator | None) -> torch.Tensor:
        """A uint8 buffer on the device or in pinned host memory; random when ``gen``."""
        if placement == "pinned":
            host = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
            if gen is not None:  # random bytes made on the GPU: host RNG is slow for GBs
                host.copy_(fill_random(torch.empty(shape, dtype=torch.uint8, device=self.dev), gen))
            return host
        t = torch.empty(shape, dtype=torch.uint8, device=self.dev)
        return fill_random(t, gen) if gen is not None else t.fill_(0)

    def alloc_objects(
        self, wl: Workload, object_nbytes: Any, chunks: int, placement: str, count: int, seed: int
    ) -> None:
        gen = torch.Generator(device=self.dev).manual_seed(seed + 1)
        wl.objects = [
            [self._buffer((chunks, int(n)), placement, gen) for n in object_nbytes]
            for _ in range(count)
        ]
        wl.extra.pop("tensors", None)
        wl.extra.pop("graphs", None)

    def run(self, path: str, plan: Any, wl: Workload, r: int) -> None:
        if path == "index":
            tensors = wl.extra.get("tensors")
            if tensors is None:
                tensors = wl.extra["tensors"] = [tensor_of(t, "tensor") for t in wl.tensors]
            cpu_copy.execute_plan(plan, tensors, wl.objects[r])
        else:
            self._kernels[path].execute(plan, wl.tensors, wl.objects[r])

    # --- public calls (kvgroups_tools.bench_public) ----------------------------------------
    def public_calls(self) -> tuple[str, ...]:
        graph = ("graph",) if self.cuda else ()
        return ("store", "load", "prepared") + graph + ("layerwise",)

    def public_paths(self, placement: str) -> list[tuple[str, str | None]]:
        """(path, backend name for ``backend=``; None: the default) offered by the public API:
        the default kernels, and for pinned objects the direct mode (a registered
        ``TorchBackend(pinned="direct")``; the default stages them)."""
        if not self.cuda:
            return [("index", None)]  # what the backend runs for CPU tensors
        if placement != "pinned":
            return [("cuda", None)]
        register_backend("torch-direct", TorchBackend("direct"), replace=True)
        return [("cuda-staged", None), ("cuda", "torch-direct")]

    def device_ids(self, ids: Any) -> Any:
        if isinstance(ids, dict):
            return {k: self.device_ids(v) for k, v in ids.items()}
        return torch.from_numpy(np.ascontiguousarray(ids)).to(self.dev)

    def jit_call(self, case: Any, ids_kind: str) -> Callable[[int], None]:
        raise Refused("jit: a JAX call (torch: see graph)")

    def graph_call(self, case: Any, ids_kind: str) -> Callable[[int], None]:
        """One CUDA graph per rotation, each capturing a prepared call on its own device ids
        and objects (what an engine's captured step holds); ``fn(i)`` replays one."""
        if not self.cuda:
            raise Refused("graph: CUDA graphs need CUDA caches")
        if ids_kind != "device":
            raise Refused(
                "graph: a captured call replays device ids (host ids are read "
                "on the host at capture)"
            )
        prep = kc.prepare(case.manager, case.wl.caches, backend=case.backend)
        wl, store = case.wl, case.direction == "store"

        def call(r: int) -> None:
            if store:
                prep.store(case.ids[r], wl.objects[r])
            else:
                prep.load(wl.objects[r], case.ids[r])

        graphs = []
        side = torch.cuda.Stream(self.dev)
        for r in range(len(case.ids)):
            side.wait_stream(torch.cuda.current_stream(self.dev))
            with torch.cuda.stream(side):
                call(r)  # warm: kernels compiled and launch state made outside the capture
            torch.cuda.current_stream(self.dev).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                call(r)
            graphs.append(g)
        wl.extra["graphs"] = graphs  # alive as long as the objects they write
        return lambda i: graphs[i % len(graphs)].replay()

    def scramble(self, wl: Workload, r: int) -> None:
        self.sync()
        for o in wl.objects[r]:
            o.fill_(SCRATCH_FILL)

    def host_bytes(self, wl: Workload, r: int) -> list[np.ndarray]:
        self.sync()  # kernels write pinned memory asynchronously
        return [o.detach().to("cpu", copy=True).numpy() for o in wl.objects[r]]

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def release(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.dev)
            torch.cuda.empty_cache()

    # --- timing ----------------------------------------------------------------------------
    def time(
        self,
        fn: Callable[[int], Any],
        wl: Workload | None = None,
        *,
        repeats: int,
        warmup: int,
        target_s: float,
        max_calls: int,
    ) -> Timing:
        """Per-call seconds of batches of back-to-back calls: CUDA events on the current
        stream around each batch (GPU), the wall clock (CPU)."""
        if not self.cuda:
            return wall_timer(
                fn,
                lambda: None,
                repeats=repeats,
                warmup=warmup,
                target_s=target_s,
                max_calls=max_calls,
            )
        i, estimate, first = 0, 0.0, None
        for _ in range(max(1, warmup)):
            self.sync()
            t0 = time.perf_counter()
            fn(i)
            self.sync()
            estimate, i = time.perf_counter() - t0, i + 1
            first = estimate if first is None else first
        calls = calls_for(estimate, target_s, max_calls)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        secs, host = [], []
        for _ in range(repeats):
            self.sync()
            start.record()
            h0 = time.perf_counter()
            for _ in range(calls):
                fn(i)
                i += 1
            host.append((time.perf_counter() - h0) / calls)
            end.record()
            end.synchronize()
            secs.append(start.elapsed_time(end) / 1e3 / calls)
        return Timing(tuple(secs), calls, statistics.median(host), first)

    def ceiling(self, name: str, nbytes: int, rotate: int, **timing: Any) -> Timing:
        """The copy that bounds a transfer of ``nbytes``: ``device_copy``, ``pinned_h2d``,
        ``pinned_d2h``; one buffer pair per rotation."""
        if name == "device_copy":
            src = [self._buffer((nbytes,), "device", None).fill_(i) for i in range(rotate)]
            dst = [self._buffer((nbytes,), "device", None) for _ in range(rotate)]
        elif name in ("pinned_h2d", "pinned_d2h") and self.cuda:
            dev = [self._buffer((nbytes,), "device", None) for _ in range(rotate)]
            host = [self._buffer((nbytes,), "pinned", None) for _ in range(rotate)]
            src, dst = (host, dev) if name == "pinned_h2d" else (dev, host)
        else:
            raise UnsupportedConfigError(
                f"ceiling: expected one of 'device_copy', 'pinned_h2d', "
                f"'pinned_d2h' (pinned ones on CUDA), got {name!r}"
            )
        return self.time(
            lambda i: dst[i % rotate].copy_(src[i % rotate], non_blocking=True), **timing
        )


def make_kit(device: str | None = None) -> TorchKit:
    """The torch kit: ``device`` ``None`` (CUDA when usable, else CPU), ``"cpu"``, ``"cuda"``,
    ``"cuda:N"`` or ``"gpu"``."""
    return TorchKit(device)
