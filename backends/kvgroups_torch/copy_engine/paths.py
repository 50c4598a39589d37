"""Which path moves a transfer under ``path="auto"``: a table measured on the GPU.

The kernel wins on small pieces (the copy engines pay a fixed cost per copy), the copy
engines on large pages and on pinned host memory, and where the crossover lies depends on
the GPU, the link and the driver. So nothing is guessed: :func:`tune_copy_paths` times both
paths on this GPU through the public calls, over the size of one copy (page bytes of an
NHD page), the chunk count, the direction and the object placement (GPU or pinned host), and
writes the table to ``copy_paths-<gpu>-<driver>.json`` in the cache folder
(``$KVGROUPS_COPY_PATHS_DIR``, default ``$XDG_CACHE_HOME/kvgroups``, i.e.
``~/.cache/kvgroups``). ``"auto"`` reads it once per process; a transfer then takes the
faster path of the nearest measured point (copy size and chunk count on a log scale, same
direction and placement). Without a table ``"auto"`` is the kernel, as before any
measurement; ``KVGROUPS_COPY_PATHS=off`` ignores the table.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .runs import copy_bytes

ENV_DIR = "KVGROUPS_COPY_PATHS_DIR"
ENV_SWITCH = "KVGROUPS_COPY_PATHS"
TABLE_VERSION = 1
PAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
CHUNK_COUNTS = (1, 4, 16, 64, 256)


@dataclass(frozen=True)
class Point:
    """One measurement: medians in ms of the same transfer on both paths."""

    direction: str
    placement: str
    copy_bytes: int
    chunks: int
    kernel_ms: float
    copy_engine_ms: float

    @property
    def faster(self) -> str:
        return "copy_engine" if self.copy_engine_ms < self.kernel_ms else "kernel"


class PathTable:
    """The measured points of one GPU and driver, and the choice they imply."""

    def __init__(self, points: Sequence[Point], gpu: str = "", driver: int = 0) -> None:
        self.points = tuple(points)
        self.gpu, self.driver = gpu, driver
        self._memo: dict[tuple, str] = {}

    def choose_for(self, direction: str, placement: str, nbytes: int, chunks: int) -> str:
        """ "kernel" or "copy_engine": the faster at the nearest point (log scale)."""
        key = (direction, placement, nbytes, chunks)
        found = self._memo.get(key)
        if found is None:
            best, found = math.inf, "kernel"
            for p in self.points:
                if p.direction != direction or p.placement != placement:
                    continue
                d = (
                    math.log2(max(nbytes, 1) / p.copy_bytes) ** 2
                    + math.log2(max(chunks, 1) / p.chunks) ** 2
                )
                if d < best:
                    best, found = d, p.faster
            if len(self._memo) > 4096:
                self._memo.clear()
            self._memo[key] = found
        return found

    def choose(self, direction: str, placement: str, group: Any, chunks: int) -> str:
        """The path of a group transfer: its copies' size is :func:`copy_bytes`."""
        return self.choose_for(direction, placement, copy_bytes(group), chunks)

    def to_json(self) -> dict:
        return {
            "version": TABLE_VERSION,
            "gpu": self.gpu,
            "driver": self.driver,
            "points": [p.__dict__ for p in self.points],
        }

    @classmethod
    def from_json(cls, data: dict) -> "PathTable":
        return cls(
            [Point(**p) for p in data["points"]], data.get("gpu", ""), int(data.get("driver", 0))
        )


def table_dir() -> Path:
    """Folder of the tables (``$KVGROUPS_COPY_PATHS_DIR`` or ``$XDG_CACHE_HOME/kvgroups``)."""
    override = os.environ.get(ENV_DIR)
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "kvgroups"


def table_file(gpu: str, driver: int) -> Path:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-").lower() or "gpu"
    return table_dir() / f"copy_paths-{slug}-{driver}.json"


_tables: dict[int, PathTable | None] = {}
_lock = threading.Lock()


def _gpu_and_driver(device_index: int) -> tuple[str, int]:
    import torch

    from kvgroups_torch.cuda.driver import driver_version

    return torch.cuda.get_device_name(device_index), driver_version()


def table_for(device_index: int) -> PathTable | None:
    """The table of this GPU (read from disk once per process), or None."""
    if device_index in _tables:
        return _tables[device_index]
    with _lock:
        if device_index not in _tables:
            _tables[device_index] = _read(device_index)
    return _tables[device_index]


def _read(device_index: int) -> PathTable | None:
    if os.environ.get(ENV_SWITCH, "").lower() in ("0", "off", "false", "no"):
        return None
    try:
        gpu, driver = _gpu_and_driver(device_index)
    except Exception:  # no usable GPU or driver (CPU emulation): no table, the kernel
        return None
    try:
        data = json.loads(table_file(gpu, driver).read_text())
    except (OSError, ValueError):
        return None
    if data.get("version") != TABLE_VERSION:
        return None
    return PathTable.from_json(data)


def set_table(device_index: int, table: PathTable | None) -> None:
    """Use ``table`` for ``device_index`` in this process (None: auto is the kernel)."""
    with _lock:
        _tables[device_index] = table


def forget_tables() -> None:
    """Read the tables from disk again at the next "auto" transfer."""
    with _lock:
        _tables.clear()


def page_geometry(page_bytes: int) -> tuple[int, int]:
    """``(block_size, kv_heads)`` of a bf16 NHD page of ``page_bytes`` with 128-wide heads."""
    row = 256  # one bf16 head of 128
    if page_bytes < 16 * row:
        return max(1, page_bytes // row), 1
    return 16, page_bytes // (16 * row)


def tune_copy_paths(
    device: Any = None,
    *,
    page_sizes: Sequence[int] = PAGE_SIZES,
    chunk_counts: Sequence[int] = CHUNK_COUNTS,
    placements: Sequence[str] = ("device", "pinned"),
    directions: Sequence[str] = ("store", "load"),
    layers: int = 8,
    max_bytes: int = 1 << 30,
    iters: int = 5,
    save: bool = True,
    on_point: Any = None,
) -> PathTable:
    """Measure the kernel against the copy engines on this GPU and cache the table.

    For every page size (a Llama-like bf16 NHD cache of ``layers`` layers whose head count
    and block size give that page), chunk count (256-token chunks of random blocks; points
    moving more than ``max_bytes`` are left out), direction and object placement, the same
    prepared call with host ids runs with ``path="kernel"`` and ``path="copy_engine"``
    (medians of ``iters`` CUDA-event timings). With ``save`` the table is written to
    :func:`table_file` and used by ``"auto"`` from now on in this process. ``on_point(point)``
    is called after each measurement (benchmarks print them). Takes a minute or two with the
    defaults.
    """
    import numpy as np
    import torch

    import kvgroups_core as kc
    from kvgroups_core.formats.catalogue import EngineKVFormat as F
    from kvgroups_core.grouping.manager import KVLayerGroupsManager

    index = torch.device(device if device is not None else "cuda").index
    index = torch.cuda.current_device() if index is None else index
    dev = torch.device("cuda", index)
    chunk_tokens = 256
    points = []
    rng = np.random.default_rng(0)
    for page in page_sizes:
        bs, nh = page_geometry(page)
        wanted = [c for c in chunk_counts if c * chunk_tokens * nh * 256 * 2 * layers <= max_bytes]
        if not wanted:
            continue
        blocks = max(wanted) * chunk_tokens // bs
        num_blocks = max(2 * blocks, 64)
        caches = [
            torch.empty((2, num_blocks, bs, nh, 128), dtype=torch.bfloat16, device=dev)
            for _ in range(layers)
        ]
        manager = KVLayerGroupsManager(
            caches, [F.NL_X_TWO_NB_BS_NH_HS] * layers, lmcache_tokens_per_chunk=chunk_tokens
        )
        prep = kc.prepare(manager, caches)
        nbytes = kc.object_nbytes(manager, 0)
        for placement in placements:
            big = (
                torch.empty((max(wanted), nbytes), dtype=torch.uint8, device=dev, pin_memory=False)
                if placement == "device"
                else torch.empty((max(wanted), nbytes), dtype=torch.uint8, pin_memory=True)
            )
            for chunks in wanted:
                ids = rng.permutation(num_blocks)[: chunks * chunk_tokens // bs]
                objects = [big[:chunks]]
                for direction in directions:
                    kernel_ms, copy_engine_ms = (
                        _median_ms(_call(prep, direction, ids, objects, path), iters)
                        for path in ("kernel", "copy_engine")
                    )
                    point = Point(direction, placement, page, chunks, kernel_ms, copy_engine_ms)
                    points.append(point)
                    if on_point is not None:
                        on_point(point)
            big = None
        caches = prep = None  # freed before the next page size allocates
    gpu, driver = _gpu_and_driver(index)
    table = PathTable(points, gpu, driver)
    if save:
        file = table_file(gpu, driver)
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table.to_json(), indent=1))
        tmp.replace(file)
        set_table(index, table)
    return table


def _call(prep: Any, direction: str, ids: Any, objects: list, path: str) -> Any:
    if direction == "store":
        return lambda: prep.store(ids, objects, path=path)
    return lambda: prep.load(objects, ids, path=path)


def _median_ms(call: Any, iters: int) -> float:
    import torch

    call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    per_batch = max(1, min(50, int(0.005 / max(time.perf_counter() - t0, 1e-6))))
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(per_batch):
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / per_batch)
    times.sort()
    return times[len(times) // 2]
