"""How fast JAX copies N bytes on this GPU: a jitted ``x + 1`` on uint32 (the JAX bench kit's
``device_copy`` ceiling) against ``jnp.copy`` (XLA's plain copy), 256 MiB to 8 GiB.

    python3 benchmarks/probe_jax_copy.py [OUT.jsonl]

One JSON line per (size, op): the median of 7 batches of 10 back-to-back calls (two input
buffers alternating), and GB/s counting bytes read + written.
"""
import json
import sys
import time

import jax
import jax.numpy as jnp

out = open(sys.argv[1], "w") if len(sys.argv) > 1 else sys.stdout
plus = jax.jit(lambda x: x + 1)
copy = jax.jit(lambda x: jnp.copy(x))
for mib in (256, 1024, 1984, 2048, 4096, 8192):
    n = mib << 20
    xs = [jnp.full((n // 4096, 1024), i, jnp.uint32) for i in range(2)]
    for name, fn in (("x_plus_1", plus), ("jnp_copy", copy)):
        y = fn(xs[0])
        y.block_until_ready()
        secs = []
        for _ in range(7):
            t0 = time.perf_counter()
            for k in range(10):
                y = fn(xs[k % 2])
            y.block_until_ready()
            secs.append((time.perf_counter() - t0) / 10)
        secs.sort()
        rec = {"mib": mib, "op": name, "median_s": secs[3], "gbps_rw": 2 * n / secs[3] / 1e9}
        print(json.dumps(rec), file=out, flush=True)
    del xs, y
