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
  on the Triton lowering, ``pallas_copy.TUNING["items_per_program"]`` swept (1 = the
  established one item per program).

Every configuration is VERIFIED once before it is timed: a store's objects against a torch
gather of the same pages (the reference), a load's caches against the objects at the loaded
blocks and untouched elsewhere; a mismatch is a ``verified: false`` record and exit status 1.
``frac_of_ceiling`` is the same run's device-to-device copy of the same bytes (torch
``copy_``, eager; JAX: jitted ``x + 1`` over uint32 words) over the call's time. JSON lines
to ``--out`` (appended) and stdout, then a winner table. ``--budget-s`` (default 170) stops
timing and writes ``skipped`` records for what is left.

    python benchmarks/sweep_small_pages.py --out small_pages_h200.jsonl --runtimes torch,jax
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
    for key, values in SWEEP.items():
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

    def over(self) -> bool:
        return time.perf_counter() - self.t0 > self.budget_s

    def emit(self, **rec) -> None:
        rec.setdefault("record", "transfer")
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

        for i in range(2):
            fn(i)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(2)
        torch.cuda.synchronize()
        calls = max(1, min(400, int(self.batch_ms / 1e3 / max(time.perf_counter() - t0, 1e-6))))
        times, i = [], 3
        for _ in range(self.repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn(i)
                i += 1
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
        return statistics.median(times)


def set_torch_variant(variant: str, point: dict | None) -> None:
    """Select the kernels (module switches read when launch state is built) and forget the
    launch state built before."""
    from kvgroups_torch import cuda_path, geometry, nvrtc

    if variant == "classic":
        geometry.SMALL_PAGE_BYTES = 0
        nvrtc.TUNING.pop("KVG_SMALL_UNROLL", None)
    else:
        geometry.SMALL_PAGE_BYTES = 1 << 20  # every page of the sweep
        geometry.SMALL_PLANES_PER_CTA = point["planes_per_cta"]
        geometry.SMALL_CTA_BYTES = point["cta_bytes"]
        nvrtc.TUNING["KVG_SMALL_UNROLL"] = point["unroll"]
    cuda_path.reset_caches()


class TorchCase:
    """Caches of one shape, sized for the largest chunk count, plus the reference views."""

    def __init__(self, shape: Shape, max_chunks: int, seed: int) -> None:
        import torch

        from kvgroups_core.formats import EngineKVFormat as F
        from kvgroups_core.manager import KVLayerGroupsManager

        self.shape = shape
        self.bpc = CHUNK // shape.bs
        self.num_blocks = 2 * max_chunks * self.bpc
        dims = ((2, self.num_blocks, shape.bs, shape.nh, shape.hs) if shape.layout == "nhd"
                else (2, self.num_blocks, shape.nh, shape.bs, shape.hs))
        fmt = F.NL_X_TWO_NB_BS_NH_HS if shape.layout == "nhd" else F.NL_X_TWO_NB_NH_BS_HS
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.caches = []
        for _ in range(LAYERS):
            t = torch.empty(dims, dtype=torch.bfloat16, device="cuda")
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

        ids = torch.from_numpy(ids_np.astype(np.int64)).cuda()
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

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = [torch.empty_like(src) for _ in range(2)]
    return timer.ms(lambda i: dst[i % 2].copy_(src))


def verify_torch(case: TorchCase, prep, chunks: int) -> tuple[bool, str]:
    """One store and one load checked byte for byte (and untouched blocks untouched)."""
    import torch

    import kvgroups_torch

    ids = case.ids(chunks, 1)[0]
    dev = torch.from_numpy(ids).cuda()
    out = torch.full((chunks, case.object_nbytes), 0xA5, dtype=torch.uint8, device="cuda")
    prep.store(dev, [out])
    if not torch.equal(out, case.expected_objects(ids, chunks)):
        return False, "store: objects differ from the reference"
    before = [c.clone() for c in case.caches]
    new = torch.randint(0, 256, out.shape, dtype=torch.uint8, device="cuda")
    prep.load([new], dev)
    if not torch.equal(case.cache_bytes_at(ids, chunks), new):
        return False, "load: cache pages differ from the objects"
    mask = torch.ones(case.num_blocks, dtype=torch.bool, device="cuda")
    mask[dev.long()] = False
    for a, b in zip(case.caches, before):
        if not torch.equal(a[:, mask], b[:, mask]):
            return False, "load: a block outside the ids changed"
    # Restore, so later configurations start from the same caches.
    for a, b in zip(case.caches, before):
        a.copy_(b)
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
                    objs = [[torch.empty((chunks, case.object_nbytes), dtype=torch.uint8,
                                         device="cuda")] for _ in range(2)]
                    host_ids = case.ids(chunks)
                    dev_ids = [torch.from_numpy(x).cuda() for x in host_ids]
                    id_kinds = [("device", dev_ids)]
                    if variant == "classic" or point == DEFAULT:
                        id_kinds.append(("host", host_ids))
                    for kind, ids in id_kinds:
                        for direction in ("store", "load"):
                            if direction == "store":
                                def fn(i, ids=ids):
                                    prep.store(ids[i % len(ids)], objs[i % 2])
                            else:
                                def fn(i, ids=ids):
                                    prep.load(objs[i % 2], ids[i % len(ids)])
                            ms = timer.ms(fn)
                            out.emit(**base, **label, call="prepared", ids=kind,
                                     direction=direction, median_ms=ms,
                                     gbps=2 * nbytes / ms / 1e6, frac_of_ceiling=ceiling / ms,
                                     verified=True)
                    for direction in ("store", "load"):
                        if direction == "store":
                            def call():
                                prep.store(dev_ids[0], objs[0])
                        else:
                            def call():
                                prep.load(objs[0], dev_ids[0])
                        ms = graph_ms(timer, call)
                        out.emit(**base, **label, call="graph", ids="device",
                                 direction=direction, median_ms=ms, gbps=2 * nbytes / ms / 1e6,
                                 frac_of_ceiling=ceiling / ms, verified=True)
                    del prep, objs
            del case
            torch.cuda.empty_cache()
    set_torch_variant("classic", None)


# ------------------------------------------------------------------------------------- jax

def sweep_jax(args, out: Out) -> None:
    import jax
    import jax.numpy as jnp

    from kvgroups_core import KVLayerGroupsManager, object_nbytes, prepare
    from kvgroups_core.formats import EngineKVFormat as F
    from kvgroups_jax import pallas_copy

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

    for page in args.pages:
        for shape in SHAPES[page]:
            if shape.layout != "nhd":
                continue
            bpc = CHUNK // shape.bs
            num_blocks = 2 * max(args.chunks) * bpc
            key = jax.random.PRNGKey(page)
            caches = [jax.random.bits(jax.random.fold_in(key, layer),
                                      (2, num_blocks, shape.bs, shape.nh, shape.hs),
                                      jnp.uint16).view(jnp.bfloat16)
                      for layer in range(LAYERS)]
            manager = KVLayerGroupsManager(caches, [F.NL_X_TWO_NB_BS_NH_HS] * LAYERS,
                                           lmcache_tokens_per_chunk=CHUNK)
            nobj = object_nbytes(manager, 0)
            rng = np.random.default_rng(page)
            for chunks in args.chunks:
                nbytes = chunks * nobj
                ceiling = copy_ms(nbytes)
                base = dict(runtime="jax", path="pallas-triton", placement="device",
                            chunks=chunks, page_bytes=page, shape=shape.name, layers=LAYERS,
                            bytes=nbytes, copy_ms=ceiling, ids="host", call="prepared")
                reference = None
                for ipp in args.jax_items:
                    label = dict(variant="classic" if ipp == 1 else "small",
                                 items_per_program=ipp)
                    if out.over():
                        out.emit(record="skipped", reason="time budget", **base, **label)
                        continue
                    pallas_copy.TUNING["items_per_program"] = ipp
                    jax.clear_caches()
                    ids = [rng.permutation(num_blocks)[: chunks * bpc].astype(np.int32)
                           for _ in range(3)]
                    prep = prepare(manager, caches, lowering="triton") \
                        if "lowering" in prepare.__code__.co_varnames else prepare(manager, caches)
                    got = np.asarray(prep.store(ids[0])[0])
                    if reference is None:  # the NumPy reference of the same store, once
                        reference = _numpy_store(caches, ids[0], chunks, bpc)
                    if not np.array_equal(got, reference):
                        out.emit(**base, **label, direction="store", verified=False,
                                 error="store: objects differ from the NumPy reference")
                        continue
                    ms = timed(lambda i: prep.store(ids[i % 3]))
                    out.emit(**base, **label, direction="store", median_ms=ms,
                             gbps=2 * nbytes / ms / 1e6, frac_of_ceiling=ceiling / ms,
                             verified=True)
                    objs = [jnp.asarray(got)]
                    prep.load(objs, ids[0])
                    back = np.asarray(prep.store(ids[0])[0])
                    if not np.array_equal(back, reference):
                        out.emit(**base, **label, direction="load", verified=False,
                                 error="load: reloaded pages differ")
                        continue
                    ms = timed(lambda i: prep.load(objs, ids[i % 3]))
                    out.emit(**base, **label, direction="load", median_ms=ms,
                             gbps=2 * nbytes / ms / 1e6, frac_of_ceiling=ceiling / ms,
                             verified=True)
                    caches = list(prep.kv_caches) if hasattr(prep, "kv_caches") else caches
            del caches
    pallas_copy.TUNING["items_per_program"] = 1
    jax.clear_caches()


def _numpy_store(caches, ids: np.ndarray, chunks: int, bpc: int) -> np.ndarray:
    """Objects of a store of ``ids`` from NHD caches (planes kv * layers + layer)."""
    planes = []
    for kv in range(2):
        for c in caches:
            pages = np.asarray(c[kv]).view(np.uint16)[ids]  # [n, BS, NH, HS]
            planes.append(pages.reshape(chunks, -1).view(np.uint8))
    return np.stack(planes, 1).reshape(chunks, -1)


# ---------------------------------------------------------------------------------- report

def winners(records: list[dict]) -> list[str]:
    """Per (runtime, page, chunks, direction), on the graph rows where there are (kernel
    alone) else prepared device/host ids: the classic figure and the best variant's."""
    rows = [r for r in records if r.get("record") == "transfer" and r.get("verified")]
    keys = sorted({(r["runtime"], r["page_bytes"], r["chunks"], r["direction"]) for r in rows})
    lines = ["runtime page chunks direction call: classic -> best (variant point)"]
    for rt, page, chunks, direction in keys:
        sel = [r for r in rows if (r["runtime"], r["page_bytes"], r["chunks"],
                                   r["direction"]) == (rt, page, chunks, direction)]
        call = "graph" if any(r["call"] == "graph" for r in sel) else "prepared"
        sel = [r for r in sel if r["call"] == call and r["ids"] == ("device" if call == "graph"
                                                                     else r["ids"])]
        classic = [r["frac_of_ceiling"] for r in sel if r["variant"] == "classic"]
        best = max(sel, key=lambda r: r["frac_of_ceiling"])
        point = {k: best[k] for k in ("planes_per_cta", "cta_bytes", "unroll",
                                      "items_per_program") if k in best}
        lines.append(f"{rt} {page} {chunks} {direction} {call}: "
                     f"{statistics.median(classic) if classic else float('nan'):.3f} -> "
                     f"{best['frac_of_ceiling']:.3f} ({best['variant']} {point})")
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
    p.add_argument("--jax-items", type=ints, default=[1, 4, 8, 16],
                   help="pallas_copy.TUNING['items_per_program'] values (1: the established)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch-ms", type=float, default=4.0)
    p.add_argument("--budget-s", type=float, default=170.0)
    args = p.parse_args(argv)
    runtimes = [r for r in args.runtimes.split(",") if r]
    out = Out(args.out, args.budget_s)
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
