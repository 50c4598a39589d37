"""The side channel: a small TCP service each writer rank runs beside its transport.

Readers ask it three things, one JSON line each way, one connection per question:

- ``{"op": "hello"}``: the transport's own connection data (NIXL agent metadata, a JAX
  transfer server's address) and the registered pools (:class:`PoolInfo`);
- ``{"op": "status", "request": id, "entries": [...]}``: whether the request is still
  published with those entries, and how many layers are ready (layer streaming);
- ``{"op": "release", "request": id, "reader": r, "readers": d}``: reader rank ``r`` of a
  TP group of ``d`` is done; the publication goes once all ``d`` have said so.

A publication the reader never releases expires after ``ttl_s``; a released, expired or
unknown one answers ``"released"``, so a reader never trusts entries that may hold other bytes.
Every client call has a timeout: a peer that is gone raises :class:`PeerUnavailableError`, one that
does not answer :class:`TransferTimeoutError`.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .base import Publication, Transport, checked_int
from .errors import (
    PeerUnavailableError,
    PublicationReleasedError,
    TransferTimeoutError,
    TransportError,
)

_MAX_LINE = 64 << 20


@dataclass
class _Record:
    pool_id: str
    entries: tuple[int, ...]
    layers_ready: int | None
    expires: float
    released_by: set[int] = field(default_factory=set)


class PublicationTable:
    """The writer's live publications (thread-safe: the side channel reads it)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = float(ttl_s)
        self._lock = threading.Lock()
        self._live: dict[str, _Record] = {}

    def add(
        self, request_id: str, pool_id: str, entries: tuple[int, ...], layers_ready: int | None
    ) -> None:
        with self._lock:
            self._live[request_id] = _Record(
                pool_id, entries, layers_ready, time.monotonic() + self.ttl_s
            )

    def mark_ready(self, request_id: str, layers_ready: int | None) -> None:
        with self._lock:
            record = self._live.get(request_id)
            if record is None:
                raise PublicationReleasedError(f"request {request_id!r}: not published here")
            record.layers_ready = layers_ready

    def release(self, request_id: str, reader: int | None = None, readers: int = 1) -> bool:
        """Drop a publication: at once (``reader`` None: the writer itself), or once each of
        the ``readers`` ranks of the reading TP group has released it."""
        with self._lock:
            record = self._live.get(request_id)
            if record is None:
                return False
            if reader is not None:
                record.released_by.add(int(reader))
                if len(record.released_by) < int(readers):
                    return False
            del self._live[request_id]
            return True

    def release_pool(self, pool_id: str) -> None:
        with self._lock:
            for rid in [r for r, e in self._live.items() if e.pool_id == pool_id]:
                del self._live[rid]

    def live(self) -> list[str]:
        """Requests still published (expired ones are dropped here)."""
        self._expire()
        with self._lock:
            return list(self._live)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for rid in [r for r, e in self._live.items() if e.expires < now]:
                del self._live[rid]

    def status(self, request_id: str, entries: Any) -> dict:
        self._expire()
        with self._lock:
            record = self._live.get(request_id)
            if record is None or (entries is not None and tuple(entries) != record.entries):
                return {"state": "released"}
            return {
                "state": "published",
                "layers_ready": record.layers_ready,
                "pool_id": record.pool_id,
            }


class SideChannel:
    """The writer's side-channel server (a daemon thread); ``hello`` returns ``hello()``."""

    def __init__(
        self, host: str, port: int, table: PublicationTable, hello: Callable[[], dict]
    ) -> None:
        self.table = table
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline(_MAX_LINE)
                if not line:
                    return
                try:
                    reply = outer._answer(json.loads(line))
                except Exception as exc:  # noqa: BLE001 - reported to the asking peer
                    reply = {"error": f"{type(exc).__name__}: {exc}"}
                self.wfile.write(json.dumps(reply).encode() + b"\n")

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._hello = hello
        self._server = Server((host, int(port)), Handler)
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            name=f"kvgroups-side-channel-{self.port}",
            daemon=True,
        )
        self._thread.start()

    def _answer(self, msg: dict) -> dict:
        op = msg.get("op")
        if op == "hello":
            return self._hello()
        if op == "status":
            return self.table.status(str(msg["request"]), msg.get("entries"))
        if op == "release":
            return {
                "released": self.table.release(
                    str(msg["request"]), int(msg.get("reader", 0)), int(msg.get("readers", 1))
                )
            }
        return {"error": f"op: expected 'hello', 'status' or 'release', got {op!r}"}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def ask(host: str, port: int, msg: dict, timeout: float) -> dict:
    """One question to a side channel (see the module doc for the errors)."""
    where = f"{host}:{port}"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(json.dumps(msg).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                part = sock.recv(1 << 20)
                if not part:
                    break
                data += part
    except (socket.timeout, TimeoutError):
        raise TransferTimeoutError(
            f"side channel {where}: expected an answer to {msg.get('op')!r} within {timeout} s, "
            "got none"
        ) from None
    except OSError as exc:
        raise PeerUnavailableError(
            f"side channel {where}: cannot reach the writer ({exc})"
        ) from None
    if not data.endswith(b"\n"):
        raise PeerUnavailableError(f"side channel {where}: the writer closed the connection")
    try:
        reply = json.loads(data)
    except ValueError:  # not a side channel (an endpoint from a bad publication)
        reply = None
    if not isinstance(reply, dict):
        raise PeerUnavailableError(
            f"side channel {where}: expected a JSON object answer, got {data[:80]!r}"
        )
    if "error" in reply:
        raise PeerUnavailableError(f"side channel {where}: {reply['error']}")
    return reply


class SideChannelTransport(Transport):
    """What every transport with a side channel shares: the writer's publication table and
    server, and the reader's questions (status, layers ready, release)."""

    # The keys a writer's hello carries for this transport (a peer's word: checked on arrival).
    hello_keys: tuple[str, ...] = ()

    def _start_side_channel(
        self, host: str, port: int, publication_ttl_s: float, side_channel_timeout_s: float
    ) -> None:
        self.publication_ttl_s = float(publication_ttl_s)
        self.timeout_s = float(side_channel_timeout_s)
        self._table = PublicationTable(self.publication_ttl_s)
        self._side = SideChannel(host, port, self._table, self._hello)

    def _hello(self) -> dict:
        """The transport's own connection data (runs on the side channel's thread)."""
        raise NotImplementedError

    def endpoint(self) -> dict:
        return {"host": self._side.host, "port": self._side.port}

    def _offer(
        self,
        request_id: str,
        pool_id: str,
        entries: Sequence[int],
        capacity: int,
        *,
        chunk_tokens: int,
        fingerprint: str,
        tp_size: int,
        object_layout: str,
        endpoints: Sequence[dict] | None,
        chunk_hashes: Sequence[str],
        layers_ready: int | None,
    ) -> Publication:
        from kvgroups_core.errors import KVGroupsValueError

        entries = tuple(checked_int(s, f"entries[{i}]", -(2**63)) for i, s in enumerate(entries))
        bad = [s for s in entries if not 0 <= s < capacity]
        if bad:
            raise KVGroupsValueError(f"entries: expected entries in [0, {capacity}), got {bad}")
        self._table.add(str(request_id), pool_id, entries, layers_ready)
        return Publication(
            request_id=str(request_id),
            transport=self.name,
            pool_id=pool_id,
            entries=entries,
            chunk_tokens=int(chunk_tokens),
            fingerprint=str(fingerprint),
            tp_size=int(tp_size),
            object_layout=str(object_layout),
            endpoints=tuple(endpoints or (self.endpoint(),)),
            chunk_hashes=tuple(chunk_hashes),
        )

    def mark_ready(self, request_id: str, layers_ready: int | None) -> None:
        self._table.mark_ready(str(request_id), layers_ready)

    def release(self, request_id: str) -> None:
        self._table.release(str(request_id))

    def published(self) -> list[str]:
        """Requests this side still offers (released and expired ones are gone)."""
        return self._table.live()

    def _status(self, publication: Publication, rank: int) -> dict:
        e = publication.endpoints[rank]
        reply = ask(
            e["host"],
            e["port"],
            {
                "op": "status",
                "request": publication.request_id,
                "entries": list(publication.entries),
            },
            self.timeout_s,
        )
        if reply.get("state") != "published":
            raise PublicationReleasedError(
                f"request {publication.request_id!r}: writer rank {rank} at "
                f"{e['host']}:{e['port']} no longer publishes it (released, expired or never "
                f"published with these entries)"
            )
        return reply

    def _hello_of(self, publication: Publication, rank: int) -> dict:
        e = publication.endpoints[rank]
        hello = ask(e["host"], e["port"], {"op": "hello"}, self.timeout_s)
        where = f"writer rank {rank} at {e['host']}:{e['port']}"
        if not isinstance(hello, dict) or hello.get("transport") != self.name:
            got = hello.get("transport") if isinstance(hello, dict) else hello
            raise TransportError(f"{where}: expected a {self.name!r} transport, got {got!r}")
        missing = [k for k in self.hello_keys if k not in hello]
        if missing:
            raise TransportError(
                f"{where}: expected a hello with {list(self.hello_keys)}, got keys "
                f"{sorted(map(str, hello))}"
            )
        return hello

    def layers_ready(self, publication: Publication, rank: int) -> int | None:
        return self._status(publication, rank).get("layers_ready")

    def release_remote(self, publication: Publication, reader: int = 0, readers: int = 1) -> None:
        msg = {
            "op": "release",
            "request": publication.request_id,
            "reader": int(reader),
            "readers": int(readers),
        }
        for e in publication.endpoints:
            try:
                ask(e["host"], e["port"], msg, self.timeout_s)
            except (PeerUnavailableError, TransportError):
                pass  # a writer that is gone has nothing left to release
