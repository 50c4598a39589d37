"""Disaggregated prefill/decode for KVGroupsConnector: the producer and consumer roles.

A prefill engine (``kv_role="kv_producer"`` or ``"kv_both"``) and a decode engine
(``"kv_consumer"`` or ``"kv_both"``) speak vLLM NixlConnector's request protocol, so vLLM's
proxies work unchanged:

1. The proxy sends the prompt to the prefill engine with ``kv_transfer_params={
   "do_remote_decode": True}`` (and ``max_tokens=1``).
2. The producer saves the prompt's whole chunks into its host pool as it always does (the
   connector's prefix cache), and in the step where the last of them is saved its workers
   publish those entries (:meth:`PDWorker.publish`); the scheduler pins them.
   ``request_finished`` returns the params the decode request carries: NixlConnector's keys
   (``do_remote_prefill=True``, ``remote_engine_id``, ``remote_request_id``,
   ``remote_host``, ``remote_port``, ``tp_size``) and ``"kvgroups"``, the
   :class:`~kvgroups_transport.Publication` (entries, chunk hashes, the grouping's
   fingerprint). vLLM's blocks are freed at once: the objects live in the pool.
3. The decode engine's scheduler checks the publication against its own grouping and prompt
   (fingerprint, chunk hashes) and offers the whole chunks it lacks as an asynchronous load;
   its workers pull them into staging entries over the transport (NIXL), and only once a pull
   has landed is it loaded into the caches. A pull that fails (writer gone, timed out,
   released, refused) is reported in ``failed_recving``: with vLLM's
   ``kv_load_failure_policy="recompute"`` the decode engine computes the prompt itself.
4. The consumer releases the publication; the producer's workers report it (worker
   metadata) and the scheduler unpins the entries. Unreleased publications expire after
   ``publish_ttl_s``.

Keys of ``kv_connector_extra_config`` added here (:data:`PD_KEYS`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from kvgroups_core.errors import KVGroupsError, KVGroupsValueError, UnsupportedConfigError
from kvgroups_core.logs import logger as kvgroups_logger

from .adapter import from_kv_cache_config

logger = kvgroups_logger("vllm")

#: The ``kv_connector_extra_config`` keys of disaggregated prefill/decode, with defaults.
PD_KEYS: dict[str, Any] = {
    "transport": "nixl",  # the only transport for torch engines
    "nixl_backends": ["UCX"],  # NIXL backends to create
    "side_channel_host": "127.0.0.1",  # where producer workers answer (bind and advertise)
    "side_channel_port": 5600,  # producer worker rank r answers at port + r
    "publish_ttl_s": 120.0,  # an unreleased publication's lifetime
    "pull_timeout_s": 30.0,  # deadline of one request's pull
    "staging_chunks": 64,  # consumer staging entries (chunks in flight at once)
}

PRODUCER_ROLES = ("kv_producer", "kv_both")
CONSUMER_ROLES = ("kv_consumer", "kv_both")
PARAMS_KEY = "kvgroups"


def pd_enabled(role: str, extra: Any) -> bool:
    """kv_producer / kv_consumer always; kv_both when ``transport`` is configured."""
    return role in ("kv_producer", "kv_consumer") or (
        role == "kv_both" and extra.get("transport") is not None
    )


def pd_config(extra: Any) -> dict:
    """The P/D settings of a checked ``kv_connector_extra_config`` (``vllm.config``)."""
    cfg = {k: v if extra.get(k) is None else extra.get(k) for k, v in PD_KEYS.items()}
    if cfg["transport"] != "nixl":
        raise UnsupportedConfigError(
            f"kv_connector_extra_config['transport']: expected 'nixl', got {cfg['transport']!r}"
        )
    if isinstance(cfg["nixl_backends"], str):
        cfg["nixl_backends"] = [cfg["nixl_backends"]]
    for key in ("side_channel_port", "staging_chunks"):
        cfg[key] = int(cfg[key])
    for key in ("publish_ttl_s", "pull_timeout_s"):
        cfg[key] = float(cfg[key])
    return cfg


@dataclass
class PublishItem:
    """Producer: request ``req_id``'s chunks are in ``entries`` (chunk order)."""

    req_id: str
    entries: list[int]
    hashes: list[str]


@dataclass
class PullItem:
    """Consumer: pull chunks ``[first_chunk, num_chunks)`` of ``publication`` and load them
    into ``block_ids`` (what ``load`` takes), skipping the first ``skip_tokens`` tokens."""

    req_id: str
    publication: dict
    first_chunk: int
    num_chunks: int
    skip_tokens: int
    block_ids: dict[int, list[int]]


@dataclass
class PDWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: requests whose publication the readers released."""

    released: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        return PDWorkerMeta(self.released | getattr(other, "released", set()))


def _tp(vllm_config: Any) -> tuple[int, int | None]:
    size = int(vllm_config.parallel_config.tensor_parallel_size)
    heads = None
    if size > 1:
        heads = int(vllm_config.model_config.get_total_num_kv_heads())
    return size, heads


def _endpoints(cfg: dict, tp_size: int) -> list[dict]:
    return [
        {"host": cfg["side_channel_host"], "port": cfg["side_channel_port"] + r}
        for r in range(tp_size)
    ]


class PDScheduler:
    """The scheduler side of both roles (see the module doc)."""

    def __init__(
        self, vllm_config: Any, kv_cache_config: Any, role: str, extra: dict, chunk: int
    ) -> None:
        self.cfg = pd_config(extra)
        self.role = role
        self.chunk = chunk
        self.engine_id = vllm_config.kv_transfer_config.engine_id
        self.tp_size, heads = _tp(vllm_config)
        layout = from_kv_cache_config(
            kv_cache_config, None, chunk_size=chunk, tp_size=self.tp_size, total_num_kv_heads=heads
        )
        self.manager = layout.manager
        self.fingerprint = self.manager.fingerprint(across_degrees=True)
        self._pins: dict[str, tuple[list[int], float]] = {}  # req -> (entries, expiry)
        self._to_publish: set[str] = set()
        self._published: dict[str, PublishItem] = {}
        self._pending: dict[str, tuple[Any, int, int]] = {}  # req -> (pub, hit, computed)
        self._pulls: list[PullItem] = []

    @property
    def producer(self) -> bool:
        return self.role in PRODUCER_ROLES

    @property
    def consumer(self) -> bool:
        return self.role in CONSUMER_ROLES

    @property
    def saves(self) -> bool:
        """Whether the connector saves prompt chunks (a pure consumer does not)."""
        return self.role != "kv_consumer"

    def pinned_entries(self) -> set[int]:
        now = time.monotonic()
        for rid in [r for r, (_, exp) in self._pins.items() if exp < now]:
            del self._pins[rid]
        return {s for entries, _ in self._pins.values() for s in entries}

    # --- producer ---------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        params = getattr(request, "kv_transfer_params", None)
        if self.producer and params and params.get("do_remote_decode"):
            self._to_publish.add(request.request_id)

    def publish_item(
        self, request_id: str, hashes: list[bytes], index: Any, prompt_len: int, computed: int
    ) -> PublishItem | None:
        """The publication of a do_remote_decode request once its whole chunks are saved
        (this step), or None."""
        if request_id not in self._to_publish:
            return None
        whole = prompt_len // self.chunk
        if whole == 0 or min(computed, prompt_len) // self.chunk < whole:
            return None
        entries = index.lookup(hashes[:whole])
        n = next((i for i, s in enumerate(entries) if s is None), whole)
        if n == 0:
            return None
        item = PublishItem(request_id, [int(s) for s in entries[:n]], [h.hex() for h in hashes[:n]])
        self._to_publish.discard(request_id)
        self._published[request_id] = item
        self._pins[request_id] = (item.entries, time.monotonic() + self.cfg["publish_ttl_s"])
        return item

    def finished_params(self, request: Any) -> dict | None:
        """What ``request_finished`` returns for a do_remote_decode request."""
        params = getattr(request, "kv_transfer_params", None)
        item = self._published.pop(request.request_id, None)
        if not self.producer or not params or not params.get("do_remote_decode"):
            return None
        if item is None:
            return None  # nothing saved (a prompt shorter than a chunk): decode recomputes
        status = getattr(getattr(request, "status", None), "name", "")
        if status not in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"):
            self._pins.pop(request.request_id, None)  # aborted: nobody will pull it
            return None
        publication = {
            "request_id": request.request_id,
            "transport": self.cfg["transport"],
            "pool_id": "host",
            "entries": item.entries,
            "chunk_tokens": self.chunk,
            "fingerprint": self.fingerprint,
            "tp_size": self.tp_size,
            "object_layout": self.manager.object_layout,
            "endpoints": _endpoints(self.cfg, self.tp_size),
            "chunk_hashes": item.hashes,
        }
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.cfg["side_channel_host"],
            "remote_port": self.cfg["side_channel_port"],
            "tp_size": self.tp_size,
            "remote_block_ids": None,
            PARAMS_KEY: publication,
        }

    def on_released(self, released: set[str]) -> None:
        for rid in released:
            self._pins.pop(rid, None)

    # --- consumer ---------------------------------------------------------------------

    def matched_tokens(
        self, request: Any, num_computed: int, hashes: list[bytes]
    ) -> tuple[int, bool] | None:
        """The asynchronous load a do_remote_prefill request offers, or None when this is
        not one (the connector's own prefix cache answers then). Refusals (another
        grouping, another prompt) return (0, False): the engine computes the prompt."""
        params = getattr(request, "kv_transfer_params", None)
        if (
            not self.consumer
            or not params
            or not params.get("do_remote_prefill")
            or PARAMS_KEY not in params
        ):
            return None
        from kvgroups_transport import Publication, check_publication

        try:
            pub = Publication.from_dict(params[PARAMS_KEY])
            check_publication(self.manager, pub, f"decode engine {self.engine_id}")
        except KVGroupsError as exc:
            logger.warning("request %s: not loading its prefill (%s)", request.request_id, exc)
            self._pending.pop(request.request_id, None)
            return 0, False
        prompt_len = len(request.prompt_token_ids or [])
        usable = min(pub.num_chunks, (prompt_len - 1) // self.chunk)
        mine = [h.hex() for h in hashes[:usable]]
        if list(pub.chunk_hashes[:usable]) != mine:
            logger.warning(
                "request %s: the published chunks are not this prompt's; computing it here",
                request.request_id,
            )
            return 0, False
        new = usable * self.chunk - num_computed
        if new <= 0:
            self._pending.pop(request.request_id, None)
            return 0, False
        self._pending[request.request_id] = (pub, usable, num_computed)
        return new, True

    def after_alloc(self, request: Any, blocks: Any, num_external: int, layout: Any) -> bool:
        """Record the pull of a request ``matched_tokens`` accepted; True if it was one."""
        pending = self._pending.pop(request.request_id, None)
        if pending is None:
            return False
        if num_external <= 0:
            return True
        pub, hit, computed = pending
        last = min(hit, -(-(computed + num_external) // self.chunk))
        first = computed // self.chunk
        ids = layout.block_ids(blocks.get_block_ids(), last - first, first)
        self._pulls.append(
            PullItem(
                request.request_id, pub.to_dict(), first, last, computed - first * self.chunk, ids
            )
        )
        request.kv_transfer_params["do_remote_prefill"] = False  # one transfer per request
        return True

    def take_pulls(self) -> list[PullItem]:
        pulls, self._pulls = self._pulls, []
        return pulls

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._to_publish.discard(request_id)
        if self._published.pop(request_id, None) is not None:
            self._pins.pop(request_id, None)  # finished without handing out its params


class PDWorker:
    """The worker side: a transport, the producer's pool registered with it, the consumer's
    staging (a :class:`~kvgroups_transport.Receiver`)."""

    def __init__(
        self, vllm_config: Any, kv_cache_config: Any, role: str, extra: dict, chunk: int
    ) -> None:
        self.cfg = pd_config(extra)
        self.role = role
        self.chunk = chunk
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self.transport: Any = None
        self._receiver: Any = None
        self._store: Any = None
        self._manager: Any = None
        self._published: set[str] = set()
        self._jobs: dict[str, tuple[Any, PullItem]] = {}
        self._failed: dict[str, str] = {}
        self.stats = {
            "pulled_chunks": 0,
            "pull_descriptors": 0,
            "pull_bytes": 0,
            "failed_pulls": 0,
            "published": 0,
        }

    def register(self, kv_caches: dict, store: Any) -> None:
        """Bind to the worker's caches and host store (``HostChunkStore``)."""
        from kvgroups_transport import Receiver, get_transport
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        size, heads = _tp(self._vllm_config)
        rank = get_tensor_model_parallel_rank() if size > 1 else 0
        self._manager = from_kv_cache_config(
            self._kv_cache_config,
            kv_caches,
            chunk_size=self.chunk,
            tp_rank=rank,
            tp_size=size,
            total_num_kv_heads=heads,
        ).manager
        self._store = store
        producer = self.role in PRODUCER_ROLES
        port = self.cfg["side_channel_port"] + rank if producer else 0
        self.transport = get_transport(
            "nixl",
            name=f"vllm-{self.role}-{rank}",
            backends=self.cfg["nixl_backends"],
            host=self.cfg["side_channel_host"],
            port=port,
            publication_ttl_s=self.cfg["publish_ttl_s"],
        )
        if producer:
            self.transport.register_pool("host", store.pools, store.object_bytes)
        if self.role in CONSUMER_ROLES:
            like = store.kv_caches[0] if store.kv_caches else None
            self._receiver = Receiver(
                self._manager,
                self.transport,
                capacity=self.cfg["staging_chunks"],
                like=like,
                timeout_s=self.cfg["pull_timeout_s"],
            )

    # --- producer ---------------------------------------------------------------------

    def publish(self, items: list[PublishItem]) -> None:
        """After this step's saves: offer the requests' entries to readers."""
        if not items or self.transport is None:
            return
        caches = self._store.kv_caches
        if caches and caches[0].device.type == "cuda":
            import torch

            torch.cuda.current_stream().synchronize()  # readers see the saved bytes
        from kvgroups_transport import publish

        size = self._manager.tp_size
        for item in items:
            publish(
                self.transport,
                self._manager,
                item.req_id,
                _PoolView(self._store),
                item.entries,
                endpoints=_endpoints(self.cfg, size),
                chunk_hashes=item.hashes,
            )
            self._published.add(item.req_id)
            self.stats["published"] += 1

    def worker_meta(self) -> PDWorkerMeta | None:
        if not self._published:
            return None
        live = set(self.transport.published())
        released = self._published - live
        if not released:
            return None
        self._published -= released
        return PDWorkerMeta(released)

    # --- consumer ---------------------------------------------------------------------

    def start_pulls(self, items: list[PullItem]) -> None:
        from kvgroups_transport import Publication

        for item in items:
            job = None
            try:
                job = self._receiver.begin(
                    Publication.from_dict(item.publication),
                    first_chunk=item.first_chunk,
                    num_chunks=item.num_chunks,
                )
                self._jobs[item.req_id] = (job, item)
                self._receiver.pull(job)
            except (KVGroupsError, OSError) as exc:
                self._fail(item.req_id, exc, job)

    def _fail(self, req_id: str, exc: BaseException, job: Any) -> None:
        logger.warning(
            "request %s: pull failed, the engine recomputes it (%s: %s)",
            req_id,
            type(exc).__name__,
            exc,
        )
        self._jobs.pop(req_id, None)
        if job is not None:
            try:
                self._receiver.end(job)
            except KVGroupsError:
                pass
        self._failed[req_id] = f"{type(exc).__name__}: {exc}"
        self.stats["failed_pulls"] += 1

    def results(self) -> tuple[set[str], set[str]]:
        """``(finished_recving, failed_recving)``: a landed pull is loaded here, before it
        is reported; a failed one wrote nothing into the caches."""
        done: set[str] = set()
        for req_id, (job, item) in list(self._jobs.items()):
            try:
                if not self._receiver.poll(job):
                    continue
                objects = self._receiver.objects(job)
                self._store.prepared.load(
                    objects, item.block_ids, skip_first_n_tokens=item.skip_tokens
                )
            except (KVGroupsError, OSError) as exc:
                self._fail(req_id, exc, job)
                continue
            self.stats["pulled_chunks"] += job.num_chunks
            self.stats["pull_descriptors"] += job.descriptors
            self.stats["pull_bytes"] += job.nbytes
            self._receiver.end(job)
            del self._jobs[req_id]
            done.add(req_id)
        failed = set(self._failed)
        self._failed.clear()
        return done | failed, failed

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None


class _PoolView:
    """The host store's buffers as the ``pool`` :func:`kvgroups_transport.publish` takes."""

    def __init__(self, store: Any) -> None:
        self.pool_id = "host"
        self.buffers = store.pools


def check_role(role: str) -> None:
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise KVGroupsValueError(
            f"kv_role: expected 'kv_producer', 'kv_consumer' or 'kv_both', got {role!r}"
        )
