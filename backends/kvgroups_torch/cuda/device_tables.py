"""Small tables the host writes once and kernels on any stream read.

A kernel launch reads a few tables besides its tensors: the plane pointer table of its launch
state, the per-GPU error record, the object table of a bound list of per-chunk objects. They
are built once and reused by every later launch, and those launches may run on any stream:
an engine loads on its main stream and stores on a side stream, and captures either in a
graph on a third. Two things the stream that built a table does not give the others:

- **Order.** The upload (or the zero fill) is queued on the stream current when the table
  was made, possibly behind milliseconds of the engine's work. A launch on another stream
  could read the table before it is there and copy through garbage addresses.
- **Lifetime.** PyTorch's caching allocator hands a freed block out again in the order of
  the stream it was allocated on. A launch state dropped from its cache while a launch on
  another stream still reads its table would see that memory reused.

So the first launch on each other stream makes that stream wait for the upload's event (a
GPU-side wait: the host never blocks; inside a graph capture as an external event wait, the
only wait a capture may take on work outside it), and registers the stream with the
allocator (``record_stream``), which then keeps the block until that stream's work queued
before the free is done. Once an eager look finds the upload complete no stream needs the
wait again; the registration is needed once per stream either way. A launch on a stream
already seen costs one set lookup.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from . import driver


class DeviceTable:
    """A tensor on the GPU that launches on any stream may read (see the module docstring).

    Build with :func:`upload` or :func:`zeros`; ``address`` is what a kernel gets, ``tensor``
    keeps the memory. Before a launch on ``stream`` that reads it, call
    :meth:`readable_on` (or check ``stream in table.ready`` first, the hot path).
    """

    __slots__ = (
        "tensor",
        "address",
        "home",
        "ready",
        "_written",
        "_complete",
        "_recorded",
        "_lock",
    )

    def __init__(self, tensor: torch.Tensor) -> None:
        """``tensor``: just written by work queued on the current stream."""
        self.tensor = tensor
        self.address = tensor.data_ptr()
        self.home = torch.cuda.current_stream(tensor.device).cuda_stream
        self._written = torch.cuda.Event()
        self._written.record()
        self._complete = False
        # Streams whose launches need nothing more: the home stream (in order after the
        # write) and every stream registered after the write was known complete or waited on.
        self.ready: set[int] = {self.home}
        self._recorded: set[int] = {self.home}
        self._lock = threading.Lock()

    def readable_on(self, stream: int) -> None:
        """Make a launch about to be queued on ``stream`` (the current stream of the table's
        GPU) see the table's contents, and keep its memory until that launch is done."""
        if stream in self.ready:
            return
        with self._lock:
            index = self.tensor.device.index
            capturing = driver.stream_is_capturing(index, stream)
            if stream not in self._recorded:
                self.tensor.record_stream(_stream_object(self.tensor.device, stream))
                self._recorded.add(stream)
            if not self._complete and not capturing and self._written.query():
                self._complete = True  # a look, not a wait (never during a capture)
            if not self._complete:
                # The write may still be queued: this stream waits for it on the GPU. During
                # a capture the wait becomes an external event node of the graph; no
                # stream is marked ready then (the next launch of the capture waits again,
                # and so do eager launches after it).
                driver.stream_wait_event(
                    index, stream, self._written.cuda_event, external=capturing
                )
            if self._complete or not capturing:
                self.ready.add(stream)


def _stream_object(device: torch.device, stream: int) -> torch.cuda.Stream:
    """PyTorch's object for the raw handle ``stream`` (the current stream, as launches use)."""
    current = torch.cuda.current_stream(device)
    if current.cuda_stream == stream:
        return current
    return torch.cuda.ExternalStream(stream, device=device)


def upload(array: np.ndarray, device_index: int) -> DeviceTable:
    """``array`` copied to ``cuda:device_index`` on the current stream (the host does not wait:
    the pinned staging copy is kept by PyTorch's host allocator until the copy is done)."""
    host = torch.from_numpy(np.ascontiguousarray(array)).pin_memory()
    return DeviceTable(host.to(f"cuda:{device_index}", non_blocking=True))


def zeros(count: int, device_index: int) -> DeviceTable:
    """``count`` int64 zeros on ``cuda:device_index``, zeroed on the current stream."""
    return DeviceTable(torch.zeros(count, dtype=torch.int64, device=f"cuda:{device_index}"))


class _EveryStream:
    def __contains__(self, stream: object) -> bool:
        return True


class HostTable:
    """A table in host memory for emulations of the launch path without a GPU (the emulated
    kernel tests, the CPU host-cost benchmarks): no stream needs anything."""

    __slots__ = ("tensor", "address", "ready")

    def __init__(self, array: np.ndarray) -> None:
        self.tensor = torch.from_numpy(np.ascontiguousarray(array).copy())
        self.address = self.tensor.data_ptr()
        self.ready = _EveryStream()

    def readable_on(self, stream: int) -> None:
        pass
