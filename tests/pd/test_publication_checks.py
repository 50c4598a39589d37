"""A publication comes from another process: every field of ``Publication.from_dict`` and
every argument of ``Receiver`` is checked (type and range, no coercion) with a typed error
naming it, before anything is reserved or posted. No transport package needed: the
receiver runs on a transport double that records what it is asked and refuses any transfer."""

from __future__ import annotations

import json
import socketserver
import threading

import numpy as np
import pytest
from kvgroups_transport import (
    FingerprintMismatchError,
    PeerUnavailableError,
    Publication,
    Receiver,
    check_publication,
)
from kvgroups_transport.base import PoolInfo, Transport
from kvgroups_transport.side_channel import ask

from kvgroups_core import (
    EngineKVFormat,
    KVGroupsError,
    KVGroupsTypeError,
    KVGroupsValueError,
    KVLayerGroupsManager,
)

CHUNK = 16


class RecordingTransport(Transport):
    """Registers pools (the receiver's staging) and records it; refuses to move a byte."""

    name = "recording"

    def __init__(self) -> None:
        self.pools: list[str] = []

    def register_pool(self, pool_id, buffers, object_nbytes):
        self.pools.append(pool_id)
        return PoolInfo(pool_id=pool_id, bases=(), object_nbytes=(), capacity=0)

    def _start(self, op, publication, rank, pool_id, copies, handle):
        raise AssertionError("a transfer was posted")

    def deregister_pool(self, pool_id): ...
    def endpoint(self): ...
    def publish(self, *args, **kwargs): ...
    def mark_ready(self, request_id, layers_ready): ...
    def release(self, request_id): ...
    def release_remote(self, publication, reader=0, readers=1): ...
    def layers_ready(self, publication, rank): ...
    def _progress(self, handle): ...
    def _abandon(self, handle): ...
    def close(self): ...


def reader_manager() -> KVLayerGroupsManager:
    caches = [np.zeros((2, 32, 4, 2, 8), np.float32) for _ in range(2)]
    return KVLayerGroupsManager(
        caches, [EngineKVFormat.NL_X_TWO_NB_BS_NH_HS] * 2, lmcache_tokens_per_chunk=CHUNK
    )


def good(manager=None, **changes) -> dict:
    d = {
        "request_id": "r",
        "transport": "nixl",
        "pool_id": "p",
        "entries": [2, 3, 4],
        "chunk_tokens": CHUNK,
        "fingerprint": (manager or reader_manager()).fingerprint(across_degrees=True),
        "tp_size": 1,
        "object_layout": "canonical",
        "endpoints": [{"host": "127.0.0.1", "port": 5600}],
        "chunk_hashes": [],
    }
    d.update(changes)
    return d


BAD_FIELDS = [
    ("entries", ["a"], KVGroupsTypeError, "publication.entries[0]"),
    ("entries", None, KVGroupsTypeError, "publication.entries"),
    ("entries", {"a": 1}, KVGroupsTypeError, "publication.entries"),
    ("entries", [2, 3.0, 4], KVGroupsTypeError, "publication.entries[1]"),
    ("entries", [2.9, 3.9, 4.9], KVGroupsTypeError, "publication.entries[0]"),
    ("entries", [True, 3, 4], KVGroupsTypeError, "publication.entries[0]"),
    ("entries", [-1, 3, 4], KVGroupsValueError, "publication.entries[0]"),
    ("entries", [2, 3, 2**64], KVGroupsValueError, "publication.entries[2]"),
    ("tp_size", None, KVGroupsTypeError, "publication.tp_size"),
    ("tp_size", 1.9, KVGroupsTypeError, "publication.tp_size"),
    ("tp_size", "1", KVGroupsTypeError, "publication.tp_size"),
    ("tp_size", True, KVGroupsTypeError, "publication.tp_size"),
    ("tp_size", 0, KVGroupsValueError, "publication.tp_size"),
    ("tp_size", -1, KVGroupsValueError, "publication.tp_size"),
    ("tp_size", 2**20, KVGroupsValueError, "publication.endpoints: expected one endpoint per"),
    ("chunk_tokens", 1.9, KVGroupsTypeError, "publication.chunk_tokens"),
    ("chunk_tokens", "16", KVGroupsTypeError, "publication.chunk_tokens"),
    ("chunk_tokens", 0, KVGroupsValueError, "publication.chunk_tokens"),
    ("endpoints", "127.0.0.1:5600", KVGroupsTypeError, "publication.endpoints"),
    ("endpoints", [], KVGroupsValueError, "publication.endpoints"),
    ("endpoints", ["ab"], KVGroupsTypeError, "publication.endpoints[0]"),
    (
        "endpoints",
        [{"host": "h"}],
        KVGroupsValueError,
        "publication.endpoints[0]: expected the key 'port'",
    ),
    ("endpoints", [{"host": "h", "port": "x"}], KVGroupsTypeError, "publication.endpoints[0].port"),
    (
        "endpoints",
        [{"host": "h", "port": 5600.0}],
        KVGroupsTypeError,
        "publication.endpoints[0].port",
    ),
    (
        "endpoints",
        [{"host": "h", "port": 70000}],
        KVGroupsValueError,
        "publication.endpoints[0].port",
    ),
    ("endpoints", [{"host": 5, "port": 1}], KVGroupsTypeError, "publication.endpoints[0].host"),
    ("endpoints", [{"host": "", "port": 1}], KVGroupsValueError, "publication.endpoints[0].host"),
    ("chunk_hashes", 5, KVGroupsTypeError, "publication.chunk_hashes"),
    ("chunk_hashes", ["aa"], KVGroupsValueError, "publication.chunk_hashes"),
    ("chunk_hashes", [1, 2, 3], KVGroupsTypeError, "publication.chunk_hashes[0]"),
    ("request_id", 5, KVGroupsTypeError, "publication.request_id"),
    ("transport", None, KVGroupsTypeError, "publication.transport"),
    ("pool_id", ["p"], KVGroupsTypeError, "publication.pool_id"),
    ("fingerprint", None, KVGroupsTypeError, "publication.fingerprint"),
    ("object_layout", "bogus", KVGroupsValueError, "publication.object_layout"),
    ("object_layout", 0, KVGroupsTypeError, "publication.object_layout"),
]


@pytest.mark.parametrize("key, value, error, name", BAD_FIELDS)
def test_a_malformed_field_is_refused_by_name(key, value, error, name):
    with pytest.raises(error) as info:
        Publication.from_dict(good(**{key: value}))
    assert str(info.value).startswith(name), str(info.value)


def test_well_formed_publications_are_read_as_given():
    d = good(
        tp_size=2,
        endpoints=[{"host": "a", "port": 1}, {"host": "b", "port": 65535, "agent": "x"}],
        chunk_hashes=["aa", "bb", "cc"],
        extra="ignored",
    )
    pub = Publication.from_dict(d)
    assert pub.entries == (2, 3, 4) and pub.tp_size == 2 and pub.chunk_hashes == ("aa", "bb", "cc")
    assert pub.endpoints[1] == {"host": "b", "port": 65535, "agent": "x"}
    assert Publication.from_dict(json.loads(json.dumps(pub.to_dict()))) == pub
    assert Publication.from_dict(good(entries=np.array([1, 2]).tolist())).entries == (1, 2)
    with pytest.raises(KVGroupsValueError, match="'entries'"):
        Publication.from_dict({k: v for k, v in d.items() if k != "entries"})


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"capacity": None}, KVGroupsTypeError, "capacity"),
        ({"capacity": 1.5}, KVGroupsTypeError, "capacity"),
        ({"capacity": "4"}, KVGroupsTypeError, "capacity"),
        ({"capacity": True}, KVGroupsTypeError, "capacity"),
        ({"capacity": -1}, KVGroupsValueError, "capacity"),
        ({"capacity": 0}, KVGroupsValueError, "capacity"),
        ({"capacity": 2**40}, KVGroupsValueError, "capacity"),
        ({"capacity": 4, "timeout_s": "x"}, KVGroupsTypeError, "timeout_s"),
        ({"capacity": 4, "timeout_s": None}, KVGroupsTypeError, "timeout_s"),
        ({"capacity": 4, "timeout_s": 0}, KVGroupsValueError, "timeout_s"),
        ({"capacity": 4, "timeout_s": -1.0}, KVGroupsValueError, "timeout_s"),
        ({"capacity": 4, "timeout_s": float("nan")}, KVGroupsValueError, "timeout_s"),
        ({"capacity": 4, "timeout_s": float("inf")}, KVGroupsValueError, "timeout_s"),
        ({"capacity": 4, "timeout_s": 10**400}, KVGroupsValueError, "timeout_s"),
        ({"capacity": 4, "name": 3}, KVGroupsTypeError, "name"),
    ],
)
def test_receiver_arguments_are_refused_by_name(kwargs, error, name):
    transport = RecordingTransport()
    with pytest.raises(error) as info:
        Receiver(reader_manager(), transport, **kwargs)
    assert str(info.value).startswith(f"{name}: expected"), str(info.value)
    assert transport.pools == []


def test_receiver_needs_a_manager_and_a_transport():
    with pytest.raises(KVGroupsTypeError, match="^manager: expected a KVLayerGroupsManager"):
        Receiver(None, RecordingTransport(), capacity=4)
    with pytest.raises(KVGroupsTypeError, match="^transport: expected a Transport"):
        Receiver(reader_manager(), "nixl", capacity=4)


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"first_chunk": 1.5}, KVGroupsTypeError, "first_chunk"),
        ({"first_chunk": "1"}, KVGroupsTypeError, "first_chunk"),
        ({"first_chunk": None}, KVGroupsTypeError, "first_chunk"),
        ({"first_chunk": True}, KVGroupsTypeError, "first_chunk"),
        ({"first_chunk": -1}, KVGroupsValueError, "first_chunk"),
        ({"first_chunk": 4}, KVGroupsValueError, "first_chunk"),
        ({"num_chunks": 1.9}, KVGroupsTypeError, "num_chunks"),
        ({"num_chunks": "2"}, KVGroupsTypeError, "num_chunks"),
        ({"num_chunks": -1}, KVGroupsValueError, "num_chunks"),
        ({"num_chunks": 4}, KVGroupsValueError, "num_chunks"),
    ],
)
def test_begin_refuses_bad_chunk_arguments_before_reserving_anything(kwargs, error, name):
    m = reader_manager()
    transport = RecordingTransport()
    rx = Receiver(m, transport, capacity=4)
    with pytest.raises(error) as info:
        rx.begin(Publication.from_dict(good(m)), **kwargs)
    assert str(info.value).startswith(f"{name}: expected"), str(info.value)
    assert transport.pools == [] and rx._free == [0, 1, 2, 3]


def test_a_chunk_size_that_contradicts_the_fingerprint_is_refused():
    m = reader_manager()
    pub = Publication.from_dict(good(m, chunk_tokens=2 * CHUNK))
    with pytest.raises(FingerprintMismatchError, match="chunk 32 tokens"):
        check_publication(m, pub)
    rx = Receiver(m, RecordingTransport(), capacity=4)
    with pytest.raises(FingerprintMismatchError):
        rx.begin(pub)
    assert rx._free == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "layers, error",
    [
        (0, KVGroupsTypeError),
        ("0", KVGroupsTypeError),
        ([0.0], KVGroupsTypeError),
        ([True], KVGroupsTypeError),
        ([], KVGroupsValueError),
        ([0, 0], KVGroupsValueError),
        ([2], IndexError),
        ([-1], IndexError),
    ],
)
def test_pull_refuses_bad_layers_before_posting(layers, error):
    m = reader_manager()
    transport = RecordingTransport()
    rx = Receiver(m, transport, capacity=4)
    job = rx.begin(Publication.from_dict(good(m)))
    with pytest.raises(error) as info:
        rx.pull(job, layers=layers)  # the double raises AssertionError if anything is posted
    assert isinstance(info.value, KVGroupsError)
    assert str(info.value).startswith("layers: expected"), str(info.value)
    assert job.handles == []
    with pytest.raises(KVGroupsTypeError, match="^job: expected a PullJob"):
        rx.pull(None)


def test_an_endpoint_that_is_no_side_channel_is_a_peer_error():
    class Garbage(socketserver.StreamRequestHandler):
        def handle(self):
            self.rfile.readline()
            self.wfile.write(b"HTTP/1.1 400 Bad Request\n")

    server = socketserver.TCPServer(("127.0.0.1", 0), Garbage)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        for _ in range(2):  # a JSON list answer too
            with pytest.raises(PeerUnavailableError, match="expected a JSON object answer"):
                ask(host, port, {"op": "hello"}, timeout=5.0)
            Garbage.handle = lambda self: (self.rfile.readline(), self.wfile.write(b"[1]\n"))
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


GOOD_POOL = {"pool_id": "p", "bases": [4096], "object_nbytes": [512], "capacity": 8}


@pytest.mark.parametrize(
    "change, error, name",
    [
        ({"bases": 4096}, KVGroupsTypeError, "pool.bases"),
        ({"bases": [4096.0]}, KVGroupsTypeError, r"pool.bases\[0\]"),
        ({"bases": [1, 2]}, KVGroupsValueError, "pool.bases"),
        ({"object_nbytes": ["512"]}, KVGroupsTypeError, r"pool.object_nbytes\[0\]"),
        ({"capacity": -1}, KVGroupsValueError, "pool.capacity"),
        ({"capacity": True}, KVGroupsTypeError, "pool.capacity"),
        ({"pool_id": 5}, KVGroupsTypeError, "pool.pool_id"),
        ({"device_id": "0"}, KVGroupsTypeError, "pool.device_id"),
        ({"capacity": None}, KVGroupsTypeError, "pool.capacity"),
    ],
)
def test_a_peers_pool_is_checked_field_by_field(change, error, name):
    assert PoolInfo.from_dict(GOOD_POOL) == PoolInfo(
        pool_id="p", bases=(4096,), object_nbytes=(512,), capacity=8
    )
    with pytest.raises(error, match=f"^{name}: expected"):
        PoolInfo.from_dict({**GOOD_POOL, **change})
    with pytest.raises(KVGroupsValueError, match="^pool: expected the key 'capacity'"):
        PoolInfo.from_dict({k: v for k, v in GOOD_POOL.items() if k != "capacity"})
    with pytest.raises(KVGroupsTypeError, match="^pool: expected a dict"):
        PoolInfo.from_dict([GOOD_POOL])


def test_a_hello_without_the_transports_keys_is_a_transport_error(monkeypatch):
    from kvgroups_transport import TransportError, side_channel

    class Peer(side_channel.SideChannelTransport, RecordingTransport):
        name = "nixl"
        hello_keys = ("agent", "metadata")
        timeout_s = 1.0

    publication = Publication.from_dict(good(reader_manager()))
    answers = iter([{"transport": "nixl", "agent": "a"}, ["nixl"], {"transport": "other"}])
    monkeypatch.setattr(side_channel, "ask", lambda *args: next(answers))
    with pytest.raises(TransportError, match=r"expected a hello with \['agent', 'metadata'\]"):
        Peer()._hello_of(publication, 0)
    for _ in range(2):
        with pytest.raises(TransportError, match="expected a 'nixl' transport"):
            Peer()._hello_of(publication, 0)


def test_endpoints_with_odd_keys_are_refused_and_ports_come_back_as_plain_ints():
    for endpoint, missing in (({"host": "h", 1: 2}, "port"), ({"port": 1, (1,): 2}, "host")):
        with pytest.raises(
            KVGroupsValueError, match=f"endpoints\\[0\\]: expected the key '{missing}'"
        ):
            Publication.from_dict(good(endpoints=[endpoint]))
    pub = Publication.from_dict(good(endpoints=[{"host": "h", "port": np.int64(5600)}]))
    assert type(pub.endpoints[0]["port"]) is int
    assert json.loads(json.dumps(pub.to_dict()))["endpoints"] == [{"host": "h", "port": 5600}]
