"""KVGroupsConnector's save and load path on vLLM-shaped caches, through the connector's own
calls (``kvgroups_torch.vllm.HostChunkStore``: the prepared store/load into entry
buffers in host memory, pinned on CUDA).

The caches are what vLLM >= 0.32 registers on a GPU for a Llama-3-8B-like model: 32 layers,
one logical ``[blocks, heads, tokens, K|V]`` view per layer over an NHD page (block 16,
8 KV heads x 128, bf16), which the adapter views as ``[blocks, tokens, heads, K|V]``
(NL_X_NB_BS_NH_CS). Per chunk count it measures

- ``store``: one whole-model save of n chunks (what ``wait_for_save`` does without layer
  subsets),
- ``layerwise``: the same save as 32 per-layer calls (``save_kv_layer``, ``layers=[l]``); the
  time is the sum over the layers,
- ``load``: one whole-model load of n chunks (``start_load_kv``),

and prints one JSON line per record: call, ids, runtime, path, direction, placement, chunks,
layers, page_bytes, bytes, time_us, gbps (bytes read + written per second, so twice the
payload), ceiling_gbps and frac_of_ceiling (against a plain copy of the same payload between
the same memories: device -> pinned host for saves, pinned host -> device for loads).

    python benchmarks/bench_vllm_connector.py                 # CUDA, 32 layers, 1-16 chunks
    python benchmarks/bench_vllm_connector.py --tiny          # CPU, seconds (CI runs this)
    python benchmarks/bench_vllm_connector.py --out results.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from kvgroups_torch.vllm import HostChunkStore

from kvgroups_core import EngineGroupInfo, EngineKVFormat, KVLayerGroupsManager

CHUNK = 256


def vllm_caches(layers: int, blocks: int, bs: int, heads: int, head: int, device: str) -> list:
    """One backing buffer, per-layer [B, H, N, 2*HS] views with NHD strides (vLLM's LBNHC),
    viewed the way the adapter does: [B, N, H, 2*HS]."""
    buf = torch.randn(layers, blocks, bs, heads, 2 * head, device=device).to(torch.bfloat16)
    logical = [buf[i].permute(0, 2, 1, 3) for i in range(layers)]  # what vLLM registers
    return [t.permute(0, 2, 1, 3) for t in logical]


def timer(device: str):
    if device == "cuda":

        def run(fn, reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(reps):
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            return statistics.median(times)
    else:

        def run(fn, reps):
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)

    return run


def ceiling_us(nbytes: int, direction: str, device: str, measure, reps: int) -> float:
    """A plain copy of the payload between the same memories."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    src, dst = (dev, host) if direction == "store" else (host, dev)
    for _ in range(3):  # warm-up: first touch of fresh pages, thread pools
        dst.copy_(src)
    return measure(lambda: dst.copy_(src, non_blocking=True), reps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU, 4 layers, 1-2 chunks")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--chunks", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", help="append the JSON lines to this file too")
    args = ap.parse_args(argv)
    if args.tiny:
        device, layers, chunks, bs, heads, head, reps = "cpu", 4, [1, 2], 16, 2, 64, 3
        torch.set_num_threads(1)  # small CPU copies: thread hand-offs would dominate
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --tiny for the CPU run", file=sys.stderr)
            return 2
        device, layers, bs, heads, head, reps = "cuda", args.layers, 16, 8, 128, args.reps
        chunks = [int(c) for c in args.chunks.split(",")]
    per_chunk = CHUNK // bs
    blocks = max(chunks) * per_chunk * 2 + 8
    caches = vllm_caches(layers, blocks, bs, heads, head, device)
    fmt = EngineKVFormat.NL_X_NB_BS_NH_CS
    info = EngineGroupInfo(
        engine_group_id=0, layer_indices=tuple(range(layers)), tokens_per_block=bs
    )
    manager = KVLayerGroupsManager(caches, fmt, [info], lmcache_tokens_per_chunk=CHUNK)
    store = HostChunkStore(manager, caches, capacity=max(chunks))
    page_bytes = bs * heads * 2 * head * 2
    measure = timer(device)
    gen = torch.Generator().manual_seed(0)
    base = dict(
        ids="host",
        runtime="torch",
        path="cuda" if device == "cuda" else "cpu",
        placement="pinned" if store.pinned else "cpu",
        layers=layers,
        page_bytes=page_bytes,
    )
    records = []
    for n in chunks:
        ids = {0: torch.randperm(blocks, generator=gen)[: n * per_chunk].tolist()}
        entries = list(range(n))
        nbytes = n * sum(store.object_bytes)
        calls = {
            "store": ("store", lambda ids=ids, entries=entries: store.save(ids, entries)),
            "load": ("load", lambda ids=ids, entries=entries: store.load(ids, entries)),
        }
        if store.layerwise:
            calls["layerwise"] = (
                "store",
                lambda ids=ids, entries=entries: [
                    store.save_layer(ids, entries, layer) for layer in range(layers)
                ],
            )
        for call, (direction, fn) in calls.items():
            fn()  # warm-up (first-call binding and kernel load)
            t = measure(fn, reps)
            c = ceiling_us(nbytes, direction, device, measure, reps)
            rec = dict(
                base,
                call=call,
                direction=direction,
                chunks=n,
                bytes=nbytes,
                time_us=round(t, 2),
                gbps=round(2 * nbytes / t / 1e3, 3),
                ceiling_gbps=round(2 * nbytes / c / 1e3, 3),
                frac_of_ceiling=round(c / t, 3),
            )
            records.append(rec)
        if not store.layerwise:
            records.append(
                dict(
                    base,
                    call="layerwise",
                    direction="store",
                    chunks=n,
                    bytes=nbytes,
                    skipped="kvgroups has no layers= on store yet",
                )
            )
    for rec in records:
        print(json.dumps(rec), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
