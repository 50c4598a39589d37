"""Compile ``kernels/page_copy.cu`` with NVRTC (through ``cuda.core``) at first use.

Cubins are cached on disk, keyed by the package version, the target arch (``sm_XY``), the
NVRTC version, the compile options and a hash of the source, and written under a file lock so
that concurrent processes compile once. Set ``KVGROUPS_NO_COMPILE=1`` to forbid compiling (a
missing cubin then raises :class:`~kvgroups_core.errors.CompileForbidden` naming the cache
key); ``KVGROUPS_CACHE_DIR`` overrides the cache folder (default
``$XDG_CACHE_HOME/kvgroups/cubin``, i.e. ``~/.cache/kvgroups/cubin``).

Nothing here needs a GPU: :func:`compile_cubin` works for any arch on any machine.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import threading
from pathlib import Path

from kvgroups_core import __version__ as _package_version
from kvgroups_core.errors import CompileForbidden, KernelCompileError

from .params import all_kernel_names, layout_defines

ENV_NO_COMPILE = "KVGROUPS_NO_COMPILE"
ENV_CACHE_DIR = "KVGROUPS_CACHE_DIR"
SOURCE_PATH = Path(__file__).with_name("kernels") / "page_copy.cu"
_STD = "c++17"
_PROGRAM_NAME = "page_copy"


@functools.cache
def kernel_source() -> str:
    """The CUDA C++ source of every page-copy kernel."""
    return SOURCE_PATH.read_text()


def cache_dir() -> Path:
    """Folder of the cubin cache (``KVGROUPS_CACHE_DIR`` or the XDG cache folder)."""
    override = os.environ.get(ENV_CACHE_DIR)
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "kvgroups" / "cubin"


def compile_forbidden() -> bool:
    """True when ``KVGROUPS_NO_COMPILE`` is set to a true value."""
    return os.environ.get(ENV_NO_COMPILE, "").strip().lower() not in ("", "0", "false", "no")


@functools.cache
def nvrtc_version() -> str:
    """``"major.minor"`` of the NVRTC library that compiles (part of the cache key)."""
    from cuda.bindings import nvrtc

    result, major, minor = nvrtc.nvrtcVersion()
    if int(result) != 0:
        raise KernelCompileError(f"nvrtcVersion: expected NVRTC_SUCCESS, got {result!r}")
    return f"{major}.{minor}"


def _check_arch(arch: str) -> str:
    if not (arch.startswith("sm_") and arch[3:].rstrip("a").isdigit()):
        raise KernelCompileError(f"arch: expected 'sm_XY' (e.g. 'sm_90'), got {arch!r}")
    return arch


#: Overrides of the kernel's tuning macros (``KVG_UNROLL``, ``KVG_LOAD_HINT``,
#: ``KVG_STORE_HINT``); empty means the source's defaults. Benchmarks sweep these.
TUNING: dict[str, int] = {}


def _defines(small: bool = False) -> list[tuple[str, str]]:
    # ``small``: the cubin of the small-page kernels (``kvg_*_small``), built apart because
    # they take several times the others' compile time and are off by default.
    extra = [("KVG_BUILD_SMALL", "1")] if small else []
    return list(layout_defines()) + extra + [(k, str(v)) for k, v in sorted(TUNING.items())]


def option_words(arch: str, small: bool = False) -> tuple[str, ...]:
    """The compile options, spelled as NVRTC flags (they enter the cache key)."""
    defines = tuple(f"-D{name}={value}" for name, value in _defines(small))
    return (f"-arch={_check_arch(arch)}", f"-std={_STD}", *defines)


def cache_key(arch: str, small: bool = False) -> str:
    """``page_copy-<version>-<arch>-<hash>``: the cubin's file name without extension."""
    digest = hashlib.sha256()
    for part in (_package_version, arch, nvrtc_version(), *option_words(arch, small),
                 kernel_source()):
        digest.update(part.encode())
        digest.update(b"\0")
    return f"{_PROGRAM_NAME}-{_package_version}-{arch}-{digest.hexdigest()[:20]}"


def compile_cubin(arch: str, small: bool = False) -> bytes:
    """Compile every kernel variant for ``arch`` (``small``: every small-page variant) and
    return the cubin (no GPU needed)."""
    from cuda.core import Program, ProgramOptions

    options = ProgramOptions(
        name=_PROGRAM_NAME,
        arch=_check_arch(arch),
        std=_STD,
        define_macro=_defines(small),
    )
    log = io.StringIO()
    try:
        code = Program(kernel_source(), "c++", options=options).compile("cubin", logs=log).code
    except Exception as exc:  # NVRTC reports through several exception types; re-raise typed.
        raise KernelCompileError(
            f"NVRTC failed to compile {SOURCE_PATH.name} for {arch}: {exc}\n{log.getvalue()}"
        ) from exc
    return bytes(code)


_lock = threading.Lock()


def get_cubin(arch: str, small: bool = False) -> bytes:
    """The cubin for ``arch`` (``small``: of the small-page kernels) from the disk cache,
    compiling it (under a file lock) on a miss.

    Raises
    ------
    CompileForbidden
        ``KVGROUPS_NO_COMPILE`` is set and the cache holds no cubin for this key.
    KernelCompileError
        NVRTC failed.
    """
    key = cache_key(arch, small)
    folder = cache_dir()
    path = folder / f"{key}.cubin"
    if path.is_file():
        return path.read_bytes()
    if compile_forbidden():
        raise CompileForbidden(
            f"{ENV_NO_COMPILE} is set and no cached cubin exists for cache key {key!r} "
            f"(looked for {path}); unset it once, or copy the cubin there"
        )
    from filelock import FileLock

    folder.mkdir(parents=True, exist_ok=True)
    with _lock, FileLock(str(path) + ".lock"):
        if path.is_file():  # another process compiled it while we waited
            return path.read_bytes()
        cubin = compile_cubin(arch, small)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(cubin)
        os.replace(tmp, path)  # atomic: readers never see a partial file
    return cubin


class KernelTable:
    """The loaded cubin of one arch: raw ``CUkernel`` / ``CUfunction`` handles by name.

    Library-managed loading (``cuda.core`` >= 1.0) is context independent; the handle is
    launched with ``cuLaunchKernel`` in the current (primary) context.
    """

    def __init__(self, arch: str) -> None:
        from cuda.core import ObjectCode

        self.arch = arch
        self._object = ObjectCode.from_cubin(get_cubin(arch), name=_PROGRAM_NAME)
        self._small = None  # the small-page kernels' cubin, loaded at their first use
        self._kernels: dict[str, object] = {}  # keeps the Kernel objects (and handles) alive
        self._handles: dict[str, int] = {}

    def handle(self, name: str) -> int:
        """Raw driver handle of the kernel ``name`` (see :func:`params.kernel_name`)."""
        found = self._handles.get(name)
        if found is None:
            if name not in all_kernel_names():
                raise KernelCompileError(
                    f"kernel: expected one of {all_kernel_names()}, got {name!r}"
                )
            code = self._object
            if name.endswith("_small"):
                if self._small is None:
                    from cuda.core import ObjectCode

                    self._small = ObjectCode.from_cubin(get_cubin(self.arch, small=True),
                                                        name=_PROGRAM_NAME)
                code = self._small
            try:
                kernel = code.get_kernel(name)
            except Exception as exc:
                raise KernelCompileError(f"loading {name} ({self.arch}): {exc}") from exc
            raw = getattr(kernel, "handle", None)
            if raw is None:  # cuda.core < 0.3 spelled it privately
                raw = kernel._handle
            found = int(raw)
            self._kernels[name] = kernel
            self._handles[name] = found
        return found


_tables: dict[tuple, KernelTable] = {}
_tables_lock = threading.Lock()


def kernel_table(arch: str) -> KernelTable:
    """The process-wide :class:`KernelTable` of ``arch`` (compiled / loaded once)."""
    key = (arch, tuple(sorted(TUNING.items())))
    table = _tables.get(key)
    if table is None:
        with _tables_lock:
            table = _tables.get(key)
            if table is None:
                table = _tables[key] = KernelTable(arch)
    return table
