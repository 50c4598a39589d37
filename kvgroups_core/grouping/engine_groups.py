"""Engine groups: the serving engine's paged-block address spaces (docs/SEMANTICS.md section 4).

An *engine group* is one block-id space of the serving engine (one of vLLM's hybrid KV cache
groups, say). Block ids mean something only inside their engine group, so layers of two
engine groups never share a kernel group. The engine describes its groups with one
:class:`EngineGroupInfo` per kernel group, in kernel-group order; the helpers here turn that
list into per-layer engine group ids and re-index block ids between engine groups and kernel
groups.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError

#: Per-layer engine group id of a layer left out of every kernel group (cross-layer KV
#: sharing: its KV lives in another layer's blocks). Re-exported by :mod:`.grouping`.
EXCLUDED_ENGINE_GROUP = -1


def as_int(value: Any, what: str) -> int:
    """``value`` as an int (Python or NumPy integer), else a TypeError naming ``what``."""
    # operator.index accepts Python and NumPy integers but not floats or strings; bools are
    # rejected because True as a layer index or a token count is always a bug.
    if isinstance(value, bool):
        raise KVGroupsTypeError(f"{what}: expected an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise KVGroupsTypeError(f"{what}: expected an int, got {value!r}") from None


def as_bool(value: Any, what: str) -> bool:
    """``value`` if it is a bool, else a TypeError naming ``what``: a flag given as an int or
    an array is a bug (``bool(array)`` would raise, ``bool(2)`` would quietly mean True)."""
    if not isinstance(value, bool):
        raise KVGroupsTypeError(f"{what}: expected a bool, got {type(value).__name__} {value!r}")
    return value


@dataclass(frozen=True)
class EngineGroupInfo:
    """What the engine says about one kernel group's layers.

    Parameters
    ----------
    engine_group_id : int
        The engine group (paged-block address space, dense from 0) the layers live in; it
        selects which block-id list of a request applies.
    layer_indices : sequence of int
        Registered layer indices of the kernel group (stored as a tuple).
    tokens_per_block : int, default 0
        Logical tokens covered by one block id of this engine group. ``0`` means unknown: the
        group is then taken as uncompressed (one token per physical slot).
    sw_size_tokens : int, default -1
        Sliding-window size in tokens, or ``-1`` for full attention.
    recurrent_state : bool, default False
        The layers hold recurrent (Mamba-like) state rather than attention KV: they must be in
        a state format, and ``tokens_per_block`` is the tokens one state slot id stands for
        (docs/SEMANTICS.md section 9).
    conv_projections : sequence of (int, int), default ()
        For a conv-state group: one ``(channels, units)`` pair per sub-projection of the conv
        channels in the whole model (Mamba2 ``x | B | C``, GDN ``Q | K | V``), units being the
        heads or groups the channels are made of. Only tensor-parallel merges and splits use
        it (``merge_shards`` / ``split_canonical``).

    Notes
    -----
    Immutable and hashable. New fields are only ever appended, with defaults, so positional
    construction keeps working.
    """

    engine_group_id: int
    layer_indices: tuple[int, ...] = ()
    tokens_per_block: int = 0
    sw_size_tokens: int = -1
    recurrent_state: bool = False
    conv_projections: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        gid = as_int(self.engine_group_id, "engine_group_id")
        if gid < 0:
            raise KVGroupsValueError(
                f"engine_group_id: expected a non-negative engine group id, got {gid}"
            )
        if isinstance(self.layer_indices, (str, bytes)) or not hasattr(
            self.layer_indices, "__iter__"
        ):
            raise KVGroupsTypeError(
                f"layer_indices: expected a sequence of ints, got {self.layer_indices!r}"
            )
        layers = tuple(as_int(i, "layer_indices") for i in self.layer_indices)
        tpb = as_int(self.tokens_per_block, "tokens_per_block")
        if tpb < 0:
            raise KVGroupsValueError(f"tokens_per_block: expected >= 0 (0 = unknown), got {tpb}")
        sw = as_int(self.sw_size_tokens, "sw_size_tokens")
        if sw == 0 or sw < -1:
            raise KVGroupsValueError(
                f"sw_size_tokens: expected -1 (full attention) or a window >= 1 token, got {sw}"
            )
        object.__setattr__(self, "engine_group_id", gid)
        object.__setattr__(self, "layer_indices", layers)
        object.__setattr__(self, "tokens_per_block", tpb)
        object.__setattr__(self, "sw_size_tokens", sw)
        object.__setattr__(
            self, "recurrent_state", as_bool(self.recurrent_state, "recurrent_state")
        )
        projections = check_conv_projections(self.conv_projections)
        if projections and not self.recurrent_state:
            raise KVGroupsValueError(
                "conv_projections: expected only for a recurrent_state=True group (a conv "
                f"state), got {projections} with recurrent_state=False"
            )
        object.__setattr__(self, "conv_projections", projections)


def check_conv_projections(value: Any, what: str = "conv_projections") -> tuple:
    """``((channels, units), ...)``: a conv state's sub-projections in the whole model."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise KVGroupsTypeError(
            f"{what}: expected a sequence of (channels, units) pairs, got {value!r}"
        )
    out = []
    for i, pair in enumerate(value):
        if isinstance(pair, (str, bytes)) or not hasattr(pair, "__len__") or len(pair) != 2:
            raise KVGroupsTypeError(f"{what}[{i}]: expected a (channels, units) pair, got {pair!r}")
        channels = as_int(pair[0], f"{what}[{i}] channels")
        units = as_int(pair[1], f"{what}[{i}] units")
        if channels <= 0 or units <= 0 or channels % units:
            raise KVGroupsValueError(
                f"{what}[{i}]: expected positive channels made of a whole number of units, "
                f"got {channels} channels in {units} units"
            )
        out.append((channels, units))
    return tuple(out)


def get_engine_group_indices(infos: Sequence[EngineGroupInfo], num_layers: int) -> list[int] | None:
    """The engine group id of every registered layer.

    Parameters
    ----------
    infos : sequence of EngineGroupInfo
        One info per kernel group, in kernel-group order (may be empty).
    num_layers : int
        Number of registered layers.

    Returns
    -------
    list of int or None
        ``None`` when there are no infos or no layers (everything is engine group 0); else one
        id per layer, :data:`EXCLUDED_ENGINE_GROUP` (-1) for a layer no info mentions.

    Raises
    ------
    KVGroupsValueError
        An info names a layer outside ``[0, num_layers)`` ("outside registered layer range").
    """
    num_layers = as_int(num_layers, "num_layers")
    if not infos or num_layers == 0:
        return None
    per_layer = [EXCLUDED_ENGINE_GROUP] * num_layers
    for info in infos:
        for layer in info.layer_indices:
            if not 0 <= layer < num_layers:
                raise KVGroupsValueError(
                    f"engine group info {info.engine_group_id}: layer index {layer} is outside "
                    f"registered layer range [0, {num_layers})"
                )
            per_layer[layer] = info.engine_group_id
    return per_layer


def _is_flat_ids(ids: Any) -> bool:
    if isinstance(ids, np.ndarray):
        return ids.ndim == 1
    return len(ids) > 0 and isinstance(ids[0], (int, np.integer))


def expand_engine_block_ids(
    infos: Sequence[EngineGroupInfo],
    per_engine_group_ids: Sequence[Sequence[int]] | Sequence[int] | Mapping[int, Sequence[int]],
) -> list[list[int]]:
    """Re-index block ids from engine groups to kernel groups.

    Parameters
    ----------
    infos : sequence of EngineGroupInfo
        One info per kernel group, in kernel-group order. Empty means one engine group (0)
        and one kernel group.
    per_engine_group_ids : sequence of sequences, flat sequence, or mapping
        Block ids indexed by engine group id (a list of lists, or a mapping id -> ids). A flat
        sequence of ints is the single engine group's ids (older connectors send that).

    Returns
    -------
    list of list of int
        One block-id list per kernel group, copied from its engine group's list. With no ids
        at all (an empty sequence), one empty list per kernel group.

    Raises
    ------
    KVGroupsValueError
        A kernel group's engine group has no block-id list.
    """
    group_ids = [info.engine_group_id for info in infos] if infos else [0]
    if isinstance(per_engine_group_ids, Mapping):
        lookup: Mapping[int, Any] | Sequence[Any] = per_engine_group_ids
        available = f"engine groups {sorted(per_engine_group_ids)}"
    elif len(per_engine_group_ids) == 0:
        return [[] for _ in group_ids]
    elif _is_flat_ids(per_engine_group_ids):
        lookup = [per_engine_group_ids]
        available = "one flat list (engine group 0)"
    else:
        lookup = per_engine_group_ids
        available = f"{len(per_engine_group_ids)} engine group lists"
    out = []
    for kernel_group, gid in enumerate(group_ids):
        present = gid in lookup if isinstance(lookup, Mapping) else gid < len(lookup)
        if not present:
            raise KVGroupsValueError(
                f"per_engine_group_ids: expected block ids for engine group {gid} (kernel group "
                f"{kernel_group}), got {available}"
            )
        out.append([int(b) for b in lookup[gid]])
    return out


def slice_block_ids_per_group(
    allocated: Mapping[int, Sequence[int]],
    tokens_per_block_per_group: Sequence[int],
    start_tok: int,
    end_tok: int,
) -> list[list[int]]:
    """Each engine group's block ids covering the tokens ``[start_tok, end_tok)``.

    Tokens are the only unit every engine group shares: a group whose block id covers
    ``tpb`` tokens holds ids ``[start_tok // tpb, end_tok // tpb)`` of its list. Over 256
    tokens, a ``tpb=64`` group gives 4 ids and a ``tpb=256`` group 1.

    Parameters
    ----------
    allocated : mapping of int to sequence of int
        Block ids by engine group id; a missing group yields an empty list.
    tokens_per_block_per_group : sequence of int
        Each engine group's tokens per block, indexed by engine group id (all positive).
    start_tok, end_tok : int
        Token range, start inclusive, end exclusive; both must be multiples of every group's
        tokens per block.

    Returns
    -------
    list of list of int
        One list per engine group, in engine-group order.

    Raises
    ------
    KVGroupsValueError
        A bound does not align to a group's tokens per block ("does not align"), a tokens per
        block is not positive, or the range is reversed or negative.
    KVGroupsTypeError
        ``allocated`` is not a mapping of int keys to sequences of int ids, or a bound or a
        tokens per block is not an int.
    """
    if not isinstance(allocated, Mapping):
        raise KVGroupsTypeError(
            f"allocated: expected a mapping engine group id -> block ids, got {allocated!r}"
        )
    for key in allocated:
        as_int(key, "allocated: engine group id key")
    if isinstance(tokens_per_block_per_group, (str, bytes)) or not isinstance(
        tokens_per_block_per_group, (Sequence, np.ndarray)
    ):
        raise KVGroupsTypeError(
            "tokens_per_block_per_group: expected a sequence of ints, got "
            f"{tokens_per_block_per_group!r}"
        )
    start = as_int(start_tok, "start_tok")
    end = as_int(end_tok, "end_tok")
    if start < 0 or end < start:
        raise KVGroupsValueError(
            f"token range: expected 0 <= start_tok <= end_tok, got [{start}, {end})"
        )
    out: list[list[int]] = []
    for gid, tpb in enumerate(tokens_per_block_per_group):
        tpb = as_int(tpb, f"tokens_per_block_per_group[{gid}]")
        if tpb <= 0:
            raise KVGroupsValueError(
                f"tokens_per_block_per_group[{gid}]: expected a positive token count, got {tpb}"
            )
        if start % tpb or end % tpb:
            raise KVGroupsValueError(
                f"token range [{start}, {end}) does not align to engine group {gid}'s "
                f"tokens_per_block {tpb}"
            )
        ids = allocated.get(gid, ())
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)):
            raise KVGroupsTypeError(
                f"allocated[{gid}]: expected a sequence of block ids, got {type(ids).__name__} "
                f"{ids!r}"
            )
        lo = start // tpb
        part = ids[lo : end // tpb]
        out.append([as_int(b, f"allocated[{gid}][{lo + i}]") for i, b in enumerate(part)])
    return out
