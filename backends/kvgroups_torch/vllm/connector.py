"""KVGroupsConnector: a vLLM KV connector keeping a prefix cache of memory objects in host
memory, moved with kvgroups.

Select it with::

    KVTransferConfig(kv_connector="KVGroupsConnector",
                     kv_connector_module_path="kvgroups_torch.vllm", kv_role="kv_both",
                     kv_connector_extra_config={"capacity_chunks": 1024, "chunk_size": 256})

``kv_connector_extra_config`` keys (the table in :mod:`kvgroups_torch.vllm.config`, checked at
engine start: unknown keys and bad values are refused by name): ``chunk_size`` (tokens per
cached chunk, default 256, a multiple of every group's block size), ``capacity_chunks`` or
``capacity_bytes`` (the host cache size; default 1 GiB), ``eviction`` (only ``"lru"``).
``kv_role`` must be ``"kv_both"``.

How a step runs:

- Scheduler (its own process): ``get_num_new_matched_tokens`` hashes the prompt's whole
  chunks and asks the :class:`ChunkIndex` which are cached; the hit is
  ``AttnWindowDesc.hit_chunks`` of the manager built from the config alone (full-attention
  groups need every chunk of the prefix, sliding-window groups only the last ones), cut so at
  least one prompt token is left to compute. ``build_connector_meta`` turns the step's
  scheduled requests into loads (the hit's slots, the request's block ids) and saves (every
  prompt chunk completed in this step and not cached yet, to slots it allocates, evicting LRU).
- Worker: ``register_kv_caches`` builds the same manager from the registered tensors,
  binds it once (``prepare``) and allocates one slot buffer per object group
  (``[capacity, object_nbytes]`` uint8, pinned on CUDA). ``start_load_kv`` loads every hit
  before the forward; saves go layer by layer from ``save_kv_layer`` when kvgroups has layer
  subsets (``store(..., layers=[i])``), else as one whole-model store in ``wait_for_save``.
  On CUDA every copy is queued on the current stream and nothing waits on the host, so the
  forward pass is never blocked and a block is never reused before its save ran.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvgroups_core import object_nbytes
from kvgroups_core.errors import KVGroupsValueError

from .adapter import VllmKVLayout, from_kv_cache_config
from .config import ConnectorConfig, parse_extra_config
from .host_store import HostChunkStore
from .prefix_index import ChunkIndex, chunk_hashes, consecutive_runs

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

@dataclass
class TransferItem:
    """One request's chunks to move: block ids by vLLM group id, one slot per chunk."""

    req_id: str
    block_ids: dict[int, list[int]]
    slots: list[int]
    skip_tokens: int = 0


@dataclass
class KVGroupsConnectorMetadata(KVConnectorMetadata):
    loads: list[TransferItem] = field(default_factory=list)
    saves: list[TransferItem] = field(default_factory=list)


@dataclass
class _Request:
    prompt: list[int]
    hashes: list[bytes]
    block_ids: list[list[int]]
    saved_chunks: int = 0


def _salt(request: Any) -> bytes:
    parts = [str(getattr(request, "cache_salt", None) or "")]
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora:{getattr(lora, 'lora_name', lora)}")
    for feature in getattr(request, "mm_features", None) or ():
        parts.append(f"mm:{getattr(feature, 'identifier', feature)}")
    return "\0".join(parts).encode()


def _capacity_chunks(config: ConnectorConfig, bytes_per_chunk: int) -> int:
    if config.capacity_chunks is not None:
        return config.capacity_chunks
    chunks = config.capacity_bytes // max(bytes_per_chunk, 1)
    if chunks < 1 and "capacity_bytes" in config.given:
        raise KVGroupsValueError(
            f"kv_connector_extra_config['capacity_bytes']: expected at least one chunk "
            f"({bytes_per_chunk} bytes for this model at chunk_size {config.chunk_size}), got "
            f"{config.capacity_bytes}")
    return max(1, chunks)


class KVGroupsConnector(KVConnectorBase_V1, SupportsHMA):
    """Host-memory prefix cache of kvgroups memory objects (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        config = parse_extra_config(transfer.kv_connector_extra_config,
                                    getattr(transfer, "kv_role", "kv_both"))
        self._config = config
        self._chunk = config.chunk_size
        # Both processes derive the same grouping from the config: the scheduler needs the
        # windows and object sizes, the worker checks its tensors against the same layout.
        self._plan_layout = from_kv_cache_config(kv_cache_config, None, chunk_size=self._chunk)
        manager = self._plan_layout.manager
        self._object_bytes = [object_nbytes(manager, g) for g in range(manager.num_object_groups)]
        self._capacity = _capacity_chunks(config, sum(self._object_bytes))
        self._attn = manager.get_attn_desc() if manager.num_object_groups else None
        # scheduler side
        self._index = ChunkIndex(self._capacity)
        self._requests: dict[str, _Request] = {}
        self._pending_hits: dict[str, tuple[int, int]] = {}
        self._hash_cache: dict[str, list[bytes]] = {}
        self._loads_to_send: dict[str, tuple[int, int, list[int]]] = {}
        # worker side
        self._layout: VllmKVLayout | None = None
        self._store: HostChunkStore | None = None
        self._save_stream: Any = None  # CUDA: layer-wise saves overlap the forward
        self.stats = {"loaded_chunks": 0, "saved_chunks": 0, "load_calls": 0, "store_calls": 0}

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a later cache miss, never a wrong result

    # ------------------------------------------------------------------ scheduler side

    def _hashes(self, request: Request) -> list[bytes]:
        # Hashed once from the Request (it carries the cache salt, LoRA and multimodal
        # inputs); build_connector_meta reuses these for the request's saves.
        hashes = self._hash_cache.get(request.request_id)
        if hashes is None:
            hashes = chunk_hashes(list(request.prompt_token_ids or []), self._chunk,
                                  _salt(request))
            self._hash_cache[request.request_id] = hashes
        return hashes

    def on_new_request(self, request: Request) -> None:
        self._hashes(request)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt_len = len(request.prompt_token_ids or [])
        if self._attn is None or prompt_len <= self._chunk:
            return 0, False
        # At least one prompt token must be left for the model to compute.
        usable = (prompt_len - 1) // self._chunk
        hashes = self._hashes(request)[:usable]
        present = self._index.present(hashes, len(self._attn.num_chunks_in_sw))
        hit = int(self._attn.hit_chunks(present)) if hashes else 0
        new = hit * self._chunk - num_computed_tokens
        if hit == 0 or new <= 0:
            self._pending_hits.pop(request.request_id, None)
            return 0, False
        self._pending_hits[request.request_id] = (hit, num_computed_tokens)
        return new, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        pending = self._pending_hits.pop(request.request_id, None)
        if num_external_tokens <= 0 or pending is None:
            return
        hit, computed = pending
        # vLLM may take fewer tokens than offered: load the chunks covering what it took
        # (tokens of a partly taken chunk are recomputed over identical values).
        hit = min(hit, -(-(computed + num_external_tokens) // self._chunk))
        slots = self._index.lookup(self._hashes(request)[:hit])
        if any(s is None for s in slots):  # cannot happen: nothing evicts between the calls
            raise KVGroupsValueError(f"request {request.request_id}: hit chunks were evicted")
        self._index.touch(slots)
        self._loads_to_send[request.request_id] = (hit, computed, slots)

    def _saves_for(self, req_id: str, state: _Request, computed_after: int,
                   protected: set[int]) -> list[TransferItem]:
        done = min(computed_after, len(state.prompt)) // self._chunk
        todo = []
        for c in range(state.saved_chunks, done):
            slot = self._index.lookup([state.hashes[c]])[0]
            if slot is None:
                todo.append(c)
            else:
                self._index.touch([slot])
        state.saved_chunks = max(state.saved_chunks, done)
        if not todo:
            return []
        slots = self._index.allocate(len(todo), protected)
        todo = todo[:len(slots)]
        for c, s in zip(todo, slots):
            self._index.insert(state.hashes[c], s)
        items = []
        # One store per run of consecutive slots: each writes into one view of the buffers.
        for pos, first, n in consecutive_runs(slots):
            chunks = todo[pos:pos + n]
            ids = self._chunk_ids(state, chunks)
            items.append(TransferItem(req_id, ids, list(range(first, first + n))))
        return items

    def _chunk_ids(self, state: _Request, chunks: list[int]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for c in chunks:
            for gid, ids in self._plan_layout.block_ids(state.block_ids, 1, c).items():
                out.setdefault(gid, []).extend(ids)
        return out

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVGroupsConnectorMetadata()
        protected: set[int] = set()
        scheduled = scheduler_output.num_scheduled_tokens
        touched: list[tuple[str, _Request, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or [])
            hashes = self._hash_cache.get(new.req_id)
            if hashes is None:
                hashes = chunk_hashes(prompt, self._chunk, _salt(new))
                self._hash_cache[new.req_id] = hashes
            state = _Request(prompt, hashes, [list(ids) for ids in new.block_ids])
            self._requests[new.req_id] = state
            self._emit_load(meta, new.req_id, state, protected)
            touched.append((new.req_id, state, new.num_computed_tokens + scheduled.get(new.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                state.block_ids = [list(ids) for ids in (new_ids or ())]
                state.saved_chunks = 0
                self._emit_load(meta, req_id, state, protected)
            elif new_ids is not None:
                for g, ids in enumerate(new_ids):
                    if ids:
                        state.block_ids[g].extend(ids)
            computed = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            touched.append((req_id, state, computed))
        for req_id, state, computed_after in touched:
            meta.saves.extend(self._saves_for(req_id, state, computed_after, protected))
        return meta

    def _emit_load(self, meta: KVGroupsConnectorMetadata, req_id: str, state: _Request,
                   protected: set[int]) -> None:
        load = self._loads_to_send.pop(req_id, None)
        if load is None:
            return
        hit, computed, slots = load
        ids = self._plan_layout.block_ids(state.block_ids, hit)
        meta.loads.append(TransferItem(req_id, ids, slots, computed))
        protected.update(slots)
        state.saved_chunks = hit

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._forget(request.request_id)
        return False, None

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        self._forget(request.request_id)
        return False, None

    def _forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._hash_cache.pop(req_id, None)
        self._pending_hits.pop(req_id, None)
        self._loads_to_send.pop(req_id, None)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = from_kv_cache_config(self._kv_cache_config, kv_caches, chunk_size=self._chunk)
        sizes = [object_nbytes(layout.manager, g) for g in range(layout.manager.num_object_groups)]
        if sizes != self._object_bytes:
            raise KVGroupsValueError(
                f"register_kv_caches: the registered tensors give object sizes {sizes}, the "
                f"config gives {self._object_bytes}"
            )
        self._layout = layout
        self._store = HostChunkStore(layout.manager, layout.kv_caches, self._capacity)
        on_cuda = bool(layout.kv_caches) and layout.kv_caches[0].device.type == "cuda"
        if on_cuda and self._store.layerwise:
            self._save_stream = torch.cuda.Stream(device=layout.kv_caches[0].device)

    @property
    def _pools(self) -> list[torch.Tensor]:
        return self._store.pools if self._store is not None else []

    def _metadata(self) -> KVGroupsConnectorMetadata | None:
        if self._store is None or self._store.prepared is None or not self.has_connector_metadata():
            return None
        return self._get_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._metadata()
        for item in meta.loads if meta is not None else ():
            self._store.load(item.block_ids, item.slots, item.skip_tokens)
            self.stats["loaded_chunks"] += len(item.slots)
            self.stats["load_calls"] += 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every load was queued before the forward, on the forward's own stream

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        meta = self._metadata()
        if meta is None or not meta.saves or not self._store.layerwise:
            return
        if layer_name in self._layout.excluded_layers:
            return  # its KV is another layer's (sharing) or not needed across chunks
        layer = self._layout.index_of(layer_name)
        with self._on_save_stream():
            for item in meta.saves:
                self._store.save_layer(item.block_ids, item.slots, layer)
                self.stats["store_calls"] += 1

    @contextmanager
    def _on_save_stream(self):
        """CUDA: queue a layer's save on a side stream once the forward has written that
        layer (the side stream waits for the forward's stream), so it overlaps the next
        layers instead of delaying them. CPU: run in place."""
        if self._save_stream is None:
            yield
            return
        self._save_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._save_stream):
            yield

    def wait_for_save(self) -> None:
        meta = self._metadata()
        for item in meta.saves if meta is not None else ():
            if not self._store.layerwise:
                self._store.save(item.block_ids, item.slots)
                self.stats["store_calls"] += 1
            self.stats["saved_chunks"] += len(item.slots)
        if self._save_stream is not None:
            # Later work on the forward's stream (next step's writes into these blocks, loads
            # from these slots) runs after the saves; the host does not wait.
            torch.cuda.current_stream().wait_stream(self._save_stream)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None
