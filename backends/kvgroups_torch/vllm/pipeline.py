"""A step's transfers on KVGroupsConnector's worker side, pipelined with the forward pass
(imports no vLLM module; the connector hands it vLLM's per-step items).

- **Loads.** ``start_load_kv`` queues every hit's load layer by layer on a side stream
  (:class:`~kvgroups_torch.layerwise.LayerwiseLoad`), and each attention layer's
  ``wait_for_layer_load`` makes the forward's stream wait for its own layer's load, on the
  GPU. Two kinds of step load before the forward instead, in one whole-model call queued on
  the forward's stream (still no host wait): steps whose attention layers will not call the
  connector (vLLM replays a FULL CUDA graph, which vLLM captured without the connector's
  hooks) and loads that write blocks the step also computes (vLLM took only part of a chunk:
  its other tokens are recomputed into the same blocks, and that write must come after the
  load).
- **Saves.** ``save_kv_layer`` queues layer ``l``'s store on a side stream that waits for
  the forward's stream as it is then (layer ``l``'s KV written)
  (:class:`~kvgroups_torch.layerwise.LayerwiseSave`). ``wait_for_save`` stores whatever no
  hook saved (all of it after a FULL graph replay) and makes the forward's stream wait for
  every save, so no block is reused before its save ran.

Recurrent-state layers (hybrid models) have no attention hook: their loads always run before
the forward, and their saves (and a save item limited to some layers, ``item.layers``) are
made at ``wait_for_save``. A load item's ``state_block_ids`` writes the snapshot a second time,
into the request's running state block, also before the forward.

On CPU the loads run at each layer's wait (LayerwiseLoad's CPU semantics), so a layer whose
attention ran before its wait computes on stale bytes there as it would race on the GPU.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kvgroups_core.logs import logger as kvgroups_logger
from kvgroups_torch import LayerwiseLoad, LayerwiseSave

from .host_store import HostChunkStore

logger = kvgroups_logger("vllm")


def hooks_will_run(forward_context: Any) -> bool:
    """Whether this step's attention layers call ``wait_for_layer_load`` / ``save_kv_layer``:
    vLLM calls them from its attention op when the forward runs eagerly or in PIECEWISE graphs
    (attention runs between the pieces), with attention metadata bound; a FULL graph replay
    runs no Python (and vLLM captures those graphs without connector metadata, so they hold
    no hook). vLLM's V2 runner starts FULL-graph steps' loads outside any forward context:
    no attention metadata then."""
    if forward_context is None or getattr(forward_context, "attn_metadata", None) is None:
        return False
    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    return getattr(mode, "name", mode) != "FULL"


def entry_rows(pools: Sequence[torch.Tensor], entries: list[int]) -> list:
    """Each object group's rows for ``entries``: one view for consecutive entries, else one view
    per chunk (objects as per-chunk lists), never a gathered copy (which would have to wait
    on the host for earlier saves into those rows)."""
    first = entries[0]
    if entries == list(range(first, first + len(entries))):
        return [pool[first : first + len(entries)] for pool in pools]
    return [[pool[s] for s in entries] for pool in pools]


def _grouped(manager: Any) -> list[int]:
    return sorted(layer for group in manager.kernel_groups for layer in group.layer_indices)


def _saves_layer(item: Any, layer: int) -> bool:
    """Whether save ``item`` stores ``layer`` (an item may be limited to some layers)."""
    layers = getattr(item, "layers", None)
    return layers is None or layer in layers


class StepTransfers:
    """The loads and saves of each step for one set of registered caches.

    Parameters
    ----------
    store : HostChunkStore
        The pool buffers and the prepared transfer.
    layer_index : dict of str to int
        vLLM layer name -> manager layer index (``VllmKVLayout.layer_index``).
    chunk_size : int
        Tokens per cached chunk.
    layerwise_loads : bool
        Pipeline the loads (per-layer waits); False loads every hit before the forward.
    state_layers : sequence of int
        Manager layers holding recurrent state: vLLM calls no per-layer hook for them.
    """

    def __init__(
        self,
        store: HostChunkStore,
        layer_index: dict[str, int],
        chunk_size: int,
        layerwise_loads: bool = True,
        state_layers: Sequence[int] = (),
    ) -> None:
        self.store = store
        self.layer_index = layer_index
        self.chunk_size = chunk_size
        self.state_layers = sorted(state_layers)
        prepared = store.prepared
        per_layer = prepared is not None and store.layerwise
        self.loads = None
        if per_layer and layerwise_loads:
            hooked = [
                layer for layer in _grouped(prepared.manager) if layer not in set(self.state_layers)
            ]
            self.loads = LayerwiseLoad(prepared, layers=hooked) if hooked else None
        self.saves = LayerwiseSave(prepared) if per_layer else None
        self._saved: dict[int, None] = {}  # layers saved by hooks this step, in order
        self._waited: set[int] | None = None  # layers waited for in a pipelined step

    # ---------------------------------------------------------------- loads

    def start_loads(self, items: Sequence[Any], hooks_run: bool) -> None:
        """Queue the step's loads (``items``: objects with ``block_ids``, ``entries``,
        ``skip_tokens`` and ``taken_tokens``)."""
        pipelined = []
        prepared = self.store.prepared
        for item in items:
            rows = entry_rows(self.store.pools, item.entries)
            if self.loads is not None and hooks_run and not self._recomputed(item):
                pipelined.append((rows, item.block_ids, item.skip_tokens))
                if self.state_layers:  # no hook waits for these: before the forward
                    prepared.load(
                        rows,
                        item.block_ids,
                        skip_first_n_tokens=item.skip_tokens,
                        layers=self.state_layers,
                    )
            else:  # before the forward, on its stream
                prepared.load(rows, item.block_ids, skip_first_n_tokens=item.skip_tokens)
            state_ids = getattr(item, "state_block_ids", None)
            if state_ids is not None:  # the snapshot again, into the running state block
                prepared.load(
                    rows, state_ids, skip_first_n_tokens=item.skip_tokens, layers=self.state_layers
                )
        if pipelined:
            self.loads.start_many(pipelined)
            self._waited = set()

    def _recomputed(self, item: Any) -> bool:
        """The load writes blocks this step also computes: vLLM took fewer tokens than the
        chunks loaded (unknown counts as taken in full: the scheduler always sends it)."""
        taken = getattr(item, "taken_tokens", None)
        return taken is not None and taken < len(item.entries) * self.chunk_size

    def wait_layer(self, layer_name: str) -> None:
        """Before ``layer_name``'s attention: its load is done (on the forward's stream)."""
        loads = self.loads
        if loads is None or not loads.pending:
            return
        layer = self.layer_index.get(layer_name)
        if layer is None or layer not in loads.layers:
            loads.finish()  # a layer reading another's KV (sharing), or unknown: wait for all
            self._waited = set(loads.layers)
            return
        loads.wait(layer)
        if self._waited is not None:
            self._waited.add(layer)

    # ---------------------------------------------------------------- saves

    def save_layer(self, layer_name: str, items: Sequence[Any]) -> int:
        """After ``layer_name``'s attention: queue its store for every save item. Returns the
        number of stores queued."""
        if self.saves is None or not items:
            return 0
        layer = self.layer_index.get(layer_name)
        if layer is None or layer not in self.saves.layers:
            return 0  # its KV is another layer's (sharing) or not cached
        mine = [item for item in items if _saves_layer(item, layer)]
        self.saves.save_many(
            layer, [(item.block_ids, entry_rows(self.store.pools, item.entries)) for item in mine]
        )
        self._saved[layer] = None
        return len(mine)

    def finish_step(self, saves: Sequence[Any]) -> int:
        """End of the step (``wait_for_save``): loads no wait covered are joined, saves no
        hook made are queued, and the forward's stream waits for all of them. Returns the
        number of stores queued here."""
        if self.loads is not None and self.loads.pending:
            self.loads.finish()
        if self._waited is not None:
            missed = [layer for layer in self.loads.layers if layer not in self._waited]
            self._waited = None
            if missed:
                # The forward read those layers without waiting for their loads: from now on
                # every load runs before the forward (this step may have read stale pages).
                logger.warning(
                    "kvgroups: layers %s were never waited for (no wait_for_layer_load before "
                    "their attention); loading before the forward from now on",
                    missed,
                )
                self.loads = None
        calls = 0
        if saves:
            missing = (
                []
                if self.saves is None
                else [layer for layer in self.saves.layers if layer not in self._saved]
            )
            if self.saves is None or not self._saved:
                for item in saves:  # no hook ran (a FULL graph replay): one call per item
                    self.store.save(
                        item.block_ids, item.entries, layers=getattr(item, "layers", None)
                    )
                    calls += 1
            else:  # the layers no hook saved (state layers among them)
                for layer in missing:
                    mine = [item for item in saves if _saves_layer(item, layer)]
                    self.saves.save_many(
                        layer,
                        [
                            (item.block_ids, entry_rows(self.store.pools, item.entries))
                            for item in mine
                        ],
                    )
                    calls += len(mine)
        if self.saves is not None:
            self.saves.finish()
        self._saved.clear()
        return calls
