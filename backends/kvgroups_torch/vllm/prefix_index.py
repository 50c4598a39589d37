"""The scheduler's record of what the host cache holds: chunk hash -> entry, LRU eviction.

vLLM runs the scheduler and the workers in different processes, and only the scheduler may
decide what a step loads. So the scheduler owns the index: it looks hits up, chooses the
entry every save goes to (evicting the least recently used chunk when the cache is full) and
sends those entries to the workers in the step's metadata. Workers keep nothing but the entry
buffers, so the two sides cannot disagree. A worker runs a step's loads before its saves, and
steps in order, so an entry chosen in step N holds its chunk for every load of step N+1 on.

Framework-free (plain Python and NumPy).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from kvgroups_core.errors import KVGroupsValueError


def chunk_hashes(token_ids: Sequence[int], chunk: int, salt: bytes = b"") -> list[bytes]:
    """One hash per whole chunk of ``token_ids``, each covering the whole prefix up to it.

    Hash ``c`` chains the hash of chunk ``c - 1`` with chunk ``c``'s tokens (as little-endian
    int64), so two prompts share hash ``c`` only when they share the first ``(c + 1) * chunk``
    tokens (and the ``salt``: cache salt, LoRA, multimodal inputs).
    """
    if chunk <= 0:
        raise KVGroupsValueError(f"chunk: expected a positive token count, got {chunk}")
    tokens = np.asarray(token_ids, dtype=np.int64)
    prev = hashlib.blake2b(b"kvgroups-vllm\0" + salt, digest_size=16).digest()
    out = []
    for c in range(len(tokens) // chunk):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(tokens[c * chunk : (c + 1) * chunk].tobytes())
        prev = h.digest()
        out.append(prev)
    return out


class ChunkIndex:
    """A fixed number of entries, each holding one chunk (every object group of it, except
    those recorded as absent: a recurrent-state snapshot the engine did not keep).

    ``lookup`` is side-effect free (vLLM may ask the same question twice); ``touch`` marks a
    use; ``allocate`` hands out free entries, evicting least recently used ones, never an entry
    in ``protected`` (those a load of the current step reads).
    """

    def __init__(self, capacity_chunks: int) -> None:
        if (
            isinstance(capacity_chunks, bool)
            or not isinstance(capacity_chunks, int)
            or capacity_chunks <= 0
        ):
            raise KVGroupsValueError(
                f"capacity_chunks: expected a positive int, got {capacity_chunks!r}"
            )
        self.capacity = capacity_chunks
        self._entry_of: dict[bytes, int] = {}
        self._lru: OrderedDict[int, bytes] = OrderedDict()  # oldest first
        self._free: list[int] = list(range(capacity_chunks))  # kept sorted
        self._absent: dict[int, frozenset[int]] = {}  # entry -> object groups it lacks
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entry_of)

    def __contains__(self, h: bytes) -> bool:
        return h in self._entry_of

    def lookup(self, hashes: Iterable[bytes]) -> list[int | None]:
        """Slot of each hash, None where absent (no recency change)."""
        return [self._entry_of.get(h) for h in hashes]

    def present(self, hashes: Sequence[bytes], num_object_groups: int) -> np.ndarray:
        """``[len(hashes), num_object_groups]`` booleans for ``AttnWindowDesc.hit_chunks``:
        a cached chunk has every object group but those recorded absent."""
        out = np.zeros((len(hashes), max(num_object_groups, 1)), dtype=bool)
        for i, h in enumerate(hashes):
            entry = self._entry_of.get(h)
            if entry is not None:
                out[i] = True
                for g in self._absent.get(entry, ()):
                    out[i, g] = False
        return out

    def absent(self, entry: int) -> frozenset[int]:
        """The object groups ``entry`` does not hold."""
        return self._absent.get(entry, frozenset())

    def mark_present(self, entry: int, groups: Iterable[int]) -> None:
        """``groups`` of ``entry`` now hold their bytes (a snapshot stored later)."""
        left = self._absent.get(entry, frozenset()) - set(groups)
        if left:
            self._absent[entry] = left
        else:
            self._absent.pop(entry, None)

    def touch(self, entries: Iterable[int]) -> None:
        for s in entries:
            if s in self._lru:
                self._lru.move_to_end(s)

    def allocate(self, n: int, protected: set[int] = frozenset()) -> list[int]:
        """Up to ``n`` entries (fewer only when every other entry is protected), consecutive
        where the free list allows (fewer, longer transfers)."""
        while len(self._free) < n:
            victim = next((s for s in self._lru if s not in protected), None)
            if victim is None:
                break
            h = self._lru.pop(victim)
            del self._entry_of[h]
            self._absent.pop(victim, None)
            self._free.append(victim)
            self.evictions += 1
        self._free.sort()
        n = min(n, len(self._free))
        start = _first_run(self._free, n)
        if start is None:
            taken = self._free[:n]
            del self._free[:n]
        else:
            taken = self._free[start : start + n]
            del self._free[start : start + n]
        return taken

    def insert(self, h: bytes, entry: int, absent: Iterable[int] = ()) -> None:
        """Record that ``entry`` now holds the chunk ``h`` (most recently used), without the
        object groups in ``absent``."""
        old = self._entry_of.get(h)
        if old is not None and old != entry:
            raise KVGroupsValueError(f"chunk already cached in entry {old}, got entry {entry}")
        self._entry_of[h] = entry
        self._lru[entry] = h
        self._lru.move_to_end(entry)
        missing = frozenset(absent)
        if missing:
            self._absent[entry] = missing
        else:
            self._absent.pop(entry, None)


def _first_run(sorted_entries: list[int], n: int) -> int | None:
    """Index of the first run of ``n`` consecutive entry numbers, or None."""
    if n == 0:
        return 0
    run_start = 0
    for i in range(len(sorted_entries)):
        if i > 0 and sorted_entries[i] != sorted_entries[i - 1] + 1:
            run_start = i
        if i - run_start + 1 >= n:
            return i - n + 1
    return None


def consecutive_runs(entries: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(position, first_entry, length)`` of each maximal run of consecutive entries."""
    runs = []
    i = 0
    while i < len(entries):
        j = i + 1
        while j < len(entries) and entries[j] == entries[j - 1] + 1:
            j += 1
        runs.append((i, entries[i], j - i))
        i = j
    return runs
