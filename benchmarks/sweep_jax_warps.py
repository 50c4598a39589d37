"""Triton warps per program for the JAX page copy, Llama-3-8B-like shape (32 layers, 8 KV heads
x 128, block 16, bf16, NHD), 64 chunks of 256 tokens, random blocks: median GB/s (bytes read +
written) of store and load per ``num_warps``, beside a plain JAX copy of the same bytes.

    python3 benchmarks/sweep_jax_warps.py --out FILE.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "backends")]

from kvgroups_jax.executor import execute_plan  # noqa: E402

from kvgroups_core.catalog import MODELS  # noqa: E402
from kvgroups_core.manager import KVLayerGroupsManager  # noqa: E402
from kvgroups_core.planner import bind, plan_call  # noqa: E402


def median_s(fn, iters: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--warps", default="2,4,8")
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--num-blocks", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="-")
    args = parser.parse_args()
    model = MODELS["llama3-8b"].build(num_blocks=args.num_blocks)
    key = jax.random.PRNGKey(0)
    caches = [jax.lax.bitcast_convert_type(
        jax.random.bits(jax.random.fold_in(key, i), s.shape, jnp.uint16), jnp.bfloat16)
        for i, s in enumerate(model.kv_caches)]
    manager = KVLayerGroupsManager(caches, list(model.formats))
    binding = bind(manager, caches)
    rng = np.random.default_rng(0)
    ids = rng.permutation(args.num_blocks)[: args.chunks * 16]
    store_plan = plan_call(binding, ids, "store")
    load_plan = plan_call(binding, ids, "load")
    nbytes = store_plan.num_chunks * store_plan.object_nbytes[0]
    objs = [jnp.zeros((store_plan.num_chunks, store_plan.object_nbytes[0]), jnp.uint8)]
    out = sys.stdout if args.out == "-" else open(args.out, "w")
    big = jnp.zeros((nbytes,), jnp.uint8)
    copy_s = median_s(lambda: jnp.copy(big), args.iters)
    out.write(json.dumps({"record": "ceiling", "what": "jnp.copy", "bytes": nbytes,
                          "gbps": 2 * nbytes / copy_s / 1e9}) + "\n")
    state = {"caches": caches, "objs": objs}
    for w in [int(v) for v in args.warps.split(",")]:
        def store(w=w):
            _, new_objs = execute_plan(store_plan, state["caches"], state["objs"],
                                       lowering="triton", num_warps=w)
            state["objs"] = list(new_objs)
            return state["objs"]

        def load(w=w):
            new_caches, _ = execute_plan(load_plan, state["caches"], state["objs"],
                                         lowering="triton", num_warps=w)
            state["caches"] = list(new_caches) if new_caches is not None else state["caches"]
            return state["caches"]

        for direction, fn in (("store", store), ("load", load)):
            try:
                s = median_s(fn, args.iters)
                rec = {"record": "sweep", "num_warps": w, "direction": direction, "bytes": nbytes,
                       "median_s": s, "gbps": 2 * nbytes / s / 1e9}
            except Exception as exc:  # noqa: BLE001 - one failing setting must not end the sweep
                rec = {"record": "error", "num_warps": w, "direction": direction,
                       "error": f"{type(exc).__name__}: {exc}"[:400]}
            out.write(json.dumps(rec) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
