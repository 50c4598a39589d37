"""The raw CUDA driver calls of a launch, through ctypes (about a microsecond each).

``cuda.core``'s launch builds Python objects per call; a page-copy launch only needs
``cuLaunchKernel`` with one pre-packed ``KvgParams``, in the device's primary context (the
one PyTorch uses), on PyTorch's current stream.
"""

from __future__ import annotations

import ctypes
import functools
import sys

from kvgroups_core.errors import KVGroupsError, UnsupportedConfig


class KernelLaunchError(KVGroupsError, RuntimeError):
    """The driver refused a launch (its error name and message are included)."""


@functools.cache
def _libcuda() -> ctypes.CDLL:
    if not sys.platform.startswith("linux"):
        raise UnsupportedConfig(
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
    return lib


def _error_text(code: int) -> str:
    lib = _libcuda()
    name, text = ctypes.c_char_p(), ctypes.c_char_p()
    lib.cuGetErrorName(code, ctypes.byref(name))
    lib.cuGetErrorString(code, ctypes.byref(text))
    return f"{(name.value or b'?').decode()} ({code}): {(text.value or b'').decode()}"


def check(code: int, what: str) -> None:
    """Raise :class:`KernelLaunchError` unless ``code`` is ``CUDA_SUCCESS``."""
    if code != 0:
        raise KernelLaunchError(f"{what}: expected CUDA_SUCCESS, got {_error_text(code)}")


@functools.cache
def primary_context(device_index: int) -> int:
    """Handle of the primary context of ``device_index`` (PyTorch's context)."""
    lib = _libcuda()
    dev = ctypes.c_int()
    check(lib.cuDeviceGet(ctypes.byref(dev), device_index), f"cuDeviceGet({device_index})")
    ctx = ctypes.c_void_p()
    check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    return int(ctx.value)


class Launcher:
    """``cuLaunchKernel`` with everything but the grid and stream bound ahead.

    ``params_address`` is the address of the ``KvgParams`` the kernel receives by value; the
    driver copies it during the call, so the caller may overwrite it right after.
    """

    __slots__ = ("_lib", "_ctx", "_current", "_current_ref", "_get_current", "_launch",
                 "_args", "_args_address")

    def __init__(self, device_index: int, params_address: int) -> None:
        self._lib = lib = _libcuda()
        self._ctx = primary_context(device_index)
        self._current = ctypes.c_void_p()
        # Bound once: a launch is a few microseconds of host time, and building the byref
        # and looking the functions up again were a tenth of it.
        self._current_ref = ctypes.byref(self._current)
        self._get_current = lib.cuCtxGetCurrent
        self._launch = lib.cuLaunchKernel
        self._args = (ctypes.c_void_p * 1)(params_address)
        self._args_address = ctypes.addressof(self._args)

    def launch(self, function: int, grid: tuple[int, int, int], threads: int, stream: int) -> None:
        self._get_current(self._current_ref)
        previous = self._current.value
        if previous == self._ctx:  # the usual case: PyTorch's context is current
            code = self._launch(function, grid[0], grid[1], grid[2], threads, 1, 1, 0, stream,
                                self._args_address, None)
            if code:
                check(code, "cuLaunchKernel")
            return
        # Another device (or none) is current in this thread: switch for the launch only.
        lib = self._lib
        check(lib.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        try:
            check(
                lib.cuLaunchKernel(function, grid[0], grid[1], grid[2], threads, 1, 1, 0,
                                   stream, self._args_address, None),
                "cuLaunchKernel",
            )
        finally:
            lib.cuCtxSetCurrent(previous)
