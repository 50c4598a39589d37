"""Lowering ``"cuda"``: XLA launches the CUDA page-copy kernel that ``kvgroups_torch`` runs.

Inside a jitted program the transfer is one custom call per kernel group, so the same bytes move
through the same kernel (``kvgroups_cuda/kernels/page_copy.cu``, the one-warp-per-segment
kernel of contiguous 16-byte pages) whichever runtime drives it. The call goes through jaxlib's
kernel-call custom call (``triton_kernel_call_ffi``, the one ``jax-triton`` uses): it takes PTX,
which XLA assembles once per process, and launches it on the program's stream, in CUDA graphs
too. Nothing is built in C++ and no Triton is needed.

That custom call passes each operand and result buffer as one pointer parameter and cannot pass
a parameter struct, so the kernel's parameters travel as a blob XLA holds as a constant
(``KvgXlaHead``, ``KvgParams``, the plane table; see page_copy.cu, "Launches from XLA"), and
the buffers as words ``a0..a{M-1}``, zero-padded to one of
:data:`kvgroups_cuda.nvrtc.XLA_WORD_COUNTS`. The call's ``[first_item, num_items]`` meta is read
on the device and clamped to the items its ids and objects hold, so traced skips and item
counts below the compiled bucket need no host work and cannot move bytes outside them. An
out-of-range id moves nothing for its item, as in the other lowerings; the report is
checkify's (``id_checks``), the kernel's error record is a scratch output that is dropped.

Where this lowering cannot run (no jaxlib kernel-call support, no ``cuda-core``, a geometry
the warp kernel does not take), :func:`unsupported_reason` says why; ``lowering="cuda"``
raises it as :class:`~kvgroups_core.errors.UnsupportedConfigError`, ``"auto"`` picks another.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import zlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from kvgroups_core.errors import UnsupportedConfigError
from kvgroups_jax.geometry import GroupGeometry

from .tuning import DEFAULT_TUNING, LoweringTuning

#: jaxlib's typed-FFI kernel-call target (jax >= 0.8 registers it with its CUDA plugin).
CUSTOM_CALL_TARGET = "triton_kernel_call_ffi"

#: Planes one launch may have: the kernel keeps its plane table in shared memory
#: (``KVG_XLA_MAX_PLANES`` in page_copy.cu).
MAX_PLANES = 512

_INT32_MAX = 2**31 - 1


class XlaHead(ctypes.Structure):
    """``KvgXlaHead`` of page_copy.cu: where the call's buffers sit among the words."""

    _fields_ = [
        (name, ctypes.c_int32)
        for name in ("meta", "ids", "obj", "err", "num_planes", "first_lo", "total_items", "pad")
    ]


class XlaPlane(ctypes.Structure):
    """``KvgXlaPlane``: which word holds the plane's buffer, and where in it the plane starts."""

    _fields_ = [
        ("word", ctypes.c_int64),
        ("offset", ctypes.c_int64),
        ("obj_offset", ctypes.c_int64),
    ]


def _triton_lib():
    from jax._src.lib import gpu_triton

    return gpu_triton


@functools.cache
def runtime_unavailable() -> str | None:
    """Why this JAX / jaxlib cannot launch the kernel from XLA, or None when it can."""
    try:
        lib = _triton_lib()
    except ImportError as exc:
        return f"jaxlib has no GPU kernel-call module ({exc})"
    for name in (
        "TritonKernel",
        "TritonKernelCall",
        "create_array_parameter",
        "create_scalar_parameter",
    ):
        if getattr(lib, name, None) is None:
            return f"jaxlib's GPU kernel-call module lacks {name} (no CUDA plugin?)"
    try:
        import cuda.bindings.nvrtc  # noqa: F401
    except ImportError as exc:
        return f"NVRTC (cuda-bindings) is not installed: install kvgroups' cuda extra ({exc})"
    return None


def geometry_unsupported(geom: GroupGeometry) -> str | None:
    """Why the warp kernel cannot move ``geom``'s pages, or None when it can: it needs each
    block-plane to be one contiguous byte range on both sides, in whole 16-byte vectors."""
    unit = geom.unit
    if geom.span is None:
        return "lowering 'cuda': expected pages that are one contiguous byte range"
    page = geom.block_size * geom.row * unit
    byte_values = {
        "page bytes": page,
        "block stride": geom.block_stride * unit,
        "object row bytes": geom.object_row_elems * unit,
        "region offset": geom.region_offset * unit,
        "plane stride in the object": geom.slots * geom.row * unit,
    }
    for p, off in enumerate(geom.plane_offsets):
        byte_values[f"plane {p} offset"] = off * unit
    for what, value in byte_values.items():
        if value % 16:
            return f"lowering 'cuda': expected 16-byte multiples, got {what} = {value}"
    if not 0 < geom.num_planes <= MAX_PLANES:
        return f"lowering 'cuda': expected 1..{MAX_PLANES} planes, got {geom.num_planes}"
    if geom.num_blocks > _INT32_MAX:
        return f"lowering 'cuda': expected at most {_INT32_MAX} blocks, got {geom.num_blocks}"
    return None


def unsupported_reason(geom: GroupGeometry) -> str | None:
    """:func:`runtime_unavailable` or :func:`geometry_unsupported`, whichever applies."""
    runtime = runtime_unavailable()
    return f"lowering 'cuda': {runtime}" if runtime else geometry_unsupported(geom)


def pack_blob(
    geom: GroupGeometry,
    *,
    kernel_group: int,
    obj_row_bytes: int,
    total_items: int,
    first_lo: int,
    plane_words: tuple[int, ...],
    meta_word: int,
    ids_word: int,
    obj_word: int,
    err_word: int,
) -> bytes:
    """The parameter blob of one launch (every address 0: the kernel fills them in)."""
    from kvgroups_cuda import params as P

    unit = geom.unit
    row_bytes = geom.row * unit
    page_bytes = geom.block_size * row_bytes
    p = P.KvgParams()
    p.obj_chunk_stride = obj_row_bytes
    p.block_stride = geom.block_stride * unit
    p.num_blocks = geom.num_blocks
    p.region_offset = geom.region_offset * unit
    p.row_bytes = row_bytes
    p.page_obj_stride = page_bytes
    p.blocks_per_chunk = geom.blocks_per_chunk
    p.kept_per_chunk = geom.kept_per_chunk
    p.ids_mode = P.IDS_DEVICE32
    p.obj_mode = P.OBJ_STRIDED
    p.num_runs = 1
    p.num_planes = geom.num_planes
    p.skip_mode = P.SKIP_NONE
    p.err_kernel_group = kernel_group
    p.err_engine_group = 0
    segs = -(-(page_bytes // 16) // (32 * P.WARP_UNROLL))
    p.segs_per_page = segs
    p.segs_shift = segs.bit_length() - 1 if segs & (segs - 1) == 0 else 0xFF
    run = p.runs[0]
    run.token_stride = run.obj_step = run.cache_step = row_bytes
    run.units_per_piece = run.units_per_token = row_bytes // 16
    run.page_units = page_bytes // 16
    run.shifts = P.pow2_shifts(run.page_units, run.units_per_token, run.units_per_piece)
    head = XlaHead(
        meta=meta_word,
        ids=ids_word,
        obj=obj_word,
        err=err_word,
        num_planes=geom.num_planes,
        first_lo=first_lo,
        total_items=total_items,
    )
    planes = (XlaPlane * geom.num_planes)()
    plane_stride = geom.slots * row_bytes
    for i, (word, off) in enumerate(zip(plane_words, geom.plane_offsets)):
        planes[i].word = word
        planes[i].offset = off * unit
        planes[i].obj_offset = geom.object_plane(i) * plane_stride
    return bytes(head) + bytes(p) + bytes(planes)


def _num_sms() -> int:
    try:
        return int(getattr(jax.devices("gpu")[0], "core_count", 0)) or 132
    except RuntimeError:  # no GPU: only the CPU tests build launch descriptions
        return 132


def launch_ctas(
    geom: GroupGeometry, grid_items: int, total_items: int, resident_waves: int | None = None
) -> int:
    """CTAs of a launch: one warp per unit of the largest call the program can see (the kernel
    loops when a call has more, and its idle warps exit at once when it has fewer), or at most
    ``resident_waves`` waves of resident CTAs (``LoweringTuning.resident_waves``; each CTA
    first stages its parameters, a cost a capped grid pays once per CTA instead of once per
    unit)."""
    from kvgroups_cuda import geometry, params

    page_bytes = geom.block_size * geom.row * geom.unit
    kept = geom.kept_per_chunk
    items = max(1, min(grid_items + kept - 1, max(total_items, 1)))
    fit = geometry.warp_sizing(
        page_bytes, items, geom.num_planes, params.WARP_UNROLL, params.WARPS_PER_CTA, 0, kept
    )
    if fit is None:
        raise UnsupportedConfigError(
            f"lowering 'cuda': expected fewer than 2**31 work units, got {items} items of "
            f"{geom.num_planes} planes"
        )
    ctas = max(1, min(fit[1], 2**31 - 1))
    if resident_waves:
        ctas = min(ctas, resident_waves * 2 * _num_sms())  # KVG_WARP_MIN_BLOCKS = 2 per SM
    return ctas


@functools.cache
def _ptx(arch: str, words: int, isa: str) -> str:
    """The PTX XLA assembles; ``isa`` (the ISA override, :func:`_fit_ptx_version` reads it
    again) keys the memo, so changing the override gets PTX of that version."""
    from kvgroups_cuda import nvrtc

    del isa
    return _fit_ptx_version(nvrtc.get_xla_ptx(arch, words))


def _isa_override() -> str:
    return os.environ.get(ENV_PTX_ISA, "")


#: Overrides the PTX ISA version written into the PTX XLA assembles (e.g. "9.0").
ENV_PTX_ISA = "KVGROUPS_XLA_PTX_ISA"


def _fit_ptx_version(ptx: str) -> str:
    """Lower the PTX ISA version NVRTC wrote to the one XLA's assembler reads, when older.

    XLA assembles with the PTX compiler of the CUDA it was built with; a newer NVRTC stamps a
    newer ``.version`` even on code that uses nothing new (ours needs ISA 8.3). The CUDA
    version comes from jaxlib's plugin (``cuda_runtime_build_version``), or from
    ``KVGROUPS_XLA_PTX_ISA``."""
    found = re.search(r"^\.version (\d+)\.(\d+)$", ptx, re.M)
    if found is None:
        return ptx
    override = os.environ.get(ENV_PTX_ISA, "").strip()
    if override:
        major, _, minor = override.partition(".")
        isa = (int(major), int(minor or 0))
    else:
        built = _xla_cuda_version()
        if built is None:
            return ptx
        major, minor = divmod(built // 10, 100)
        isa = (9, minor) if major >= 13 else (8, min(minor, 8)) if major == 12 else None
    if isa is None or (int(found[1]), int(found[2])) <= isa:
        return ptx
    return ptx[: found.start()] + f".version {isa[0]}.{isa[1]}" + ptx[found.end() :]


@functools.cache
def _xla_cuda_version() -> int | None:
    """The CUDA version (e.g. 13000) jaxlib's CUDA plugin was built with, if it says."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return None
    getter = getattr(cuda_versions, "cuda_runtime_build_version", None) if cuda_versions else None
    try:
        return int(getter()) if getter is not None else None
    except Exception:  # noqa: BLE001 - the plugin may be absent or report nothing
        return None


def _arch() -> tuple[str, int]:
    lib = _triton_lib()
    cc = int(lib.get_compute_capability(0))
    return f"sm_{cc}", cc


@functools.cache
def _kernel_call(direction: str, buffers: int, ctas: int, isa: str) -> bytes:
    """The serialized kernel call (jaxlib's proto, compressed) of one launch shape (``isa``:
    the PTX ISA override, see :func:`_ptx`)."""
    from kvgroups_cuda import nvrtc, params

    lib = _triton_lib()
    arch, cc = _arch()
    words = nvrtc.xla_words(buffers - 1)
    name = nvrtc.xla_entry_name(direction, words)
    ptx = _ptx(arch, words, isa)
    warps = params.THREADS // 32
    try:  # jaxlib >= 0.5: (name, warps, ctas per cluster, shared bytes, ptx, ttir, cc)
        kernel = lib.TritonKernel(name, warps, 1, 0, ptx, "", cc)
    except TypeError:  # older: (name, warps, shared bytes, ptx, ttir, cc, cluster dims)
        kernel = lib.TritonKernel(name, warps, 0, ptx, "", cc, 1, 1, 1)
    parameters = [lib.create_array_parameter(0, 0) for _ in range(buffers)]
    parameters += [lib.create_scalar_parameter(0, "u64") for _ in range(words - buffers + 1)]
    call = lib.TritonKernelCall(kernel, ctas, 1, 1, parameters)
    try:
        proto = call.to_proto(name, b"")
    except TypeError:
        proto = call.to_proto(name)
    return zlib.compress(proto)


@dataclass(frozen=True)
class LaunchSpec:
    """One launch as XLA makes it: the blob, which operands go in (after the blob) and what
    comes out, the aliases, and the grid. Words number the buffers after the blob: operands
    first, then results."""

    blob: bytes
    operand_kinds: tuple[str, ...]  # "meta", "ids", "obj", "cache"
    result_kinds: tuple[str, ...]  # "obj", "cache", "err"
    aliases: dict[int, int]  # ffi_call operand index (blob = 0) -> result index
    ctas: int

    @property
    def buffers(self) -> int:
        return 1 + len(self.operand_kinds) + len(self.result_kinds)


def launch_spec(
    direction: str,
    geom: GroupGeometry,
    grid_items: int,
    *,
    obj_rows: int,
    obj_elems: int,
    fresh: bool,
    ids_len: int,
    kernel_group: int = 0,
    resident_waves: int | None = None,
) -> LaunchSpec:
    """The static description of one kernel group's launch (no JAX arrays involved;
    ``resident_waves`` as for :func:`launch_ctas`)."""
    if direction not in ("store", "load"):
        raise ValueError(f"direction: expected 'store' or 'load', got {direction!r}")
    reason = geometry_unsupported(geom)
    if reason:
        raise UnsupportedConfigError(reason)
    caches = ("cache",) * len(geom.operand_indices)
    if direction == "store":
        operands = ("meta", "ids") + (() if fresh else ("obj",)) + caches
        results = ("obj", "err")
        obj_word = len(operands)  # the result (aliased to the operand when there is one)
        aliases = {} if fresh else {3: 0}  # ffi operand 3 (the blob is 0) is the object
    else:
        operands = ("meta", "ids", "obj") + caches
        results = caches + ("err",)
        obj_word = 2
        aliases = {4 + i: i for i in range(len(caches))}
    first_cache = operands.index("cache")
    # Items whose ids and object rows exist: the kernel clamps the traced meta to them.
    total_items = min(ids_len // geom.blocks_per_chunk, obj_rows) * geom.kept_per_chunk
    blob = pack_blob(
        geom,
        kernel_group=kernel_group,
        obj_row_bytes=obj_elems * geom.unit,
        total_items=total_items,
        first_lo=0,
        plane_words=tuple(first_cache + op for op in geom.plane_operands),
        meta_word=0,
        ids_word=1,
        obj_word=obj_word,
        err_word=len(operands) + len(results) - 1,
    )
    return LaunchSpec(
        blob,
        operands,
        results,
        aliases,
        launch_ctas(geom, int(grid_items), total_items, resident_waves),
    )


def copy_group(
    direction,
    geom: GroupGeometry,
    grid_items,
    meta,
    ids,
    obj,
    caches,
    *,
    kernel_group: int = 0,
    tuning: LoweringTuning = DEFAULT_TUNING,
    **_,
):
    """Move one kernel group's pages (arguments and results as
    :func:`kvgroups_jax.lowerings.triton.copy_group`). Traceable; the caller jits and donates the
    written operands (caches on load, objects on store), which the results reuse."""
    if len(caches) != len(geom.operand_indices):
        raise ValueError(
            f"caches: expected {len(geom.operand_indices)} operands, got {len(caches)}"
        )
    reason = runtime_unavailable()
    if reason:
        raise UnsupportedConfigError(f"lowering 'cuda': {reason}")
    rows, elems = obj.shape
    fresh = isinstance(obj, jax.ShapeDtypeStruct)
    ids = jnp.asarray(ids, jnp.int32)
    spec = launch_spec(
        direction,
        geom,
        grid_items,
        obj_rows=rows,
        obj_elems=elems,
        fresh=fresh,
        ids_len=ids.shape[0],
        kernel_group=kernel_group,
        resident_waves=tuning.resident_waves,
    )
    given = {
        "meta": [jnp.asarray(meta, jnp.int32)],
        "ids": [ids],
        "obj": [] if fresh else [obj],
        "cache": list(caches),
    }
    operands = [given[kind].pop(0) for kind in spec.operand_kinds]
    shapes = {
        "obj": [jax.ShapeDtypeStruct((rows, elems), obj.dtype)],
        "cache": [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches],
        "err": [jax.ShapeDtypeStruct((64,), jnp.uint8)],
    }  # 8 int64 words, dropped
    results = [shapes[kind].pop(0) for kind in spec.result_kinds]
    opaque = _kernel_call(direction, spec.buffers, spec.ctas, _isa_override())
    # vmap: one launch per batch entry (the kernel has no batch axis).
    call = jax.ffi.ffi_call(
        CUSTOM_CALL_TARGET, results, input_output_aliases=spec.aliases, vmap_method="sequential"
    )
    out = call(jnp.asarray(np.frombuffer(spec.blob, np.uint8)), *operands, opaque=opaque)
    if direction == "store":
        return out[0]
    return tuple(out[:-1])
