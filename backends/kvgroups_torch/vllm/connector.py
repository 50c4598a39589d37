"""KVGroupsConnector: a vLLM KV connector keeping a prefix cache of memory objects in host
memory, moved with kvgroups.

Select it with::

    KVTransferConfig(kv_connector="KVGroupsConnector",
                     kv_connector_module_path="kvgroups_torch.vllm", kv_role="kv_both",
                     kv_connector_extra_config={"capacity_chunks": 1024, "chunk_size": 256})

``kv_connector_extra_config`` keys (the table in :mod:`kvgroups_torch.vllm.config`, checked at
engine start: unknown keys and bad values are refused by name): ``chunk_size`` (tokens per
cached chunk, default 256, a multiple of every group's block size), ``capacity_chunks`` or
``capacity_bytes`` (the host cache size; default 1 GiB), ``eviction`` (only ``"lru"``),
``layerwise_loads`` (default true: each layer's load is waited for by that layer only, on the
GPU; false: every load finishes before the forward), and the prefill/decode keys of
:mod:`.pd` (docs/PD.md).

How a step runs:

- Scheduler (its own process): ``get_num_new_matched_tokens`` hashes the prompt's whole
  chunks and asks the :class:`ChunkIndex` which are cached; the hit is
  ``AttnWindowDesc.hit_chunks`` of the manager built from the config alone (full-attention
  groups need every chunk of the prefix, sliding-window groups only the last ones), cut so at
  least one prompt token is left to compute. ``build_connector_meta`` turns the step's
  scheduled requests into loads (the hit's entries, the request's block ids) and saves (every
  prompt chunk completed in this step and not cached yet, to entries it allocates, evicting LRU).
- Worker: ``register_kv_caches`` builds the same manager from the registered tensors,
  binds it once (``prepare``) and allocates one pool buffer per object group
  (``[capacity, object_nbytes]`` uint8, pinned on CUDA). The step's transfers are pipelined
  with the forward (:mod:`.pipeline`): ``start_load_kv`` queues every hit's load layer by layer
  on a side stream and ``wait_for_layer_load`` makes the forward wait, on the GPU, for its own
  layer; ``save_kv_layer`` queues each layer's store on a side stream once the layer wrote
  its KV; ``wait_for_save`` stores what no hook saved (FULL CUDA-graph replays call no hook)
  and makes the forward's stream wait for the saves. Nothing waits on the host, and vLLM's
  FULL graphs stay on (the connector needs no PIECEWISE downgrade).

Recurrent state (hybrid models; ``MambaSpec`` in ``mamba_cache_mode="align"``, docs/SEMANTICS.md
section 9): a chunk's state object is the snapshot after its last token. vLLM hands a
connector the blocks holding such snapshots in the step that computes them (the scheduler
output's ``kv_connector_block_state.boundary_state_offloads``); a chunk saved without one is
recorded with its state missing, so lookups never serve a prefix whose snapshot is missing (an
attention hit without it is a miss), and a later request that has the snapshot adds it to the
cached chunk. A load writes the hit's last snapshot into the block vLLM allocated for it and
into the request's running state block, because vLLM copies the former into the latter before
the step's loads run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvgroups_core import object_nbytes
from kvgroups_core.errors import KVGroupsValueError

from .adapter import VllmKVLayout, from_kv_cache_config
from .config import host_capacity_chunks, parse_extra_config
from .host_store import HostChunkStore
from .pd import PDScheduler, PDWorker, PDWorkerMeta, pd_enabled
from .pipeline import StepTransfers, hooks_will_run
from .prefix_index import ChunkIndex, chunk_hashes, consecutive_runs
from .stats import ConnectorCounters, KVGroupsConnectorStats, KVGroupsPromMetrics, log

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclass
class TransferItem:
    """One request's chunks to move: block ids by vLLM group id, one entry per chunk.

    A load also carries the tokens vLLM counts as present after it (``taken_tokens``).
    ``layers``: only these manager layers (a snapshot added to a cached chunk); None: all.
    ``state_block_ids``: a load's ids with each recurrent-state group's last id replaced by
    the request's running state block (loaded a second time, state layers only)."""

    req_id: str
    block_ids: dict[int, list[int]]
    entries: list[int]
    skip_tokens: int = 0
    taken_tokens: int | None = None
    layers: list[int] | None = None
    state_block_ids: dict[int, list[int]] | None = None


@dataclass
class KVGroupsConnectorMetadata(KVConnectorMetadata):
    loads: list[TransferItem] = field(default_factory=list)
    saves: list[TransferItem] = field(default_factory=list)
    pd_publishes: list = field(default_factory=list)  # pd.PublishItem, after this step's saves
    pd_pulls: list = field(default_factory=list)  # pd.PullItem, started with this step's loads


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


class KVGroupsConnector(KVConnectorBase_V1, SupportsHMA):
    """Host-memory prefix cache of kvgroups memory objects (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        config = parse_extra_config(
            transfer.kv_connector_extra_config, getattr(transfer, "kv_role", "kv_both")
        )
        self._config = config
        self._chunk = config.chunk_size
        self._layerwise_loads = config.layerwise_loads
        extra = config
        # Both processes derive the same grouping from the config: the scheduler needs the
        # windows and object sizes, the worker checks its tensors against the same layout.
        self._plan_layout = from_kv_cache_config(kv_cache_config, None, chunk_size=self._chunk)
        manager = self._plan_layout.manager
        self._object_bytes = [object_nbytes(manager, g) for g in range(manager.num_object_groups)]
        self._capacity = host_capacity_chunks(config, sum(self._object_bytes))
        self._attn = manager.get_attn_desc() if manager.num_object_groups else None
        # Recurrent state: its object group(s) and vLLM groups (with their block sizes).
        self._state_ogs = frozenset(
            g for g, o in enumerate(manager.object_groups) if o.recurrent_state
        )
        self._state_groups = {
            gid: self._plan_layout.group_block_sizes[gid] for gid in self._plan_layout.state_groups
        }
        self._state_layers = list(self._plan_layout.state_layers)
        # scheduler side
        self._index = ChunkIndex(self._capacity)
        self._requests: dict[str, _Request] = {}
        self._pending_hits: dict[str, tuple[int, int]] = {}
        self._hash_memo: dict[str, list[bytes]] = {}
        self._loads_to_send: dict[str, tuple[int, int, list[int], int]] = {}
        # worker side
        self._layout: VllmKVLayout | None = None
        self._store: HostChunkStore | None = None
        self._steps: StepTransfers | None = None
        self._counters = ConnectorCounters()
        self.stats = self._counters.totals  # running totals (stats.COUNTERS)
        log.info(
            "KVGroupsConnector (%s): capacity %d chunks of %d tokens, %d bytes per chunk "
            "in %d object group(s), %.1f MiB of host memory",
            role.name,
            self._capacity,
            self._chunk,
            sum(self._object_bytes),
            len(self._object_bytes),
            self._capacity * sum(self._object_bytes) / 2**20,
        )
        # Disaggregated prefill/decode (pd.py): kv_producer / kv_consumer, or kv_both with a
        # configured transport.
        kv_role = str(self._kv_transfer_config.kv_role)
        self._pd_sched: PDScheduler | None = None
        self._pd_worker: PDWorker | None = None
        if pd_enabled(kv_role, extra):
            if role == KVConnectorRole.SCHEDULER:
                self._pd_sched = PDScheduler(
                    vllm_config, kv_cache_config, kv_role, extra, self._chunk
                )
            else:
                self._pd_worker = PDWorker(
                    vllm_config, kv_cache_config, kv_role, extra, self._chunk
                )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a later cache miss, never a wrong result

    # ------------------------------------------------------------------ scheduler side

    def _hashes(self, request: Request) -> list[bytes]:
        # Hashed once from the Request (it carries the cache salt, LoRA and multimodal
        # inputs); build_connector_meta reuses these for the request's saves.
        hashes = self._hash_memo.get(request.request_id)
        if hashes is None:
            hashes = chunk_hashes(list(request.prompt_token_ids or []), self._chunk, _salt(request))
            self._hash_memo[request.request_id] = hashes
        return hashes

    def on_new_request(self, request: Request) -> None:
        self._hashes(request)
        if self._pd_sched is not None:
            self._pd_sched.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._pd_sched is not None:
            offer = self._pd_sched.matched_tokens(
                request, num_computed_tokens, self._hashes(request)
            )
            if offer is not None:
                return offer
        prompt_len = len(request.prompt_token_ids or [])
        if self._attn is None or prompt_len <= self._chunk:
            return 0, False
        # At least one prompt token must be left for the model to compute.
        usable = (prompt_len - 1) // self._chunk
        hashes = self._hashes(request)[:usable]
        present = self._index.present(hashes, len(self._attn.num_chunks_in_sw))
        hit = int(self._attn.hit_chunks(present)) if hashes else 0
        self._counters.looked_up(request.request_id, len(hashes), hit)
        new = hit * self._chunk - num_computed_tokens
        if hit == 0 or new <= 0:
            self._pending_hits.pop(request.request_id, None)
            return 0, False
        self._pending_hits[request.request_id] = (hit, num_computed_tokens)
        return new, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self._pd_sched is not None and self._pd_sched.after_alloc(
            request, blocks, num_external_tokens, self._plan_layout
        ):
            return
        pending = self._pending_hits.pop(request.request_id, None)
        if num_external_tokens <= 0 or pending is None:
            return
        hit, computed = pending
        taken = computed + num_external_tokens
        if self._state_groups and taken % self._chunk:
            # The recurrent state must resume exactly where the loaded prefix ends, and only
            # chunk ends have snapshots: a partly taken chunk cannot be served correctly.
            raise KVGroupsValueError(
                f"request {request.request_id}: vLLM took {num_external_tokens} external "
                f"tokens after {computed} computed ones, expected a prefix ending on a "
                f"{self._chunk}-token chunk boundary (recurrent-state snapshots exist only there)"
            )
        # vLLM may take fewer tokens than offered: load the chunks covering what it took
        # (tokens of a partly taken chunk are recomputed over identical values).
        hit = min(hit, -(-taken // self._chunk))
        entries = self._index.lookup(self._hashes(request)[:hit])
        if any(s is None for s in entries):  # cannot happen: nothing evicts between the calls
            raise KVGroupsValueError(f"request {request.request_id}: hit chunks were evicted")
        self._index.touch(entries)
        self._loads_to_send[request.request_id] = (
            hit,
            computed,
            entries,
            computed + num_external_tokens,
        )

    def _saves_for(
        self,
        req_id: str,
        state: _Request,
        computed_after: int,
        protected: set[int],
        snapshots: dict[int, dict[int, int]],
    ) -> list[TransferItem]:
        done = min(computed_after, len(state.prompt)) // self._chunk
        todo = []
        items = []
        for c in range(state.saved_chunks, done):
            entry = self._index.lookup([state.hashes[c]])[0]
            if entry is None:
                todo.append(c)
                continue
            self._index.touch([entry])
            if self._index.absent(entry) & self._state_ogs and self._snapshot(c, snapshots):
                # A chunk cached without its snapshot; this request has it: add it.
                items.append(
                    TransferItem(
                        req_id,
                        self._chunk_ids(state, [c], snapshots),
                        [entry],
                        layers=self._state_layers,
                    )
                )
                self._index.mark_present(entry, self._state_ogs)
        state.saved_chunks = max(state.saved_chunks, done)
        if not todo:
            return items
        entries = self._index.allocate(len(todo), protected)
        todo = todo[: len(entries)]
        for c, s in zip(todo, entries):
            absent = () if self._snapshot(c, snapshots) else self._state_ogs
            self._index.insert(state.hashes[c], s, absent)
        # One store per run of consecutive entries: each writes into one view of the buffers.
        for pos, first, n in consecutive_runs(entries):
            chunks = todo[pos : pos + n]
            ids = self._chunk_ids(state, chunks, snapshots)
            items.append(TransferItem(req_id, ids, list(range(first, first + n))))
        return items

    def _snapshot(self, chunk: int, snapshots: dict[int, dict[int, int]]) -> bool:
        """Whether every recurrent-state group has a snapshot at the chunk's end (always
        true for a model without state)."""
        if not self._state_groups:
            return True
        have = snapshots.get((chunk + 1) * self._chunk, {})
        return all(gid in have for gid in self._state_groups)

    def _chunk_ids(
        self, state: _Request, chunks: list[int], snapshots: dict[int, dict[int, int]] | None = None
    ) -> dict[int, list[int]]:
        """Block ids of ``chunks``; a recurrent-state group's last id of a chunk is the block
        vLLM offered as that chunk's snapshot (its block table may have moved on)."""
        out: dict[int, list[int]] = {}
        for c in chunks:
            have = (snapshots or {}).get((c + 1) * self._chunk, {})
            for gid, ids in self._plan_layout.block_ids(state.block_ids, 1, c).items():
                if gid in have:
                    ids = ids[:-1] + [have[gid]]
                out.setdefault(gid, []).extend(ids)
        return out

    def _snapshots(self, scheduler_output: Any) -> dict[str, dict[int, dict[int, int]]]:
        """This step's snapshot blocks: request -> boundary (tokens) -> vLLM group -> block.

        vLLM offers the exact block of every Mamba "align" state it kept in the step that
        computed it (``kv_connector_block_state.boundary_state_offloads``, vLLM >= 0.32);
        without that field no snapshot is known and state is never saved."""
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(block_state, "boundary_state_offloads", None) or {}
        out: dict[str, dict[int, dict[int, int]]] = {}
        for req_id, offered in offers.items():
            for gid, block_id, boundary in offered:
                if gid in self._state_groups and boundary % self._chunk == 0:
                    out.setdefault(req_id, {}).setdefault(int(boundary), {})[gid] = int(block_id)
        return out

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVGroupsConnectorMetadata()
        pd = self._pd_sched
        protected: set[int] = pd.pinned_entries() if pd is not None else set()
        scheduled = scheduler_output.num_scheduled_tokens
        snapshots = self._snapshots(scheduler_output) if self._state_groups else {}
        touched: list[tuple[str, _Request, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or [])
            hashes = self._hash_memo.get(new.req_id)
            if hashes is None:
                hashes = chunk_hashes(prompt, self._chunk, _salt(new))
                self._hash_memo[new.req_id] = hashes
            state = _Request(prompt, hashes, [list(ids) for ids in new.block_ids])
            self._requests[new.req_id] = state
            after = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            self._emit_load(meta, new.req_id, state, protected, after)
            touched.append((new.req_id, state, after))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            computed = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            if req_id in resumed:
                state.block_ids = [list(ids) for ids in (new_ids or ())]
                state.saved_chunks = 0
                self._emit_load(meta, req_id, state, protected, computed)
            elif new_ids is not None:
                for g, ids in enumerate(new_ids):
                    if ids:
                        state.block_ids[g].extend(ids)
            touched.append((req_id, state, computed))
        for req_id, state, computed_after in touched:
            if pd is not None and not pd.saves:
                continue
            meta.saves.extend(
                self._saves_for(req_id, state, computed_after, protected, snapshots.get(req_id, {}))
            )
            if pd is not None:
                item = pd.publish_item(
                    req_id, state.hashes, self._index, len(state.prompt), computed_after
                )
                if item is not None:
                    meta.pd_publishes.append(item)
        if pd is not None:
            meta.pd_pulls = pd.take_pulls()
        self._counters.evictions(self._index.evictions)
        return meta

    def _emit_load(
        self,
        meta: KVGroupsConnectorMetadata,
        req_id: str,
        state: _Request,
        protected: set[int],
        computed_after: int,
    ) -> None:
        load = self._loads_to_send.pop(req_id, None)
        if load is None:
            return
        hit, computed, entries, taken = load
        ids = self._plan_layout.block_ids(state.block_ids, hit)
        meta.loads.append(
            TransferItem(
                req_id,
                ids,
                entries,
                computed,
                taken,
                state_block_ids=self._running_state_ids(state, ids, computed_after),
            )
        )
        protected.update(entries)
        state.saved_chunks = hit

    def _running_state_ids(
        self, state: _Request, ids: dict[int, list[int]], computed_after: int
    ) -> dict[int, list[int]] | None:
        """``ids`` with each state group's last id replaced by the request's running state
        block of this step (vLLM's align mode runs the step from block ``cdiv(tokens after
        the step, block_size) - 1`` and copies the hit's block there before loads run)."""
        if not self._state_groups or not ids:
            return None
        out = dict(ids)
        for gid, bs in self._state_groups.items():
            running = -(-computed_after // bs) - 1
            table = state.block_ids[gid]
            if not ids.get(gid) or not 0 <= running < len(table):
                return None
            out[gid] = ids[gid][:-1] + [int(table[running])]
        return out

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        params = self._pd_sched.finished_params(request) if self._pd_sched else None
        self._forget(request.request_id)
        return False, params  # the objects live in the host pool: vLLM's blocks free at once

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        return self.request_finished(request, [])

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if self._pd_sched is not None and isinstance(meta, PDWorkerMeta):
            self._pd_sched.on_released(meta.released)

    def _forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._hash_memo.pop(req_id, None)
        self._pending_hits.pop(req_id, None)
        self._loads_to_send.pop(req_id, None)
        self._counters.forget(req_id)
        if self._pd_sched is not None:
            self._pd_sched.forget(req_id)

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
        self._steps = StepTransfers(
            self._store,
            layout.layer_index,
            self._chunk,
            layerwise_loads=self._layerwise_loads,
            state_layers=layout.state_layers,
        )
        log.info(
            "KVGroupsConnector worker: %d host entries per object group (%s), %d kernel "
            "group(s), loads %s, saves %s",
            self._capacity,
            "pinned" if self._store.pinned else "pageable",
            layout.manager.num_kernel_groups,
            "layer by layer" if self._layerwise_loads else "before the forward",
            "layer by layer" if self._store.layerwise else "after the forward",
        )
        if self._pd_worker is not None:
            self._pd_worker.register(kv_caches, self._store)

    @property
    def _pools(self) -> list[torch.Tensor]:
        return self._store.pools if self._store is not None else []

    def _metadata(self) -> KVGroupsConnectorMetadata | None:
        if self._store is None or self._store.prepared is None or not self.has_connector_metadata():
            return None
        return self._get_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._metadata()
        if meta is not None and meta.loads:
            self._steps.start_loads(meta.loads, hooks_will_run(forward_context))
            for item in meta.loads:
                self._counters.add("loaded_chunks", len(item.entries))
                self._counters.add("load_calls")
        if self._pd_worker is not None and meta is not None:
            self._pd_worker.start_pulls(meta.pd_pulls)  # land in staging, loaded when done

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._steps is not None:
            self._steps.wait_layer(layer_name)  # a GPU-side wait: the host goes on

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        meta = self._metadata()
        if meta is None or not meta.saves:
            return
        self._counters.add("store_calls", self._steps.save_layer(layer_name, meta.saves))

    def wait_for_save(self) -> None:
        meta = self._metadata()
        if self._steps is None:
            return
        saves = meta.saves if meta is not None else []
        # Later work on the forward's stream (next step's writes into these blocks, loads
        # from these entries) runs after this step's transfers; the host does not wait.
        self._counters.add("store_calls", self._steps.finish_step(saves))
        for item in saves:
            self._counters.add("saved_chunks", len(item.entries))
        if self._pd_worker is not None and meta is not None:
            self._pd_worker.publish(meta.pd_publishes)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._pd_worker is None:
            return super().get_transfer_results(finished_req_ids)
        done, failed = self._pd_worker.results()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def build_connector_worker_meta(self) -> Any:
        return self._pd_worker.worker_meta() if self._pd_worker is not None else None

    def shutdown(self) -> None:
        if self._pd_worker is not None:
            self._pd_worker.close()

    # ------------------------------------------------------------------ stats (both sides)

    def get_kv_connector_stats(self) -> KVGroupsConnectorStats | None:
        stats = KVGroupsConnectorStats(data=self._counters.take())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVGroupsConnectorStats:
        return KVGroupsConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVGroupsPromMetrics:
        return KVGroupsPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
