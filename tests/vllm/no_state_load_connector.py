"""Test-only: KVGroupsConnector that loads a hit's attention KV but not its recurrent-state
snapshot, the way a cache that ignores state reports hits (LMCache #2863). The hybrid
end-to-end test runs it as the negative control: outputs must then differ."""

from __future__ import annotations

from kvgroups_torch.vllm.connector import KVGroupsConnector


class NoStateLoadConnector(KVGroupsConnector):
    def start_load_kv(self, forward_context, **kwargs):
        if not self.has_connector_metadata():
            return
        state = set(self._layout.state_layers)
        attention = [i for i in range(len(self._layout.kv_caches)) if i not in state]
        for item in self._get_connector_metadata().loads:
            self._store.load(item.block_ids, item.entries, item.skip_tokens, layers=attention)
            self.stats["loaded_chunks"] += len(item.entries)
