"""Test-only: KVGroupsConnector variants that fill every block a load is about to write with
random bytes first (all layers, queued before the loads), so a layer whose attention ran
before its own load would attend to noise.

- ``ScrambledTargetConnector``: then loads as usual (the outputs must equal a run without a
  connector: every layer waited for its load);
- ``UnwaitedConnector``: the same without ``wait_for_layer_load`` (the negative control: the
  outputs of a loaded prompt change)."""

from __future__ import annotations

import torch
from kvgroups_torch.vllm.connector import KVGroupsConnector


class ScrambledTargetConnector(KVGroupsConnector):
    def start_load_kv(self, forward_context, **kwargs):
        meta = self._metadata()
        if meta is not None:
            gen = torch.Generator().manual_seed(11)
            for item in meta.loads:
                noise = [
                    torch.randint(
                        0, 256, (len(item.entries), pool.shape[1]), dtype=torch.uint8, generator=gen
                    )
                    for pool in self._pools
                ]
                self._store.prepared.load(
                    noise, item.block_ids, skip_first_n_tokens=item.skip_tokens
                )
        super().start_load_kv(forward_context, **kwargs)


class UnwaitedConnector(ScrambledTargetConnector):
    def wait_for_layer_load(self, layer_name):
        return
