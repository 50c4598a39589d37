"""Torch tensors as core descriptors, read through DLPack without losing the dtype.

DLPack is the one path every framework shares, so the core reads torch tensors the same way
it reads any array. Types DLPack (or an older torch) cannot export, fp8 and bool, are read as
a uint8 view of the same width and strides, then given back their real :class:`DType`.
"""

from __future__ import annotations

import torch

from kvgroups_core.descriptors import TensorDesc, TensorSpec, describe_dlpack
from kvgroups_core.dtypes import DTYPE_MAP, DType
from kvgroups_core.errors import KVGroupsTypeError

_NAMES: dict[torch.dtype, str] = {
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
        _NAMES[getattr(torch, _name)] = _name

#: Exported as a same-width uint8 view: DLPack support for these varies across torch versions.
_BYTE_VIEW = {torch.float8_e4m3fn, torch.float8_e5m2, torch.bool}

_TORCH_OF: dict[str, torch.dtype] = {name: dt for dt, name in _NAMES.items()}


def dtype_of(t: torch.Tensor) -> DType:
    """The :class:`DType` of a torch tensor (``torch.float8_e4m3fn`` -> ``float8_e4m3fn``)."""
    name = _NAMES.get(t.dtype)
    if name is None:
        raise KVGroupsTypeError(
            f"tensor dtype: expected one of {sorted(_NAMES.values())}, got {t.dtype}"
        )
    return DTYPE_MAP[name]


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype of a :class:`DType`."""
    try:
        return _TORCH_OF[dtype.name]
    except KeyError:
        raise KVGroupsTypeError(
            f"dtype: expected one of {sorted(_TORCH_OF)}, got {dtype.name}"
        ) from None


def describe_tensor(x: torch.Tensor) -> TensorDesc:
    """Describe a torch tensor: shape, strides (elements), dtype, device, address.

    ``device`` is ``"cuda:N"`` for GPU tensors, ``"cuda_host"`` for pinned host tensors and
    ``"cpu"`` for pageable ones; ``obj`` is ``x`` itself (kept alive by the descriptor).
    """
    if not isinstance(x, torch.Tensor):
        raise KVGroupsTypeError(f"tensor: expected a torch.Tensor, got {type(x).__name__}")
    dtype = dtype_of(x)
    if x.device.type == "meta":
        # No memory behind it: abstract, enough to plan; transfers refuse it (validate_caches).
        return TensorDesc(TensorSpec(tuple(x.shape), dtype, tuple(x.stride()), "meta"), 0, 0,
                          x, "torch")
    source = x.detach()
    if x.dtype in _BYTE_VIEW:
        source = source.view(torch.uint8)
    desc = describe_dlpack(source, "torch")
    device = desc.spec.device
    if x.device.type == "cpu" and x.is_pinned():
        device = "cuda_host"
    spec = TensorSpec(desc.spec.shape, dtype, desc.spec.strides, device)
    return TensorDesc(spec, desc.data_ptr, desc.byte_offset, x, "torch")
