"""kvgroups for vLLM: the adapter from vLLM's KV cache config and the KV connector.

- :func:`from_kv_cache_config` / :func:`manager_from_kv_cache_config`: vLLM's ``KVCacheConfig``
  and the ``register_kv_caches`` dict -> a manager, the tensors in its layer order, and the
  conversion of vLLM's per-group block ids (:meth:`VllmKVLayout.block_ids`).
- ``KVGroupsConnector``: a ``KVConnectorBase_V1`` (hybrid-aware) keeping a prefix cache of
  memory objects in host memory. Select it with ``KVTransferConfig(kv_connector=
  "KVGroupsConnector", kv_connector_module_path="kvgroups_torch.vllm", kv_role="kv_both")``.
- :class:`HostChunkStore`: the connector's worker side without vLLM (pool buffers in host
  memory filled and read by prepared calls), public so that benchmarks measure its calls.

The adapter imports no vLLM module (it reads vLLM's objects by their attributes), so it loads
without vLLM; the connector needs vLLM and is imported on first use.
"""

from __future__ import annotations

from typing import Any

from .adapter import VllmKVLayout, from_kv_cache_config, manager_from_kv_cache_config, natural_key
from .host_store import HostChunkStore
from .prefix_index import ChunkIndex, chunk_hashes

__all__ = [
    "ChunkIndex",
    "HostChunkStore",
    "KVGroupsConnector",
    "VllmKVLayout",
    "chunk_hashes",
    "from_kv_cache_config",
    "manager_from_kv_cache_config",
    "natural_key",
]


def __getattr__(name: str) -> Any:
    # vLLM's factory does getattr(import_module("kvgroups_torch.vllm"), "KVGroupsConnector").
    if name in ("KVGroupsConnector", "KVGroupsConnectorMetadata"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
