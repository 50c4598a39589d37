"""The launch parameters of ``kernels/page_copy.cu``, mirrored with ctypes.

One :class:`KvgParams` is passed by value (``__grid_constant__``) to every page-copy kernel.
Its layout must match the C struct byte for byte; :func:`layout_defines` hands the sizes to
the compiler, whose ``static_assert`` s reject a mismatch at build time.
"""

from __future__ import annotations

import ctypes

#: Must equal the ``#define`` s of the same names in ``page_copy.cu``.
MAX_RUNS = 2
MAX_TILE = 64
INLINE_IDS = 512
INLINE_OBJS = 64
THREADS = 256
#: 16-byte vectors per lane of one warp-kernel segment (``KVG_WARP_UNROLL``): a segment is
#: ``32 * WARP_UNROLL * 16`` bytes of a page.
WARP_UNROLL = 16
WARPS_PER_CTA = THREADS // 32
ERR_WORDS = 8

#: Vector widths a kernel variant exists for, widest first.
VECTOR_WIDTHS = (16, 8, 4, 2, 1)

# ids_mode / obj_mode values of KvgParams.
IDS_INLINE32, IDS_DEVICE32, IDS_DEVICE64 = 0, 1, 2
SKIP_NONE, SKIP_DEVICE32, SKIP_DEVICE64 = 0, 1, 2
OBJ_STRIDED, OBJ_TABLE, OBJ_INLINE = 0, 1, 2

_u64 = ctypes.c_uint64
_i64 = ctypes.c_int64
_u32 = ctypes.c_uint32
_i32 = ctypes.c_int32


class KvgRun(ctypes.Structure):
    """One segment run, offsets and steps in bytes, sizes in vector units."""

    _fields_ = [
        ("cache_offset", _i64),
        ("cache_step", _i64),
        ("token_stride", _i64),
        ("obj_offset", _i64),
        ("obj_step", _i64),
        ("units_per_piece", _u32),
        ("units_per_token", _u32),
        ("page_units", _u32),
        ("shifts", _u32),
    ]


def pow2_shifts(page_units: int, units_per_token: int, units_per_piece: int) -> int:
    """``KvgRun.shifts``: log2 of each size in its byte, 0xFF where it is not a power of two."""
    out = 0
    for i, n in enumerate((page_units, units_per_token, units_per_piece)):
        shift = n.bit_length() - 1 if n > 0 and n & (n - 1) == 0 else 0xFF
        out |= shift << (8 * i)
    return out


class KvgPlane(ctypes.Structure):
    """One entry of the plane table: the plane's cache base and its object row offset."""

    _fields_ = [("base", _u64), ("obj_offset", _i64)]


class KvgParams(ctypes.Structure):
    """Everything one launch needs (see the comments of ``page_copy.cu``)."""

    _fields_ = [
        ("plane_table", _u64),
        ("obj_base", _u64),
        ("obj_chunk_stride", _i64),
        ("obj_table", _u64),
        ("ids", _u64),
        ("err_record", _u64),
        ("skip", _u64),
        ("block_stride", _i64),
        ("num_blocks", _i64),
        ("region_offset", _i64),
        ("row_bytes", _i64),
        ("page_obj_stride", _i64),
        ("skip_mul", _i64),
        ("skip_div", _i64),
        ("skip_max", _i64),
        ("blocks_per_chunk", _i32),
        ("kept_per_chunk", _i32),
        ("first_item", _i32),
        ("num_items", _i32),
        ("items_per_cta", _i32),
        ("ids_mode", _i32),
        ("obj_mode", _i32),
        ("num_runs", _i32),
        ("num_planes", _i32),
        ("num_tiles", _i32),
        ("skip_mode", _i32),
        ("err_engine_group", _i32),
        ("err_kernel_group", _i32),
        ("reserved", _i32),
        ("segs_per_page", _i32),
        ("segs_shift", _i32),
        ("runs", KvgRun * MAX_RUNS),
        ("inline_objs", _u64 * INLINE_OBJS),
        ("inline_ids", _i32 * INLINE_IDS),
    ]


def layout_defines() -> tuple[tuple[str, str], ...]:
    """``-D`` macros that make the kernel source check this layout."""
    return (
        ("KVG_PARAMS_BYTES", str(ctypes.sizeof(KvgParams))),
        ("KVG_RUN_BYTES", str(ctypes.sizeof(KvgRun))),
    )


def kernel_name(direction: str, vector: int, contiguous: bool, warp: bool = False) -> str:
    """Entry point of one variant, e.g. ``kvg_store_v16_contig`` (``warp``: the one-warp-per-
    segment kernel of contiguous 16-byte-aligned pages, ``kvg_store_v16_warp``)."""
    if warp:
        if vector != 16 or not contiguous:
            raise ValueError("warp kernels: expected contiguous pages of 16-byte vectors")
        return f"kvg_{direction}_v16_warp"
    kind = "contig" if contiguous else "runs"
    return f"kvg_{direction}_v{vector}_{kind}"


def all_kernel_names() -> list[str]:
    """Every variant the source defines (the CI test compiles them all)."""
    names = [
        kernel_name(d, v, c)
        for d in ("store", "load")
        for v in VECTOR_WIDTHS
        for c in (True, False)
    ]
    return names + [kernel_name(d, 16, True, warp=True) for d in ("store", "load")]
