"""Backends: the protocol, the registry, and finding a tensor's framework without importing it.

A framework is recognised the einops / array-api-compat way: only if its module is already in
``sys.modules`` (the user imported it, so it costs nothing) is its array class looked up and
``issubclass`` checked; the answer is cached per type. The backend package itself is imported
only then, on first use.

Built-in entries (loaded lazily):

- ``"numpy"``: :class:`kvgroups_core.reference.NumpyBackend` for ``numpy.ndarray``
- ``"torch"``: ``kvgroups_torch:TorchBackend`` for ``torch.Tensor``
- ``"jax"``: ``kvgroups_jax:JaxBackend`` for ``jax.Array`` and JAX tracers
  (``jax.core.Tracer``: values inside ``jax.jit`` / ``shard_map`` / ``vmap``)

:func:`describe` lives here (not in ``descriptors``) because it asks the array's backend:
descriptors stay a leaf module and nothing imports in a circle.

Third-party backends call :func:`register_backend`, or declare an entry point in the group
``kvgroups.backends`` whose value is a :class:`Backend` subclass or instance (its ``name`` and
``array_types`` attributes say what it handles).
"""

from __future__ import annotations

import abc
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

from .descriptors import TensorDesc, TensorSpec, describe_dlpack
from .errors import BackendNotFound, KVGroupsTypeError, UnsupportedConfig
from .objects import check_objects
from .plan import with_block_ids


class Backend(abc.ABC):
    """What a runtime implements to move pages for the core.

    Subclasses set ``name`` and ``array_types`` (qualified class names such as
    ``"torch.Tensor"``) and implement :meth:`execute` and :meth:`allocate_objects`.
    """

    name: ClassVar[str] = ""
    array_types: ClassVar[tuple[str, ...]] = ()
    #: The ``path=`` values the transfer calls accept for this backend ("auto" first).
    transfer_paths: ClassVar[tuple[str, ...]] = ("auto", "kernel")

    def describe(self, x: Any) -> TensorDesc:
        """Describe one of this framework's arrays (default: read DLPack)."""
        return describe_dlpack(x, self.name)

    @abc.abstractmethod
    def execute(
        self, plan: Any, caches: Sequence[TensorDesc], objects: Sequence[Any]
    ) -> tuple[list | None, list]:
        """Run a :class:`~kvgroups_core.plan.TransferPlan`.

        ``caches`` are the backing tensors in ``plan.tensor_specs`` order; ``objects`` one
        entry per object group (a ``[num_chunks, object_nbytes]`` uint8 array, or a list of
        ``num_chunks`` 1-D uint8 buffers). Everything was validated by the core. Returns the
        new cache arrays in slot order (``None`` when written in place) and the objects
        (new arrays for immutable runtimes, the same ones otherwise).
        """

    @abc.abstractmethod
    def allocate_objects(
        self, plan: Any, like: TensorDesc, placement: str | None = None
    ) -> list:
        """Allocate one ``[num_chunks, object_nbytes]`` uint8 array per object group, on the
        device of ``like`` (or ``placement``: e.g. ``"pinned"`` for pinned host memory)."""

    def bind_caches(self, caches: Sequence[TensorDesc]) -> "BoundCaches":
        """Validate the backing tensors of one binding (slot order) and return what runs the
        per-call work on them (:class:`BoundCaches`). Backends whose calls repeat host work
        that depends only on the caches (devices, addresses, launch state) return a subclass
        that keeps it."""
        self.validate_caches(caches)
        return BoundCaches(self, caches)

    def validate(self, plan: Any, caches: Sequence[TensorDesc], objects: Sequence[Any]) -> None:
        """Backend-specific checks run before any byte moves: both halves below."""
        self.validate_caches(caches)
        self.validate_objects(plan, caches, objects)

    def validate_caches(self, caches: Sequence[TensorDesc]) -> None:
        """Checks of the bound caches alone (devices, memory kinds); run once per binding."""
        return None

    def validate_objects(self, plan: Any, caches: Sequence[TensorDesc],
                         objects: Sequence[Any]) -> None:
        """Checks of one call's objects against the (already validated) caches."""
        return None

    def shape_of(self, x: Any) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        """``(dtype name, shape, element strides)`` of an array: the cheap subset of
        :meth:`describe` that per-call object checks need (backends override it for speed)."""
        spec = self.describe(x).spec
        return spec.dtype.name, spec.shape, spec.strides

    def to_host_ids(self, ids: Any) -> Any:
        """Block ids held by this framework as a NumPy-convertible object (may synchronise).
        Only called for ids :meth:`device_ids_spec` calls host."""
        return ids

    def device_ids_spec(self, x: Any) -> tuple[str, tuple[int, ...]] | None:
        """``(dtype name, shape)`` when ``x`` is an id array (or a skip scalar) this backend
        keeps where it is: device-resident (torch CUDA tensors, FakeTensors) or traced (JAX
        tracers). The planner then checks only those static facts and hands ``x`` itself to
        the backend (``TransferPlan.device_ids`` / ``skip_tokens``), which must drop and
        report out-of-range ids. None (this default) for host values: they are converted
        with :meth:`to_host_ids` and checked eagerly. :func:`dtype_and_shape` helps."""
        return None

    def device_ids_key(self, x: Any) -> Any:
        """A cheap hashable fingerprint of device ids, or None (this default; host ids, or
        ids not worth remembering). Ids with equal fingerprints must get equal answers from
        :meth:`device_ids_spec` and from the backend's own checks of them (device,
        contiguity): a prepared transfer reuses the plan of such ids without planning again
        (``kvgroups_core.call_memo``), so the fingerprint must not depend on their values."""
        return None

    # Array plumbing used by the demo, benchmarks and the conformance suite, so that code in
    # the core can drive any runtime without importing it.
    def from_numpy(self, a: Any, device: str | None = None, dtype: Any = None) -> Any:
        """A new array of this framework holding ``a``'s bytes, on ``device`` (``None``:
        :meth:`default_device`). With ``dtype`` (a DType or name of the same width as ``a``'s),
        ``a`` holds raw bits to be reinterpreted as ``dtype`` (how bfloat16 and float8 travel
        without a NumPy dtype for them)."""
        raise UnsupportedConfig(f"backend {self.name!r}: from_numpy is not implemented")

    def to_numpy(self, x: Any) -> Any:
        """A host NumPy copy of ``x``, bit-exact (same-width unsigned dtype where NumPy has
        no equivalent)."""
        raise UnsupportedConfig(f"backend {self.name!r}: to_numpy is not implemented")

    def import_foreign(self, x: Any) -> Any:
        """Adopt another runtime's array through DLPack, zero-copy where the runtimes allow."""
        raise UnsupportedConfig(f"backend {self.name!r}: import_foreign is not implemented")

    def default_device(self) -> str:
        """Where new arrays go by default (``"cuda"`` when a GPU is usable, else ``"cpu"``)."""
        return "cpu"

    def synchronize(self, x: Any = None) -> None:
        """Wait until queued work (on ``x``, or all of it) is done; for timing."""
        return None


class BoundCaches:
    """A backend's hold on one validated set of backing tensors, made by
    :meth:`Backend.bind_caches` for the repeated calls of a prepared transfer.

    :meth:`run` is the whole per-call contract: check the objects, then move the bytes, and
    raise before moving any byte if the objects are bad. This default runs the backend's
    generic methods; subclasses may do the same work faster but must reject the same input
    with the same errors.
    """

    def __init__(self, backend: Backend, caches: Sequence[TensorDesc]) -> None:
        self.backend = backend
        self.caches = list(caches)

    def release(self) -> bool:
        """Let go of the bound tensors while the binding waits for the next one-shot call
        (:mod:`kvgroups_core.reuse`), keeping everything derived from them; :meth:`restore`
        hands the same tensors back. False when this class cannot (the default for
        subclasses, which may hold tensors elsewhere: they opt in by overriding both): the
        binding is then not kept."""
        if type(self) is not BoundCaches:
            return False
        self._release_caches()
        return True

    def restore(self, tensors: Sequence[Any]) -> None:
        """Take back the tensors :meth:`release` let go of (the same objects, slot order)."""
        # The descriptors are this binding's own (made by its bind, never handed out while
        # released): their ``obj`` is put back rather than 32 descriptors built again.
        for d, x in zip(self.caches, tensors):
            d.__dict__["obj"] = x  # the frozen dataclass's field, set as its __init__ does

    def _release_caches(self) -> None:
        """:meth:`release` for a class that keeps its tensors only in :attr:`caches`."""
        for d in self.caches:
            d.__dict__["obj"] = None

    def run(self, plan: Any, objects: Sequence[Any]) -> tuple[list | None, list]:
        """Validate ``objects`` for ``plan`` and execute it (see :meth:`Backend.execute`)."""
        check_objects(plan, objects, self.backend.shape_of)
        self.backend.validate_objects(plan, self.caches, objects)
        return self.backend.execute(plan, self.caches, objects)

    def runner(self, plan: Any, block_ids: Any) -> Callable[[Any, Sequence[Any], Any], tuple]:
        """A function ``(block_ids, objects, objects_key) -> (new caches, objects)`` that runs
        ``plan`` again, after a :meth:`run` of it passed, with other ids of the same signature
        (one flat array for every group, int64 NumPy for host ids) and objects of a signature
        the core has validated (``kvgroups_core.call_memo``); ``objects_key`` is that
        signature (the backend's ``objects_key`` of ``objects``), which a runner may use to
        find what it derived from the same objects before. ``block_ids`` are the ids ``plan``
        was made with. This default puts the ids in the plan and runs it as :meth:`run` does,
        without the object checks when :meth:`run` is this class's own; backends override it
        to keep per-plan launch state."""
        backend, caches = self.backend, self.caches
        own_run = type(self).run is BoundCaches.run

        def run(ids: Any, objects: Sequence[Any], objects_key: Any = None) -> tuple:
            again = with_block_ids(plan, ids)
            if own_run:
                return backend.execute(again, caches, objects)
            return self.run(again, objects)

        return run

    def bind_source(self, manager: Any, kv_caches: Any) -> None:
        """Told by :func:`~kvgroups_core.transfer.prepare` after binding: the manager and the
        engine's structure the bound caches came from. Backends that plan again per device
        shard (JAX caches sharded over a mesh) use them; this default ignores them."""
        return None

    def adopt_results(self, new_caches: Sequence[Any]) -> bool:
        """After :meth:`run` returned new arrays for the bound caches (runtimes that do not
        write in place, like JAX): take them as the bound caches and return True when they
        match the old ones slot for slot (shape, dtype, device), so the caller's binding stays
        valid; False (this default) makes the caller bind them from scratch."""
        return False

    def allocate_objects(self, plan: Any) -> list:
        """New objects for ``plan`` next to the caches (none when nothing is bound)."""
        if not self.caches:
            return []
        return self.backend.allocate_objects(plan, self.caches[0])


@dataclass
class _Entry:
    name: str
    loader: "Backend | type[Backend] | Callable[[], Backend] | str"
    # None: an entry point's, read from its object when it is first loaded (listing or
    # naming backends never imports one; see _load_entry_points).
    array_types: tuple[str, ...] | None
    instance: Backend | None = None

    def get(self) -> Backend:
        if self.instance is None:
            loader = self.loader
            if isinstance(loader, str):
                module_name, _, attr = loader.partition(":")
                try:
                    module = importlib.import_module(module_name)
                    loader = getattr(module, attr)
                except (ImportError, AttributeError) as exc:  # not installed, or stale
                    raise BackendNotFound(
                        f"backend {self.name!r}: expected {module_name} and the framework it "
                        f"runs on to be installed, got {type(exc).__name__}: {exc}") from exc
            if self.array_types is None:
                self.array_types = tuple(getattr(loader, "array_types", ()))
                _TYPE_CACHE.clear()
            if isinstance(loader, Backend):
                self.instance = loader
            else:
                instance = loader()
                if not isinstance(instance, Backend):
                    raise KVGroupsTypeError(
                        f"backend {self.name!r}: expected the loader to return a Backend, "
                        f"got {type(instance).__name__}"
                    )
                self.instance = instance
        return self.instance


_ENTRIES: dict[str, _Entry] = {}
_TYPE_CACHE: dict[type, str | None] = {}
_ENTRY_POINTS_LOADED = False


def register_backend(
    name: str,
    loader: "Backend | type[Backend] | Callable[[], Backend] | str",
    *,
    array_types: Sequence[str] = (),
    replace: bool = False,
) -> None:
    """Register a backend under ``name``.

    ``loader`` is a Backend instance, a Backend subclass, a factory, or ``"module:attr"``
    (imported on first use). ``array_types`` are qualified class names of the arrays it
    handles (``"cupy.ndarray"``); tensors of those types then find this backend on their own.
    """
    if not name or not isinstance(name, str):
        raise KVGroupsTypeError(f"name: expected a non-empty str, got {name!r}")
    if name in _ENTRIES and not replace:
        raise KVGroupsTypeError(
            f"name: backend {name!r} is already registered (pass replace=True to override)"
        )
    _ENTRIES[name] = _Entry(name, loader, tuple(array_types))
    _TYPE_CACHE.clear()


def unregister_backend(name: str) -> None:
    """Remove a backend (tests use this to clean up)."""
    _ENTRIES.pop(name, None)
    _TYPE_CACHE.clear()


def registered_backends() -> list[str]:
    _load_entry_points()
    return list(_ENTRIES)


def unavailable_reason(name: str) -> str | None:
    """Why the backend ``name`` cannot load here (its module or framework is not installed),
    or None when it can, found without importing a framework: a loaded backend is available;
    otherwise its ``"module:attr"`` loader's module and the top-level modules of its array
    types must be installed."""
    _load_entry_points()
    entry = _ENTRIES.get(name)
    if entry is None:
        return f"no backend is registered as {name!r}"
    if entry.instance is not None:
        return None
    modules = [q.split(".", 1)[0] for q in entry.array_types or ()]
    if isinstance(entry.loader, str):
        modules.insert(0, entry.loader.partition(":")[0])
    for module in dict.fromkeys(modules):
        try:
            found = module in sys.modules or importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"{module} is not installed"
    return None


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``."""
    _load_entry_points()
    try:
        entry = _ENTRIES[name]
    except KeyError:
        raise BackendNotFound(
            f"backend: expected one of {sorted(_ENTRIES)}, got {name!r}"
        ) from None
    return entry.get()


def _load_entry_points() -> None:
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    _ENTRY_POINTS_LOADED = True
    from importlib.metadata import entry_points

    for ep in entry_points(group="kvgroups.backends"):
        if ep.name in _ENTRIES:
            continue
        # Registered by name, imported on first use: naming or listing backends (a command
        # line's checks) must not import every installed framework.
        _ENTRIES[ep.name] = _Entry(ep.name, ep.value, None)
    _TYPE_CACHE.clear()


def _resolve_entry_points(x: Any) -> str | None:
    """For an array type no loaded backend claims: load the entry points whose array types
    are not known yet, and return the first that claims it (one that fails to load claims
    nothing; naming it raises its typed error)."""
    t = type(x)
    for entry in list(_ENTRIES.values()):
        if entry.array_types is not None:
            continue
        try:
            entry.get()
        except Exception:  # noqa: BLE001 - refused by name when used: get_backend raises
            entry.array_types = ()
            continue
        for qualified in entry.array_types:
            cls = _resolve_class(qualified)
            if cls is not None and issubclass(t, cls):
                return entry.name
    return None


def _resolve_class(qualified: str) -> type | None:
    """The class named ``qualified`` if its top-level module is already imported."""
    root = qualified.split(".", 1)[0]
    if root not in sys.modules:
        return None
    module_name, _, cls_name = qualified.rpartition(".")
    module = sys.modules.get(module_name)
    if module is None:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            return None
    cls = getattr(module, cls_name, None)
    return cls if isinstance(cls, type) else None


def framework_of(x: Any) -> str | None:
    """Name of the backend whose arrays ``x`` belongs to, or None; imports nothing new."""
    if isinstance(x, TensorDesc):
        return None if x.framework == "spec" else x.framework
    if isinstance(x, TensorSpec):
        return None
    t = type(x)
    if t in _TYPE_CACHE:
        return _TYPE_CACHE[t]
    _load_entry_points()
    found = None
    for entry in _ENTRIES.values():
        for qualified in entry.array_types or ():
            cls = _resolve_class(qualified)
            if cls is not None and issubclass(t, cls):
                found = entry.name
                break
        if found:
            break
    if found is None and (hasattr(x, "__dlpack__") or hasattr(x, "shape")):
        found = _resolve_entry_points(x)
    _TYPE_CACHE[t] = found
    return found


def backend_for_object(x: Any) -> Backend | None:
    name = framework_of(x)
    return None if name is None else get_backend(name)


def backend_for_tensors(tensors: Sequence[Any], explicit: str | None = None) -> Backend:
    """Pick the backend for one call: ``explicit`` if given, else the single framework the
    tensors belong to. Two frameworks in one call -> TypeError naming both."""
    if explicit is not None:
        return get_backend(explicit)
    names: dict[str, str] = {}
    for x in tensors:
        name = framework_of(x)
        if name is not None and name not in names:
            names[name] = type(x).__qualname__
    if len(names) > 1:
        listed = " and ".join(f"{n} ({t})" for n, t in names.items())
        raise KVGroupsTypeError(
            f"tensors: expected one framework per call, got {listed}; pass backend= to choose"
        )
    if not names:
        raise BackendNotFound(
            "tensors: expected framework arrays to infer the backend, got only descriptors; "
            "pass backend="
        )
    return get_backend(next(iter(names)))


def dtype_and_shape(x: Any) -> tuple[str, tuple[int, ...]]:
    """``(dtype name, shape)`` of any array-like with ``dtype`` and ``shape`` attributes, read
    without data (works on tracers and fake tensors): the usual body of
    :meth:`Backend.device_ids_spec` once a backend has decided ``x`` stays on the device.
    The dtype name is the framework's spelling with any ``torch.`` prefix dropped."""
    name = str(getattr(x, "dtype", ""))
    name = name.rpartition(".")[2]
    return name, tuple(int(s) for s in getattr(x, "shape", ()))


def describe(x: Any) -> TensorDesc:
    """Describe ``x``: a TensorDesc (returned as is), a TensorSpec (abstract descriptor), a
    NumPy array, or any DLPack producer (torch, JAX, CuPy ...).

    A registered backend for ``x``'s framework describes it when one exists (it may know more,
    e.g. fp8 dtypes or abstract traced values, whose descriptors are ``is_abstract``);
    otherwise DLPack is read directly. The framework is never imported here.
    """
    if isinstance(x, TensorDesc):
        return x
    if isinstance(x, TensorSpec):
        return TensorDesc(x)
    backend = backend_for_object(x)
    if backend is not None:
        return backend.describe(x)
    return describe_dlpack(x)


register_backend("numpy", "kvgroups_core.reference:NumpyBackend", array_types=("numpy.ndarray",))
register_backend("torch", "kvgroups_torch:TorchBackend", array_types=("torch.Tensor",))
# Tracers (inside jax.jit, shard_map, vmap) are not jax.Array subclasses; ShapeDtypeStructs
# are JAX's abstract arrays.
register_backend("jax", "kvgroups_jax:JaxBackend",
                 array_types=("jax.Array", "jax.core.Tracer", "jax.ShapeDtypeStruct"))
