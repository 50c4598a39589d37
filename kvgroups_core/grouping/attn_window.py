"""Cross-chunk attention windows and prefix hits (docs/SEMANTICS.md section 8).

A prefix of ``L`` chunks can be served from the cache when every object group can serve it:
a full-attention group needs all of chunks ``[0, L)``, a group with a window of ``w`` chunks
only ``[max(0, L - w), L)``. Windowed groups make the servable set gappy (a window group may
serve ``L = 6`` but not ``L = 5``), so the hit is the largest servable ``L``, not the first
gap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError

from .engine_groups import as_int


@dataclass(frozen=True)
class AttnWindowDesc:
    """Per-object-group attention windows, in chunks.

    Parameters
    ----------
    num_chunks_in_sw : sequence of int
        One entry per object group: ``-1`` = full attention (the whole prefix), ``w >= 1`` =
        needs only the last ``w`` chunks of a prefix. Stored as a list.
    world_size : int, default 1
        Shards per chunk; a chunk counts as present only when all of them are.

    Raises
    ------
    KVGroupsValueError
        A window is 0 or below -1, or ``world_size < 1``.
    """

    num_chunks_in_sw: list[int]
    world_size: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.num_chunks_in_sw, (str, bytes)) or not isinstance(
            self.num_chunks_in_sw, (Sequence, np.ndarray)
        ):
            raise KVGroupsTypeError(
                f"num_chunks_in_sw: expected a sequence of ints, got {self.num_chunks_in_sw!r}"
            )
        windows = [as_int(w, "num_chunks_in_sw") for w in self.num_chunks_in_sw]
        for g, w in enumerate(windows):
            if w == 0 or w < -1:
                raise KVGroupsValueError(
                    f"num_chunks_in_sw[{g}]: expected -1 (full attention) or a window >= 1 "
                    f"chunk, got {w}"
                )
        world_size = as_int(self.world_size, "world_size")
        if world_size < 1:
            raise KVGroupsValueError(f"world_size: expected >= 1, got {world_size}")
        object.__setattr__(self, "num_chunks_in_sw", windows)
        object.__setattr__(self, "world_size", world_size)

    def __hash__(self) -> int:
        return hash((tuple(self.num_chunks_in_sw), self.world_size))

    @property
    def num_object_groups(self) -> int:
        """Object groups described."""
        return len(self.num_chunks_in_sw)

    def is_full_attention(self, object_group_idx: int) -> bool:
        """True when the object group needs the whole prefix."""
        return self.num_chunks_in_sw[object_group_idx] < 0

    def servable(self, present: Any) -> np.ndarray:
        """Which prefix lengths can be served.

        Parameters
        ----------
        present : array_like of bool
            ``[num_chunks, num_object_groups]``, or ``[num_chunks, num_object_groups,
            world_size]`` when shards are counted: whether chunk ``c`` of object group ``g``
            (shard ``s``) is in the cache.

        Returns
        -------
        numpy.ndarray of bool, shape ``[num_chunks + 1]``
            Entry ``L`` is True when a prefix of ``L`` chunks is servable (``L = 0`` always).
        """
        ok = self._chunk_present(present)
        num_chunks, num_groups = ok.shape
        # have[L, g] = present chunks of group g among [0, L), so chunks in [a, L) are
        # all present iff have[L] - have[a] == L - a.
        have = np.zeros((num_chunks + 1, num_groups), dtype=np.int64)
        np.cumsum(ok, axis=0, out=have[1:])
        lengths = np.arange(num_chunks + 1, dtype=np.int64)[:, None]
        # A window longer than the prefix is full attention; clamping keeps any window an
        # int64 (a window of 10**20 chunks is valid, it just covers every prefix).
        clamped = [min(w, num_chunks) for w in self.num_chunks_in_sw]
        windows = np.asarray(clamped, dtype=np.int64).reshape(1, num_groups)
        start = np.where(windows < 0, 0, np.maximum(lengths - windows, 0))
        got = have - np.take_along_axis(have, start, axis=0)
        return np.all(got == lengths - start, axis=1)

    def hit_chunks(self, present: Any) -> int:
        """The longest servable prefix, in chunks (see :meth:`servable` for ``present``).

        Examples
        --------
        Full attention with chunks {0, 1, 3} of 4 present serves 2 chunks; adding a group with
        a 2-chunk window present at {2, 3, 4} of 5 chunks, full {0..3} serves 4.
        """
        servable = self.servable(present)
        return int(np.flatnonzero(servable)[-1])

    def _chunk_present(self, present: Any) -> np.ndarray:
        arr = np.asarray(present)
        if arr.dtype != np.bool_:
            if arr.dtype.kind not in "biu":
                raise KVGroupsTypeError(f"present: expected a boolean array, got dtype {arr.dtype}")
            arr = arr != 0
        groups = self.num_object_groups
        if arr.ndim == 2:
            expected = f"[num_chunks, {groups}]"
        elif arr.ndim == 3:
            expected = f"[num_chunks, {groups}, {self.world_size}]"
        else:
            raise KVGroupsValueError(
                f"present: expected a 2-D [num_chunks, {groups}] or 3-D [num_chunks, {groups}, "
                f"{self.world_size}] array, got shape {arr.shape}"
            )
        if arr.shape[1] != groups or (arr.ndim == 3 and arr.shape[2] != self.world_size):
            raise KVGroupsValueError(f"present: expected shape {expected}, got {arr.shape}")
        # NumPy's stubs type an axis reduction as "scalar or array"; of a 3-D array it is 2-D.
        return arr.all(axis=2) if arr.ndim == 3 else arr  # type: ignore[return-value]
