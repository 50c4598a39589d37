"""How each engine's KV tensors are read: axis names, memory order, zero-copy views.

A *reader* takes one described tensor of an engine's structure and returns its
:class:`~kvgroups_core.formats.catalogue.EngineKVFormat` plus a view of the same memory in that
format's
axis order (``[NB, BS, NH, HS]`` for an SGLang ``[PBS, NH, HS]`` page, ``[NB, BS, NH, 2, HS]``
for a JAX engine's packed heads, the memory-order view of a permuted tensor). Structures (lists,
K/V lists, buckets of layers) are :mod:`kvgroups_core.formats.detection`'s business.

How a shape is named, and what the ``kv_layout`` hint means:

- the engine decides how the shape is read; ``kv_layout`` ("NHD" or "HND") names the order of
  the token and head axes *in memory* where the shape cannot tell;
- a permuted view of a dense tensor is classified by its memory order, read from its strides,
  and normalized to the memory-order view. Without a ``kv_layout`` hint the view is read as the
  NHD view vLLM exposes (so an HND cache exposed as NHD is found to be HND);
- dim 0 may carry per-block padding when it is the block axis; any other strided layout is
  rejected.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError, mismatch
from kvgroups_core.tensors.arrays import describe
from kvgroups_core.tensors.descriptors import TensorDesc, TensorSpec

from .catalogue import CROSS_LAYER, KV_LIST, LAYER_LIST, LAYER_PAIR_LIST, EngineKVFormat
from .layout import INDEXER_ROW_BYTES, check_dense

#: Engines :func:`detect_format` knows (``"vllm_tpu"`` is an alias of ``"tpu_inference"``).
ENGINES = ("vllm", "sglang", "trtllm", "tpu_inference", "sglang_jax", "maxtext")
_ENGINE_ALIASES = {"vllm_tpu": "tpu_inference"}

#: Keys ``hints`` may hold.
HINT_KEYS = ("kv_layout", "tokens_per_block", "num_kv_heads", "head_dim", "recurrent_state")
_SIZE_HINTS = ("tokens_per_block", "num_kv_heads", "head_dim")

# (structure, axes) -> format: a memory order names its format.
_BY_AXES = {(f.facts.structure, f.facts.axes): f for f in EngineKVFormat}

Names = tuple[str, ...]
Reader = Callable[[TensorDesc, str, "Hints"], "tuple[EngineKVFormat, TensorDesc]"]
Namer = Callable[[tuple[int, ...], bool], Names]


@dataclass(frozen=True)
class Hints:
    """The validated ``hints`` mapping (every field optional)."""

    kv_layout: str | None = None
    tokens_per_block: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    recurrent_state: bool = False


def parse_hints(hints: Any) -> Hints:
    """Validate a ``hints`` mapping: known keys only, ``kv_layout`` "NHD"/"HND" (any case),
    sizes positive ints; ``None`` values count as absent."""
    if hints is None:
        return Hints()
    if not isinstance(hints, Mapping):
        raise KVGroupsTypeError(mismatch("hints", "a mapping or None", type(hints).__name__))
    unknown = sorted(str(k) for k in hints if k not in HINT_KEYS)
    if unknown:
        raise KVGroupsValueError(mismatch("hints", f"keys among {list(HINT_KEYS)}", unknown))
    layout = hints.get("kv_layout")
    if layout is not None:
        if not isinstance(layout, str) or layout.upper() not in ("NHD", "HND"):
            raise KVGroupsValueError(mismatch("hints['kv_layout']", "'NHD' or 'HND'", layout))
        layout = layout.upper()
    state = hints.get("recurrent_state")
    if state is not None and not isinstance(state, bool):
        raise KVGroupsValueError(mismatch("hints['recurrent_state']", "a bool", state))
    sizes = {}
    for key in _SIZE_HINTS:
        value = hints.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
            raise KVGroupsValueError(mismatch(f"hints[{key!r}]", "a positive int", value))
        sizes[key] = int(value)
    return Hints(layout, **sizes, recurrent_state=bool(state))


def engine_name(engine: Any) -> str:
    """The canonical engine name (case and ``-``/``_`` insensitive, aliases resolved)."""
    name = engine.lower().replace("-", "_") if isinstance(engine, str) else ""
    name = _ENGINE_ALIASES.get(name, name)
    if name not in ENGINES:
        raise KVGroupsValueError(mismatch("engine", f"one of {list(ENGINES)}", engine))
    return name


# --- zero-copy views -------------------------------------------------------------------


def tensor_desc(x: Any, what: str) -> TensorDesc:
    """:func:`~kvgroups_core.tensors.arrays.describe` ``x``, naming ``what`` in a type error."""
    try:
        return describe(x)
    except KVGroupsTypeError as err:
        text = str(err)
        text = text[len("tensor: ") :] if text.startswith("tensor: ") else text
        raise KVGroupsTypeError(f"{what}: {text}") from err


def _restrided(d: TensorDesc, shape: Sequence[int], strides: Sequence[int]) -> TensorDesc:
    spec = TensorSpec(tuple(shape), d.spec.dtype, tuple(strides), d.spec.device)
    return d.view(spec)


def _regroup(d: TensorDesc, axis: int, count: int, sizes: Sequence[int], what: str) -> TensorDesc:
    """View axes ``[axis, axis + count)`` as ``sizes`` (same element count), zero-copy.

    The replaced axes must be dense among themselves, like a merge in ``reshape``."""
    shape, strides = d.shape, d.strides
    part = [i for i in range(axis, axis + count) if shape[i] > 1]
    for outer, inner in zip(part, part[1:]):
        if strides[outer] != strides[inner] * shape[inner]:
            raise KVGroupsValueError(
                f"{what}: expected axes {list(range(axis, axis + count))} to be dense so they "
                f"can be viewed as {list(sizes)}, got shape {shape} with strides {strides}"
            )
    step = strides[part[-1]] if part else 1
    new_strides = []
    for size in reversed(sizes):
        new_strides.append(step)
        step *= size
    return _restrided(
        d,
        shape[:axis] + tuple(sizes) + shape[axis + count :],
        strides[:axis] + tuple(reversed(new_strides)) + strides[axis + count :],
    )


def _memory_order(spec: TensorSpec) -> tuple[int, ...]:
    """Axes from outermost to innermost in memory (a stable sort by stride).

    A size-1 axis has no meaningful stride; it keeps its place just outside the axis that
    follows it."""
    key = [0] * spec.ndim
    outer = 1
    for i in reversed(range(spec.ndim)):
        if spec.shape[i] > 1:
            key[i] = spec.strides[i]
            outer = spec.strides[i] * spec.shape[i]
        else:
            key[i] = outer
    return tuple(sorted(range(spec.ndim), key=lambda i: (-key[i], i)))


def _classify(
    d: TensorDesc, what: str, structure: str, namer: Namer, kv_layout: str | None = None
) -> tuple[EngineKVFormat, TensorDesc]:
    """The format of one backing tensor and its memory-order view.

    ``namer(shape, hnd)`` names the axes of a shape. With a ``kv_layout`` hint the memory
    order is named by the hint; without one the given view is named NHD and its names are
    carried into memory order by the strides."""
    order = _memory_order(d.spec)
    mem = d
    if order != tuple(range(d.spec.ndim)):
        mem = _restrided(d, [d.shape[i] for i in order], [d.strides[i] for i in order])
    if kv_layout is None:
        view_names = namer(d.shape, False)
        names = tuple(view_names[i] for i in order)
    else:
        names = namer(mem.shape, kv_layout == "HND")
    fmt = _BY_AXES.get((structure, names))
    if fmt is None:
        known = sorted(" ".join(a) for s, a in _BY_AXES if s == structure)
        raise KVGroupsValueError(
            f"{what}: expected a memory order among [{'; '.join(known)}], got "
            f"[{' '.join(names)}] (shape {d.shape}, strides {d.strides})"
        )
    check_dense(mem, fmt, what)
    return fmt, mem


# --- how each engine's tensors are read --------------------------------------------------


def _mid(hnd: bool) -> Names:
    return ("NH", "BS") if hnd else ("BS", "NH")


def _fixed(*names: str) -> Namer:
    return lambda shape, hnd: names


def _rank_error(what: str, expected: str, d: TensorDesc) -> KVGroupsValueError:
    return KVGroupsValueError(mismatch(what, expected, f"shape {d.shape} ({d.dtype})"))


def read_vllm_tensor(d: TensorDesc, what: str, h: Hints) -> tuple[EngineKVFormat, TensorDesc]:
    """One vLLM per-layer tensor: rank 5 (``[2, NB, ...]`` FlashAttention or ``[NB, 2, ...]``
    FlashInfer), rank 4 (K/V packed per head, CS), rank 3 (MLA, or the uint8 ``[NB, BS, 132]``
    indexer) or the vLLM-RBLN rank 6 ``[2, NB, NH, 1, BS, HS]``."""
    shape = d.shape
    if d.spec.ndim == 5:

        def namer(s: tuple[int, ...], hnd: bool) -> Names:
            if s[0] == 2:
                return ("TWO", "NB", *_mid(hnd), "HS")
            if s[1] == 2:
                return ("NB", "TWO", *_mid(hnd), "HS")
            raise KVGroupsValueError(
                mismatch(what, "a rank-5 tensor with dim 0 or dim 1 of size 2 (K/V)", s)
            )

        return _classify(d, what, LAYER_LIST, namer, h.kv_layout)
    if d.spec.ndim == 4:
        if shape[3] % 2:
            raise KVGroupsValueError(
                mismatch(what, "[NB, BS, NH, CS] or [NB, NH, BS, CS] with CS = 2*HS even", shape)
            )

        def cs_namer(s: tuple[int, ...], hnd: bool) -> Names:
            # vLLM's layout hint can be stale for packed caches; a middle axis matching
            # tokens_per_block (or num_kv_heads) settles the order when exactly one does.
            for size, when_first in ((h.tokens_per_block, False), (h.num_kv_heads, True)):
                if size is not None and (s[1] == size) != (s[2] == size):
                    hnd = (s[1] == size) == when_first
                    break
            return ("NB", *_mid(hnd), "CS")

        return _classify(d, what, LAYER_LIST, cs_namer, h.kv_layout)
    if d.spec.ndim == 3:
        if d.dtype.name == "uint8" and shape[2] == INDEXER_ROW_BYTES:
            return _classify(d, what, LAYER_LIST, _fixed("NB", "BS", "BSV_BSS"))
        return _classify(d, what, LAYER_LIST, _fixed("NB", "BS", "HS"))
    if d.spec.ndim == 6 and shape[0] == 2 and shape[3] == 1:  # vLLM-RBLN
        return _classify(d, what, LAYER_LIST, _fixed("TWO", "NB", "NH", "ONE", "BS", "HS"))
    raise _rank_error(what, "a per-layer tensor of rank 3, 4 or 5 (or a bare rank-6 tensor)", d)


def read_vllm_cross(d: TensorDesc, what: str, h: Hints) -> tuple[EngineKVFormat, TensorDesc]:
    """vLLM's cross-layer tensor ``[NB, NL, 2, BS, NH, HS]`` (``[.., NH, BS, ..]`` when HND)."""
    if d.spec.ndim != 6:
        raise _rank_error(what, "a bare rank-6 tensor [NB, NL, 2, BS, NH, HS] or a list", d)
    return _classify(
        d, what, CROSS_LAYER, lambda s, hnd: ("NB", "NL", "TWO", *_mid(hnd), "HS"), h.kv_layout
    )


def read_trtllm_cross(d: TensorDesc, what: str, h: Hints) -> tuple[EngineKVFormat, TensorDesc]:
    """TRT-LLM's pool ``[NB, NL, 2, NH, BS, HS]``, or ``[NB, NL, 2, NH*BS*HS]`` viewed through
    the ``num_kv_heads``, ``tokens_per_block`` and ``head_dim`` hints."""
    if d.spec.ndim == 4:
        nh, bs, hs = h.num_kv_heads, h.tokens_per_block, h.head_dim
        missing = [k for k, v in zip(HINT_KEYS[1:], (bs, nh, hs)) if v is None]
        if missing:
            raise KVGroupsValueError(
                mismatch(
                    "hints",
                    "num_kv_heads, tokens_per_block and head_dim to view the "
                    f"rank-4 TRT-LLM pool {d.shape} as [NB, NL, 2, NH, BS, HS]",
                    f"no {', '.join(missing)}",
                )
            )
        assert nh is not None and bs is not None and hs is not None  # for mypy: none missing
        if d.shape[3] != nh * bs * hs:
            raise KVGroupsValueError(
                mismatch(
                    f"{what} dim 3",
                    f"num_kv_heads*tokens_per_block*head_dim = {nh}*{bs}*{hs} = {nh * bs * hs}",
                    d.shape[3],
                )
            )
        d = _regroup(d, 3, 1, (nh, bs, hs), what)
    if d.spec.ndim != 6:
        raise _rank_error(what, "a rank-6 pool [NB, NL, 2, NH, BS, HS] (or rank 4 + hints)", d)
    return _classify(d, what, CROSS_LAYER, _fixed("NB", "NL", "TWO", "NH", "BS", "HS"))


def _fold_pages(d: TensorDesc, what: str, bs: int) -> TensorDesc:
    """``[PBS, ...]`` -> ``[PBS / BS, BS, ...]``."""
    pbs = d.shape[0]
    if pbs % bs:
        raise KVGroupsValueError(
            f"{what}: expected the page axis ({pbs} slots) to be a multiple of "
            f"tokens_per_block ({bs}), got {pbs} = {pbs // bs}*{bs} + {pbs % bs}"
        )
    return _regroup(d, 0, 1, (pbs // bs, bs), what)


def read_sglang_tensor(d: TensorDesc, what: str, h: Hints) -> tuple[EngineKVFormat, TensorDesc]:
    """One SGLang per-layer tensor: MLA ``[PBS, 1, HS]`` or indexer ``[NP, PS*132]``."""
    if d.spec.ndim == 2 and d.dtype.name == "uint8" and d.shape[1] % INDEXER_ROW_BYTES == 0:
        d = _regroup(d, 1, 1, (d.shape[1] // INDEXER_ROW_BYTES, INDEXER_ROW_BYTES), what)
        return _classify(d, what, LAYER_LIST, _fixed("NB", "BS", "BSV_BSS"))
    if d.spec.ndim == 3 and d.shape[1] == 1:
        if h.tokens_per_block is None:
            return _classify(d, what, LAYER_LIST, _fixed("PBS", "ONE", "HS"))
        d = _fold_pages(d, what, h.tokens_per_block)
        d = _restrided(d, d.shape[:2] + d.shape[3:], d.strides[:2] + d.strides[3:])
        return _classify(d, what, LAYER_LIST, _fixed("NB", "BS", "HS"))
    raise _rank_error(
        what, "an MLA [PBS, 1, HS] or indexer uint8 [NP, PS*132] tensor, or K/V tensors", d
    )


def read_sglang_kv(d: TensorDesc, what: str, h: Hints) -> tuple[EngineKVFormat, TensorDesc]:
    """One SGLang K or V tensor: ``[NB, BS, NH, HS]``, or ``[PBS, NH, HS]`` (viewed as
    ``[PBS / BS, BS, NH, HS]`` given ``tokens_per_block``; page-folded without it)."""
    if d.spec.ndim == 3:
        if h.tokens_per_block is None:
            return _classify(d, what, KV_LIST, _fixed("PBS", "NH", "HS"))
        d = _fold_pages(d, what, h.tokens_per_block)
    if d.spec.ndim != 4:
        raise _rank_error(what, "a K or V tensor [PBS, NH, HS] or [NB, BS, NH, HS]", d)
    return _classify(d, what, KV_LIST, _fixed("NB", "BS", "NH", "HS"))


def read_pair_tensor(d: TensorDesc, what: str, h: Hints) -> tuple[EngineKVFormat, TensorDesc]:
    """K or V of a vLLM-Ascend ``(K, V)`` pair, ``[NB, BS, NH, HS]``."""
    if d.spec.ndim != 4:
        raise _rank_error(what, "a K or V tensor [NB, BS, NH, HS] of a (K, V) pair", d)
    return _classify(d, what, LAYER_PAIR_LIST, _fixed("NB", "BS", "NH", "HS"))


def read_jax_tensor(d: TensorDesc, what: str, h: Hints) -> tuple[EngineKVFormat, TensorDesc]:
    """tpu-inference / sglang-jax: ``[NP, PS, 2*NH // P, P, HD]`` (or ``[NP, PS, 2*NH, HD]``)
    with heads ``[K0, V0, K1, V1, ...]``, viewed as ``[NB, BS, NH, 2, HS]``."""
    if d.spec.ndim == 5:
        packing = 32 // d.dtype.bits if d.dtype.bits <= 32 else 0
        if d.shape[3] != packing:
            raise KVGroupsValueError(
                mismatch(
                    f"{what} dim 3 (packing)",
                    f"32 / dtype bits = {packing} for "
                    f"{d.dtype} in [NP, PS, 2*NH/packing, packing, HD]",
                    d.shape[3],
                )
            )
        start, count = 2, 2
    elif d.spec.ndim == 4:
        start, count = 2, 1
    else:
        raise _rank_error(
            what,
            "[num_pages, page_size, 2*num_kv_heads//packing, packing, "
            "head_dim] (or rank 4 without packing)",
            d,
        )
    heads2 = math.prod(d.shape[start : start + count])
    if heads2 % 2:
        raise KVGroupsValueError(
            mismatch(f"{what} K/V heads", "an even count (K and V interleaved)", heads2)
        )
    d = _regroup(d, start, count, (heads2 // 2, 2), what)
    return _classify(d, what, LAYER_LIST, _fixed("NB", "BS", "NH", "TWO", "HS"))


def read_maxtext_kv(d: TensorDesc, what: str, h: Hints) -> tuple[EngineKVFormat, TensorDesc]:
    """One MaxText K or V page array, heads outermost: ``[NH, NP, PS, HD]``."""
    if d.spec.ndim != 4:
        raise _rank_error(what, "a K or V array [num_kv_heads, num_pages, page_size, head_dim]", d)
    return _classify(d, what, KV_LIST, _fixed("NH", "NB", "BS", "HS"))
