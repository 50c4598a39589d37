"""What KVGroupsConnector did, for vLLM's metrics and for the log.

Counted in chunks (the connector's unit of caching):

- scheduler side: ``lookup_chunks`` (whole prompt chunks looked up, once per request),
  ``hit_chunks`` (found in the host cache and offered to vLLM), ``miss_chunks`` (not found),
  ``evicted_chunks`` (least recently used chunks dropped to make room for saves);
- worker side: ``loaded_chunks`` / ``saved_chunks`` (moved between the engine's blocks and the
  host entries) and the ``load_calls`` / ``store_calls`` that moved them.

vLLM collects them through the connector's hooks: each process's connector hands over what it
counted since the last call (``get_kv_connector_stats``), the scheduler adds the two sides
(:class:`KVGroupsConnectorStats`), and vLLM's stat loggers print them ("KV Transfer
metrics: ...") and feed the Prometheus counters of :class:`KVGroupsPromMetrics`
(``vllm:kvgroups_hit_chunks_total`` ...). Both need vLLM's stat logging on (``vllm serve``
has it; ``LLM(..., disable_log_stats=False)`` offline).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvgroups_core.logs import logger

log: logging.Logger = logger("vllm")

#: The counters, in the order the log prints them, with what each Prometheus counter says.
COUNTERS = {
    "lookup_chunks": "Whole prompt chunks KVGroupsConnector looked up in its host cache.",
    "hit_chunks": "Prompt chunks found in KVGroupsConnector's host cache and offered to vLLM.",
    "miss_chunks": "Prompt chunks looked up and not found in KVGroupsConnector's host cache.",
    "evicted_chunks": "Chunks KVGroupsConnector evicted (least recently used) to save others.",
    "loaded_chunks": "Chunks KVGroupsConnector loaded from host memory into vLLM's blocks.",
    "saved_chunks": "Chunks KVGroupsConnector saved from vLLM's blocks into host memory.",
    "load_calls": "kvgroups load calls KVGroupsConnector made.",
    "store_calls": "kvgroups store calls KVGroupsConnector made (per layer when layer-wise).",
}


class ConnectorCounters:
    """The counters of one connector (one process's side of it): running totals, and what was
    counted since :meth:`take` last handed an interval to vLLM."""

    def __init__(self) -> None:
        self.totals = dict.fromkeys(COUNTERS, 0)
        self._interval = dict.fromkeys(COUNTERS, 0)
        self._looked_up: set[str] = set()
        self._evictions_seen = 0

    def add(self, key: str, n: int = 1) -> None:
        self.totals[key] += n
        self._interval[key] += n

    def looked_up(self, req_id: str, chunks: int, hits: int) -> None:
        """A request's lookup: counted once per request (vLLM may ask again while the request
        waits for blocks)."""
        if req_id in self._looked_up:
            return
        self._looked_up.add(req_id)
        self.add("lookup_chunks", chunks)
        self.add("hit_chunks", hits)
        self.add("miss_chunks", chunks - hits)
        log.info(
            "request %s: %d of %d prompt chunks in the host cache (%d missing)",
            req_id,
            hits,
            chunks,
            chunks - hits,
        )

    def forget(self, req_id: str) -> None:
        self._looked_up.discard(req_id)

    def evictions(self, total: int) -> None:
        """The index's running eviction count: what is new since the last call is counted."""
        new = total - self._evictions_seen
        if new > 0:
            self._evictions_seen = total
            self.add("evicted_chunks", new)
            log.info("evicted %d chunk(s) from the host cache (%d in all)", new, total)

    def take(self) -> dict[str, int]:
        """What was counted since the last call (and start a new interval)."""
        out, self._interval = self._interval, dict.fromkeys(COUNTERS, 0)
        return out


@dataclass
class KVGroupsConnectorStats(KVConnectorStats):
    """vLLM's container for the counters of one interval: summed across the scheduler and the
    workers, reduced to totals and a hit rate for the log."""

    def __post_init__(self) -> None:
        for key in COUNTERS:
            self.data.setdefault(key, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVGroupsConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {key: self.data.get(key, 0) for key in COUNTERS}
        lookups = out["lookup_chunks"]
        out["hit_rate"] = round(out["hit_chunks"] / lookups, 4) if lookups else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(key, 0) for key in COUNTERS)


class KVGroupsPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per entry of :data:`COUNTERS`, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: self._counter_cls(
                name=f"vllm:kvgroups_{key}_total", documentation=doc, labelnames=labelnames
            )
            for key, doc in COUNTERS.items()
        }
        self._children: dict[tuple[int, str], Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key not in self._counters or not value:
                continue
            child = self._children.get((engine_idx, key))
            if child is None:
                child = self._counters[key].labels(*self.per_engine_labelvalues[engine_idx])
                self._children[(engine_idx, key)] = child
            child.inc(value)
