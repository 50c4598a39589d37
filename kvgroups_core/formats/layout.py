"""Per-layer geometry of every format, read generically from shapes and strides.

:func:`layer_layouts` turns a normalized KV cache structure plus one format per layer into one
:class:`LayerLayout` per layer: the sizes the grouping keys on (kv_size, heads, head size, block
size, dtype), the padding rule, and the page model of ``docs/DESIGN.md`` (where each plane
starts, the block stride and the :class:`~kvgroups_core.formats.segments.SegmentRun` s of a token
row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError
from kvgroups_core.tensors.arrays import describe
from kvgroups_core.tensors.descriptors import TensorDesc, TensorSpec
from kvgroups_core.tensors.dtypes import DType

from .catalogue import CROSS_LAYER, KV_LIST, LAYER_LIST, LAYER_PAIR_LIST, EngineKVFormat
from .segments import SegmentRun, widest_unit
from .state_layout import state_layer_fields

#: Blocked-scale indexer rows: 128 bytes of fp8 values and a 4-byte scale per token.
INDEXER_VALUE_BYTES = 128
INDEXER_SCALE_BYTES = 4
INDEXER_ROW_BYTES = INDEXER_VALUE_BYTES + INDEXER_SCALE_BYTES


@dataclass(frozen=True, eq=False)
class LayerLayout:
    """Geometry of one layer in the page model.

    ``planes[kv]`` is ``(tensor, byte_offset)``: the backing tensor holding plane ``kv`` and the
    byte offset of that plane's block 0 from the tensor's first element.
    """

    format: EngineKVFormat
    kv_size: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_size: int
    dtype: DType
    block_stride_elems: int
    block_stride_bytes: int
    runs: tuple[SegmentRun, ...]
    planes: tuple[tuple[TensorDesc, int], ...]

    @property
    def row_bytes(self) -> int:
        """Bytes of one token row of one plane in a memory object (``nh * hs * itemsize``)."""
        return self.num_heads * self.head_size * self.dtype.itemsize

    @property
    def unit_bytes(self) -> int:
        """Widest power-of-two vector (<= 16 B) dividing every size, offset and stride."""
        values: list[int] = [self.block_stride_bytes, self.row_bytes]
        for run in self.runs:
            values += [
                run.nbytes,
                run.obj_offset,
                run.obj_step,
                run.cache_offset,
                run.cache_step,
                run.token_stride,
            ]
        values += [offset for _, offset in self.planes]
        return widest_unit(values)

    def same_geometry(self, other: "LayerLayout") -> bool:
        """True when one kernel launch can move both layers (pointers aside)."""
        return (
            self.format is other.format
            and self.num_blocks == other.num_blocks
            and self.block_stride_bytes == other.block_stride_bytes
            and self.runs == other.runs
            and self.dtype == other.dtype
        )


#: Axes whose length the format fixes: a tensor with another length there is some other layout
#: (a ``[2, 64, 16, 8, 128]`` tensor declared ``NL_X_NB_TWO_BS_NH_HS`` is not 64 K/V planes).
_FIXED_AXES = {"TWO": 2, "ONE": 1}


def _check_axes_fit(
    shape: tuple[int, ...], axes: tuple[str, ...], fmt: EngineKVFormat, what: str
) -> None:
    """Every axis non-empty and every fixed axis of its length, before any geometry is read."""
    for size, name in zip(shape, axes):
        want = _FIXED_AXES.get(name)
        if want is not None and size != want:
            raise KVGroupsValueError(
                f"{what}: expected axis {name} of length {want} for {fmt.name} "
                f"[{', '.join(axes)}], got shape {tuple(shape)}; is the declared format the "
                "tensor's?"
            )
        if size <= 0:
            raise KVGroupsValueError(
                f"{what}: expected a non-empty {name} axis for {fmt.name} [{', '.join(axes)}], "
                f"got shape {tuple(shape)}"
            )


def check_dense(desc: TensorDesc, fmt: EngineKVFormat, what: str) -> None:
    """Accept a permutation of a contiguous tensor, with per-block padding on dim 0 when dim 0
    is the block axis and outermost in memory; reject any other strided layout."""
    spec = desc.spec
    dims = [(spec.strides[i], spec.shape[i], i) for i in range(spec.ndim) if spec.shape[i] > 1]
    dims.sort(key=lambda d: (d[0], d[2]))
    step = 1
    for pos, (stride, size, index) in enumerate(dims):
        outermost = pos == len(dims) - 1
        padded_ok = outermost and index == 0 and fmt.block_axis_first
        if stride == step or (padded_ok and stride > step):
            step = stride * size
            continue
        raise KVGroupsValueError(
            f"{what}: expected a contiguous tensor (or a permutation of one, or blocks padded on "
            f"dim 0) for {fmt.name}, got shape {spec.shape} with strides {spec.strides}"
        )


def _tensor_layout(
    fmt: EngineKVFormat, tensors: Sequence[TensorDesc], layer_in_tensor: int, what: str
) -> LayerLayout:
    axes = fmt.facts.axes
    first = tensors[0]
    for t in tensors:
        if t.spec.ndim != len(axes):
            raise KVGroupsValueError(
                f"{what}: expected a rank-{len(axes)} tensor [{', '.join(axes)}] for "
                f"{fmt.name}, got shape {t.spec.shape}"
            )
        _check_axes_fit(t.spec.shape, axes, fmt, what)
        if t.spec.shape != first.spec.shape or t.spec.strides != first.spec.strides:
            raise KVGroupsValueError(
                f"{what}: expected K and V tensors of one shape and strides, got "
                f"{first.spec.shape}/{first.spec.strides} and {t.spec.shape}/{t.spec.strides}"
            )
        if t.spec.dtype != first.spec.dtype:
            raise KVGroupsValueError(
                f"{what}: expected K and V of one dtype, got {first.dtype} and {t.dtype}"
            )
        check_dense(t, fmt, what)
    shape, strides = first.spec.shape, first.spec.strides
    dtype = first.spec.dtype
    e = dtype.itemsize
    size = {name: shape[i] for i, name in enumerate(axes)}
    stride = {name: strides[i] for i, name in enumerate(axes)}

    nb = size["NB"]
    bs = size["BS"]
    block_stride_bytes = stride["NB"] * e
    inner = math.prod(shape[1:])
    block_stride_elems = strides[0] if fmt.block_axis_first and strides[0] > inner else 0

    if fmt.is_indexer:
        if dtype.itemsize != 1 or size["BSV_BSS"] != INDEXER_ROW_BYTES:
            raise KVGroupsValueError(
                f"{what}: expected a 1-byte dtype [NB, BS, {INDEXER_ROW_BYTES}] for {fmt.name}, "
                f"got {dtype} {shape}"
            )
        nh, hs = 1, INDEXER_ROW_BYTES
        # Inside a block all BS value rows come first, then all BS scales.
        runs: tuple[SegmentRun, ...] = (
            SegmentRun(
                count=1,
                nbytes=INDEXER_VALUE_BYTES,
                obj_offset=0,
                obj_step=0,
                cache_offset=0,
                cache_step=0,
                token_stride=INDEXER_VALUE_BYTES,
            ),
            SegmentRun(
                count=1,
                nbytes=INDEXER_SCALE_BYTES,
                obj_offset=INDEXER_VALUE_BYTES,
                obj_step=0,
                cache_offset=bs * INDEXER_VALUE_BYTES,
                cache_step=0,
                token_stride=INDEXER_SCALE_BYTES,
            ),
        )
    else:
        head_axis = "CS" if "CS" in size else "HS"
        hs = size[head_axis]
        if stride[head_axis] != 1 and hs > 1:
            raise KVGroupsValueError(
                f"{what}: expected the {head_axis} axis to be contiguous (stride 1), got "
                f"strides {strides}"
            )
        nh = size.get("NH", 1)
        head_stride = stride.get("NH", hs)
        token_stride = stride["BS"] * e
        if nh == 1 or head_stride == hs:
            runs = (
                SegmentRun(
                    count=1,
                    nbytes=nh * hs * e,
                    obj_offset=0,
                    obj_step=0,
                    cache_offset=0,
                    cache_step=0,
                    token_stride=token_stride,
                ),
            )
        else:
            runs = (
                SegmentRun(
                    count=nh,
                    nbytes=hs * e,
                    obj_offset=0,
                    obj_step=hs * e,
                    cache_offset=0,
                    cache_step=head_stride * e,
                    token_stride=token_stride,
                ),
            )

    kv_size = fmt.kv_size
    planes = []
    for kv in range(kv_size):
        tensor = tensors[kv] if len(tensors) == kv_size else tensors[0]
        offset = layer_in_tensor * stride.get("NL", 0)
        if len(tensors) == 1:
            offset += kv * stride.get("TWO", 0)
        planes.append((tensor, offset * e))
    return LayerLayout(
        format=fmt,
        kv_size=kv_size,
        num_blocks=nb,
        block_size=bs,
        num_heads=nh,
        head_size=hs,
        dtype=dtype,
        block_stride_elems=block_stride_elems,
        block_stride_bytes=block_stride_bytes,
        runs=runs,
        planes=tuple(planes),
    )


def describe_named(x: Any, what: str) -> TensorDesc:
    """``describe(x)``, a refusal naming ``what`` (the place in the cache structure) instead
    of a bare "tensor"."""
    try:
        return describe(x)
    except KVGroupsTypeError as exc:
        text = str(exc)
        text = text[len("tensor: ") :] if text.startswith("tensor: ") else text
        raise KVGroupsTypeError(f"{what}: {text}") from None


def _as_desc(x: Any, what: str) -> TensorDesc:
    if x is None or isinstance(x, (list, tuple, dict, str, bytes, int, float)):
        raise KVGroupsTypeError(
            f"{what}: expected a tensor (an object with __dlpack__, or a TensorSpec), got "
            f"{type(x).__name__}"
        )
    return describe_named(x, what)


def layer_tensors(kv_caches: Any, fmt: EngineKVFormat, layer: int) -> tuple[list[TensorDesc], int]:
    """The backing tensor(s) of ``layer`` and the layer's index inside them (cross-layer)."""
    structure = fmt.facts.structure
    if structure == CROSS_LAYER:
        if isinstance(kv_caches, (list, tuple)):
            return [_as_desc(kv_caches[0], f"kv_caches[0] (layer {layer})")], layer
        return [_as_desc(kv_caches, f"kv_caches (layer {layer})")], layer
    if not isinstance(kv_caches, (list, tuple)):
        raise KVGroupsTypeError(
            f"kv_caches: expected a list for {fmt.name}, got {type(kv_caches).__name__}"
        )
    if structure == KV_LIST:
        if len(kv_caches) != 2:
            raise KVGroupsValueError(
                f"kv_caches: expected [K list, V list] for {fmt.name}, got {len(kv_caches)} entries"
            )
        return [
            _as_desc(kv_caches[0][layer], f"kv_caches[0][{layer}] (K of layer {layer})"),
            _as_desc(kv_caches[1][layer], f"kv_caches[1][{layer}] (V of layer {layer})"),
        ], 0
    entry = kv_caches[layer]
    if fmt is EngineKVFormat.NL_X_NB_BS_NH_TWO_HS:
        what = f"kv_caches[{layer}]"
        return [_jax_heads_view(_as_desc(entry, f"{what} (layer {layer})"), what)], 0
    if structure == LAYER_PAIR_LIST:
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise KVGroupsValueError(
                f"kv_caches[{layer}]: expected a (K, V) pair for {fmt.name}, got {entry!r}"
            )
        return [
            _as_desc(entry[0], f"kv_caches[{layer}][0] (K of layer {layer})"),
            _as_desc(entry[1], f"kv_caches[{layer}][1] (V of layer {layer})"),
        ], 0
    assert structure == LAYER_LIST
    return [_as_desc(entry, f"kv_caches[{layer}] (layer {layer})")], 0


def _jax_heads_view(d: TensorDesc, what: str) -> TensorDesc:
    """A JAX engine's own page array, ``[NP, PS, 2*NH // packing, packing, HD]`` (any packing:
    fp32 1, bf16 2, fp8 4) or ``[NP, PS, 2*NH, HD]``, viewed zero-copy as the format's
    ``[NB, BS, NH, 2, HS]`` (heads K0, V0, K1, V1 ...). Already-normalized views (dim 3 of 2)
    are returned as they are: for them both readings name the same bytes."""
    shape, strides = d.spec.shape, d.spec.strides
    if len(shape) == 5 and shape[3] == 2:
        return d
    if len(shape) not in (4, 5):
        return d  # _tensor_layout names the expected rank
    heads = shape[2] * (shape[3] if len(shape) == 5 else 1)
    if len(shape) == 5 and shape[3] > 1 and shape[2] > 1 and strides[2] != strides[3] * shape[3]:
        raise KVGroupsValueError(
            f"{what}: expected the packed head axes (2, 3) to be dense, got shape {shape} with "
            f"strides {strides}"
        )
    if heads % 2:
        raise KVGroupsValueError(
            f"{what}: expected an even count of K/V heads (K and V interleaved), got {heads} "
            f"in shape {shape}"
        )
    head_stride = strides[3] if len(shape) == 5 and shape[3] > 1 else strides[2]
    new_shape = shape[:2] + (heads // 2, 2, shape[-1])
    new_strides = strides[:2] + (2 * head_stride, head_stride, strides[-1])
    spec = TensorSpec(new_shape, d.spec.dtype, new_strides, d.spec.device)
    return d.view(spec)


def _kind(x: Any) -> str:
    """What an entry of a cache structure is, in a message ("a tensor" for a described one)."""
    return "a tensor" if isinstance(x, TensorDesc) else type(x).__name__


def num_layers_of(kv_caches: Any, fmt: EngineKVFormat) -> int:
    """Layers in a structure of one format (the structure checked against the format's)."""
    structure = fmt.facts.structure
    if structure == CROSS_LAYER:
        tensor = kv_caches
        if isinstance(kv_caches, (list, tuple)):
            if len(kv_caches) != 1:
                raise KVGroupsValueError(
                    f"kv_caches: expected the one cross-layer tensor of {fmt.name} (or a list "
                    f"holding it), got a list of {len(kv_caches)}"
                )
            tensor = kv_caches[0]
        return _as_desc(tensor, "kv_caches").spec.shape[fmt.facts.axes.index("NL")]
    if not isinstance(kv_caches, (list, tuple)):
        expected = "[K list, V list]" if structure == KV_LIST else "a list with one entry per layer"
        raise KVGroupsTypeError(
            f"kv_caches: expected {expected} for {fmt.name}, got {_kind(kv_caches)}"
        )
    if structure == KV_LIST:
        if len(kv_caches) != 2 or not all(isinstance(x, (list, tuple)) for x in kv_caches):
            raise KVGroupsValueError(
                f"kv_caches: expected [K list, V list] for {fmt.name}, got "
                f"[{', '.join(map(_kind, kv_caches))}]"
            )
        if len(kv_caches[0]) != len(kv_caches[1]):
            raise KVGroupsValueError(
                f"kv_caches: expected K and V lists of one length for {fmt.name}, got "
                f"{len(kv_caches[0])} K and {len(kv_caches[1])} V tensors"
            )
        return len(kv_caches[0])
    return len(kv_caches)


def layer_layout(kv_caches: Any, fmt: EngineKVFormat, layer: int) -> LayerLayout:
    """The :class:`LayerLayout` of one layer."""
    if not isinstance(fmt, EngineKVFormat):
        raise KVGroupsTypeError(
            f"engine_kv_formats[{layer}]: expected an EngineKVFormat, got {fmt!r}"
        )
    if not fmt.groupable:
        raise KVGroupsValueError(
            f"engine_kv_formats[{layer}]: {fmt.name} folds blocks and slots into one axis "
            "(no NB/BS), so it cannot be grouped; register the tensors viewed as "
            "[NB, BS, ...] (detect_format does this given a tokens_per_block hint)"
        )
    tensors, index = layer_tensors(kv_caches, fmt, layer)
    if fmt.is_recurrent_state:
        return LayerLayout(**state_layer_fields(fmt, tensors, f"kv_caches layer {layer}"))
    if fmt.is_cross_layer:
        nl = tensors[0].spec.shape[fmt.facts.axes.index("NL")]
        if not 0 <= index < nl:
            raise KVGroupsValueError(
                f"layer: expected an index in [0, {nl}) of the cross-layer tensor, got {index}"
            )
    return _tensor_layout(fmt, tensors, index, f"kv_caches layer {layer}")


def layer_layouts(kv_caches: Any, engine_kv_formats: Sequence[EngineKVFormat]) -> list[LayerLayout]:
    """One :class:`LayerLayout` per layer of a normalized structure."""
    return [layer_layout(kv_caches, fmt, i) for i, fmt in enumerate(engine_kv_formats)]
