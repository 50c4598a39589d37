"""The raw CUDA driver calls of a launch, through ctypes (about a microsecond each).

``cuda.core``'s launch builds Python objects per call; a page-copy launch only needs
``cuLaunchKernelEx`` with one pre-packed ``KvgParams``, in the device's primary context (the
one PyTorch uses), on PyTorch's current stream. ``cuLaunchKernelEx`` rather than
``cuLaunchKernel`` (drivers from CUDA 11.8) even where no launch attribute is set: its
geometry travels in a struct written only when it changes, while ctypes converting
``cuLaunchKernel``'s eleven scalar arguments costs more than the rest of the call.

On sm_90 and later the page-copy kernels are launched with programmatic stream serialization
(``cuLaunchKernelEx``): the GPU may set a launch up while the kernel before it on the stream
drains, which hides most of the idle time between back-to-back kernels (docs/PERFORMANCE.md
has both measurements). Stream order stays exact because every such kernel's first
instruction is ``griddepcontrol.wait`` (``kvgroups_cuda/kernels/page_copy.cu``): it returns only
once the
kernel before it has finished and its writes are visible. Only kernels that wait may be
launched this way (``programmatic=True``); ``KVGROUPS_PROGRAMMATIC_LAUNCH=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

from kvgroups_core.errors import KVGroupsError, UnsupportedConfigError


class KernelLaunchError(KVGroupsError, RuntimeError):
    """The driver refused a launch (its error name and message are included)."""


@functools.cache
def libcuda() -> ctypes.CDLL:
    """The CUDA driver library, loaded once (Linux only)."""
    if not sys.platform.startswith("linux"):
        raise UnsupportedConfigError(
            f"platform: expected linux for the CUDA kernels, got {sys.platform}"
        )
    lib = ctypes.CDLL("libcuda.so.1")
    vp, u = ctypes.c_void_p, ctypes.c_uint
    lib.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, vp, vp]
    lib.cuLaunchKernel.restype = ctypes.c_int
    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(vp)]
    lib.cuCtxGetCurrent.restype = ctypes.c_int
    lib.cuCtxSetCurrent.argtypes = [vp]
    lib.cuCtxSetCurrent.restype = ctypes.c_int
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuDeviceGet.restype = ctypes.c_int
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), ctypes.c_int]
    lib.cuDevicePrimaryCtxRetain.restype = ctypes.c_int
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuGetErrorName.restype = ctypes.c_int
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuGetErrorString.restype = ctypes.c_int
    lib.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
    lib.cuDeviceGetAttribute.restype = ctypes.c_int
    lib.cuDriverGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.cuDriverGetVersion.restype = ctypes.c_int
    lib.cuStreamIsCapturing.argtypes = [vp, ctypes.POINTER(ctypes.c_int)]
    lib.cuStreamIsCapturing.restype = ctypes.c_int
    lib.cuStreamWaitEvent.argtypes = [vp, vp, u]
    lib.cuStreamWaitEvent.restype = ctypes.c_int
    if hasattr(lib, "cuLaunchKernelEx"):  # CUDA 11.8 and later drivers
        lib.cuLaunchKernelEx.argtypes = [vp, vp, vp, vp]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
    return lib


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [
        ("id", ctypes.c_int),
        ("pad", ctypes.c_char * 4),
        ("value", ctypes.c_int),
        ("value_rest", ctypes.c_char * 60),
    ]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``."""

    _fields_ = [
        ("grid_x", ctypes.c_uint),
        ("grid_y", ctypes.c_uint),
        ("grid_z", ctypes.c_uint),
        ("block_x", ctypes.c_uint),
        ("block_y", ctypes.c_uint),
        ("block_z", ctypes.c_uint),
        ("shared_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.c_void_p),
        ("num_attrs", ctypes.c_uint),
    ]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_COMPUTE_CAPABILITY_MAJOR = 75  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
# Graph edges carrying a programmatic dependency (what capturing these launches in an engine's
# CUDA graph records) came with CUDA 12.3: older drivers keep the plain launch, to be safe.
_MIN_DRIVER_VERSION = 12030


@functools.cache
def programmatic_launch(device_index: int) -> bool:
    """Whether launches on ``device_index`` use programmatic stream serialization: sm_90 or
    later, a CUDA 12.3+ driver with ``cuLaunchKernelEx``, and ``KVGROUPS_PROGRAMMATIC_LAUNCH``
    not "0"."""
    if os.environ.get("KVGROUPS_PROGRAMMATIC_LAUNCH", "1") == "0":
        return False
    lib = libcuda()
    if not hasattr(lib, "cuLaunchKernelEx"):
        return False
    version = ctypes.c_int()
    check(lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
    if version.value < _MIN_DRIVER_VERSION:
        return False
    dev, major = ctypes.c_int(), ctypes.c_int()
    check(lib.cuDeviceGet(ctypes.byref(dev), device_index), f"cuDeviceGet({device_index})")
    check(
        lib.cuDeviceGetAttribute(ctypes.byref(major), _COMPUTE_CAPABILITY_MAJOR, dev),
        "cuDeviceGetAttribute",
    )
    return major.value >= 9


def _error_text(code: int) -> str:
    lib = libcuda()
    name, text = ctypes.c_char_p(), ctypes.c_char_p()
    lib.cuGetErrorName(code, ctypes.byref(name))
    lib.cuGetErrorString(code, ctypes.byref(text))
    return f"{(name.value or b'?').decode()} ({code}): {(text.value or b'').decode()}"


def check(code: int, what: str) -> None:
    """Raise :class:`KernelLaunchError` unless ``code`` is ``CUDA_SUCCESS``."""
    if code != 0:
        raise KernelLaunchError(f"{what}: expected CUDA_SUCCESS, got {_error_text(code)}")


@functools.cache
def driver_version() -> int:
    """``cuDriverGetVersion`` (e.g. 13000 for CUDA 13.0)."""
    lib = libcuda()
    version = ctypes.c_int()
    check(lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
    return version.value


def primary_context(device_index: int) -> int:
    """Handle of the primary context of ``device_index`` (PyTorch's context)."""
    lib = libcuda()
    dev = ctypes.c_int()
    check(lib.cuDeviceGet(ctypes.byref(dev), device_index), f"cuDeviceGet({device_index})")
    ctx = ctypes.c_void_p()
    check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    return int(ctx.value)


class _InContext:
    """The primary context of a device current for a few driver calls (restored after)."""

    def __init__(self, device_index: int) -> None:
        self._ctx = primary_context(device_index)

    def __enter__(self) -> None:
        lib = libcuda()
        current = ctypes.c_void_p()
        check(lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        self._previous = current.value
        if self._previous != self._ctx:
            check(lib.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def __exit__(self, *exc: object) -> None:
        if self._previous != self._ctx:
            libcuda().cuCtxSetCurrent(self._previous)


_CAPTURE_STATUS_NONE = 0  # CU_STREAM_CAPTURE_STATUS_NONE
_EVENT_WAIT_EXTERNAL = 1  # CU_EVENT_WAIT_EXTERNAL


def stream_is_capturing(device_index: int, stream: int) -> bool:
    """Whether ``stream`` (a raw handle on ``device_index``) is being captured into a graph
    (an invalidated capture counts: nothing may be queued outside it either)."""
    status = ctypes.c_int()
    with _InContext(device_index):
        check(libcuda().cuStreamIsCapturing(stream, ctypes.byref(status)), "cuStreamIsCapturing")
    return status.value != _CAPTURE_STATUS_NONE


def stream_wait_event(device_index: int, stream: int, event: int, *, external: bool) -> None:
    """Work queued on ``stream`` after this waits for ``event`` on the GPU (the host does not
    wait). ``external``: ``stream`` is being captured and ``event`` was recorded outside the
    capture, so the graph gets an external event wait node (the only such wait a capture
    accepts)."""
    flags = _EVENT_WAIT_EXTERNAL if external else 0
    with _InContext(device_index):
        check(libcuda().cuStreamWaitEvent(stream, event, flags), "cuStreamWaitEvent")


class Launcher:
    """A kernel launch with everything but the grid and stream bound ahead.

    ``params_address`` is the address of the ``KvgParams`` the kernel receives by value; the
    driver copies it during the call, so the caller may overwrite it right after.
    ``programmatic``: the kernels this launcher runs begin with ``griddepcontrol.wait``, so
    they may be launched with programmatic stream serialization where
    :func:`programmatic_launch` allows it (never set it for a kernel that does not wait).
    """

    __slots__ = (
        "_lib",
        "_ctx",
        "_current",
        "_current_ref",
        "_get_current",
        "_launch",
        "_args",
        "_args_address",
        "_config",
        "_config_address",
        "_attribute",
        "_written",
        "programmatic",
    )

    def __init__(
        self, device_index: int, params_address: int, *, programmatic: bool = False
    ) -> None:
        self._lib = lib = libcuda()
        self._ctx = primary_context(device_index)
        self._current = ctypes.c_void_p()
        # Bound once: a launch is a few microseconds of host time, and building the byref
        # and looking the functions up again were a tenth of it.
        self._current_ref = ctypes.byref(self._current)
        self._get_current = lib.cuCtxGetCurrent
        self._args = (ctypes.c_void_p * 1)(params_address)
        self._args_address = ctypes.addressof(self._args)
        self.programmatic = programmatic and programmatic_launch(device_index)
        self._config = self._attribute = None
        # (grid, threads, stream) the config holds: an engine repeats one shape on one
        # stream, and five ctypes field writes per launch were a tenth of its host time.
        self._written: tuple | None = None
        if hasattr(lib, "cuLaunchKernelEx"):
            self._config = _LaunchConfig(block_y=1, block_z=1, shared_bytes=0)
            if self.programmatic:
                self._attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
                self._config.attrs = ctypes.addressof(self._attribute)
                self._config.num_attrs = 1
            self._config_address = ctypes.addressof(self._config)
            self._launch = lib.cuLaunchKernelEx
        else:
            self._launch = lib.cuLaunchKernel

    def _enqueue(self, function: int, grid: tuple[int, int, int], threads: int, stream: int) -> int:
        config = self._config
        if config is None:
            return self._launch(
                function,
                grid[0],
                grid[1],
                grid[2],
                threads,
                1,
                1,
                0,
                stream,
                self._args_address,
                None,
            )
        shape = (grid, threads, stream)
        if shape != self._written:
            config.grid_x, config.grid_y, config.grid_z = grid
            config.block_x, config.stream = threads, stream
            self._written = shape
        return self._launch(self._config_address, function, self._args_address, None)

    def launch(self, function: int, grid: tuple[int, int, int], threads: int, stream: int) -> None:
        self._get_current(self._current_ref)
        previous = self._current.value
        if previous == self._ctx:  # the usual case: PyTorch's context is current
            code = self._enqueue(function, grid, threads, stream)
            if code:
                check(code, self._name())
            return
        # Another device (or none) is current in this thread: switch for the launch only.
        lib = self._lib
        check(lib.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        try:
            check(self._enqueue(function, grid, threads, stream), self._name())
        finally:
            lib.cuCtxSetCurrent(previous)

    def _name(self) -> str:
        return "cuLaunchKernelEx" if self._config is not None else "cuLaunchKernel"
