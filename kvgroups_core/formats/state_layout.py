"""Recurrent-state layers in the page model (docs/SEMANTICS.md section 9, docs/FORMATS.md).

A recurrent layer (Mamba, Gated DeltaNet, linear attention) keeps one whole state per *slot*:
a conv window and a temporal (SSM / delta-rule) matrix, each a tensor ``[NB, ...]`` registered
as its own layer in a state format. In the page model a slot is a block of one token slot whose
one row is the whole state, so every backend moves state slots with the kernels it moves
attention pages with: one contiguous run of the state's unpadded bytes per slot, the block
stride stepping over any padding the engine adds to its pages.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError
from kvgroups_core.tensors.descriptors import TensorDesc
from kvgroups_core.tensors.dtypes import DType, as_dtype

from .catalogue import EngineKVFormat
from .segments import SegmentRun

CONV_FORMATS = (EngineKVFormat.NL_X_NB_CD_CW, EngineKVFormat.NL_X_NB_CW_CD)
TEMPORAL_FORMAT = EngineKVFormat.NL_X_NB_SH_SS

#: The conv state orientations engines name: "DS" = (channels, window), "SD" = (window,
#: channels) per slot.
CONV_ORIENTATIONS = {"DS": EngineKVFormat.NL_X_NB_CD_CW, "SD": EngineKVFormat.NL_X_NB_CW_CD}


def is_conv(fmt: Any) -> bool:
    return fmt in CONV_FORMATS


def conv_format(orientation: str, what: str = "conv_layout") -> EngineKVFormat:
    """The conv state format of an engine's orientation name ("DS" or "SD", any case)."""
    key = str(orientation).upper() if isinstance(orientation, str) else None
    if key not in CONV_ORIENTATIONS:
        raise KVGroupsValueError(
            f"{what}: expected 'DS' (channels, window) or 'SD' (window, channels), got "
            f"{orientation!r}"
        )
    return CONV_ORIENTATIONS[key]


def _check_rows(desc: TensorDesc, fmt: EngineKVFormat, what: str) -> None:
    """A slot's state must be one row-major run; only the slot axis may be padded."""
    shape, strides = desc.spec.shape, desc.spec.strides
    step = 1
    for i in range(len(shape) - 1, 0, -1):
        if shape[i] > 1 and strides[i] != step:
            raise KVGroupsValueError(
                f"{what}: expected each slot of {fmt.name} [{', '.join(fmt.facts.axes)}] to be "
                f"one row-major state (strides {_row_major(shape)[1:]} after the slot axis), "
                f"got shape {shape} with strides {strides}"
            )
        step *= shape[i]
    if shape[0] > 1 and strides[0] < step:
        raise KVGroupsValueError(
            f"{what}: expected the slot axis (dim 0) of {fmt.name} to step over a whole state "
            f"({step} elements or more), got stride {strides[0]} in shape {shape}"
        )


def _row_major(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def state_layer_fields(
    fmt: EngineKVFormat, tensors: Sequence[TensorDesc], what: str
) -> dict[str, Any]:
    """The fields of one state layer's :class:`~kvgroups_core.formats.layout.LayerLayout`.

    ``kv_size = 1``, ``block_size = 1`` (a slot), one run of the whole unpadded state; the
    conv state's channels act as heads in the ``CD_CW`` orientation (a shard of channels is a
    contiguous part of the row), the temporal state's heads (dim 1) are its heads.
    """
    if len(tensors) != 1:
        raise KVGroupsValueError(f"{what}: expected one state tensor, got {len(tensors)}")
    desc = tensors[0]
    shape = desc.spec.shape
    rank_ok = len(shape) == 3 if is_conv(fmt) else len(shape) >= 3
    if not rank_ok:
        want = "rank-3" if is_conv(fmt) else "rank >= 3"
        raise KVGroupsValueError(
            f"{what}: expected a {want} tensor [{', '.join(fmt.facts.axes)}] for {fmt.name}, "
            f"got shape {shape}"
        )
    if any(n <= 0 for n in shape):
        raise KVGroupsValueError(
            f"{what}: expected non-empty axes for {fmt.name}, got shape {shape}"
        )
    _check_rows(desc, fmt, what)
    dtype = desc.spec.dtype
    e = dtype.itemsize
    state = math.prod(shape[1:])
    stride0 = desc.spec.strides[0] if shape[0] > 1 else state
    if fmt is EngineKVFormat.NL_X_NB_CW_CD:
        nh, hs = 1, state
    else:
        nh, hs = shape[1], state // shape[1]
    runs = (
        SegmentRun(
            count=1,
            nbytes=state * e,
            obj_offset=0,
            obj_step=0,
            cache_offset=0,
            cache_step=0,
            token_stride=state * e,
        ),
    )
    return dict(
        format=fmt,
        kv_size=1,
        num_blocks=shape[0],
        block_size=1,
        num_heads=nh,
        head_size=hs,
        dtype=dtype,
        block_stride_elems=stride0 if stride0 > state else 0,
        block_stride_bytes=stride0 * e,
        runs=runs,
        planes=((desc, 0),),
    )


def _shape_dims(shape: Any, what: str) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints, else a typed error naming ``what``."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise KVGroupsTypeError(f"{what}: expected a shape (a sequence of ints), got {shape!r}")
    dims = []
    for d in shape:
        try:
            if isinstance(d, bool):
                raise TypeError
            dims.append(operator.index(d))
        except TypeError:
            raise KVGroupsTypeError(f"{what}: expected int dimensions, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise KVGroupsValueError(f"{what}: expected non-negative dimensions, got {shape!r}")
    return tuple(dims)


def state_page_offsets(
    shapes: Sequence[Sequence[int]], dtypes: Sequence[Any], what: str = "state page"
) -> list[tuple[int, int]]:
    """``(byte offset, nbytes)`` of each sub-state in a page that holds them back to back (how
    vLLM lays out a ``MambaSpec`` page: its ``shapes`` in its ``dtypes``, in order).

    Raises KVGroupsValueError when a sub-state does not start on a multiple of its element
    size (it could not be viewed in its dtype), KVGroupsTypeError when ``shapes`` is not a
    sequence of int shapes or ``dtypes`` not a sequence.
    """
    for name, value in (("shapes", shapes), ("dtypes", dtypes)):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise KVGroupsTypeError(f"{what}: {name}: expected a sequence, got {value!r}")
    if len(shapes) != len(dtypes):
        raise KVGroupsValueError(
            f"{what}: expected one dtype per shape, got {len(shapes)} shapes and "
            f"{len(dtypes)} dtypes"
        )
    out, offset = [], 0
    for i, (shape, dt) in enumerate(zip(shapes, dtypes)):
        dims = _shape_dims(shape, f"{what}: shapes[{i}]")
        dtype: DType = as_dtype(dt)
        if offset % dtype.itemsize:
            raise KVGroupsValueError(
                f"{what}: sub-state {i} ({dtype.name} {dims}) starts at byte {offset}, "
                f"not a multiple of its {dtype.itemsize}-byte elements"
            )
        nbytes = math.prod(dims) * dtype.itemsize
        out.append((offset, nbytes))
        offset += nbytes
    return out
