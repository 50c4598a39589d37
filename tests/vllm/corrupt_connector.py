"""Test-only: KVGroupsConnector that scrambles every chunk just before loading it.

The end-to-end tests run it as a negative control: if outputs stayed equal with scrambled
loads, equal outputs with the real connector would prove nothing."""

from __future__ import annotations

import torch
from kvgroups_torch.vllm.connector import KVGroupsConnector


class CorruptingConnector(KVGroupsConnector):
    def start_load_kv(self, forward_context, **kwargs):
        if self.has_connector_metadata():
            gen = torch.Generator().manual_seed(7)
            for item in self._get_connector_metadata().loads:
                index = torch.tensor(item.entries, dtype=torch.long)
                for pool in self._pools:
                    noise = torch.randint(
                        0, 256, (len(item.entries), pool.shape[1]), dtype=torch.uint8, generator=gen
                    )
                    pool.index_copy_(0, index, noise)
        super().start_load_kv(forward_context, **kwargs)
