"""Throughput and host cost of the torch backend's store / load, next to measured ceilings.

Shapes come from the shared catalogue (``kvgroups_tools.catalog``): Llama-3-8B-like (32 layers,
8 KV heads x 128, block 16, bf16, NHD) and small pages (1 KV head x 64). Per shape: 64 chunks
of 256 tokens to random blocks, store and load, objects in GPU memory and in pinned host
memory (direct UVA access and staging + one bulk copy), against

- the device-to-device copy of the same byte count (bytes read + written),
- pinned host copies each way (the PCIe ceiling),
- plain torch ``index_select`` / ``index_copy_`` (``kvgroups_torch.cpu``),

plus the host cost of one store call for one chunk. CUDA events, warm-up, medians, rotating
object buffers and id sets. One JSON object per line to ``--out`` (and a table on stdout).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "backends")]

from kvgroups_cuda import geometry, nvrtc  # noqa: E402
from kvgroups_torch import BoundPlan, TorchBackend, describe_tensor  # noqa: E402
from kvgroups_torch import cpu as cpu_path  # noqa: E402
from kvgroups_torch.cuda import device_tables  # noqa: E402
from kvgroups_torch.cuda import launch as cuda_launch  # noqa: E402
from kvgroups_torch.cuda import objects as cuda_objects  # noqa: E402
from kvgroups_torch.cuda import replay as cuda_replay  # noqa: E402
from kvgroups_torch.cuda import run as cuda_run  # noqa: E402

from kvgroups_core.grouping.manager import KVLayerGroupsManager  # noqa: E402
from kvgroups_core.transfer.api import prepare, store  # noqa: E402
from kvgroups_core.transfer.planner import bind, plan_call  # noqa: E402
from kvgroups_tools.catalog import MODELS  # noqa: E402


def cuda_ms(fn, iters: int, warmup: int, batch_s: float = 0.005) -> dict:
    """Median / min / max milliseconds per call of ``fn(i)``: ``iters`` batches of back-to-back
    calls between two CUDA events, each batch about ``batch_s`` long. Within a batch the host
    enqueues call k+1 while the device runs call k (as a serving loop does), so a call's host
    cost is not counted as device time unless it exceeds it; that cost is measured on its own
    (``host_cost``)."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(warmup)
    torch.cuda.synchronize()
    calls = max(1, min(100, int(batch_s / max(time.perf_counter() - t0, 1e-6))))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times, i = [], warmup + 1
    for _ in range(iters):
        start.record()
        for _ in range(calls):
            fn(i)
            i += 1
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return {"ms": statistics.median(times), "ms_min": min(times), "ms_max": max(times),
            "iters": iters, "calls_per_batch": calls}


def random_caches(model, device: str) -> list[torch.Tensor]:
    out = []
    gen = torch.Generator(device=device).manual_seed(0)
    for spec in model.kv_caches:
        dtype = getattr(torch, spec.dtype.name)
        nbytes = int(np.prod(spec.shape)) * spec.dtype.itemsize
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)
        out.append(raw.view(dtype).view(spec.shape))
    return out


class Setup:
    def __init__(self, shape: str, layers: int, num_blocks: int, chunks: int, rotate: int):
        model = MODELS[shape].build(num_blocks=num_blocks, layers=layers)
        self.caches = random_caches(model, "cuda")
        self.manager = KVLayerGroupsManager(self.caches, list(model.formats),
                                            lmcache_tokens_per_chunk=256)
        self.binding = bind(self.manager, self.caches)
        self.slots = list(self.binding.tensors)
        bpc = self.manager.calculate_num_blocks(0, 256)
        rng = np.random.default_rng(1)
        self.ids = [rng.permutation(num_blocks)[: chunks * bpc] for _ in range(rotate)]
        self.plans = {d: [plan_call(self.binding, ids, d) for ids in self.ids]
                      for d in ("store", "load")}
        nbytes = self.binding.object_nbytes
        self.objects = [[torch.empty((chunks, n), dtype=torch.uint8, device="cuda")
                         for n in nbytes] for _ in range(rotate)]
        self.nbytes = chunks * sum(nbytes)
        self.rotate = rotate
        self.bpc = bpc


def bench_shape(args, shape: str, backend: TorchBackend, staged: TorchBackend, emit) -> None:
    s = Setup(shape, args.layers, args.num_blocks, args.chunks, args.rotate)
    nbytes = s.nbytes
    common = {"shape": shape, "layers": args.layers, "chunks": args.chunks, "bytes": nbytes}

    # Ceilings: device copy of the same byte count; pinned host copies each way.
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = [torch.empty_like(src) for _ in range(2)]
    d2d = cuda_ms(lambda i: dst[i % 2].copy_(src), args.iters, args.warmup)
    d2d_gbps = 2 * nbytes / d2d["ms"] / 1e6
    emit({**common, "name": "ceiling_d2d_copy", **d2d, "GBps_rw": d2d_gbps})

    def kernel(direction, b=backend, objs=None):
        def fn(i):
            k = i % s.rotate
            b.execute(s.plans[direction][k], s.slots, objs[k] if objs else s.objects[k])
        return fn

    def baseline(direction):
        def fn(i):
            k = i % s.rotate
            cpu_path.run_plan(s.plans[direction][k], s.caches, s.objects[k])
        return fn

    results = {}
    for direction in ("store", "load"):
        r = cuda_ms(kernel(direction), args.iters, args.warmup)
        base = cuda_ms(baseline(direction), max(3, args.iters // 4), 1)
        gbps = 2 * nbytes / r["ms"] / 1e6
        results[direction] = r
        emit({**common, "name": f"{direction}_gpu_objects", **r, "GBps_rw": gbps,
              "frac_of_d2d": d2d["ms"] / r["ms"], "baseline_ms": base["ms"],
              "speedup_vs_index_ops": base["ms"] / r["ms"]})

    if args.sweep:
        sweep(args, s, kernel, d2d["ms"], common, emit)

    # Correctness spot check against the plain torch path.
    ref = [torch.zeros_like(o) for o in s.objects[0]]
    cpu_path.run_plan(s.plans["store"][0], s.caches, ref)
    backend.execute(s.plans["store"][0], s.slots, s.objects[0])
    torch.cuda.synchronize()
    emit({**common, "name": "check_store_equals_index_ops",
          "ok": all(torch.equal(a, b) for a, b in zip(ref, s.objects[0]))})

    if args.pinned:
        pinned = [[torch.empty((args.chunks, n), dtype=torch.uint8, pin_memory=True)
                   for n in s.binding.object_nbytes]]
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        it = max(3, args.iters // 4)
        h2d = cuda_ms(lambda i: dev.copy_(host, non_blocking=True), it, 1)
        d2h = cuda_ms(lambda i: host.copy_(dev, non_blocking=True), it, 1)
        ceil = {"store": d2h, "load": h2d}
        emit({**common, "name": "ceiling_pinned_h2d", **h2d, "GBps": nbytes / h2d["ms"] / 1e6})
        emit({**common, "name": "ceiling_pinned_d2h", **d2h, "GBps": nbytes / d2h["ms"] / 1e6})
        for direction in ("store", "load"):
            for mode, b in (("direct", backend), ("staged", staged)):
                r = cuda_ms(lambda i, d=direction, b=b: b.execute(
                    s.plans[d][0], s.slots, pinned[0]), it, 1)
                emit({**common, "name": f"{direction}_pinned_{mode}", **r,
                      "GBps": nbytes / r["ms"] / 1e6,
                      "frac_of_pinned_copy": ceil[direction]["ms"] / r["ms"]})
    torch.cuda.empty_cache()


def sweep(args, s, kernel, d2d_ms, common, emit) -> None:
    """Kernel tuning knobs: loads in flight, L2 sector prefetch, streaming stores, CTA size."""
    defaults = (dict(nvrtc.TUNING), geometry.TARGET_CTA_BYTES)
    knobs = [[int(v) for v in a.split(",")] for a in
             (args.sweep_unroll, args.sweep_load_hint, args.sweep_store_hint, args.sweep_load_nc,
              args.sweep_min_blocks, args.sweep_cta)]
    try:
        for unroll, load_hint, store_hint, load_nc, min_blocks, target in \
                itertools.product(*knobs):
            nvrtc.TUNING.clear()
            nvrtc.TUNING.update(KVG_UNROLL=unroll, KVG_LOAD_HINT=load_hint,
                                KVG_STORE_HINT=store_hint, KVG_LOAD_NC=load_nc,
                                KVG_MIN_BLOCKS=min_blocks)
            geometry.TARGET_CTA_BYTES = target
            cuda_launch.reset_caches()
            config = {"unroll": unroll, "load_hint": load_hint, "store_hint": store_hint,
                      "load_nc": load_nc, "min_blocks": min_blocks, "cta_bytes": target}
            for direction in ("store", "load"):
                r = cuda_ms(kernel(direction), args.iters, 2)
                emit({**common, "name": f"sweep_{direction}", **config, **r,
                      "frac_of_d2d": d2d_ms / r["ms"]})
    finally:
        nvrtc.TUNING.clear()
        nvrtc.TUNING.update(defaults[0])
        geometry.TARGET_CTA_BYTES = defaults[1]
        cuda_launch.reset_caches()


def _host_us(emit, name: str, fn, calls: int, sync=None) -> None:
    """Median host microseconds of ``fn()``; ``sync`` (CUDA) keeps the launch queue short."""
    for _ in range(50):
        fn()
    if sync:
        sync()
    times = []
    for i in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
        if sync and i % 64 == 63:
            sync()
    if sync:
        sync()
    emit({"name": f"host_cost_{name}", "us_median": statistics.median(times),
          "us_p10": float(np.percentile(times, 10)), "us_p90": float(np.percentile(times, 90)),
          "calls": calls, "layers": 32, "chunks": 1})


def host_cost(args, emit) -> None:
    """Host time of one store call moving one chunk of a 32-layer model (median of calls)."""
    model = MODELS["llama3-8b"].build(num_blocks=1024, layers=32)
    caches = random_caches(model, "cuda")
    manager = KVLayerGroupsManager(caches, list(model.formats), lmcache_tokens_per_chunk=256)
    binding = bind(manager, caches)
    slots = list(binding.tensors)
    backend = TorchBackend()
    bpc = manager.calculate_num_blocks(0, 256)
    rng = np.random.default_rng(2)
    ids = rng.permutation(1024)[:bpc]
    objects = [torch.empty((1, n), dtype=torch.uint8, device="cuda")
               for n in binding.object_nbytes]
    plan = plan_call(binding, ids, "store")
    bound = BoundPlan(plan, caches, objects)
    dev_ids = torch.from_numpy(ids).cuda()
    prepared = prepare(manager, caches, backend="torch")

    def measure(name, fn, calls):
        _host_us(emit, name, fn, calls, torch.cuda.synchronize)

    calls = args.host_calls
    measure("backend_execute", lambda: backend.execute(plan, slots, objects), calls)
    measure("bound_plan_run_device_ids", lambda: bound.run(dev_ids), calls)
    measure("bound_plan_execute_device_ids",
            lambda: bound.execute(bound.caches, bound.objects, [dev_ids]), calls)
    measure("core_plan_and_execute",
            lambda: backend.execute(plan_call(binding, ids, "store"), slots, objects), calls)
    measure("core_prepared_store", lambda: prepared.store(ids, objects), calls)
    measure("core_prepared_load", lambda: prepared.load(objects, ids), calls)
    measure("core_store", lambda: store(manager, caches, ids, objects, backend="torch"),
            max(50, calls // 10))
    measure("describe_one_tensor", lambda: describe_tensor(caches[0]), calls)


def host_cost_cpu(args, emit) -> None:
    """``--host-only-cpu``: the prepared path's host work without a GPU, to track it anywhere.

    CPU tensors play the GPU's, the prepared transfer runs its CUDA path
    (``cuda_run.DeviceCaches``: object checks, bindings, packed parameters), and only the
    driver side is stubbed: ``cuLaunchKernel``, the device state, the current stream and
    host-to-device copies. So a row here is a GPU row minus the launch itself (a few
    microseconds of ctypes and driver time on the H200 host).
    """
    class Kernels:
        def handle(self, name):
            return 0

    class Device:
        index, arch, num_sms = 0, "sm_90", 132
        err_table = device_tables.HostTable(np.zeros(8, dtype=np.int64))
        err_record = err_table.tensor
        kernels = Kernels()

    class Launcher:
        def __init__(self, device_index, params_address, *, programmatic=False):
            pass

        def launch(self, function, grid, threads, stream):
            pass

    device = Device()
    cuda_run.device_state = lambda index: device
    cuda_launch.Launcher = Launcher
    cuda_run.current_stream = lambda index: 0
    cuda_replay.current_stream = lambda index: 0
    cuda_launch._to_device = lambda a, index: torch.from_numpy(np.ascontiguousarray(a).copy())
    cuda_objects._to_table = lambda a, index: device_tables.HostTable(a)
    cuda_launch._to_table = lambda a, index: device_tables.HostTable(a)

    model = MODELS["llama3-8b"].build(num_blocks=1024, layers=32)
    # Never touched (no launch runs): empty tensors cost no memory until written.
    caches = [torch.empty(spec.shape, dtype=getattr(torch, spec.dtype.name))
              for spec in model.kv_caches]
    manager = KVLayerGroupsManager(caches, list(model.formats), lmcache_tokens_per_chunk=256)
    prepared = prepare(manager, caches, backend="torch")
    fast = cuda_run.DeviceCaches(prepared._bound.caches, 0)
    fast.device = torch.device("cpu")  # "objects on the caches' GPU" are CPU tensors here
    prepared._bound.device_caches = fast
    binding = prepared.binding
    ids = np.random.default_rng(2).permutation(1024)[:manager.calculate_num_blocks(0, 256)]
    objects = [torch.empty((1, n), dtype=torch.uint8) for n in binding.object_nbytes]
    plan = plan_call(binding, ids, "store")
    assert prepared.store(ids, objects) is not None and fast._launches, "not the CUDA path"

    calls = args.host_calls
    for name, fn in (
        ("cpu_stub_core_plan_call", lambda: plan_call(binding, ids, "store")),
        ("cpu_stub_bound_caches_run", lambda: prepared._bound.run(plan, objects)),
        ("cpu_stub_core_prepared_store", lambda: prepared.store(ids, objects)),
        ("cpu_stub_core_prepared_load", lambda: prepared.load(objects, ids)),
    ):
        _host_us(emit, name, fn, calls)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="llama3-8b,small-pages")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rotate", type=int, default=2)
    p.add_argument("--host-calls", type=int, default=2000)
    p.add_argument("--no-pinned", dest="pinned", action="store_false")
    p.add_argument("--sweep", action="store_true", help="also sweep the kernel tuning knobs")
    p.add_argument("--sweep-unroll", default="4,8")
    p.add_argument("--sweep-load-hint", default="0,1")
    p.add_argument("--sweep-store-hint", default="0,1")
    p.add_argument("--sweep-load-nc", default="0,1")
    p.add_argument("--sweep-min-blocks", default="1")
    p.add_argument("--sweep-cta", default="16384,32768,65536,131072")
    p.add_argument("--no-host-cost", dest="host_cost", action="store_false")
    p.add_argument("--out", type=Path, default=None, help="JSON lines file (appended)")
    p.add_argument("--host-only-cpu", action="store_true",
                   help="only the host cost of the prepared path, launches stubbed (no GPU)")
    args = p.parse_args(argv)
    if args.host_only_cpu:
        sink = open(args.out, "a") if args.out else None

        def emit_line(row):
            print(json.dumps(row), flush=True)
            if sink:
                sink.write(json.dumps(row) + "\n")

        emit_line({"name": "meta", "device": "cpu (launches stubbed)",
                   "torch": torch.__version__, "argv": sys.argv[1:]})
        host_cost_cpu(args, emit_line)
        return
    if not torch.cuda.is_available():
        sys.exit("bench_torch_transfer: needs a CUDA GPU")
    meta = {"name": "meta", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "argv": sys.argv[1:]}
    rows = [meta]
    out = open(args.out, "a") if args.out else None

    def emit(row):
        rows.append(row)
        line = json.dumps(row)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    emit(meta)
    backend, staged = TorchBackend("direct"), TorchBackend("staged")
    for shape in filter(None, args.shapes.split(",")):  # --shapes "": host cost only
        bench_shape(args, shape, backend, staged, emit)
    if args.host_cost:
        host_cost(args, emit)
    best = {}
    for r in rows:
        if r["name"].startswith("sweep_"):
            key = (r["shape"], r["name"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    for (shape, name), r in sorted(best.items()):
        print(f"best {name} {shape}: unroll={r['unroll']} load_hint={r['load_hint']} "
              f"store_hint={r['store_hint']} load_nc={r['load_nc']} "
              f"min_blocks={r['min_blocks']} cta_bytes={r['cta_bytes']} "
              f"frac_of_d2d={r['frac_of_d2d']:.3f}")
    print("\nsummary")
    for r in rows[1:]:
        if r["name"].startswith("sweep_"):
            continue
        keys = [k for k in ("shape", "ms", "GBps_rw", "GBps", "frac_of_d2d",
                            "speedup_vs_index_ops", "frac_of_pinned_copy", "us_median", "ok")
                if k in r]
        print(f"  {r['name']:<34}" + "  ".join(
            f"{k}={r[k]:.3f}" if isinstance(r[k], float) else f"{k}={r[k]}" for k in keys))


if __name__ == "__main__":
    main()
