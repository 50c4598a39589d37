"""JAX against torch on the same work, each called as its engines call it.

One Llama-3-8B-like cache in vLLM's NHD layout (32 layers of ``[2, NB, 16, 8, 128]`` bf16: 32 KiB
pages), the same contents in both runtimes, 256-token chunks to random blocks, objects on the
device, device-resident ids. For every chunk count and direction:

- JAX (``runtime="jax"``, ``call="jit"``): ``--calls-per-program`` public ``store`` (or ``load``)
  calls chained in one jitted program, with traced int32 ids and the objects (stores) or the
  caches (loads) donated and threaded from call to call and from program to program, the way
  an engine's step keeps its buffers. ``--programs`` programs are dispatched back to back
  before one wait, as an engine dispatches its next step before the last one finishes. Once
  per ``--lowerings`` entry (``path`` is the lowering asked for).
- torch (``runtime="torch"``, ``call="prepared"``): as many ``prepare(manager, caches).store``
  / ``.load`` calls with CUDA-tensor ids, back to back before one wait.

Each record is per call: ``median`` (ms: the steady-state cost of one more call, from batches
of one and two units timed in alternation, medians over ``--repeats``; see
:func:`per_call_seconds`), ``wall_ms`` (a one-unit batch from an idle device to its wait, per
call), ``frac_of_ceiling`` (torch's ``copy_`` of the same bytes in the same process, timed the
same way, over ``median``), for JAX ``frac_of_torch`` (torch's ``median`` over JAX's;
``frac_of_torch_wall`` the same of ``wall_ms``) and,
where the profiler records device activity, ``device_ms`` (all kernels of one program per call)
and ``kernel_ms`` (only the transfer kernels: names starting with ``kvg``). Before timing, the
first JAX program's result is compared byte for byte with torch's (``verified``; the exit
status is 1 if any differs). One JSON object per line on stdout and appended to ``--out``.
``--tiny`` runs a few-KiB model on the CPU in seconds (CI)::

    python benchmarks/bench_parity.py --out benchmarks/results/parity_h200.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
from common import device_kernels
from kvgroups_jax import JaxBackend

from kvgroups_core import (
    EngineKVFormat,
    KVLayerGroupsManager,
    load,
    prepare,
    register_backend,
    store,
)

FULL = dict(
    layers=32,
    blocks=2048,
    block_size=16,
    heads=8,
    head_dim=128,
    tokens=256,
    chunks="4,16,64",
    calls_per_program=8,
    programs=6,
    lowerings="auto,cuda",
)
TINY = dict(
    layers=2,
    blocks=64,
    block_size=4,
    heads=2,
    head_dim=8,
    tokens=8,
    chunks="1,2",
    calls_per_program=2,
    programs=2,
    lowerings="auto",
)
FORMAT = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a few-KiB model on the CPU (CI)")
    for key, value in FULL.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    for key, value in (TINY if args.tiny else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.chunks = [int(c) for c in str(args.chunks).split(",")]
    args.lowerings = [x for x in args.lowerings.split(",") if x]
    return args


class Timing(NamedTuple):
    seconds: float  # the steady-state cost of one more call (or ``wall``, see steady)
    wall: float  # a one-unit batch from an idle device, per call
    steady: bool  # whether ``seconds`` is the steady-state difference


def per_call_seconds(batch, calls: int, repeats: int) -> Timing:
    """Seconds per call, steady state and wall. ``batch(n)`` makes ``n * calls`` calls from an
    idle device and waits for them. ``wall``: the median of ``batch(1)`` per call, which
    includes starting from idle and the final wait; ``seconds``: the median of
    ``batch(2) - batch(1)`` (timed in alternation) per extra call, the steady-state cost of one
    more call, free of both (a jitted JAX program started on an idle GPU reaches it ~0.5 ms
    after its dispatch begins, where a torch launch takes microseconds)."""
    batch(1)  # warm-up: compiles, first touch
    one, extra = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        batch(1)
        t1 = time.perf_counter()
        batch(2)
        t2 = time.perf_counter()
        one.append(t1 - t0)
        extra.append((t2 - t1) - (t1 - t0))
    marginal, wall = statistics.median(extra) / calls, statistics.median(one) / calls
    # Noise larger than the calls (tiny CPU runs) can leave no positive difference: the
    # wall figure then stands in, and the record says so (``steady_state: false``).
    return Timing(marginal if marginal > 0 else wall, wall, marginal > 0)


def same_bytes(jax_arrays, torch_tensors) -> bool:
    """Byte-for-byte equality of JAX arrays and torch tensors (read zero-copy through DLPack
    on the device; NaN payloads of random bf16 compare as bits)."""
    for a, t in zip(jax_arrays, torch_tensors, strict=True):
        mine = torch.from_dlpack(a).contiguous().view(torch.uint8).reshape(-1)
        if not torch.equal(mine, t.contiguous().view(torch.uint8).reshape(-1)):
            return False
    return True


class Parity:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        shape = (2, args.blocks, args.block_size, args.heads, args.head_dim)
        make = jax.jit(
            lambda k: jax.lax.bitcast_convert_type(
                jax.random.bits(k, shape, jnp.uint16), jnp.bfloat16
            )
        )
        self.jcaches = [make(jax.random.PRNGKey(i)) for i in range(args.layers)]
        self.tcaches = [torch.from_dlpack(c).clone() for c in self.jcaches]
        self.device = self.tcaches[0].device
        self.cuda = self.device.type == "cuda"
        formats = [FORMAT] * args.layers
        self.jmanager = KVLayerGroupsManager(
            self.jcaches, formats, lmcache_tokens_per_chunk=args.tokens
        )
        self.tmanager = KVLayerGroupsManager(
            self.tcaches, formats, lmcache_tokens_per_chunk=args.tokens
        )
        self.prep = prepare(self.tmanager, self.tcaches)
        self.bpc = args.tokens // args.block_size
        self.page_bytes = args.block_size * args.heads * args.head_dim * 2
        self.rng = np.random.default_rng(0)
        self.failed = False
        self.out: list[dict] = []

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def emit(self, **record) -> None:
        record.update(
            placement="device",
            ids="device",
            page_bytes=self.page_bytes,
            layers=self.args.layers,
            jax=jax.__version__,
            torch=torch.__version__,
            device=torch.cuda.get_device_name(self.device) if self.cuda else "cpu",
        )
        print(json.dumps(record), flush=True)
        self.out.append(record)

    def ceiling(self, nbytes: int, calls: int) -> Timing:
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)

        def batch(n):
            for _ in range(n * calls):
                dst.copy_(src)
            self.sync()

        return per_call_seconds(batch, calls, self.args.repeats)

    def run(self, chunks: int) -> None:
        a = self.args
        k, programs = a.calls_per_program, a.programs
        calls = k * programs
        ids = np.stack([self.rng.permutation(a.blocks)[: chunks * self.bpc] for _ in range(k)])
        ids = ids.astype(np.int32)
        tids = [torch.from_numpy(row).to(self.device) for row in ids]
        tobjs = self.prep.store(tids[-1])
        nbytes = sum(o[:chunks].numel() for o in tobjs)
        copy = self.ceiling(nbytes, calls)

        def torch_batch(direction):
            def batch(n):
                for _ in range(n * programs):
                    for row in tids:
                        if direction == "store":
                            self.prep.store(row, tobjs)
                        else:
                            self.prep.load(tobjs, row)
                self.sync()

            return batch

        torch_s = {}
        for direction in ("store", "load"):
            torch_s[direction] = per_call_seconds(torch_batch(direction), calls, a.repeats)
            self.emit(
                runtime="torch",
                call="prepared",
                path="cuda-kernel" if self.cuda else "cpu",
                direction=direction,
                chunks=chunks,
                **self.figures(torch_s[direction], nbytes, copy),
                calls_per_batch=calls,
            )
        # The torch loads wrote the blocks of ids into tcaches: the JAX load chain below starts
        # from the same contents, so both end equal.
        jids = jnp.asarray(ids)
        for lowering in a.lowerings:
            name = f"parity-{lowering}"
            register_backend(name, JaxBackend(lowering=lowering), replace=True)
            self.run_jax(name, lowering, chunks, jids, tobjs, nbytes, copy, torch_s)

    def run_jax(self, name, lowering, chunks, jids, tobjs, nbytes, copy, torch_s) -> None:
        a = self.args
        k, programs = a.calls_per_program, a.programs
        m = self.jmanager

        def store_chain(objs, caches, ids):
            for i in range(k):
                objs = store(m, caches, ids[i], objs, backend=name)
            return objs

        def load_chain(caches, objs, ids):
            for i in range(k):
                caches = load(m, objs, caches, ids[i], backend=name)
            return caches

        steps = {
            "store": jax.jit(store_chain, donate_argnums=0),
            "load": jax.jit(load_chain, donate_argnums=0),
        }
        objs = store(m, self.jcaches, jids[k - 1], backend=name)
        # Each chain donates its own buffers: the store chain a copy of the objects the load
        # chain reads, the load chain a copy of the caches (what torch's caches held before
        # its loads).
        held = {
            "store": [jnp.array(o, copy=True) for o in objs],
            "load": [jnp.array(c, copy=True) for c in self.jcaches],
        }
        fixed = {"store": self.jcaches, "load": objs}
        # The store chain's last call writes the same objects as torch's store of ids[k - 1],
        # and the load chain ends with the caches the torch loads left.
        held["store"] = steps["store"](held["store"], fixed["store"], jids)
        held["load"] = steps["load"](held["load"], fixed["load"], jids)
        verified = {
            "store": same_bytes(held["store"], tobjs),
            "load": same_bytes(held["load"], self.tcaches),
        }
        for direction in ("store", "load"):
            step = steps[direction]

            def one(_=None, direction=direction, step=step):
                held[direction] = step(held[direction], fixed[direction], jids)

            def batch(n, direction=direction, one=one):
                for _ in range(n * programs):
                    one()
                jax.block_until_ready(held[direction])

            seconds = per_call_seconds(batch, k * programs, a.repeats)
            kernels = device_kernels(
                one, lambda d=direction: jax.block_until_ready(held[d]), calls=programs
            )
            extra = {}
            if kernels:
                extra = dict(
                    device_ms=sum(kernels.values()) / k * 1e3,
                    kernel_ms=sum(v for n, v in kernels.items() if n.startswith("kvg")) / k * 1e3,
                )
            self.failed |= not verified[direction]
            self.emit(
                runtime="jax",
                call="jit",
                path=lowering,
                direction=direction,
                chunks=chunks,
                **self.figures(seconds, nbytes, copy),
                frac_of_torch=torch_s[direction].seconds / seconds.seconds,
                frac_of_torch_wall=torch_s[direction].wall / seconds.wall,
                calls_per_program=k,
                programs_in_flight=programs,
                verified=verified[direction],
                backend=jax.default_backend(),
                **extra,
            )
        # From here on the JAX caches are what torch's loads left (the next chunk count's
        # stores read equal bytes in both runtimes).
        self.jcaches = held["load"]

    @staticmethod
    def figures(t: Timing, nbytes: int, copy: Timing) -> dict:
        return dict(
            median=t.seconds * 1e3,
            wall_ms=t.wall * 1e3,
            gbps=2 * nbytes / t.seconds / 1e9,
            bytes=nbytes,
            copy_ms=copy.seconds * 1e3,
            frac_of_ceiling=copy.seconds / t.seconds,
            steady_state=t.steady and copy.steady,
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    bench = Parity(args)
    for chunks in args.chunks:
        bench.run(chunks)
    if args.out is not None:
        with open(args.out, "a") as fh:
            for record in bench.out:
                fh.write(json.dumps(record) + "\n")
    return 1 if bench.failed else 0


if __name__ == "__main__":
    sys.exit(main())
