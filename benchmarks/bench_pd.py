"""Prefill -> decode over NIXL between two processes: descriptors per request, bandwidth against
the same run's copy, and time to the first layer of a layer-streamed pull.

A writer process (this script with ``--writer``) holds vLLM-shaped caches (one
``[blocks, tokens, heads, K|V]`` view per layer, block 16, bf16) and a pool of memory objects,
both on the GPU (NIXL ``VRAM``) or, with ``--tiny``, in host memory (``DRAM``). It stores each
request's chunks into pool entries and publishes them. This process is the reader: it pulls
with the public reader (``kvgroups_transport.Receiver``) and loads into its own caches. Models:
``llama`` (full attention) and ``hybrid`` (every other layer a 1024-token sliding window in its
own engine group, so its objects move only the last chunks). Per chunk count it reports

- ``pull``: ``Receiver.begin/pull/wait`` of every chunk into staging entries (consecutive on
  both sides), and ``pull_scattered`` (writer entries not consecutive); ``pull_partial``: the
  reader already holds all but the last chunk;
- ``pull_load``: the same plus ``load`` into the caches;
- ``first_layer``: pull and load of layer 0 only (its byte ranges), against ``pull_load``:
  when a decode engine can start its first layer.

Fields: call, model, transport, memory, chunks, tokens, layers, object_groups, descriptors
(ours), posted_descriptors (NIXL's count after its own merging), nixl_connector_descriptors
(what vLLM's NixlConnector prepares for the same request: blocks x layers x 2), bytes, time_us
and transfer_us (medians; transfer_us is post-to-done of the NIXL requests alone), gbps
(payload), ceiling_gbps (the same run's copy of the same bytes between two buffers of that
memory: device-to-device on a GPU, memcpy on the host) and frac_of_ceiling.

    python benchmarks/bench_pd.py                # CUDA, 32 layers, 8 x 128 heads, 1, 4, 16 chunks
    python benchmarks/bench_pd.py --tiny         # CPU, seconds (CI runs this)
    python benchmarks/bench_pd.py --out results.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "backends")]  # runs from a checkout, no install

from kvgroups_transport import (  # noqa: E402
    ObjectPool,
    Publication,
    Receiver,
    get_transport,
    nixl_connector_descriptors,
    object_sizes,
    publish,
)

from kvgroups_core import (  # noqa: E402
    EngineGroupInfo,
    EngineKVFormat,
    KVLayerGroupsManager,
    prepare,
    store,
)

CHUNK = 256
BS = 16
WINDOW = 1024


def shape(tiny: bool) -> dict:
    if tiny:
        return dict(layers=4, heads=2, head=64, chunks=[1, 2], device="cpu", reps=3)
    return dict(layers=32, heads=8, head=128, chunks=[1, 4, 16], device="cuda", reps=7)


def caches_and_manager(model: str, s: dict, blocks: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(s["layers"]):
        x = torch.randint(
            -(2**15),
            2**15,
            (blocks, BS, s["heads"], 2 * s["head"]),
            generator=gen,
            dtype=torch.int16,
        ).view(torch.bfloat16)
        caches.append(x.to(s["device"]))
    layers = list(range(s["layers"]))
    if model == "llama":
        infos = [
            EngineGroupInfo(engine_group_id=0, layer_indices=tuple(layers), tokens_per_block=BS)
        ]
    else:  # even layers full attention, odd layers a sliding window (two engine groups)
        infos = [
            EngineGroupInfo(
                engine_group_id=0, layer_indices=tuple(layers[0::2]), tokens_per_block=BS
            ),
            EngineGroupInfo(
                engine_group_id=1,
                layer_indices=tuple(layers[1::2]),
                tokens_per_block=BS,
                sw_size_tokens=WINDOW,
            ),
        ]
    manager = KVLayerGroupsManager(
        caches, EngineKVFormat.NL_X_NB_BS_NH_CS, infos, lmcache_tokens_per_chunk=CHUNK
    )
    return caches, manager


def block_ids(manager, n: int, blocks: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    per = n * CHUNK // BS
    return {
        g.engine_group_idx: torch.randperm(blocks, generator=gen)[:per].tolist()
        for g in manager.kernel_groups
    }


# --- the writer process ---------------------------------------------------------------------


def writer(args: argparse.Namespace) -> None:
    s = shape(args.tiny)
    out = Path(args.writer)
    top = max(s["chunks"])
    blocks = 2 * top * CHUNK // BS + 8
    transport = get_transport("nixl", name="bench-writer", publication_ttl_s=3600)
    pubs = {}
    for model in ("llama", "hybrid"):
        caches, manager = caches_and_manager(model, s, blocks, seed=1)
        pool = ObjectPool.allocate(f"pool-{model}", object_sizes(manager), 2 * top, like=caches[0])
        transport.register_pool(pool.pool_id, pool.buffers, pool.object_nbytes)
        for n in s["chunks"]:
            ids = block_ids(manager, n, blocks, seed=n)
            store(manager, caches, ids, pool.writable_rows(range(n)))
            scattered = list(range(2 * n - 2, -1, -2))  # descending, every other entry
            for c, entry in enumerate(scattered):
                one = {g: i[c * CHUNK // BS : (c + 1) * CHUNK // BS] for g, i in ids.items()}
                store(manager, caches, one, pool.writable_rows([entry]))
            if caches[0].is_cuda:
                torch.cuda.synchronize()
            for kind, entries in (("consecutive", list(range(n))), ("scattered", scattered)):
                pubs[f"{model}-{kind}-{n}"] = publish(
                    transport, manager, f"{model}/{kind}/{n}", pool, entries
                ).to_dict()
    (out / "ready.json").write_text(json.dumps(pubs))
    while not (out / "stop").exists():
        time.sleep(0.05)
    transport.close()


# --- the reader (this process) --------------------------------------------------------------


def median_us(fn, reps: int, sync) -> float:
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def copy_ceiling_us(nbytes: int, device: str, reps: int, sync) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    return median_us(lambda: dst.copy_(src), reps, sync)


def measure(rx, prepared, pub, ids, first, layers, reps, device, sync) -> dict:
    """One pull (and load, with ``prepared``), timed over ``reps`` after a warm-up."""
    seen = {}

    def once():
        job = rx.begin(pub, first_chunk=first)
        rx.pull(job, layers=layers)
        rx.wait(job)
        if prepared is not None:
            prepared.load(rx.objects(job), ids, layers=layers)
        rx.end(job, release_remote=False)
        seen.update(
            descriptors=job.descriptors,
            posted=job.posted_descriptors,
            nbytes=job.nbytes,
            transfer_us=max(h.stats.seconds for h in job.handles) * 1e6,
        )

    once()  # warm-up: handshake, registration, first-call binding
    transfers = []

    def timed():
        once()
        transfers.append(seen["transfer_us"])

    t = median_us(timed, reps, sync)
    ceiling = copy_ceiling_us(max(seen["nbytes"], 1), device, reps, sync)
    return dict(
        descriptors=seen["descriptors"],
        posted_descriptors=seen["posted"],
        bytes=seen["nbytes"],
        time_us=round(t, 1),
        transfer_us=round(statistics.median(transfers), 1),
        gbps=round(seen["nbytes"] / t / 1e3, 3),
        ceiling_gbps=round(seen["nbytes"] / ceiling / 1e3, 3),
        frac_of_ceiling=round(ceiling / t, 3),
    )


def reader(args: argparse.Namespace, pubs: dict) -> list[dict]:
    s = shape(args.tiny)
    device = s["device"]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    top = max(s["chunks"])
    blocks = 2 * top * CHUNK // BS + 8
    transport = get_transport("nixl", name="bench-reader")
    records = []
    for model in ("llama", "hybrid"):
        caches, manager = caches_and_manager(model, s, blocks, seed=2)
        prepared = prepare(manager, caches)
        rx = Receiver(manager, transport, capacity=top, like=caches[0], name=f"stage-{model}")
        base = dict(
            model=model,
            transport="nixl",
            layers=s["layers"],
            memory="VRAM" if device == "cuda" else "DRAM",
            object_groups=manager.num_object_groups,
            ucx_tls=os.environ.get("UCX_TLS", "default"),
        )
        for n in s["chunks"]:
            ids = block_ids(manager, n, blocks, seed=n)
            baseline = nixl_connector_descriptors(n * CHUNK // BS, s["layers"])

            def run(
                kind,
                first=0,
                load=False,
                layers=None,
                n=n,
                ids=ids,
                rx=rx,
                prepared=prepared,
                model=model,
            ):
                pub = Publication.from_dict(pubs[f"{model}-{kind}-{n}"])
                later = {g: i[first * CHUNK // BS :] for g, i in ids.items()}
                return measure(
                    rx,
                    prepared if load else None,
                    pub,
                    later,
                    first,
                    layers,
                    s["reps"],
                    device,
                    sync,
                )

            cases = {
                "pull": run("consecutive"),
                "pull_scattered": run("scattered"),
                "pull_partial": run("consecutive", first=n - 1),
                "pull_load": run("consecutive", load=True),
                "first_layer": run("consecutive", load=True, layers=[0]),
            }
            calls = {
                "pull": "Receiver.begin+pull+wait",
                "pull_scattered": "Receiver.begin+pull+wait",
                "pull_partial": "Receiver.begin+pull+wait",
                "pull_load": "Receiver.begin+pull+wait+PreparedTransfer.load",
                "first_layer": "Receiver.pull(layers=[0])+wait+load(layers=[0])",
            }
            for case, rec in cases.items():
                records.append(
                    dict(
                        base,
                        case=case,
                        call=calls[case],
                        chunks=n,
                        tokens=n * CHUNK,
                        nixl_connector_descriptors=baseline,
                        **rec,
                    )
                )
            records[-1]["whole_request_us"] = cases["pull_load"]["time_us"]
    transport.close()
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU, 4 layers, 1-2 chunks")
    ap.add_argument("--out", help="append the JSON lines to this file too")
    ap.add_argument("--writer", help=argparse.SUPPRESS)  # the writer process's folder
    args = ap.parse_args(argv)
    if args.writer:
        writer(args)
        return 0
    if not args.tiny and not torch.cuda.is_available():
        print("no CUDA device: use --tiny for the CPU run", file=sys.stderr)
        return 2
    if args.tiny:
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, __file__, "--writer", tmp] + (["--tiny"] if args.tiny else [])
        proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            deadline = time.monotonic() + 300
            while not (Path(tmp) / "ready.json").exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    print("the writer process failed to start", file=sys.stderr)
                    return 1
                time.sleep(0.05)
            time.sleep(0.1)
            records = reader(args, json.loads((Path(tmp) / "ready.json").read_text()))
        finally:
            (Path(tmp) / "stop").write_text("")
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    for rec in records:
        print(json.dumps(rec), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
