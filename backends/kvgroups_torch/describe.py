"""Torch tensors as core descriptors, read through DLPack without losing the dtype.

DLPack is the one path every framework shares, so the core reads torch tensors the same way
it reads any array. Types DLPack (or an older torch) cannot export, fp8 and bool, are read as
a uint8 view of the same width and strides, then given back their real :class:`DType`.
"""

from __future__ import annotations

from typing import Any

import torch

from kvgroups_core.errors import KVGroupsTypeError
from kvgroups_core.tensors.descriptors import TensorDesc, TensorSpec, describe_dlpack
from kvgroups_core.tensors.dtypes import DTYPE_MAP, DType

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.bool: "bool",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        DTYPE_NAMES[getattr(torch, _name)] = _name

#: Exported as a same-width uint8 view: DLPack support for these varies across torch versions.
_BYTE_VIEW = {torch.float8_e4m3fn, torch.float8_e5m2, torch.bool}

_TORCH_OF: dict[str, torch.dtype] = {name: dt for dt, name in DTYPE_NAMES.items()}

_STRIDED = torch.strided


def dtype_of(t: torch.Tensor) -> DType:
    """The :class:`DType` of a torch tensor (``torch.float8_e4m3fn`` -> ``float8_e4m3fn``)."""
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise KVGroupsTypeError(
            f"tensor dtype: expected one of {sorted(DTYPE_NAMES.values())}, got {t.dtype}"
        )
    return DTYPE_MAP[name]


def check_plain(x: torch.Tensor, what: str) -> None:
    """Refuse a tensor whose memory is not its values laid out by its strides: sparse, mkldnn
    and nested tensors (no strided buffer: DLPack and ``data_ptr`` fail) and negative-bit views
    (torch negates lazily, so their bytes are the unnegated values: moving them would move the
    wrong numbers, silently). Conjugate views, the same for complex numbers, need no test:
    only complex tensors have them, and no transfer takes a complex dtype."""
    if x.layout is not _STRIDED or x.is_nested:
        got = f"a nested tensor (layout {x.layout})" if x.is_nested else f"layout {x.layout}"
        raise KVGroupsTypeError(
            f"{what}: expected a dense tensor (layout torch.strided), got {got}"
        )
    if x.is_neg():
        raise KVGroupsTypeError(
            f"{what}: expected a tensor whose memory holds its values, got a negative-bit view "
            "(is_neg() is True); pass tensor.resolve_neg()"
        )


def shape_of(x: Any) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """``(dtype name, shape, element strides)`` of a tensor: what the core's object rule reads
    (``kvgroups_core.transfer.objects.check_objects``, which names the object in a refusal);
    other values, and tensors whose memory is not their values (:func:`check_plain`), are
    refused, typed."""
    if not isinstance(x, torch.Tensor):
        raise KVGroupsTypeError(f"objects: expected torch.Tensor objects, got {type(x).__name__}")
    if x.layout is not _STRIDED or x.is_nested or x.is_neg():
        check_plain(x, "objects")
    return DTYPE_NAMES.get(x.dtype, str(x.dtype)), tuple(x.shape), x.stride()


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype of a :class:`DType`."""
    try:
        return _TORCH_OF[dtype.name]
    except KeyError:
        raise KVGroupsTypeError(
            f"dtype: expected one of {sorted(_TORCH_OF)}, got {dtype.name}"
        ) from None


def is_abstract_tensor(x: torch.Tensor) -> bool:
    """A tensor without readable memory: a ``torch.compile`` fake (or its functional
    wrapper) or a meta tensor."""
    return x.device.type == "meta" or torch._subclasses.fake_tensor.is_fake(x)


def describe_tensor(x: torch.Tensor) -> TensorDesc:
    """Describe a torch tensor: shape, strides (elements), dtype, device, address.

    ``device`` is ``"cuda:N"`` for GPU tensors, ``"cuda_host"`` for pinned host tensors and
    ``"cpu"`` for pageable ones; ``obj`` is ``x`` itself (kept alive by the descriptor).
    Inside ``torch.compile`` (fake tensors) the descriptor is abstract: shape, dtype, strides
    and device, no pointer.
    """
    if not isinstance(x, torch.Tensor):
        raise KVGroupsTypeError(f"tensor: expected a torch.Tensor, got {type(x).__name__}")
    dtype = dtype_of(x)  # first: complex tensors (the only conjugate views) are refused here
    check_plain(x, "tensor")
    if is_abstract_tensor(x):
        spec = TensorSpec(
            tuple(int(n) for n in x.shape),
            dtype,
            tuple(int(n) for n in x.stride()),
            _device_name(x.device),
        )
        return TensorDesc(spec, 0, 0, x, "torch", abstract=True)
    source = x.detach()
    if x.dtype in _BYTE_VIEW:
        source = source.view(torch.uint8)
    desc = describe_dlpack(source, "torch")
    device = desc.spec.device
    if x.device.type == "cpu" and x.is_pinned():
        device = "cuda_host"
    spec = TensorSpec(desc.spec.shape, dtype, desc.spec.strides, device)
    return TensorDesc(spec, desc.data_ptr, desc.byte_offset, x, "torch")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else 0}"
    return device.type
