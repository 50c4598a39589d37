"""Memory-object allocation: one ``[num_chunks, object_nbytes]`` uint8 tensor per object group,
on a GPU or in pinned host memory (which the kernels read and write directly)."""

from __future__ import annotations

from typing import Sequence

import torch

from kvgroups_core.errors import KVGroupsValueError

#: Placement names accepted by :func:`allocate_objects`.
PINNED = ("pinned", "cuda_host", "host_pinned", "pinned_host")
DEVICE = ("device", "cuda", "gpu")
HOST = ("cpu", "host")


def resolve_placement(
    placement: str | None, like_device: torch.device
) -> tuple[torch.device, bool]:
    """``(device, pinned)`` for a placement name relative to the caches' device."""
    if placement is None:
        return like_device, False
    key = placement.strip().lower()
    if key in PINNED:
        return torch.device("cpu"), True
    if key in DEVICE:
        if like_device.type != "cuda":
            raise KVGroupsValueError(
                f"placement: expected caches on a GPU for {placement!r}, "
                f"got caches on {like_device}"
            )
        return like_device, False
    if key in HOST:
        return torch.device("cpu"), False
    if key.startswith("cuda:"):
        return torch.device(key), False
    raise KVGroupsValueError(
        f"placement: expected None or one of {PINNED + DEVICE + HOST} or 'cuda:N', "
        f"got {placement!r}"
    )


def allocate_objects(
    object_nbytes: Sequence[int],
    num_chunks: int,
    like_device: torch.device,
    placement: str | None = None,
) -> list[torch.Tensor]:
    """One uninitialised ``[num_chunks, nbytes]`` uint8 tensor per object group.

    Parameters
    ----------
    object_nbytes : sequence of int
        Bytes of one chunk's object, per object group (``TransferPlan.object_nbytes``).
    num_chunks : int
    like_device : torch.device
        Device of the caches; the default placement.
    placement : str, optional
        ``"pinned"`` (pinned host memory), ``"device"`` (the caches' GPU), ``"cpu"``
        (pageable host memory, CPU caches only) or ``"cuda:N"``.
    """
    device, pinned = resolve_placement(placement, like_device)
    return [
        torch.empty((num_chunks, int(n)), dtype=torch.uint8, device=device, pin_memory=pinned)
        for n in object_nbytes
    ]
