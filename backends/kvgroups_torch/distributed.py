"""Checks across the ranks of a ``torch.distributed`` tensor-parallel group.

Each rank of a TP group builds its manager from its own shard; :func:`check_same_grouping`
proves they agree (same grouping, chunk size, formats, dtypes and object layout) before any
rank stores a part of an object the others would read differently.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from kvgroups_core.errors import KVGroupsValueError


def check_same_grouping(manager: Any, group: Any = None) -> str:
    """Compare ``manager.fingerprint()`` over the ranks of ``group`` (collective).

    Every rank of ``group`` (default: the whole world) must call it. The fingerprints are
    exchanged with ``all_gather_object``, so it works on any backend (gloo, NCCL). Where the
    group's size equals ``manager.tp_size``, the ranks' ``tp_rank`` values must also be
    distinct.

    Returns
    -------
    str
        The group's common fingerprint.

    Raises
    ------
    KVGroupsValueError
        On every rank alike, naming the group ranks whose fingerprint differs from group
        rank 0's (or the ranks claiming the same ``tp_rank``).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise KVGroupsValueError(
            "group: expected an initialised torch.distributed process group "
            "(torch.distributed.init_process_group), got none"
        )
    mine = (manager.fingerprint(), manager.tp_rank, manager.tp_size)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    expected = gathered[0][0]
    differ = [r for r, (fp, _, _) in enumerate(gathered) if fp != expected]
    if differ:
        detail = ", ".join(f"rank {r} has {gathered[r][0][:12]}" for r in differ)
        raise KVGroupsValueError(
            f"manager: expected every rank of the TP group to share rank 0's grouping "
            f"(fingerprint {expected[:12]}), got {detail}"
        )
    if len(gathered) == manager.tp_size:
        seen: dict[int, int] = {}
        for r, (_, tp_rank, _) in enumerate(gathered):
            if tp_rank in seen:
                raise KVGroupsValueError(
                    f"manager.tp_rank: expected a distinct tp_rank on every rank of the group, "
                    f"got tp_rank {tp_rank} on ranks {seen[tp_rank]} and {r}"
                )
            seen[tp_rank] = r
    return expected
