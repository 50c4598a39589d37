"""What a bare gather reaches: random pages out of pools of growing size, against the copy.

Diagnostic (H200): the least a page gather must do, one warp per 8 KiB segment of a page
(16-byte loads, all in flight before the stores, no id checks, no tables, no bookkeeping),
compiled with NVRTC and launched raw, gathering ``--moved-mib`` of 32 KiB pages chosen at
random out of a pool of each ``--pools-gib`` size (and the same count of consecutive pages,
``order="sequential"``) into one contiguous buffer. ``frac_of_ceiling`` is the same run's
``copy_`` of the moved bytes over the gather's time (CUDA events over batches of back-to-back
launches, medians). It bounds what any page-copy kernel reaches on random block ids of an
engine's cache: the kvgroups kernels do the same work plus their checks. ``--moved-mib``
takes several sizes (32 MiB is one Llama-3-8B chunk of 256 tokens); ``--directions
store,load`` adds the reverse, a scatter of a packed buffer into the pool's pages (a load's
work, ``probe="bare_scatter"``). ``--programmatic``
runs it the way they are launched on sm_90+ (behind ``griddepcontrol.wait``, with
programmatic stream serialization: see ``kvgroups_torch/driver.py``); ``--trigger`` adds their
early ``griddepcontrol.launch_dependents``. On the largest pool
and the last size it also records the floor of layer-by-layer calls: 32 launches of a 32nd of the pages each in
one CUDA graph against one launch of all of them (``bare_gather_layerwise``), and the same for
plain eager ``copy_`` of contiguous bytes (``copy_layerwise``). JSON lines::

    python benchmarks/probe_gather_ceiling.py --out benchmarks/results/gather_ceiling_h200.jsonl
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "backends"), str(ROOT / "benchmarks")]

import bench_torch_engine as bte  # noqa: E402
from kvgroups_torch.cuda import driver  # noqa: E402

PAGE = 32768
SOURCE = r"""
struct alignas(16) V { unsigned long long a, b; };
struct Args { const V* src; V* dst; const int* ids; unsigned int n_units; int pad; };
// unit u = segment u % 4 (8 KiB, 16 vectors per lane) of page u / 4. GATHER: pool page
// ids[page] -> contiguous page `page` (a store); else the reverse (a load's scatter).
template <bool WAIT, bool GATHER> __device__ __forceinline__ void move_pages(const Args& p) {
    if (WAIT) asm volatile("griddepcontrol.wait;" ::: "memory");
#if TRIGGER
    if (WAIT) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    const unsigned int u = blockIdx.x * 8u + (threadIdx.x >> 5);
    if (u >= p.n_units) return;
    const unsigned int page = u >> 2, seg = u & 3u, lane = threadIdx.x & 31u;
    const unsigned long long pooled = (unsigned long long)p.ids[page] * 2048u + seg * 512u + lane;
    const unsigned long long packed = (unsigned long long)page * 2048u + seg * 512u + lane;
    const V* __restrict__ s = p.src + (GATHER ? pooled : packed);
    V* __restrict__ d = p.dst + (GATHER ? packed : pooled);
    V v[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) v[k] = s[k * 32];
#pragma unroll
    for (int k = 0; k < 16; ++k) d[k * 32] = v[k];
}
extern "C" __global__ void __launch_bounds__(256, 2) gather(const Args p) {
    move_pages<false, true>(p);
}
// The same behind the wait that lets it be launched programmatically (sm_90+, driver.py).
extern "C" __global__ void __launch_bounds__(256, 2) gather_wait(const Args p) {
    move_pages<true, true>(p);
}
extern "C" __global__ void __launch_bounds__(256, 2) scatter(const Args p) {
    move_pages<false, false>(p);
}
extern "C" __global__ void __launch_bounds__(256, 2) scatter_wait(const Args p) {
    move_pages<true, false>(p);
}
"""


class Args(ctypes.Structure):
    _fields_ = [("src", ctypes.c_uint64), ("dst", ctypes.c_uint64), ("ids", ctypes.c_uint64),
                ("n_units", ctypes.c_uint32), ("pad", ctypes.c_int32)]


def main(argv=None) -> None:
    from cuda.core import ObjectCode, Program, ProgramOptions

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pools-gib", default="2,16,64")
    p.add_argument("--moved-mib", default="512",
                   help="comma-separated sizes moved per launch (the last one also runs the layer-wise floor)")
    p.add_argument("--directions", default="store",
                   help="store (gather from the pool), load (scatter into it), or both")
    p.add_argument("--programmatic", action="store_true",
                   help="the kernel behind griddepcontrol.wait, launched with programmatic "
                        "stream serialization (as the kvgroups kernels are on sm_90+)")
    p.add_argument("--trigger", action="store_true",
                   help="with --programmatic: each CTA lets the next launch start right after "
                        "its wait (griddepcontrol.launch_dependents, as the kvgroups kernels do)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    arch = "sm_%d%d" % torch.cuda.get_device_capability()
    source = "#define TRIGGER %d\n" % int(a.trigger) + SOURCE
    code = Program(source, "c++", options=ProgramOptions(arch=arch, std="c++17")).compile("cubin")
    suffix = "_wait" if a.programmatic else ""
    kernels = {d: int(ObjectCode.from_cubin(code.code).get_kernel(k + suffix).handle)
               for d, k in (("store", "gather"), ("load", "scatter"))}
    args = Args()
    launcher = driver.Launcher(torch.cuda.current_device(), ctypes.addressof(args),
                               programmatic=a.programmatic)
    timer = bte.Timer(True, iters=9, warmup=3, batch_s=0.03)
    pools = [int(x) for x in a.pools_gib.split(",")]
    sizes = [int(x) for x in a.moved_mib.split(",")]
    directions = a.directions.split(",")
    rng = np.random.default_rng(0)
    for gib in pools:
        pool = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
        pages = pool.numel() // PAGE
        for mib in sizes:
            moved = mib << 20
            n_pages = moved // PAGE
            packed = [torch.empty(moved, dtype=torch.uint8, device="cuda") for _ in range(2)]
            ceiling = timer.ms(lambda i, d=packed: d[i % 2].copy_(d[1 - i % 2]))["median"]
            chosen = {}
            for order in ("random", "sequential"):
                sets = chosen[order] = [torch.from_numpy(
                    (rng.permutation(pages)[:n_pages] if order == "random"
                     else np.arange(n_pages) + k * n_pages % (pages - n_pages))
                    .astype(np.int32)).cuda() for k in range(4)]
                for direction in directions:
                    t = timer.ms(partial(run_once, args, launcher, kernels[direction], direction,
                                         pool, packed, sets, n_pages))
                    torch.cuda.synchronize()
                    emit(a, {"call": "internal",
                             "probe": "bare_gather" if direction == "store" else "bare_scatter",
                             "runtime": "torch", "path": "bare-kernel", "ids": "device",
                             "direction": direction, "placement": "device", "page_bytes": PAGE,
                             "moved_bytes": moved, "pool_bytes": gib << 30, "order": order,
                             "copy_ms": ceiling, "programmatic": launcher.programmatic,
                             "trigger": a.trigger,
                             "frac_of_ceiling": ceiling / t["median"], **t})
            if gib == max(pools) and mib == sizes[-1] and "store" in directions:
                layerwise(a, kernels["store"], args, launcher, timer, pool, chosen["random"],
                          n_pages)
            del packed
        del pool
        torch.cuda.empty_cache()


def run_once(args, launcher, kernel, direction, pool, packed, sets, n_pages, i) -> None:
    """One launch moving the pages of id set ``i % 4`` between the pool and a packed buffer."""
    units = n_pages * 4
    ends = (pool.data_ptr(), packed[i % 2].data_ptr())
    args.src, args.dst = ends if direction == "store" else ends[::-1]
    args.ids, args.n_units = sets[i % 4].data_ptr(), units
    launcher.launch(kernel, (-(-units // 8), 1, 1), 256, torch.cuda.current_stream().cuda_stream)


def layerwise(a, kernel, args, launcher, timer, pool, sets, n_pages, layers: int = 32) -> None:
    """The floor of one-layer launches: ``layers`` launches of 1/``layers`` of the pages each,
    captured in one CUDA graph (no host time), against one launch of all of them."""
    per = n_pages // layers
    keep = []  # ctypes parameter blocks the graph's launches were recorded with

    def launch_all(stream, pieces):
        for k in range(pieces):
            block = Args(pool.data_ptr(), dst_all.data_ptr() + k * per * PAGE,
                         sets[0].data_ptr() + 4 * k * per, per * 4 * (layers // pieces), 0)
            keep.append(block)
            lk = driver.Launcher(torch.cuda.current_device(), ctypes.addressof(block),
                                 programmatic=a.programmatic)
            lk.launch(kernel, (-(-block.n_units // 8), 1, 1), 256, stream)

    dst_all = torch.empty(n_pages * PAGE, dtype=torch.uint8, device="cuda")
    out = {}
    for pieces in (1, layers):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            launch_all(torch.cuda.current_stream().cuda_stream, pieces)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch_all(torch.cuda.current_stream().cuda_stream, pieces)
        out[pieces] = timer.ms(lambda i, g=graph: g.replay())["median"]
    emit(a, {"call": "internal", "probe": "bare_gather_layerwise", "runtime": "torch",
             "path": "bare-kernel", "graph": True, "launches": layers,
             "programmatic": launcher.programmatic, "trigger": a.trigger,
             "bytes_per_launch": per * PAGE, "ms_one_launch": out[1],
             "ms_all_launches": out[layers], "us_per_launch": out[layers] * 1e3 / layers,
             "frac_of_whole": out[1] / out[layers]})
    copies = copy_pieces(timer, n_pages * PAGE, layers)
    emit(a, {"call": "internal", "probe": "copy_layerwise", "runtime": "torch",
             "path": "copy_", "graph": False, "launches": layers,
             "bytes_per_launch": per * PAGE, "ms_one_launch": copies[1],
             "ms_all_launches": copies[layers], "us_per_launch": copies[layers] * 1e3 / layers,
             "frac_of_whole": copies[1] / copies[layers]})


def copy_pieces(timer, nbytes: int, layers: int) -> dict[int, float]:
    """The same floor for plain ``copy_`` (the benchmarks' ceiling): one copy of ``nbytes``
    and ``layers`` back-to-back copies of a ``layers``-th each, eager (milliseconds per set;
    a captured ``copy_`` becomes a graph memcpy node, a different engine, so no graph here)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    step = nbytes // layers
    pieces = [(dst[k * step:(k + 1) * step], src[k * step:(k + 1) * step]) for k in range(layers)]

    def copy_all(i):
        for d, s in pieces:
            d.copy_(s)

    return {1: timer.ms(lambda i: dst.copy_(src))["median"], layers: timer.ms(copy_all)["median"]}


def emit(a, record: dict) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if a.out is not None:
        with open(a.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
