"""JAX transfers as a JAX serving engine makes them, through the public calls only.

A tpu-inference-like cache (one ``[num_pages, page_size, 2*heads // 2, 2, head_dim]`` bf16 array
per layer, K/V interleaved; ``--layout vllm_nhd`` for vLLM's ``[2, NB, BS, NH, HS]``) and, per
chunk count (default 1, 4, 16, 64):

- ``call="jit"``: an engine-like jitted step with the caches donated: ``load`` a request's
  chunks, a small computation over the cache (:func:`step_compute`: one page-plane per layer
  read, one written; with ``--weights-mib``, a read of that many MiB, as a decode step streams
  its weights, so the step is device-bound), ``store`` the request's chunks without objects;
  block ids are ``device`` (traced int32 arrays, new ids every call: no retrace) or ``host``
  (NumPy ids baked into the trace). Its transfer time is the median, over ``--repeats`` pairs
  of batches timed back to back (``timing: "paired"``), of the step's time minus the same step
  without the transfer: pairing cancels the machine's drift between the two.
- ``call="store"``: eager ``store(manager, caches, ids)`` without objects (``path="default"``:
  the store creates them) and with donated objects passed in (``path="donated"``);
  ``call="prepared"``: the same through ``prepare(manager, caches).store``.

Every record: ``gbps`` = bytes read + written per second of the transfer, ``frac_of_ceiling``
= the same run's device copy of the same bytes (a jitted, donated ``x + 1`` over uint32 words,
warmed) over the transfer's time; jit records add ``frac_of_per_call_ceiling``, the same over
two copies of one call's bytes in one program (the step's load and store are two kernels,
where the one-copy ceiling is one); medians over ``--repeats`` batches. On a GPU, jit records
also carry device time from a profiler trace (:func:`device_kernels`): the transfer's own
kernels (``transfer_kernels_device_s``, ``frac_of_ceiling_device`` against the copy's kernel),
and every kernel of the step with and without the transfer (``frac_of_ceiling_step_device``:
the copy over the step's device time growth; ``device_growth_us``: where it grew), free of the
host's dispatch time. JSON lines on stdout and appended to ``--out``. ``--tiny`` runs a
few-KiB model on the CPU in seconds (CI).

    python benchmarks/bench_jax_engine.py --out jax_engine_h200.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import device_kernels

from kvgroups_core import KVLayerGroupsManager, detect_format, load, prepare, store

FULL = dict(
    layers=32, pages=2048, page_size=16, heads=8, head_dim=128, tokens=256, chunks="1,4,16,64"
)
TINY = dict(layers=2, pages=16, page_size=4, heads=2, head_dim=8, tokens=8, chunks="1,2")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a few-KiB model (CPU, CI)")
    for key, value in FULL.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None)
    p.add_argument(
        "--layout",
        choices=("tpu_inference", "vllm_nhd"),
        default="tpu_inference",
        help="tpu-inference packed pages (K/V interleaved on heads) or vLLM's "
        "[2, NB, BS, NH, HS] per layer (contiguous K and V pages)",
    )
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--target-ms", type=float, default=25.0, help="time per timed batch")
    p.add_argument("--calls", default="jit,store,prepared")
    p.add_argument(
        "--weights-mib",
        type=int,
        default=0,
        help="the jitted step also reads this many MiB (a decode step's weight "
        "stream), so both steps are device-bound; 0: the small step alone",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    base = TINY if args.tiny else FULL
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.chunks = [int(c) for c in str(args.chunks).split(",")]
    args.calls = args.calls.split(",")
    return args


def make_caches(args, seed):
    if args.layout == "tpu_inference":
        shape = (args.pages, args.page_size, args.heads, 2, args.head_dim)
    else:
        shape = (2, args.pages, args.page_size, args.heads, args.head_dim)
    make = jax.jit(
        lambda k: jax.lax.bitcast_convert_type(jax.random.bits(k, shape, jnp.uint16), jnp.bfloat16)
    )
    return [make(jax.random.PRNGKey(seed * 1000 + i)) for i in range(args.layers)]


def timed(fn, sync, repeats, target_s):
    """Median wall time per call of back-to-back ``fn(i)`` calls (batches sized to target_s)."""
    i = 0
    for _ in range(2):  # warm-up: compilation and first-touch
        fn(i)
        i += 1
    sync()
    t0 = time.perf_counter()
    fn(i)
    i += 1
    sync()
    calls = max(1, min(1000, int(target_s / max(time.perf_counter() - t0, 1e-6))))
    secs = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(i)
            i += 1
        sync()
        secs.append((time.perf_counter() - t0) / calls)
    return statistics.median(secs)


def paired(fn_a, fn_b, sync, repeats, target_s):
    """Medians of back-to-back ``fn_a(i)`` and ``fn_b(i)`` calls timed in alternating batches,
    and the median of the pairs' differences (a - b): drift between the two cancels."""

    def batch_size(fn):
        for i in range(2):  # warm-up: compilation and first-touch
            fn(i)
        sync()
        t0 = time.perf_counter()
        fn(2)
        sync()
        return max(1, min(1000, int(target_s / max(time.perf_counter() - t0, 1e-6))))

    calls = batch_size(fn_a)
    batch_size(fn_b)

    def batch(fn):
        sync()
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        sync()
        return (time.perf_counter() - t0) / calls

    pairs = [(batch(fn_a), batch(fn_b)) for _ in range(repeats)]
    return (
        statistics.median(a for a, _ in pairs),
        statistics.median(b for _, b in pairs),
        statistics.median(a - b for a, b in pairs),
    )


def copy_program(nbytes, copies=1):
    """``(fn, sync)``: ``fn(i)`` runs ``copies`` device copies of ``nbytes`` each (read + write
    each byte) in one donated program; ``optimization_barrier`` keeps XLA from fusing them."""
    words = max(1, nbytes // 4)
    held = [jnp.zeros((words,), jnp.uint32)]

    def copy(x):
        if copies == 1:
            return x + 1  # the program every committed one-copy ceiling was measured with
        for _ in range(copies):
            x = jax.lax.optimization_barrier(x + 1)
        return x

    step = jax.jit(copy, donate_argnums=0)

    def fn(i):
        held[0] = step(held[0])

    return fn, lambda: jax.block_until_ready(held[0])


def copy_ceiling(nbytes, repeats, target_s, copies=1):
    """Seconds of :func:`copy_program` (wall time of back-to-back calls, warmed)."""
    return timed(*copy_program(nbytes, copies), repeats, target_s)


def step_compute(caches, weights, *, plane_elems):
    """The engine-like step's own work: one page-plane (``plane_elems`` elements) of every
    layer read and one written, through flat views of the layers (the same work for either
    layout), plus with ``weights`` a read of that stand-in for the step's weight stream. XLA
    rewrites all of layer 0 every step, in the step and in its baseline alike, so the
    subtraction cancels it."""
    n = plane_elems
    total = sum(c.reshape(-1)[:n].astype(jnp.float32).sum() for c in caches)
    if weights is not None:
        total = total + jnp.sum(weights, dtype=jnp.uint32).astype(jnp.float32) * 0.0
    flat = caches[0].reshape(-1)
    flat = flat.at[n : 2 * n].set((flat[n : 2 * n] + total).astype(flat.dtype))
    return [flat.reshape(caches[0].shape)] + list(caches[1:])


def weights_for(mib):
    """The weight stream's stand-in (``mib`` MiB of uint32), or None."""
    return jnp.ones(mib << 18, jnp.uint32) if mib else None


class Bench:
    def __init__(self, args):
        self.args = args
        self.caches = make_caches(args, 0)
        engine = "tpu_inference" if args.layout == "tpu_inference" else "vllm"
        fmt, normalized = detect_format(self.caches, engine=engine)
        self.manager = KVLayerGroupsManager(normalized, fmt, lmcache_tokens_per_chunk=args.tokens)
        self.bpc = args.tokens // args.page_size
        self.page_bytes = args.page_size * args.heads * 2 * args.head_dim * 2
        self.rng = np.random.default_rng(0)
        self.out = []

    def ids(self, chunks, count=8):
        return [
            self.rng.permutation(self.args.pages)[: chunks * self.bpc].astype(np.int32)
            for _ in range(count)
        ]

    def sync(self, *trees):
        jax.block_until_ready([self.caches, *trees])

    def emit(self, **record):
        record.update(
            runtime="jax",
            placement="device",
            page_bytes=self.page_bytes,
            layout=self.args.layout,
            backend=jax.default_backend(),
            jax=jax.__version__,
        )
        print(json.dumps(record), flush=True)
        self.out.append(record)

    def record(self, call, ids, path, direction, chunks, seconds, nbytes, ceiling_s, extra=None):
        self.emit(
            call=call,
            ids=ids,
            path=path,
            direction=direction,
            chunks=chunks,
            median_s=seconds,
            bytes=nbytes,
            gbps=2 * nbytes / seconds / 1e9,
            ceiling_gbps=2 * nbytes / ceiling_s / 1e9,
            frac_of_ceiling=ceiling_s / seconds,
            **(extra or {}),
        )

    # --- jitted engine-like step -------------------------------------------------------------
    def run_jit(self, chunks, ids_kind):
        a = self.args
        manager = self.manager
        objs = store(manager, self.caches, self.ids(chunks, 1)[0])
        nbytes_one = sum(int(o.nbytes) for o in objs)
        sets = self.ids(chunks)
        traces = {"n": 0}

        compute = functools.partial(step_compute, plane_elems=a.page_size * a.heads * a.head_dim)

        def with_transfer(caches, objs, load_ids, store_ids, weights):
            traces["n"] += 1
            caches = load(manager, objs, caches, load_ids)
            caches = compute(caches, weights)
            return caches, store(manager, caches, store_ids)

        def without(caches, objs, load_ids, store_ids, weights):
            return compute(caches, weights), []

        weights = weights_for(a.weights_mib)

        def runner(step_fn):
            if ids_kind == "device":
                jitted = jax.jit(step_fn, donate_argnums=(0,))
                dev = [
                    (jnp.asarray(s), jnp.asarray(sets[(k + 3) % len(sets)]))
                    for k, s in enumerate(sets)
                ]

                def fn(i):
                    li, si = dev[i % len(dev)]
                    self.caches, self._objs = jitted(self.caches, objs, li, si, weights)
            else:  # NumPy ids are constants of the trace: one id set, one compilation
                li, si = sets[0], sets[1]
                jitted = jax.jit(lambda c, o, w: step_fn(c, o, li, si, w), donate_argnums=(0,))

                def fn(i):
                    self.caches, self._objs = jitted(self.caches, objs, weights)

            return fn

        self._objs = []
        sync = lambda: self.sync(self._objs)  # noqa: E731
        t_step, t_base, transfer = paired(
            runner(with_transfer), runner(without), sync, a.repeats, a.target_ms / 1e3
        )
        moved = 2 * nbytes_one  # load + store
        transfer = max(transfer, 1e-9)
        ceiling = copy_ceiling(moved, a.repeats, a.target_ms / 1e3)
        # The transfer is two programs' worth of kernels (a load, a store) of nbytes_one each:
        # beside the one-copy ceiling, two copies of nbytes_one in one program.
        per_call = copy_ceiling(nbytes_one, a.repeats, a.target_ms / 1e3, copies=2)
        extra = {
            "step_s": t_step,
            "step_without_transfer_s": t_base,
            "traces": traces["n"],
            "weights_mib": a.weights_mib,
            "timing": "paired",
            "per_call_ceiling_s": per_call,
            "frac_of_per_call_ceiling": per_call / transfer,
        }
        if jax.default_backend() == "gpu":
            extra.update(
                self.device_time(runner(with_transfer), runner(without), sync, moved, nbytes_one)
            )
        self.record("jit", ids_kind, "step", "load+store", chunks, transfer, moved, ceiling, extra)

    def device_time(self, with_transfer, without, sync, moved, nbytes_one):
        """The step's kernels' device time (profiler): the transfer's own kernels
        (``kvgroups_*``), every kernel of the step with and without the transfer, and the
        copies the wall-time figures compare with, in seconds per call."""
        steps = {
            name: device_kernels(fn, sync)
            for name, fn in (("with", with_transfer), ("without", without))
        }
        ceiling = sum(device_kernels(*copy_program(moved)).values())
        per_call = sum(device_kernels(*copy_program(nbytes_one, copies=2)).values())
        kernels = sum(t for k, t in steps["with"].items() if "kvgroups" in k)
        step, base = (sum(steps[k].values()) for k in ("with", "without"))
        growth = {
            k: steps["with"].get(k, 0.0) - steps["without"].get(k, 0.0)
            for k in set(steps["with"]) | set(steps["without"])
        }
        biggest = sorted(growth, key=lambda k: -abs(growth[k]))[:8]
        return {
            "transfer_kernels_device_s": kernels,
            "step_device_s": step,
            "step_without_transfer_device_s": base,
            "ceiling_device_s": ceiling,
            "per_call_ceiling_device_s": per_call,
            # the transfer's kernels against one copy of the moved bytes, and the step's
            # device time growth (kernels plus what they cost the step's other work)
            "frac_of_ceiling_device": ceiling / max(kernels, 1e-12),
            "frac_of_ceiling_step_device": ceiling / max(step - base, 1e-12),
            # the kernels whose time changed most with the transfer (microseconds)
            "device_growth_us": {k[:60]: round(growth[k] * 1e6, 2) for k in biggest},
        }

    # --- eager stores ------------------------------------------------------------------------
    def run_store(self, chunks, call):
        a = self.args
        sets = self.ids(chunks)
        prepared = prepare(self.manager, self.caches) if call == "prepared" else None
        do_store = (
            prepared.store
            if prepared
            else (lambda ids, objects=None: store(self.manager, self.caches, ids, objects))
        )
        objs = do_store(sets[0])
        nbytes = sum(int(o.nbytes) for o in objs)
        ceiling = copy_ceiling(nbytes, a.repeats, a.target_ms / 1e3)
        held = [objs]

        def default(i):
            held[0] = do_store(sets[i % len(sets)])

        def donated(i):
            held[0] = do_store(sets[i % len(sets)], held[0])

        for path, fn in (("default", default), ("donated", donated)):
            t = timed(fn, lambda: self.sync(held[0]), a.repeats, a.target_ms / 1e3)
            self.record(call, "host", path, "store", chunks, t, nbytes, ceiling)


def main(argv=None):
    args = parse_args(argv)
    bench = Bench(args)
    bench.emit(
        call="meta",
        layers=args.layers,
        pages=args.pages,
        page_size=args.page_size,
        heads=args.heads,
        head_dim=args.head_dim,
        tokens_per_chunk=args.tokens,
        device=str(jax.devices()[0]),
    )
    for chunks in args.chunks:
        if "jit" in args.calls:
            for kind in ("device", "host"):
                bench.run_jit(chunks, kind)
        for call in ("store", "prepared"):
            if call in args.calls:
                bench.run_store(chunks, call)
    if args.out is not None:
        with open(args.out, "a") as f:
            for r in bench.out:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
