"""Prefill -> decode with kvgroups objects: the writer's pool and publication, the reader's
plan, pull, assembly and load. Engine- and framework-agnostic (the arrays are the engine's;
``kvgroups_core.store`` / ``load`` move them).

Writer::

    pool = ObjectPool.allocate("prefill", object_sizes(manager), capacity, like=caches[0])
    transport.register_pool(pool.pool_id, pool.buffers, pool.object_nbytes)
    store(manager, caches, ids, pool.writable_rows(entries))    # the engine's own store
    pub = publish(transport, manager, "req-1", pool, entries)   # -> pub.to_dict() to the reader

Reader::

    rx = Receiver(manager, transport, capacity=64, like=caches[0])
    job = rx.begin(Publication.from_dict(d), first_chunk=k)   # fingerprints checked here
    rx.pull(job); rx.wait(job)                                # into staging entries only
    load(manager, rx.objects(job), caches, ids_of_chunks_k_to_n)
    rx.end(job)                                               # staging freed, writer released

Nothing reaches the caches before :meth:`Receiver.wait` returned: a failed or timed-out
pull raises there and the staging entries are dropped.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from kvgroups_core import ReadPlan, assemble, object_nbytes, plan_reads
from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError, UnsupportedConfigError
from kvgroups_core.grouping.manager import check_manager
from kvgroups_core.transfer.planner import check_layer_indices

from .base import Publication, TransferHandle, Transport, checked_int
from .errors import FingerprintMismatchError
from .plan import chunks_to_read, pull_copies


def object_sizes(manager: Any) -> list[int]:
    """``object_nbytes`` of every object group."""
    return [object_nbytes(manager, og) for og in range(manager.num_object_groups)]


class ObjectPool:
    """``capacity`` entries per object group: one uint8 ``[capacity, object_nbytes]`` array per
    group (torch or NumPy; JAX arrays are immutable and use the JAX transport's own pools)."""

    def __init__(self, pool_id: str, buffers: Sequence[Any]) -> None:
        shapes = {tuple(b.shape)[0] for b in buffers}
        if not buffers or len(shapes) != 1 or any(len(b.shape) != 2 for b in buffers):
            raise KVGroupsValueError(
                f"buffers: expected [capacity, object_nbytes] arrays of one capacity, got "
                f"shapes {[tuple(b.shape) for b in buffers]}"
            )
        self.pool_id = str(pool_id)
        self.buffers = list(buffers)
        self.capacity = shapes.pop()
        self.object_nbytes = [int(b.shape[1]) for b in buffers]

    @classmethod
    def allocate(
        cls,
        pool_id: str,
        object_nbytes: Sequence[int],
        capacity: int,
        like: Any = None,
        pin_memory: bool = False,
    ) -> "ObjectPool":
        """New pool buffers of ``like``'s framework and device (default: NumPy)."""
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(like, torch.Tensor):
            return cls(
                pool_id,
                [
                    torch.empty(
                        (capacity, n),
                        dtype=torch.uint8,
                        device=like.device,
                        pin_memory=pin_memory and like.device.type == "cpu",
                    )
                    for n in object_nbytes
                ],
            )
        if like is None or isinstance(like, np.ndarray):
            return cls(pool_id, [np.empty((capacity, n), np.uint8) for n in object_nbytes])
        raise UnsupportedConfigError(
            f"like: expected a torch tensor or a NumPy array to allocate pool buffers like, got "
            f"{type(like).__name__} (JAX caches move with the 'jax_transfer' transport)"
        )

    def writable_rows(self, entries: Sequence[int]) -> list:
        """Every object group's rows of consecutive ``entries`` as views, for a store to fill
        in place (non-consecutive entries: KVGroupsValueError; store each run on its own)."""
        entries = [int(s) for s in entries]
        if entries and entries != list(range(entries[0], entries[0] + len(entries))):
            raise KVGroupsValueError(
                f"entries: expected consecutive entries for a store into the pool, got {entries}"
            )
        return self.rows(entries)

    def rows(self, entries: Sequence[int]) -> list:
        """Every object group's rows of ``entries``: views when consecutive, else gathered
        copies (for reading only: use :meth:`writable_rows` to store)."""
        entries = [int(s) for s in entries]
        if not entries:
            return [b[0:0] for b in self.buffers]
        first = entries[0]
        if entries == list(range(first, first + len(entries))):
            return [b[first : first + len(entries)] for b in self.buffers]
        return [b[entries] for b in self.buffers]


def publish(
    transport: Transport,
    manager: Any,
    request_id: str,
    pool: ObjectPool,
    entries: Sequence[int],
    *,
    endpoints: Sequence[dict] | None = None,
    chunk_hashes: Sequence[str] = (),
    layers_ready: int | None = None,
) -> Publication:
    """Publish a request's chunks, stored by ``manager``'s rank into ``entries`` of ``pool``."""
    return transport.publish(
        request_id,
        pool.pool_id,
        entries,
        chunk_tokens=manager.lmcache_tokens_per_chunk,
        fingerprint=manager.fingerprint(across_degrees=True),
        tp_size=manager.tp_size,
        object_layout=manager.object_layout,
        endpoints=endpoints,
        chunk_hashes=chunk_hashes,
        layers_ready=layers_ready,
    )


def check_publication(manager: Any, publication: Publication, reader: str = "this reader") -> None:
    """The writer's grouping must be the reader's (any TP degree): FingerprintMismatchError
    naming both sides otherwise."""
    mine = manager.fingerprint(across_degrees=True)
    # The fingerprint covers the chunk size; a chunk_tokens that disagrees with it is a
    # publication that contradicts itself.
    if publication.fingerprint != mine or publication.chunk_tokens != (
        manager.lmcache_tokens_per_chunk
    ):
        e = publication.endpoints[0] if publication.endpoints else {}
        raise FingerprintMismatchError(
            f"publication.fingerprint: expected the grouping of {reader} (fingerprint "
            f"{mine[:16]}, chunk {manager.lmcache_tokens_per_chunk} tokens, TP "
            f"{manager.tp_size}), got the writer's fingerprint {publication.fingerprint[:16]} "
            f"(request {publication.request_id!r} at {e.get('host')}:{e.get('port')}, chunk "
            f"{publication.chunk_tokens} tokens, TP {publication.tp_size}): the two engines "
            "group the model differently (model, chunk size, windows, formats or dtypes)"
        )


@dataclass
class PullJob:
    """One request being pulled: what to read, where it lands, what is outstanding."""

    publication: Publication
    reads: ReadPlan
    first_chunk: int
    last_chunk: int  # chunks [first_chunk, last_chunk) of the publication move
    chunks: list[list[int]]  # per object group, request chunk indices to move
    pools: dict[int, str]  # source rank -> staging pool id
    entries: list[int]  # staging entry of request chunk first_chunk + i
    handles: list[TransferHandle] = field(default_factory=list)

    @property
    def num_chunks(self) -> int:
        return self.last_chunk - self.first_chunk

    @property
    def descriptors(self) -> int:
        return sum(h.stats.descriptors for h in self.handles)

    @property
    def posted_descriptors(self) -> int:
        return sum(max(h.stats.posted_descriptors, 0) for h in self.handles)

    @property
    def nbytes(self) -> int:
        return sum(h.stats.nbytes for h in self.handles)


class Receiver:
    """The reading side: staging pools registered with the transport, pulls into them.

    Parameters
    ----------
    manager : the reading rank's manager.
    transport : Transport
    capacity : int
        Staging entries (chunks in flight at once, over all requests), in ``[1,
        MAX_STAGING_ENTRIES]``.
    like : array, optional
        Staging buffers are allocated like it (framework and device; default NumPy).
    timeout_s : float
        Deadline of every pull, in seconds (> 0).
    """

    #: The most staging entries a receiver takes: chunks in flight at once, far beyond what an
    #: engine keeps in flight (a bigger ``capacity`` is a mistake, not a need).
    MAX_STAGING_ENTRIES = 1 << 20

    def __init__(
        self,
        manager: Any,
        transport: Transport,
        capacity: int,
        like: Any = None,
        timeout_s: float = 30.0,
        name: str = "staging",
    ) -> None:
        self.manager = check_manager(manager)
        if not isinstance(transport, Transport):
            raise KVGroupsTypeError(
                f"transport: expected a Transport (get_transport(...)), got "
                f"{type(transport).__name__}"
            )
        self.transport = transport
        self.capacity = checked_int(capacity, "capacity", 1, self.MAX_STAGING_ENTRIES + 1)
        if isinstance(timeout_s, (bool, np.bool_)) or not isinstance(
            timeout_s, (int, float, np.integer, np.floating)
        ):
            raise KVGroupsTypeError(
                f"timeout_s: expected a number of seconds, got {type(timeout_s).__name__} "
                f"{timeout_s!r}"
            )
        try:
            seconds = float(timeout_s)
        except OverflowError:  # an int past the float range
            seconds = math.inf
        if not (math.isfinite(seconds) and seconds > 0):
            raise KVGroupsValueError(
                f"timeout_s: expected a finite number of seconds > 0, got {timeout_s!r}"
            )
        self.timeout_s = seconds
        if not isinstance(name, str):
            raise KVGroupsTypeError(f"name: expected a str, got {type(name).__name__}")
        self._like = like
        self._name = name
        self._pools: dict[tuple, list[ObjectPool]] = {}
        self._free = list(range(self.capacity))
        self._layers = frozenset(
            layer for g in self.manager.kernel_groups for layer in g.layer_indices
        )

    def begin(
        self, publication: Publication, *, first_chunk: int = 0, num_chunks: int | None = None
    ) -> PullJob:
        """Plan a pull of chunks ``[first_chunk, num_chunks)`` (default: every published
        chunk) and reserve staging entries for them. Checks the fingerprint first: a mismatch
        raises before anything is reserved."""
        if not isinstance(publication, Publication):
            raise KVGroupsTypeError(
                f"publication: expected a Publication, got {type(publication).__name__}"
            )
        n = publication.num_chunks
        if num_chunks is not None:
            n = checked_int(num_chunks, "num_chunks", 0, publication.num_chunks + 1)
        first_chunk = checked_int(first_chunk, "first_chunk", 0)
        check_publication(self.manager, publication)
        reads = plan_reads(self.manager, publication.tp_size, publication.object_layout)
        arrays = getattr(self.transport, "produces_arrays", False)
        chunks = chunks_to_read(self.manager, n, first_chunk)
        if arrays:  # the transport hands out new arrays: no staging entries
            return PullJob(publication, reads, first_chunk, n, chunks, {}, [])
        pools = self._staging(reads)
        entries = self._take(n - first_chunk)
        return PullJob(
            publication,
            reads,
            first_chunk,
            n,
            chunks,
            {r: pools[i].pool_id for i, r in enumerate(reads.src_ranks)},
            entries,
        )

    def _staging(self, reads: ReadPlan) -> list[ObjectPool]:
        key = (reads.src_tp_size, reads.src_object_layout)
        pools = self._pools.get(key)
        if pools is None:
            sizes = [o.src_nbytes for o in reads.objects]
            pools = []
            for i in range(len(reads.src_ranks)):
                try:
                    pool = ObjectPool.allocate(
                        f"{self._name}-tp{key[0]}-{key[1]}-{i}",
                        sizes,
                        self.capacity,
                        like=self._like,
                    )
                except MemoryError:
                    raise KVGroupsValueError(
                        f"capacity: expected staging entries that fit in memory, got "
                        f"{self.capacity} entries of {sum(sizes)} bytes per writer rank"
                    ) from None
                self.transport.register_pool(pool.pool_id, pool.buffers, pool.object_nbytes)
                pools.append(pool)
            self._pools[key] = pools
        return pools

    def _take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise UnsupportedConfigError(
                f"staging: expected room for {n} chunks, got {len(self._free)} free of "
                f"{self.capacity} staging entries"
            )
        self._free.sort()
        for i in range(len(self._free) - n + 1):  # a run keeps descriptors merged
            if self._free[i + n - 1] - self._free[i] == n - 1:
                taken = self._free[i : i + n]
                del self._free[i : i + n]
                return taken
        taken = self._free[:n]
        del self._free[:n]
        return taken

    def pull(self, job: PullJob, *, layers: Sequence[int] | None = None) -> None:
        """Post the job's transfers (one per writer rank it reads from); ``layers``: only
        those layers' rows (layer streaming; call once per layer set as they are ready)."""
        if not isinstance(job, PullJob):
            raise KVGroupsTypeError(
                f"job: expected a PullJob (from Receiver.begin), got {type(job).__name__}"
            )
        layers = check_layer_indices(layers, self._layers)
        pub = job.publication
        if getattr(self.transport, "produces_arrays", False):
            return self._pull_arrays(job, layers)
        for r in job.reads.src_ranks:
            copies = []
            for reads, chunks in zip(job.reads.objects, job.chunks):
                if r not in reads.ranges or not chunks:
                    continue
                remote = [pub.entries[c] for c in chunks]
                local = [job.entries[c - job.first_chunk] for c in chunks]
                copies.extend(pull_copies(reads, r, remote, local, layers))
            job.handles.append(
                self.transport.pull(pub, r, job.pools[r], copies, timeout=self.timeout_s)
            )

    def _pull_arrays(self, job: PullJob, layers: Sequence[int] | None) -> None:
        if layers is not None:
            raise UnsupportedConfigError(
                f"layers: expected None with the {self.transport.name!r} transport (whole "
                "objects only; layer streaming needs 'nixl')"
            )
        sizes = [o.src_nbytes for o in job.reads.objects]
        for r in job.reads.src_ranks:
            wanted = [
                (og, c)
                for og, (reads, chunks) in enumerate(zip(job.reads.objects, job.chunks))
                if r in reads.ranges
                for c in chunks
            ]
            job.handles.append(
                self.transport.pull_objects(
                    job.publication,
                    r,
                    wanted,
                    sizes,
                    reader=self.manager.tp_rank,
                    timeout=self.timeout_s,
                )
            )

    def _stacked(self, job: PullJob, src_rank: int, og: int) -> Any:
        """Pulled per-chunk arrays of one writer rank as ``[num_chunks, nbytes]`` (chunks a
        window skips are zeros: the load does not read them)."""
        arrays = {}
        for h, r in zip(job.handles, job.reads.src_ranks):
            if r == src_rank:
                arrays = h.native or {}
        nbytes = job.reads.objects[og].src_nbytes
        rows = []
        for c in range(job.first_chunk, job.last_chunk):
            x = arrays.get((og, c))
            rows.append(x.reshape((1, nbytes)) if x is not None else None)
        like = next((x for h in job.handles for x in (h.native or {}).values()), None)
        if like is None:
            raise KVGroupsValueError("job: expected pulled objects to assemble, got none")
        xp = like.__array_namespace__()
        rows = [x if x is not None else xp.zeros((1, nbytes), dtype=xp.uint8) for x in rows]
        return xp.concat(rows, axis=0)

    def poll(self, job: PullJob) -> bool:
        """True once every posted transfer of the job is done (raises on failure)."""
        return all([self.transport.poll(h) for h in job.handles])

    def wait(self, job: PullJob) -> None:
        """Block until the job's transfers are done; on failure abandon them all and raise."""
        try:
            for h in job.handles:
                self.transport.wait(h)
        except BaseException:
            for h in job.handles:
                self.transport.cancel(h)
            raise

    def objects(self, job: PullJob) -> list:
        """The reader's objects of chunks ``[first_chunk, n)``, one uint8 ``[n - first_chunk,
        object_nbytes]`` array per object group, for ``load`` (rows of chunks a window
        skips hold no data: the load does not read them)."""
        if getattr(self.transport, "produces_arrays", False):
            return [
                assemble(reads, {r: self._stacked(job, r, og) for r in reads.ranges})
                for og, reads in enumerate(job.reads.objects)
            ]
        pools = self._pools[(job.reads.src_tp_size, job.reads.src_object_layout)]
        by_id = {p.pool_id: p for p in pools}
        out = []
        for og, reads in enumerate(job.reads.objects):
            staged = {r: by_id[job.pools[r]].rows(job.entries)[og] for r in reads.ranges}
            out.append(assemble(reads, staged))
        return out

    def end(self, job: PullJob, *, release_remote: bool = True) -> None:
        """Give the staging entries back and (default) tell the writers they may reuse theirs."""
        for h in job.handles:
            self.transport.cancel(h)
        if not self.transport.uncancelled():  # else a late write may still land there
            self._free.extend(job.entries)
        job.entries = []
        if release_remote:
            self.transport.release_remote(
                job.publication, self.manager.tp_rank, self.manager.tp_size
            )
