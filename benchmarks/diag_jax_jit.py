"""Where the time of a jitted JAX transfer goes: traced against constant block ids.

Diagnostic (run by hand on a GPU): a tpu-inference-like 32-layer cache, one jitted function per
variant (load only, store only, load + store), block ids traced (jit arguments) or constant
(NumPy ids baked into the trace), and the traced variants again with the checkify id report
removed. Prints one JSON line per variant (``us`` per call, back-to-back, median of batches)
and writes each variant's optimized HLO to ``--hlo-dir`` (to compare the programs XLA runs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "backends"), str(ROOT / "benchmarks")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_jax_engine import timed  # noqa: E402

from kvgroups_core import KVLayerGroupsManager, detect_format, load, store  # noqa: E402


def timed_us(fn, sync) -> float:
    """Microseconds per back-to-back call: the engine benchmark's timer."""
    return timed(fn, sync, 7, 0.02) * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--pages", type=int, default=2048)
    p.add_argument("--chunks", default="1,16")
    p.add_argument("--hlo-dir", type=Path, default=None)
    a = p.parse_args(argv)
    from kvgroups_jax import executor

    shape = (a.pages, 16, 8, 2, 128)
    caches = [jnp.zeros(shape, jnp.bfloat16) + i for i in range(a.layers)]
    fmt, norm = detect_format(caches, engine="tpu_inference")
    manager = KVLayerGroupsManager(norm, fmt, lmcache_tokens_per_chunk=256)
    rng = np.random.default_rng(0)
    held = {"c": caches}
    real_report = executor.check_block_ids
    for chunks in [int(c) for c in a.chunks.split(",")]:
        sets = [rng.permutation(a.pages)[:chunks * 16].astype(np.int32) for _ in range(8)]
        dev = [jnp.asarray(s) for s in sets]
        objs = store(manager, held["c"], sets[0])
        jax.block_until_ready(objs)

        bodies = {
            "load": lambda c, o, li, si: (load(manager, o, c, li), o),
            "store": lambda c, o, li, si: (c, store(manager, c, si)),
            "step": lambda c, o, li, si: (lambda c2: (c2, store(manager, c2, si)))(
                load(manager, o, c, li)),
        }
        for name, body in bodies.items():
            for ids in ("traced", "const", "traced_noreport"):
                executor.check_block_ids = (lambda i, *x, **k: i) if ids == "traced_noreport" \
                    else real_report
                if ids == "const":
                    li, si = sets[0], sets[1]
                    jitted = jax.jit(lambda c, o, _b=body, _l=li, _s=si: _b(c, o, _l, _s),
                                     donate_argnums=(0,))
                    call = lambda i, _j=jitted, _o=objs: _j(held["c"], _o)  # noqa: E731
                    lowered = jitted.lower(held["c"], objs)
                else:
                    jitted = jax.jit(body, donate_argnums=(0,))
                    call = lambda i, _j=jitted, _o=objs, _d=dev: _j(  # noqa: E731
                        held["c"], _o, _d[i % 8], _d[(i + 3) % 8])
                    lowered = jitted.lower(held["c"], objs, dev[0], dev[1])
                compiled = lowered.compile()
                text = compiled.as_text()
                if a.hlo_dir is not None:
                    a.hlo_dir.mkdir(parents=True, exist_ok=True)
                    (a.hlo_dir / f"{name}_{ids}_{chunks}.hlo.txt").write_text(text)

                def fn(i, _call=call):
                    held["c"], held["o"] = _call(i)

                us = timed_us(fn, lambda: jax.block_until_ready(held["c"]))
                ops = {k: text.count(k) for k in ("custom-call(", " copy(", "copy-start",
                                                   "gather(", "scatter(", "fusion(",
                                                   "while(", "conditional(")}
                print(json.dumps(dict(call="jit", runtime="jax", chunks=chunks, fn=name,
                                      ids="host" if ids == "const" else "device",
                                      variant=ids, us=round(us, 1),
                                      bytes=int(sum(int(o.nbytes) for o in objs)),
                                      hlo_chars=len(text), ops=ops)), flush=True)
    executor.check_block_ids = real_report


if __name__ == "__main__":
    main()
