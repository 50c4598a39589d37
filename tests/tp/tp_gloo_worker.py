"""One rank of a gloo tensor-parallel group (run by test_tp_gloo.py as a separate process).

    python tp_gloo_worker.py RANK WORLD INIT_FILE OUT_DIR [CANONICAL_NPZ]

Every rank builds the same whole model (one seed), takes its shard, and then: checks the
group's grouping; stores its shard and all-gathers the parts, which must merge to the TP=1
objects; stores straight into one file-backed buffer shared by the group (TP-native layout);
loads its split of canonical objects (CANONICAL_NPZ, written by a run of another degree, or a
TP=1 store) and compares its heads with a TP=1 load; and finally sees a mismatching rank named.
Results go to OUT_DIR/rank{RANK}.json; rank 0 also writes OUT_DIR/canonical.npz.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from kvgroups_torch import check_same_grouping

from kvgroups_core import (
    KVGroupsValueError,
    load,
    merge_shards,
    object_nbytes,
    split_canonical,
    store,
)
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

MODEL = MODELS["hybrid-full-sw-gqa2"]
NUM_CHUNKS = 3


def same(got: list, want: list) -> bool:
    return len(got) == len(want) and all(
        np.array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
        for g, w in zip(got, want)
    )


def main(rank: int, world: int, init_file: str, out_dir: str, canonical_in: str | None) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    out = Path(out_dir)
    rng = np.random.default_rng(1234)
    full = make_model_caches(MODEL, rng)
    before = make_model_caches(MODEL, rng)
    ids = block_ids(MODEL, NUM_CHUNKS, rng)
    reference = reference_store(MODEL, full, ids)
    result: dict = {"rank": rank, "world": world}

    shard = to_backend(shard_caches(MODEL, full, rank, world), "torch")
    mine = manager(MODEL, shard, rank, world)
    result["fingerprint"] = check_same_grouping(mine)
    result["own_fingerprint"] = mine.fingerprint()
    # A subgroup of the world (new_group is collective: every rank creates it).
    pair = dist.new_group([0, 1])
    result["pair_fingerprint"] = check_same_grouping(mine, group=pair) if rank < 2 else None

    # Canonical layout: each rank stores its shard; the parts are gathered and merged.
    objects = store(mine, shard, ids)
    gathered = []
    for obj in objects:
        parts = [torch.empty_like(obj) for _ in range(world)]
        dist.all_gather(parts, obj)
        gathered.append(parts)
    per_rank = [[gathered[og][r] for og in range(len(objects))] for r in range(world)]
    managers = [manager(MODEL, shard_caches(MODEL, full, r, world), r, world) for r in range(world)]
    merged = merge_shards(managers, per_rank)
    result["merged_is_tp1"] = same([m.numpy() for m in merged], reference)
    if rank == 0:
        np.savez(out / "canonical.npz", *[m.numpy() for m in merged])

    # TP-native layout: every rank stores into one file-backed buffer, no collective.
    native = manager(MODEL, shard, rank, world, object_layout="tp_native")
    sizes = [object_nbytes(native, og) for og in range(native.num_object_groups)]
    paths = [str(out / f"shared_og{og}.bin") for og in range(len(sizes))]
    if rank == 0:
        for path, n in zip(paths, sizes):
            torch.from_file(path, shared=True, size=NUM_CHUNKS * n, dtype=torch.uint8).fill_(0)
    dist.barrier()
    shared = [
        torch.from_file(p, shared=True, size=NUM_CHUNKS * n, dtype=torch.uint8).view(NUM_CHUNKS, n)
        for p, n in zip(paths, sizes)
    ]
    store(native, shard, ids, shared)
    dist.barrier()
    natives = [
        manager(MODEL, shard_caches(MODEL, full, r, world), r, world, object_layout="tp_native")
        for r in range(world)
    ]
    result["shared_is_native"] = same(
        [s.numpy() for s in shared], split_canonical(native, reference)
    )
    result["shared_merges_to_tp1"] = same(
        [m.numpy() for m in merge_shards(natives, [shared] * world)], reference
    )

    # Load this rank's split of canonical objects written at another degree.
    if canonical_in:
        with np.load(canonical_in) as npz:
            canonical = [npz[f"arr_{i}"] for i in range(len(npz.files))]
    else:
        canonical = reference
    caches = to_backend(shard_caches(MODEL, before, rank, world), "torch")
    load(mine, split_canonical(mine, [torch.from_numpy(c) for c in canonical]), caches, ids)
    want = shard_caches(MODEL, reference_load(MODEL, canonical, before, ids), rank, world)
    result["loaded_heads_match_tp1_load"] = same([c.numpy() for c in leaves(caches)], leaves(want))

    # A rank whose grouping differs (another chunk size) is named, on every rank.
    odd = world - 1
    other = manager(
        MODEL, shard, rank, world, **({"lmcache_tokens_per_chunk": 128} if rank == odd else {})
    )
    try:
        check_same_grouping(other)
        result["mismatch_error"] = None
    except KVGroupsValueError as exc:
        result["mismatch_error"] = str(exc)

    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]), int(args[1]), args[2], args[3], args[4] if len(args) > 4 else None)
