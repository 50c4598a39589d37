"""The ``"torch"`` backend of the core registry (``kvgroups_core.tensors.arrays``)."""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import numpy as np
import torch

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError, UnsupportedConfigError
from kvgroups_core.tensors.descriptors import TensorDesc
from kvgroups_core.tensors.dtypes import as_dtype
from kvgroups_core.transfer.backend import Backend, BoundCaches
from kvgroups_core.transfer.checks import Memory

from . import cpu as cpu_copy
from .compile import dynamo as compiled
from .copy_engine import batch as copy_engine
from .cuda import device as cuda_device
from .cuda import execute as cuda_execute
from .cuda import objects as cuda_objects
from .cuda import repeat as cuda_repeat
from .describe import DTYPE_NAMES, check_plain, describe_tensor, shape_of, torch_dtype
from .fingerprints import fingerprints, same_fingerprints
from .objects import allocate_objects

_NUMPY_NATIVE = (
    "float16",
    "float32",
    "float64",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "bool",
)

#: How pinned host objects are reached by default; chosen by measurement (see
#: docs/PERFORMANCE.md): "direct" (kernel through UVA) or "staged".
DEFAULT_PINNED_MODE = "staged"


def tensor_of(x: Any, what: str) -> torch.Tensor:
    """The torch tensor behind a TensorDesc (or the tensor itself). Another runtime's array
    (JAX, NumPy, CuPy ...) is adopted through DLPack, zero-copy: the torch backend then moves
    the pages of that runtime's memory in place."""
    t = x.obj if isinstance(x, TensorDesc) else x
    if isinstance(t, torch.Tensor):
        return t
    if hasattr(t, "__dlpack__"):
        return torch.from_dlpack(t)
    raise KVGroupsTypeError(
        f"{what}: expected a torch.Tensor or a DLPack producer, got {type(t).__name__}"
    )


def _adopt_objects(objects: Sequence[Any]) -> list:
    """Objects as torch tensors (foreign ones adopted zero-copy through DLPack)."""
    out = []
    for g, entry in enumerate(objects):
        if isinstance(entry, (list, tuple)):
            out.append([tensor_of(t, f"objects[{g}][{c}]") for c, t in enumerate(entry)])
        else:
            out.append(tensor_of(entry, f"objects[{g}]"))
    return out


def _leaf_tensors(objects: Sequence[Any]) -> list:
    out = []
    for entry in objects:
        out.extend(entry if isinstance(entry, (list, tuple)) else [entry])
    return out


def cache_device(caches: Sequence[Any]) -> torch.device:
    """The one device of the backing tensors."""
    if not caches:
        raise KVGroupsValueError("caches: expected at least one backing tensor, got none")
    first = tensor_of(caches[0], "caches[0]").device
    return first


class TorchBackend(Backend):
    """PyTorch: CUDA kernels (NVRTC) for GPU caches, indexing ops for CPU caches.

    Parameters
    ----------
    pinned : {"direct", "staged"}
        How the kernels reach objects in pinned host memory (see :func:`cuda_execute.execute_plan`).
    """

    name: ClassVar[str] = "torch"
    array_types: ClassVar[tuple[str, ...]] = ("torch.Tensor",)
    #: "kernel": the page-copy kernels; "copy_engine": one batch of DMA copies
    #: (``cuMemcpyBatchAsync``, host ids only); "auto": by the table of
    #: :mod:`kvgroups_torch.copy_engine.paths` (the kernel until one is measured).
    transfer_paths: ClassVar[tuple[str, ...]] = ("auto", "kernel", "copy_engine")

    def __init__(self, pinned: str = DEFAULT_PINNED_MODE) -> None:
        if pinned not in ("direct", "staged"):
            raise KVGroupsValueError(f"pinned: expected 'direct' or 'staged', got {pinned!r}")
        self.pinned = pinned

    def describe(self, x: Any) -> TensorDesc:
        return describe_tensor(x)

    def shape_of(self, x: Any) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        return shape_of(tensor_of(x, "objects"))

    def execute(
        self, plan: Any, caches: Sequence[TensorDesc], objects: Sequence[Any]
    ) -> tuple[list | None, list]:
        """Move the bytes of ``plan``; caches (load) or objects (store) are written in place.
        Inside a ``torch.compile`` trace, record the transfer as a custom op instead."""
        device = cache_device(caches)
        given = objects
        objects = _adopt_objects(objects)
        tensors = [tensor_of(c, f"caches[{i}]") for i, c in enumerate(caches)]
        if plan.path == "copy_engine":
            if device.type != "cuda":
                raise UnsupportedConfigError(
                    "path: expected 'auto' or 'kernel' for CPU caches ('copy_engine' needs a "
                    "CUDA GPU), got 'copy_engine'"
                )
            copy_engine.refuse_device_ids(plan)
        if compiled.any_traced(tensors[:1] + _leaf_tensors(objects)):
            compiled.record(plan, tensors, objects, self.pinned)
            return None, list(given)
        if device.type == "cuda":
            cuda_execute.execute_checked_plan(
                plan, caches, objects, device.index, pinned=self.pinned
            )
        elif device.type == "cpu":
            cpu_copy.execute_plan(compiled.host_plan(plan), tensors, objects)
        else:
            raise UnsupportedConfigError(f"caches: expected CPU or CUDA tensors, got {device}")
        return None, list(given)

    def bind_caches(self, caches: Sequence[TensorDesc]) -> BoundCaches:
        self.validate_caches(caches)
        return TorchBoundCaches(self, caches)

    def buffer_keys(self, xs: list) -> list:
        """What a prepared transfer compares per call to notice a cache changed in place
        (``resize_``, ``set_``, ``.data =``, ``as_strided_``, ``requires_grad_``): each bound
        tensor's address, shape, strides, dtype and ``requires_grad``
        (:mod:`kvgroups_torch.fingerprints`)."""
        return fingerprints(xs)

    #: ``buffer_keys_match(xs, keys)``: whether ``xs`` still have the fingerprints ``keys``
    #: (the per-call check; a plain function, one call frame less on the hot path).
    buffer_keys_match = staticmethod(same_fingerprints)

    def memory_of(self, x: Any, what: str = "tensor") -> Memory | None:
        """Where a tensor's bytes are (``kvgroups_core.transfer.checks``); tensors a transfer cannot
        use (meta, autograd, not plain strided memory) are refused here, before any byte moves."""
        if not isinstance(x, torch.Tensor):
            return None
        # One gate for the refusals (about 0.2 us per object of a call the core has not
        # memoised): the first read of an object, before data_ptr() fails on a sparse one.
        if x.requires_grad or x.is_meta or x.layout is not _STRIDED or x.is_nested or x.is_neg():
            _check_usable(x, what)
        if type(x) is not torch.Tensor and torch._subclasses.fake_tensor.is_fake(x):
            return None  # torch.compile's fakes: no memory to judge (planning only)
        shape, strides, e = x.shape, x.stride(), x.element_size()
        # Pageable host memory may be a read-only mapping (checked against the page tables,
        # not cheap); pinned memory is CUDA's own allocation, writable, and on the hot path.
        host = not x.is_cuda and not x.is_pinned()
        if len(shape) == 2:  # objects, the per-call case: no generic loop
            rows, cols = shape
            if not rows or not cols:
                return Memory(x.data_ptr(), 0, True, host)
            return Memory(
                x.data_ptr(),
                (1 + (rows - 1) * strides[0] + (cols - 1) * strides[1]) * e,
                True,
                host,
                rows,
                strides[0] * e,
                cols * e,
            )
        if 0 in shape:
            return Memory(x.data_ptr(), 0, True, host)
        extent = (1 + sum((n - 1) * s for n, s in zip(shape, strides))) * e
        return Memory(x.data_ptr(), extent, True, host)

    def validate_caches(self, caches: Sequence[Any]) -> None:
        """Every backing tensor is a torch tensor on one device, with memory and no autograd."""
        for i, c in enumerate(caches):
            t = c.obj if isinstance(c, TensorDesc) else c  # descriptors or the tensors
            if isinstance(t, torch.Tensor):
                _check_usable(t, f"kv_caches (bound tensor {i})")
        device = cache_device(caches)
        for i, c in enumerate(caches):
            if tensor_of(c, f"caches[{i}]").device != device:
                raise KVGroupsValueError(
                    f"caches[{i}]: expected a tensor on {device}, got {tensor_of(c, '').device}"
                )

    def validate_objects(
        self, plan: Any, caches: Sequence[TensorDesc], objects: Sequence[Any]
    ) -> None:
        """Memory kinds, before any byte moves: GPU caches take objects on the same GPU or in
        pinned host memory; CPU caches take CPU objects."""
        device = tensor_of(caches[0], "caches[0]").device
        for g, entry in enumerate(objects):
            for c, t in enumerate(entry if isinstance(entry, (list, tuple)) else [entry]):
                what = f"objects[{g}][{c}]" if isinstance(entry, (list, tuple)) else f"objects[{g}]"
                t = tensor_of(t, what)
                if device.type == "cuda":
                    if compiled.any_traced([t]):
                        continue  # a fake: its memory kind is checked when the op runs
                    cuda_objects.check_object_placement(t, device.index, what)
                elif t.device.type != "cpu":
                    raise KVGroupsValueError(
                        f"{what}: expected a CPU tensor for CPU caches, got {t.device}"
                    )

    def allocate_objects(self, plan: Any, like: TensorDesc, placement: str | None = None) -> list:
        device = tensor_of(like, "like").device
        return allocate_objects(plan.object_nbytes, plan.num_chunks, device, placement)

    # Array plumbing the core's demo, benchmarks and conformance suite use.
    def from_numpy(self, a: Any, device: str | None = None, dtype: Any = None) -> torch.Tensor:
        """A new tensor holding ``a``'s bytes on ``device``; with ``dtype``, ``a`` holds raw
        bits of that dtype (bfloat16 / float8 travel as same-width unsigned integers)."""
        arr = np.ascontiguousarray(a)
        if dtype is not None:
            target = torch_dtype(as_dtype(dtype))
            bits = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[arr.dtype.itemsize]
            t = torch.from_numpy(arr.view(bits).copy()).view(target)
        elif arr.dtype.kind == "V" or arr.dtype.name not in _NUMPY_NATIVE:
            t = torch.from_numpy(arr.view(f"u{arr.dtype.itemsize}").copy())
        else:
            t = torch.from_numpy(arr.copy())
        return t.to(device or self.default_device())

    def to_numpy(self, x: Any) -> np.ndarray:
        """A bit-exact host copy (bfloat16 / float8 as same-width unsigned integers)."""
        t = tensor_of(x, "x").detach().to("cpu").contiguous()
        if t.dtype.is_floating_point and t.dtype not in (
            torch.float16,
            torch.float32,
            torch.float64,
        ):
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
            return t.view(bits).numpy().view(f"u{t.element_size()}")
        return t.numpy()

    def import_foreign(self, x: Any) -> torch.Tensor:
        """Adopt another runtime's array through DLPack (zero-copy), except that host arrays
        are copied into pinned memory when CUDA is usable: the kernels only reach pinned
        host memory."""
        t = torch.from_dlpack(x)
        if t.device.type == "cpu" and torch.cuda.is_available() and not t.is_pinned():
            t = t.pin_memory()
        return t

    def default_device(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    def synchronize(self, x: Any = None) -> None:
        """Wait for queued work, then raise what the kernels recorded about device-side ids
        (:func:`cuda_device.check_errors`: a synchronising call checks them anyway)."""
        if not torch.cuda.is_available():
            return
        if isinstance(x, torch.Tensor):
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
                cuda_device.check_errors(x.device)
            return
        torch.cuda.synchronize()
        cuda_device.check_errors()

    def to_host_ids(self, ids: Any) -> Any:
        if isinstance(ids, torch.Tensor):
            _check_host_ids(ids)
            return ids.detach().numpy()  # CPU tensors only: CUDA ids are device ids
        return ids

    def device_ids_spec(self, x: Any) -> tuple[str, tuple[int, ...]] | None:
        """CUDA tensors stay on the GPU (the kernels read and range-check them there) and
        fake tensors of a ``torch.compile`` trace have no values: both are device ids. CPU
        tensors are host ids (read and checked eagerly)."""
        if not isinstance(x, torch.Tensor):
            return None
        traced = compiled.is_traced(x)  # not is_compiling(): unset in Dynamo's fake runs
        if not traced:
            if not x.is_cuda or x.layout is not torch.strided or x.is_nested or x.is_quantized:
                return None  # eager host ids (to_host_ids names what is wrong with others)
            return DTYPE_NAMES.get(x.dtype, str(x.dtype)), tuple(x.shape)  # eager: plain ints
        return DTYPE_NAMES.get(x.dtype, str(x.dtype)), tuple(int(n) for n in x.shape)

    def device_ids_key(self, x: Any) -> Any:
        """Eager CUDA id tensors: dtype, shape, GPU and contiguity (what the planner and the
        launch read of them; their values are the kernel's to check)."""
        if type(x) is torch.Tensor and x.is_cuda and not _IS_FUNCTIONAL(x):
            return x.dtype, x.shape, x.get_device(), x.is_contiguous()
        return None

    def objects_key(self, objects: Sequence[Any]) -> tuple | None:
        """``(identity, address, dtype, shape, strides)`` of each plain eager tensor (their
        device follows from the address); None for anything else (per-chunk lists, foreign
        arrays, fakes)."""
        try:
            out = []
            for t in objects:
                if type(t) is not torch.Tensor:
                    return None
                out.append((id(t), t.data_ptr(), t.dtype, t.shape, t.stride()))
            return tuple(out)
        except RuntimeError:  # no storage (functional wrappers): not remembered
            return None


_DATA_PTR = torch.Tensor.data_ptr
_STRIDED = torch.strided
_IS_FUNCTIONAL = torch._is_functional_tensor


def _check_host_ids(ids: torch.Tensor) -> None:
    """Host id tensors NumPy can read: strided, with memory on the CPU, of an integer dtype
    (the core then checks values and rank). What torch itself would refuse is named here."""
    if ids.is_nested:
        raise KVGroupsTypeError("expected a 1-D tensor of ints, got a nested tensor")
    if ids.layout is not torch.strided:
        raise KVGroupsTypeError(
            f"expected a dense (strided) tensor of ints, got layout {ids.layout}"
        )
    if ids.is_quantized:
        raise KVGroupsTypeError(f"expected a tensor of ints, got quantized {ids.dtype}")
    if ids.is_meta:
        raise KVGroupsTypeError("expected a tensor with memory, got a meta tensor")
    if ids.device.type != "cpu":
        raise KVGroupsTypeError(
            f"expected ids on the CPU or int32/int64 ids on the caches' GPU, got {ids.dtype} "
            f"on {ids.device}"
        )
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype is torch.bool:
        raise KVGroupsTypeError(
            f"expected integer block ids, got a tensor of {ids.dtype} (shape {tuple(ids.shape)})"
        )


def _check_usable(t: torch.Tensor, what: str) -> None:
    check_plain(t, what)
    if t.device.type == "meta":
        raise KVGroupsValueError(f"{what}: expected a tensor with memory, got a meta tensor")
    if t.requires_grad:
        raise KVGroupsValueError(
            f"{what}: expected a tensor outside autograd (requires_grad=False), got one that "
            "requires grad; pass tensor.detach()"
        )


class TorchBoundCaches(BoundCaches):
    """The prepared path of :class:`TorchBackend`: for CUDA caches, calls whose objects are
    plain ``[num_chunks, nbytes]`` uint8 tensors on the caches' GPU (the hot case) go through
    :class:`cuda_execute.DeviceCaches`, which keeps the per-cache launch state; every other call
    takes the generic checks and :meth:`TorchBackend.execute`."""

    def __init__(self, backend: TorchBackend, caches: Sequence[TensorDesc]) -> None:
        super().__init__(backend, caches)
        device = cache_device(self.caches)
        traced = any(getattr(c, "is_abstract", False) for c in self.caches)
        self.device_caches = (
            cuda_execute.DeviceCaches(self.caches, device.index)
            if device.type == "cuda" and not traced
            else None
        )

    def release(self) -> bool:
        # The launch state keeps addresses only (the guard checks them per call).
        self._release_caches()
        return True

    def execute(self, plan: Any, objects: Sequence[Any]) -> tuple[list | None, list]:
        fast = self.device_caches
        if fast is not None:
            addresses = fast.device_object_addresses(plan, objects)
            if addresses is not None:
                fast.execute(plan, addresses)
                return None, list(objects)
        return super().execute(plan, objects)

    def repeater(self, plan: Any, block_ids: Any) -> Any:
        """CUDA caches: the plan's launches kept ready (:class:`cuda_repeat.PlanRepeater`), for
        objects on the caches' GPU; other objects (pinned host) take :meth:`execute`."""
        generic = super().repeater(plan, block_ids)
        fast = self.device_caches
        if fast is None:
            return generic
        if getattr(plan, "path", "kernel") != "kernel" and copy_engine.copy_groups(
            plan, fast.index
        ):
            return generic  # the copy engines take (part of) it: their path decides per call
        return cuda_repeat.PlanRepeater(fast, plan, block_ids, generic)
