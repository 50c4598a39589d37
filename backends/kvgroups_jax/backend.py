"""The ``"jax"`` backend of the core registry.

Host cost matters here (a one-chunk transfer moves a few MiB: tens of microseconds of GPU
time), so the per-call path avoids descriptors and rereading what cannot have changed: a
prepared transfer's calls go through :class:`_BoundJax`, which checks the objects with a few
attribute compares and skips the in-place pointer bookkeeping once the caches are the
executor's own outputs.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError, UnsupportedConfigError
from kvgroups_core.tensors.descriptors import TensorDesc
from kvgroups_core.tensors.dtypes import as_dtype
from kvgroups_core.transfer.backend import Backend, BoundCaches
from kvgroups_core.transfer.checks import Memory
from kvgroups_core.transfer.objects import check_objects

from .describe import describe_array, memory_kind_of
from .executor import execute_plan, writes_every_byte
from .foreign import any_imported, check_in_place, import_dlpack
from .lowerings.choice import LOWERINGS
from .lowerings.tuning import DEFAULT_TUNING, LoweringTuning
from .sharded import (
    UnknownSharding,
    check_object_sharding,
    execute_sharded,
    local_binding,
    localize,
    shard_layout,
    sharding_of,
    vouched_shardings,
)

_PINNED = ("pinned", "pinned_host", "cuda_host")
_UINT8 = np.dtype(np.uint8)


class JaxBackend(Backend):
    """Moves pages of JAX arrays with Pallas kernels (plain XLA where no kernel applies).

    Parameters
    ----------
    lowering : "auto" (on CUDA GPUs Mosaic GPU for contiguous spans of >= 16 KiB on Hopper with
        jax >= 0.11, else Triton; on TPUs the Mosaic TPU DMA kernels; XLA beyond int32
        indexing and on CPU), or one of "cuda" (the torch backend's CUDA kernel launched by
        XLA; contiguous spans only), "triton", "mosaic", "xla", "interpret", "tpu" (the TPU
        DMA kernels: on a TPU, or traced and lowered for one), "tpu-interpret" (the same in
        TPU interpret mode, any platform) to force a path (register such an instance under
        its own name: there is no global switch; "jax-tpu" and "jax-tpu-interpret" are).
    num_warps : warps per Triton program.
    tuning : the lowerings' launch shapes (:class:`~kvgroups_jax.lowerings.tuning.LoweringTuning`;
        default the shipped one): part of every program's key, passed to the kernels.
    """

    name: ClassVar[str] = "jax"
    # Tracers (inside jax.jit, shard_map, vmap) are not jax.Array subclasses: named apart;
    # ShapeDtypeStructs describe abstractly (a manager built from shapes alone).
    array_types: ClassVar[tuple[str, ...]] = (
        "jax.Array",
        "jax.core.Tracer",
        "jax.ShapeDtypeStruct",
    )

    def __init__(
        self,
        lowering: str = "auto",
        num_warps: int | None = None,
        tuning: LoweringTuning | None = None,
    ):
        if lowering not in LOWERINGS:
            raise KVGroupsValueError(f"lowering: expected one of {LOWERINGS}, got {lowering!r}")
        if tuning is not None and not isinstance(tuning, LoweringTuning):
            raise KVGroupsTypeError(
                f"tuning: expected a LoweringTuning or None, got {type(tuning).__name__}"
            )
        self.lowering = lowering
        self.num_warps = num_warps
        self.tuning = tuning or DEFAULT_TUNING
        if lowering == "tpu-interpret":
            # Every new plan shape compiles an interpreted program for seconds on a CPU: the
            # conformance kit runs its small case set unless told otherwise.
            self.conformance_cases = "small"

    def describe(self, x: Any) -> TensorDesc:
        return describe_array(x)

    def shape_of(self, x: Any) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        # The per-call object check: a JAX array (always row-major) read without building a
        # descriptor, so an object of another dtype (bool, which no cache may have) is named
        # by the object rule as not uint8; anything else as the base class reads it.
        if type(x) is NewObject:
            return "uint8", x.shape, (x.shape[1], 1)
        if _concrete(x):
            shape = x.shape
            strides = [1] * len(shape)
            for i in range(len(shape) - 1, 0, -1):
                strides[i - 1] = strides[i] * max(shape[i], 1)
            return "uint8" if x.dtype == _UINT8 else x.dtype.name, shape, tuple(strides)
        return super().shape_of(x)

    def bind_caches(self, caches: Sequence[TensorDesc]) -> BoundCaches:
        self.validate_caches(caches)
        return _BoundJax(self, caches)

    #: No per-call fingerprint of bound caches (``kvgroups_core.transfer.checks.CacheGuard``): a JAX
    #: array never changes in place, and a deleted one fails at dispatch, before anything runs.
    buffer_keys = None

    def memory_of(self, x: Any, what: str = "array") -> Memory | None:
        """XLA's buffers never alias one another, so there is no range to check
        (``kvgroups_core.transfer.checks``); a deleted or donated array is refused here."""
        if _concrete(x) and x.is_deleted():
            raise KVGroupsValueError(
                f"{what}: expected a live array, got one already deleted or donated (a JAX "
                "load consumes the caches it is given: pass the arrays it returned)"
            )
        return None

    def validate_caches(self, caches: Sequence[TensorDesc]) -> None:
        """Live arrays in device memory, all on one device (several CPU devices are distinct
        devices), or all sharded over one mesh (checked by
        :func:`~kvgroups_jax.sharded.shard_layout`)."""
        devices: dict[Any, int] = {}
        sharded = False
        for i, c in enumerate(caches):
            x = c.obj if isinstance(c, TensorDesc) else c
            if not _concrete(x):
                continue
            self.memory_of(x, f"kv_caches (bound array {i})")
            kind = memory_kind_of(x)
            if kind not in (None, "device"):
                # The programs gather from the caches with index arrays in device memory, which
                # XLA refuses across memory spaces; only objects move to and from host memory.
                raise UnsupportedConfigError(
                    f"kv_caches (bound array {i}): expected an array in device memory "
                    f"(memory_kind 'device'), got memory_kind {kind!r} (objects may be in "
                    "pinned_host memory, caches may not)"
                )
            sharded = sharded or len(x.sharding.device_set) > 1
            for dev in x.devices():
                devices.setdefault(dev, i)
        if sharded:
            shard_layout([c.obj if isinstance(c, TensorDesc) else c for c in caches])
        elif len(devices) > 1:
            listed = ", ".join(f"{dev} (bound array {i})" for dev, i in devices.items())
            raise KVGroupsValueError(f"kv_caches: expected arrays on one device, got {listed}")

    def validate_objects(self, plan, caches: Sequence[TensorDesc], objects: Sequence[Any]) -> None:
        """Objects are live and on the caches' device (or in pinned_host memory)."""
        devices = set()
        for c in caches:
            x = c.obj if isinstance(c, TensorDesc) else c
            if _concrete(x):
                devices.update(x.devices())
        for k, obj in enumerate(objects):
            for part in obj if isinstance(obj, (list, tuple)) else [obj]:
                x = part.obj if isinstance(part, TensorDesc) else part
                if not _concrete(x):
                    continue
                self.memory_of(x, f"objects[{k}]")
                if memory_kind_of(x) == "pinned_host":
                    continue
                dev = set(x.devices())
                if devices and not dev <= devices:
                    raise KVGroupsValueError(
                        f"objects[{k}]: expected an array on {sorted(map(str, devices))} (the "
                        f"caches' device, or in pinned_host memory), got one on "
                        f"{sorted(map(str, dev))}"
                    )

    def execute(self, plan, caches: Sequence[TensorDesc], objects: Sequence[Any]):
        # Another runtime's tensors (torch, NumPy ...) are adopted through DLPack, zero-copy;
        # a CPU load into them is written back (see foreign.check_in_place).
        arrays = [c if _concrete(c) else _as_array(c) for c in caches]
        objs = [
            [_adopt(p) for p in o]
            if isinstance(o, (list, tuple))
            else None
            if type(o) is NewObject
            else o
            if _concrete(o)
            else _as_array(o)
            for o in objects
        ]
        if shard_layout(arrays) is not None:
            raise UnsupportedConfigError(
                "kv_caches: sharded caches are moved per shard through prepare(), store() or "
                "load() (which pass the manager); got a direct backend call"
            )
        # Per-chunk buffers are stacked into one [num_chunks, nbytes] array (a copy of the
        # objects, never of the caches) and split again for the result.
        chunked = [isinstance(o, (list, tuple)) for o in objs]
        objs = [
            jnp.stack([c.obj if isinstance(c, TensorDesc) else c for c in o]) if ch else o
            for o, ch in zip(objs, chunked)
        ]
        new_caches, new_objs = self._execute(plan, arrays, objs)
        new_objs = [list(n) if ch else n for n, ch in zip(new_objs, chunked)]
        if plan.direction == "load":
            new_objs = [orig if ch else n for orig, n, ch in zip(objects, new_objs, chunked)]
        return new_caches, new_objs

    def _execute(self, plan, arrays: list, objs: list):
        # Objects in pinned host memory are staged through device memory: kernels address
        # device memory only.
        if any(isinstance(x, jax.core.Tracer) for x in arrays + objs):
            return self._execute_traced(plan, arrays, objs)
        kinds = [memory_kind_of(o) for o in objs]
        if "pinned_host" not in kinds:
            return self._execute_plain(plan, arrays, objs)
        # A store that writes every byte of a pinned object needs no copy of its old bytes:
        # the kernel creates the device object (one trip over the link, not two); a layer
        # subset keeps the other regions, so those objects are copied in first.
        store = plan.direction == "store"
        staged = [
            (None if store and writes_every_byte(plan, g) else _to_device(o))
            if k == "pinned_host"
            else o
            for g, (o, k) in enumerate(zip(objs, kinds))
        ]
        before = _pointers(arrays) if plan.direction == "load" else []
        new_caches, new_objs = execute_plan(
            plan,
            arrays,
            staged,
            lowering=self.lowering,
            num_warps=self.num_warps,
            tuning=self.tuning,
        )
        new_objs = [
            jax.device_put(n, o.sharding)
            if k == "pinned_host" and plan.direction == "store"
            else (o if k == "pinned_host" else n)
            for n, o, k in zip(new_objs, objs, kinds)
        ]
        if plan.direction == "store":
            return None, list(new_objs)
        _check_in_place(plan, before, arrays, new_caches)
        return list(new_caches), list(new_objs)

    def _execute_traced(self, plan, arrays: list, objs: list):
        """Inside a JAX transformation: no buffers to compare, the caller's jit decides
        donation; the program is traced into the caller's. Objects in host memory (their
        abstract value says so) are staged through device memory as on the eager path."""
        hosted = [_in_host_memory(o) for o in objs]
        store = plan.direction == "store"
        staged = [
            (None if store and writes_every_byte(plan, g) else _device_space(o)) if h else o
            for g, (o, h) in enumerate(zip(objs, hosted))
        ]
        new_caches, new_objs = execute_plan(
            plan,
            arrays,
            staged,
            lowering=self.lowering,
            num_warps=self.num_warps,
            tuning=self.tuning,
        )
        if store:
            return None, [_host_space(n) if h else n for n, h in zip(new_objs, hosted)]
        return list(new_caches), [o if h else n for n, o, h in zip(new_objs, objs, hosted)]

    def _execute_plain(self, plan, arrays: list, objs: list, check: bool = True):
        """Objects in device memory. ``check=False``: the caches are known to be XLA's own
        buffers (outputs of an earlier load), which donation reuses in place."""
        load = plan.direction == "load"
        before = _pointers(arrays) if load and check else []
        new_caches, new_objs = execute_plan(
            plan, arrays, objs, lowering=self.lowering, num_warps=self.num_warps, tuning=self.tuning
        )
        if not load:
            return None, list(new_objs)
        if check:
            _check_in_place(plan, before, arrays, new_caches)
        return list(new_caches), list(new_objs)

    def allocate_objects(self, plan, like: TensorDesc, placement: str | None = None) -> list:
        x = like.obj if isinstance(like, TensorDesc) else like
        device = (
            next(iter(x.devices()))
            if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
            else jax.devices()[0]
        )
        kind = "pinned_host" if placement in _PINNED else None
        if placement is not None and placement not in _PINNED + ("device",):
            raise KVGroupsValueError(
                f"placement: expected None, 'device' or 'pinned_host', got {placement!r}"
            )
        sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=kind)
        return [_zeros((plan.num_chunks, n), sharding)() for n in plan.object_nbytes]

    def to_host_ids(self, ids: Any) -> Any:
        return np.asarray(ids)

    def device_ids_spec(self, x: Any) -> tuple[str, tuple[int, ...]] | None:
        """Traced ids (and a traced skip) stay where they are: planned from their dtype and
        shape, range-checked in the program (the kernels drop bad ids; checkify reports them).
        Concrete arrays are read to the host and checked eagerly, as before."""
        if isinstance(x, jax.core.Tracer):
            return str(x.dtype), tuple(int(s) for s in x.shape)
        return None

    # --- array plumbing for the demo, benchmarks and the conformance suite ---------------

    def from_numpy(self, a: Any, device: str | None = None, dtype: Any = None) -> Any:
        a = np.ascontiguousarray(a)
        sharding = _sharding_for(device or self.default_device())
        # may_alias=False: the CPU client would otherwise alias the NumPy buffer, which it
        # then copies instead of donating (loads would not be in place).
        x = jax.device_put(a, sharding, may_alias=False)
        # A buffer that came from the host can still be one the CPU client will not donate;
        # an XLA-computed copy is XLA's own, so later loads into it stay in place.
        x = _owned_copy(sharding)(x)
        if dtype is not None:
            target = jnp.dtype(as_dtype(dtype).name)
            if target.itemsize != a.dtype.itemsize:
                raise KVGroupsValueError(
                    f"dtype: expected a type of {a.dtype.itemsize} bytes like the array's "
                    f"{a.dtype}, got {target} ({target.itemsize} bytes)"
                )
            if target != x.dtype:
                x = jax.jit(
                    lambda v: jax.lax.bitcast_convert_type(v, target), out_shardings=sharding
                )(x)
        return x

    def to_numpy(self, x: Any) -> Any:
        out = np.asarray(jax.device_get(x))
        if out.dtype.kind not in "biuf" or out.dtype.name.startswith(("bfloat", "float8")):
            out = out.view(f"uint{out.dtype.itemsize * 8}")
        return out

    def import_foreign(self, x: Any) -> Any:
        """Adopt another runtime's array through DLPack (zero-copy), except that host memory
        is copied to the GPU when JAX computes on one: its kernels address device memory."""
        arr = import_dlpack(x)
        if self.default_device() == "cuda" and next(iter(arr.devices())).platform == "cpu":
            arr = jax.device_put(arr, _sharding_for("cuda"))
        return arr

    def default_device(self) -> str:
        return "cuda" if jax.default_backend() == "gpu" else "cpu"

    def synchronize(self, x: Any = None) -> None:
        if x is None:
            for d in jax.live_arrays():
                d.block_until_ready()
        else:
            jax.block_until_ready(x)


class _BoundJax(BoundCaches):
    """A prepared transfer's hold on its caches (see the module docs).

    The fast path needs every bound cache to be a concrete JAX array in device memory on one
    device (no DLPack import) and a call's objects to be uint8 ``[num_chunks, nbytes]`` arrays
    with that same sharding: then the generic checks could not fail, and are skipped. After a
    load the bound arrays are replaced by the results (:meth:`adopt_results`), so the binding
    survives loads without re-reading 32 layouts.
    """

    def __init__(self, backend: "JaxBackend", caches: Sequence[TensorDesc]) -> None:
        super().__init__(backend, caches)
        self.backend: JaxBackend = backend
        self._arrays = [c.obj if isinstance(c, TensorDesc) else c for c in caches]
        self._sharding = _plain_sharding(self._arrays)
        self._owned = False  # the arrays are outputs of our own load
        # Caches sharded over a mesh: refused here (before anything is donated) unless every
        # shard can move its own pages; the shard binding needs the manager (bind_source),
        # and so do tracers whose sharding only the manager knows (an Auto-axes mesh).
        self._unknown = self._sharding is None and any(
            isinstance(sharding_of(x), UnknownSharding) for x in self._arrays
        )
        self._shards = (
            shard_layout(self._arrays) if self._sharding is None and not self._unknown else None
        )
        self._shard_binding = None
        self._all_concrete = self._sharding is not None or all(map(_concrete, self._arrays))

    def bind_source(self, manager, kv_caches) -> None:
        if self._unknown:
            self._shards = shard_layout(self._arrays, vouched_shardings(manager, kv_caches))
        if self._shards is not None:
            self._shard_binding = local_binding(manager, kv_caches, self._arrays, self._shards)

    @property
    def caches(self) -> list:
        if self._descs is None:  # read after adopt_results: describe the current arrays
            self._descs = [describe_array(x) for x in self._arrays]
        return self._descs

    @caches.setter
    def caches(self, value: Sequence[Any]) -> None:
        self._descs = list(value)

    def execute(self, plan, objects: Sequence[Any]) -> tuple[list | None, list]:
        if self._shards is not None:
            return self._execute_sharded(plan, objects)
        if self._sharding is not None and self._plain_objects(plan, objects):
            objs = [None if type(o) is NewObject else o for o in objects]
            return self.backend._execute_plain(plan, self._arrays, objs, check=not self._owned)
        return super().execute(plan, objects)

    def _execute_sharded(self, plan, objects: Sequence[Any]) -> tuple[list | None, list]:
        if self._shard_binding is None:
            raise UnsupportedConfigError(
                "kv_caches: sharded caches are moved per shard through prepare(), store() or "
                "load() (which pass the manager); got a direct backend call"
            )
        check_objects(plan, objects, self.backend.shape_of)
        objs = [None if type(o) is NewObject else o for o in objects]
        check_object_sharding(self._shards, objs, plan)
        local = localize(plan, self._shard_binding)
        return execute_sharded(
            self._shards,
            local,
            self._arrays,
            objs,
            lowering=self.backend.lowering,
            num_warps=self.backend.num_warps,
            tuning=self.backend.tuning,
        )

    def _plain_objects(self, plan, objects: Sequence[Any]) -> bool:
        nbytes = plan.object_nbytes
        if not isinstance(objects, (list, tuple)) or len(objects) != len(nbytes):
            return False
        rows, sharding = plan.num_chunks, self._sharding
        for obj, n in zip(objects, nbytes):
            if type(obj) is NewObject:
                if obj.shape != (rows, n):
                    return False
                continue
            if not (
                _concrete(obj)
                and obj.dtype == _UINT8
                and obj.shape == (rows, n)
                and obj.sharding == sharding
            ):
                return False
        return True

    def adopt_results(self, new_caches: Sequence[Any]) -> bool:
        self._all_concrete = all(map(_concrete, new_caches))  # not inside a transformation
        if self._shards is not None:  # same global shapes and shardings: the binding holds
            self._arrays = list(new_caches)
            self._descs = None
            return True
        if self._sharding is None:
            return False  # foreign or unusual caches: let the core bind the results afresh
        self._arrays = list(new_caches)
        self._descs = None
        self._owned = True
        return True

    def release(self) -> bool:
        # Only the arrays are let go of: the sharding, the shard binding (shapes only) and
        # whether the arrays are our own load's outputs stay true for the same arrays.
        if not self._all_concrete:
            return False  # traced (a load's results inside a transformation): never kept
        if self._shard_binding is not None and any(
            d.obj is not None for d in self._shard_binding.tensors
        ):
            return False
        self._arrays = self._descs = None
        return True

    def restore(self, tensors: Sequence[Any]) -> None:
        self._arrays = list(tensors)

    def allocate_objects(self, plan) -> list:
        # The store's own program creates the objects (the kernels' outputs): allocating and
        # zero-filling them first costs a fill pass and a separate program per call.
        if not plan.num_chunks:  # nothing runs: the empty objects themselves
            return [jnp.zeros((0, n), jnp.uint8) for n in plan.object_nbytes]
        return [NewObject((plan.num_chunks, n)) for n in plan.object_nbytes]


class NewObject:
    """An object a store is to create (``store`` without ``objects``): its shape, no buffer.

    The executor makes it the kernel's output, so the returned objects are new arrays that no
    zero-filled buffer preceded."""

    __slots__ = ("shape",)
    dtype = _UINT8

    def __init__(self, shape: tuple[int, int]) -> None:
        self.shape = shape

    def __repr__(self) -> str:
        return f"NewObject({self.shape})"


_CONCRETE: dict[type, bool] = {}


def _concrete(x: Any) -> bool:
    """A concrete ``jax.Array`` (not a tracer): one dict lookup per call."""
    t = type(x)
    hit = _CONCRETE.get(t)
    if hit is None:
        hit = _CONCRETE[t] = issubclass(t, jax.Array) and not issubclass(t, jax.core.Tracer)
    return hit


def _as_array(c: Any) -> Any:
    return _adopt(c.obj if isinstance(c, TensorDesc) else c)


def _plain_sharding(arrays: list) -> Any:
    """The one device-memory sharding of ``arrays`` when they qualify for the fast path."""
    if not arrays or not all(_concrete(x) and not x.is_deleted() for x in arrays):
        return None
    sharding = arrays[0].sharding
    if not isinstance(sharding, jax.sharding.SingleDeviceSharding) or sharding.memory_kind not in (
        None,
        "device",
    ):
        return None
    if any(x.sharding != sharding for x in arrays):
        return None
    if any_imported(_pointers(arrays)):
        return None  # DLPack imports: loads may need writing back (foreign.check_in_place)
    return sharding


def _pointers(arrays: list) -> list[int]:
    """Buffer pointers before a load; 0 where :func:`check_in_place` has nothing to compare."""
    try:
        return [x.unsafe_buffer_pointer() for x in arrays]
    except Exception:  # traced, deleted or sharded values: one by one
        return [_pointer(x) for x in arrays]


def _check_in_place(plan, before: list[int], arrays: list, new_caches) -> None:
    """:func:`check_in_place`, after a cheap test for its common outcome: no DLPack import
    involved and every result in its input's buffer, when it has nothing to do."""
    if not any_imported(before):
        try:
            if [y.unsafe_buffer_pointer() for y in new_caches] == before:
                return
        except Exception:  # traced results: the full check sorts them out
            pass
    # As _pointer reads them (0: skipped); the inputs are donated by now, their metadata stays.
    before = [
        p if _concrete(x) and x.size and len(x.sharding.device_set) == 1 else 0
        for p, x in zip(before, arrays)
    ]
    check_in_place(plan, before, arrays, list(new_caches))


def _adopt(x: Any) -> Any:
    if isinstance(x, jax.Array) or not hasattr(x, "__dlpack__"):
        return x
    return import_dlpack(x)


@functools.lru_cache(maxsize=64)
def _zeros(shape: tuple[int, int], sharding: Any) -> Any:
    return jax.jit(lambda: jnp.zeros(shape, jnp.uint8), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _owned_copy(sharding: Any) -> Any:
    return jax.jit(lambda v: jnp.copy(v), out_shardings=sharding)


def _pointer(x: Any) -> int:
    if (
        isinstance(x, jax.Array)
        and not isinstance(x, jax.core.Tracer)
        and x.size
        and len(x.devices()) == 1
        and not x.is_deleted()
    ):
        return int(x.unsafe_buffer_pointer())
    return 0


def _sharding_for(device: str):
    """A single-device sharding for our device spelling (``"cuda:1"``, ``"pinned"`` ...)."""
    name, _, index = str(device).partition(":")
    pinned = name in _PINNED
    if name in ("cuda", "gpu") or pinned:
        devs = jax.devices("gpu") if jax.default_backend() == "gpu" else []
        if not devs:
            if pinned:
                devs = jax.devices("cpu")
            else:
                raise KVGroupsValueError(f"device: expected 'cpu' (no GPU visible), got {device!r}")
    elif name == "cpu":
        devs = jax.devices("cpu")
    else:
        raise KVGroupsValueError(f"device: expected 'cpu', 'cuda[:N]' or 'pinned', got {device!r}")
    dev = devs[int(index) if index else 0]
    kind = "pinned_host" if pinned and dev.platform != "cpu" else None
    return jax.sharding.SingleDeviceSharding(dev, memory_kind=kind)


def _in_host_memory(x: Any) -> bool:
    """Whether ``x`` lives in host memory: a pinned_host array, or a tracer whose abstract
    value is in the host memory space (a pinned_host argument of the caller's jit)."""
    if x is None:
        return False
    if isinstance(x, jax.core.Tracer):
        space = getattr(getattr(jax, "memory", None), "Space", None)
        return space is not None and getattr(jax.typeof(x), "memory_space", None) == space.Host
    return memory_kind_of(x) == "pinned_host"


def _device_space(x: Any) -> Any:
    return (
        jax.device_put(x, jax.memory.Space.Device)
        if isinstance(x, jax.core.Tracer)
        else _to_device(x)
    )


def _host_space(x: Any) -> Any:
    return jax.device_put(x, jax.memory.Space.Host)


def _to_device(x: jax.Array) -> jax.Array:
    device = next(iter(x.devices()))
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(device, memory_kind="device"))
