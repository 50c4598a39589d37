"""Cache builders and an independent model of docs/SEMANTICS.md section 6 (the kit's oracle).

Nothing here uses the page model (SegmentRuns, byte offsets): token rows are read with plain
NumPy indexing of each format's logical axes, so the suite checks the core's layout maths
instead of repeating it.
"""

from __future__ import annotations

import numpy as np

from kvgroups_core.formats.catalogue import CROSS_LAYER, KV_LIST, LAYER_PAIR_LIST
from kvgroups_core.formats.catalogue import EngineKVFormat as F

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
    FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
    BF16 = FP8 = None

DTYPES = {
    "float16": np.dtype(np.float16),
    "bfloat16": BF16,
    "float32": np.dtype(np.float32),
    "uint8": np.dtype(np.uint8),
    "float8_e4m3fn": FP8,
}

#: Formats every backend must move (docs/FORMATS.md must-haves plus the JAX engine layouts).
TRANSFER_FORMATS = tuple(f for f in F if f.must_have)


def _size(axis: str, nl: int, nb: int, bs: int, nh: int, hs: int) -> int:
    return {
        "NB": nb,
        "BS": bs,
        "NH": nh,
        "HS": hs,
        "CS": hs,
        "NL": nl,
        "TWO": 2,
        "ONE": 1,
        "BSV_BSS": 132,
    }[axis]


def random_bits(
    shape: tuple[int, ...], dtype: np.dtype, rng: np.random.Generator, padded_extra: int = 0
) -> np.ndarray:
    """Random bit patterns (NaN payloads included) of ``dtype``; with ``padded_extra`` the
    blocks (dim 0) are padded by that many elements, filled with a 0xA5 sentinel."""
    bits = f"uint{dtype.itemsize * 8}"
    inner = int(np.prod(shape[1:]))
    raw = rng.integers(
        0, 2 ** (dtype.itemsize * 8), size=(shape[0], inner + padded_extra), dtype=np.uint64
    ).astype(bits)
    if padded_extra:
        raw[:, inner:] = np.frombuffer(b"\xa5" * dtype.itemsize, dtype=bits)[0]
    base = raw.view(dtype)
    view = (
        base[:, :inner].reshape(shape)
        if not padded_extra
        else np.lib.stride_tricks.as_strided(
            base,
            shape=shape,
            strides=(base.strides[0],)
            + tuple(
                s * dtype.itemsize for s in np.cumprod((list(shape[1:]) + [1])[::-1])[::-1][1:]
            ),
            writeable=True,
        )
    )
    return view


def copy_keeping_strides(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` with ``a``'s strides: the bytes between its elements (padding between
    blocks) are copied too. Harnesses use it to keep padded caches padded."""
    if a.flags.c_contiguous or a.size == 0:
        return a.copy()
    if any(s < 0 for s in a.strides):
        raise ValueError(f"a: expected non-negative strides, got {a.strides}")
    extent = sum((n - 1) * s for n, s in zip(a.shape, a.strides)) // a.itemsize + 1
    flat = np.lib.stride_tricks.as_strided(a, shape=(extent,), strides=(a.itemsize,)).copy()
    return np.lib.stride_tricks.as_strided(flat, shape=a.shape, strides=a.strides, writeable=True)


def make_caches(
    fmt: F,
    *,
    nl: int,
    nb: int,
    bs: int,
    nh: int,
    hs: int,
    dtype: str,
    rng: np.random.Generator,
    pad: int = 0,
    zero: bool = False,
):
    """Caches of ``fmt`` as NumPy arrays: ``(structure, formats_per_layer)``."""
    np_dtype = np.dtype(np.uint8) if fmt.is_indexer else DTYPES[dtype]
    axes = fmt.facts.axes
    shape = tuple(_size(a, nl, nb, bs, nh, hs) for a in axes)

    def one() -> np.ndarray:
        arr = random_bits(shape, np_dtype, rng, pad if fmt.block_axis_first else 0)
        if zero:
            if pad and fmt.block_axis_first:
                arr[...] = 0  # only the logical elements: the padding keeps its sentinel
            else:
                arr = np.zeros(shape, np_dtype)
        return arr

    structure = fmt.facts.structure
    if structure == CROSS_LAYER:
        caches = one()
    elif structure == KV_LIST:
        caches = [[one() for _ in range(nl)], [one() for _ in range(nl)]]
    elif structure == LAYER_PAIR_LIST:
        caches = [(one(), one()) for _ in range(nl)]
    else:
        caches = [one() for _ in range(nl)]
    return caches, [fmt] * nl


def plane_tensor(caches, fmt: F, layer: int, kv: int) -> tuple[np.ndarray, dict[str, int]]:
    """The array holding (layer, kv) and the axis selections that pick it."""
    structure = fmt.facts.structure
    select = {"ONE": 0}
    if structure == CROSS_LAYER:
        arr = caches
        select["NL"] = layer
    elif structure == KV_LIST:
        arr = caches[kv][layer]
    elif structure == LAYER_PAIR_LIST:
        arr = caches[layer][kv]
    else:
        arr = caches[layer]
    if "TWO" in fmt.facts.axes:
        select["TWO"] = kv
    return arr, select


def token_rows(caches, fmt: F, layer: int, kv: int, block: int) -> np.ndarray:
    """Bytes of block ``block`` of (layer, kv) as object rows: uint8 ``[bs, row_bytes]``."""
    arr, select = plane_tensor(caches, fmt, layer, kv)
    select["NB"] = block
    axes = fmt.facts.axes
    if fmt.is_indexer:
        blk = np.ascontiguousarray(arr[block]).reshape(-1)
        bs = arr.shape[1]
        values = blk[: bs * 128].reshape(bs, 128)
        scales = blk[bs * 128 : bs * 132].reshape(bs, 4)
        return np.concatenate([values, scales], axis=1)
    index = tuple(select.get(a, slice(None)) for a in axes)
    rest = [a for a in axes if a not in select]
    sub = arr[index]
    head = "CS" if "CS" in rest else "HS"
    order = [rest.index("BS")] + ([rest.index("NH")] if "NH" in rest else []) + [rest.index(head)]
    sub = np.ascontiguousarray(np.transpose(sub, order))
    bs = sub.shape[0]
    return sub.reshape(bs, -1).view(np.uint8).reshape(bs, -1).copy()  # never a view of the cache


def expected_object(manager, caches, og: int, chunk_ids: dict[int, np.ndarray]) -> np.ndarray:
    """One chunk's object of object group ``og`` built from docs/SEMANTICS.md section 6.

    ``chunk_ids`` maps engine group id -> this chunk's engine block ids.
    """
    parts = []
    chunk = manager.lmcache_tokens_per_chunk
    for k in manager.object_groups[og].kernel_group_indices:
        group = manager.kernel_groups[k]
        fmt = group.engine_kv_format
        ids = chunk_ids[group.engine_group_idx]
        bpc = manager.calculate_num_blocks(k, chunk)
        kept = manager.calculate_num_blocks(k, manager.get_subchunk_sw_size_tokens(k))
        assert len(ids) == bpc
        kept_ids = ids[bpc - kept :]
        for kv in range(group.shape_desc.kv_size):
            for layer in group.layer_indices:
                for b in kept_ids:
                    parts.append(token_rows(caches, fmt, layer, kv, int(b)).reshape(-1))
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def all_blocks(caches, formats) -> dict[tuple[int, int, int], np.ndarray]:
    """Every (layer, kv, block) -> its token-row bytes."""
    out = {}
    for layer, fmt in enumerate(formats):
        arr, _ = plane_tensor(caches, fmt, layer, 0)
        nb = arr.shape[fmt.facts.axes.index("NB")]
        for kv in range(fmt.kv_size):
            for b in range(nb):
                out[(layer, kv, b)] = token_rows(caches, fmt, layer, kv, b)
    return out
