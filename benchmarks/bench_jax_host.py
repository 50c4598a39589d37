"""Host cost of one JAX transfer call: the Python and dispatch time before the call returns.

For a catalogue model (default Llama-3-8B-like: 32 layers, one cache array per layer) and each
chunk count (default 1 and 64), per direction:

- ``execute_plan``: :func:`kvgroups_jax.execute_plan` on a prebuilt plan;
- ``dispatch_floor``: the executor's jitted program called directly with prebuilt arguments,
  i.e. what JAX / XLA dispatch costs on their own (the part no Python of ours can remove);
- ``backend_execute``: :meth:`kvgroups_jax.JaxBackend.execute` on the same plan;
- ``prepared``: the core's ``prepare(manager, caches).store / .load`` (plans, checks, execute);
- ``plan_call``: the core's planning alone, for reference.

Rows ending in ``_python`` time the same entry points with the executor's jitted programs
replaced by a stub that returns its inputs: our Python alone, without JAX dispatch or the copy.

Each call is timed on its own with the wall clock, the device idle (every result is waited for
after the timer stops), after a warm-up; medians and percentiles in microseconds. One JSON
object per line on stdout and appended to ``--out``.

On a GPU the full rows are the host cost (the copy runs asynchronously). On a CPU they are not:
XLA runs the copy itself, partly on the calling thread, and its worker threads keep the (few)
cores busy right after each wait, so a CPU's full rows mix in XLA's own work and vary from run
to run; the ``_python`` rows are the stable measure of our code there. A CPU also defaults to
small pages (``--num-heads 1 --head-size 8``): 64-chunk calls at the model's page size take
seconds of CPU copying, and host work does not depend on page bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "backends")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from kvgroups_jax import JaxBackend, executor  # noqa: E402
from kvgroups_jax.lowerings import choice as lowering_choice  # noqa: E402

from kvgroups_core.formats.catalogue import EngineKVFormat  # noqa: E402
from kvgroups_core.grouping.manager import KVLayerGroupsManager  # noqa: E402
from kvgroups_core.tensors.arrays import register_backend  # noqa: E402
from kvgroups_core.tensors.descriptors import TensorSpec  # noqa: E402
from kvgroups_core.transfer.api import prepare  # noqa: E402
from kvgroups_core.transfer.planner import bind, plan_call  # noqa: E402
from kvgroups_tools.bench_kits.jax_kit import JaxKit  # noqa: E402
from kvgroups_tools.catalog import MODELS  # noqa: E402

CHUNK_TOKENS = 256


def build_model(args):
    model = MODELS[args.model].build(num_blocks=args.num_blocks, layers=args.layers)
    if args.num_heads is None and args.head_size is None:
        return model
    if any(f != EngineKVFormat.NL_X_TWO_NB_BS_NH_HS for f in model.formats):
        sys.exit("bench_jax_host: --num-heads / --head-size need a [2, NB, BS, NH, HS] model")
    specs = []
    for spec in model.kv_caches:
        nh = args.num_heads or spec.shape[-2]
        hs = args.head_size or spec.shape[-1]
        specs.append(TensorSpec(spec.shape[:-2] + (nh, hs), spec.dtype))
    return replace(model, kv_caches=specs)


@contextlib.contextmanager
def stubbed_dispatch():
    """Replace the executor's jitted programs by stubs returning what they would donate."""
    saved = executor._store_jit, executor._load_jit
    executor._store_jit = lambda program, caches, objects, metas, idss: objects
    executor._load_jit = lambda program, caches, objects, metas, idss: caches
    try:
        yield
    finally:
        executor._store_jit, executor._load_jit = saved


def timed(fn, sync, calls: int, warmup: int) -> dict:
    """Median / p10 / p90 microseconds of ``fn()``, the device drained after each call."""
    for _ in range(warmup):
        fn()
        sync()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
        sync()
    return {"us_median": statistics.median(times), "us_p10": float(np.percentile(times, 10)),
            "us_p90": float(np.percentile(times, 90)), "calls": calls}


def bench_chunks(args, chunks: int, model, kit: JaxKit, backend_name: str, emit) -> None:
    caches = kit.make_caches(model.kv_caches, 0)
    manager = KVLayerGroupsManager(caches, list(model.formats),
                                   lmcache_tokens_per_chunk=CHUNK_TOKENS)
    binding = bind(manager, caches)
    bpc = manager.calculate_num_blocks(0, CHUNK_TOKENS)
    if chunks * bpc > args.num_blocks:
        sys.exit(f"bench_jax_host: {chunks} chunks need {chunks * bpc} blocks, got "
                 f"--num-blocks {args.num_blocks}")
    ids = np.random.default_rng(chunks).permutation(args.num_blocks)[: chunks * bpc]
    plans = {d: plan_call(binding, ids, d) for d in ("store", "load")}
    state = {"caches": [d.obj for d in binding.tensors],
             "objects": [jnp.zeros((chunks, n), jnp.uint8) for n in binding.object_nbytes]}
    jax.block_until_ready(state["objects"])

    def sync():
        jax.block_until_ready((state["caches"], state["objects"]))

    common = {"model": args.model, "layers": args.layers, "chunks": chunks,
              "lowering": args.lowering, "arrays": len(binding.tensors)}

    def emit_row(name, direction, fn, python=True):
        emit({"name": f"{name}_{direction}", "direction": direction, **common,
              **timed(fn, sync, args.calls, args.warmup)})
        if python:
            with stubbed_dispatch():
                emit({"name": f"{name}_{direction}_python", "direction": direction, **common,
                      **timed(fn, sync, args.calls, args.warmup)})

    def set_result(direction, caches, objects):
        if direction == "load":
            state["caches"] = list(caches)
        else:
            state["objects"] = list(objects)

    for direction in ("store", "load"):
        plan = plans[direction]

        def run_executor(plan=plan, d=direction):
            c, o = executor.execute_plan(plan, state["caches"], state["objects"],
                                         lowering=args.lowering)
            set_result(d, c, o)

        emit_row("execute_plan", direction, run_executor)

        # The arguments execute_plan passes (device-resident metas), built once.
        platform, placement = executor._home(state["caches"])
        program = executor.build_program(plan, args.lowering, platform)[0]  # its defaults
        metas, idss = executor._runtime_args(plan, placement)
        fn = executor._store_jit if direction == "store" else executor._load_jit

        def run_floor(d=direction, fn=fn, program=program, metas=metas, idss=idss):
            out = fn(program, tuple(state["caches"]), tuple(state["objects"]), metas, idss)
            set_result(d, out, out)

        emit_row("dispatch_floor", direction, run_floor, python=False)

        backend = JaxBackend(lowering=args.lowering)

        def run_backend(plan=plan, d=direction, backend=backend):
            c, o = backend.execute(plan, state["caches"], state["objects"])
            set_result(d, c, o)

        emit_row("backend_execute", direction, run_backend)
        emit_row("plan_call", direction, lambda d=direction: plan_call(binding, ids, d),
                 python=False)

    prepared = prepare(manager, list(state["caches"]), backend=backend_name)

    def run_prepared_store():
        state["objects"] = list(prepared.store(ids, state["objects"]))

    def run_prepared_load():
        state["caches"] = list(prepared.load(state["objects"], ids))

    emit_row("prepared", "store", run_prepared_store)
    emit_row("prepared", "load", run_prepared_load)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--chunks", default="1,64", help="comma-separated chunk counts")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="blocks per cache (default: enough for the largest chunk count)")
    p.add_argument("--num-heads", type=int, default=None, help="override the model's KV heads")
    p.add_argument("--head-size", type=int, default=None, help="override the model's head size")
    p.add_argument("--lowering", default="auto", choices=lowering_choice.LOWERINGS)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--device", default=None, help="'cpu', 'cuda[:N]' (default: JAX's)")
    p.add_argument("--out", type=Path, default=None, help="JSON lines file (appended)")
    args = p.parse_args(argv)
    kit = JaxKit(args.device)
    if kit.device == "cpu" and args.num_heads is None and args.head_size is None:
        args.num_heads, args.head_size = 1, 8  # see the module docs
    chunk_counts = [int(c) for c in args.chunks.split(",")]
    if args.num_blocks is None:  # 2x the blocks the largest call touches
        block_size = MODELS[args.model].build(num_blocks=1, layers=1).block_size
        args.num_blocks = 2 * max(chunk_counts) * (CHUNK_TOKENS // block_size)
    out = open(args.out, "a") if args.out else None

    def emit(row):
        line = json.dumps(row)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    model = build_model(args)
    spec = model.kv_caches[0]
    emit({"name": "meta", **kit.info(), "argv": sys.argv[1:] if argv is None else list(argv),
          "cache_shape": list(spec.shape), "dtype": spec.dtype.name,
          "num_blocks": args.num_blocks})
    backend_name = "jax"
    if args.lowering != "auto":
        backend_name = f"jax-{args.lowering}"
        register_backend(backend_name, JaxBackend(lowering=args.lowering),
                         array_types=(), replace=True)
    for chunks in chunk_counts:
        bench_chunks(args, chunks, model, kit, backend_name, emit)
    if out:
        out.close()


if __name__ == "__main__":
    main()
