"""Recurrent-state caches for the conformance kit (docs/SEMANTICS.md section 9) and their
oracle, written with plain NumPy indexing (a slot's state is ``arr[slot]``), not the page model.

A *hybrid* model here alternates recurrent and attention layers as Qwen3-Next does: every
recurrent layer registers its conv state and then its temporal state as two layers, every
attention layer one ``[NB, NH, BS, CS]`` tensor (vLLM's HND per-head K|V rows). States live in
engine pages of ``page_bytes`` (vLLM pads them to the attention page); the sentinel byte 0xA5
fills the padding, so a case can check that no padding byte moved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvgroups_conformance.caches import DTYPES, random_bits
from kvgroups_core import EngineGroupInfo
from kvgroups_core.formats.catalogue import EngineKVFormat as F

PAD = 0xA5
STATE_GROUP, ATTN_GROUP = 0, 1  #: engine groups (vLLM: the Mamba group, the attention group)


@dataclass(frozen=True)
class HybridShape:
    """A tiny GDN-like hybrid: ``conv`` / ``temporal`` are one slot's state shapes."""

    layers: int = 4  # alternating recurrent, attention, recurrent, ...
    nb: int = 12
    bs: int = 4  # attention slots per block
    heads: int = 2
    cs: int = 8  # attention K|V row per head
    conv: tuple[int, ...] = (3, 24)  # (window, channels): the "SD" orientation
    temporal: tuple[int, ...] = (2, 4, 8)
    conv_dtype: str = "bfloat16"
    temporal_dtype: str = "float32"
    attn_dtype: str = "bfloat16"
    page_bytes: int = 0  # 0: the state exactly, else a padded page (>= conv + temporal)
    conv_format: F = F.NL_X_NB_CW_CD

    @property
    def state_nbytes(self) -> int:
        return (
            math.prod(self.conv) * DTYPES[self.conv_dtype].itemsize
            + math.prod(self.temporal) * DTYPES[self.temporal_dtype].itemsize
        )


def state_pages(shape: HybridShape, rng: np.random.Generator, zero: bool = False):
    """One recurrent layer's page buffer ``[NB, page]`` uint8 and its two views, as vLLM lays
    a ``MambaSpec`` page out: conv at byte 0, temporal right after it, padding to the page."""
    conv_dt, temp_dt = DTYPES[shape.conv_dtype], DTYPES[shape.temporal_dtype]
    conv_bytes = math.prod(shape.conv) * conv_dt.itemsize
    state = shape.state_nbytes
    page = shape.page_bytes or state
    raw = np.full((shape.nb, page), PAD, np.uint8)
    raw[:, :state] = 0 if zero else rng.integers(0, 256, (shape.nb, state), dtype=np.uint8)
    conv = raw[:, :conv_bytes].view(conv_dt).reshape((shape.nb,) + shape.conv)
    temporal = raw[:, conv_bytes:state].view(temp_dt).reshape((shape.nb,) + shape.temporal)
    return raw, conv, temporal


def hybrid_caches(shape: HybridShape, rng: np.random.Generator, zero: bool = False):
    """``(caches, formats, raws)``: the registered layers in order, their formats, and every
    recurrent layer's page buffer."""
    caches, formats, raws = [], [], []
    attn_dt = DTYPES[shape.attn_dtype]
    for i in range(shape.layers):
        if i % 2 == 0:
            raw, conv, temporal = state_pages(shape, rng, zero)
            caches += [conv, temporal]
            formats += [shape.conv_format, F.NL_X_NB_SH_SS]
            raws.append(raw)
        else:
            dims = (shape.nb, shape.heads, shape.bs, shape.cs)
            caches.append(np.zeros(dims, attn_dt) if zero else random_bits(dims, attn_dt, rng))
            formats.append(F.NL_X_NB_NH_BS_CS)
    return caches, formats, raws


def hybrid_infos(formats, tokens_per_block: int) -> list[EngineGroupInfo]:
    """The engine's description: conv and temporal kernel groups in the state engine group
    (``recurrent_state=True``), attention in its own."""
    conv = tuple(i for i, f in enumerate(formats) if f in (F.NL_X_NB_CD_CW, F.NL_X_NB_CW_CD))
    temporal = tuple(i for i, f in enumerate(formats) if f is F.NL_X_NB_SH_SS)
    attn = tuple(i for i, f in enumerate(formats) if not f.is_recurrent_state)
    return [
        EngineGroupInfo(STATE_GROUP, conv, tokens_per_block, recurrent_state=True),
        EngineGroupInfo(STATE_GROUP, temporal, tokens_per_block, recurrent_state=True),
        EngineGroupInfo(ATTN_GROUP, attn, tokens_per_block),
    ]


def slot_bytes(arr: np.ndarray, slot: int) -> np.ndarray:
    """One slot's state as uint8 (the state only: a padded page's tail is not part of it)."""
    return np.ascontiguousarray(arr[slot]).reshape(-1).view(np.uint8)


def expected_state_object(manager, caches, chunk_last_slot: int) -> np.ndarray:
    """The state object group's object for a chunk whose last state id is
    ``chunk_last_slot``: every state kernel group in order, its layers in order."""
    og = next(o for o in manager.object_groups if o.recurrent_state)
    parts = [
        slot_bytes(caches[layer], chunk_last_slot)
        for k in og.kernel_group_indices
        for layer in manager.kernel_groups[k].layer_indices
    ]
    return np.concatenate(parts)
