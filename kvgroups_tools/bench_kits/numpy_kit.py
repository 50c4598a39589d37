"""Bench kit for NumPy (``kvgroups bench --backends numpy``): host memory only.

Paths: ``reference`` (the oracle, :class:`~kvgroups_core.transfer.reference.NumpyBackend`, explicit
byte
index arithmetic) and ``take`` (the plain baseline: strided byte views and one fancy-indexing
gather or scatter per plane and run). The ceiling is a host ``memcpy`` of the same byte count.
Timed by the wall clock (nothing is asynchronous).
"""

from __future__ import annotations

import gc
import os
import platform
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from kvgroups_core.errors import UnsupportedConfigError
from kvgroups_core.transfer.reference import NumpyBackend, byte_view
from kvgroups_tools.bench import SCRATCH_FILL, Timing, Workload, map_specs, wall_timer
from kvgroups_tools.bench_public import Refused


def run_take(plan: Any, tensors: list, objects: list) -> None:
    """Execute ``plan`` with fancy indexing over strided byte views (in place).

    ``tensors`` are the plan's backing tensors (TensorDescs of NumPy memory); ``objects`` one
    contiguous ``[num_chunks, nbytes]`` uint8 array per object group.
    """
    store = plan.direction == "store"
    views = [byte_view(d, writable=not store) for d in tensors]
    for g in plan.groups:
        if g.num_items <= 0:
            continue
        chunk, pos, bid = g.items()
        obj = objects[g.object_group_idx]
        flat, row_stride = obj.reshape(-1), obj.strides[0]
        for p, plane in enumerate(g.planes):
            base = views[plane.tensor_index]
            for run in g.runs:
                # [num_blocks, block_size, count, nbytes] of plane p
                cache = as_strided(
                    base[plane.byte_offset + run.cache_offset :],
                    (g.num_blocks, g.block_size, run.count, run.nbytes),
                    (g.block_stride_bytes, run.token_stride, run.cache_step, 1),
                    writeable=not store,
                )
                start = g.region_offset + p * g.slots * g.row_bytes + run.obj_offset
                # [num_chunks, kept, block_size, count, nbytes]
                rows = as_strided(
                    flat[start:],
                    (obj.shape[0], g.kept_per_chunk, g.block_size, run.count, run.nbytes),
                    (row_stride, g.block_size * g.row_bytes, g.row_bytes, run.obj_step, 1),
                    writeable=store,
                )
                if store:
                    rows[chunk, pos] = cache[bid]
                else:
                    cache[bid] = rows[chunk, pos]


class NumpyKit:
    """The NumPy runtime for the benchmark runner (see :mod:`kvgroups_tools.bench`)."""

    backend = "numpy"
    device = "cpu"
    baseline = "take"
    default_path = "reference"
    _PATHS = ("take", "reference")

    def __init__(self) -> None:
        self.be = NumpyBackend()

    def info(self) -> dict:
        return {
            "device_name": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
        }

    def paths(self) -> tuple[str, ...]:
        return self._PATHS

    def default_paths(self) -> tuple[str, ...]:
        return self._PATHS

    def path_kind(self, path: str) -> str:
        return "baseline" if path == "take" else "reference"

    def placements(self) -> tuple[str, ...]:
        return ("device",)  # the caches' memory: the host

    def check(self, path: str, placement: str) -> str | None:
        if path not in self._PATHS:
            return f"path: expected one of {self._PATHS} for numpy, got {path!r}"
        return None if placement == "device" else f"placement {placement!r}: host memory only"

    def l2_bytes(self) -> int:
        return 32 << 20

    def make_caches(self, specs: Any, seed: int, fill: bool = True) -> Any:
        rng = np.random.default_rng(seed)

        def make(spec: Any, i: int) -> Any:
            raw = (
                rng.integers(0, 256, spec.numel * spec.dtype.itemsize, dtype=np.uint8)
                if fill
                else np.zeros(spec.numel * spec.dtype.itemsize, np.uint8)
            )
            bits = raw.view(spec.dtype.uint_view_name).reshape(spec.shape)
            return self.be.from_numpy(bits, "cpu", spec.dtype)

        return map_specs(specs, make)

    def alloc_objects(
        self, wl: Workload, object_nbytes: Any, chunks: int, placement: str, count: int, seed: int
    ) -> None:
        rng = np.random.default_rng(seed + 1)
        wl.objects = [
            [rng.integers(0, 256, (chunks, n), dtype=np.uint8) for n in object_nbytes]
            for _ in range(count)
        ]

    def run(self, path: str, plan: Any, wl: Workload, r: int) -> None:
        if path == "take":
            run_take(plan, wl.tensors, wl.objects[r])
        else:
            self.be.execute(plan, wl.tensors, wl.objects[r])

    # --- public calls (kvgroups_tools.bench_public) ----------------------------------------
    def public_calls(self) -> tuple[str, ...]:
        return ("store", "load", "prepared", "layerwise")

    def public_paths(self, placement: str) -> list[tuple[str, str | None]]:
        return [("reference", None)]  # what kvgroups_core.store runs for NumPy arrays

    def device_ids(self, ids: Any) -> Any:
        raise Refused("ids: NumPy has no device ids (host memory only)")

    def jit_call(self, case: Any, ids_kind: str) -> Any:
        raise Refused("jit: a JAX call")

    def graph_call(self, case: Any, ids_kind: str) -> Any:
        raise Refused("graph: a torch CUDA call")

    def time(self, fn: Any, wl: Workload, **timing: Any) -> Timing:
        return wall_timer(fn, lambda: None, **timing)

    def scramble(self, wl: Workload, r: int) -> None:
        for o in wl.objects[r]:
            o.fill(SCRATCH_FILL)

    def host_bytes(self, wl: Workload, r: int) -> list[np.ndarray]:
        return [o.copy() for o in wl.objects[r]]

    def ceiling(self, name: str, nbytes: int, rotate: int, **timing: Any) -> Timing:
        if name != "device_copy":
            raise UnsupportedConfigError(
                f"ceiling: expected 'device_copy' on the host, got {name!r}"
            )
        src = [np.full(nbytes, i, np.uint8) for i in range(rotate)]
        dst = [np.full(nbytes, 255, np.uint8) for _ in range(rotate)]  # pages touched
        return wall_timer(
            lambda i: np.copyto(dst[i % rotate], src[i % rotate]), lambda: None, **timing
        )

    def release(self) -> None:
        gc.collect()


def make_kit(device: str | None = None) -> NumpyKit:
    """The NumPy kit; ``device`` must be None or ``"cpu"``."""
    if device not in (None, "cpu"):
        raise UnsupportedConfigError(f"device: expected 'cpu' for numpy, got {device!r}")
    return NumpyKit()
