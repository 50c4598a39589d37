"""Transfers beside compute, through the public calls (``prepared.store`` / ``load``,
``kvgroups_torch.LayerwiseLoad``), on Llama-3-8B-like caches (32 layers, 8 KV heads x 128,
block 16, bf16, NHD: 32 KiB pages, 256-token chunks to random blocks).

Sections (``--only``):

- ``interference``: a prepared store / load of device objects on a side stream beside a
  compute kernel on the main stream -- a bf16 8192^3 GEMM and an attention-like kernel
  (``scaled_dot_product_attention``, decode: one query per sequence over a long context) --
  for ``max_ctas`` in {4, 8, 16, 33, 66, 132, uncapped}, ``path="copy_engine"`` and plain
  ``copy_`` of the same bytes. Each point: the transfer alone (``frac_of_ceiling``: the same
  run's device copy of the same bytes over its time), the compute's slowdown while transfers
  cover its whole run (``compute_slowdown``), the transfer's rate while compute covers its
  whole run (``concurrent_frac_of_copy``), and ``lost_compute_us_per_gib``: compute time lost
  per GiB moved (``(1 - 1 / slowdown)`` of the compute's time over the bytes moved then).
  Both streams start together behind a gate (a sleep kernel both wait on), so the host's
  enqueue order does not matter.
- ``step``: a 32-layer step (per layer a bf16 GEMM of 4096 x 4096 x 14336 and a read of the
  layer's loaded pages) captured in one CUDA graph: compute alone, with every layer's load
  queued at once on a side stream and each layer waiting for its own (``LayerwiseLoad``,
  ``overlap_over_compute``; target <= 1.05 where ``fits``: the loads alone take less than
  the compute), and with the whole load before the compute (``serial_over_compute``); device
  objects (64 chunks) and pinned objects (16 chunks).
- ``host_link``: a pinned store and a pinned load (16 chunks each) at once on two streams
  against two concurrent ``copy_`` of the same bytes (device -> pinned, pinned -> device),
  and a pinned store beside the GEMM (``max_ctas`` 4 / 16 / uncapped, the copy engine).
- ``default``: one ``overlap_default`` record: among the device-object kernel settings whose
  transfer keeps >= 0.5 of the copy beside the GEMM, the ``max_ctas`` losing the least GEMM
  time per GiB moved, and whether the issue's goal (>= 0.5 of the copy, GEMM slowed <= 10 %)
  is met by any setting.

CUDA timed with events, medians over rounds. ``--tiny``: a small CPU run (no streams, no
graphs: the sections run their calls in order and time them with the wall clock) that checks
every record is written; CI runs it. One JSON object per line to ``--out`` and stdout, each
with ``call`` (the public call measured: ``prepared.store``, ``prepared.load``,
``LayerwiseLoad``, or a summary name).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(ROOT / "backends"), str(HERE)]

from bench_torch_engine import Setup, Timer, copy_ms  # noqa: E402
from kvgroups_torch import LayerwiseLoad  # noqa: E402

import kvgroups_core as kc  # noqa: E402

CAPS = (4, 8, 16, 33, 66, 132, None)
GATE_CYCLES = 6_000_000  # ~3 ms at the H200's clock: longer than the host's enqueueing


class WallEvent:
    """A CPU stand-in for ``torch.cuda.Event`` (the wall clock when recorded)."""

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: "WallEvent") -> float:
        return (other.t - self.t) * 1e3


class Bench:
    """Shared state: the cache setup, timing, the side stream and the output."""

    def __init__(self, args, emit) -> None:
        self.args, self.emit = args, emit
        self.s = Setup(args)
        self.cuda = self.s.device == "cuda"
        self.timer = Timer(self.cuda, args.iters, args.warmup, args.batch_s)
        self.side = torch.cuda.Stream() if self.cuda else None
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count if self.cuda else None

    def event(self):
        return torch.cuda.Event(enable_timing=True) if self.cuda else WallEvent()

    def on_side(self):
        return torch.cuda.stream(self.side) if self.cuda else nullcontext()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def together(
        self, transfer, n_t: int, compute, n_k: int, rounds: int, compute_first: bool = False
    ) -> dict:
        """Medians of the transfer's and the compute's time per call, ``n_t`` transfers on
        the side stream and ``n_k`` computes on the main stream, started together (both wait
        for a gate kernel). ``compute_first``: the computes are enqueued first (where the
        compute must cover the transfers, whatever the host's time to enqueue them)."""
        main = torch.cuda.current_stream() if self.cuda else None
        per_t, per_k, covered = [], [], []

        def transfers(ev):
            with self.on_side():
                ev[0].record()
                for i in range(n_t):
                    transfer(i)
                ev[1].record()

        for r in range(rounds + 1):  # round 0 warms up
            ev = [self.event() for _ in range(4)]
            if self.cuda:
                torch.cuda._sleep(GATE_CYCLES)  # both streams start when the gate ends
                self.side.wait_stream(main)
            if not compute_first:
                transfers(ev)
            ev[2].record()
            for i in range(n_k):
                compute(i)
            ev[3].record()
            if compute_first:
                transfers(ev)
            if self.cuda:
                main.wait_stream(self.side)
            self.sync()
            if r:
                t_ms, k_ms = ev[0].elapsed_time(ev[1]), ev[2].elapsed_time(ev[3])
                per_t.append(t_ms / n_t)
                per_k.append(k_ms / n_k)
                covered.append((t_ms, k_ms))
        return {
            "transfer_ms": statistics.median(per_t),
            "compute_ms": statistics.median(per_k),
            "windows_ms": covered[len(covered) // 2],
        }


# ------------------------------------------------------------------------ compute kernels


def gemm_kernel(b: Bench):
    n = 128 if b.args.tiny else 8192
    dtype = torch.float32 if b.args.tiny else torch.bfloat16
    x = torch.randn(n, n, device=b.s.device, dtype=dtype)
    y = torch.randn(n, n, device=b.s.device, dtype=dtype)
    out = torch.empty_like(x)
    name = f"gemm_{str(dtype).split('.')[-1]}_{n}^3"
    return name, lambda i: torch.matmul(x, y, out=out), 2 * n**3


def attention_kernel(b: Bench):
    """Decode-like attention: one query per sequence over ``ctx`` cached tokens."""
    batch, heads, ctx, dim = (2, 2, 64, 16) if b.args.tiny else (32, 32, 4096, 128)
    dtype = torch.float32 if b.args.tiny else torch.bfloat16
    q = torch.randn(batch, heads, 1, dim, device=b.s.device, dtype=dtype)
    k = torch.randn(batch, heads, ctx, dim, device=b.s.device, dtype=dtype)
    v = torch.randn_like(k)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return (
        f"sdpa_decode_b{batch}_h{heads}_ctx{ctx}",
        lambda i: sdpa(q, k, v),
        2 * k.numel() * k.element_size(),
    )


# ------------------------------------------------------------------------ interference


def transfers(b: Bench, chunks: int):
    """``(label, direction, max_ctas, path, fn(i))`` for every setting of the curve."""
    s = b.s
    dev_ids, host_ids = s.ids(chunks, "device"), s.ids(chunks, "host")
    objs = s.objects(chunks)
    out = []
    caps = (4, None) if b.args.tiny else CAPS

    def call(direction, ids, **kw):
        if direction == "store":
            return lambda i: s.prep.store(ids[i % 4], objs[i % 2], **kw)
        return lambda i: s.prep.load(objs[i % 2], ids[i % 4], **kw)

    for direction in ("store", "load"):
        for cap in caps:
            out.append(("kernel", direction, cap, "kernel", call(direction, dev_ids, max_ctas=cap)))
        out.append(
            (
                "copy_engine",
                direction,
                None,
                "copy_engine",
                call(direction, host_ids, path="copy_engine"),
            )
        )
    nbytes = s.moved_bytes(chunks)
    src = torch.empty(nbytes, dtype=torch.uint8, device=s.device)
    dst = [torch.empty_like(src) for _ in range(2)]
    out.append(("copy_", "copy", None, "copy_", lambda i: dst[i % 2].copy_(src)))
    return out


def bench_interference(b: Bench, chunks: int) -> list[dict]:
    s, args = b.s, b.args
    nbytes = s.moved_bytes(chunks)
    ceiling = copy_ms(s, b.timer, nbytes)
    window = 1.0 if args.tiny else args.window_ms
    rows = []
    kernels = [gemm_kernel(b), attention_kernel(b)]
    alone_k = {name: b.timer.ms(fn)["median"] for name, fn, _ in kernels}
    for label, direction, cap, path, fn in transfers(b, chunks):
        base = {
            "call": "copy_" if label == "copy_" else f"prepared.{direction}",
            "ids": "host" if path == "copy_engine" else "device",
            "runtime": "torch",
            "path": path,
            "direction": direction,
            "placement": "device",
            "max_ctas": cap,
            "sms": b.sms,
            "chunks": chunks,
            "page_bytes": s.page_bytes,
            "bytes": nbytes,
            "copy_ms": ceiling,
        }
        if path == "copy_engine" and not b.cuda:
            b.emit({**base, "skipped": "the copy engine needs a CUDA GPU"})
            continue
        alone = b.timer.ms(fn)
        t_ms = alone["median"]
        for name, compute, work in kernels:
            k_ms = alone_k[name]
            # Transfers covering the compute: the compute's slowdown.
            n_k = max(1, round(window / k_ms))
            n_t = max(1, math.ceil(1.5 * n_k * k_ms / t_ms))
            cover_k = b.together(fn, n_t, compute, n_k, args.rounds)
            # Compute covering the transfers: the transfer's rate beside it (a transfer
            # slowed 3x still ends inside the compute).
            n_t2 = max(1, round(window / t_ms))
            n_k2 = max(1, math.ceil(3 * n_t2 * t_ms / k_ms))
            cover_t = b.together(fn, n_t2, compute, n_k2, args.rounds, compute_first=True)
            slowdown = cover_k["compute_ms"] / k_ms
            t_conc = cover_t["transfer_ms"]
            # While the transfers cover the compute: the compute's delay (ms) and the bytes
            # the transfers moved in that time.
            lost = (slowdown - 1) * k_ms * n_k
            moved = nbytes * n_k * k_ms * slowdown / cover_k["transfer_ms"]
            row = {
                **base,
                "compute": name,
                "compute_work": work,
                "median": t_ms,
                "gbps": 2 * nbytes / t_ms / 1e6,
                "frac_of_ceiling": ceiling / t_ms,
                "compute_alone_ms": k_ms,
                "compute_concurrent_ms": cover_k["compute_ms"],
                "compute_slowdown": slowdown,
                "transfer_concurrent_ms": t_conc,
                "concurrent_gbps": 2 * nbytes / t_conc / 1e6,
                "concurrent_frac_of_copy": ceiling / t_conc,
                "lost_compute_us_per_gib": 1e3 * lost / (moved / 2**30) if moved else None,
                "transfers_per_window": [n_t, n_t2],
                "computes_per_window": [n_k, n_k2],
                "covered": cover_t["windows_ms"][0] <= cover_t["windows_ms"][1]
                and cover_k["windows_ms"][0] >= cover_k["windows_ms"][1],
            }
            b.emit(row)
            rows.append(row)
    return rows


def _pick(rows: list[dict]) -> dict | None:
    """The issue's goal first (>= 0.5 of the copy beside the GEMM, GEMM slowed <= 10 %: the
    fastest such transfer), else the least GEMM time lost per GiB among transfers keeping
    >= 0.5 of the copy."""
    fast = [r for r in rows if r["concurrent_frac_of_copy"] >= 0.5]
    goal = [r for r in fast if r["compute_slowdown"] <= 1.10]
    if goal:
        return max(goal, key=lambda r: r["concurrent_frac_of_copy"])
    costed = [r for r in fast if r["lost_compute_us_per_gib"] is not None]
    return min(
        costed, key=lambda r: (r["lost_compute_us_per_gib"], r["max_ctas"] or 10**9), default=None
    )


def choose_default(b: Bench, rows: list[dict]) -> None:
    """The ``max_ctas`` a side-stream device transfer should use beside a GEMM (``_pick``),
    over both directions and per direction."""
    gemm = [r for r in rows if r["compute"].startswith("gemm") and r["path"] == "kernel"]
    pick = _pick(gemm)
    by_direction = {}
    for d in ("store", "load"):
        chosen = _pick([r for r in gemm if r["direction"] == d])
        by_direction[d] = None if chosen is None else chosen["max_ctas"] or "uncapped"
    goal = [
        r for r in gemm if r["concurrent_frac_of_copy"] >= 0.5 and r["compute_slowdown"] <= 1.10
    ]
    b.emit(
        {
            "call": "overlap_default",
            "runtime": "torch",
            "rule": _pick.__doc__.strip(),
            "max_ctas": None if pick is None else pick["max_ctas"] or "uncapped",
            "picked": None
            if pick is None
            else {
                k: pick[k]
                for k in (
                    "direction",
                    "concurrent_frac_of_copy",
                    "compute_slowdown",
                    "lost_compute_us_per_gib",
                )
            },
            "by_direction": by_direction,
            "goal_met": bool(goal),
            "goal": ">= 0.5 of the copy, GEMM slowed <= 10 %",
            "meeting_goal": sorted({(r["direction"], r["max_ctas"] or 0) for r in goal}),
        }
    )


# ------------------------------------------------------------------------ step


def bench_step(b: Bench) -> None:
    s, args = b.s, b.args
    m, k, n = (64, 64, 128) if args.tiny else (4096, 4096, 14336)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    x = torch.randn(m, k, device=s.device, dtype=dtype)
    w = torch.randn(k, n, device=s.device, dtype=dtype)
    out = torch.empty(m, n, device=s.device, dtype=dtype)

    def gemm():
        torch.matmul(x, w, out=out)

    for placement, chunks in (
        ("device", 2 if args.tiny else 64),
        ("pinned", 1 if args.tiny else 16),
    ):
        if placement == "pinned" and not b.cuda:
            placement = "host"  # plain CPU memory: the same calls, no link
        caps = (
            (None,) if args.tiny else ((None, 8, 16, 33) if placement == "device" else (None, 16))
        )
        _step_case(b, placement, chunks, caps, gemm, [m, k, n])


def _step_case(b: Bench, placement: str, chunks: int, caps, gemm, shape) -> None:
    s = b.s
    layers = s.layers
    ids = s.ids(chunks, "device")[0]
    first = ids[: s.bpc]  # each layer's attention stand-in reads its first loaded chunk
    objs = [
        torch.empty(
            (chunks, kc.object_nbytes(s.manager, 0)),
            dtype=torch.uint8,
            device=s.device if placement == "device" else "cpu",
            pin_memory=placement == "pinned",
        )
    ]
    objs[0].random_(0, 256)
    seen = [None] * layers

    def compute(layer):
        gemm()
        seen[layer] = s.caches[layer].index_select(1, first)

    def compute_only():
        for layer in range(layers):
            compute(layer)

    def serial():
        s.prep.load(objs, ids)
        compute_only()

    def overlapped(loads):
        loads.start(objs, ids)
        for layer in range(layers):
            loads.wait(layer)
            compute(layer)
        loads.finish()

    times = {"compute": _step_ms(b, compute_only), "serial": _step_ms(b, serial)}
    for cap in caps:
        loads = LayerwiseLoad(s.prep, max_ctas=cap)
        times[cap] = _step_ms(b, lambda loads=loads: overlapped(loads))
    load_alone = b.timer.ms(lambda i: s.prep.load(objs, ids))["median"]
    compute_ms = times["compute"]
    for cap in caps:
        b.emit(
            {
                "call": "LayerwiseLoad",
                "runtime": "torch",
                "placement": placement,
                "chunks": chunks,
                "layers": layers,
                "max_ctas": cap,
                "graph": b.cuda,
                "page_bytes": s.page_bytes,
                "bytes": s.moved_bytes(chunks),
                "median": times[cap],
                "compute_ms": compute_ms,
                "serial_ms": times["serial"],
                "load_alone_ms": load_alone,
                "fits": load_alone < compute_ms,
                "overlap_over_compute": times[cap] / compute_ms,
                "serial_over_compute": times["serial"] / compute_ms,
                "gemm": shape,
            }
        )


def _step_ms(b: Bench, fn) -> float:
    """Median time of one step: a CUDA graph of ``fn`` replayed (eager on CPU)."""
    if not b.cuda:
        return b.timer.ms(lambda i: fn())["median"]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up outside the capture (kernels, launch tables, cuBLAS workspaces)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return b.timer.ms(lambda i: graph.replay())["median"]


# ------------------------------------------------------------------------ host link


def bench_host_link(b: Bench) -> None:
    s, args = b.s, b.args
    chunks = 1 if args.tiny else 16
    nbytes = s.moved_bytes(chunks)
    pinned = b.cuda
    placement = "pinned" if pinned else "host"
    objs = [
        [
            torch.empty(
                (chunks, kc.object_nbytes(s.manager, 0)), dtype=torch.uint8, pin_memory=pinned
            )
        ]
        for _ in range(2)
    ]
    ids = s.ids(2 * chunks, "device")[0]
    store_ids, load_ids = ids[: chunks * s.bpc], ids[chunks * s.bpc :]
    host_ids = s.ids(chunks, "host")[0]
    dev = torch.empty(nbytes, dtype=torch.uint8, device=s.device)
    dev2 = torch.empty_like(dev)
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
    base = {
        "runtime": "torch",
        "placement": placement,
        "chunks": chunks,
        "page_bytes": s.page_bytes,
        "bytes": nbytes,
    }

    def store(i):
        s.prep.store(store_ids, objs[0])

    def load(i):
        s.prep.load(objs[1], load_ids)

    def d2h(i):
        host[0].copy_(dev, non_blocking=pinned)

    def h2d(i):
        dev2.copy_(host[1], non_blocking=pinned)

    alone = {
        name: b.timer.ms(fn)["median"]
        for name, fn in (("store", store), ("load", load), ("d2h", d2h), ("h2d", h2d))
    }
    rounds = max(3, args.rounds)
    both = b.together(store, 1, load, 1, rounds)
    copies = b.together(d2h, 1, h2d, 1, rounds)
    both_ms = max(both["windows_ms"])
    copies_ms = max(copies["windows_ms"])
    b.emit(
        {
            **base,
            "call": "prepared.store+prepared.load",
            "streams": 2,
            "store_alone_ms": alone["store"],
            "load_alone_ms": alone["load"],
            "store_concurrent_ms": both["transfer_ms"],
            "load_concurrent_ms": both["compute_ms"],
            "median": both_ms,
            "sum_link_gbps": 2 * nbytes / both_ms / 1e6,
            "copies_ms": copies_ms,
            "copies_sum_link_gbps": 2 * nbytes / copies_ms / 1e6,
            "frac_of_copies": copies_ms / both_ms,
            "store_frac_of_d2h": alone["d2h"] / alone["store"],
            "load_frac_of_h2d": alone["h2d"] / alone["load"],
        }
    )
    name, compute, work = gemm_kernel(b)
    k_ms = b.timer.ms(compute)["median"]
    caps = (None,) if args.tiny else (4, 16, None)
    settings = [("kernel", cap) for cap in caps] + [("copy_engine", None)]
    for path, cap in settings:
        row = {
            **base,
            "call": "prepared.store",
            "direction": "store",
            "path": path,
            "ids": "host" if path == "copy_engine" else "device",
            "max_ctas": cap,
            "compute": name,
            "compute_work": work,
        }
        if path == "copy_engine" and not b.cuda:
            b.emit({**row, "skipped": "the copy engine needs a CUDA GPU"})
            continue
        if path == "copy_engine":

            def fn(i):
                s.prep.store(host_ids, objs[0], path="copy_engine")
        else:

            def fn(i, cap=cap):
                s.prep.store(store_ids, objs[0], max_ctas=cap)

        t_ms = b.timer.ms(fn)["median"]
        n_k = max(1, round((1.0 if args.tiny else args.window_ms) / k_ms))
        n_t = max(1, math.ceil(1.5 * n_k * k_ms / t_ms))
        cover_k = b.together(fn, n_t, compute, n_k, args.rounds)
        n_k2 = max(1, math.ceil(3 * t_ms / k_ms))
        cover_t = b.together(fn, 1, compute, n_k2, args.rounds, compute_first=True)
        b.emit(
            {
                **row,
                "median": t_ms,
                "link_gbps": nbytes / t_ms / 1e6,
                "frac_of_link": alone["d2h"] / t_ms,
                "d2h_ms": alone["d2h"],
                "compute_alone_ms": k_ms,
                "compute_slowdown": cover_k["compute_ms"] / k_ms,
                "transfer_concurrent_ms": cover_t["transfer_ms"],
                "concurrent_frac_of_link": alone["d2h"] / cover_t["transfer_ms"],
            }
        )


# ------------------------------------------------------------------------ main


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    p.add_argument("--tiny", action="store_true", help="small CPU run (CI smoke test)")
    p.add_argument(
        "--only", nargs="+", default=None, choices=["interference", "step", "host_link", "default"]
    )
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--chunks", type=int, default=16, help="chunks per interference transfer")
    p.add_argument(
        "--window-ms",
        type=float,
        default=10.0,
        help="about how long each side-by-side measurement runs",
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-s", type=float, default=0.02)
    args = p.parse_args(argv)
    if args.tiny:
        args.chunks, args.rounds, args.iters, args.warmup, args.batch_s = 2, 1, 2, 1, 0.001
    elif not torch.cuda.is_available():
        p.error("no CUDA GPU: use --tiny for the CPU smoke run")
    sink = open(args.out, "a") if args.out else None

    def emit(row: dict) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if sink:
            sink.write(line + "\n")
            sink.flush()

    b = Bench(args, emit)
    emit(
        {
            "call": "overlap_setup",
            "runtime": "torch",
            "device": b.s.device,
            "gpu": torch.cuda.get_device_name() if b.cuda else None,
            "torch": torch.__version__,
            "layers": b.s.layers,
            "num_blocks": b.s.num_blocks,
            "page_bytes": b.s.page_bytes,
        }
    )
    wanted = set(args.only or ("interference", "step", "host_link", "default"))
    sections = [
        ("interference", lambda: bench_interference(b, args.chunks)),
        ("step", lambda: bench_step(b)),
        ("host_link", lambda: bench_host_link(b)),
    ]
    rows = []
    for name, run in sections:
        if name not in wanted and not (name == "interference" and "default" in wanted):
            continue
        t0 = time.perf_counter()
        try:
            out = run()
        except Exception as exc:  # noqa: BLE001 - recorded, the other sections still run
            emit({"call": f"overlap_{name}", "runtime": "torch", "failed": repr(exc)[:2000]})
            b.sync()
            continue
        if name == "interference":
            rows = out
        emit({"call": f"overlap_{name}", "runtime": "torch", "seconds": time.perf_counter() - t0})
    if "default" in wanted and rows:
        choose_default(b, rows)
    if sink:
        sink.close()


if __name__ == "__main__":
    main()
