"""Is a jitted JAX store slower with traced block ids because the id buffer changes address?

Diagnostic (run by hand on a GPU, once per XLA_FLAGS setting): a 32-layer tpu-inference-like
cache, a jitted store without objects, block ids passed as jit arguments (a new array each call,
or the same array every call) or baked in as constants. Prints one JSON line per variant: ``us``
per call back-to-back (median), ``host_us`` (the calls alone, no synchronisation) and
``latency_us`` (one call, synchronised).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "backends")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kvgroups_core import KVLayerGroupsManager, detect_format, store  # noqa: E402


def main() -> None:
    layers, pages = 32, 2048
    caches = [jnp.zeros((pages, 16, 8, 2, 128), jnp.bfloat16) + i for i in range(layers)]
    fmt, norm = detect_format(caches, engine="tpu_inference")
    manager = KVLayerGroupsManager(norm, fmt, lmcache_tokens_per_chunk=256)
    rng = np.random.default_rng(0)
    held = {"c": caches}
    for chunks in (1, 16):
        sets = [rng.permutation(pages)[:chunks * 16].astype(np.int32) for _ in range(8)]
        dev = [jnp.asarray(s) for s in sets]
        def body(c, si):
            return c, store(manager, c, si)

        traced = jax.jit(body, donate_argnums=(0,))
        const = jax.jit(lambda c, _ids=sets[1]: body(c, _ids), donate_argnums=(0,))
        variants = {
            "traced_rotating": lambda i, _t=traced, _d=dev: _t(held["c"], _d[i % 8]),
            "traced_same": lambda i, _t=traced, _d=dev: _t(held["c"], _d[0]),
            "const": lambda i, _c=const: _c(held["c"]),
        }
        for name, call in variants.items():
            def fn(i, _call=call):
                held["c"], held["o"] = _call(i)

            def sync():
                jax.block_until_ready(held["c"])
                jax.block_until_ready(held.get("o"))
            for i in range(5):
                fn(i)
            sync()
            per, host, lat = [], [], []
            for r in range(7):
                t0 = time.perf_counter()
                for i in range(50):
                    fn(i)
                t1 = time.perf_counter()
                sync()
                t2 = time.perf_counter()
                per.append((t2 - t0) / 50 * 1e6)
                host.append((t1 - t0) / 50 * 1e6)
                t0 = time.perf_counter()
                fn(r)
                sync()
                lat.append((time.perf_counter() - t0) * 1e6)
            print(json.dumps(dict(call="jit", runtime="jax", direction="store", chunks=chunks,
                                  ids="host" if name == "const" else "device",
                                  variant=name, us=round(statistics.median(per), 1),
                                  host_us=round(statistics.median(host), 1),
                                  latency_us=round(statistics.median(lat), 1),
                                  xla_flags=os.environ.get("XLA_FLAGS", ""))), flush=True)


if __name__ == "__main__":
    main()
