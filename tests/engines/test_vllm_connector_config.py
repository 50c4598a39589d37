"""The adversarial suite, the vLLM connector's settings (issue 35, cause 9); no vLLM needed.

``kv_connector_extra_config`` is checked against the table of known keys
(``kvgroups_torch.vllm.config.KEYS``): unknown or misspelt keys were ignored,
``capacity_bytes`` 0 or -1 became one chunk, ``capacity_chunks: 2.7`` two, and
``kv_role="kv_producer"`` ran as ``kv_both`` (now each role is implemented). Each example draws a
dict of known, misspelt and
unknown keys with good and bad values; a valid dict must come back with every key (given or
default), an invalid one must raise a typed error naming the offending key. The same checks
on the real engine: tests/vllm/test_connector_config.py.
"""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from kvgroups_torch.vllm.config import (  # noqa: E402
    KEYS,
    MAX_CAPACITY_BYTES,
    MAX_CHUNKS,
    ConfigKey,
    host_capacity_chunks,
    keys_table,
    parse_extra_config,
)

import kvgroups_core as kc  # noqa: E402

GOOD = {
    "chunk_size": [256, 512, 1],
    "capacity_chunks": [1, 64, 10**6, MAX_CHUNKS],
    "capacity_bytes": [1, 8 << 30, MAX_CAPACITY_BYTES],
    "eviction": ["lru", "LRU"],
}
BAD = {
    "chunk_size": [0, -256, 2.5, "256", True, None],
    "capacity_chunks": [2.7, "lots", 0, -1, False, [4], MAX_CHUNKS + 1, 2**62, 10**30],
    "capacity_bytes": [0, -1, 1.5, "1GiB", None, MAX_CAPACITY_BYTES + 1, 10**30],
    "eviction": ["fifo", 1, None, ""],
}
TYPOS = {
    "capacity_chunk": "capacity_chunks",
    "chunksize": "chunk_size",
    "capacity_byte": "capacity_bytes",
    "evict": "eviction",
}
UNKNOWN = ["foo", "shared_storage_path", 3, ""]


@st.composite
def _configs(draw):
    """``(extra, the key it must be refused for or None)``."""
    extra, bad_key = {}, None
    for key in sorted(GOOD):
        if key.startswith("capacity_") and any(k.startswith("capacity_") for k in extra):
            continue  # the two are exclusive: drawn apart (the clash is its own case)
        if draw(st.booleans()):
            extra[key] = draw(st.sampled_from(GOOD[key]))
    roll = draw(st.integers(0, 4))
    if roll == 0:
        key = draw(st.sampled_from(sorted(BAD)))
        extra.pop("capacity_bytes" if key == "capacity_chunks" else "capacity_chunks", None)
        extra[key] = draw(st.sampled_from(BAD[key]))
        bad_key = key
    elif roll == 1:
        typo = draw(st.sampled_from(sorted(TYPOS)))
        extra[typo] = 1
        bad_key = typo
    elif roll == 2:
        name = draw(st.sampled_from(UNKNOWN))
        extra[name] = 1
        bad_key = repr(name)
    return extra, bad_key


@settings(max_examples=120, deadline=None, derandomize=True)
@given(_configs())
def test_settings_are_taken_exactly_or_refused_by_key(case):
    extra, bad_key = case
    if bad_key is None:
        config = parse_extra_config(dict(extra))
        assert set(config) == {k.name for k in KEYS}
        for k in KEYS:
            want = extra.get(k.name, k.default)
            assert config[k.name] == (want.lower() if isinstance(want, str) else want)
        assert config.given == frozenset(extra)
        return
    with pytest.raises(kc.KVGroupsError) as info:
        parse_extra_config(dict(extra))
    assert isinstance(info.value, (ValueError, TypeError))
    assert bad_key in str(info.value), str(info.value)
    if bad_key in TYPOS:
        assert f"did you mean {TYPOS[bad_key]!r}" in str(info.value)


def test_the_issues_cases():
    for extra, match in [
        ({"capacity_chunk": 8}, "did you mean 'capacity_chunks'"),
        ({"foo": 1}, "unknown key 'foo'"),
        ({"capacity_bytes": 0}, r"'capacity_bytes'\]: expected an int in \[1, "),
        ({"capacity_bytes": -1}, "capacity_bytes"),
        ({"capacity_chunks": 2.7}, r"'capacity_chunks'\]: expected an int"),
        ({"capacity_chunks": "lots"}, "capacity_chunks.*'lots'"),
        ({"capacity_chunks": 8, "capacity_bytes": 1 << 20}, "got both"),
    ]:
        with pytest.raises(kc.KVGroupsError, match=match):
            parse_extra_config(extra)


def test_capacities_are_bounded_where_they_are_parsed():
    # 2**62 entries used to pass, and the connector's index then failed at engine start
    # (MemoryError; OverflowError for 10**30) with nothing naming the setting.
    for extra, match in [
        (
            {"capacity_chunks": 2**62},
            rf"'capacity_chunks'\]: expected an int in \[1, {MAX_CHUNKS}\]",
        ),
        ({"capacity_chunks": 10**30}, r"'capacity_chunks'\].*got 10000"),
        (
            {"capacity_bytes": 10**30},
            rf"'capacity_bytes'\]: expected an int in \[1, {MAX_CAPACITY_BYTES}\]",
        ),
        ({"staging_chunks": 2**40}, r"'staging_chunks'\]: expected an int in"),
    ]:
        with pytest.raises(kc.KVGroupsValueError, match=match):
            parse_extra_config(extra)
    assert parse_extra_config({"capacity_chunks": MAX_CHUNKS}).capacity_chunks == MAX_CHUNKS


def test_the_host_cache_entries_from_capacity_bytes_are_bounded_at_start():
    chunk = 4096  # bytes per chunk of some model
    assert host_capacity_chunks(parse_extra_config({"capacity_chunks": 7}), chunk) == 7
    assert host_capacity_chunks(parse_extra_config({"capacity_bytes": 3 * chunk + 1}), chunk) == 3
    assert host_capacity_chunks(parse_extra_config({}), chunk) == (1 << 30) // chunk
    for nbytes in (chunk - 1, (MAX_CHUNKS + 1) * chunk):
        with pytest.raises(kc.KVGroupsValueError, match=r"'capacity_bytes'\]: expected between"):
            host_capacity_chunks(parse_extra_config({"capacity_bytes": nbytes}), chunk)
    assert host_capacity_chunks(parse_extra_config({}), 1) == MAX_CHUNKS  # the default, clamped


def test_capacity_chunks_are_bounded_in_bytes_as_capacity_bytes_is():
    # 2**24 chunks of a 70B-class model's 16 MiB: 256 TiB, refused as capacity_bytes would be.
    chunk = 16 << 20
    fits = MAX_CAPACITY_BYTES // chunk
    assert host_capacity_chunks(parse_extra_config({"capacity_chunks": fits}), chunk) == fits
    with pytest.raises(kc.KVGroupsValueError, match=r"'capacity_chunks'\]: expected at most"):
        host_capacity_chunks(parse_extra_config({"capacity_chunks": fits + 1}), chunk)


def test_a_host_cache_the_allocator_refuses_is_a_typed_error_naming_capacity():
    import torch
    from kvgroups_torch.vllm.host_store import HostChunkStore

    caches = [torch.zeros(2, 4, 16, 8, 128, dtype=torch.float16) for _ in range(2)]
    manager = kc.KVLayerGroupsManager(
        caches, [kc.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS] * 2, lmcache_tokens_per_chunk=16
    )
    chunk = sum(kc.object_nbytes(manager, g) for g in range(manager.num_object_groups))
    assert chunk * MAX_CHUNKS >= 1 << 41  # 2 TiB: more than any CI machine can map
    with pytest.raises(kc.KVGroupsValueError, match="^capacity: expected a host cache this"):
        HostChunkStore(manager, caches, MAX_CHUNKS, pinned=False)


@pytest.mark.parametrize("role", [["kv_both"], {}, ("kv_both",), 1, b"kv_both"])
def test_a_kv_role_that_is_not_a_string_is_refused_by_name(role):
    with pytest.raises(
        kc.KVGroupsTypeError, match=f"kv_role: expected one of .*got {type(role).__name__}"
    ):
        parse_extra_config({}, role)


@pytest.mark.parametrize("role", ["kv_both", "kv_producer", "kv_consumer"])
def test_the_three_roles_run_and_others_are_refused_by_name(role):
    assert parse_extra_config({}, role).role == role
    with pytest.raises(kc.KVGroupsValueError, match="kv_role"):
        parse_extra_config({}, "kv_sideways")
    assert parse_extra_config(None).role == "kv_both"


def test_disaggregation_settings_are_checked_by_name():
    config = parse_extra_config(
        {"transport": "NIXL", "side_channel_port": 6000, "pull_timeout_s": 5}, "kv_producer"
    )
    assert (config.transport, config.side_channel_port, config.pull_timeout_s) == (
        "nixl",
        6000,
        5.0,
    )
    for extra, match in [
        ({"transport": "mooncake"}, r"'transport'\]: expected one of"),
        ({"side_channel_port": 0}, r"'side_channel_port'\]: expected an int"),
        ({"pull_timeout_s": "soon"}, r"'pull_timeout_s'\]: expected a number"),
        ({"publish_ttl_s": float("nan")}, "publish_ttl_s"),
        ({"nixl_backends": []}, r"'nixl_backends'\]: expected a list"),
        ({"layerwise_loads": "yes"}, r"'layerwise_loads'\]: expected true"),
        ({"sidechannel_port": 1}, "did you mean 'side_channel_port'"),
    ]:
        with pytest.raises(kc.KVGroupsError, match=match):
            parse_extra_config(extra, "kv_consumer")


def test_a_new_row_is_all_it_takes_to_add_a_setting():
    port = ConfigKey(
        "side_channel_port",
        int,
        5600,
        "where this engine publishes its metadata",
        minimum=1,
        maximum=65535,
    )
    hosts = ConfigKey(
        "nixl_backends", list, ["UCX"], "transport backends", item_kind=str, minimum=1
    )
    keys = KEYS + (port, hosts)
    config = parse_extra_config({"side_channel_port": 7000}, keys=keys)
    assert (config.side_channel_port, config.nixl_backends) == (7000, ["UCX"])
    with pytest.raises(kc.KVGroupsValueError, match=r"side_channel_port'\]: expected an int in"):
        parse_extra_config({"side_channel_port": 70000}, keys=keys)
    with pytest.raises(kc.KVGroupsTypeError, match=r"nixl_backends'\]\[1\]: expected a str"):
        parse_extra_config({"nixl_backends": ["UCX", 3]}, keys=keys)
    assert "side_channel_port" in keys_table(keys)


def test_the_integration_guide_shows_the_table():
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[2] / "docs" / "INTEGRATION.md").read_text()
    assert keys_table() in guide, (
        "docs/INTEGRATION.md: paste kvgroups_torch.vllm.config."
        "keys_table() after <!-- connector-keys -->"
    )
