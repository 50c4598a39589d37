"""Per-GPU state of the page-copy kernels, its error record, and the current stream.

Architecture, loaded kernels, SM count and the device-side error record (read and raised by
:func:`check_errors`), and the raw handle of PyTorch's current stream.
"""

from __future__ import annotations

import threading

import torch
from kvgroups_cuda import params as P
from kvgroups_cuda.nvrtc import kernel_table

from kvgroups_core.errors import (
    KVGroupsIndexError,
    KVGroupsValueError,
)

from . import device_tables


class DeviceState:
    """Per-GPU state: arch, kernels, SM count and the out-of-range block id flag."""

    def __init__(self, index: int) -> None:
        major, minor = torch.cuda.get_device_capability(index)
        self.index = index
        self.arch = f"sm_{major}{minor}"
        self.num_sms = torch.cuda.get_device_properties(index).multi_processor_count
        # The error record kernels write when they meet an out-of-range block id or device
        # skip (page_copy.cu, kvg_report); static address, so graph replays report through it.
        # Launches on any stream write it (device_tables: its zero fill is ordered for them).
        self.err_table = device_tables.zeros(P.ERR_WORDS, index)
        self.err_record = self.err_table.tensor
        self.kernels = kernel_table(self.arch)


_devices: dict[int, DeviceState] = {}
_devices_lock = threading.Lock()


def device_state(index: int) -> DeviceState:
    state = _devices.get(index)
    if state is None:
        with _devices_lock:
            state = _devices.get(index)
            if state is None:
                state = _devices[index] = DeviceState(index)
    return state


def forget_devices() -> None:
    """Drop every per-GPU state (its kernels are loaded again at the next use)."""
    with _devices_lock:
        _devices.clear()


def check_device_errors(device: torch.device | int | str | None = None) -> None:
    """Synchronise with ``device`` and raise if a kernel met a bad device-side value.

    Block ids (and a load's ``skip_first_n_tokens``) that live on the GPU are checked by the
    kernels: a bad id moves nothing for its item, a bad skip is clamped, and the first bad
    value is recorded on the device (:data:`DeviceState.err_record`). This reads and clears
    the record; ``kvgroups_torch.check_errors`` is the public name.

    Raises
    ------
    KVGroupsIndexError
        A launch since the last check saw a block id outside ``[0, num_blocks)``; the message
        names the argument (``block_ids[engine group]``), the bound and the first bad value.
    KVGroupsValueError
        A device ``skip_first_n_tokens`` outside ``[0, tokens covered]``.
    """
    index = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    index = torch.device(index).index if not isinstance(index, int) else index
    if index is None:
        index = torch.cuda.current_device()
    state = _devices.get(index)
    if state is None:
        return
    # Every stream's launches write the record: wait for all of them, not only for the
    # current stream (which is all the read below would wait for).
    torch.cuda.synchronize(index)
    raise_recorded(state.err_record, f"cuda:{index}", index)


def check_errors(device: torch.device | int | str | None = None) -> None:
    """The documented check of device-side ids: synchronise with ``device`` (default: every
    GPU a transfer ran on), then raise the first bad id or skip the kernels met since the
    last check (see :func:`check_device_errors`)."""
    if device is not None:
        check_device_errors(device)
        return
    for index in sorted(_devices):
        check_device_errors(index)


def raise_recorded(record: torch.Tensor, where: str, device_index: int | None = None) -> None:
    """Read (synchronising), clear and raise the error ``record`` holds, if any.

    ``device_index``: the record's GPU, synchronised after the clear, so no launch queued
    later on another stream can record into it before the clear lands (and have its
    error wiped)."""
    words = record.tolist()  # the one synchronisation: the point of a check
    if not words[0]:
        return
    record.zero_()
    if device_index is not None:
        torch.cuda.synchronize(device_index)
    value, engine_group, kernel_group, bound, count = (int(w) for w in words[1:6])
    if engine_group < 0:
        raise KVGroupsValueError(
            f"skip_first_n_tokens: expected a value in [0, {bound}] (the tokens the block ids "
            f"cover), got {value} on {where} (clamped; {count} bad value(s) since the last check)"
        )
    raise KVGroupsIndexError(
        f"block_ids[{engine_group}]: expected ids in [0, {bound}) for kernel group "
        f"{kernel_group}, got {value} on {where} (those items were not moved; {count} bad "
        "id(s) since the last check)"
    )


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device_index: int) -> int:
    """Raw handle of PyTorch's current stream on ``device_index``."""
    if _raw_stream is not None:  # a plain int, without building a Stream object
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream
