"""Shape knobs of the JAX Pallas (Triton) page copy on one GPU: which kernel shape is fastest.

For each catalogue shape (default: Llama-3-8B-like, 32 layers, 8 KV heads x 128, block 16,
bf16, NHD, and the small-page shape, 1 KV head x 64) and 64 chunks of 256 tokens on random
blocks, every variant (box size, warps, ``pallas_copy.TUNING`` knobs) runs store and load
through its own jitted program (donated, in place, as the executor does). Timing: batches of
back-to-back calls with ``block_until_ready`` after each batch, median over batches, so the
host's dispatch hides behind the device work. Beside them, the same run's device copy of the
same byte count (a jitted ``x ^ 1``: one read and one write of every byte). Every variant's
store output is checked against the first variant's bytes. Records say ``call: "internal"``:
the programs are built from the executor's parts, below the public calls.

    python3 benchmarks/sweep_jax_kernel.py --out FILE.jsonl
"""

from __future__ import annotations

import argparse
import itertools
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

from kvgroups_jax.geometry import bucket, group_geometry  # noqa: E402
from kvgroups_jax.lowerings import mosaic as pallas_mosaic  # noqa: E402
from kvgroups_jax.lowerings import triton as pallas_copy  # noqa: E402
from kvgroups_jax.views import flat_view, object_unview, object_view, unflat_view  # noqa: E402

from kvgroups_core.grouping.manager import KVLayerGroupsManager  # noqa: E402
from kvgroups_core.transfer.planner import bind, plan_call  # noqa: E402
from kvgroups_tools.catalog import MODELS  # noqa: E402


def batch_seconds(step, sync, batches: int, calls: int) -> list[float]:
    """Per-call seconds of ``batches`` batches of ``calls`` back-to-back ``step()`` calls."""
    step()
    sync()
    out = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        sync()
        out.append((time.perf_counter() - t0) / calls)
    return out


def variants(spec: str) -> list[dict]:
    """``box=4096,8192;warps=4,8|per_program=2``: the union over ``|`` of the products of each
    part's ``;``-separated axes (box, warps, read_first, per_program, items_major,
    chunk_order); axes a part
    does not name keep the defaults."""
    out: list[dict] = []
    for product in spec.split("|"):
        axes = {"box": [4096], "warps": [4], "read_first": [1], "per_program": [1],
                "items_major": [1], "chunk_order": [1]}
        for part in filter(None, product.split(";")):
            name, _, values = part.partition("=")
            axes[name.strip()] = [int(v) for v in values.split(",")]
        for combo in itertools.product(*axes.values()):
            v = dict(zip(axes, combo))
            if v not in out:
                out.append(v)
    return out


def programs(geom, unit: int, grid_items: int, slots, warps: int, interpret: bool,
             lowering: str):
    copy = pallas_mosaic.copy_group if lowering == "mosaic" else pallas_copy.copy_group

    def store(caches, obj, meta, ids):
        views = tuple(flat_view(caches[s], unit) for s in slots)
        out = copy("store", geom, grid_items, meta, ids, object_view(obj, unit), views,
                   num_warps=warps, interpret=interpret)
        return object_unview(out, unit)

    def load(caches, obj, meta, ids):
        views = tuple(flat_view(caches[s], unit) for s in slots)
        out = copy("load", geom, grid_items, meta, ids, object_view(obj, unit), views,
                   num_warps=warps, interpret=interpret)
        return tuple(unflat_view(v, caches[s].shape, caches[s].dtype, unit)
                     for s, v in zip(slots, out))

    return jax.jit(store, donate_argnums=(1,)), jax.jit(load, donate_argnums=(0,))


def measure_variant(state, store_j, load_j, meta, ids, args, rec, moved, copy_s):
    """Time store and load of one variant into ``rec``; returns the first store's bytes."""
    def do_store():
        state["obj"] = store_j(state["caches"], state["obj"], meta, ids)

    def do_load():
        state["caches"] = load_j(state["caches"], state["obj"], meta, ids)

    t0 = time.perf_counter()
    do_store()
    jax.block_until_ready(state["obj"])
    rec["first_call_s"] = time.perf_counter() - t0
    got = np.asarray(state["obj"])
    for direction, step, out in (("store", do_store, "obj"), ("load", do_load, "caches")):
        s = statistics.median(batch_seconds(
            step, lambda o=out: jax.block_until_ready(state[o]), args.batches, args.calls))
        rec[f"{direction}_gbps"] = 2 * moved / s / 1e9
        rec[f"{direction}_of_copy"] = copy_s / s
    return got


def run_shape(name: str, args, emit) -> None:
    model = MODELS[name].build(num_blocks=args.num_blocks, layers=args.layers)
    key = jax.random.PRNGKey(0)
    caches = [jax.lax.bitcast_convert_type(
        jax.random.bits(jax.random.fold_in(key, i), s.shape, jnp.uint16), jnp.bfloat16)
        for i, s in enumerate(model.kv_caches)]
    manager = KVLayerGroupsManager(caches, list(model.formats), lmcache_tokens_per_chunk=256)
    binding = bind(manager, caches)
    bpc = manager.calculate_num_blocks(0, 256)
    ids = np.random.default_rng(0).permutation(args.num_blocks)[: args.chunks * bpc]
    plans = {d: plan_call(binding, ids, d) for d in ("store", "load")}
    group = plans["store"].groups[0]
    nbytes = plans["store"].object_nbytes[0]
    moved = args.chunks * nbytes
    common = {"shape": name, "layers": args.layers, "chunks": args.chunks, "bytes": moved,
              "page_bytes": group.block_size * group.row_bytes}

    flat = jnp.zeros((moved // 4,), jnp.uint32)
    flip = jax.jit(lambda x: x ^ jnp.uint32(1))
    held = [flat]

    def copy_step():
        held[0] = flip(held[0])

    secs = batch_seconds(copy_step, lambda: jax.block_until_ready(held[0]), args.batches,
                         args.calls)
    copy_s = statistics.median(secs)
    emit({**common, "record": "ceiling", "what": "device_copy (jit x ^ 1)",
          "median_s": copy_s, "gbps": 2 * moved / copy_s / 1e9})
    held.clear()

    meta = jnp.array([0, group.num_items], jnp.int32)
    pad = np.zeros(bucket(len(group.block_ids)), np.int32)
    pad[: len(group.block_ids)] = np.asarray(group.block_ids)
    dev_ids = jnp.asarray(pad)
    slots = None
    reference = None
    for v in variants(args.variants):
        pallas_copy.TUNING.update(read_first=bool(v["read_first"]),
                                  planes_per_program=v["per_program"],
                                  items_major=bool(v["items_major"]),
                                  chunk_order=bool(v["chunk_order"]))
        pallas_mosaic.CHUNK_ORDER = bool(v["chunk_order"])
        jax.clear_caches()
        rec = {**common, "record": "variant", "lowering": args.lowering, **v,
               "path": f"pallas-{args.lowering}", "ids": "device", "placement": "device"}
        try:
            geom = group_geometry(group, plans["store"].tensor_specs, nbytes,
                                  max_elems=v["box"])
            slots = geom.operand_slots
            store_j, load_j = programs(geom, geom.unit, bucket(group.num_items), slots,
                                       v["warps"], args.interpret, args.lowering)
            state = {"caches": tuple(caches),
                     "obj": jnp.zeros((args.chunks, nbytes), jnp.uint8)}
            got = measure_variant(state, store_j, load_j, meta, dev_ids, args, rec,
                                  moved, copy_s)
            if reference is None:
                reference = got
            rec["store_matches_first_variant"] = bool(np.array_equal(got, reference))
            caches = list(state["caches"])
        except Exception as exc:  # noqa: BLE001 - one failing variant must not end the sweep
            rec["error"] = f"{type(exc).__name__}: {exc}"[:600]
        emit(rec)
    pallas_copy.TUNING.update(TUNING_DEFAULTS)
    pallas_mosaic.CHUNK_ORDER = True
    jax.clear_caches()


TUNING_DEFAULTS = dict(pallas_copy.TUNING)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="llama3-8b,small-pages")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--batches", type=int, default=7)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--variants", default="box=2048,4096,8192;warps=4,8;read_first=0,1",
                   help="';'-separated axes: box, warps, read_first, per_program, items_major, "
                        "chunk_order")
    p.add_argument("--lowering", default="triton", choices=("triton", "mosaic"),
                   help="mosaic: the TMA kernel (its variants only differ in the box knob)")
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU smoke)")
    p.add_argument("--out", default="-")
    args = p.parse_args(argv)
    out = sys.stdout if args.out == "-" else open(args.out, "a")

    def emit(rec):
        # The kernels' own jitted programs, not a public call (``call: "internal"``).
        rec = {"call": "internal", "runtime": "jax", **rec}
        out.write(json.dumps(rec) + "\n")
        out.flush()
        if out is not sys.stdout:
            print(json.dumps(rec), flush=True)

    emit({"record": "meta", "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
          "argv": sys.argv[1:]})
    for name in args.shapes.split(","):
        run_shape(name, args, emit)


if __name__ == "__main__":
    main()
