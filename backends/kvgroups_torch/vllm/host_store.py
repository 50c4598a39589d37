"""The worker side of KVGroupsConnector without vLLM: pool buffers in host memory and the
kvgroups calls that fill and read them. The connector and the benchmark
(benchmarks/bench_vllm_connector.py) both go through this class, so the benchmark measures the
connector's own calls."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from kvgroups_core import object_nbytes, prepare
from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError
from kvgroups_core.grouping.engine_groups import as_bool, as_int
from kvgroups_core.grouping.manager import check_manager
from kvgroups_core.transfer.api import PreparedTransfer

from .config import MAX_CHUNKS


def supports_layer_subsets() -> bool:
    """True once kvgroups' prepared calls take ``layers=[...]`` (layer-by-layer saves)."""
    return "layers" in inspect.signature(PreparedTransfer.store).parameters


class HostChunkStore:
    """``capacity`` chunk entries per object group, bound once to the engine's caches.

    Parameters
    ----------
    manager, kv_caches
        The manager and the caches in its layer order (``VllmKVLayout.manager`` /
        ``.kv_caches``).
    capacity : int
        Entries (chunks) of every object group's buffer, ``[capacity, object_nbytes]`` uint8.
    pinned : bool, optional
        Page-locked buffers (default: when the caches are on CUDA, which the kernels then read
        and write directly).
    """

    def __init__(
        self, manager: Any, kv_caches: list, capacity: int, pinned: bool | None = None
    ) -> None:
        self.manager = check_manager(manager)
        capacity = as_int(capacity, "capacity")
        if not 1 <= capacity <= MAX_CHUNKS:  # the connector's own bound
            raise KVGroupsValueError(
                f"capacity: expected between 1 and {MAX_CHUNKS} entries, got {capacity}"
            )
        self.capacity = capacity
        self.kv_caches = kv_caches
        device = kv_caches[0].device if kv_caches else torch.device("cpu")
        self.pinned = device.type == "cuda" if pinned is None else as_bool(pinned, "pinned")
        self.object_bytes = [object_nbytes(manager, g) for g in range(manager.num_object_groups)]
        try:
            self.pools = [
                torch.empty((capacity, n), dtype=torch.uint8, pin_memory=self.pinned)
                for n in self.object_bytes
            ]
        except (RuntimeError, MemoryError) as exc:  # the allocator's own refusal
            raise KVGroupsValueError(
                f"capacity: expected a host cache this machine can allocate, got {capacity} "
                f"chunks of {sum(self.object_bytes)} bytes "
                f"({'pinned' if self.pinned else 'pageable'}): {exc}"
            ) from exc
        self.prepared = prepare(manager, kv_caches) if kv_caches else None
        self.layerwise = (
            supports_layer_subsets() and self.prepared is not None and self._layer_saves_match()
        )

    def _layer_saves_match(self) -> bool:
        """Saving layer by layer must give the whole-model save's bytes: checked once, on one
        chunk of block 0 (a read of the caches only), so a backend that does not place layer
        subsets by their object plane yet falls back to whole-model saves."""
        ids = {
            g.engine_group_idx: [0] * (self.manager.lmcache_tokens_per_chunk // g.tokens_per_block)
            for g in self.manager.kernel_groups
        }
        try:
            whole = self.prepared.store(ids)
            parts = [torch.zeros_like(o) for o in whole]
            for layer in range(len(self.kv_caches)):
                if any(layer in g.layer_indices for g in self.manager.kernel_groups):
                    self.prepared.store(ids, parts, layers=[layer])
        except Exception:  # noqa: BLE001 - any failure means: do not use layer subsets
            return False
        return all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(whole, parts))

    def _entries(self, entries: Any, consecutive: bool) -> list[int]:
        """``entries`` checked: a non-empty list of ints in ``[0, capacity)``; consecutive
        ones for a save (it writes through a view of the pool; a gathered copy would be lost)."""
        if not isinstance(entries, (list, tuple, range)) or len(entries) == 0:
            raise KVGroupsTypeError(
                f"entries: expected a non-empty list of pool entries, got {entries!r}"
            )
        out = [as_int(e, f"entries[{i}]") for i, e in enumerate(entries)]
        for i, e in enumerate(out):
            if not 0 <= e < self.capacity:
                raise KVGroupsValueError(
                    f"entries[{i}]: expected an entry in [0, {self.capacity}), got {e}"
                )
        if consecutive and out != list(range(out[0], out[0] + len(out))):
            raise KVGroupsValueError(f"entries: expected consecutive entries for a save, got {out}")
        return out

    def rows(self, entries: list[int]) -> list[torch.Tensor]:
        """Each object group's rows for ``entries``: a view when they are consecutive, else a
        gathered copy (loads only: saves always go to consecutive entries)."""
        entries = self._entries(entries, consecutive=False)
        first = entries[0]
        if entries == list(range(first, first + len(entries))):
            return [pool[first : first + len(entries)] for pool in self.pools]
        if self.pinned and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # earlier stores into these rows
        index = torch.tensor(entries, dtype=torch.long)
        return [pool.index_select(0, index) for pool in self.pools]

    def load(
        self,
        block_ids: Any,
        entries: list[int],
        skip_tokens: int = 0,
        layers: list[int] | None = None,
    ) -> None:
        """Chunks in ``entries`` -> the blocks ``block_ids`` (all layers, or ``layers``)."""
        self.prepared.load(
            self.rows(entries), block_ids, skip_first_n_tokens=skip_tokens, layers=layers
        )

    def save(self, block_ids: Any, entries: list[int], layers: list[int] | None = None) -> None:
        """The blocks ``block_ids`` (all layers, or ``layers``) -> consecutive ``entries``."""
        self.prepared.store(block_ids, self.rows(self._entries(entries, True)), layers=layers)

    def save_layer(self, block_ids: Any, entries: list[int], layer: int) -> None:
        """One layer's pages -> its regions of the chunks in ``entries`` (needs layer subsets)."""
        self.prepared.store(block_ids, self.rows(self._entries(entries, True)), layers=[layer])
