"""Host cost of the one-shot public calls against the prepared ones, per call, on the CPU.

An engine calls ``store(manager, caches, ids)`` / ``load(manager, objects, caches, ids)`` with
the same cache arrays every step; this measures what such a call costs on top of
``prepare(manager, caches).store(ids)`` / ``.load(objects, ids)``. The caches are a small
Llama-like model (default 32 layers of ``[2, NB, 16, 1, 8]`` float32, one chunk of 256
tokens), so the copy is tiny and the rows are host time: planning, checks, binding, dispatch.

Rows per runtime (``--runtimes``: ``jax`` on its default backend, ``torch`` CPU, ``numpy``):

- ``oneshot_store`` / ``prepared_store``: store without objects (allocated by the call);
- ``oneshot_store_objects`` / ``prepared_store_objects``: store into objects passed in (JAX:
  the previous call's results, donated);
- ``oneshot_load`` / ``prepared_load``: load of those objects (JAX: the caches the previous
  load returned are passed in, as an engine does).

Rows ending in ``_python`` (``--stub``, the default ``both``) time the same calls with the copy
itself replaced by a stub (JAX: the executor's jitted programs; torch: the CPU copy loop;
NumPy: the reference copy): our Python alone, the stable measure on a shared CPU.

Each call is timed on its own with the wall clock after a warm-up, its results waited for after
the timer stops; the median and p10/p90 in microseconds. One JSON object per line on stdout and
appended to ``--out``. On a CPU, JAX rows include XLA running the (tiny) copy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "backends")]

from kvgroups_core.formats.catalogue import EngineKVFormat  # noqa: E402
from kvgroups_core.grouping.manager import KVLayerGroupsManager  # noqa: E402
from kvgroups_core.transfer.api import load, prepare, store  # noqa: E402

CHUNK_TOKENS = 256
BLOCK_SIZE = 16


def _stats(times: list) -> dict:
    return {"us_median": statistics.median(times), "us_p10": float(np.percentile(times, 10)),
            "us_p90": float(np.percentile(times, 90)), "calls": len(times)}


def timed_pair(fns, sync, calls: int, warmup: int) -> list[dict]:
    """Each of ``fns`` timed call by call, the calls interleaved (a shared CPU's load and
    clock drift hit both alike), results waited for after each timer stops."""
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
    return [_stats(t) for t in times]


def make_runtime(name: str, torch_device: str = "cpu"):
    """(make a cache from a NumPy array, wait for arrays, whether loads return new arrays)."""
    if name == "jax":
        import jax
        import jax.numpy as jnp

        return jnp.asarray, jax.block_until_ready, True
    if name == "torch":
        import torch

        if torch_device != "cpu":
            return (lambda a: torch.from_numpy(a).to(torch_device),
                    lambda x: torch.cuda.synchronize(), False)
        return torch.from_numpy, lambda x: None, False
    if name == "numpy":
        return np.copy, lambda x: None, False
    raise SystemExit(f"bench_oneshot_host: unknown runtime {name!r}")


@contextlib.contextmanager
def stubbed_copy(runtime: str):
    """Replace the runtime's copy by a stub returning what it would (see the module docs)."""
    if runtime == "jax":
        from kvgroups_jax import executor as module

        saved = {"_store_jit": module._store_jit, "_load_jit": module._load_jit}
        stubs = {"_store_jit": lambda program, caches, objects, metas, idss: objects,
                 "_load_jit": lambda program, caches, objects, metas, idss: caches}
    elif runtime == "torch":
        from kvgroups_torch import cpu as module

        saved = {"run_plan": module.run_plan}
        stubs = {"run_plan": lambda plan, tensors, objects: None}
    else:
        from kvgroups_core.transfer import reference as module

        saved = {"execute": module.NumpyBackend.execute}
        stubs = {"execute": lambda self, plan, caches, objects: (None, list(objects))}
        module = module.NumpyBackend
    for name, stub in stubs.items():
        setattr(module, name, stub)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def _device_of(x) -> str:
    devices = getattr(x, "devices", None)  # JAX
    return str(next(iter(devices()))) if callable(devices) else str(getattr(x, "device", "cpu"))


def bench_runtime(args, runtime: str, emit) -> None:
    make, wait, returns_new = make_runtime(runtime, args.torch_device)
    shape = (2, args.num_blocks, BLOCK_SIZE, args.num_heads, args.head_size)
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(shape).astype(np.float32) for _ in range(args.layers)]
    # Two cache sets of one manager: the prepared transfer's and the one-shot calls' (a JAX
    # load consumes the caches it is given, so the two cannot share them).
    caches = {"prepared": [make(a) for a in host], "oneshot": [make(a) for a in host]}
    manager = KVLayerGroupsManager(caches["oneshot"], EngineKVFormat.NL_X_TWO_NB_BS_NH_HS,
                                   lmcache_tokens_per_chunk=CHUNK_TOKENS)
    ids = rng.permutation(args.num_blocks)[: args.chunks * CHUNK_TOKENS // BLOCK_SIZE]
    prepared = prepare(manager, caches["prepared"])
    objects = {"prepared": prepared.store(ids), "oneshot": store(manager, caches["oneshot"], ids)}

    def sync():
        wait((caches, objects))

    common = {"runtime": runtime, "layers": args.layers, "chunks": args.chunks,
              "cache_shape": list(shape),
              "device": _device_of(caches["oneshot"][0])}

    def store_fns(with_objects: bool):
        def p():
            objects["prepared"] = prepared.store(ids, objects["prepared"] if with_objects
                                                 else None)

        def o():
            objects["oneshot"] = store(manager, caches["oneshot"], ids,
                                       objects["oneshot"] if with_objects else None)
        return p, o

    def load_fns():
        def p():
            out = prepared.load(objects["prepared"], ids)
            if returns_new:
                caches["prepared"] = out

        def o():
            out = load(manager, objects["oneshot"], caches["oneshot"], ids)
            if returns_new:
                caches["oneshot"] = out
        return p, o

    rows = [("store", store_fns(False)), ("store_objects", store_fns(True)),
            ("load", load_fns())]
    modes = {"both": (False, True), "yes": (True,), "no": (False,)}[args.stub]
    if runtime == "torch" and args.torch_device != "cpu":
        modes = (False,)  # the stub replaces the CPU copy only; CUDA calls are host time
    for stub in modes:
        real = dict(objects)  # the stubs return placeholders, and donate nothing
        for name, fns in rows:
            if stub:
                objects.update(real)
            with stubbed_copy(runtime) if stub else contextlib.nullcontext():
                timings = timed_pair(fns, sync, args.calls, args.warmup)
            suffix = "_python" if stub else ""
            direction = "load" if name == "load" else "store"
            for kind, call, timing in zip(("prepared", "oneshot"), ("prepared", direction),
                                          timings):
                emit({"name": f"{kind}_{name}{suffix}", "call": call, "direction": direction,
                      **common, **timing})
            gap = timings[1]["us_median"] - timings[0]["us_median"]
            emit({"name": f"oneshot_minus_prepared_{name}{suffix}",
                  "call": f"{direction} - prepared", "direction": direction, **common,
                  "us_median_gap": gap})
        if stub:
            objects.update(real)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runtimes", default="jax,torch,numpy")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--chunks", type=int, default=1)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--num-heads", type=int, default=1)
    p.add_argument("--head-size", type=int, default=8)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--stub", default="both", choices=("both", "yes", "no"),
                   help="time the calls with the copy stubbed (_python rows), without, or both "
                        "(on a GPU use 'no': the calls are asynchronous, so they are host time)")
    p.add_argument("--torch-device", default="cpu", help="'cpu' or 'cuda[:N]' for torch's caches")
    p.add_argument("--label", default="", help="free text stored in every row (e.g. a commit)")
    p.add_argument("--out", type=Path, default=None, help="JSON lines file (appended)")
    args = p.parse_args(argv)
    out = open(args.out, "a") if args.out else None

    def emit(row):
        if args.label:
            row = {**row, "label": args.label}
        line = json.dumps(row)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    for runtime in args.runtimes.split(","):
        bench_runtime(args, runtime, emit)
    if out:
        out.close()


if __name__ == "__main__":
    main()
