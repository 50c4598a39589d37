"""JAX small pages (512 B - 4 KiB per block and plane) through the public calls, eager and jitted.

Llama-like caches (32 layers, one ``[2, NB, BS, NH, HS]`` bf16 array per layer, vLLM's NHD),
256-token chunks to random blocks, objects in device memory. Per page size and chunk count:

- ``call="prepared"``: ``prepare(manager, caches).store(ids)`` / ``.load(objects, ids)``, host
  (NumPy) ids, back to back. ``dispatch_ms`` is the host's time per call without waiting;
  ``host_bound`` says it took >= 0.9 of the call: JAX's dispatch of the program (one array per
  layer), not the kernel, sets the rate.
- ``call="jit"``: what an engine's compiled step does: ``--reps`` public ``store`` (objects
  carried, donated) or ``load`` (caches carried, donated) calls unrolled in one ``jax.jit``
  with traced ids, timed per transfer. One program dispatches them all, so the figure is the
  device's; the ceiling is the same number of copies of the same bytes in one program.

``frac_of_ceiling`` = the same run's device copy of the same bytes (a jitted ``x + 1`` over
uint32 words, the copies separated by ``optimization_barrier`` so XLA cannot fuse them) over the
transfer's time; medians over ``--repeats`` batches. Every point is verified first: each
store's objects (jitted and eager) equal the NumPy reference store of the same ids, and each
load of the objects a store of the same ids made leaves the caches as they were.

    python benchmarks/bench_jax_small_pages.py --out jax_small_pages_h200.jsonl

``--tiny`` runs the flow on the CPU in seconds (2 layers; figures mean nothing there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402  (after the allocator setting above)
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from kvgroups_core import (  # noqa: E402
    EngineKVFormat,
    KVLayerGroupsManager,
    load,
    object_nbytes,
    prepare,
    store,
)

F = EngineKVFormat
CHUNK = 256
#: (block_size, heads, head_size) of bf16 pages per page size in bytes.
SHAPES = {512: (16, 1, 16), 1024: (16, 1, 32), 2048: (16, 1, 64), 4096: (16, 2, 64)}


def timed(fn, repeats: int, batch_s: float) -> tuple[float, float]:
    """(median seconds per call, median host seconds per call before the wait) of back-to-back
    ``fn(i)`` calls in batches of about ``batch_s``."""
    jax.block_until_ready(fn(0))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(1))
    calls = max(2, min(500, int(batch_s / max(time.perf_counter() - t0, 1e-6))))
    total, host, i = [], [], 2
    for _ in range(repeats):
        t = time.perf_counter()
        r = None
        for _ in range(calls):
            r = fn(i)
            i += 1
        t_host = time.perf_counter()
        jax.block_until_ready(r)
        t_end = time.perf_counter()
        total.append((t_end - t) / calls)
        host.append((t_host - t) / calls)
    return statistics.median(total), statistics.median(host)


def copy_program(nbytes: int, reps: int):
    """``reps`` copies of ``nbytes`` in one jitted, donated program (unfused)."""

    def copies(x):
        for _ in range(reps):
            x = lax.optimization_barrier(x + 1)
        return x

    return jax.jit(copies, donate_argnums=0), jnp.zeros(nbytes // 4, jnp.uint32)


class Case:
    """One page shape's caches, manager and id sets."""

    def __init__(self, page: int, layers: int, max_chunks: int, seed: int) -> None:
        bs, nh, hs = SHAPES[page]
        self.page, self.layers, self.bpc = page, layers, CHUNK // bs
        self.num_blocks = 2 * max_chunks * self.bpc
        key = jax.random.PRNGKey(seed)
        shape = (2, self.num_blocks, bs, nh, hs)
        self.caches = [
            jax.random.bits(jax.random.fold_in(key, layer), shape, jnp.uint16).view(jnp.bfloat16)
            for layer in range(layers)
        ]
        self.manager = KVLayerGroupsManager(
            self.caches, [F.NL_X_TWO_NB_BS_NH_HS] * layers, lmcache_tokens_per_chunk=CHUNK
        )
        self.rng = np.random.default_rng(seed)

    def ids(self, chunks: int, count: int) -> np.ndarray:
        return np.stack(
            [self.rng.permutation(self.num_blocks)[: chunks * self.bpc] for _ in range(count)]
        ).astype(np.int32)


def reference_store(case: Case, caches, ids: np.ndarray) -> np.ndarray:
    """The NumPy path's objects of a store of ``ids`` from ``caches`` (the oracle)."""
    host = [np.asarray(c) for c in caches]
    return np.asarray(prepare(case.manager, host).store(ids)[0])


def run_point(case: Case, chunks: int, args, emit) -> bool:
    nobj = object_nbytes(case.manager, 0)
    nbytes = chunks * nobj
    base = dict(
        runtime="jax",
        path="default",
        placement="device",
        chunks=chunks,
        page_bytes=case.page,
        layers=case.layers,
        bytes=nbytes,
    )
    ids = case.ids(chunks, args.reps)
    dev_ids = jnp.asarray(ids)
    manager = case.manager

    # --- verification and the jitted programs ----------------------------------------------
    want = reference_store(case, case.caches, ids[-1])

    def stores(caches, objects, id_stack):
        for r in range(args.reps):
            objects = store(manager, caches, id_stack[r], objects)
        return objects

    def loads(caches, objects, id_stack):
        for r in range(args.reps):
            caches = load(manager, objects, caches, id_stack[r])
        return caches

    jit_store = jax.jit(stores, donate_argnums=1)
    jit_load = jax.jit(loads, donate_argnums=0)
    objects = store(manager, case.caches, ids[0])
    t0 = time.perf_counter()
    objects = jit_store(case.caches, objects, dev_ids)
    got = np.asarray(objects[0])
    compile_s = time.perf_counter() - t0
    ok_store = bool(np.array_equal(got, want))
    # Loads of the objects a store of the last ids made, into those ids: the caches must not
    # change (every load writes back what was there); any stray write would show.
    same = [jnp.asarray(np.stack([ids[-1]] * args.reps))]
    before = [np.asarray(c).view(np.uint16) for c in case.caches]  # bits: NaN payloads
    case.caches = jit_load(case.caches, objects, same[0])
    ok_load = all(
        np.array_equal(np.asarray(c).view(np.uint16), b) for c, b in zip(case.caches, before)
    )
    del before
    if not (ok_store and ok_load):
        emit(
            record="error",
            **base,
            call="jit",
            verified=False,
            error=f"store matches the reference: {ok_store}; load round trip: {ok_load}",
        )
        return False

    # --- ceiling: the same bytes copied reps times in one program, and once eagerly -----------
    copies, buf = copy_program(nbytes, args.reps)
    state = [buf]

    def copy_fn(i):
        state[0] = copies(state[0])
        return state[0]

    copy_s, _ = timed(copy_fn, args.repeats, args.batch_s)
    copy_one = copy_s / args.reps
    emit(
        record="ceiling",
        **base,
        what=f"jit {args.reps} x (x + 1) on uint32, unfused",
        median_s=copy_one,
        gbps=2 * nbytes / copy_one / 1e9,
    )

    # --- jit: reps public calls in one compiled program ------------------------------------
    held = {"objects": objects}

    def store_fn(i):
        held["objects"] = jit_store(case.caches, held["objects"], dev_ids)
        return held["objects"]

    def load_fn(i):
        case.caches = jit_load(case.caches, held["objects"], same[0])
        return case.caches

    for direction, fn in (("store", store_fn), ("load", load_fn)):
        total, host = timed(fn, args.repeats, args.batch_s)
        per = total / args.reps
        emit(
            record="transfer",
            **base,
            call="jit",
            ids="device",
            direction=direction,
            reps=args.reps,
            median_s=per,
            gbps=2 * nbytes / per / 1e9,
            frac_of_ceiling=copy_one / per,
            ceiling_s=copy_one,
            dispatch_s=host / args.reps,
            host_bound=host >= 0.9 * total,
            first_call_s=compile_s,
            verified=True,
        )

    # --- prepared eager calls, host ids ----------------------------------------------------
    prep = prepare(manager, case.caches)
    eager_objs = [prep.store(ids[r]) for r in range(min(3, args.reps))]
    verified = {"store": bool(np.array_equal(np.asarray(prep.store(ids[-1])[0]), want))}
    # The eager load, as the jitted one: loading what a store of the same ids read must leave
    # every cache bit as it was.
    bits = [np.asarray(c).view(np.uint16) for c in prep.kv_caches]
    prep.load(eager_objs[0], ids[0])
    verified["load"] = all(
        np.array_equal(np.asarray(c).view(np.uint16), b) for c, b in zip(prep.kv_caches, bits)
    )
    del bits
    calls = {
        "store": lambda i: prep.store(ids[i % args.reps]),
        "load": lambda i: prep.load(eager_objs[i % len(eager_objs)], ids[i % len(eager_objs)]),
    }
    for direction, fn in calls.items():
        total, host = timed(fn, args.repeats, args.batch_s)
        emit(
            record="transfer",
            **base,
            call="prepared",
            ids="host",
            direction=direction,
            median_s=total,
            gbps=2 * nbytes / total / 1e9,
            frac_of_ceiling=copy_one / total,
            ceiling_s=copy_one,
            dispatch_s=host,
            host_bound=host >= 0.9 * total,
            verified=verified[direction],
        )
    case.caches = list(prep.kv_caches)
    return all(verified.values())


def main(argv=None) -> int:
    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x]

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    p.add_argument("--pages", type=ints, default=[512, 1024, 2048, 4096])
    p.add_argument("--chunks", type=ints, default=[64, 256])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--reps", type=int, default=8, help="public calls per jitted program")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--batch-s", type=float, default=0.02)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run (2 layers, tiny sizes)")
    args = p.parse_args(argv)
    if args.tiny:
        args.pages, args.chunks, args.layers = [512], [1, 2], 2
        args.reps, args.repeats, args.batch_s = 2, 2, 0.001
    unknown = sorted(set(args.pages) - set(SHAPES))
    if unknown:
        p.error(f"--pages: expected sizes from {sorted(SHAPES)}, got {unknown}")
    out = args.out.open("a") if args.out else None
    ok = True

    def emit(**record):
        record.update(device=str(jax.devices()[0].device_kind), jax=jax.__version__)
        line = json.dumps(record)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    for page in args.pages:
        case = Case(page, args.layers, max(args.chunks), seed=page)
        for chunks in args.chunks:
            ok = run_point(case, chunks, args, emit) and ok
        del case
        jax.clear_caches()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
