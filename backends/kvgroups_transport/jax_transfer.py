"""``jax.experimental.transfer`` as a kvgroups transport, for JAX engines.

JAX arrays are immutable and a transfer server moves whole arrays, so this transport works on
objects rather than byte ranges of registered memory: the writer offers each published
(chunk, object group) object as its own array (``TransferServer.await_pull``), and a reader
pulls exactly the (chunk, object group) pairs its load reads (windows and partial pulls
included): one array, the transport's descriptor, per pair. The pulled arrays land on the
reader's device; :class:`~kvgroups_transport.Receiver` stacks them per source rank and
assembles the reader's objects (any TP pair), which ``kvgroups_core.load`` then takes.

Layer streaming needs byte ranges and is the NIXL transport's (a layer subset here raises
``UnsupportedConfigError``). A pull never blocks: readiness is polled against the deadline, and a
pull past it is abandoned (JAX expires it on its own).
"""

from __future__ import annotations

import datetime
import hashlib
from typing import Any, Sequence

from kvgroups_core.errors import KVGroupsValueError, UnsupportedConfigError

from .base import Copy, PoolInfo, Publication, TransferHandle
from .errors import PeerUnavailableError, TransportError, TransportUnavailableError
from .side_channel import SideChannelTransport


def import_jax_transfer() -> tuple[Any, Any]:
    """``(jax, jax.experimental.transfer)``."""
    try:
        import jax
        from jax.experimental import transfer
    except ImportError as exc:
        raise TransportUnavailableError(
            f"transport 'jax_transfer': expected JAX with jax.experimental.transfer "
            f"(pip install 'jax>=0.10'), got {exc}"
        ) from None
    return jax, transfer


def transfer_id(request_id: str, chunk: int, object_group: int, reader: int) -> int:
    """The transfer server's id of one (request, chunk, object group) offer to one reader."""
    digest = hashlib.blake2b(
        f"{request_id}\0{chunk}\0{object_group}\0{reader}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") >> 1


class JaxTransferTransport(SideChannelTransport):
    """Memory objects over ``jax.experimental.transfer`` (see the module doc).

    Parameters
    ----------
    name : str
        Unused beyond symmetry with the other transports.
    host, port : side-channel address (port 0 picks a free one).
    publication_ttl_s, side_channel_timeout_s : as for the NIXL transport.
    device : jax.Device, optional
        Where pulled arrays land and whose client serves transfers (default: the first).
    """

    hello_keys = ("address",)

    name = "jax_transfer"
    produces_arrays = True  # pulls return new arrays instead of filling registered entries

    def __init__(
        self,
        name: str = "kvgroups",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        publication_ttl_s: float = 120.0,
        side_channel_timeout_s: float = 5.0,
        device: Any = None,
    ) -> None:
        self._jax, transfer = import_jax_transfer()
        self._device = device or self._jax.devices()[0]
        self._server = transfer.start_transfer_server(
            self._device.client, f"{host}:0", [f"{host}:0"]
        )
        self._address = self._server.address()
        self._pools: dict[str, tuple[PoolInfo, list]] = {}
        self._connections: dict[str, Any] = {}
        self._start_side_channel(host, port, publication_ttl_s, side_channel_timeout_s)

    def _hello(self) -> dict:
        return {
            "transport": self.name,
            "address": self._address,
            "pools": [info.to_dict() for info, _ in list(self._pools.values())],
        }

    # --- the writer -------------------------------------------------------------------

    def register_pool(
        self, pool_id: str, buffers: Sequence[Any], object_nbytes: Sequence[int]
    ) -> PoolInfo:
        sizes = [int(n) for n in object_nbytes]
        shapes = [tuple(b.shape) for b in buffers]
        if (
            len(shapes) != len(sizes)
            or any(len(s) != 2 or s[1] != n for s, n in zip(shapes, sizes))
            or len({s[0] for s in shapes}) != 1
        ):
            raise KVGroupsValueError(
                f"buffers: expected [capacity, object_nbytes] arrays of one capacity for "
                f"objects of {sizes}, got shapes {shapes}"
            )
        info = PoolInfo(
            pool_id=pool_id, bases=(), object_nbytes=tuple(sizes), capacity=shapes[0][0]
        )
        self._pools[pool_id] = (info, list(buffers))
        return info

    def update_pool(self, pool_id: str, buffers: Sequence[Any]) -> None:
        """The pool's current arrays (a JAX store returns new ones): hand them over before
        publishing what they hold."""
        info, _ = self._pools[pool_id]
        self._pools[pool_id] = (info, list(buffers))

    def deregister_pool(self, pool_id: str) -> None:
        if self._pools.pop(pool_id, None) is not None:
            self._table.release_pool(pool_id)

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
        readers: int = 1,
    ) -> Publication:
        """As :meth:`Transport.publish`; ``readers``: the reading group's TP degree (each
        reader rank pulls its own copy of what it needs)."""
        if layers_ready is not None:
            raise UnsupportedConfigError(
                "layers_ready: expected None (jax.experimental.transfer moves whole objects; "
                "layer streaming needs the 'nixl' transport)"
            )
        if pool_id not in self._pools:
            raise KVGroupsValueError(
                f"pool_id: expected a registered pool ({sorted(self._pools)}), got {pool_id!r}"
            )
        info, buffers = self._pools[pool_id]
        pub = self._offer(
            request_id,
            pool_id,
            entries,
            info.capacity,
            chunk_tokens=chunk_tokens,
            fingerprint=fingerprint,
            tp_size=tp_size,
            object_layout=object_layout,
            endpoints=endpoints,
            chunk_hashes=chunk_hashes,
            layers_ready=None,
        )
        expires = datetime.datetime.now() + datetime.timedelta(seconds=self.publication_ttl_s)
        for chunk, entry in enumerate(pub.entries):
            for og, buf in enumerate(buffers):
                row = buf[entry]
                for reader in range(int(readers)):
                    self._server.await_pull(
                        transfer_id(pub.request_id, chunk, og, reader), [row], timeout=expires
                    )
        return pub

    # --- the reader -------------------------------------------------------------------

    def _connection(self, publication: Publication, rank: int) -> Any:
        hello = self._hello_of(publication, rank)
        conn = self._connections.get(hello["address"])
        if conn is None:
            try:
                conn = self._server.connect(hello["address"])
            except Exception as exc:  # noqa: BLE001 - the runtime's own error classes
                raise PeerUnavailableError(
                    f"writer rank {rank} at {hello['address']}: {exc}"
                ) from exc
            self._connections[hello["address"]] = conn
        return conn

    def pull_objects(
        self,
        publication: Publication,
        rank: int,
        wanted: Sequence[tuple[int, int]],
        object_nbytes: Sequence[int],
        *,
        reader: int = 0,
        timeout: float = 30.0,
    ) -> TransferHandle:
        """Pull the objects ``(object group, chunk)`` of ``wanted`` from writer rank
        ``rank``; once done, ``handle.native[(og, chunk)]`` is each one's uint8 array."""
        jax = self._jax
        handle = self._handle(
            publication, rank, len(wanted), sum(object_nbytes[og] for og, _ in wanted), timeout
        )
        self._status(publication, rank)
        conn = self._connection(publication, rank)
        sharding = jax.sharding.SingleDeviceSharding(self._device)
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=float(timeout))
        arrays = {}
        for og, chunk in wanted:
            spec = jax.ShapeDtypeStruct((object_nbytes[og],), jax.numpy.uint8, sharding=sharding)
            (arrays[(og, chunk)],) = conn.pull(
                transfer_id(publication.request_id, chunk, og, reader), [spec], timeout=deadline
            )
        handle.native = arrays
        handle.after = lambda: self._status(publication, rank)
        return handle

    def _start(
        self,
        op: str,
        publication: Publication,
        rank: int,
        pool_id: str,
        copies: Sequence[Copy],
        handle: TransferHandle,
    ) -> None:
        raise UnsupportedConfigError(
            "copies: expected whole objects (pull_objects); jax.experimental.transfer moves "
            "arrays, not byte ranges of registered memory"
        )

    def _progress(self, handle: TransferHandle) -> bool:
        arrays = handle.native or {}
        if not all(a.is_ready() for a in arrays.values()):
            return False
        try:
            self._jax.block_until_ready(list(arrays.values()))  # ready: raises, never waits
        except Exception as exc:  # noqa: BLE001 - JaxRuntimeError
            raise TransportError(f"transfer from {handle.peer}: {exc}") from exc
        return True

    def _abandon(self, handle: TransferHandle) -> None:
        handle.native = None  # JAX expires the pull at its deadline on its own

    def close(self) -> None:
        self._side.close()
        self._pools.clear()
        self._connections.clear()
