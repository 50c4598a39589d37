"""Compile ``kernels/page_copy.cu`` with NVRTC (through ``cuda.core``) at first use.

Cubins are cached on disk, keyed by the package version, the target arch (``sm_XY``), the
NVRTC version, the compile options and a hash of the source, and written under a file lock so
that concurrent processes compile once. Set ``KVGROUPS_NO_COMPILE=1`` to forbid compiling (a
missing cubin then raises :class:`~kvgroups_core.errors.CompileForbiddenError` naming the cache
key); ``KVGROUPS_CACHE_DIR`` overrides the cache folder (default
``$XDG_CACHE_HOME/kvgroups/cubin``, i.e. ``~/.cache/kvgroups/cubin``).

Nothing here needs a GPU: :func:`compile_cubin` works for any arch on any machine.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import io
import os
import threading
import time
from pathlib import Path

from kvgroups_core import __version__ as _package_version
from kvgroups_core.errors import CompileForbiddenError, KernelCompileError, UnsupportedConfigError
from kvgroups_core.logs import logger

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


def cuda_python(module: str):
    """``cuda.core`` or ``cuda.bindings.nvrtc``, imported when a kernel is first compiled or
    loaded; a typed error naming the extra that installs them (``kvgroups[cuda]``: kept out
    of the ``torch`` extra so CPU-only installs pull no CUDA wheels)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise KernelCompileError(
            f"the CUDA kernels need {module} (NVRTC and the CUDA Python bindings): install "
            f"them with kvgroups' cuda extra (from a checkout: pip install '.[torch,cuda]'); "
            f"got {type(exc).__name__}: {exc}"
        ) from exc


@functools.cache
def nvrtc_version() -> str:
    """``"major.minor"`` of the NVRTC library that compiles (part of the cache key)."""
    nvrtc = cuda_python("cuda.bindings.nvrtc")

    result, major, minor = nvrtc.nvrtcVersion()
    if int(result) != 0:
        raise KernelCompileError(f"nvrtcVersion: expected NVRTC_SUCCESS, got {result!r}")
    return f"{major}.{minor}"


def _check_arch(arch: str) -> str:
    if not (arch.startswith("sm_") and arch[3:].rstrip("a").isdigit()):
        raise KernelCompileError(f"arch: expected 'sm_XY' (e.g. 'sm_90'), got {arch!r}")
    return arch


def _defines() -> list[tuple[str, str]]:
    return list(layout_defines())


def option_words(arch: str) -> tuple[str, ...]:
    """The compile options, spelled as NVRTC flags (they enter the cache key)."""
    defines = tuple(f"-D{name}={value}" for name, value in _defines())
    return (f"-arch={_check_arch(arch)}", f"-std={_STD}", *defines)


def cache_key(arch: str) -> str:
    """``page_copy-<version>-<arch>-<hash>``: the cubin's file name without extension."""
    digest = hashlib.sha256()
    for part in (_package_version, arch, nvrtc_version(), *option_words(arch), kernel_source()):
        digest.update(part.encode())
        digest.update(b"\0")
    return f"{_PROGRAM_NAME}-{_package_version}-{arch}-{digest.hexdigest()[:20]}"


def compile_cubin(arch: str) -> bytes:
    """Compile every kernel variant for ``arch`` and return the cubin (no GPU needed)."""
    core = cuda_python("cuda.core")
    Program, ProgramOptions = core.Program, core.ProgramOptions

    options = ProgramOptions(
        name=_PROGRAM_NAME,
        arch=_check_arch(arch),
        std=_STD,
        define_macro=_defines(),
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
_log = logger("cuda")


def _cached(key: str, suffix: str, build) -> bytes:
    """The cache file ``key + suffix``, made by ``build()`` (under a file lock) on a miss."""
    folder = cache_dir()
    path = folder / f"{key}{suffix}"
    if path.is_file():
        return path.read_bytes()
    if compile_forbidden():
        raise CompileForbiddenError(
            f"{ENV_NO_COMPILE} is set and no cached build exists for cache key {key!r} "
            f"(looked for {path}); unset it once, or copy the file there"
        )
    from filelock import FileLock

    folder.mkdir(parents=True, exist_ok=True)
    with _lock, FileLock(str(path) + ".lock"):
        if path.is_file():  # another process compiled it while we waited
            return path.read_bytes()
        # A first use compiles for seconds: say so.
        _log.info("compiling %s with NVRTC (first use; cached in %s)", key, folder)
        started = time.perf_counter()
        data = build()
        _log.info("compiled %s in %.1f s", key, time.perf_counter() - started)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # atomic: readers never see a partial file
    return data


def get_cubin(arch: str) -> bytes:
    """The cubin for ``arch`` from the disk cache, compiling it (under a file lock) on a
    miss.

    Raises
    ------
    CompileForbiddenError
        ``KVGROUPS_NO_COMPILE`` is set and the cache holds no cubin for this key.
    KernelCompileError
        NVRTC failed.
    """
    return _cached(cache_key(arch), ".cubin", lambda: compile_cubin(arch))


# XLA entry points (kvgroups_jax, lowering "cuda"): jaxlib's kernel-call custom call passes each
# buffer as its own pointer parameter, so an entry point exists per padded buffer count; it
# compiles PTX (XLA assembles it), of the warp kernels only.

#: Buffer counts an XLA entry point exists for (a call pads its buffers with zero words up to
#: the next one; 448 words keep the parameters under the 4 KiB every driver accepts).
XLA_WORD_COUNTS = (8, 16, 32, 64, 128, 256, 448)


def xla_words(buffers: int) -> int:
    """The smallest entry-point word count that holds ``buffers`` buffers."""
    for words in XLA_WORD_COUNTS:
        if buffers <= words:
            return words
    raise UnsupportedConfigError(
        f"buffers: expected at most {XLA_WORD_COUNTS[-1]} buffers in one XLA launch, got {buffers}"
    )


def xla_entry_name(direction: str, words: int) -> str:
    """``kvg_store_v16_warp_xla64``: the XLA entry point of ``direction`` for ``words``."""
    return f"kvg_{direction}_v16_warp_xla{words}"


def xla_entry_source(direction: str, words: int) -> str:
    """One XLA entry point: the blob, ``words`` buffer words, jaxlib's two trailing pointers.

    Thread 0 stages the words in shared memory (a CTA reads each one there later, by index:
    kernel parameters cannot be indexed at run time) before ``kvg_xla_warp_copy`` syncs."""
    store = {"store": "true", "load": "false"}[direction]
    params = ", ".join(f"kvg_u64 a{i}" for i in range(words))
    stage = " ".join(f"w[{i}] = a{i};" for i in range(words))
    return (
        f'extern "C" __global__ void __launch_bounds__(KVG_THREADS, KVG_WARP_MIN_BLOCKS)\n'
        f"{xla_entry_name(direction, words)}(const char* blob, {params}, "
        f"kvg_u64 jaxlib_scratch, kvg_u64 jaxlib_profile) {{\n"
        f"    __shared__ kvg_u64 w[{words}];\n"
        f"    if (threadIdx.x == 0) {{ {stage} }}\n"
        f"    kvg_xla_warp_copy<{store}>(blob, w);\n}}\n"
    )


def xla_source(words: int) -> str:
    """The source of the XLA build for ``words``: the kernels plus its two entry points."""
    return kernel_source() + "\n" + "".join(xla_entry_source(d, words) for d in ("store", "load"))


def _xla_defines() -> list[tuple[str, str]]:
    return list(layout_defines()) + [("KVG_BUILD_XLA", "1")]


def xla_cache_key(arch: str, words: int) -> str:
    """``page_copy_xla<words>-<version>-<arch>-<hash>``: the PTX file's name."""
    digest = hashlib.sha256()
    defines = [f"-D{n}={v}" for n, v in _xla_defines()]
    for part in (_package_version, arch, nvrtc_version(), *defines, xla_source(words)):
        digest.update(part.encode())
        digest.update(b"\0")
    return f"{_PROGRAM_NAME}_xla{words}-{_package_version}-{arch}-{digest.hexdigest()[:20]}"


def compile_xla_ptx(arch: str, words: int) -> str:
    """PTX of the two XLA entry points for ``words`` (no GPU needed).

    Straight through ``cuda.bindings.nvrtc``: ``cuda.core`` asks the driver whether it could
    load the PTX, and there may be no driver where this runs (CI)."""
    _nvrtc = cuda_python("cuda.bindings.nvrtc")

    def check(result, what: str, program=None) -> None:
        if int(result) == 0:
            return
        log = ""
        if program is not None:
            _, size = _nvrtc.nvrtcGetProgramLogSize(program)
            buf = b" " * size
            _nvrtc.nvrtcGetProgramLog(program, buf)
            log = buf.decode(errors="replace")
        raise KernelCompileError(
            f"NVRTC failed to compile the XLA entry points ({words} words) for {arch}: "
            f"{what} returned {result!r}\n{log}"
        )

    result, program = _nvrtc.nvrtcCreateProgram(
        xla_source(words).encode(), f"{_PROGRAM_NAME}_xla.cu".encode(), 0, [], []
    )
    check(result, "nvrtcCreateProgram")
    try:
        options = [
            f"-arch={_check_arch(arch).replace('sm_', 'compute_')}".encode(),
            f"-std={_STD}".encode(),
        ]
        options += [f"-D{n}={v}".encode() for n, v in _xla_defines()]
        (result,) = _nvrtc.nvrtcCompileProgram(program, len(options), options)
        check(result, "nvrtcCompileProgram", program)
        result, size = _nvrtc.nvrtcGetPTXSize(program)
        check(result, "nvrtcGetPTXSize")
        ptx = b" " * size
        (result,) = _nvrtc.nvrtcGetPTX(program, ptx)
        check(result, "nvrtcGetPTX")
    finally:
        _nvrtc.nvrtcDestroyProgram(program)
    return ptx.rstrip(b"\0").decode()


def get_xla_ptx(arch: str, words: int) -> str:
    """:func:`compile_xla_ptx` through the disk cache (same rules as :func:`get_cubin`)."""
    return _cached(
        xla_cache_key(arch, words), ".ptx", lambda: compile_xla_ptx(arch, words).encode()
    ).decode()


class KernelTable:
    """The loaded cubin of one arch: raw ``CUkernel`` / ``CUfunction`` handles by name.

    Library-managed loading (``cuda.core`` >= 1.0) is context independent; the handle is
    launched (``kvgroups_torch.cuda.driver``) in the current (primary) context.
    """

    def __init__(self, arch: str) -> None:
        ObjectCode = cuda_python("cuda.core").ObjectCode

        self.arch = arch
        self._object = ObjectCode.from_cubin(get_cubin(arch), name=_PROGRAM_NAME)
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
            try:
                kernel = self._object.get_kernel(name)
            except Exception as exc:
                raise KernelCompileError(f"loading {name} ({self.arch}): {exc}") from exc
            found = int(kernel.handle)
            self._kernels[name] = kernel
            self._handles[name] = found
        return found


_tables: dict[str, KernelTable] = {}
_tables_lock = threading.Lock()


def kernel_table(arch: str) -> KernelTable:
    """The process-wide :class:`KernelTable` of ``arch`` (compiled / loaded once)."""
    table = _tables.get(arch)
    if table is None:
        with _tables_lock:
            table = _tables.get(arch)
            if table is None:
                table = _tables[arch] = KernelTable(arch)
    return table
