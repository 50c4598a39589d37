"""Where a jitted engine step with transfers spends its time: a JAX profiler trace, summarised.

Diagnostic (by hand, on a GPU): the engine-like step of ``bench_jax_engine.py`` (load a
request's chunks, its small computation and weight stream (``bench_jax_engine.step_compute``),
store them; traced ids) and the same step without the
transfers, ``--steps`` calls each under ``jax.profiler.trace``; prints per variant the device
events (kernels: count, total and mean microseconds) and the busiest host events, as JSON lines.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import bench_jax_engine as bje  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kvgroups_core import load, store  # noqa: E402


def summarise(trace_dir: str, top: int) -> dict:
    files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    data = jax.profiler.ProfileData.from_file(files[0])
    out = {}
    for plane in data.planes:
        totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        for line in plane.lines:
            for ev in line.events:
                t = totals[ev.name[:90]]
                t[0] += 1
                t[1] += ev.duration_ns / 1e3
        best = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
        if best:
            out[plane.name] = [(name, n, round(us, 1)) for name, (n, us) in best]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--weights-mib", type=int, default=0, help="the step's weight stream")
    p.add_argument("--compute", choices=("flat", "inplace"), default="flat",
                   help="bench_jax_engine.step_compute's mode")
    a = p.parse_args(argv)
    args = bje.parse_args(["--tiny"] if a.tiny else [])
    bench = bje.Bench(args)
    manager = bench.manager
    sets = bench.ids(a.chunks)
    dev = [jnp.asarray(s) for s in sets]
    objs = store(manager, bench.caches, sets[0])
    weights = bje.weights_for(a.weights_mib)

    def compute(caches):
        return bje.step_compute(caches, weights, layout=args.layout, mode=a.compute,
                                plane_elems=args.page_size * args.heads * args.head_dim)

    def with_transfer(caches, objs, li, si):
        caches = compute(load(manager, objs, caches, li))
        return caches, store(manager, caches, si)

    def without(caches, objs, li, si):
        return compute(caches), []

    held = {"c": bench.caches}
    for name, fn in (("with_transfer", with_transfer), ("without", without)):
        step = jax.jit(fn, donate_argnums=(0,))
        for i in range(3):
            held["c"], _ = step(held["c"], objs, dev[i % 8], dev[(i + 3) % 8])
        jax.block_until_ready(held["c"])
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                for i in range(a.steps):
                    held["c"], o = step(held["c"], objs, dev[i % 8], dev[(i + 3) % 8])
                jax.block_until_ready((held["c"], o))
            print(json.dumps({"call": "jit", "runtime": "jax", "path": "step", "ids": "device",
                              "probe": "profile", "variant": name, "chunks": a.chunks,
                              "steps": a.steps,
                              "weights_mib": a.weights_mib, "compute": a.compute,
                              "planes": summarise(d, a.top)}), flush=True)


if __name__ == "__main__":
    main()
