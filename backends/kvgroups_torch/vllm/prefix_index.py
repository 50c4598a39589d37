"""The scheduler's record of what the host cache holds: chunk hash -> slot, LRU eviction.

vLLM runs the scheduler and the workers in different processes, and only the scheduler may
decide what a step loads. So the scheduler owns the index: it looks hits up, chooses the
slot every save goes to (evicting the least recently used chunk when the cache is full) and
sends those slots to the workers in the step's metadata. Workers keep nothing but the slot
buffers, so the two sides cannot disagree. A worker runs a step's loads before its saves, and
steps in order, so a slot chosen in step N holds its chunk for every load of step N+1 on.

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
    """A fixed number of slots, each holding one chunk (every object group of it, except
    those recorded as absent: a recurrent-state snapshot the engine did not keep).

    ``lookup`` is side-effect free (vLLM may ask the same question twice); ``touch`` marks a
    use; ``allocate`` hands out free slots, evicting least recently used ones, never a slot
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
        self._slot_of: dict[bytes, int] = {}
        self._lru: OrderedDict[int, bytes] = OrderedDict()  # oldest first
        self._free: list[int] = list(range(capacity_chunks))  # kept sorted
        self._absent: dict[int, frozenset[int]] = {}  # slot -> object groups it lacks
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, h: bytes) -> bool:
        return h in self._slot_of

    def lookup(self, hashes: Iterable[bytes]) -> list[int | None]:
        """Slot of each hash, None where absent (no recency change)."""
        return [self._slot_of.get(h) for h in hashes]

    def present(self, hashes: Sequence[bytes], num_object_groups: int) -> np.ndarray:
        """``[len(hashes), num_object_groups]`` booleans for ``AttnWindowDesc.hit_chunks``:
        a cached chunk has every object group but those recorded absent."""
        out = np.zeros((len(hashes), max(num_object_groups, 1)), dtype=bool)
        for i, h in enumerate(hashes):
            slot = self._slot_of.get(h)
            if slot is not None:
                out[i] = True
                for g in self._absent.get(slot, ()):
                    out[i, g] = False
        return out

    def absent(self, slot: int) -> frozenset[int]:
        """The object groups ``slot`` does not hold."""
        return self._absent.get(slot, frozenset())

    def mark_present(self, slot: int, groups: Iterable[int]) -> None:
        """``groups`` of ``slot`` now hold their bytes (a snapshot stored later)."""
        left = self._absent.get(slot, frozenset()) - set(groups)
        if left:
            self._absent[slot] = left
        else:
            self._absent.pop(slot, None)

    def touch(self, slots: Iterable[int]) -> None:
        for s in slots:
            if s in self._lru:
                self._lru.move_to_end(s)

    def allocate(self, n: int, protected: set[int] = frozenset()) -> list[int]:
        """Up to ``n`` slots (fewer only when every other slot is protected), consecutive
        where the free list allows (fewer, longer transfers)."""
        while len(self._free) < n:
            victim = next((s for s in self._lru if s not in protected), None)
            if victim is None:
                break
            h = self._lru.pop(victim)
            del self._slot_of[h]
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

    def insert(self, h: bytes, slot: int, absent: Iterable[int] = ()) -> None:
        """Record that ``slot`` now holds the chunk ``h`` (most recently used), without the
        object groups in ``absent``."""
        old = self._slot_of.get(h)
        if old is not None and old != slot:
            raise KVGroupsValueError(f"chunk already cached in slot {old}, got slot {slot}")
        self._slot_of[h] = slot
        self._lru[slot] = h
        self._lru.move_to_end(slot)
        missing = frozenset(absent)
        if missing:
            self._absent[slot] = missing
        else:
            self._absent.pop(slot, None)


def _first_run(sorted_slots: list[int], n: int) -> int | None:
    """Index of the first run of ``n`` consecutive slot numbers, or None."""
    if n == 0:
        return 0
    run_start = 0
    for i in range(len(sorted_slots)):
        if i > 0 and sorted_slots[i] != sorted_slots[i - 1] + 1:
            run_start = i
        if i - run_start + 1 >= n:
            return i - n + 1
    return None


def consecutive_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(position, first_slot, length)`` of each maximal run of consecutive slots."""
    runs = []
    i = 0
    while i < len(slots):
        j = i + 1
        while j < len(slots) and slots[j] == slots[j - 1] + 1:
            j += 1
        runs.append((i, slots[i], j - i))
        i = j
    return runs
