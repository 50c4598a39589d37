"""The writer or the reader of JAX caches over jax.experimental.transfer (test_pd_jax.py).

    python pd_jax_worker.py writer DIR
    python pd_jax_worker.py reader DIR

The writer stores every model's JAX caches (kvgroups' JAX backend) and publishes the objects:
whole (TP=1), a second time for a partial pull, per rank of a TP=2 group (two transports, one
per rank, reading 2 -> 1), and TP=1 for two reader ranks (1 -> 2); plus one publication it
releases at once. The reader pulls, assembles and loads each, compares with the TP=1 NumPy
reference, and checks the refusals. Results: DIR/reader.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from kvgroups_transport import (
    FingerprintMismatchError,
    Publication,
    PublicationReleasedError,
    Receiver,
    get_transport,
    object_sizes,
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
)

CHUNKS = 3
NAMES = ("mha-nhd", "hybrid-full-sw-gqa2", "mla-indexer")


def data(name):
    model = MODELS[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    full = make_model_caches(model, rng)
    before = make_model_caches(model, rng)
    ids = block_ids(model, CHUNKS, rng)
    return model, full, before, ids


def jx(tree):
    return [jnp.asarray(x) for x in tree]


def jids(ids):
    return {g: jnp.asarray(i) for g, i in ids.items()}


def wait_for(path: Path, timeout: float = 180.0) -> Path:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)
    return path


def write(path: Path, d: dict) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(d))
    path.with_suffix(".tmp").rename(path)


def writer(out: Path) -> None:
    ranks = [get_transport("jax_transfer", publication_ttl_s=300) for _ in range(2)]
    for name in NAMES:
        model, full, _, ids = data(name)
        for tp in (1, 2):
            endpoints = [t.endpoint() for t in ranks[:tp]]
            for r in range(tp):
                shard = jx(shard_caches(model, full, r, tp))
                m = manager(model, shard, r, tp)
                objects = store(m, shard, jids(ids))
                pool = f"{name}-tp{tp}"
                ranks[r].register_pool(pool, objects, object_sizes(m))
                fp = m.fingerprint(across_degrees=True)
                kw = dict(chunk_tokens=model.chunk, fingerprint=fp, tp_size=tp, endpoints=endpoints)
                pubs = {f"{name}-tp{tp}": ranks[r].publish(f"{name}/tp{tp}", pool, [0, 1, 2], **kw)}
                if tp == 1:
                    pubs[f"{name}-partial"] = ranks[r].publish(
                        f"{name}/partial", pool, [0, 1, 2], **kw
                    )
                    pubs[f"{name}-to2"] = ranks[r].publish(
                        f"{name}/to2", pool, [0, 1, 2], readers=2, **kw
                    )
                if r == 0:
                    for key, pub in pubs.items():
                        write(out / f"pub-{key}.json", pub.to_dict())
    model, full, _, ids = data("mha-nhd")
    m = manager(model, jx(full))
    fp = m.fingerprint(across_degrees=True)
    gone = ranks[0].publish(
        "released", "mha-nhd-tp1", [0, 1, 2], chunk_tokens=model.chunk, fingerprint=fp
    )
    ranks[0].release("released")
    write(out / "pub-released.json", gone.to_dict())
    deadline = time.monotonic() + 240
    while any(t.published() for t in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    write(out / "writer.json", {"unreleased": sorted(set().union(*(t.published() for t in ranks)))})


def same(got, want) -> bool:
    return all(
        np.array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
        for g, w in zip(got, want)
    )


def pull_load(rx, pub, m, caches, ids, first=0):
    job = rx.begin(pub, first_chunk=first)
    rx.pull(job)
    rx.wait(job)
    n = len(next(iter(ids.values())))
    later = {g: i[first * n // CHUNKS :] for g, i in ids.items()}
    new = load(m, rx.objects(job), caches, jids(later))
    rx.end(job)
    return new, job


def reader(out: Path) -> None:
    transport = get_transport("jax_transfer", side_channel_timeout_s=5.0)
    result = {}
    for name in NAMES:
        model, full, before, ids = data(name)
        canonical = reference_store(model, full, ids)
        entry = {}
        for key, d, first in (
            (f"{name}-tp1", 1, 0),
            (f"{name}-partial", 1, 2),
            (f"{name}-tp2", 1, 0),
            (f"{name}-to2", 2, 0),
        ):
            pub = Publication.from_dict(json.loads(wait_for(out / f"pub-{key}.json").read_text()))
            exact = True
            for r in range(d):
                caches = jx(shard_caches(model, before, r, d))
                m = manager(model, caches, r, d)
                rx = Receiver(m, transport, capacity=4)
                new, job = pull_load(rx, pub, m, caches, ids, first)
                later = {g: i[first * len(i) // CHUNKS :] for g, i in ids.items()}
                want = reference_load(model, [c[first:] for c in canonical], before, later)
                exact &= same(leaves(new), leaves(shard_caches(model, want, r, d)))
            entry[key] = {
                "exact": bool(exact),
                "descriptors": job.descriptors,
                "chunks": [len(c) for c in job.chunks],
            }
        result[name] = entry
    model, _, before, ids = data("mha-nhd")
    caches = jx(before)
    result["refusals"] = {}
    for key, m in (
        ("mismatch", manager(model, caches, lmcache_tokens_per_chunk=2 * model.chunk)),
        ("released", manager(model, caches)),
    ):
        pub = Publication.from_dict(
            json.loads(
                wait_for(
                    out / f"pub-{'mha-nhd-tp1' if key == 'mismatch' else 'released'}.json"
                ).read_text()
            )
        )
        try:
            pull_load(Receiver(m, transport, capacity=4), pub, m, caches, ids)
            result["refusals"][key] = None
        except (FingerprintMismatchError, PublicationReleasedError) as exc:
            result["refusals"][key] = type(exc).__name__
    write(out / "reader.json", result)
    transport.close()


if __name__ == "__main__":
    (writer if sys.argv[1] == "writer" else reader)(Path(sys.argv[2]))
