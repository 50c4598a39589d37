"""Small pages (512 B - 4 KiB per block and plane) through the public prepared calls: the
established page-copy kernel against the small-page kernels and their tunables, on one GPU.

Llama-like caches (32 layers, one ``[2, NB, BS, NH, HS]`` bf16 tensor per layer, vLLM's NHD;
one HND case for the (token, piece) kernels), 256-token chunks to random blocks, objects in
GPU memory. For each page shape and chunk count (default 64 and 256):

- torch, ``kvgroups_core.prepare(manager, caches)``: ``store`` / ``load`` with CUDA-tensor ids
  (``call="prepared"``) and the same calls captured in a CUDA graph (``call="graph"``: no host
  time, so the kernel alone), for ``variant="classic"`` (``geometry.SMALL_PAGE_BYTES = 0``)
  and ``variant="small"`` at each tunable point (``planes_per_cta``, ``cta_bytes``,
  ``unroll`` = ``KVG_SMALL_UNROLL``), varied one at a time around the default; host ids
  (NumPy) for the classic kernel and the default small point;
- jax (``--runtimes torch,jax``), ``prepare(manager, caches).store`` / ``.load`` with host ids
  on the Triton lowering (the default for pages below 16 KiB), ``pallas_copy.TUNING
  ["items_per_program"]`` swept (1 = the established one item per program; default 1 and
  8, at 256 chunks only: each point compiles its programs).

Every configuration is VERIFIED once before it is timed: a store's objects against a torch
gather of the same pages (the reference), a load's caches against the objects at the loaded
blocks and untouched elsewhere; a mismatch is a ``verified: false`` record and exit status 1.
``frac_of_ceiling`` is the same run's device-to-device copy of the same bytes (torch
``copy_``, eager; JAX: jitted ``x + 1`` over uint32 words) over the call's time. JSON lines
to ``--out`` (appended) and stdout, then a winner table. The small-page kernels live in a cubin
of their own (NVRTC, ~15-20 s per ``unroll`` value on first use, then cached on disk). ``--budget-s`` (default 170) stops
timing and writes ``skipped`` records for what is left.

    python benchmarks/sweep_small_pages.py --out small_pages_h200.jsonl --runtimes torch,jax

``--tiny`` runs the same flow on the CPU in seconds (2 layers, the CPU paths; its figures mean
nothing, its verification does).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "backends")]
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

CHUNK = 256
LAYERS = 32
#: "cuda" on the GPU; "cpu" for the smoke test (``--tiny``: the CPU paths, wall clock, no
#: graphs), which checks this script's own flow and references.
DEVICE = {"name": "cuda"}


@dataclass(frozen=True)
class Shape:
    """One cache shape: ``page_bytes = bs * nh * hs * 2`` (bf16)."""

    bs: int
    nh: int
    hs: int
    layout: str = "nhd"  # "nhd": [2, NB, BS, NH, HS]; "hnd": [2, NB, NH, BS, HS]

    @property
    def page_bytes(self) -> int:
        return self.bs * self.nh * self.hs * 2

    @property
    def name(self) -> str:
        return f"{self.layout}-bs{self.bs}-nh{self.nh}-hs{self.hs}"


SHAPES = {
    512: [Shape(16, 1, 16)],
    1024: [Shape(16, 1, 32), Shape(8, 1, 64), Shape(16, 2, 16, "hnd")],
    2048: [Shape(16, 1, 64)],
    4096: [Shape(16, 2, 64)],
}

#: The small-page kernels' default point and the values each tunable is swept over (one at a
#: time around the default).
DEFAULT = {"planes_per_cta": 8, "cta_bytes": 65536, "unroll": 8}
SWEEP = {"planes_per_cta": (1, 4, 16), "cta_bytes": (16384, 32768, 131072), "unroll": (4, 16)}


def small_points(args) -> list[dict]:
    points = [dict(DEFAULT)]
    for key in SWEEP:
        for v in getattr(args, key):
            if v != DEFAULT[key]:
                points.append({**DEFAULT, key: v})
    return points


class Out:
    def __init__(self, path: Path | None, budget_s: float) -> None:
        self.sink = open(path, "a") if path else None
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.records: list[dict] = []
        self.failed = False
        self.common: dict = {}  # fields every record carries (the --define macros)

    def over(self) -> bool:
        return time.perf_counter() - self.t0 > self.budget_s

    def emit(self, **rec) -> None:
        rec.setdefault("record", "transfer")
        rec.update(self.common)
        if rec.get("verified") is False:
            self.failed = True
        self.records.append(rec)
        line = json.dumps(rec)
        print(line, flush=True)
        if self.sink:
            self.sink.write(line + "\n")
            self.sink.flush()


# ----------------------------------------------------------------------------------- torch

class TorchTimer:
    """Milliseconds per call: CUDA events over batches of back-to-back calls, median."""

    def __init__(self, repeats: int, batch_ms: float) -> None:
        self.repeats, self.batch_ms = repeats, batch_ms

    def ms(self, fn) -> float:
        import torch

        cuda = DEVICE["name"] == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        for i in range(2):
            fn(i)
        sync()
        t0 = time.perf_counter()
        fn(2)
        sync()
        calls = max(1, min(400, int(self.batch_ms / 1e3 / max(time.perf_counter() - t0, 1e-6))))
        times, i = [], 3
        for _ in range(self.repeats):
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
            t = time.perf_counter()
            for _ in range(calls):
                fn(i)
                i += 1
            if cuda:
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / calls)
            else:
                times.append((time.perf_counter() - t) * 1e3 / calls)
        return statistics.median(times)


_TORCH_DEFAULTS: dict = {}


def set_torch_variant(variant: str, point: dict | None) -> None:
    """Select the kernels (module switches read when launch state is built) and forget the
    launch state built before."""
    from kvgroups_cuda import geometry, nvrtc
    from kvgroups_torch.cuda import launch as cuda_launch

    _TORCH_DEFAULTS.setdefault("planes", geometry.SMALL_PLANES_PER_CTA)
    _TORCH_DEFAULTS.setdefault("cta_bytes", geometry.SMALL_CTA_BYTES)
    if variant == "classic":  # and the module defaults back
        geometry.SMALL_PAGE_BYTES = 0
        geometry.SMALL_PLANES_PER_CTA = _TORCH_DEFAULTS["planes"]
        geometry.SMALL_CTA_BYTES = _TORCH_DEFAULTS["cta_bytes"]
        nvrtc.TUNING.pop("KVG_SMALL_UNROLL", None)
    else:
        geometry.SMALL_PAGE_BYTES = 1 << 20  # every page of the sweep
        geometry.SMALL_PLANES_PER_CTA = point["planes_per_cta"]
        geometry.SMALL_CTA_BYTES = point["cta_bytes"]
        nvrtc.TUNING["KVG_SMALL_UNROLL"] = point["unroll"]
    cuda_launch.reset_caches()


class TorchCase:
    """Caches of one shape, sized for the largest chunk count, plus the reference views."""

    def __init__(self, shape: Shape, max_chunks: int, seed: int) -> None:
        import torch

        from kvgroups_core.formats.catalogue import EngineKVFormat as F
        from kvgroups_core.grouping.manager import KVLayerGroupsManager

        self.shape = shape
        self.bpc = CHUNK // shape.bs
        self.num_blocks = 2 * max_chunks * self.bpc
        dims = ((2, self.num_blocks, shape.bs, shape.nh, shape.hs) if shape.layout == "nhd"
                else (2, self.num_blocks, shape.nh, shape.bs, shape.hs))
        fmt = F.NL_X_TWO_NB_BS_NH_HS if shape.layout == "nhd" else F.NL_X_TWO_NB_NH_BS_HS
        dev = DEVICE["name"]
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.caches = []
        for _ in range(LAYERS):
            t = torch.empty(dims, dtype=torch.bfloat16, device=dev)
            t.view(torch.int16).random_(generator=gen)
            self.caches.append(t)
        self.manager = KVLayerGroupsManager(self.caches, [fmt] * LAYERS,
                                            lmcache_tokens_per_chunk=CHUNK)
        self.nbytes = lambda chunks: chunks * self.object_nbytes
        import kvgroups_core as kc

        self.object_nbytes = kc.object_nbytes(self.manager, 0)
        self.rng = np.random.default_rng(seed)

    def ids(self, chunks: int, count: int = 3) -> list[np.ndarray]:
        n = chunks * self.bpc
        return [self.rng.permutation(self.num_blocks)[:n].astype(np.int32)
                for _ in range(count)]

    def expected_objects(self, ids_np: np.ndarray, chunks: int):
        """The objects of a store of ``ids_np``, from the page model with torch indexing
        (planes kv * layers + layer, rows token-major as FORMATS.md lays them out)."""
        import torch

        ids = torch.from_numpy(ids_np.astype(np.int64)).to(DEVICE["name"])
        rows = []
        for kv in range(2):
            for cache in self.caches:
                blocks = cache[kv].index_select(0, ids)  # [n, ...] in the cache's layout
                if self.shape.layout == "hnd":  # [n, NH, BS, HS] -> token rows [n, BS, NH, HS]
                    blocks = blocks.transpose(1, 2)
                rows.append(blocks.reshape(chunks, -1).contiguous().view(torch.uint8))
        return torch.stack(rows, 1).reshape(chunks, -1)  # [chunks, planes * kept * page]

    def cache_bytes_at(self, ids_np: np.ndarray, chunks: int):
        """What a load of these objects must have left at ``ids_np`` (as expected_objects)."""
        return self.expected_objects(ids_np, chunks)


def torch_copy_ms(timer: TorchTimer, nbytes: int) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE["name"])
    dst = [torch.empty_like(src) for _ in range(2)]
    return timer.ms(lambda i: dst[i % 2].copy_(src))


def verify_torch(case: TorchCase, prep, chunks: int) -> tuple[bool, str]:
    """One store and one load checked byte for byte (and untouched blocks untouched)."""
    import kvgroups_torch
    import torch

    ids = case.ids(chunks, 1)[0]
    device = DEVICE["name"]
    dev = torch.from_numpy(ids).to(device)
    out = torch.full((chunks, case.object_nbytes), 0xA5, dtype=torch.uint8, device=device)
    prep.store(dev, [out])
    if not torch.equal(out, case.expected_objects(ids, chunks)):
        return False, "store: objects differ from the reference"
    before = [c.view(torch.int16).clone() for c in case.caches]  # bits: NaNs compare equal
    new = torch.randint(0, 256, out.shape, dtype=torch.uint8, device=device)
    prep.load([new], dev)
    if not torch.equal(case.cache_bytes_at(ids, chunks), new):
        return False, "load: cache pages differ from the objects"
    mask = torch.ones(case.num_blocks, dtype=torch.bool, device=device)
    mask[dev.long()] = False
    for a, b in zip(case.caches, before):
        if not torch.equal(a.view(torch.int16)[:, mask], b[:, mask]):
            return False, "load: a block outside the ids changed"
    # Restore, so later configurations start from the same caches.
    for a, b in zip(case.caches, before):
        a.view(torch.int16).copy_(b)
    if device == "cuda":
        kvgroups_torch.check_errors()
    return True, ""


def graph_ms(timer: TorchTimer, call, reps: int = 10) -> float:
    """Per-call time of ``reps`` calls captured in one CUDA graph (the kernel alone)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            call()
    return timer.ms(lambda i: graph.replay()) / reps


def time_torch_variant(case: TorchCase, prep, chunks: int, timer: TorchTimer, out: Out,
                       base: dict, host: bool) -> None:
    """Prepared store / load with device ids (and host ids when ``host``), then the same
    captured in a CUDA graph. Each load writes back what a store of the same ids read, so
    the caches keep their bytes."""
    import torch

    device = DEVICE["name"]
    host_ids = case.ids(chunks)
    dev_ids = [torch.from_numpy(x).to(device) for x in host_ids]
    objs = [[torch.empty((chunks, case.object_nbytes), dtype=torch.uint8, device=device)]
            for _ in host_ids]
    for k, ids in enumerate(dev_ids):
        prep.store(ids, objs[k])
    nbytes, ceiling = base["bytes"], base["copy_ms"]

    def emit(call, kind, direction, ms):
        out.emit(**base, call=call, ids=kind, direction=direction, median_ms=ms,
                 gbps=2 * nbytes / ms / 1e6, frac_of_ceiling=ceiling / ms)

    for kind, ids in [("device", dev_ids)] + ([("host", host_ids)] if host else []):
        n = len(ids)
        emit("prepared", kind, "store",
             timer.ms(lambda i, ids=ids, n=n: prep.store(ids[i % n], objs[i % n])))
        emit("prepared", kind, "load",
             timer.ms(lambda i, ids=ids, n=n: prep.load(objs[i % n], ids[i % n])))
    if device == "cuda":
        emit("graph", "device", "store",
             graph_ms(timer, lambda: prep.store(dev_ids[0], objs[0])))
        emit("graph", "device", "load",
             graph_ms(timer, lambda: prep.load(objs[0], dev_ids[0])))


def sweep_torch(args, out: Out) -> None:
    import torch

    import kvgroups_core as kc

    timer = TorchTimer(args.repeats, args.batch_ms)
    variants = [("classic", None)] + [("small", p) for p in small_points(args)]
    for page in args.pages:
        for shape in SHAPES[page]:
            case = TorchCase(shape, max(args.chunks), seed=page + shape.bs)
            for chunks in args.chunks:
                nbytes = case.nbytes(chunks)
                ceiling = torch_copy_ms(timer, nbytes)
                base = dict(runtime="torch", path="cuda-kernel", placement="device",
                            chunks=chunks, page_bytes=page, shape=shape.name, layers=LAYERS,
                            bytes=nbytes, copy_ms=ceiling)
                for variant, point in variants:
                    label = dict(variant=variant, **(point or {}))
                    if out.over():
                        out.emit(record="skipped", reason="time budget", **base, **label)
                        continue
                    set_torch_variant(variant, point)
                    prep = kc.prepare(case.manager, case.caches)
                    ok, why = verify_torch(case, prep, chunks)
                    if not ok:
                        out.emit(**base, **label, verified=False, error=why)
                        continue
                    time_torch_variant(case, prep, chunks, timer, out,
                                       {**base, **label, "verified": True},
                                       host=variant == "classic" or point == DEFAULT)
            del case
            if DEVICE["name"] == "cuda":
                torch.cuda.empty_cache()
    set_torch_variant("classic", None)


# ------------------------------------------------------------------------------------- jax

def sweep_jax(args, out: Out) -> None:
    import jax
    import jax.numpy as jnp
    from kvgroups_jax.lowerings import triton as pallas_copy

    from kvgroups_core import KVLayerGroupsManager, object_nbytes, prepare
    from kvgroups_core.formats.catalogue import EngineKVFormat as F

    def timed(fn) -> float:
        jax.block_until_ready(fn(0))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(1))
        calls = max(1, min(200, int(args.batch_ms / 1e3 / max(time.perf_counter() - t0, 1e-6))))
        times, i = [], 2
        for _ in range(args.repeats):
            t = time.perf_counter()
            r = None
            for _ in range(calls):
                r = fn(i)
                i += 1
            jax.block_until_ready(r)
            times.append((time.perf_counter() - t) * 1e3 / calls)
        return statistics.median(times)

    def copy_ms(nbytes: int) -> float:
        x = jnp.zeros(nbytes // 4, dtype=jnp.uint32)
        step = jax.jit(lambda a: a + 1, donate_argnums=0)
        state = [x]

        def fn(i):
            state[0] = step(state[0])
            return state[0]

        return timed(fn)

    saved = {k: pallas_copy.TUNING[k] for k in ("items_per_program", "small_page_bytes")}
    for page in args.pages:
        for shape in SHAPES[page]:
            if shape.layout != "nhd":
                continue
            bpc = CHUNK // shape.bs
            num_blocks = 2 * max(args.jax_chunks) * bpc
            key = jax.random.PRNGKey(page)
            caches = [jax.random.bits(jax.random.fold_in(key, layer),
                                      (2, num_blocks, shape.bs, shape.nh, shape.hs),
                                      jnp.uint16).view(jnp.bfloat16)
                      for layer in range(LAYERS)]
            manager = KVLayerGroupsManager(caches, [F.NL_X_TWO_NB_BS_NH_HS] * LAYERS,
                                           lmcache_tokens_per_chunk=CHUNK)
            nobj = object_nbytes(manager, 0)
            rng = np.random.default_rng(page)
            for chunks in args.jax_chunks:
                nbytes = chunks * nobj
                ceiling = copy_ms(nbytes)
                base = dict(runtime="jax", path="pallas-triton", placement="device",
                            chunks=chunks, page_bytes=page, shape=shape.name, layers=LAYERS,
                            bytes=nbytes, copy_ms=ceiling, ids="host", call="prepared")
                reference = None
                ids = [rng.permutation(num_blocks)[: chunks * bpc].astype(np.int32)
                       for _ in range(3)]  # the same ids for every variant: one reference
                for ipp in args.jax_items:
                    label = dict(variant="classic" if ipp == 1 else "small",
                                 items_per_program=ipp)
                    if out.over():
                        out.emit(record="skipped", reason="time budget", **base, **label)
                        continue
                    pallas_copy.TUNING["items_per_program"] = ipp
                    pallas_copy.TUNING["small_page_bytes"] = 0 if ipp == 1 else 1 << 20
                    jax.clear_caches()
                    prep = prepare(manager, caches)
                    got = np.asarray(prep.store(ids[0])[0])
                    if reference is None:  # the NumPy reference of the same store, once
                        before_np = [np.asarray(c).view(np.uint16) for c in caches]
                        reference = _numpy_store(before_np, ids[0], chunks)
                    if not np.array_equal(got, reference):
                        out.emit(**base, **label, direction="store", verified=False,
                                 error="store: objects differ from the NumPy reference")
                        caches = list(prep.kv_caches)
                        continue
                    ms = timed(lambda i, prep=prep, ids=ids: prep.store(ids[i % 3]))
                    out.emit(**base, **label, direction="store", median_ms=ms,
                             gbps=2 * nbytes / ms / 1e6, frac_of_ceiling=ceiling / ms,
                             verified=True)
                    # A load of random objects into the stored blocks, checked against them
                    # and the blocks outside the ids (then the caches are made whole again).
                    new = rng.integers(0, 256, got.shape, dtype=np.uint8)
                    prep.load([jnp.asarray(new)], ids[0])
                    loaded = [np.asarray(c) for c in prep.kv_caches]
                    want = _numpy_load(before_np, new, ids[0], chunks)
                    ok = all(np.array_equal(a.view(np.uint16), b) for a, b in zip(loaded, want))
                    prep.load([jnp.asarray(got)], ids[0])
                    if not ok:
                        out.emit(**base, **label, direction="load", verified=False,
                                 error="load: caches differ from the NumPy reference")
                        caches = list(prep.kv_caches)
                        continue
                    # Each load writes back what a store of the same ids read (caches kept).
                    objs = [prep.store(x) for x in ids]
                    ms = timed(lambda i, prep=prep, objs=objs, ids=ids:
                               prep.load(objs[i % 3], ids[i % 3]))
                    out.emit(**base, **label, direction="load", median_ms=ms,
                             gbps=2 * nbytes / ms / 1e6, frac_of_ceiling=ceiling / ms,
                             verified=True)
                    caches = list(prep.kv_caches)
            del caches
    pallas_copy.TUNING.update(saved)  # the defaults again, for whatever runs next
    jax.clear_caches()


def _numpy_store(caches: list[np.ndarray], ids: np.ndarray, chunks: int) -> np.ndarray:
    """Objects of a store of ``ids`` from NHD caches (uint16 views; planes kv * layers +
    layer, each the kept pages' token rows in order)."""
    planes = []
    for kv in range(2):
        for c in caches:
            pages = c[kv][ids]  # [n, BS, NH, HS]
            planes.append(pages.reshape(chunks, -1).view(np.uint8))
    return np.stack(planes, 1).reshape(chunks, -1)


def _numpy_load(caches: list[np.ndarray], objects: np.ndarray, ids: np.ndarray,
                chunks: int) -> list[np.ndarray]:
    """The caches (uint16 views) after a load of ``objects`` into the blocks ``ids``."""
    out = [c.copy() for c in caches]
    per_plane = objects.reshape(chunks, 2 * len(caches), -1)
    for kv in range(2):
        for layer, c in enumerate(out):
            rows = per_plane[:, kv * len(caches) + layer].reshape(-1).view(np.uint16)
            c[kv][ids] = rows.reshape((len(ids),) + c.shape[2:])
    return out


# ---------------------------------------------------------------------------------- report

_POINT_KEYS = ("planes_per_cta", "cta_bytes", "unroll", "items_per_program")


def _kernel_rows(records: list[dict]) -> list[dict]:
    """Verified transfer rows of the call that shows the kernel best: torch CUDA-graph
    replays (no host time) where there are any, else prepared calls with device ids, and
    JAX's prepared calls (host ids)."""
    rows = [r for r in records if r.get("record") == "transfer" and r.get("verified")]
    graph = any(r["runtime"] == "torch" and r["call"] == "graph" for r in rows)
    want = {"torch": ("graph", "device") if graph else ("prepared", "device"),
            "jax": ("prepared", "host")}
    return [r for r in rows if (r["call"], r["ids"]) == want[r["runtime"]]]


def winners(records: list[dict]) -> list[str]:
    """One line per (runtime, page, chunks, direction): the classic kernel's fraction of the
    copy and the best variant's, then per runtime the small-page point that is best in the
    worst case and the largest page size up to which it never loses to the classic kernel
    (the suggested threshold)."""
    rows = _kernel_rows(records)
    lines = ["runtime page chunks direction call: classic -> best (variant point)"]
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["runtime"], r["page_bytes"], r["chunks"], r["direction"]),
                         []).append(r)
    for (rt, page, chunks, direction), sel in sorted(cells.items()):
        classic = [r["frac_of_ceiling"] for r in sel if r["variant"] == "classic"]
        best = max(sel, key=lambda r: r["frac_of_ceiling"])
        point = {k: best[k] for k in _POINT_KEYS if k in best}
        c = f"{statistics.median(classic):.3f}" if classic else "-"
        lines.append(f"{rt} {page} {chunks} {direction} {best['call']}: {c} -> "
                     f"{best['frac_of_ceiling']:.3f} ({best['variant']} {point})")
    for rt in sorted({k[0] for k in cells}):
        points: dict = {}
        for (r_rt, page, chunks, direction), sel in cells.items():
            if r_rt != rt:
                continue
            classic = [r["frac_of_ceiling"] for r in sel if r["variant"] == "classic"]
            if not classic:
                continue
            for r in sel:
                if r["variant"] == "small":
                    key = tuple((k, r[k]) for k in _POINT_KEYS if k in r)
                    points.setdefault(key, {})[(page, chunks, direction)] = \
                        r["frac_of_ceiling"] / statistics.median(classic)
        if not points:
            continue
        best_key = max(points, key=lambda k: min(points[k].values()))
        ratios = points[best_key]
        threshold = 0
        for page in sorted({p for p, _, _ in ratios}):
            if min(v for (p, _, _), v in ratios.items() if p == page) < 0.99:  # 1%: noise
                break
            threshold = page
        lines.append(f"{rt} suggestion: small-page point {dict(best_key)}, worst ratio to "
                     f"classic {min(ratios.values()):.3f}, never slower up to pages of "
                     f"{threshold} B (threshold {threshold}; 0 = keep it off)")
    return lines


def main(argv=None) -> int:
    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x]

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    p.add_argument("--runtimes", default="torch", help="torch, jax or torch,jax")
    p.add_argument("--pages", type=ints, default=[512, 1024, 2048, 4096])
    p.add_argument("--chunks", type=ints, default=[64, 256])
    p.add_argument("--planes-per-cta", type=ints, default=list(SWEEP["planes_per_cta"]))
    p.add_argument("--cta-bytes", type=ints, default=list(SWEEP["cta_bytes"]))
    p.add_argument("--unroll", type=ints, default=list(SWEEP["unroll"]))
    p.add_argument("--jax-items", type=ints, default=[1, 8],
                   help="pallas_copy.TUNING['items_per_program'] values (1: the established)")
    p.add_argument("--jax-chunks", type=ints, default=[256],
                   help="chunk counts of the JAX part (each compiles its own programs)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch-ms", type=float, default=4.0)
    p.add_argument("--budget-s", type=float, default=170.0)
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke run of this script (2 layers, small sizes, no graphs)")
    p.add_argument("--define", action="append", default=[], metavar="MACRO=VALUE",
                   help="a page_copy.cu tuning macro for every torch kernel of the run, e.g. "
                        "KVG_PLANE_MAJOR=1 (the classic kernel's earlier unit order)")
    args = p.parse_args(argv)
    if args.define:
        from kvgroups_cuda import nvrtc
        from kvgroups_torch.cuda import launch as cuda_launch

        for item in args.define:
            name, _, value = item.partition("=")
            if not name.startswith("KVG_") or not value.lstrip("-").isdigit():
                p.error(f"--define: expected KVG_NAME=INTEGER, got {item!r}")
            nvrtc.TUNING[name] = int(value)
        cuda_launch.reset_caches()
    if args.tiny:
        DEVICE["name"] = "cpu"
        args.pages, args.chunks, args.layers = [512, 1024], [1, 2], 2
        args.planes_per_cta, args.cta_bytes, args.unroll = [4], [], []
        args.jax_items, args.jax_chunks, args.repeats, args.batch_ms = [1, 4], [2], 2, 1.0
    unknown = sorted(set(args.pages) - set(SHAPES))
    if unknown:
        p.error(f"--pages: expected sizes from {sorted(SHAPES)} (the shapes this sweep knows), "
                f"got {unknown}")
    globals()["LAYERS"] = args.layers
    runtimes = [r for r in args.runtimes.split(",") if r]
    out = Out(args.out, args.budget_s)
    if args.define:
        out.common["defines"] = list(args.define)
    if "torch" in runtimes:
        sweep_torch(args, out)
    if "jax" in runtimes:
        sweep_jax(args, out)
    table = winners(out.records)
    out.emit(record="winners", lines=table, elapsed_s=time.perf_counter() - out.t0)
    print("\n".join(table))
    return 1 if out.failed else 0


if __name__ == "__main__":
    sys.exit(main())
