"""The engine-native torch calls, measured through the public API only.

Llama-3-8B-like caches (32 layers, 8 KV heads x 128, block 16, bf16, NHD: 32 KiB pages),
256-token chunks to random blocks, objects in GPU memory. Every figure sits next to the same
run's device-to-device copy of the same bytes (``frac_of_ceiling``):

- ``prepared`` store / load with host ids (NumPy) and CUDA-tensor ids, 1 / 4 / 16 / 64 chunks;
- ``store`` (one-shot) with CUDA ids, 1 and 16 chunks;
- ``graph``: a prepared one-chunk store captured in a CUDA graph, replayed with new ids
  written in place between replays;
- ``layerwise``: 32 calls with ``layers=[l]`` of a 16-chunk store (the whole model moved
  layer by layer) against the whole-model call (``frac_of_whole``), eager and (device ids)
  captured in one CUDA graph as an engine's captured forward pass runs them;
- ``compile``: a ``torch.compile(fullgraph=True)`` engine step calling the prepared store;
- ``sm_cap``: a store capped with ``max_ctas`` (16 of the GPU's SMs by default) running beside
  a bf16 GEMM on another stream: the store's GB/s alone and beside the GEMM, and the GEMM's
  slowdown (its own event-timed duration beside the stores over its time alone), capped and
  not; ``step_over_gemm`` is the whole step (GEMM and stores joined) over the GEMM alone.
- ``state`` (``--only state``): recurrent state beside attention (docs/SEMANTICS.md section
  9) on a Qwen3-Next-like hybrid (``--state-layers`` layers, three Gated DeltaNet : one full
  attention; per GDN layer a (3, 8192) bf16 conv state and a (32, 128, 128) fp32 delta memory,
  one snapshot slot per chunk; attention 2 KV heads x 256, block 16): prepared store / load of
  the state layers alone (``layers="state"``), the attention layers alone and the whole model,
  host and CUDA ids, 1 / 4 / 16 / 64 chunks. A load writes only the last chunk's snapshot
  (the request's state slot), so its bytes are the attention chunks plus one snapshot; every
  record's ``bytes`` is what its plan moves, against the same run's copy of those bytes.
- ``paths`` (``--paths kernel,copy_engine``): prepared store / load with host ids forced onto
  each ``path=``, over page sizes 1-128 KiB (a Llama-like bf16 NHD cache whose head count and
  block size give the page), 1 / 4 / 16 / 64 / 256 chunks, objects on the GPU and in pinned
  host memory; each record carries ``path``, and its ceiling is the same run's plain copy of
  the same bytes (device to device, or over the link for pinned objects: ``link_gbps``).
  Points moving more than ``--paths-max-bytes`` (and page sizes not started within
  ``--paths-budget-s``) are recorded as skipped.

CUDA timed with events over batches of back-to-back calls (medians); ``--tiny`` runs a small
model (small pages, 2 layers) on the CPU with wall-clock timing (the CI smoke test; no graph,
no SM cap). One JSON object per line to ``--out`` and stdout; fields ``call, ids, runtime,
path, direction, placement, chunks, page_bytes, gbps, frac_of_ceiling, median`` (ms per call)
plus extras::

    python benchmarks/bench_torch_engine.py --out torch_engine_h200.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import kvgroups_torch  # noqa: F401  (compile support is installed on import)
import numpy as np
import torch

import kvgroups_core as kc
from kvgroups_core import EngineKVFormat, KVLayerGroupsManager
from kvgroups_tools.catalog import MODELS

CHUNK = 256


class Timer:
    """Milliseconds per call of ``fn(i)``: CUDA events over batches of back-to-back calls, or
    the wall clock on the CPU."""

    def __init__(self, cuda: bool, iters: int, warmup: int, batch_s: float) -> None:
        self.cuda, self.iters, self.warmup, self.batch_s = cuda, iters, warmup, batch_s

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, fn) -> dict:
        for i in range(self.warmup):
            fn(i)
        self.sync()
        t0 = time.perf_counter()
        fn(self.warmup)
        self.sync()
        calls = max(1, min(200, int(self.batch_s / max(time.perf_counter() - t0, 1e-6))))
        times, i = [], self.warmup + 1
        for _ in range(self.iters):
            if self.cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
            t = time.perf_counter()
            for _ in range(calls):
                fn(i)
                i += 1
            if self.cuda:
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / calls)
            else:
                times.append((time.perf_counter() - t) * 1e3 / calls)
        return {
            "median": statistics.median(times),
            "ms_min": min(times),
            "ms_max": max(times),
            "calls_per_batch": calls,
        }


class Setup:
    def __init__(self, args) -> None:
        self.device = "cpu" if args.tiny else "cuda"
        layers, num_blocks = (2, 64) if args.tiny else (args.layers, args.num_blocks)
        name = "small-pages" if args.tiny else "llama3-8b"
        model = MODELS[name].build(
            num_blocks=num_blocks, layers=layers, dtype="float16" if args.tiny else "bfloat16"
        )
        gen = torch.Generator(device=self.device).manual_seed(0)
        self.caches = []
        for spec in model.kv_caches:
            dtype = getattr(torch, spec.dtype.name)
            t = torch.empty(spec.shape, dtype=dtype, device=self.device)
            t.view(torch.int16).random_(generator=gen)
            self.caches.append(t)
        self.manager = KVLayerGroupsManager(
            self.caches, list(model.formats), lmcache_tokens_per_chunk=CHUNK
        )
        self.prep = kc.prepare(self.manager, self.caches)
        self.layers = layers
        self.num_blocks = num_blocks
        self.bpc = self.manager.calculate_num_blocks(0, CHUNK)
        group = self.manager.kernel_groups[0]
        sd = group.shape_desc
        self.page_bytes = sd.bs * sd.nh * sd.hs * group.dtype.itemsize
        self.rng = np.random.default_rng(1)

    def ids(self, chunks: int, kind: str, rotate: int = 4) -> list:
        out = []
        for _ in range(rotate):
            ids = self.rng.permutation(self.num_blocks)[: chunks * self.bpc].astype(np.int32)
            out.append(torch.from_numpy(ids).to(self.device) if kind == "device" else ids)
        return out

    def objects(self, chunks: int, rotate: int = 2) -> list:
        n = kc.object_nbytes(self.manager, 0)
        return [
            [torch.empty((chunks, n), dtype=torch.uint8, device=self.device)] for _ in range(rotate)
        ]

    def moved_bytes(self, chunks: int) -> int:
        return chunks * kc.object_nbytes(self.manager, 0)


def copy_ms(s: Setup, timer: Timer, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=s.device)
    dst = [torch.empty_like(src) for _ in range(2)]
    return timer.ms(lambda i: dst[i % 2].copy_(src))["median"]


def record(
    s: Setup,
    call: str,
    ids: str,
    direction: str,
    chunks: int,
    timing: dict,
    ceiling_ms: float,
    **extra,
) -> dict:
    nbytes = s.moved_bytes(chunks)
    ms = timing["median"]
    return {
        "call": call,
        "ids": ids,
        "runtime": "torch",
        "path": "cuda-kernel" if s.device == "cuda" else "cpu",
        "direction": direction,
        "placement": "device",
        "chunks": chunks,
        "page_bytes": s.page_bytes,
        "gbps": 2 * nbytes / ms / 1e6,
        "frac_of_ceiling": ceiling_ms / ms,
        **timing,
        "copy_ms": ceiling_ms,
        "bytes": nbytes,
        **extra,
    }


def bench_prepared(s: Setup, timer: Timer, chunk_counts, emit) -> None:
    for chunks in chunk_counts:
        ceiling = copy_ms(s, timer, s.moved_bytes(chunks))
        objs = s.objects(chunks)
        for kind in ("host", "device"):
            ids = s.ids(chunks, kind)
            t = timer.ms(lambda i, ids=ids, objs=objs: s.prep.store(ids[i % len(ids)], objs[i % 2]))
            emit(record(s, "prepared", kind, "store", chunks, t, ceiling))
            t = timer.ms(lambda i, ids=ids, objs=objs: s.prep.load(objs[i % 2], ids[i % len(ids)]))
            emit(record(s, "prepared", kind, "load", chunks, t, ceiling))
        if chunks in (1, 16):
            ids = s.ids(chunks, "device")
            t = timer.ms(
                lambda i, ids=ids, objs=objs: kc.store(
                    s.manager, s.caches, ids[i % len(ids)], objs[i % 2]
                )
            )
            emit(record(s, "store", "device", "store", chunks, t, ceiling))
            t = timer.ms(
                lambda i, ids=ids, objs=objs: kc.load(
                    s.manager, objs[i % 2], s.caches, ids[i % len(ids)]
                )
            )
            emit(record(s, "load", "device", "load", chunks, t, ceiling))


def bench_graph(s: Setup, timer: Timer, emit) -> None:
    chunks = 1
    ceiling = copy_ms(s, timer, s.moved_bytes(chunks))
    ids = s.ids(chunks, "device")
    static = ids[0].clone()
    objs = s.objects(chunks, rotate=1)[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        s.prep.store(static, objs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s.prep.store(static, objs)
    t = timer.ms(lambda i: graph.replay())
    emit(record(s, "graph", "device", "store", chunks, t, ceiling))

    def with_new_ids(i):
        static.copy_(ids[i % len(ids)])  # the engine's pattern: new ids written in place
        graph.replay()

    t = timer.ms(with_new_ids)
    emit(record(s, "graph", "device", "store", chunks, t, ceiling, new_ids_each_replay=True))


def bench_layerwise(s: Setup, timer: Timer, chunks: int, emit) -> None:
    ceiling = copy_ms(s, timer, s.moved_bytes(chunks))
    objs = s.objects(chunks)
    for kind in ("device", "host"):
        ids = s.ids(chunks, kind)
        whole = timer.ms(lambda i, ids=ids, objs=objs: s.prep.store(ids[i % len(ids)], objs[i % 2]))
        emit(record(s, "prepared", kind, "store", chunks, whole, ceiling))

        def per_layer(i, ids=ids):
            for layer in range(s.layers):
                s.prep.store(ids[i % len(ids)], objs[i % 2], layers=[layer])

        t = timer.ms(per_layer)
        emit(
            record(
                s,
                "layerwise",
                kind,
                "store",
                chunks,
                t,
                ceiling,
                calls_per_step=s.layers,
                frac_of_whole=whole["median"] / t["median"],
            )
        )

        def per_layer_load(i, ids=ids):
            for layer in range(s.layers):
                s.prep.load(objs[i % 2], ids[i % len(ids)], layers=[layer])

        if kind == "device" and s.device == "cuda":
            bench_layerwise_graph(s, timer, chunks, ids[0], objs[0], whole, ceiling, emit)

        whole_load = timer.ms(
            lambda i, ids=ids, objs=objs: s.prep.load(objs[i % 2], ids[i % len(ids)])
        )
        t = timer.ms(per_layer_load)
        emit(
            record(
                s,
                "layerwise",
                kind,
                "load",
                chunks,
                t,
                ceiling,
                calls_per_step=s.layers,
                frac_of_whole=whole_load["median"] / t["median"],
            )
        )


def bench_layerwise_graph(
    s: Setup, timer: Timer, chunks: int, ids, objs, whole: dict, ceiling: float, emit
) -> None:
    """The 32 layer-wise stores as an engine runs them inside its captured forward pass:
    one CUDA graph holding every call (no host work per call on replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for layer in range(s.layers):
            s.prep.store(ids, objs, layers=[layer])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(s.layers):
            s.prep.store(ids, objs, layers=[layer])
    t = timer.ms(lambda i: graph.replay())
    emit(
        record(
            s,
            "layerwise",
            "device",
            "store",
            chunks,
            t,
            ceiling,
            calls_per_step=s.layers,
            frac_of_whole=whole["median"] / t["median"],
            graph=True,
        )
    )


def bench_compile(s: Setup, timer: Timer, chunk_counts, backend: str, emit) -> None:
    def step(prep, ids, objects):
        prep.store(ids, objects)
        return objects[0]

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for chunks in chunk_counts:
        ceiling = copy_ms(s, timer, s.moved_bytes(chunks))
        ids, objs = s.ids(chunks, "device"), s.objects(chunks)
        t0 = time.perf_counter()
        compiled(s.prep, ids[0], objs[0])
        timer.sync()
        first_s = time.perf_counter() - t0
        t = timer.ms(lambda i, ids=ids, objs=objs: compiled(s.prep, ids[i % len(ids)], objs[i % 2]))
        emit(
            record(
                s,
                "compile",
                "device",
                "store",
                chunks,
                t,
                ceiling,
                compiler=backend,
                first_call_s=first_s,
            )
        )


def bench_sm_cap(s: Setup, timer: Timer, chunks: int, max_ctas: int, emit) -> None:
    ceiling = copy_ms(s, timer, s.moved_bytes(chunks))
    ids, objs = s.ids(chunks, "device"), s.objects(chunks)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    gemm_alone = timer.ms(lambda i: torch.matmul(a, b, out=out))
    side = torch.cuda.Stream()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for cap in (max_ctas, None):
        alone = timer.ms(
            lambda i, cap=cap: s.prep.store(ids[i % len(ids)], objs[i % 2], max_ctas=cap)
        )
        # Side by side: each timed step is one GEMM on the main stream and, on the side
        # stream, as many stores as fit in it (both streams joined at the end of the step).
        per_gemm = max(1, int(gemm_alone["median"] / alone["median"]))

        def both(i, cap=cap, per_gemm=per_gemm):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for k in range(per_gemm):
                    s.prep.store(ids[(i + k) % len(ids)], objs[(i + k) % 2], max_ctas=cap)
            torch.matmul(a, b, out=out)
            torch.cuda.current_stream().wait_stream(side)

        step = timer.ms(both)
        gemm_ms, store_ms = _side_by_side(s, ids, objs, a, b, out, side, cap, per_gemm)
        emit(
            record(
                s,
                "sm_cap",
                "device",
                "store",
                chunks,
                alone,
                ceiling,
                max_ctas=cap,
                sms=sms,
                gemm_alone_ms=gemm_alone["median"],
                step_ms=step["median"],
                stores_per_gemm=per_gemm,
                step_over_gemm=step["median"] / gemm_alone["median"],
                gemm_concurrent_ms=gemm_ms,
                gemm_slowdown=gemm_ms / gemm_alone["median"],
                concurrent_store_ms=store_ms,
                concurrent_store_gbps=2 * s.moved_bytes(chunks) * per_gemm / store_ms / 1e6,
            )
        )


def _side_by_side(s: Setup, ids, objs, a, b, out, side, cap, per_gemm, rounds: int = 15):
    """Medians of the GEMM's own time on the main stream and of the stores' on the side
    stream while both run (CUDA events on each stream, the stores enqueued first)."""
    main = torch.cuda.current_stream()
    gemm, store = [], []
    for r in range(rounds + 2):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        side.wait_stream(main)
        with torch.cuda.stream(side):
            events[0].record()
            for k in range(per_gemm):
                s.prep.store(ids[(r + k) % len(ids)], objs[(r + k) % 2], max_ctas=cap)
            events[1].record()
        events[2].record()
        torch.matmul(a, b, out=out)
        events[3].record()
        main.wait_stream(side)
        torch.cuda.synchronize()
        if r >= 2:  # two warm-up rounds
            store.append(events[0].elapsed_time(events[1]))
            gemm.append(events[2].elapsed_time(events[3]))
    return statistics.median(gemm), statistics.median(store)


def bench_state(args, timer: Timer, emit) -> None:
    """Recurrent-state pages beside attention through the prepared calls (see the docstring)."""
    from kvgroups_tools.bench import call_bytes

    device = "cpu" if args.tiny else "cuda"
    chunk_counts = (1, 2) if args.tiny else tuple(args.chunks)
    layers = 4 if args.tiny else args.state_layers
    # Attention blocks for the most chunks (plus slack); the catalogue gives one snapshot
    # slot per chunk of them.
    num_blocks = 2 * max(chunk_counts) * CHUNK // 16 + 16
    model = MODELS["qwen3-next-like"].build(num_blocks=num_blocks, layers=layers)
    gen = torch.Generator(device=device).manual_seed(5)
    caches = []
    for spec in model.kv_caches:
        t = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype.name), device=device)
        t.view(torch.uint8).random_(generator=gen)
        caches.append(t)
    manager = KVLayerGroupsManager(
        caches, list(model.formats), model.engine_group_infos, lmcache_tokens_per_chunk=CHUNK
    )
    prep = kc.prepare(manager, caches)
    state = sorted(i for g in manager.kernel_groups if g.recurrent_state for i in g.layer_indices)
    attention = sorted(
        i for g in manager.kernel_groups if not g.recurrent_state for i in g.layer_indices
    )
    slots = min(g.shape_desc.nb for g in manager.kernel_groups if g.recurrent_state)
    nbytes = [kc.object_nbytes(manager, og) for og in range(manager.num_object_groups)]
    rng = np.random.default_rng(7)
    page = max(
        g.shape_desc.nh * g.shape_desc.hs * g.dtype.itemsize
        for g in manager.kernel_groups
        if g.recurrent_state
    )
    for chunks in chunk_counts:
        objs = [
            [torch.empty((chunks, n), dtype=torch.uint8, device=device) for n in nbytes]
            for _ in range(2)
        ]

        def ids_for(kind: str, chunks: int = chunks) -> list:
            out = []
            for _ in range(4):
                per_group = {
                    0: rng.permutation(num_blocks)[: chunks * CHUNK // 16],
                    1: rng.permutation(slots)[:chunks],
                }
                out.append(
                    {
                        g: torch.from_numpy(v.astype(np.int64)).to(device)
                        if kind == "device"
                        else v
                        for g, v in per_group.items()
                    }
                )
            return out

        for kind in ("host", "device"):
            ids = ids_for(kind)
            for which, layers_arg in (("state", state), ("attention", attention), ("all", None)):
                for direction in ("store", "load"):
                    moved = call_bytes(
                        manager,
                        caches,
                        {
                            g: np.asarray(v.cpu() if hasattr(v, "cpu") else v)
                            for g, v in ids[0].items()
                        },
                        direction,
                        layers=layers_arg,
                    )
                    ceiling = copy_ms(SimpleNamespace(device=device), timer, moved)
                    if direction == "store":

                        def fn(i, ids=ids, objs=objs, layers_arg=layers_arg):
                            prep.store(ids[i % 4], objs[i % 2], layers=layers_arg)
                    else:

                        def fn(i, ids=ids, objs=objs, layers_arg=layers_arg):
                            prep.load(objs[i % 2], ids[i % 4], layers=layers_arg)

                    t = timer.ms(fn)
                    ms = t["median"]
                    emit(
                        {
                            "call": "prepared",
                            "ids": kind,
                            "runtime": "torch",
                            "path": "cuda-kernel" if device == "cuda" else "cpu",
                            "direction": direction,
                            "placement": "device",
                            "chunks": chunks,
                            "page_bytes": page,
                            "layers": which,
                            "model": "qwen3-next-like",
                            "model_layers": layers,
                            "gbps": 2 * moved / ms / 1e6,
                            "frac_of_ceiling": ceiling / ms,
                            **t,
                            "copy_ms": ceiling,
                            "bytes": moved,
                        }
                    )


PATH_PAGES = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
PATH_CHUNKS = (1, 4, 16, 64, 256)


def page_geometry(page_bytes: int) -> tuple[int, int]:
    """``(block_size, kv_heads)`` of a bf16 NHD page of ``page_bytes`` with 128-wide heads:
    block 16 from 4 KiB up, fewer tokens per block below."""
    row = 256  # one bf16 head of 128
    if page_bytes < 16 * row:
        return max(1, page_bytes // row), 1
    return 16, page_bytes // (16 * row)


def _nhd_setup(page: int, layers: int, chunks: int, device: str, tiny: bool):
    """A Llama-like NHD cache (128-wide heads) whose pages are ``page`` bytes, with room
    for ``chunks`` chunks of distinct random blocks."""
    dtype = torch.float16 if tiny else torch.bfloat16
    hs = 128
    bs, nh = page_geometry(page)
    num_blocks = max(64, 2 * chunks * CHUNK // bs)
    caches = [
        torch.empty((2, num_blocks, bs, nh, hs), dtype=dtype, device=device) for _ in range(layers)
    ]
    for c in caches:
        c.view(torch.int16).random_()
    manager = KVLayerGroupsManager(
        caches, [EngineKVFormat.NL_X_TWO_NB_BS_NH_HS] * layers, lmcache_tokens_per_chunk=CHUNK
    )
    return manager, caches, num_blocks, bs, bs * nh * hs * caches[0].element_size()


def bench_paths(args, timer: Timer, emit) -> None:
    cuda = not args.tiny
    device = "cuda" if cuda else "cpu"
    paths = args.paths
    pages = (1024, 4096) if args.tiny else args.paths_pages
    chunk_counts = (1, 2) if args.tiny else args.paths_chunks
    placements = ("device",) if args.tiny else ("device", "pinned")
    layers = 2 if args.tiny else args.paths_layers
    rng = np.random.default_rng(3)
    t0 = time.perf_counter()
    for page in pages:
        if time.perf_counter() - t0 > args.paths_budget_s:
            emit(
                {
                    "call": "prepared",
                    "ids": "host",
                    "runtime": "torch",
                    "path": paths[0],
                    "page_bytes": page,
                    "skipped": f"past --paths-budget-s {args.paths_budget_s}",
                }
            )
            continue
        bs = page_geometry(page)[0]
        fits = [
            c for c in chunk_counts if c * 2 * layers * CHUNK // bs * page <= args.paths_max_bytes
        ]
        for chunks in sorted(set(chunk_counts) - set(fits)):
            for placement in placements:
                emit(
                    {
                        "call": "prepared",
                        "ids": "host",
                        "runtime": "torch",
                        "path": paths[0],
                        "placement": placement,
                        "chunks": chunks,
                        "page_bytes": page,
                        "skipped": f"moves more than --paths-max-bytes {args.paths_max_bytes}",
                    }
                )
        if not fits:
            continue
        manager, caches, num_blocks, bs, page_bytes = _nhd_setup(
            page, layers, max(fits), device, args.tiny
        )
        prep = kc.prepare(manager, caches)
        nbytes = kc.object_nbytes(manager, 0)
        for placement in placements:
            pinned = placement == "pinned"
            big = [
                torch.empty(
                    (max(fits), nbytes),
                    dtype=torch.uint8,
                    device="cpu" if pinned else device,
                    pin_memory=pinned,
                )
                for _ in range(2)
            ]
            for chunks in fits:
                moved = chunks * nbytes
                blocks = chunks * CHUNK // bs
                ids = [rng.permutation(num_blocks)[:blocks] for _ in range(4)]
                objs = [[b[:chunks]] for b in big]
                ceilings = {
                    d: _ceiling_ms(timer, moved, device, pinned, d) for d in ("store", "load")
                }
                for path in paths:
                    for direction in ("store", "load"):
                        base = {
                            "call": "prepared",
                            "ids": "host",
                            "runtime": "torch",
                            "path": path,
                            "direction": direction,
                            "placement": placement,
                            "chunks": chunks,
                            "page_bytes": page_bytes,
                            "layers": layers,
                            "device": device,
                        }
                        if path == "copy_engine" and not cuda:
                            emit({**base, "skipped": "the copy engine needs a CUDA GPU"})
                            continue
                        if direction == "store":

                            def fn(i, ids=ids, objs=objs, path=path, prep=prep):
                                prep.store(ids[i % 4], objs[i % 2], path=path)
                        else:

                            def fn(i, ids=ids, objs=objs, path=path, prep=prep):
                                prep.load(objs[i % 2], ids[i % 4], path=path)

                        t = timer.ms(fn)
                        ms = t["median"]
                        emit(
                            {
                                **base,
                                "gbps": 2 * moved / ms / 1e6,
                                "link_gbps": moved / ms / 1e6 if pinned else None,
                                "frac_of_ceiling": ceilings[direction] / ms,
                                **t,
                                "copy_ms": ceilings[direction],
                                "bytes": moved,
                            }
                        )
            big = objs = None
        caches = prep = manager = None


def _ceiling_ms(timer: Timer, nbytes: int, device: str, pinned: bool, direction: str) -> float:
    """The plain copy of ``nbytes``: device to device, or over the link in the direction of
    the transfer (device -> pinned for a store, pinned -> device for a load)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if not pinned:
        other = [torch.empty_like(dev) for _ in range(2)]
        return timer.ms(lambda i: other[i % 2].copy_(dev))["median"]
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if direction == "store":
        return timer.ms(lambda i: host.copy_(dev, non_blocking=True))["median"]
    return timer.ms(lambda i: dev.copy_(host, non_blocking=True))["median"]


def _csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    p.add_argument("--tiny", action="store_true", help="small CPU run (CI smoke test)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=8192)
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-s", type=float, default=0.025)
    p.add_argument("--max-ctas", type=int, default=16)
    p.add_argument("--compiler", default="inductor")
    p.add_argument(
        "--only",
        nargs="+",
        default=None,
        choices=["prepared", "graph", "layerwise", "compile", "sm_cap", "paths", "state"],
    )
    p.add_argument(
        "--state-layers",
        type=int,
        default=12,
        help="layers of the Qwen3-Next-like model of --only state (3 GDN : 1 attn)",
    )
    p.add_argument(
        "--paths",
        type=_csv(str),
        default=None,
        help="run the path sweep with these path= values (kernel,copy_engine)",
    )
    p.add_argument("--paths-pages", type=_csv(int), default=list(PATH_PAGES))
    p.add_argument("--paths-chunks", type=_csv(int), default=list(PATH_CHUNKS))
    p.add_argument("--paths-layers", type=int, default=4)
    p.add_argument("--paths-iters", type=int, default=5)
    p.add_argument("--paths-max-bytes", type=int, default=2 << 30)
    p.add_argument(
        "--paths-budget-s",
        type=float,
        default=600.0,
        help="page sizes not started by then are recorded as skipped",
    )
    args = p.parse_args(argv)
    if args.tiny:
        args.chunks, args.iters, args.warmup, args.batch_s = [1, 2], 2, 1, 0.001
        args.compiler = "aot_eager"
    elif not torch.cuda.is_available():
        p.error("no CUDA GPU: use --tiny for the CPU smoke run")
    s = Setup(args)
    timer = Timer(s.device == "cuda", args.iters, args.warmup, args.batch_s)
    sink = open(args.out, "a") if args.out else None

    def emit(row: dict) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if sink:
            sink.write(line + "\n")
            sink.flush()

    default = ["prepared", "graph", "layerwise", "compile", "sm_cap"]
    if args.tiny:
        default += ["paths", "state"]  # the CI smoke test covers them (kernel only on CPU)
    wanted = set(args.only or default)
    if "prepared" in wanted:
        bench_prepared(s, timer, args.chunks, emit)
    if "graph" in wanted and s.device == "cuda":
        bench_graph(s, timer, emit)
    if "layerwise" in wanted:
        bench_layerwise(s, timer, 2 if args.tiny else 16, emit)
    if "compile" in wanted:
        bench_compile(s, timer, [1] if args.tiny else [1, 16], args.compiler, emit)
    if "sm_cap" in wanted and s.device == "cuda":
        bench_sm_cap(s, timer, 64, args.max_ctas, emit)
    if "state" in wanted:
        bench_state(args, timer, emit)
    if args.paths or "paths" in wanted:
        args.paths = args.paths or ["kernel", "copy_engine"]
        bench_paths(
            args,
            Timer(s.device == "cuda", min(args.iters, args.paths_iters), args.warmup, args.batch_s),
            emit,
        )
    if sink:
        sink.close()


if __name__ == "__main__":
    main()
