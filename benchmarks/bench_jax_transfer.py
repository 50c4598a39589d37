"""Benchmark the JAX backend's store / load against the device copy ceiling and plain XLA.

Llama-3-8B-like shape (32 layers, 8 KV heads x 128, block 16, bf16, vLLM NHD
``[2, NB, BS, NH, HS]`` per layer), ``--chunks`` chunks of 256 tokens on random blocks. Prints
JSON lines: one per (path, direction) with the median time, bytes read + written per second and
the fraction of the same run's device copy rate and of plain XLA; then compile counts for a new
page count inside a bucket, and peak device memory around a load.

    python benchmarks/bench_jax_transfer.py --out benchmarks/results/jax_h200.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from kvgroups_jax.executor import execute_plan, trace_count

from kvgroups_core.formats.segments import SegmentRun, widest_unit
from kvgroups_core.tensors.descriptors import TensorSpec
from kvgroups_core.transfer.plan import GroupTransfer, PlaneRef, TransferPlan


def llama_plan(direction, args, ids, num_chunks, first_item=0):
    e = 2
    row = args.heads * args.head_size * e
    bpc = args.chunk_tokens // args.block
    nb = args.num_blocks
    planes = tuple(PlaneRef(tensor_slot=layer, byte_offset=kv * nb * args.block * row)
                   for kv in range(2) for layer in range(args.layers))
    run = SegmentRun(count=1, nbytes=row, obj_offset=0, obj_step=0, cache_offset=0,
                     cache_step=0, token_stride=row)
    group = GroupTransfer(
        kernel_group_idx=0, object_group_idx=0, region_offset=0, row_bytes=row,
        block_size=args.block, slots=args.chunk_tokens, planes=planes,
        block_stride_bytes=args.block * row, num_blocks=nb, runs=(run,),
        unit_bytes=widest_unit([row]), itemsize=e, block_ids=np.asarray(ids[: num_chunks * bpc]),
        blocks_per_chunk=bpc, kept_per_chunk=bpc, first_item=first_item, num_chunks=num_chunks,
    )
    spec = TensorSpec((2, nb, args.block, args.heads, args.head_size), "bfloat16")
    return TransferPlan(direction=direction, num_chunks=num_chunks,
                        object_nbytes=(2 * args.layers * args.chunk_tokens * row,),
                        groups=(group,), tensor_specs=(spec,) * args.layers)


def timed(fn, iters, warmup):
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_ceiling(nbytes, iters, warmup):
    """Median seconds and bytes read + written per second of a plain device copy."""
    x = jnp.zeros((nbytes // 4,), jnp.uint32)
    add = jax.jit(lambda v: v + jnp.uint32(1))  # one read and one write of every byte
    t = timed(lambda: add(x), iters, warmup)
    return t, 2 * nbytes / t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--paths", default="triton,mosaic,xla,auto")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rotate", type=int, default=2, help="object buffers and id sets rotated")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--dump-hlo", default=None,
                   help="write the optimized HLO of each path's store program to PATH.<path>")
    args = p.parse_args(argv)
    out = open(args.out, "a") if args.out else None

    def emit(rec):
        line = json.dumps(rec)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    dev = jax.devices()[0]
    rng = np.random.default_rng(0)
    bpc = args.chunk_tokens // args.block
    shape = (2, args.num_blocks, args.block, args.heads, args.head_size)
    key = jax.random.PRNGKey(0)
    caches = [jax.random.bits(jax.random.fold_in(key, i), shape, jnp.uint16).view(jnp.bfloat16)
              for i in range(args.layers)]
    id_sets = [rng.permutation(args.num_blocks)[: args.chunks * bpc] for _ in range(args.rotate)]
    plans = {d: [llama_plan(d, args, ids, args.chunks) for ids in id_sets]
             for d in ("store", "load")}
    onb = plans["store"][0].object_nbytes[0]
    payload = args.chunks * onb
    objects = [jax.random.bits(jax.random.fold_in(key, 1000 + i), (args.chunks, onb), jnp.uint8)
               for i in range(args.rotate)]
    jax.block_until_ready(caches + objects)
    t_copy, ceiling = copy_ceiling(payload, args.iters, args.warmup)
    emit({"kind": "ceiling", "device": str(dev.device_kind), "jax": jax.__version__,
          "bytes": 2 * payload, "median_s": t_copy, "GBps": ceiling / 1e9})

    state = {"caches": caches, "objects": objects, "i": 0}

    def step(direction, path):
        def fn():
            k = state["i"] % args.rotate
            state["i"] += 1
            plan = plans[direction][k]
            c, o = execute_plan(plan, state["caches"], [state["objects"][k]], lowering=path)
            if direction == "load":
                state["caches"] = list(c)
            else:
                state["objects"][k] = o[0]
            return o[0] if direction == "store" else c[0]
        return fn

    results = {}
    if args.dump_hlo:
        from kvgroups_jax import executor

        for path in args.paths.split(","):
            try:
                prog, metas, idss = executor.build_program(plans["store"][0], path,
                                                           dev.platform)
                text = executor._store_jit.lower(prog, tuple(caches), (objects[0],), metas,
                                                 idss).compile().as_text()
            except Exception as exc:  # diagnostics only: keep benchmarking
                text = f"{type(exc).__name__}: {exc}"
            with open(f"{args.dump_hlo}.{path}", "w") as f:
                f.write(text)
    for path in args.paths.split(","):
        for direction in ("store", "load"):
            try:
                t = timed(step(direction, path), args.iters, args.warmup)
            except Exception as exc:  # report and go on: one path failing must not hide others
                emit({"kind": "transfer", "path": path, "direction": direction,
                      "error": f"{type(exc).__name__}: {str(exc)[:400]}"})
                continue
            rate = 2 * payload / t
            results[(path, direction)] = rate
            emit({"kind": "transfer", "path": path, "direction": direction, "median_s": t,
                  "bytes": 2 * payload, "GBps": rate / 1e9, "of_copy": rate / ceiling})
    for (path, direction), rate in results.items():
        base = results.get(("xla", direction))
        if base and path != "xla":
            emit({"kind": "vs_xla", "path": path, "direction": direction,
                  "speedup": rate / base})

    # Compilations for a new page count inside the bucket (1024 -> 1000 and 640 items).
    for path in [q for q in args.paths.split(",") if (q, "load") in results]:
        before = trace_count()
        for first in (24, 7):
            plan = llama_plan("load", args, id_sets[0], args.chunks, first_item=first)
            c, _ = execute_plan(plan, state["caches"], [state["objects"][0]], lowering=path)
            state["caches"] = list(c)
        plan = llama_plan("store", args, id_sets[0], args.chunks * 5 // 8)  # 40 of 64 rows
        _, o = execute_plan(plan, state["caches"], [state["objects"][0]], lowering=path)
        state["objects"][0] = o[0]
        jax.block_until_ready(state["caches"])
        emit({"kind": "compiles_in_bucket", "path": path, "new_traces": trace_count() - before,
              "requests": ["load 1000 items", "load 1017 items", "store 640 items (pool 64)"]})

    # Peak device memory and pointers around one load.
    stats = getattr(dev, "memory_stats", lambda: None)() or {}
    ptrs = [c.unsafe_buffer_pointer() for c in state["caches"]]
    before_in_use, before_peak = stats.get("bytes_in_use"), stats.get("peak_bytes_in_use")
    c, _ = execute_plan(plans["load"][0], state["caches"], [state["objects"][0]], lowering="auto")
    jax.block_until_ready(c)
    after = getattr(dev, "memory_stats", lambda: None)() or {}
    emit({"kind": "load_memory", "cache_bytes_per_layer":
          int(np.prod(shape)) * 2, "bytes_in_use_before": before_in_use,
          "bytes_in_use_after": after.get("bytes_in_use"), "peak_before": before_peak,
          "peak_after": after.get("peak_bytes_in_use"),
          "same_pointers": [x.unsafe_buffer_pointer() for x in c] == ptrs})
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
