"""The torch page-copy kernels for contiguous pages, through the public prepared calls.

Llama-3-8B-like caches (32 layers, 8 KV heads x 128, block 16, bf16, vLLM NHD: 32 KiB pages),
256-token chunks to random blocks of ``--num-blocks`` (default 8192: 16 GiB of caches), objects
on the GPU, CUDA-tensor ids. For each kernel variant (``variant``: ``classic`` =
``geometry.WARP_MIN_PAGE_BYTES = 0``; ``warp-u{U}-b{B}`` = the warp kernels with ``U`` vectors
per lane (``KVG_WARP_UNROLL``) and ``B`` resident CTAs per SM (``KVG_WARP_MIN_BLOCKS``)):

- ``call="prepared"``: ``prepare(manager, caches).store`` / ``.load`` at 1 / 4 / 16 / 64 chunks;
- ``call="graph"``: the same call captured in a CUDA graph and replayed (no host time), 1 and
  16 chunks;
- ``call="layerwise"``: 32 calls with ``layers=[l]`` of a 16-chunk store, eager and in one CUDA
  graph, with ``frac_of_whole`` (the whole-model call's time over theirs) beside the copy.

Each variant is checked before it is timed: a store's objects and a load's caches against the
classic kernel's on the same cache contents (``verified``; exit status 1 if any differs). ``frac_of_ceiling`` is the same run's ``copy_`` of the
same bytes over the call's time (CUDA events over batches of back-to-back calls, medians).
One JSON object per line to ``--out`` and stdout::

    python benchmarks/sweep_warp_kernel.py --out benchmarks/results/torch_warp_h200.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "backends"), str(ROOT / "benchmarks")]

import bench_torch_engine as bte  # noqa: E402
from kvgroups_cuda import geometry, nvrtc  # noqa: E402
from kvgroups_torch.cuda import launch as cuda_launch  # noqa: E402

import kvgroups_core as kc  # noqa: E402

VARIANTS = {  # name: (WARP_MIN_PAGE_BYTES, nvrtc.TUNING)
    "classic": (0, {}),
    "warp-u4-b1": (8192, {"KVG_WARP_UNROLL": 4, "KVG_WARP_MIN_BLOCKS": 1}),
    "warp-u4-b6": (8192, {"KVG_WARP_UNROLL": 4, "KVG_WARP_MIN_BLOCKS": 6}),
    "warp-u8-b4": (8192, {"KVG_WARP_UNROLL": 8, "KVG_WARP_MIN_BLOCKS": 4}),
    "warp-u16-b2": (8192, {}),  # the defaults
    "warp-u32-b1": (8192, {"KVG_WARP_UNROLL": 32, "KVG_WARP_MIN_BLOCKS": 1}),
    # cache operators of the defaults' 16-byte accesses (KVG_WARP_LD_HINT / _ST_HINT)
    "warp-u16-b2-ldcs": (8192, {"KVG_WARP_LD_HINT": 1}),
    "warp-u16-b2-ldna": (8192, {"KVG_WARP_LD_HINT": 2}),
    "warp-u16-b2-stcs": (8192, {"KVG_WARP_ST_HINT": 1}),
    "warp-u16-b2-cs": (8192, {"KVG_WARP_LD_HINT": 1, "KVG_WARP_ST_HINT": 1}),
    # units plane by plane over every chunk (main's order before chunk by chunk)
    "warp-u16-b2-planes": (8192, {"KVG_WARP_PLANE_MAJOR": 1}),
    # the next launch starts only as this one's CTAs exit (before the early trigger)
    "warp-u16-b2-late": (8192, {"KVG_EARLY_TRIGGER": 0}),
    # stores without the L2 prefetch of their first segment before the wait (the other
    # prefetch variants measured, -pfload and -pflanes, are in the code at 014ab89)
    "warp-u16-b2-nopf": (8192, {"KVG_WARP_PREFETCH": 0}),
}


def select(name: str) -> None:
    threshold, tuning = VARIANTS[name]
    geometry.WARP_MIN_PAGE_BYTES = threshold
    nvrtc.TUNING.clear()
    nvrtc.TUNING.update(tuning)
    cuda_launch.reset_caches()


def captured(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--num-blocks", type=int, default=8192)
    p.add_argument("--iters", type=int, default=9)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--layerwise-ctas", default="",
                   help="comma-separated max_ctas values for the layer-wise calls besides "
                        "the uncapped ones (records carry max_ctas)")
    args = p.parse_args(argv)
    caps = [None] + [int(c) for c in args.layerwise_ctas.split(",") if c]

    class A:
        tiny, layers, num_blocks = False, 32, args.num_blocks

    s = bte.Setup(A)
    timer = bte.Timer(True, iters=args.iters, warmup=3, batch_s=0.03)
    rng = np.random.default_rng(0)
    counts = (1, 4, 16, 64)
    ceiling = {c: bte.copy_ms(s, timer, s.moved_bytes(c)) for c in counts}
    ids = {c: [torch.from_numpy(rng.permutation(s.num_blocks)[: c * s.bpc].astype(np.int32))
               .cuda() for _ in range(4)] for c in counts}
    objs = {c: s.objects(c) for c in counts}
    failed = False

    def emit(r):
        line = json.dumps(r)
        print(line, flush=True)
        if args.out is not None:
            with open(args.out, "a") as f:
                f.write(line + "\n")

    def bytes_of(name: str, where: torch.Tensor) -> tuple:
        """A 4-chunk store into zeroed objects and the load of them back at other blocks,
        by variant ``name``, from the caches as they are now (put back after the load)."""
        select(name)
        prep = kc.prepare(s.manager, s.caches)
        stored = [torch.zeros_like(objs[4][0][0])]
        prep.store(ids[4][0], stored)
        snapshot = [c[:, where].clone() for c in s.caches]
        prep.load(stored, ids[4][1])
        # Compared as integers: the random bf16 bits include NaNs, never equal as floats.
        loaded = [c[:, where].view(torch.int16).cpu() for c in s.caches]
        for c, old in zip(s.caches, snapshot):
            c[:, where] = old
        torch.cuda.synchronize()
        return stored[0].cpu(), loaded

    def measure(name: str) -> bool:
        # Verified against the classic kernel on the same cache contents (timed loads
        # write the objects' bytes into the caches, so each check starts from what is there).
        where = ids[4][1].long()
        want_obj, want_caches = bytes_of("classic", where)
        got_obj, got_caches = bytes_of(name, where)
        ok = torch.equal(got_obj, want_obj) and all(
            torch.equal(g, w) for g, w in zip(got_caches, want_caches))
        select(name)
        prep = kc.prepare(s.manager, s.caches)
        base = {"runtime": "torch", "path": "cuda-kernel", "placement": "device",
                "page_bytes": s.page_bytes, "variant": name, "verified": ok}
        for c in counts:
            for direction in ("store", "load"):
                if direction == "store":
                    fn = lambda i, c=c: prep.store(ids[c][i % 4], objs[c][i % 2])  # noqa: E731
                else:
                    fn = lambda i, c=c: prep.load(objs[c][i % 2], ids[c][i % 4])  # noqa: E731
                t = timer.ms(fn)
                emit({**base, "call": "prepared", "ids": "device", "direction": direction,
                      "chunks": c, "frac_of_ceiling": ceiling[c] / t["median"],
                      "copy_ms": ceiling[c], **t})
                if c in (1, 16):
                    graph = captured(lambda fn=fn: fn(0))
                    t = timer.ms(lambda i, g=graph: g.replay())
                    emit({**base, "call": "graph", "ids": "device", "direction": direction,
                          "chunks": c, "frac_of_ceiling": ceiling[c] / t["median"],
                          "copy_ms": ceiling[c], **t})
        whole = timer.ms(lambda i: prep.store(ids[16][0], objs[16][0]))["median"]

        for cap in caps:
            opts = {} if cap is None else {"max_ctas": cap}

            def per_layer(i=0, opts=opts):
                for layer in range(s.layers):
                    prep.store(ids[16][0], objs[16][0], layers=[layer], **opts)

            eager = timer.ms(per_layer)
            graph = captured(per_layer)
            replay = timer.ms(lambda i, graph=graph: graph.replay())
            for t, in_graph in ((eager, False), (replay, True)):
                emit({**base, "call": "layerwise", "ids": "device", "direction": "store",
                      "chunks": 16, "graph": in_graph, "calls_per_step": s.layers,
                      "max_ctas": cap, "frac_of_ceiling": ceiling[16] / t["median"],
                      "frac_of_whole": whole / t["median"], "whole_ms": whole,
                      "copy_ms": ceiling[16], **t})
        return ok

    for name in args.variants.split(","):
        failed |= not measure(name)
    select("warp-u16-b2")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
