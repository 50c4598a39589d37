"""Tensor parallelism: where one rank's shard sits in the whole model, and the TP-native layout.

Engines shard KV heads over the ``tp_size`` ranks of a tensor-parallel group: rank ``r`` of a
layer with ``H`` KV heads holds heads ``[r * H / t, (r + 1) * H / t)`` (vLLM and SGLang). A
manager built with ``tp_rank=r, tp_size=t`` groups that rank's shard tensors; this module
says, per kernel group, which heads of the whole model the shard holds (:class:`TPShard`).

Replication. A group every rank holds whole is *replicated*: caches without a head axis (MLA
latents, the indexer cache) and, when a layer has fewer KV heads than ranks (``H < t``), the
one head each rank keeps, shared by ``t / H`` ranks (vLLM's ``num_kv_head_replicas``: rank
``r`` holds head ``r // (t / H)``). The first rank of each replica set is the group's *owner*:
:func:`~kvgroups_core.merge_shards` takes its copy.

Object layouts (``object_layout=`` of the manager), for an object group of regions ``k``:

``"canonical"``
    A rank's objects are the objects of its shard, laid out as SEMANTICS.md section 6
    describes for any manager: region ``k`` is ``[kv_size, nl, slots, h * hs]`` with the
    rank's ``h`` heads. The TP=1 objects of the whole model are the *canonical objects*
    (``[kv_size, nl, slots, H * hs]``); ``merge_shards`` / ``split_canonical`` convert.
``"tp_native"``
    Every rank addresses the same object, the size of a canonical one: region ``k`` is
    ``[num_parts, kv_size, nl, slots, h * hs]``, heads outermost, where part ``i`` is the
    canonical region of the ranks holding heads ``[i * h, (i + 1) * h)``. So a rank's share
    of each region is one contiguous byte range, and its store writes exactly that range
    (its per-rank canonical region, unchanged) into a buffer all ranks share, with no
    gather; replicated groups have one part, written alike by each replica. At ``tp_size=1``
    both layouts are the same bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvgroups_core.errors import KVGroupsValueError, UnsupportedConfigError
from kvgroups_core.formats.catalogue import EngineKVFormat

from .engine_groups import as_int
from .state_tp import ConvSplit, conv_split

CANONICAL = "canonical"
TP_NATIVE = "tp_native"
OBJECT_LAYOUTS = (CANONICAL, TP_NATIVE)

_FINGERPRINT_VERSION = "kvgroups-grouping-v1"


@dataclass(frozen=True, kw_only=True)
class TPShard:
    """Which KV heads of the whole model one rank's kernel group holds.

    ``total_heads`` (``H``) are the group's KV heads in the whole model (1 for caches without
    a head axis), ``rank_heads`` (``h``) the heads of the rank's shard, ``replicas`` the
    ranks that hold each of those head sets (1 = sharded, ``tp_size`` = every rank holds the
    whole group).
    """

    tp_rank: int
    tp_size: int
    total_heads: int
    rank_heads: int
    replicas: int
    # A conv-state group: its channels split per sub-projection (``total_heads`` and
    # ``rank_heads`` count channels), or None. ``needs_conv_projections``: a conv-state group
    # at tp_size > 1 whose engine gave no ``conv_projections`` (it cannot be merged or split).
    conv: ConvSplit | None = None
    needs_conv_projections: bool = False

    @property
    def num_parts(self) -> int:
        """Distinct head sets of the group: ``H / h`` (1 for a wholly replicated group); for a
        conv state, the distinct rank states (``tp_size``, or 1 when wholly replicated)."""
        if self.conv is not None:
            return self.tp_size // self.replicas
        return self.total_heads // self.rank_heads

    @property
    def part(self) -> int:
        """Which head set this rank holds: heads ``[part * h, (part + 1) * h)``."""
        return self.tp_rank // self.replicas

    @property
    def head_start(self) -> int:
        """The first of this rank's heads in the whole model."""
        return self.part * self.rank_heads

    @property
    def is_replicated(self) -> bool:
        """True when more than one rank holds these heads (MLA latents, ``H < tp_size``)."""
        return self.replicas > 1

    @property
    def is_owner(self) -> bool:
        """True for the first rank of the replica set (the copy ``merge_shards`` takes)."""
        return self.tp_rank % self.replicas == 0

    def owner_of_part(self, part: int) -> int:
        """The rank whose copy of head set ``part`` merging takes."""
        return part * self.replicas


def check_tp_args(
    tp_rank: Any, tp_size: Any, object_layout: Any, total_num_kv_heads: Any = None
) -> tuple[int, int, str]:
    """Validate the manager's tensor-parallel keywords (before anything else is read, the
    caches included; only ``total_num_kv_heads``' length waits for the layer count)."""
    check_total_heads(total_num_kv_heads)
    size = as_int(tp_size, "tp_size")
    rank = as_int(tp_rank, "tp_rank")
    if size < 1:
        raise KVGroupsValueError(f"tp_size: expected a rank count >= 1, got {size}")
    if not 0 <= rank < size:
        raise KVGroupsValueError(f"tp_rank: expected a rank in [0, {size}), got {rank}")
    if object_layout not in OBJECT_LAYOUTS:
        raise KVGroupsValueError(
            f"object_layout: expected one of {list(OBJECT_LAYOUTS)}, got {object_layout!r}"
        )
    return rank, size, object_layout


def _has_head_axis(fmt: Any) -> bool:
    return fmt is not None and "NH" in fmt.facts.axes


def check_total_heads(total_num_kv_heads: Any) -> list[int] | int | None:
    """``total_num_kv_heads`` as None, one count, or one count per layer, each >= 1 (the
    per-layer length is checked once the layers are known)."""
    if total_num_kv_heads is None:
        return None
    if isinstance(total_num_kv_heads, Sequence) and not isinstance(
        total_num_kv_heads, (str, bytes)
    ):
        values = [as_int(h, f"total_num_kv_heads[{i}]") for i, h in enumerate(total_num_kv_heads)]
        for i, h in enumerate(values):
            if h < 1:
                raise KVGroupsValueError(f"total_num_kv_heads[{i}]: expected >= 1, got {h}")
        return values
    value = as_int(total_num_kv_heads, "total_num_kv_heads")
    if value < 1:
        raise KVGroupsValueError(f"total_num_kv_heads: expected >= 1, got {value}")
    return value


def _total_heads_per_layer(total_num_kv_heads: Any, num_layers: int) -> Sequence[int | None]:
    """One total head count per layer (None: infer from the shard)."""
    values = check_total_heads(total_num_kv_heads)
    if values is None:
        return [None] * num_layers
    if isinstance(values, int):
        return [values] * num_layers
    if len(values) != num_layers:
        raise KVGroupsValueError(
            f"total_num_kv_heads: expected one head count per layer ({num_layers}), got "
            f"{len(values)}"
        )
    return values


def _state_shard(k: int, group: Any, rank: int, size: int) -> TPShard:
    """Recurrent state (docs/SEMANTICS.md section 9): temporal heads split like KV heads; conv
    channels split per sub-projection."""
    fmt = group.engine_kv_format
    sd = group.shape_desc
    if fmt is EngineKVFormat.NL_X_NB_SH_SS:
        return TPShard(
            tp_rank=rank, tp_size=size, total_heads=sd.nh * size, rank_heads=sd.nh, replicas=1
        )
    if not group.conv_projections:
        h = sd.nh
        return TPShard(
            tp_rank=rank,
            tp_size=size,
            total_heads=h * size,
            rank_heads=h,
            replicas=1,
            needs_conv_projections=size > 1,
        )
    split = conv_split(
        group.conv_projections,
        size,
        sd.nh,
        sd.hs,
        sd.element_size,
        fmt is EngineKVFormat.NL_X_NB_CD_CW,
        f"kernel group {k}",
    )
    return TPShard(
        tp_rank=rank,
        tp_size=size,
        total_heads=sum(split.channels),
        rank_heads=sum(split.rank_channels),
        replicas=size if split.fully_replicated else 1,
        conv=split,
    )


def canonical_region_nbytes(manager: Any, region: Any) -> int:
    """Bytes of a rank region's kernel group in the canonical (whole-model) object."""
    shard = manager.tp_shard(region.kernel_group_idx)
    if shard.conv is not None:
        return region.nbytes // shard.conv.rank_row_bytes * shard.conv.canonical_row_bytes
    return region.nbytes * shard.num_parts


def _shard_of_group(
    k: int, group: Any, totals: Sequence[int | None], rank: int, size: int
) -> TPShard:
    if getattr(group, "recurrent_state", False):
        return _state_shard(k, group, rank, size)
    fmt = group.engine_kv_format
    h = group.shape_desc.nh
    if not _has_head_axis(fmt):
        # No head axis (MLA latent, indexer): every rank holds the whole group.
        return TPShard(tp_rank=rank, tp_size=size, total_heads=h, rank_heads=h, replicas=size)
    given = {totals[layer] for layer in group.layer_indices}
    if len(given) > 1:
        raise UnsupportedConfigError(
            f"total_num_kv_heads: kernel group {k} (layers {group.layer_indices}) mixes total "
            f"head counts {sorted(given, key=str)} that one rank shard cannot tell apart; "
            "register those layers in different engine groups"
        )
    total = given.pop()
    if total is None:
        total = h * size
    if total >= size:
        if total % size or h != total // size:
            raise KVGroupsValueError(
                f"kernel group {k}: expected {total} KV heads split evenly over {size} ranks "
                f"(total_num_kv_heads / tp_size heads per rank), got a shard of {h} heads"
            )
        return TPShard(tp_rank=rank, tp_size=size, total_heads=total, rank_heads=h, replicas=1)
    if size % total or h != 1:
        raise KVGroupsValueError(
            f"kernel group {k}: expected tp_size {size} to be a multiple of its {total} KV "
            f"heads (each rank then holds 1 replicated head), got a shard of {h} heads"
        )
    return TPShard(
        tp_rank=rank, tp_size=size, total_heads=total, rank_heads=1, replicas=size // total
    )


def shard_groups(
    kernel_groups: Sequence[Any], num_layers: int, total_num_kv_heads: Any, rank: int, size: int
) -> tuple[TPShard, ...]:
    """The :class:`TPShard` of every kernel group of one rank's manager."""
    totals = _total_heads_per_layer(total_num_kv_heads, num_layers)
    return tuple(_shard_of_group(k, g, totals, rank, size) for k, g in enumerate(kernel_groups))


# --- the TP-native object layout -------------------------------------------------------


def full_region_nbytes(manager: Any, kernel_group_idx: int, rank_nbytes: int) -> int:
    """Bytes of a kernel group's region in the canonical (whole-model) object."""
    return rank_nbytes * manager.tp_shard(kernel_group_idx).num_parts


def tp_native_regions(manager: Any, regions: list) -> list:
    """Re-place a rank's canonical regions at their parts of the TP-native object."""
    out = []
    offset = 0
    for region in regions:
        shard = manager.tp_shard(region.kernel_group_idx)
        out.append(replace(region, offset=offset + shard.part * region.nbytes))
        offset += region.nbytes * shard.num_parts
    return out


def tp_native_nbytes(manager: Any, regions: list) -> int:
    """Bytes of a TP-native object (the size of a canonical one)."""
    return sum(r.nbytes * manager.tp_shard(r.kernel_group_idx).num_parts for r in regions)


# --- fingerprint ------------------------------------------------------------------------


def _describe(manager: Any, *, across_degrees: bool) -> dict:
    groups = []
    for k, g in enumerate(manager.kernel_groups):
        sd = g.shape_desc
        shard = manager.tp_shard(k)
        fmt = g.engine_kv_format
        # Keys only recurrent-state groups have (others' digests stay as they were).
        state = (
            {"recurrent_state": True, "conv_projections": [list(p) for p in g.conv_projections]}
            if g.recurrent_state
            else {}
        )
        groups.append(
            {
                **state,
                "layers": list(g.layer_indices),
                "kv_size": sd.kv_size,
                "heads": shard.total_heads if across_degrees else sd.nh,
                "total_heads": shard.total_heads,
                "replicas": None if across_degrees else shard.replicas,
                # A conv state's per-rank row depends on the degree: across degrees, the whole
                # model's elements per slot.
                "head_size": (
                    shard.conv.canonical_row_bytes // sd.element_size
                    if across_degrees and shard.conv is not None
                    else sd.hs
                ),
                "block_size": sd.bs,
                "tokens_per_block": g.tokens_per_block,
                "engine_group": g.engine_group_idx,
                "sliding_window": g.sw_size_tokens,
                "dtype": g.dtype.name,
                "format": None if fmt is None else fmt.name,
                "slots_per_chunk": manager.get_slots_per_chunk_in_sw(k),
            }
        )
    return {
        "version": _FINGERPRINT_VERSION,
        "chunk": manager.lmcache_tokens_per_chunk,
        "separate_object_groups": manager.separate_object_groups,
        "full_sw_kv": manager.full_sw_kv,
        "formats": [f.name for f in manager.engine_kv_formats],
        "kernel_groups": groups,
        "object_groups": [
            [list(o.kernel_group_indices), o.sw_size_chunks] for o in manager.object_groups
        ],
        "object_layout": CANONICAL if across_degrees else manager.object_layout,
        "tp_size": None if across_degrees else manager.tp_size,
    }


def fingerprint(manager: Any, *, across_degrees: bool = False) -> str:
    """A stable digest (SHA-256 hex) of everything that fixes a manager's objects.

    It covers the grouping (layers, geometry, engine groups, windows), the chunk size, the
    formats, the dtypes, the object layout and the TP degree, but not the rank, the block
    count or any address: the ranks of one TP group agree, and so do separate processes.
    ``across_degrees=True`` digests the canonical (whole-model) objects instead: equal for
    every TP degree and layout of one model, so a store at one degree can be checked
    against a load at another.
    """
    text = json.dumps(
        _describe(manager, across_degrees=across_degrees), sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(text.encode()).hexdigest()
