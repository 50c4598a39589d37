"""Host time per public call: what a store or load costs the engine's thread before it returns.

An engine calls ``prepare(manager, caches).store(ids)`` / ``.load(objects, ids)`` (or the
one-shot ``store(manager, caches, ids)`` / ``load(manager, objects, caches, ids)``) every step,
with the same caches; on a GPU the copy runs asynchronously, so the call's wall time is the
host's share: planning, checks, binding, dispatch. Per runtime (``--runtimes``: ``torch``,
``jax``, ``numpy``), on a Llama-like cache (default 32 layers of ``[2, NB, 16, 1, 8]`` float32
on the CPU, ``[2, NB, 16, 8, 128]`` bfloat16 with ``--device cuda``), one chunk of 256 tokens:

- ``prepared`` / ``store`` (one-shot), direction ``store``: a store creating its objects;
- the same with ``objects=`` passed in (``objects: "given"``; JAX: the previous call's
  objects, donated);
- ``prepared`` / ``load`` (one-shot), direction ``load``: a load of those objects (JAX: the
  caches the previous load returned are passed in, as an engine does);
- ``layerwise``: one prepared store with ``layers=[0]`` (an engine's per-layer call).

Each call is timed on its own with the wall clock after a warm-up, the prepared and one-shot
calls interleaved (a shared machine's drift hits both alike), the results waited for after
the timer stops; the median and p10/p90 in microseconds. On a CPU the copy itself is in the
figure (tiny at the default sizes). One JSON object per line on stdout and appended to
``--out``::

    python benchmarks/bench_host_cost.py --device cuda --runtimes torch,jax --out
    host_cost_h200.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
from common import JsonLines

from kvgroups_core import EngineKVFormat, KVLayerGroupsManager, load, prepare, store

CHUNK_TOKENS = 256
BLOCK_SIZE = 16


def stats(times: list[float]) -> dict:
    return {
        "us_median": statistics.median(times),
        "us_p10": float(np.percentile(times, 10)),
        "us_p90": float(np.percentile(times, 90)),
        "calls": len(times),
    }


def timed_together(fns, sync, calls: int, warmup: int) -> list[dict]:
    """Each of ``fns`` timed call by call, the calls interleaved; results waited for after
    each timer stops."""
    for _ in range(warmup):
        for fn in fns:
            fn()
            sync()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(calls):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter_ns()
            fn()
            out.append((time.perf_counter_ns() - t0) / 1e3)
            sync()
    return [stats(t) for t in times]


def runtime(name: str, device: str):
    """``(make a cache from a NumPy array, wait for a tree of arrays, loads return new caches,
    the cache dtype)``."""
    if name == "jax":
        import jax
        import jax.numpy as jnp

        dtype = jnp.bfloat16 if device == "cuda" else jnp.float32
        return (lambda a: jnp.asarray(a, dtype=dtype)), jax.block_until_ready, True
    if name == "torch":
        import torch

        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        return (lambda a: torch.from_numpy(a).to(device, dtype)), (lambda tree: sync()), False
    if name == "numpy":
        return np.copy, (lambda tree: None), False
    raise SystemExit(f"bench_host_cost: --runtimes: expected torch, jax or numpy, got {name!r}")


def bench_runtime(args, name: str, emit) -> None:
    make, wait, returns_new = runtime(name, args.device)
    shape = (2, args.num_blocks, BLOCK_SIZE, args.num_heads, args.head_size)
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(shape).astype(np.float32) for _ in range(args.layers)]
    # Two cache sets of one manager, the prepared calls' and the one-shot calls' (a JAX load
    # consumes the caches it is given, so the two cannot share them).
    caches = {"prepared": [make(a) for a in host], "oneshot": [make(a) for a in host]}
    manager = KVLayerGroupsManager(
        caches["oneshot"],
        EngineKVFormat.NL_X_TWO_NB_BS_NH_HS,
        lmcache_tokens_per_chunk=CHUNK_TOKENS,
    )
    ids = rng.permutation(args.num_blocks)[: args.chunks * CHUNK_TOKENS // BLOCK_SIZE]
    prepared = prepare(manager, caches["prepared"])
    objects = {"prepared": prepared.store(ids), "oneshot": store(manager, caches["oneshot"], ids)}
    common = {
        "runtime": name,
        "ids": "host",
        "placement": "device",
        "layers": args.layers,
        "chunks": args.chunks,
        "cache_shape": list(shape),
        "device": args.device,
    }

    def sync():
        wait((caches, objects))

    def stores(given: bool):
        def p():
            objects["prepared"] = prepared.store(ids, objects["prepared"] if given else None)

        def o():
            objects["oneshot"] = store(
                manager, caches["oneshot"], ids, objects["oneshot"] if given else None
            )

        return p, o

    def loads():
        def p():
            out = prepared.load(objects["prepared"], ids)
            if returns_new:
                caches["prepared"] = out

        def o():
            out = load(manager, objects["oneshot"], caches["oneshot"], ids)
            if returns_new:
                caches["oneshot"] = out

        return p, o

    for direction, given, fns in (
        ("store", False, stores(False)),
        ("store", True, stores(True)),
        ("load", True, loads()),
    ):
        pair = timed_together(fns, sync, args.calls, args.warmup)
        for call, timing in zip(("prepared", direction), pair):
            emit(
                {
                    "call": call,
                    "direction": direction,
                    "objects": "given" if given else "created",
                    **common,
                    **timing,
                }
            )

    def one_layer():
        objects["prepared"] = prepared.store(ids, objects["prepared"], layers=[0])

    (timing,) = timed_together([one_layer], sync, args.calls, args.warmup)
    emit(
        {
            "call": "layerwise",
            "direction": "store",
            "objects": "given",
            "layers_per_call": 1,
            **common,
            **timing,
        }
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runtimes", default="torch,jax,numpy")
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where torch and JAX keep the caches (NumPy: always the host)",
    )
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--chunks", type=int, default=1)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--num-heads", type=int, default=None, help="default 1 (CPU), 8 (cuda)")
    p.add_argument("--head-size", type=int, default=None, help="default 8 (CPU), 128 (cuda)")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="2 layers, a few calls (CI smoke run)")
    p.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.num_heads = args.num_heads or (8 if cuda else 1)
    args.head_size = args.head_size or (128 if cuda else 8)
    if args.tiny:
        args.layers, args.calls, args.warmup = 2, 3, 1
    emit = JsonLines(args.out)
    for name in args.runtimes.split(","):
        if cuda and name == "numpy":
            continue
        bench_runtime(args, name, emit)
    emit.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
