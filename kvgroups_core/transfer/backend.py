"""The backend protocol: what a runtime implements to move pages, and its hold on caches.

:class:`Backend` and :class:`BoundCaches`. Backends are registered, and found from the tensors,
by the array registry (:mod:`kvgroups_core.tensors.arrays`), which knows only their
:class:`~kvgroups_core.tensors.arrays.ArrayBackend` part.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

from kvgroups_core.errors import UnsupportedConfigError
from kvgroups_core.tensors.arrays import ArrayBackend
from kvgroups_core.tensors.descriptors import TensorDesc, with_objs

from .objects import check_objects
from .plan import TransferPlan

if TYPE_CHECKING:
    from kvgroups_core.grouping.manager import KVLayerGroupsManager


class Backend(ArrayBackend, abc.ABC):
    """What a runtime implements to move pages for the core.

    Subclasses set ``name`` and ``array_types`` (qualified class names such as
    ``"torch.Tensor"``) and implement :meth:`execute` and :meth:`allocate_objects`.
    """

    #: The ``path=`` values the transfer calls accept for this backend ("auto" first).
    transfer_paths: ClassVar[tuple[str, ...]] = ("auto", "kernel")

    @abc.abstractmethod
    def execute(
        self, plan: TransferPlan, caches: Sequence[TensorDesc], objects: Sequence[Any]
    ) -> tuple[list | None, list]:
        """Run a :class:`~kvgroups_core.transfer.plan.TransferPlan`.

        ``caches`` are the backing tensors in ``plan.tensor_specs`` order; ``objects`` one
        entry per object group (a ``[num_chunks, object_nbytes]`` uint8 array, or a list of
        ``num_chunks`` 1-D uint8 buffers). Everything was validated by the core. Returns the
        new cache arrays in tensor_index order (``None`` when written in place) and the objects
        (new arrays for immutable runtimes, the same ones otherwise).
        """

    @abc.abstractmethod
    def allocate_objects(
        self, plan: TransferPlan, like: TensorDesc, placement: str | None = None
    ) -> list:
        """Allocate one ``[num_chunks, object_nbytes]`` uint8 array per object group, on the
        device of ``like`` (or ``placement``: e.g. ``"pinned"`` for pinned host memory)."""

    def bind_caches(self, caches: Sequence[TensorDesc]) -> "BoundCaches":
        """Validate the backing tensors of one binding (tensor_index order) and return what runs the
        per-call work on them (:class:`BoundCaches`). Backends whose calls repeat host work
        that depends only on the caches (devices, addresses, launch state) return a subclass
        that keeps it."""
        self.validate_caches(caches)
        return BoundCaches(self, caches)

    def validate(
        self, plan: TransferPlan, caches: Sequence[TensorDesc], objects: Sequence[Any]
    ) -> None:
        """Backend-specific checks run before any byte moves: both halves below."""
        self.validate_caches(caches)
        self.validate_objects(plan, caches, objects)

    def validate_caches(self, caches: Sequence[TensorDesc]) -> None:
        """Checks of the bound caches alone (devices, memory kinds); run once per binding."""
        return None

    def validate_objects(
        self, plan: TransferPlan, caches: Sequence[TensorDesc], objects: Sequence[Any]
    ) -> None:
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
        (``kvgroups_core.transfer.fast.call_memo``), so the fingerprint must not depend on their
        values."""
        return None

    # Array plumbing used by the demo, benchmarks and the conformance suite, so that code in
    # the core can drive any runtime without importing it.
    def from_numpy(self, a: Any, device: str | None = None, dtype: Any = None) -> Any:
        """A new array of this framework holding ``a``'s bytes, on ``device`` (``None``:
        :meth:`default_device`). With ``dtype`` (a DType or name of the same width as ``a``'s),
        ``a`` holds raw bits to be reinterpreted as ``dtype`` (how bfloat16 and float8 travel
        without a NumPy dtype for them)."""
        raise UnsupportedConfigError(f"backend {self.name!r}: from_numpy is not implemented")

    def to_numpy(self, x: Any) -> Any:
        """A host NumPy copy of ``x``, bit-exact (same-width unsigned dtype where NumPy has
        no equivalent)."""
        raise UnsupportedConfigError(f"backend {self.name!r}: to_numpy is not implemented")

    def import_foreign(self, x: Any) -> Any:
        """Adopt another runtime's array through DLPack, zero-copy where the runtimes allow."""
        raise UnsupportedConfigError(f"backend {self.name!r}: import_foreign is not implemented")

    def default_device(self) -> str:
        """Where new arrays go by default (``"cuda"`` when a GPU is usable, else ``"cpu"``)."""
        return "cpu"

    def synchronize(self, x: Any = None) -> None:
        """Wait until queued work (on ``x``, or all of it) is done; for timing."""
        return None


class BoundCaches:
    """A backend's hold on one validated set of backing tensors, made by
    :meth:`Backend.bind_caches` for the repeated calls of a prepared transfer.

    :meth:`execute` is the whole per-call contract: check the objects, then move the bytes, and
    raise before moving any byte if the objects are bad. This default runs the backend's
    generic methods; subclasses may do the same work faster but must reject the same input
    with the same errors.
    """

    _caches: list | None
    _bare: list | None  # the descriptors without their tensors (released)
    _taken: list | None  # the tensors restore() took back

    def __init__(self, backend: Backend, caches: Sequence[TensorDesc]) -> None:
        self.backend = backend
        self.caches = list(caches)

    @property
    def caches(self) -> list:
        """The bound descriptors, in tensor_index order. After :meth:`restore` they are made again
        when first read (a one-shot call served by a repeater never reads them)."""
        found = self._caches
        if found is None:
            found = self._caches = with_objs(self._bare, self._taken)
            self._taken = None
        return found

    @caches.setter
    def caches(self, value: Sequence[TensorDesc]) -> None:
        self._caches = list(value)
        self._bare = None
        self._taken = None

    def release(self) -> bool:
        """Let go of the bound tensors while the binding waits for the next one-shot call
        (:mod:`kvgroups_core.transfer.fast.reuse`), keeping everything derived from them;
        :meth:`restore`
        hands the same tensors back. False when this class cannot (the default for
        subclasses, which may hold tensors elsewhere: they opt in by overriding both): the
        binding is then not kept."""
        if type(self) is not BoundCaches:
            return False
        self._release_caches()
        return True

    def restore(self, tensors: Sequence[Any]) -> None:
        """Take back the tensors :meth:`release` let go of (the same objects, same order)."""
        self._taken = list(tensors)

    def _release_caches(self) -> None:
        """:meth:`release` for a class that keeps its tensors only in :attr:`caches`: the
        descriptors are kept without them (made once per binding: a restore hands back the
        same tensors, whose fingerprints the caller compares)."""
        if self._caches is not None:
            if self._bare is None:
                self._bare = with_objs(self._caches, [None] * len(self._caches))
            self._caches = None
        self._taken = None

    def execute(self, plan: TransferPlan, objects: Sequence[Any]) -> tuple[list | None, list]:
        """Validate ``objects`` for ``plan`` and execute it (see :meth:`Backend.execute`)."""
        check_objects(plan, objects, self.backend.shape_of)
        self.backend.validate_objects(plan, self.caches, objects)
        return self.backend.execute(plan, self.caches, objects)

    def repeater(
        self, plan: TransferPlan, block_ids: Any
    ) -> Callable[[Any, Sequence[Any], Any], tuple]:
        """A function ``(block_ids, objects, objects_key) -> (new caches, objects)`` that runs
        ``plan`` again, after a :meth:`execute` of it passed, with other ids of the same signature
        (one flat array for every group, int64 NumPy for host ids) and objects of a signature
        the core has validated (``kvgroups_core.transfer.fast.call_memo``); ``objects_key`` is that
        signature (the backend's ``objects_key`` of ``objects``), which a repeater may use to
        find what it derived from the same objects before. ``block_ids`` are the ids ``plan``
        was made with. This default puts the ids in the plan and runs it as :meth:`execute` does,
        without the object checks when :meth:`execute` is this class's own; backends override it
        to keep per-plan launch state."""
        backend = self.backend
        own_execute = type(self).execute is BoundCaches.execute

        def repeat(ids: Any, objects: Sequence[Any], objects_key: Any = None) -> tuple:
            again = plan.with_block_ids(ids)
            if own_execute:
                return backend.execute(again, self.caches, objects)
            return self.execute(again, objects)

        return repeat

    def bind_source(self, manager: KVLayerGroupsManager, kv_caches: Any) -> None:
        """Told by :func:`~kvgroups_core.transfer.api.prepare` after binding: the manager and the
        engine's structure the bound caches came from. Backends that plan again per device
        shard (JAX caches sharded over a mesh) use them; this default ignores them."""
        return None

    def adopt_results(self, new_caches: Sequence[Any]) -> bool:
        """After :meth:`execute` returned new arrays for the bound caches (runtimes that do not
        write in place, like JAX): take them as the bound caches and return True when they
        match the old ones one for one (shape, dtype, device), so the caller's binding stays
        valid; False (this default) makes the caller bind them from scratch."""
        return False

    def allocate_objects(self, plan: TransferPlan) -> list:
        """New objects for ``plan`` next to the caches (none when nothing is bound)."""
        bare, taken = self._bare, self._taken
        if (
            type(self).caches is BoundCaches.caches
            and self._caches is None
            and bare is not None
            and taken is not None
        ):
            # Taken back after a release: describe only the cache the allocation needs.
            first = with_objs(bare[:1], taken[:1])
        else:
            first = self.caches[:1]
        return self.backend.allocate_objects(plan, first[0]) if first else []
