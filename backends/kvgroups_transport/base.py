"""The transport interface: memory objects moved between engines (prefill -> decode).

Framework- and transport-free. A transport moves bytes between *pools*: per object group one
buffer of ``capacity`` entries, entry ``s`` holding one chunk's object at ``base + s *
object_nbytes`` (the layout of ``[capacity, object_nbytes]`` uint8 arrays). The life of a
request:

1. Both sides register their pools once (:meth:`Transport.register_pool`).
2. The writer stores a request's chunks into entries and publishes them
   (:meth:`Transport.publish`): a :class:`Publication`, plain JSON-able data naming the entries,
   the grouping's fingerprint (``manager.fingerprint(across_degrees=True)``), the writer's TP
   degree and object layout, and where each writer rank answers (its side channel).
3. The reader checks the fingerprint (before any byte moves), plans which bytes it needs
   (:mod:`kvgroups_transport.plan`) and pulls them into its own entries
   (:meth:`Transport.pull`; :meth:`Transport.push` is the writer-initiated mirror), then waits
   (:meth:`Transport.wait`) and only then loads them into its caches.
4. The reader releases the request (:meth:`Transport.release_remote`); the writer may reuse
   the entries. A publication also expires after the transport's ``publication_ttl_s``.

A :class:`Copy` is one descriptor: a byte range of one entry run on each side.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from kvgroups_core import OBJECT_LAYOUTS
from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError

from .errors import TransferTimeoutError


@dataclass(frozen=True, kw_only=True)
class MemoryRegion:
    """One registered buffer: ``nbytes`` bytes at ``address`` on ``device`` ("cpu" or
    "cuda", with ``device_id``)."""

    address: int
    nbytes: int
    device: str = "cpu"
    device_id: int = 0


def memory_region(array: Any) -> MemoryRegion:
    """Where a contiguous array's bytes are (torch, NumPy or JAX; read by duck typing, so no
    framework is imported)."""
    if isinstance(array, MemoryRegion):
        return array
    if hasattr(array, "data_ptr") and hasattr(array, "is_contiguous"):  # torch
        if not array.is_contiguous():
            raise KVGroupsValueError("array: expected a contiguous tensor, got a strided view")
        dev = array.device
        return MemoryRegion(
            address=int(array.data_ptr()),
            nbytes=int(array.numel() * array.element_size()),
            device="cuda" if dev.type == "cuda" else "cpu",
            device_id=int(dev.index or 0),
        )
    interface = getattr(array, "__array_interface__", None)
    if interface is not None:  # NumPy and its kin
        if interface.get("strides") is not None and not array.flags["C_CONTIGUOUS"]:
            raise KVGroupsValueError("array: expected a C-contiguous array, got a strided one")
        return MemoryRegion(address=int(interface["data"][0]), nbytes=int(array.nbytes))
    if hasattr(array, "unsafe_buffer_pointer"):  # a single-device JAX array
        (dev,) = array.devices()
        return MemoryRegion(
            address=int(array.unsafe_buffer_pointer()),
            nbytes=int(array.nbytes),
            device="cuda" if dev.platform == "gpu" else "cpu",
            device_id=int(getattr(dev, "local_hardware_id", 0) or 0),
        )
    raise KVGroupsTypeError(
        f"array: expected a torch, NumPy or JAX array, got {type(array).__name__}"
    )


@dataclass(frozen=True, kw_only=True)
class PoolInfo:
    """A registered pool as a peer addresses it."""

    pool_id: str
    bases: tuple[int, ...]  # per object group
    object_nbytes: tuple[int, ...]  # per object group
    capacity: int
    device: str = "cpu"
    device_id: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "PoolInfo":
        """A peer's pool from its JSON form (another process's word: every field checked,
        nothing converted)."""
        if not isinstance(d, dict):
            raise KVGroupsTypeError(f"pool: expected a dict, got {type(d).__name__}")
        missing = [k for k in ("pool_id", "bases", "object_nbytes", "capacity") if k not in d]
        if missing:
            raise KVGroupsValueError(
                f"pool: expected the key {missing[0]!r}, got keys {sorted(map(str, d))}"
            )
        bases = _sequence(d["bases"], "pool.bases")
        sizes = _sequence(d["object_nbytes"], "pool.object_nbytes")
        if len(bases) != len(sizes):
            raise KVGroupsValueError(
                f"pool.bases: expected one base per object group ({len(sizes)}), got {len(bases)}"
            )
        return cls(
            pool_id=_string(d["pool_id"], "pool.pool_id"),
            bases=tuple(
                checked_int(b, f"pool.bases[{g}]", 0, _INT64_LIMIT) for g, b in enumerate(bases)
            ),
            object_nbytes=tuple(
                checked_int(n, f"pool.object_nbytes[{g}]", 0, _INT64_LIMIT)
                for g, n in enumerate(sizes)
            ),
            capacity=checked_int(d["capacity"], "pool.capacity", 0, _INT64_LIMIT),
            device=_string(d.get("device", "cpu"), "pool.device"),
            device_id=checked_int(d.get("device_id", 0), "pool.device_id", 0, 1 << 16),
        )


@dataclass(frozen=True, kw_only=True)
class Copy:
    """One descriptor: ``nbytes`` bytes from offset ``remote_offset`` of remote entry
    ``remote_entry`` to offset ``local_offset`` of local entry ``local_entry`` (a pull; a push
    reverses the direction), in object group ``object_group``'s buffers. ``nbytes`` may run
    over several consecutive entries on both sides (a coalesced run of chunks)."""

    object_group: int
    remote_entry: int
    remote_offset: int
    local_entry: int
    local_offset: int
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class Publication:
    """A request's objects as their writer publishes them (JSON-able: :meth:`to_dict`).

    ``entries[c]`` is the writer's pool entry of the request's chunk ``c`` (the same entry on
    every writer rank); ``endpoints[r]`` is where writer rank ``r`` answers (its side
    channel: ``{"host": ..., "port": ...}``). ``fingerprint`` is the writer's
    ``manager.fingerprint(across_degrees=True)``; ``tp_size`` and ``object_layout`` say how
    the writer's objects are laid out; ``chunk_hashes`` (optional) identify the chunks'
    tokens, so a reader can check they are its prompt's.

    A publication comes from another process, so :meth:`from_dict` checks every field's type
    and range (nothing is coerced: ``"1"``, ``1.0`` and ``True`` are not the int 1) and
    raises a typed error naming the field: strings for the ids, fingerprint and layout
    (``"canonical"`` or ``"tp_native"``), int entries in ``[0, 2**63)``, ``chunk_tokens >=
    1``, ``tp_size >= 1`` with one ``{"host": str, "port": int}`` endpoint per writer rank,
    and no chunk hashes or one string per chunk.
    """

    request_id: str
    transport: str
    pool_id: str
    entries: tuple[int, ...]
    chunk_tokens: int
    fingerprint: str
    tp_size: int
    object_layout: str
    endpoints: tuple[dict, ...]
    chunk_hashes: tuple[str, ...] = ()

    @property
    def num_chunks(self) -> int:
        return len(self.entries)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["entries"], d["endpoints"] = list(self.entries), [dict(e) for e in self.endpoints]
        d["chunk_hashes"] = list(self.chunk_hashes)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "Publication":
        if not isinstance(d, dict):
            raise KVGroupsTypeError(f"publication: expected a dict, got {type(d).__name__}")
        missing = [k for k in _PUBLICATION_KEYS if k not in d]
        if missing:
            raise KVGroupsValueError(
                f"publication: expected the key {missing[0]!r}, got keys {sorted(map(str, d))}"
            )
        entries = tuple(
            checked_int(s, f"publication.entries[{i}]", 0, _INT64_LIMIT)
            for i, s in enumerate(_sequence(d["entries"], "publication.entries"))
        )
        tp_size = checked_int(d["tp_size"], "publication.tp_size", 1)
        endpoints = _sequence(d["endpoints"], "publication.endpoints")
        if len(endpoints) != tp_size:
            raise KVGroupsValueError(
                f"publication.endpoints: expected one endpoint per writer rank (tp_size "
                f"{tp_size}), got {len(endpoints)}"
            )
        hashes = _sequence(d.get("chunk_hashes", ()), "publication.chunk_hashes")
        if len(hashes) not in (0, len(entries)):
            raise KVGroupsValueError(
                f"publication.chunk_hashes: expected none or one per chunk ({len(entries)}), got "
                f"{len(hashes)}"
            )
        layout = _string(d["object_layout"], "publication.object_layout")
        if layout not in OBJECT_LAYOUTS:
            raise KVGroupsValueError(
                f"publication.object_layout: expected one of {list(OBJECT_LAYOUTS)}, got {layout!r}"
            )
        return cls(
            request_id=_string(d["request_id"], "publication.request_id"),
            transport=_string(d["transport"], "publication.transport"),
            pool_id=_string(d["pool_id"], "publication.pool_id"),
            entries=entries,
            chunk_tokens=checked_int(d["chunk_tokens"], "publication.chunk_tokens", 1),
            fingerprint=_string(d["fingerprint"], "publication.fingerprint"),
            tp_size=tp_size,
            object_layout=layout,
            endpoints=tuple(
                _endpoint(e, f"publication.endpoints[{r}]") for r, e in enumerate(endpoints)
            ),
            chunk_hashes=tuple(
                _string(h, f"publication.chunk_hashes[{i}]") for i, h in enumerate(hashes)
            ),
        )


_PUBLICATION_KEYS = (
    "request_id",
    "transport",
    "pool_id",
    "entries",
    "chunk_tokens",
    "fingerprint",
    "tp_size",
    "object_layout",
    "endpoints",
)
_INT64_LIMIT = 2**63


def checked_int(value: Any, what: str, low: int, high: int | None = None) -> int:
    """``value`` if it is an int in ``[low, high)`` (Python or NumPy; bools, floats and
    strings refused, not coerced), else a typed error naming ``what``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise KVGroupsTypeError(f"{what}: expected an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < low or (high is not None and value >= high):
        expected = f">= {low}" if high is None else f"in [{low}, {high})"
        raise KVGroupsValueError(f"{what}: expected an int {expected}, got {value}")
    return value


def _sequence(value: Any, what: str) -> list | tuple:
    if not isinstance(value, (list, tuple)):
        raise KVGroupsTypeError(f"{what}: expected a list, got {type(value).__name__} {value!r}")
    return value


def _string(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise KVGroupsTypeError(f"{what}: expected a str, got {type(value).__name__} {value!r}")
    return value


def _endpoint(value: Any, what: str) -> dict:
    """A writer rank's side channel: ``{"host": str, "port": int}`` (other keys kept)."""
    if not isinstance(value, dict):
        raise KVGroupsTypeError(
            f"{what}: expected a dict with 'host' and 'port', got {type(value).__name__} {value!r}"
        )
    for key in ("host", "port"):
        if key not in value:
            raise KVGroupsValueError(
                f"{what}: expected the key {key!r}, got keys {sorted(map(repr, value))}"
            )
    if not _string(value["host"], f"{what}.host"):
        raise KVGroupsValueError(f"{what}.host: expected a host name, got ''")
    # A plain int (a NumPy one would not survive to_dict's JSON).
    return {**value, "port": checked_int(value["port"], f"{what}.port", 0, 65536)}


@dataclass
class TransferStats:
    """What one transfer moved: descriptors handed to the transport, descriptors it posted
    after its own merging (-1 when it does not say), bytes, and seconds from post to done."""

    descriptors: int
    posted_descriptors: int = -1
    nbytes: int = 0
    seconds: float = 0.0


@dataclass
class TransferHandle:
    """An outstanding pull or push. ``deadline`` is on ``time.monotonic()``."""

    request_id: str
    peer: str
    stats: TransferStats
    deadline: float
    started: float = field(default_factory=time.monotonic)
    state: str = "pending"  # "pending", "done" or "failed"
    native: Any = None  # the transport's own handle
    after: Any = None  # checked once the bytes landed: raises if they must not be used


class Transport(ABC):
    """Moves memory objects between registered pools of two engines (see the module doc).

    Subclasses implement the ``_``-prefixed hooks; the public methods here add the checks
    and the deadlines every transport shares. All methods are called from one thread.
    """

    name = "abstract"

    #: seconds a publication stays pullable when nobody releases it
    publication_ttl_s: float = 120.0

    @abstractmethod
    def register_pool(
        self, pool_id: str, buffers: Sequence[Any], object_nbytes: Sequence[int]
    ) -> PoolInfo:
        """Register one buffer per object group (``[capacity, object_nbytes[og]]`` uint8 or
        a :class:`MemoryRegion`), once; returns what peers address it by. The transport
        holds the arrays until :meth:`deregister_pool` (a :class:`MemoryRegion` is the
        caller's to keep alive)."""

    @abstractmethod
    def deregister_pool(self, pool_id: str) -> None:
        """Forget a pool: its publications are released, peers can no longer read it."""

    @abstractmethod
    def endpoint(self) -> dict:
        """Where this side answers peers (its side channel), for :attr:`Publication.endpoints`."""

    @abstractmethod
    def publish(
        self,
        request_id: str,
        pool_id: str,
        entries: Sequence[int],
        *,
        chunk_tokens: int,
        fingerprint: str,
        tp_size: int = 1,
        object_layout: str = "canonical",
        endpoints: Sequence[dict] | None = None,
        chunk_hashes: Sequence[str] = (),
        layers_ready: int | None = None,
    ) -> Publication:
        """Offer a request's chunks (in ``entries`` of ``pool_id``) to readers until released or
        expired. ``layers_ready``: for layer-streamed publications, how many layers (manager
        layer order) are written so far (None: all of them; see :meth:`mark_ready`)."""

    @abstractmethod
    def mark_ready(self, request_id: str, layers_ready: int | None) -> None:
        """Layer streaming: the first ``layers_ready`` layers of every published chunk are
        written (None: all)."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """Writer side: stop offering a request (its entries may be reused)."""

    @abstractmethod
    def release_remote(self, publication: Publication, reader: int = 0, readers: int = 1) -> None:
        """Reader side: reader rank ``reader`` (of a TP group of ``readers``) tells every
        writer rank it is done; a writer drops the request once all readers have."""

    @abstractmethod
    def layers_ready(self, publication: Publication, rank: int) -> int | None:
        """How many layers writer rank ``rank`` has published (None: all); raises
        :class:`PublicationReleasedError` if it no longer offers the request."""

    @abstractmethod
    def _start(
        self,
        op: str,
        publication: Publication,
        rank: int,
        pool_id: str,
        copies: Sequence[Copy],
        handle: TransferHandle,
    ) -> None:
        """Post ``copies`` ("READ": remote -> local, "WRITE": local -> remote); set
        ``handle.native``."""

    @abstractmethod
    def _progress(self, handle: TransferHandle) -> bool:
        """True once the posted copies are done; raises a :class:`TransportError` on failure."""

    @abstractmethod
    def _abandon(self, handle: TransferHandle) -> None:
        """Cancel an unfinished transfer (its destination bytes must not be used)."""

    def pull(
        self,
        publication: Publication,
        rank: int,
        pool_id: str,
        copies: Sequence[Copy],
        *,
        timeout: float = 30.0,
    ) -> TransferHandle:
        """Read ``copies`` of writer rank ``rank``'s objects of ``publication`` into local
        pool ``pool_id``. Returns at once; :meth:`wait` or :meth:`poll` completes it."""
        return self._post("READ", publication, rank, pool_id, copies, timeout)

    def push(
        self,
        publication: Publication,
        rank: int,
        pool_id: str,
        copies: Sequence[Copy],
        *,
        timeout: float = 30.0,
    ) -> TransferHandle:
        """Write ``copies`` from local pool ``pool_id`` into the entries a reader published
        (``publication`` is the reader's offer of empty entries)."""
        return self._post("WRITE", publication, rank, pool_id, copies, timeout)

    def _post(
        self,
        op: str,
        publication: Publication,
        rank: int,
        pool_id: str,
        copies: Sequence[Copy],
        timeout: float,
    ) -> TransferHandle:
        handle = self._handle(
            publication, rank, len(copies), sum(c.nbytes for c in copies), timeout
        )
        if copies:
            self._start(op, publication, rank, pool_id, copies, handle)
        else:
            handle.state = "done"
        return handle

    def _handle(
        self, publication: Publication, rank: int, descriptors: int, nbytes: int, timeout: float
    ) -> TransferHandle:
        if not 0 <= rank < len(publication.endpoints):
            raise KVGroupsValueError(
                f"rank: expected a writer rank in [0, {len(publication.endpoints)}), got {rank}"
            )
        return TransferHandle(
            request_id=publication.request_id,
            peer=where(publication, rank),
            stats=TransferStats(descriptors=descriptors, nbytes=nbytes),
            deadline=time.monotonic() + float(timeout),
        )

    def poll(self, handle: TransferHandle) -> bool:
        """True once done. Raises :class:`TransferTimeoutError` past the deadline (the transfer is
        cancelled) and :class:`TransportError` subclasses on failure; a failed handle stays
        failed."""
        if handle.state == "done":
            return True
        if handle.state == "failed":
            raise TransferTimeoutError(
                f"transfer of request {handle.request_id!r} from {handle.peer} already failed"
            )
        try:
            done = self._progress(handle)
            if done and handle.after is not None:
                handle.after()
        except BaseException:
            handle.state = "failed"
            self._abandon(handle)
            raise
        if done:
            handle.state = "done"
            handle.stats.seconds = time.monotonic() - handle.started
            return True
        if time.monotonic() > handle.deadline:
            handle.state = "failed"
            self._abandon(handle)
            raise TransferTimeoutError(
                f"transfer of request {handle.request_id!r} from {handle.peer}: expected it "
                f"done within its deadline, got none after "
                f"{time.monotonic() - handle.started:.3f} s"
            )
        return False

    def cancel(self, handle: TransferHandle) -> None:
        """Give up an unfinished transfer: its destination bytes must not be used."""
        if handle.state == "pending":
            handle.state = "failed"
            self._abandon(handle)

    def uncancelled(self) -> int:
        """Abandoned transfers the transport could not cancel yet (their destination entries
        may still be written: do not reuse them while this is non-zero)."""
        return 0

    def wait(self, handle: TransferHandle, poll_interval_s: float = 0.0) -> TransferStats:
        """Block until ``handle`` is done (or raise as :meth:`poll` does)."""
        while not self.poll(handle):
            if poll_interval_s:
                time.sleep(poll_interval_s)
        return handle.stats

    @abstractmethod
    def close(self) -> None:
        """Release everything (pools, publications, the side channel)."""


def where(publication: Publication, rank: int) -> str:
    """Writer rank ``rank`` of a publication, for messages."""
    e = publication.endpoints[rank]
    return f"writer rank {rank} at {e.get('host')}:{e.get('port')}"
