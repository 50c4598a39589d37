"""NIXL as a kvgroups transport (``pip install nixl-cu12``, or ``nixl-cu13`` for CUDA 13).

One NIXL agent per engine rank; pools are registered with it once (``DRAM`` for host memory,
``VRAM`` for device memory). Peers exchange agent metadata through the side channel
(:mod:`.side_channel`), so no etcd or NIXL listener thread is needed. A pull is one NIXL
``READ`` request of one descriptor per :class:`~kvgroups_transport.base.Copy`; NIXL merges
descriptors that are consecutive on both sides once more, and its count after merging is
reported (``TransferStats.posted_descriptors``, from NIXL's telemetry).

Backends default to ``["UCX"]``: on a machine without RDMA, UCX moves the bytes over shared
memory or TCP loopback, which is how CI runs it; on a GPU with a CUDA-enabled wheel, UCX's
CUDA transports move device memory.
"""

from __future__ import annotations

import base64
import importlib
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvgroups_core.errors import KVGroupsValueError, UnsupportedConfigError

from .base import Copy, PoolInfo, Publication, TransferHandle, checked_int, memory_region
from .errors import (
    PeerUnavailableError,
    PublicationReleasedError,
    TransportError,
    TransportUnavailableError,
)
from .side_channel import SideChannelTransport

_MEM = {"cpu": "DRAM", "cuda": "VRAM"}


def import_nixl() -> tuple[Any, Any]:
    """``(nixl_agent, nixl_agent_config)`` from whichever NIXL wheel is installed."""
    for name in ("nixl", "nixl_cu12", "nixl_cu13"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "nixl_agent"):
            return module.nixl_agent, module.nixl_agent_config
    raise TransportUnavailableError(
        "transport 'nixl': expected the NIXL Python package (pip install nixl-cu12, or "
        "nixl-cu13 on CUDA 13), got none installed"
    )


@dataclass
class _Pool:
    info: PoolInfo
    registration: Any
    mem: str
    buffers: list  # held so the registered memory outlives every transfer into or out of it


@dataclass
class _Peer:
    agent: str
    epoch: int
    pools: dict[str, PoolInfo]


class NixlTransport(SideChannelTransport):
    """Memory objects over NIXL (see the module doc).

    Parameters
    ----------
    name : str
        Prefix of this side's agent name (a unique suffix is added per process).
    backends : list of str, default ["UCX"]
        NIXL backends to create; each must be a plugin the wheel ships.
    host, port : side-channel address (port 0 picks a free one; see :meth:`endpoint`).
    publication_ttl_s : seconds a publication stays pullable unless released.
    side_channel_timeout_s : deadline of each side-channel question.
    """

    hello_keys = ("agent", "metadata", "epoch", "pools")

    name = "nixl"

    def __init__(
        self,
        name: str = "kvgroups",
        *,
        backends: Sequence[str] = ("UCX",),
        host: str = "127.0.0.1",
        port: int = 0,
        publication_ttl_s: float = 120.0,
        side_channel_timeout_s: float = 5.0,
    ) -> None:
        nixl_agent, nixl_agent_config = import_nixl()
        self.agent_name = f"{name}-{uuid.uuid4().hex[:12]}"
        self.backends = list(backends)
        config = nixl_agent_config(
            enable_prog_thread=True,
            enable_listen_thread=False,
            backends=self.backends,
            capture_telemetry=True,
        )
        self._agent = nixl_agent(self.agent_name, config)
        missing = [b for b in self.backends if b not in self._agent.backends]
        if missing:
            raise UnsupportedConfigError(
                f"nixl_backends: expected plugins this NIXL wheel ships "
                f"({sorted(self._agent.get_plugin_list())}), got {missing}"
            )
        self._pools: dict[str, _Pool] = {}
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._lingering: list[Any] = []  # handles NIXL could not cancel yet
        self._epoch = 0
        self._metadata = self._agent.get_agent_metadata()
        self._start_side_channel(host, port, publication_ttl_s, side_channel_timeout_s)

    # --- registration and publication (the writer) ----------------------------------

    def _hello(self) -> dict:
        # Runs on the side channel's thread: only data the main thread prepared.
        return {
            "transport": self.name,
            "agent": self.agent_name,
            "epoch": self._epoch,
            "metadata": base64.b64encode(self._metadata).decode(),
            "pools": [p.info.to_dict() for p in list(self._pools.values())],
        }

    def register_pool(
        self, pool_id: str, buffers: Sequence[Any], object_nbytes: Sequence[int]
    ) -> PoolInfo:
        if pool_id in self._pools:
            raise KVGroupsValueError(f"pool_id: expected a new pool id, got {pool_id!r} again")
        regions = [memory_region(b) for b in buffers]
        sizes = [int(n) for n in object_nbytes]
        if len(regions) != len(sizes) or not regions:
            raise KVGroupsValueError(
                f"buffers: expected one buffer per object group ({len(sizes)}), got {len(regions)}"
            )
        capacities = {r.nbytes // n for r, n in zip(regions, sizes) if n}
        devices = {(r.device, r.device_id) for r in regions}
        if (
            len(capacities) != 1
            or len(devices) != 1
            or any(r.nbytes % n for r, n in zip(regions, sizes) if n)
        ):
            raise KVGroupsValueError(
                f"buffers: expected [capacity, object_nbytes] buffers of one capacity on one "
                f"device, got {[r.nbytes for r in regions]} bytes for objects of {sizes} on "
                f"{sorted(devices)}"
            )
        device, device_id = devices.pop()
        mem = _MEM[device]
        registration = self._agent.register_memory(
            [(r.address, r.nbytes, r.device_id, "") for r in regions], mem
        )
        info = PoolInfo(
            pool_id=pool_id,
            bases=tuple(r.address for r in regions),
            object_nbytes=tuple(sizes),
            capacity=capacities.pop(),
            device=device,
            device_id=device_id,
        )
        self._pools[pool_id] = _Pool(info, registration, mem, list(buffers))
        self._refresh_metadata()
        return info

    def deregister_pool(self, pool_id: str) -> None:
        pool = self._pools.pop(pool_id, None)
        if pool is None:
            return
        self._table.release_pool(pool_id)
        self._agent.deregister_memory(pool.registration)
        self._refresh_metadata()

    def _refresh_metadata(self) -> None:
        self._metadata = self._agent.get_agent_metadata()
        self._epoch += 1

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
        pool = self._pools.get(pool_id)
        if pool is None:
            raise KVGroupsValueError(
                f"pool_id: expected a registered pool ({sorted(self._pools)}), got {pool_id!r}"
            )
        return self._offer(
            request_id,
            pool_id,
            entries,
            pool.info.capacity,
            chunk_tokens=chunk_tokens,
            fingerprint=fingerprint,
            tp_size=tp_size,
            object_layout=object_layout,
            endpoints=endpoints,
            chunk_hashes=chunk_hashes,
            layers_ready=layers_ready,
        )

    # --- the reader -----------------------------------------------------------------

    def _peer(self, publication: Publication, rank: int) -> _Peer:
        e = publication.endpoints[rank]
        key = (str(e["host"]), int(e["port"]))
        peer = self._peers.get(key)
        if peer is None:
            hello = self._hello_of(publication, rank)
            for old in [k for k, p in self._peers.items() if p.agent == hello["agent"]]:
                del self._peers[old]
            try:
                self._agent.remove_remote_agent(hello["agent"])
            except Exception:  # noqa: BLE001 - not loaded before: nothing to remove
                pass
            pools = [PoolInfo.from_dict(p) for p in _hello_list(hello["pools"], rank)]
            try:
                metadata = base64.b64decode(hello["metadata"], validate=True)
            except (TypeError, ValueError) as exc:
                raise TransportError(
                    f"writer rank {rank}: expected base64 agent metadata in its hello, got "
                    f"{type(hello['metadata']).__name__}"
                ) from exc
            self._agent.add_remote_agent(metadata)
            peer = _Peer(
                str(hello["agent"]),
                checked_int(hello["epoch"], f"writer rank {rank}: hello.epoch", 0),
                {p.pool_id: p for p in pools},
            )
            self._peers[key] = peer
        return peer

    def _start(
        self,
        op: str,
        publication: Publication,
        rank: int,
        pool_id: str,
        copies: Sequence[Copy],
        handle: TransferHandle,
    ) -> None:
        local = self._pools.get(pool_id)
        if local is None:
            raise KVGroupsValueError(
                f"pool_id: expected a registered local pool ({sorted(self._pools)}), got "
                f"{pool_id!r}"
            )
        self._status(publication, rank)
        peer = self._peer(publication, rank)
        remote = peer.pools.get(publication.pool_id)
        if remote is None:  # the writer registered it after our hello: ask again once
            self._peers.pop(
                (publication.endpoints[rank]["host"], int(publication.endpoints[rank]["port"])),
                None,
            )
            peer = self._peer(publication, rank)
            remote = peer.pools.get(publication.pool_id)
        if remote is None:
            raise PublicationReleasedError(
                f"request {publication.request_id!r}: writer rank {rank} has no pool "
                f"{publication.pool_id!r} registered"
            )
        local_descs = _descriptors(local.info, copies, "local")
        remote_descs = _descriptors(remote, copies, "remote")
        try:
            native = self._agent.initialize_xfer(
                op,
                self._agent.get_xfer_descs(local_descs, local.mem),
                self._agent.get_xfer_descs(remote_descs, _MEM[remote.device]),
                peer.agent,
            )
            state = self._agent.transfer(native)
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own classes
            self._forget_peer(publication, rank)
            raise _translate(exc, handle.peer) from exc
        handle.native = native
        if state == "ERR":
            raise TransportError(f"transfer from {handle.peer}: NIXL refused to post it")
        if op == "READ":
            # The bytes are usable only if the writer still held them when they landed.
            handle.after = lambda: self._status(publication, rank)

    def _progress(self, handle: TransferHandle) -> bool:
        try:
            state = self._agent.check_xfer_state(handle.native)
        except Exception as exc:  # noqa: BLE001
            raise _translate(exc, handle.peer) from exc
        if state == "ERR":
            raise TransportError(f"transfer from {handle.peer}: NIXL reports an error")
        if state != "DONE":
            return False
        try:
            handle.stats.posted_descriptors = int(
                self._agent.get_xfer_telemetry(handle.native).descCount
            )
        except Exception:  # noqa: BLE001 - telemetry is optional
            pass
        self._agent.release_xfer_handle(handle.native)
        handle.native = None
        return True

    def _abandon(self, handle: TransferHandle) -> None:
        if handle.native is None:
            return
        self._lingering.append(handle.native)
        handle.native = None
        self._abandon_retry()

    def uncancelled(self) -> int:
        self._abandon_retry()
        return len(self._lingering)

    def _abandon_retry(self) -> None:
        still = []
        for native in self._lingering:
            try:
                self._agent.release_xfer_handle(native)
            except Exception:  # noqa: BLE001 - still in flight: try again later
                still.append(native)
        self._lingering = still

    def _forget_peer(self, publication: Publication, rank: int) -> None:
        e = publication.endpoints[rank]
        self._peers.pop((str(e["host"]), int(e["port"])), None)

    def close(self) -> None:
        self._side.close()
        for pool_id in list(self._pools):
            self.deregister_pool(pool_id)


def _descriptors(pool: PoolInfo, copies: Sequence[Copy], side: str) -> np.ndarray:
    """An ``[n, 3]`` int64 array (address, length, device id), bounds checked."""
    out = np.empty((len(copies), 3), dtype=np.int64)
    for i, c in enumerate(copies):
        entry, offset = (
            (c.local_entry, c.local_offset)
            if side == "local"
            else (c.remote_entry, c.remote_offset)
        )
        n = pool.object_nbytes[c.object_group]
        start = entry * n + offset
        if entry < 0 or offset < 0 or start + c.nbytes > pool.capacity * n:
            raise KVGroupsValueError(
                f"copies[{i}]: expected bytes inside {side} pool {pool.pool_id!r} "
                f"({pool.capacity} entries of {n} bytes), got entry {entry} offset {offset} "
                f"length {c.nbytes}"
            )
        out[i] = (pool.bases[c.object_group] + start, c.nbytes, pool.device_id)
    return out


def _translate(exc: Exception, peer: str) -> TransportError:
    name = type(exc).__name__
    if "Disconnect" in name or "NotFound" in name or "NotAllowed" in name:
        return PeerUnavailableError(f"transfer from {peer}: the writer is gone ({name})")
    return TransportError(f"transfer from {peer}: NIXL failed ({name}: {exc})")


def _hello_list(pools: Any, rank: int) -> list:
    if not isinstance(pools, list):
        raise TransportError(
            f"writer rank {rank}: expected a list of pools in its hello, got {type(pools).__name__}"
        )
    return pools
