"""JAX serving engines' KV caches -> a kvgroups manager, and their page tables -> block ids.

- tpu-inference (vLLM on TPU) and sglang-jax: one array per layer, ``[num_pages, page_size,
  2 * heads // packing, packing, head_dim]`` with K and V interleaved along the heads
  (``packing = 32 // dtype bits``). The runner keeps them as a list (tpu-inference:
  ``runner.kv_caches``, its index per layer name in ``runner.layer_name_to_kvcache_index``;
  sglang-jax: ``token_to_kv_pool.kv_buffer``). Block ids are vLLM's (per KV cache group) for
  tpu-inference, page ids for sglang-jax.
- MaxText paged attention: separate K and V page arrays per layer, ``[heads, num_pages,
  page_size, head_dim]`` (``key_pages`` / ``value_pages``); a request's pages are a row of
  ``page_state.page_map`` (``num_pages_used`` of them).

- sglang-jax's ``RecurrentStatePool`` (hybrid GDN / linear-attention models, docs/SEMANTICS.md
  section 9): per recurrent layer a list ``conv_buffers[l]`` of ``[slots, channels, kernel -
  1]`` conv states and ``recurrent_buffers[l]`` ``[slots, H, D, D]``; each array is one state
  layer (conv states then the temporal state), beside the attention layers of
  ``from_sglang_jax`` (``recurrent_pool=``) or alone (:func:`from_sglang_jax_recurrent`).
  Slot 0 of each data-parallel rank is the dummy slot. The state group's ids are one slot per
  ``tokens_per_slot`` tokens (default the chunk): the slot holding the state after them.

The adapter views every array in the format the core plans for (tpu-inference arrays as
``[NB, BS, NH, 2, HS]``: a reshape that is free for row-major arrays and an identity for
bfloat16) and returns :class:`JaxEngineLayout`; hand ``layout.kv_caches`` to ``store`` /
``load`` and turn what ``load`` returns back with :meth:`JaxEngineLayout.to_engine` (and a
recurrent pool's arrays with :meth:`JaxEngineLayout.state_to_engine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
import numpy as np

from kvgroups_core import (
    EngineGroupInfo,
    EngineKVFormat,
    KVLayerGroupsManager,
    group_layers_by_identity,
)
from kvgroups_core.errors import KVGroupsIndexError, KVGroupsValueError


@dataclass
class JaxEngineLayout:
    """The manager, the arrays it reads (in its format), and how to give them back."""

    manager: KVLayerGroupsManager
    kv_caches: Any
    engine: str
    engine_shapes: list[tuple[int, ...]]
    # Manager layers of a recurrent pool's states, and per recurrent layer how many conv
    # states precede its temporal state.
    state_layers: list[int] = field(default_factory=list)
    convs_per_layer: list[int] = field(default_factory=list)

    def to_engine(self, kv_caches: Any) -> list:
        """Arrays returned by ``load`` in the engine's own shapes (tpu-inference / sglang-jax:
        the per-layer list, the attention layers only; MaxText: ``[K list, V list]``
        unchanged)."""
        if self.engine == "maxtext":
            return kv_caches
        state = set(self.state_layers)
        attention = [x for i, x in enumerate(kv_caches) if i not in state]
        return [jnp.reshape(x, s) for x, s in zip(attention, self.engine_shapes)]

    def state_to_engine(self, kv_caches: Any) -> tuple[list, list]:
        """A recurrent pool's arrays from what ``load`` returns, as ``RecurrentStatePool``
        keeps them: ``(recurrent_buffers, conv_buffers)`` (its ``replace_buffer`` takes that)."""
        arrays = [kv_caches[i] for i in self.state_layers]
        recurrent, conv, pos = [], [], 0
        for n in self.convs_per_layer:
            conv.append(arrays[pos : pos + n])
            recurrent.append(arrays[pos + n])
            pos += n + 1
        return recurrent, conv


def _manager(
    caches: Any,
    fmt: EngineKVFormat,
    num_layers: int,
    layer_groups: Sequence[Sequence[int]] | None,
    windows: Sequence[int] | None,
    tokens_per_block: int,
    chunk: int,
) -> KVLayerGroupsManager:
    """One EngineGroupInfo per kernel group: the engine's block spaces and windows (tokens)."""
    groups = [list(g) for g in layer_groups] if layer_groups else [list(range(num_layers))]
    windows = list(windows) if windows is not None else [-1] * len(groups)
    if len(windows) != len(groups):
        raise KVGroupsValueError(
            f"windows: expected one window per engine group ({len(groups)}), got {len(windows)}"
        )
    per_layer = [-1] * num_layers
    for gid, layers in enumerate(groups):
        for i in layers:
            if not 0 <= i < num_layers:
                raise KVGroupsIndexError(
                    f"layer_groups[{gid}]: layer {i} is outside the {num_layers} layers"
                )
            per_layer[i] = gid
    infos = []
    for ident, layers in group_layers_by_identity(caches, fmt, per_layer):
        gid = ident.engine_group_idx
        if gid < 0:
            continue
        sw = int(windows[gid])
        if 0 < sw < chunk:  # a sub-chunk window is stored as whole pages
            sw = -(-sw // tokens_per_block) * tokens_per_block
        infos.append(
            EngineGroupInfo(
                engine_group_id=gid,
                layer_indices=tuple(layers),
                tokens_per_block=tokens_per_block,
                sw_size_tokens=sw,
            )
        )
    return KVLayerGroupsManager(caches, fmt, infos, lmcache_tokens_per_chunk=chunk)


def from_tpu_inference(
    kv_caches: Sequence[Any],
    *,
    layer_groups: Sequence[Sequence[int]] | None = None,
    windows: Sequence[int] | None = None,
    chunk_size: int = 256,
    engine: str = "tpu_inference",
) -> JaxEngineLayout:
    """tpu-inference / sglang-jax per-layer arrays (see the module docstring).

    ``layer_groups``: the layer indices of each engine group (vLLM KV cache group), None = one
    group; ``windows``: each group's sliding window in tokens (-1 = full attention).
    """
    arrays = list(kv_caches)
    views, shapes = [], []
    for i, x in enumerate(arrays):
        if x.ndim != 5:
            raise KVGroupsValueError(
                f"kv_caches[{i}]: expected [num_pages, page_size, 2*heads//packing, packing, "
                f"head_dim], got shape {tuple(x.shape)}"
            )
        packing = 32 // (np.dtype(x.dtype).itemsize * 8)
        if x.shape[3] != packing or (x.shape[2] * x.shape[3]) % 2:
            raise KVGroupsValueError(
                f"kv_caches[{i}]: expected packing {packing} for {np.dtype(x.dtype).name} and an "
                f"even K/V head count, got shape {tuple(x.shape)}"
            )
        heads = x.shape[2] * x.shape[3] // 2
        shapes.append(tuple(x.shape))
        views.append(jnp.reshape(x, (x.shape[0], x.shape[1], heads, 2, x.shape[4])))
    page = int(arrays[0].shape[1]) if arrays else 1
    fmt = EngineKVFormat.NL_X_NB_BS_NH_TWO_HS
    manager = _manager(views, fmt, len(views), layer_groups, windows, page, chunk_size)
    return JaxEngineLayout(manager, views, engine, shapes)


def from_sglang_jax(
    pool: Any,
    *,
    windows: Sequence[int] | None = None,
    layer_groups: Sequence[Sequence[int]] | None = None,
    chunk_size: int = 256,
    recurrent_pool: Any = None,
    tokens_per_slot: int | None = None,
) -> JaxEngineLayout:
    """sglang-jax's ``MHATokenToKVPool`` (its ``kv_buffer`` list of fused K/V arrays), and
    with ``recurrent_pool`` a hybrid model's ``RecurrentStatePool`` after it in one manager:
    its state engine group comes after the attention groups, one slot id per
    ``tokens_per_slot`` tokens (default the chunk)."""
    layout = from_tpu_inference(
        pool.kv_buffer,
        layer_groups=layer_groups,
        windows=windows,
        chunk_size=chunk_size,
        engine="sglang_jax",
    )
    if recurrent_pool is None:
        return layout
    state, formats, convs = _recurrent_layers(recurrent_pool)
    attn = layout.manager
    state_group = len(layer_groups) if layer_groups else 1  # after the attention groups
    first = len(layout.kv_caches)
    caches = list(layout.kv_caches) + state
    infos = [
        EngineGroupInfo(
            engine_group_id=g.engine_group_idx,
            layer_indices=tuple(g.layer_indices),
            tokens_per_block=g.tokens_per_block,
            sw_size_tokens=g.sw_size_tokens,
        )
        for g in attn.kernel_groups
    ]
    infos += _state_infos(
        state, formats, state_group, first, _tokens_per_slot(tokens_per_slot, chunk_size)
    )
    manager = KVLayerGroupsManager(
        caches, list(attn.engine_kv_formats) + formats, infos, lmcache_tokens_per_chunk=chunk_size
    )
    return JaxEngineLayout(
        manager, caches, "sglang_jax", layout.engine_shapes, list(range(first, len(caches))), convs
    )


def from_sglang_jax_recurrent(
    pool: Any, *, chunk_size: int = 256, tokens_per_slot: int | None = None
) -> JaxEngineLayout:
    """sglang-jax's ``RecurrentStatePool`` alone: one engine group (0) of state slots."""
    state, formats, convs = _recurrent_layers(pool)
    infos = _state_infos(state, formats, 0, 0, _tokens_per_slot(tokens_per_slot, chunk_size))
    manager = KVLayerGroupsManager(state, formats, infos, lmcache_tokens_per_chunk=chunk_size)
    return JaxEngineLayout(manager, state, "sglang_jax", [], list(range(len(state))), convs)


def _recurrent_layers(pool: Any) -> tuple[list, list[EngineKVFormat], list[int]]:
    """Each recurrent layer's conv states (``[slots, channels, kernel - 1]``, "DS") then its
    temporal state (``[slots, H, D, D]``), one array each."""
    recurrent, conv = list(pool.recurrent_buffers), list(pool.conv_buffers)
    if len(recurrent) != len(conv):
        raise KVGroupsValueError(
            f"recurrent_pool: expected one conv_buffers entry per recurrent layer "
            f"({len(recurrent)}), got {len(conv)}"
        )
    arrays, formats, convs = [], [], []
    for layer, (temporal, states) in enumerate(zip(recurrent, conv)):
        for i, c in enumerate(states):
            if c.ndim != 3:
                raise KVGroupsValueError(
                    f"recurrent_pool.conv_buffers[{layer}][{i}]: expected [slots, channels, "
                    f"kernel - 1], got shape {tuple(c.shape)}"
                )
            arrays.append(c)
            formats.append(EngineKVFormat.NL_X_NB_CD_CW)
        arrays.append(temporal)
        formats.append(EngineKVFormat.NL_X_NB_SH_SS)
        convs.append(len(states))
    return arrays, formats, convs


def _state_infos(
    arrays: list, formats: list[EngineKVFormat], group: int, first: int, tokens_per_slot: int
) -> list[EngineGroupInfo]:
    """One recurrent-state EngineGroupInfo per kernel group of the state layers."""
    return [
        EngineGroupInfo(
            engine_group_id=group,
            layer_indices=tuple(first + i for i in layers),
            tokens_per_block=tokens_per_slot,
            recurrent_state=True,
        )
        for _, layers in group_layers_by_identity(arrays, formats, [group] * len(arrays))
    ]


def _tokens_per_slot(value: int | None, chunk: int) -> int:
    tps = chunk if value is None else int(value)
    if tps <= 0 or chunk % tps:
        raise KVGroupsValueError(
            f"tokens_per_slot: expected a positive divisor of chunk_size {chunk}, got {value!r}"
        )
    return tps


def from_maxtext(
    key_pages: Sequence[Any], value_pages: Sequence[Any], *, chunk_size: int = 256
) -> JaxEngineLayout:
    """MaxText's per-layer ``key_pages`` / ``value_pages`` ``[heads, pages, page_size, dim]``."""
    ks, vs = list(key_pages), list(value_pages)
    if len(ks) != len(vs):
        raise KVGroupsValueError(
            f"value_pages: expected one V array per K array ({len(ks)}), got {len(vs)}"
        )
    for i, (k, v) in enumerate(zip(ks, vs)):
        if k.ndim != 4 or k.shape != v.shape:
            raise KVGroupsValueError(
                f"key_pages[{i}] / value_pages[{i}]: expected equal [heads, pages, page_size, "
                f"head_dim] arrays, got {tuple(k.shape)} and {tuple(v.shape)}"
            )
    caches = [ks, vs]
    page = int(ks[0].shape[2]) if ks else 1
    manager = _manager(
        caches, EngineKVFormat.TWO_X_NL_X_NH_NB_BS_HS, len(ks), None, None, page, chunk_size
    )
    return JaxEngineLayout(manager, caches, "maxtext", [])


def pages_from_page_map(page_state: Any, slot: int) -> list[int]:
    """A MaxText request's page ids: ``page_map[slot, :num_pages_used[slot]]``."""
    page_map = np.asarray(page_state.page_map)
    used = np.asarray(page_state.num_pages_used)
    if not 0 <= slot < page_map.shape[0]:
        raise KVGroupsIndexError(
            f"slot: expected 0 <= slot < {page_map.shape[0]} page groups, got {slot}"
        )
    return page_map[slot, : int(used[slot])].astype(np.int64).tolist()
