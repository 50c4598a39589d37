"""The array registry: registered backends, framework detection without imports, describe().

A framework is recognised the einops / array-api-compat way: only if its module is already in
``sys.modules`` (the user imported it, so it costs nothing) is its array class looked up and
``issubclass`` checked; the answer is memoised per type. The backend package itself is imported
only then, on first use.

Built-in entries (loaded lazily):

- ``"numpy"``: :class:`kvgroups_core.transfer.reference.NumpyBackend` for ``numpy.ndarray``
- ``"torch"``: ``kvgroups_torch:TorchBackend`` for ``torch.Tensor``
- ``"jax"``: ``kvgroups_jax:JaxBackend`` for ``jax.Array`` and JAX tracers
  (``jax.core.Tracer``: values inside ``jax.jit`` / ``shard_map`` / ``vmap``)

:func:`describe` lives here (not in ``descriptors``) because it asks the array's backend:
descriptors stay a leaf module and nothing imports in a circle.

Third-party backends call :func:`register_backend`, or declare an entry point in the group
``kvgroups.backends`` whose value is a :class:`Backend` subclass or instance (its ``name`` and
``array_types`` attributes say what it handles). The protocol a backend implements to move
pages is :class:`kvgroups_core.transfer.backend.Backend`; the registry needs only its
:class:`ArrayBackend` part, so it sits below every module that describes tensors.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

from kvgroups_core.errors import BackendNotFoundError, KVGroupsTypeError

from .descriptors import TensorDesc, TensorSpec, describe_dlpack


class ArrayBackend:
    """The part of a backend the array registry uses: the framework's ``name``, the
    ``array_types`` it handles and how it describes one of them. Transfer backends subclass
    it through :class:`kvgroups_core.transfer.backend.Backend`."""

    name: ClassVar[str] = ""
    array_types: ClassVar[tuple[str, ...]] = ()

    def describe(self, x: Any) -> TensorDesc:
        """Describe one of this framework's arrays (default: read DLPack)."""
        return describe_dlpack(x, self.name)


@dataclass
class _Entry:
    name: str
    loader: "ArrayBackend | type[ArrayBackend] | Callable[[], ArrayBackend] | str"
    # None: an entry point's, read from its object when it is first loaded (listing or
    # naming backends never imports one; see _load_entry_points).
    array_types: tuple[str, ...] | None
    instance: ArrayBackend | None = None

    def get(self) -> ArrayBackend:
        if self.instance is None:
            loader = self.loader
            if isinstance(loader, str):
                module_name, _, attr = loader.partition(":")
                try:
                    module = importlib.import_module(module_name)
                    loader = getattr(module, attr)
                except (ImportError, AttributeError) as exc:  # not installed, or stale
                    raise BackendNotFoundError(
                        f"backend {self.name!r}: expected {module_name} and the framework it "
                        f"runs on to be installed, got {type(exc).__name__}: {exc}"
                    ) from exc
            if self.array_types is None:
                self.array_types = tuple(getattr(loader, "array_types", ()))
                _TYPE_MEMO.clear()
            if isinstance(loader, ArrayBackend):
                self.instance = loader
            else:
                instance = loader()
                if not isinstance(instance, ArrayBackend):
                    raise KVGroupsTypeError(
                        f"backend {self.name!r}: expected the loader to return a Backend, "
                        f"got {type(instance).__name__}"
                    )
                self.instance = instance
        return self.instance


_ENTRIES: dict[str, _Entry] = {}
_TYPE_MEMO: dict[type, str | None] = {}
_ENTRY_POINTS_LOADED = False


def register_backend(
    name: str,
    loader: "ArrayBackend | type[ArrayBackend] | Callable[[], ArrayBackend] | str",
    *,
    array_types: Sequence[str] = (),
    replace: bool = False,
) -> None:
    """Register a backend under ``name``.

    ``loader`` is a ArrayBackend instance, a ArrayBackend subclass, a factory, or ``"module:attr"``
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
    _TYPE_MEMO.clear()


def unregister_backend(name: str) -> None:
    """Remove a backend (tests use this to clean up)."""
    _ENTRIES.pop(name, None)
    _TYPE_MEMO.clear()


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


def get_backend(name: str) -> ArrayBackend:
    """The backend registered as ``name``."""
    _load_entry_points()
    try:
        entry = _ENTRIES[name]
    except KeyError:
        raise BackendNotFoundError(
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
    _TYPE_MEMO.clear()


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
        # get() has just set array_types (mypy keeps the `is not None` test above)
        for qualified in entry.array_types:  # type: ignore[attr-defined]
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
    if t in _TYPE_MEMO:
        return _TYPE_MEMO[t]
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
    _TYPE_MEMO[t] = found
    return found


def backend_for_object(x: Any) -> ArrayBackend | None:
    name = framework_of(x)
    return None if name is None else get_backend(name)


def backend_for_tensors(
    tensors: Sequence[Any],
    explicit: str | None = None,
    name_of: Callable[[int], str] | None = None,
    what: str = "tensors",
) -> ArrayBackend:
    """Pick the backend for one call: ``explicit`` if given, else the single framework the
    tensors belong to. Two frameworks in one call -> TypeError naming both; ``name_of(i)``
    (called only then) names ``tensors[i]`` as the caller's argument (``"objects[0]"``);
    ``what`` names the tensors as a whole when none belongs to a framework."""
    if explicit is not None:
        return get_backend(explicit)
    names: dict[str, tuple[str, int]] = {}
    for i, x in enumerate(tensors):
        name = framework_of(x)
        if name is not None and name not in names:
            names[name] = (type(x).__qualname__, i)
    if len(names) > 1:
        if name_of is not None:
            (first, (t0, i0)), (other, (t1, i1)) = list(names.items())[:2]
            raise KVGroupsTypeError(
                f"{name_of(i1)}: expected a {first} array (one framework per call: "
                f"{name_of(i0)} is {first} ({t0})), got {other} ({t1}); pass backend= to choose"
            )
        listed = " and ".join(f"{n} ({t})" for n, (t, _) in names.items())
        raise KVGroupsTypeError(
            f"tensors: expected one framework per call, got {listed}; pass backend= to choose"
        )
    if not names:
        kinds = ", ".join(sorted({type(x).__name__ for x in tensors})) or "no arrays"
        raise BackendNotFoundError(
            f"{what}: expected arrays of a framework (NumPy, torch, JAX ...) to infer the "
            f"backend from, got {kinds}; pass backend= for descriptors"
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


register_backend(
    "numpy", "kvgroups_core.transfer.reference:NumpyBackend", array_types=("numpy.ndarray",)
)
register_backend("torch", "kvgroups_torch:TorchBackend", array_types=("torch.Tensor",))
# Tracers (inside jax.jit, shard_map, vmap) are not jax.Array subclasses; ShapeDtypeStructs
# are JAX's abstract arrays.
register_backend(
    "jax",
    "kvgroups_jax:JaxBackend",
    array_types=("jax.Array", "jax.core.Tracer", "jax.ShapeDtypeStruct"),
)
