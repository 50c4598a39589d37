"""Test-only: vLLM's own ExampleConnector (disk, per layer), made to cache exactly the first
``load_tokens`` tokens of a prompt (kv_connector_extra_config) instead of all but the last.

It is the reference for MLA, where vLLM's CPU attention over a loaded context is not bitwise
the attention of a one-pass prefill: KVGroupsConnector must give exactly what vLLM's own
connector gives at the same split."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1 import example_connector
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector


class FixedSplitExampleConnector(ExampleConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        tokens = int(self._kv_transfer_config.get_from_extra_config("load_tokens", 512))
        # ExampleConnector sizes what it saves and loads with this module-level helper.
        example_connector.align_to_block_size = lambda num_tokens, block_size: tokens
