"""One rank of a prefill (writer) or decode (reader) group, moving objects over a transport.

    python pd_worker.py ROLE RANK WORLD DIR TRANSPORT OTHER_WORLD

ROLE is ``prefill`` or ``decode``; ranks of a group agree over gloo (``DIR/init-ROLE``) when
WORLD > 1. Every process builds the same whole-model caches (one seed per model), so each side
knows what the other stored. Publications go through files (``DIR/pub-NAME.json``, written by
prefill rank 0 with every rank's endpoint); results to ``DIR/ROLE-RANK.json``.

What runs:

- per model of MODELS, prefill stores 3 chunks into pool entries and publishes; each
  decode rank pulls what its heads need, loads its shard, and compares with the TP=1 load of
  the canonical objects (its heads; every other block untouched). Then a partial pull (the
  reader already holds chunk 0) and, on equal degrees, a layer-streamed pull (prefill stores
  layer by layer after the reader subscribed, publishing each layer as it is written).
  With one writer and one reader, the reader then runs the failure cases: a fingerprint
  mismatch, a released publication, a stopped writer (SIGSTOP: the pull times out), a killed
  writer (SIGKILL: the peer is gone). Each must raise its typed error and leave the reader's
  caches bit for bit as they were.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from kvgroups_torch import check_same_grouping
from kvgroups_transport import (
    FingerprintMismatchError,
    ObjectPool,
    PeerUnavailableError,
    Publication,
    PublicationReleasedError,
    Receiver,
    TransferTimeoutError,
    get_transport,
    object_sizes,
    publish,
)

from kvgroups_core import load, store
from tests.support.tp_models import (
    MODELS,
    block_ids,
    leaves,
    make_model_caches,
    manager,
    reference_load,
    reference_store,
    shard_caches,
    to_backend,
)

CHUNKS = 3
DEVICE = os.environ.get("KVG_PD_DEVICE", "cpu")  # "cuda": caches and pools in device memory
EXACT_MODELS = ("mha-nhd", "hybrid-full-sw-gqa2", "mla-indexer")
TP_MODELS = ("hybrid-full-sw-gqa2", "mla-indexer")


def wait_for(path: Path, timeout: float = 120.0) -> Path:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)
    time.sleep(0.05)  # written with a rename, but be generous on slow file systems
    return path


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(path)


def world_data(model_name: str):
    model = MODELS[model_name]
    rng = np.random.default_rng(sum(map(ord, model_name)))
    full = make_model_caches(model, rng)
    before = make_model_caches(model, rng)
    ids = block_ids(model, CHUNKS, rng)
    return model, full, before, ids


def host(x):
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def same(got, want) -> bool:
    return all(
        np.array_equal(host(g).view(np.uint8), host(w).view(np.uint8)) for g, w in zip(got, want)
    )


def settle() -> None:
    """Stores on a GPU are queued: readers may only see the bytes once they ran."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def torch_caches(structure):
    """A NumPy structure as torch tensors on DEVICE."""
    if isinstance(structure, list):
        return [torch_caches(x) for x in structure]
    return to_backend(structure, "torch").to(DEVICE)


def gather(obj, world):
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def models_for(scenario_world: tuple[int, int]) -> tuple[str, ...]:
    return EXACT_MODELS if scenario_world == (1, 1) else TP_MODELS


# --- the writer ---------------------------------------------------------------------------


def prefill(rank: int, world: int, out: Path, transport_name: str, readers: int) -> None:
    transport = get_transport(transport_name, name=f"prefill{rank}", publication_ttl_s=300)
    names = models_for((world, readers))
    stream = []
    for name in names:
        model, full, _, ids = world_data(name)
        shard = torch_caches(shard_caches(model, full, rank, world))
        m = manager(model, shard, rank, world)
        if world > 1:
            check_same_grouping(m)
        pool = ObjectPool.allocate(f"pool-{name}", object_sizes(m), 8, like=leaves(shard)[0])
        transport.register_pool(pool.pool_id, pool.buffers, pool.object_nbytes)
        entries = [5, 6, 7]  # consecutive: one descriptor per object group
        store(m, shard, ids, pool.writable_rows(entries))
        settle()
        endpoints = gather(transport.endpoint(), world)
        pub = publish(transport, m, f"{name}/whole", pool, entries, endpoints=endpoints)
        partial = publish(transport, m, f"{name}/partial", pool, entries, endpoints=endpoints)
        if rank == 0:
            write_json(out / f"pub-{name}-whole.json", pub.to_dict())
            write_json(out / f"pub-{name}-partial.json", partial.to_dict())
        if world == readers:
            # Layer streaming: published with no layer ready; written once the reader waits.
            other = [0, 1, 2]
            streamed = publish(
                transport, m, f"{name}/stream", pool, other, endpoints=endpoints, layers_ready=0
            )
            if rank == 0:
                write_json(out / f"pub-{name}-stream.json", streamed.to_dict())
            stream.append((name, m, shard, ids, pool, other))
    for name, m, shard, ids, pool, entries in stream:
        wait_for(out / f"subscribed-{name}")
        layers = sorted(i for g in m.kernel_groups for i in g.layer_indices)
        for i, layer in enumerate(layers):
            store(m, shard, ids, pool.writable_rows(entries), layers=[layer])
            settle()
            transport.mark_ready(f"{name}/stream", i + 1)
            time.sleep(0.2)
    failures = world == readers == 1
    if failures:
        failures_writer(out, transport)
    deadline = time.monotonic() + 240
    while set(transport.published()) - {"ok"} and time.monotonic() < deadline:
        time.sleep(0.1)
    left = sorted(set(transport.published()) - {"ok"})
    write_json(out / f"prefill-{rank}.json", {"unreleased": left})
    if failures:
        time.sleep(300)  # the reader stops and then kills this process
    transport.close()


# --- the reader ---------------------------------------------------------------------------


def decode(rank: int, world: int, out: Path, transport_name: str, writers: int) -> None:
    transport = get_transport(transport_name, name=f"decode{rank}")
    result: dict = {}
    for name in models_for((writers, world)):
        model, full, before, ids = world_data(name)
        canonical = reference_store(model, full, ids)
        caches = torch_caches(shard_caches(model, before, rank, world))
        m = manager(model, caches, rank, world)
        if world > 1:
            check_same_grouping(m)
        rx = Receiver(m, transport, capacity=8, like=leaves(caches)[0], name=f"staging-{name}")
        # Whole request.
        pub = Publication.from_dict(
            json.loads(wait_for(out / f"pub-{name}-whole.json").read_text())
        )
        job = rx.begin(pub)
        rx.pull(job)
        rx.wait(job)
        load(m, rx.objects(job), caches, ids)
        want = shard_caches(model, reference_load(model, canonical, before, ids), rank, world)
        entry = {
            "exact": same(leaves(caches), leaves(want)),
            "descriptors": job.descriptors,
            "posted": job.posted_descriptors,
            "bytes": job.nbytes,
            "src_ranks": list(job.reads.src_ranks),
            "chunks": [len(c) for c in job.chunks],
        }
        rx.end(job)
        # Partial: chunk 0 is already here; only chunks 1 and 2 move.
        caches = torch_caches(shard_caches(model, before, rank, world))
        m = manager(model, caches, rank, world)
        rx.manager = m
        pub = Publication.from_dict(
            json.loads(wait_for(out / f"pub-{name}-partial.json").read_text())
        )
        job = rx.begin(pub, first_chunk=1)
        rx.pull(job)
        rx.wait(job)
        later = {g: i[len(i) // CHUNKS :] for g, i in ids.items()}
        load(m, rx.objects(job), caches, later)
        want = shard_caches(
            model, reference_load(model, [c[1:] for c in canonical], before, later), rank, world
        )
        entry.update(
            partial_exact=same(leaves(caches), leaves(want)),
            partial_chunks=[len(c) for c in job.chunks],
            partial_bytes=job.nbytes,
        )
        rx.end(job)
        if writers == world:
            entry.update(stream(name, model, rank, world, out, rx, before, ids, canonical))
        result[name] = entry
    if writers == world == 1:
        result["failures"] = failures_reader(out, transport)
    write_json(out / f"decode-{rank}.json", result)
    transport.close()


def stream(name, model, rank, world, out, rx, before, ids, canonical) -> dict:
    caches = torch_caches(shard_caches(model, before, rank, world))
    m = manager(model, caches, rank, world)
    rx.manager = m
    pub = Publication.from_dict(json.loads(wait_for(out / f"pub-{name}-stream.json").read_text()))
    job = rx.begin(pub)
    seen = []
    (out / f"subscribed-{name}").write_text("")  # every reader rank: any one starts it
    layers = sorted(i for g in m.kernel_groups for i in g.layer_indices)
    for i, layer in enumerate(layers):
        while True:
            ready = min(rx.transport.layers_ready(pub, r) for r in job.reads.src_ranks)
            if ready is None or ready > i:
                break
            time.sleep(0.01)
        seen.append(ready)
        rx.pull(job, layers=[layer])
        rx.wait(job)
        load(m, rx.objects(job), caches, ids, layers=[layer])
    rx.end(job)
    want = shard_caches(model, reference_load(model, canonical, before, ids), rank, world)
    return {
        "stream_exact": same(leaves(caches), leaves(want)),
        "stream_ready_seen": seen,
        "stream_layers": len(layers),
    }


# --- failures -----------------------------------------------------------------------------


def failures_writer(out: Path, transport) -> None:
    """Two more publications for the failure cases: "ok" (kept) and "released"."""
    model, full, _, ids = world_data("hybrid-full-sw-gqa2")
    shard = torch_caches(full)
    m = manager(model, shard)
    pool = ObjectPool.allocate("failures", object_sizes(m), 4, like=shard[0])
    transport.register_pool(pool.pool_id, pool.buffers, pool.object_nbytes)
    store(m, shard, ids, pool.writable_rows([0, 1, 2]))
    settle()
    for rid in ("ok", "released"):
        write_json(out / f"pub-{rid}.json", publish(transport, m, rid, pool, [0, 1, 2]).to_dict())
    transport.release("released")
    (out / "writer.pid").write_text(str(os.getpid()))


def failures_reader(out: Path, transport) -> dict:
    """Mismatch, released, stopped writer (timeout), killed writer (gone), in that order."""
    transport.timeout_s = 2.0
    model, _, before, ids = world_data("hybrid-full-sw-gqa2")
    caches = torch_caches(before)
    m = manager(model, caches)
    rx = Receiver(m, transport, capacity=4, like=caches[0], timeout_s=3.0, name="failures")
    ok = Publication.from_dict(json.loads(wait_for(out / "pub-ok.json").read_text()))
    released = Publication.from_dict(json.loads(wait_for(out / "pub-released.json").read_text()))
    pid = int(wait_for(out / "writer.pid").read_text())
    result = {}

    def attempt(what, pub, manager_=m):
        rx.manager = manager_
        t0 = time.monotonic()
        job = None
        try:
            job = rx.begin(pub)
            rx.pull(job)
            rx.wait(job)
            load(m, rx.objects(job), caches, ids)
            error = None
        except Exception as exc:  # noqa: BLE001 - the test reads the class and message
            error = (type(exc).__name__, str(exc))
            for c in (
                FingerprintMismatchError,
                PublicationReleasedError,
                TransferTimeoutError,
                PeerUnavailableError,
            ):
                if isinstance(exc, c):
                    error = (c.__name__, str(exc))
        if job is not None and job.entries:
            rx.end(job, release_remote=False)
        result[what] = {
            "error": error,
            "seconds": time.monotonic() - t0,
            "untouched": same(caches, before),
            "descriptors": job.descriptors if job else 0,
        }

    other = manager(model, caches, lmcache_tokens_per_chunk=2 * model.chunk)
    attempt("mismatch", ok, other)
    attempt("released", released)
    wait_for(out / "prefill-0.json")  # the writer has recorded its releases
    os.kill(pid, signal.SIGSTOP)
    attempt("timeout", ok)
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    attempt("gone", ok)
    return result


def main() -> None:
    role, rank, world, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    transport_name = sys.argv[5] if len(sys.argv) > 5 else "nixl"
    torch.set_num_threads(1)
    other = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"file://{out / ('init-' + role)}", rank=rank, world_size=world
        )
    if role == "prefill":
        prefill(rank, world, out, transport_name, other)
    else:
        decode(rank, world, out, transport_name, other)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
