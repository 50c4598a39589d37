"""Tensor descriptors: what the core knows about a tensor, read without its framework.

A :class:`TensorSpec` is shape, strides, dtype and device: enough to plan (planning never needs
data, which is what makes it work on abstract values under ``jax.jit``). A :class:`TensorDesc`
adds where the bytes are and keeps the described object alive.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError

from .dtypes import DType, as_dtype, from_dlpack_code


def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a contiguous row-major array of ``shape``."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class TensorSpec:
    """A data-less tensor descriptor: ``shape``, ``dtype``, ``strides`` (in elements; ``None``
    means row-major) and ``device`` (``"cpu"``, ``"cuda:0"``, ``"cuda_host"`` ...).

    Hashable and comparable by value; ``strides=None`` and explicit row-major strides compare
    equal.
    """

    shape: tuple[int, ...]
    dtype: DType
    # The default None (row-major) never outlives __post_init__, which stores the strides.
    strides: tuple[int, ...] = None  # type: ignore[assignment]
    device: str = "cpu"

    if TYPE_CHECKING:
        # What the constructor accepts: __post_init__ turns it into the fields' types.
        def __init__(
            self,
            shape: Sequence[int],
            dtype: object,
            strides: Sequence[int] | None = None,
            device: str = "cpu",
        ) -> None: ...

    def __post_init__(self) -> None:
        try:
            shape = tuple(int(s) for s in self.shape)
        except TypeError:
            raise KVGroupsTypeError(
                f"shape: expected a sequence of ints, got {self.shape!r}"
            ) from None
        if any(s < 0 for s in shape):
            raise KVGroupsValueError(f"shape: expected non-negative sizes, got {shape}")
        strides = (
            row_major_strides(shape)
            if self.strides is None
            else tuple(int(s) for s in self.strides)
        )
        if len(strides) != len(shape):
            raise KVGroupsValueError(
                f"strides: expected {len(shape)} entries for shape {shape}, got {strides}"
            )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "strides", strides)
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        object.__setattr__(self, "device", str(self.device))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        """Row-major contiguous (size-1 axes may carry any stride)."""
        expected = row_major_strides(self.shape)
        return all(
            size <= 1 or stride == want
            for size, stride, want in zip(self.shape, self.strides, expected)
        )

    def extent_elems(self) -> int:
        """Elements from the first to one past the last addressed element (0 if empty)."""
        if self.numel == 0:
            return 0
        if any(s < 0 for s in self.strides):
            raise KVGroupsValueError(f"strides: expected non-negative strides, got {self.strides}")
        return 1 + sum((n - 1) * s for n, s in zip(self.shape, self.strides))


@dataclass(frozen=True, eq=False)
class TensorDesc:
    """A described tensor: its :class:`TensorSpec`, where its first element lives
    (``data_ptr + byte_offset``; both 0 for abstract values) and the object it came from.

    ``obj`` keeps the tensor alive as long as the descriptor is; ``framework`` names the
    runtime that owns it ("numpy", "torch", "jax", ... or "spec" for a bare spec).
    ``abstract`` says whether the value has a readable pointer: True for a tracer, a fake or
    meta tensor, False for a concrete array (even one described without a single pointer,
    such as a sharded array); None (the default) infers it, see :attr:`is_abstract`.
    ``placement`` is how a value spread over several devices is spread (JAX: its sharding), as
    an opaque hashable token of the backend's; None for a value on one device. The core only
    records it (:attr:`KVLayerGroupsManager.source_placements`), never reads it.
    """

    spec: TensorSpec
    data_ptr: int = 0
    byte_offset: int = 0
    obj: Any = field(default=None, repr=False)
    framework: str = "spec"
    abstract: bool | None = None
    placement: Any = field(default=None, repr=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.shape

    @property
    def strides(self) -> tuple[int, ...]:
        return self.spec.strides

    @property
    def dtype(self) -> DType:
        return self.spec.dtype

    @property
    def device(self) -> str:
        return self.spec.device

    @property
    def is_abstract(self) -> bool:
        """True when there are no bytes behind it: what the backend said (``abstract``), else
        a bare spec (a TensorSpec given as a cache) or a non-empty value described with no
        pointer. Planning never reads the pointer of an abstract desc."""
        if self.abstract is not None:
            return self.abstract
        return self.obj is None or (self.data_ptr == 0 and self.spec.nbytes > 0)

    @property
    def address(self) -> int:
        """Address of the first element."""
        return self.data_ptr + self.byte_offset

    def with_obj(self, obj: Any) -> "TensorDesc":
        """This descriptor of ``obj`` instead of :attr:`obj`, every other field kept (None: a
        descriptor that keeps nothing alive): see :func:`with_objs`."""
        return with_objs([self], [obj])[0]

    def view(self, spec: TensorSpec, extra_byte_offset: int = 0) -> "TensorDesc":
        """Another view of the same memory (the caller guarantees it stays in bounds)."""
        return TensorDesc(
            spec,
            self.data_ptr,
            self.byte_offset + extra_byte_offset,
            self.obj,
            self.framework,
            self.abstract,
            self.placement,
        )


def with_objs(descs: Any, objs: Any) -> list[TensorDesc]:
    """``[d.with_obj(x) for d, x in zip(descs, objs)]``, made without ``__init__``: for tensors
    let go of and taken back (the very same objects, nothing read from them again), which a
    prepared one-shot binding does for every bound tensor of a call."""
    new, put = object.__new__, object.__setattr__
    out = []
    for d, x in zip(descs, objs):
        fields = d.__dict__.copy()
        fields["obj"] = x
        made = new(TensorDesc)
        put(made, "__dict__", fields)
        out.append(made)
    return out


# --- generic DLPack reading -------------------------------------------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


# DLDeviceType values (dlpack.h) -> our device strings.
_DEVICE_NAMES = {
    1: "cpu",
    2: "cuda",
    3: "cuda_host",
    4: "opencl",
    7: "vulkan",
    8: "metal",
    10: "rocm",
    11: "rocm_host",
    13: "cuda_managed",
    14: "oneapi",
}


def device_name(device_type: int, device_id: int) -> str:
    """Our spelling of a DLPack device: ``cpu``, ``cuda:0``, ``cuda_host`` ..."""
    name = _DEVICE_NAMES.get(int(device_type), f"dlpack{int(device_type)}")
    if name in ("cpu", "cuda_host", "rocm_host"):
        return name
    return f"{name}:{int(device_id)}"


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def describe_dlpack(x: Any, framework: str = "dlpack") -> TensorDesc:
    """Describe any ``__dlpack__`` producer by reading its DLTensor, importing nothing.

    The capsule is left unconsumed, so its producer's deleter runs when it is dropped; ``x``
    itself is kept alive by the returned descriptor.
    """
    if not hasattr(x, "__dlpack__"):
        raise KVGroupsTypeError(
            f"tensor: expected an object with __dlpack__ or a TensorSpec, got {type(x).__name__}"
        )
    capsule = x.__dlpack__()
    address = _get_pointer(capsule, b"dltensor")
    # DLManagedTensor starts with its DLTensor.
    t = _DLTensor.from_address(address)
    ndim = int(t.ndim)
    shape = tuple(int(t.shape[i]) for i in range(ndim))
    if t.strides:
        strides = tuple(int(t.strides[i]) for i in range(ndim))
    else:
        strides = None
    dtype = from_dlpack_code(t.dtype.code, t.dtype.bits, t.dtype.lanes)
    device = device_name(t.device.device_type, t.device.device_id)
    spec = TensorSpec(shape, dtype, strides, device)
    desc = TensorDesc(spec, int(t.data or 0), int(t.byte_offset), x, framework)
    del capsule
    return desc


def describe_numpy(x: Any) -> TensorDesc:
    """Describe a NumPy array (any dtype, ml_dtypes' bfloat16 and float8 included)."""
    itemsize = x.dtype.itemsize
    if any(s % itemsize for s in x.strides):
        raise KVGroupsValueError(
            f"tensor strides: expected multiples of the itemsize {itemsize}, got {x.strides}"
        )
    spec = TensorSpec(x.shape, as_dtype(x.dtype), tuple(s // itemsize for s in x.strides), "cpu")
    ptr = int(x.__array_interface__["data"][0]) if x.size else 0
    return TensorDesc(spec, ptr, 0, x, "numpy")
