"""SGLang's KV pools -> a kvgroups manager, and SGLang's token slots -> page ids.

SGLang (``sglang/srt/mem_cache/memory_pool.py``) keeps the cache in token pools; the adapter
reads them by the pools' own attribute names (it never imports SGLang):

- ``MHATokenToKVPool``: ``k_buffer[l]`` and ``v_buffer[l]`` of ``[size + page_size, head_num,
  head_dim]`` (slot 0's page is the padding page), ``page_size``, ``layer_num``,
  ``start_layer``.
- ``MLATokenToKVPool``: ``kv_buffer[l]`` of ``[size + page_size, 1, kv_lora_rank +
  qk_rope_head_dim]``.
- ``SWAKVPool`` (hybrid sliding-window models): ``full_kv_pool`` and ``swa_kv_pool`` (two MHA
  pools of different sizes, so two page spaces) and ``layers_mapping`` (global layer id ->
  (layer index inside its pool, is_swa)). The window size lives in the model config, not the
  pool: pass ``sliding_window``.

Each buffer is viewed (zero-copy) as ``[pages, page_size, heads, head_dim]``; a page is a
block. A request's slots come from ``req_to_token_pool.req_to_token[req_pool_idx, :len]``;
:func:`pages_from_token_slots` turns page-aligned slots into page ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvgroups_core import (
    EngineGroupInfo,
    EngineKVFormat,
    KVLayerGroupsManager,
    group_layers_by_identity,
)
from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError

FULL_GROUP = 0  #: engine group of full-attention layers (and of every layer of a plain pool)
SWA_GROUP = 1  #: engine group of a hybrid pool's sliding-window layers


def pages_from_token_slots(slots: Any, page_size: int, what: str = "slots") -> list[int]:
    """Page ids of a request's token slots (whole pages, page-aligned, in order).

    Raises KVGroupsValueError naming ``what`` when the slots do not fill whole pages or a
    page's slots are not ``page * page_size + 0 .. page_size - 1``.
    """
    locs = np.asarray(slots.cpu() if hasattr(slots, "cpu") else slots, dtype=np.int64).ravel()
    if len(locs) % page_size:
        raise KVGroupsValueError(
            f"{what}: expected whole pages of {page_size} slots, got {len(locs)} slots"
        )
    pages = locs.reshape(-1, page_size)
    first = pages[:, 0]
    if np.any(first % page_size) or np.any(pages != first[:, None] + np.arange(page_size)):
        bad = int(np.nonzero(np.any(pages != (first - first % page_size)[:, None]
                                    + np.arange(page_size), axis=1))[0][0])
        raise KVGroupsValueError(
            f"{what}: expected page-aligned runs of {page_size} consecutive slots, page {bad} "
            f"holds slots {pages[bad].tolist()}"
        )
    return (first // page_size).tolist()


def _paged(buf: Any, page_size: int, what: str) -> Any:
    rows = buf.shape[0]
    if rows % page_size:
        raise KVGroupsValueError(
            f"{what}: expected a whole number of {page_size}-slot pages, got {rows} slots"
        )
    return buf.view(rows // page_size, page_size, *buf.shape[1:])


def _pool_kind(pool: Any) -> str:
    if hasattr(pool, "full_kv_pool") and hasattr(pool, "swa_kv_pool"):
        return "swa"
    if hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer"):
        return "mha"
    if hasattr(pool, "kv_buffer"):
        return "mla"
    raise KVGroupsTypeError(
        f"pool: expected an SGLang MHATokenToKVPool, MLATokenToKVPool or SWAKVPool (k_buffer/"
        f"v_buffer, kv_buffer, or full_kv_pool/swa_kv_pool), got {type(pool).__name__}"
    )


@dataclass
class SglangKVLayout:
    """An SGLang pool as kvgroups sees it: the manager, the normalized caches it reads, the
    page size, and the global layer id of every manager layer."""

    manager: KVLayerGroupsManager
    kv_caches: Any
    page_size: int
    layer_ids: list[int]
    kind: str

    def block_ids(self, slots: Any, swa_slots: Any = None) -> dict[int, list[int]]:
        """Page ids for ``store`` / ``load`` from a request's token slots (full pool), and for
        a hybrid pool its SWA-pool slots (``full_to_swa_index_mapping[slots]``)."""
        ids = {FULL_GROUP: pages_from_token_slots(slots, self.page_size, "slots")}
        if self.kind == "swa":
            if swa_slots is None:
                raise KVGroupsValueError(
                    "swa_slots: expected the SWA pool's slots of the request (a hybrid pool "
                    "has two page spaces), got None"
                )
            ids[SWA_GROUP] = pages_from_token_slots(swa_slots, self.page_size, "swa_slots")
        elif swa_slots is not None:
            raise KVGroupsValueError(
                f"swa_slots: expected None for a {self.kind.upper()} pool (one page space)"
            )
        return ids


def from_sglang_pool(pool: Any, *, chunk_size: int = 256,
                     sliding_window: int | None = None) -> SglangKVLayout:
    """Build a :class:`SglangKVLayout` from an SGLang KV pool (see the module docstring).

    Raises KVGroupsTypeError for an object that is no SGLang pool, KVGroupsValueError for a
    hybrid pool without ``sliding_window`` and for buffers that are not whole pages.
    """
    kind = _pool_kind(pool)
    page_size = int(pool.page_size)
    if kind == "mla":
        views = [_paged(b, page_size, f"kv_buffer[{i}]")[:, :, 0] for i, b in enumerate(pool.kv_buffer)]
        start = int(getattr(pool, "start_layer", 0) or 0)
        layer_ids = [start + i for i in range(len(views))]
        caches, fmt = views, EngineKVFormat.NL_X_NB_BS_HS
        groups = [FULL_GROUP] * len(views)
        window = {FULL_GROUP: -1}
    else:
        if kind == "mha":
            pools = [(pool, False)]
            start = int(getattr(pool, "start_layer", 0) or 0)
            layer_ids = [start + i for i in range(len(pool.k_buffer))]
            where = [(0, i) for i in range(len(pool.k_buffer))]
            window = {FULL_GROUP: -1}
        else:
            if sliding_window is None or int(sliding_window) <= 0:
                raise KVGroupsValueError(
                    f"sliding_window: expected the model's window in tokens for an SWAKVPool, "
                    f"got {sliding_window!r}"
                )
            pools = [(pool.full_kv_pool, False), (pool.swa_kv_pool, True)]
            mapping = dict(pool.layers_mapping)
            layer_ids = sorted(mapping)
            where = [(1 if mapping[g][1] else 0, int(mapping[g][0])) for g in layer_ids]
            sw = int(sliding_window)
            # A window shorter than a chunk is stored as whole pages (a few tokens more).
            sw = -(-sw // page_size) * page_size if sw < chunk_size else sw
            window = {FULL_GROUP: -1, SWA_GROUP: sw}
        ks, vs, groups = [], [], []
        for p, i in where:
            src = pools[p][0]
            ks.append(_paged(src.k_buffer[i], page_size, f"k_buffer[{i}]"))
            vs.append(_paged(src.v_buffer[i], page_size, f"v_buffer[{i}]"))
            groups.append(SWA_GROUP if pools[p][1] else FULL_GROUP)
        caches, fmt = [ks, vs], EngineKVFormat.TWO_X_NL_X_NB_BS_NH_HS
    manager = _manager(caches, fmt, groups, page_size, window, chunk_size)
    return SglangKVLayout(manager, caches, page_size, layer_ids, kind)


def _manager(caches: Any, fmt: EngineKVFormat, groups: Sequence[int], page_size: int,
             windows: dict[int, int], chunk: int) -> KVLayerGroupsManager:
    """One EngineGroupInfo per kernel group (the engine's page spaces, windows in tokens)."""
    infos = [EngineGroupInfo(engine_group_id=ident.engine_group_idx, layer_indices=tuple(layers),
                             tokens_per_block=page_size,
                             sw_size_tokens=windows[ident.engine_group_idx])
             for ident, layers in group_layers_by_identity(caches, fmt, list(groups))]
    return KVLayerGroupsManager(caches, fmt, infos, lmcache_tokens_per_chunk=chunk)
