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

Recurrent state (hybrid GDN / Mamba models; docs/SEMANTICS.md section 9), given as
``mamba_pool=``:

- ``MambaPool``: ``mamba_cache.conv`` (a list, one buffer per conv state) and
  ``mamba_cache.temporal``, each ``[num_mamba_layers, size + 1, *state]``, conv states
  ``(channels, kernel - 1)``; ``size``, ``num_mamba_layers``.
- ``MambaPoolHost``: ``conv_buffer`` (a list) and ``temporal_buffer`` in its ``layout``:
  ``layer_first`` ``[num_mamba_layers, size, *state]``, or ``page_first`` /
  ``page_first_direct`` ``[size, num_mamba_layers, 1, *state]`` (a slot's layers side by side).

Every buffer's layer ``l`` is viewed (zero-copy) as ``[slots, *state]`` and registered as one
state layer, a recurrent layer's conv states then its temporal state. A slot holds one whole
state; the state engine group's ids are one slot per ``tokens_per_slot`` tokens (default: the
chunk, one snapshot slot per cached chunk): the slot holding the state after that many tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
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
STATE_GROUP = 2  #: engine group of the recurrent-state slots (``mamba_pool=``)
MAMBA_HOST_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


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
        bad = int(
            np.nonzero(
                np.any(pages != (first - first % page_size)[:, None] + np.arange(page_size), axis=1)
            )[0][0]
        )
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
    state_layers: list[int] = field(default_factory=list)
    tokens_per_slot: int = 0

    def block_ids(
        self, slots: Any, swa_slots: Any = None, state_slots: Any = None
    ) -> dict[int, list[int]]:
        """Page ids for ``store`` / ``load`` from a request's token slots (full pool), for a
        hybrid pool its SWA-pool slots (``full_to_swa_index_mapping[slots]``), and with a
        Mamba pool the state slots: one per ``tokens_per_slot`` tokens, the slot holding the
        state after them (its only read in a load is the last)."""
        if self.kind == "state":
            return {STATE_GROUP: self._state_ids(state_slots, None)}
        ids = {FULL_GROUP: pages_from_token_slots(slots, self.page_size, "slots")}
        if self.state_layers:
            ids[STATE_GROUP] = self._state_ids(state_slots, len(ids[FULL_GROUP]))
        elif state_slots is not None:
            raise KVGroupsValueError(
                "state_slots: expected None for a layout without a Mamba pool, got slots"
            )
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

    def _state_ids(self, state_slots: Any, pages: int | None) -> list[int]:
        if state_slots is None:
            raise KVGroupsValueError(
                "state_slots: expected the Mamba pool slots holding the state after every "
                f"{self.tokens_per_slot} tokens, got None"
            )
        ids = [
            int(x)
            for x in np.asarray(
                state_slots.cpu() if hasattr(state_slots, "cpu") else state_slots
            ).ravel()
        ]
        if pages is not None and len(ids) * self.tokens_per_slot != pages * self.page_size:
            raise KVGroupsValueError(
                f"state_slots: expected one slot per {self.tokens_per_slot} tokens of the "
                f"{pages * self.page_size} the pages cover, got {len(ids)} slots"
            )
        return ids


def _mamba_buffers(pool: Any) -> tuple[list, Any, str]:
    """``(conv buffers, temporal buffer, layout)`` of a MambaPool or MambaPoolHost."""
    cache = getattr(pool, "mamba_cache", None)
    if cache is not None and hasattr(cache, "conv") and hasattr(cache, "temporal"):
        return list(cache.conv), cache.temporal, "layer_first"
    if hasattr(pool, "conv_buffer") and hasattr(pool, "temporal_buffer"):
        layout = str(getattr(pool, "layout", "layer_first"))
        if layout not in MAMBA_HOST_LAYOUTS:
            raise KVGroupsValueError(
                f"mamba_pool.layout: expected one of {list(MAMBA_HOST_LAYOUTS)}, got {layout!r}"
            )
        return list(pool.conv_buffer), pool.temporal_buffer, layout
    raise KVGroupsTypeError(
        f"mamba_pool: expected an SGLang MambaPool (mamba_cache.conv / .temporal) or "
        f"MambaPoolHost (conv_buffer / temporal_buffer), got {type(pool).__name__}"
    )


def _mamba_layers(pool: Any) -> tuple[list, list[EngineKVFormat]]:
    """Each Mamba layer's conv states then its temporal state, as ``[slots, *state]`` views."""
    convs, temporal, layout = _mamba_buffers(pool)
    layers = int(pool.num_mamba_layers)

    def layer_view(buf: Any, layer: int, what: str) -> Any:
        if layout == "layer_first":
            if buf.shape[0] != layers:
                raise KVGroupsValueError(
                    f"{what}: expected [num_mamba_layers={layers}, slots, ...], got shape "
                    f"{tuple(buf.shape)}"
                )
            return buf[layer]
        if buf.ndim < 4 or buf.shape[1] != layers or buf.shape[2] != 1:
            raise KVGroupsValueError(
                f"{what}: expected page_first [slots, num_mamba_layers={layers}, 1, ...], got "
                f"shape {tuple(buf.shape)}"
            )
        return buf[:, layer, 0]

    caches, formats = [], []
    for layer in range(layers):
        for i, conv in enumerate(convs):
            view = layer_view(conv, layer, f"mamba_pool conv[{i}]")
            if view.ndim != 3:
                raise KVGroupsValueError(
                    f"mamba_pool conv[{i}]: expected (channels, kernel - 1) conv states, got "
                    f"{tuple(view.shape[1:])}"
                )
            caches.append(view)
            formats.append(EngineKVFormat.NL_X_NB_CD_CW)  # SGLang keeps conv states "DS"
        caches.append(layer_view(temporal, layer, "mamba_pool temporal"))
        formats.append(EngineKVFormat.NL_X_NB_SH_SS)
    return caches, formats


def from_sglang_mamba_pool(
    pool: Any, *, chunk_size: int = 256, tokens_per_slot: int | None = None
) -> SglangKVLayout:
    """A state-only :class:`SglangKVLayout` of a ``MambaPool`` or ``MambaPoolHost``: one
    engine group (:data:`STATE_GROUP`) of slots, ``tokens_per_slot`` tokens per slot id
    (default the chunk); ``block_ids(None, state_slots=...)`` takes the slots."""
    caches, formats = _mamba_layers(pool)
    tps = _tokens_per_slot(tokens_per_slot, chunk_size)
    manager = _manager(
        caches, formats, [STATE_GROUP] * len(caches), {STATE_GROUP: (tps, -1)}, chunk_size
    )
    return SglangKVLayout(manager, caches, 1, [], "state", list(range(len(caches))), tps)


def from_sglang_pool(
    pool: Any,
    *,
    chunk_size: int = 256,
    sliding_window: int | None = None,
    mamba_pool: Any = None,
    tokens_per_slot: int | None = None,
) -> SglangKVLayout:
    """Build a :class:`SglangKVLayout` from an SGLang KV pool (see the module docstring).

    With ``mamba_pool`` (a hybrid model's ``MambaPool`` or ``MambaPoolHost``), its recurrent
    states follow the attention layers in one manager (engine group :data:`STATE_GROUP`,
    ``tokens_per_slot`` tokens per slot id, default the chunk), so one ``hit_chunks`` covers
    both; the attention layers are then registered per layer (MHA as ``(K, V)`` pairs), with
    the same objects as without state.

    Raises KVGroupsTypeError for an object that is no SGLang pool, KVGroupsValueError for a
    hybrid pool without ``sliding_window`` and for buffers that are not whole pages.
    """
    kind = _pool_kind(pool)
    page_size = int(pool.page_size)
    if kind == "mla":
        views = [
            _paged(b, page_size, f"kv_buffer[{i}]")[:, :, 0] for i, b in enumerate(pool.kv_buffer)
        ]
        start = int(getattr(pool, "start_layer", 0) or 0)
        layer_ids = [start + i for i in range(len(views))]
        caches: Any = views
        formats = [EngineKVFormat.NL_X_NB_BS_HS] * len(views)
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
        if mamba_pool is None:
            caches, formats = [ks, vs], [EngineKVFormat.TWO_X_NL_X_NB_BS_NH_HS] * len(ks)
        else:  # one layer list that state layers can join: (K, V) pairs, the same planes
            caches, formats = list(zip(ks, vs)), [EngineKVFormat.NL_X_TWO_X_NB_BS_NH_HS] * len(ks)
    windows = {g: (page_size, w) for g, w in window.items()}
    state_layers: list[int] = []
    tps = 0
    if mamba_pool is not None:
        state, state_formats = _mamba_layers(mamba_pool)
        tps = _tokens_per_slot(tokens_per_slot, chunk_size)
        state_layers = list(range(len(caches), len(caches) + len(state)))
        caches = list(caches) + state
        formats = list(formats) + state_formats
        groups = list(groups) + [STATE_GROUP] * len(state)
        windows[STATE_GROUP] = (tps, -1)
    manager = _manager(caches, formats, groups, windows, chunk_size)
    return SglangKVLayout(manager, caches, page_size, layer_ids, kind, state_layers, tps)


def _tokens_per_slot(value: int | None, chunk: int) -> int:
    tps = chunk if value is None else int(value)
    if tps <= 0 or chunk % tps:
        raise KVGroupsValueError(
            f"tokens_per_slot: expected a positive divisor of chunk_size {chunk}, got {value!r}"
        )
    return tps


def _manager(
    caches: Any,
    formats: Sequence[EngineKVFormat],
    groups: Sequence[int],
    windows: dict[int, tuple[int, int]],
    chunk: int,
) -> KVLayerGroupsManager:
    """One EngineGroupInfo per kernel group: the engine's page (or slot) spaces, their tokens
    per id and windows; the state group's layers are recurrent state."""
    if len(set(formats)) == 1:  # one format for every layer: the engine's own structure
        formats = formats[0]
    infos = [
        EngineGroupInfo(
            engine_group_id=ident.engine_group_idx,
            layer_indices=tuple(layers),
            tokens_per_block=windows[ident.engine_group_idx][0],
            sw_size_tokens=windows[ident.engine_group_idx][1],
            recurrent_state=ident.engine_group_idx == STATE_GROUP,
        )
        for ident, layers in group_layers_by_identity(caches, formats, list(groups))
    ]
    return KVLayerGroupsManager(caches, formats, infos, lmcache_tokens_per_chunk=chunk)
