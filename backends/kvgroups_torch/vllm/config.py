"""The KVGroupsConnector's configuration: ``kv_role`` and ``kv_connector_extra_config``.

Every key the connector reads is a row of :data:`KEYS` (name, type, bounds, default, meaning),
and :func:`parse_extra_config` checks a user's dict against the table when the engine starts:
an unknown key is refused with the closest known name ("did you mean"), a value of the wrong
type or outside its bounds is refused naming the key, the expected and the given value. A
misspelt ``capacity_chunk`` used to be ignored, ``capacity_bytes: 0`` became one chunk and
``capacity_chunks: 2.7`` two. To add a setting, add a row (and read it from the parsed
:class:`ConnectorConfig` by name); :func:`keys_table` prints the table for the docs.

``kv_role``: ``"kv_both"`` (each engine stores and loads its own prefixes; with ``transport``
set it also publishes and pulls for prefill/decode disaggregation), ``"kv_producer"`` (a
prefill engine) or ``"kv_consumer"`` (a decode engine); docs/PD.md.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError, UnsupportedConfigError

#: Where the settings come from, for messages.
WHERE = "kv_connector_extra_config"

DEFAULT_CAPACITY_BYTES = 1 << 30

#: The most chunk entries a host cache (``capacity_chunks``, or ``capacity_bytes`` in chunks) or
#: a consumer's staging (``staging_chunks``) may have. Every entry costs its index memory at
#: start, before any chunk is held (a free-list entry: a pointer and an int, about 36 bytes),
#: and a held chunk a hash entry and an LRU entry besides (a few hundred bytes), on top of its
#: object bytes in host memory. 2**24 entries hold 4.3e9 tokens at the default chunk size, more
#: than any host's memory for a real model's KV; a bigger count would make the index alone
#: allocate gigabytes (or fail to: 2**62 entries) when the engine starts.
MAX_CHUNKS = 1 << 24

#: The most bytes ``capacity_bytes`` may name: 2**47 (128 TiB), the user address space of a
#: 48-bit virtual address (x86-64, ARM64), beyond what a host can allocate.
MAX_CAPACITY_BYTES = 1 << 47


@dataclass(frozen=True)
class ConfigKey:
    """One setting of ``kv_connector_extra_config``.

    ``kind``: ``int``, ``float``, ``str``, ``bool`` or ``list`` (then ``item_kind`` is the type
    of its items); ints are never bools or floats, a float may be given as an int, and a ``str``
    is compared case-insensitively with ``choices``. ``minimum`` / ``maximum`` bound numbers
    (inclusive) and list lengths.
    ``default`` None means "not set" (another key or a computed value decides). ``excludes``
    names keys that may not be given together with this one.
    """

    name: str
    kind: type
    default: Any
    meaning: str
    minimum: int | None = None
    maximum: int | None = None
    choices: tuple[str, ...] = ()
    item_kind: type | None = None
    excludes: tuple[str, ...] = ()

    def check(self, value: Any) -> Any:
        """``value`` as the setting's type (choices lower-cased), or a typed error naming the
        key, the expected and the given value."""
        what = f"{WHERE}[{self.name!r}]"
        if self.kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise KVGroupsTypeError(
                    f"{what}: expected an int{self._bounds()}, got {type(value).__name__} {value!r}"
                )
            self._check_bounds(value, what, value)
            return value
        if self.kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise KVGroupsTypeError(
                    f"{what}: expected a number{self._bounds()}, got {type(value).__name__} "
                    f"{value!r}"
                )
            self._check_bounds(value, what, value)
            return float(value)
        if self.kind is bool:
            if not isinstance(value, bool):
                raise KVGroupsTypeError(
                    f"{what}: expected true or false, got {type(value).__name__} {value!r}"
                )
            return value
        if self.kind is str:
            if not isinstance(value, str):
                raise KVGroupsTypeError(
                    f"{what}: expected a string{self._choices()}, got {type(value).__name__} "
                    f"{value!r}"
                )
            if self.choices:
                if value.lower() not in self.choices:
                    raise KVGroupsValueError(
                        f"{what}: expected one of {list(self.choices)}, got {value!r}"
                    )
                return value.lower()
            return value
        if self.kind is list:
            if not isinstance(value, (list, tuple)):
                raise KVGroupsTypeError(
                    f"{what}: expected a list, got {type(value).__name__} {value!r}"
                )
            item = self.item_kind
            for i, v in enumerate(value):
                if item is not None and (
                    not isinstance(v, item) or isinstance(v, bool) and item is not bool
                ):
                    raise KVGroupsTypeError(
                        f"{what}[{i}]: expected a {item.__name__}, got {type(v).__name__} {v!r}"
                    )
            self._check_bounds(len(value), what, value, "entries")
            if self.choices:
                bad = [v for v in value if str(v).upper() not in self.choices]
                if bad:
                    raise KVGroupsValueError(
                        f"{what}: expected entries among {list(self.choices)}, got {bad[0]!r}"
                    )
            return list(value)
        raise TypeError(f"ConfigKey {self.name}: unsupported kind {self.kind}")  # table bug

    def _bounds(self) -> str:
        if self.minimum is not None and self.maximum is not None:
            return f" in [{self.minimum}, {self.maximum}]"
        if self.minimum is not None:
            return f" >= {self.minimum}"
        if self.maximum is not None:
            return f" <= {self.maximum}"
        return ""

    def _choices(self) -> str:
        return f" (one of {list(self.choices)})" if self.choices else ""

    def _check_bounds(self, n: float, what: str, value: Any, unit: str = "") -> None:
        low = self.minimum is not None and n < self.minimum
        high = self.maximum is not None and n > self.maximum
        if low or high:
            kind = "a number" if self.kind is float else "an int"
            noun = f"a list of{self._bounds()} {unit}" if unit else f"{kind}{self._bounds()}"
            raise KVGroupsValueError(f"{what}: expected {noun}, got {value!r}")


#: The settings the connector reads. Add a row to add one.
KEYS: tuple[ConfigKey, ...] = (
    ConfigKey(
        "chunk_size",
        int,
        256,
        "tokens per cached chunk; a multiple of every KV cache group's block size",
        minimum=1,
    ),
    ConfigKey(
        "capacity_chunks",
        int,
        None,
        "host cache size in chunks (instead of capacity_bytes)",
        minimum=1,
        maximum=MAX_CHUNKS,
        excludes=("capacity_bytes",),
    ),
    ConfigKey(
        "capacity_bytes",
        int,
        DEFAULT_CAPACITY_BYTES,
        "host cache size in bytes, rounded down to whole chunks (at least one chunk, at most "
        f"{MAX_CHUNKS})",
        minimum=1,
        maximum=MAX_CAPACITY_BYTES,
        excludes=("capacity_chunks",),
    ),
    ConfigKey(
        "eviction",
        str,
        "lru",
        "what to drop when the host cache is full: the least recently used chunk",
        choices=("lru",),
    ),
    ConfigKey(
        "layerwise_loads",
        bool,
        True,
        "pipeline the loads with the forward: each "
        "attention layer waits, on the GPU, for its own layer's load (false: every load "
        "finishes before the forward)",
    ),
    # Disaggregated prefill/decode (docs/PD.md).
    ConfigKey(
        "transport",
        str,
        None,
        "move a request's objects between engines over this "
        "transport; with kv_role 'kv_both' its presence switches P/D on (producers and "
        "consumers use 'nixl' by default)",
        choices=("nixl",),
    ),
    ConfigKey("nixl_backends", list, ["UCX"], "NIXL backends to create", minimum=1, item_kind=str),
    ConfigKey(
        "side_channel_host",
        str,
        "127.0.0.1",
        "where a producer's workers answer for "
        "their NIXL metadata (bound and advertised in the request's params)",
    ),
    ConfigKey(
        "side_channel_port",
        int,
        5600,
        "a producer worker of TP rank r answers at this port + r",
        minimum=1,
        maximum=65535,
    ),
    ConfigKey(
        "publish_ttl_s", float, 120.0, "seconds an unreleased publication stays pullable", minimum=1
    ),
    ConfigKey(
        "pull_timeout_s", float, 30.0, "deadline of one request's pull, in seconds", minimum=0
    ),
    ConfigKey(
        "staging_chunks",
        int,
        64,
        "a consumer's staging entries (chunks in flight at once)",
        minimum=1,
        maximum=MAX_CHUNKS,
    ),
)

#: ``kv_role`` -> None when the connector implements it, else why it is refused.
ROLES: dict[str, str | None] = {"kv_both": None, "kv_producer": None, "kv_consumer": None}


class ConnectorConfig(Mapping):
    """The checked settings: every key of :data:`KEYS`, given or defaulted (``config[name]``
    or ``config.name``); :attr:`given` holds the names the user set."""

    def __init__(self, values: dict[str, Any], given: frozenset[str], role: str) -> None:
        self._values = values
        self.given = given
        self.role = role

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"ConnectorConfig({self._values!r}, role={self.role!r})"


def check_role(role: Any) -> str:
    """``kv_role`` as the connector runs it, or a typed error naming ``kv_role``."""
    if role is None:
        return "kv_both"
    if not isinstance(role, str):
        raise KVGroupsTypeError(
            f"kv_role: expected one of {sorted(ROLES)}, got {type(role).__name__} {role!r}"
        )
    if role not in ROLES:
        raise KVGroupsValueError(f"kv_role: expected one of {sorted(ROLES)}, got {role!r}")
    why = ROLES[role]
    if why is not None:
        raise UnsupportedConfigError(f"kv_role: expected 'kv_both', got {role!r}: {why}")
    return role


def parse_extra_config(
    extra: Any, role: Any = "kv_both", keys: tuple[ConfigKey, ...] = KEYS
) -> ConnectorConfig:
    """Check ``kv_connector_extra_config`` (a mapping, or None) and ``kv_role`` against the
    table; returns every key's value (given or default)."""
    role = check_role(role)
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise KVGroupsTypeError(f"{WHERE}: expected a dict, got {type(extra).__name__}")
    by_name = {k.name: k for k in keys}
    for name in extra:
        if name not in by_name:
            raise KVGroupsValueError(_unknown(name, by_name))
    values: dict[str, Any] = {}
    for key in keys:
        if key.name in extra:
            clash = [other for other in key.excludes if other in extra]
            if clash:
                raise KVGroupsValueError(
                    f"{WHERE}: expected {key.name!r} or {clash[0]!r}, got both"
                )
            values[key.name] = key.check(extra[key.name])
        else:
            values[key.name] = key.default
    return ConnectorConfig(values, frozenset(extra), role)


def host_capacity_chunks(config: ConnectorConfig, bytes_per_chunk: int) -> int:
    """The host cache's entries: ``capacity_chunks``, or ``capacity_bytes`` in whole chunks of
    ``bytes_per_chunk`` (the model's), within [1, MAX_CHUNKS]; given bytes outside that
    are refused naming ``capacity_bytes``, the default ones are clamped to it."""
    if config.capacity_chunks is not None:
        total = config.capacity_chunks * bytes_per_chunk
        if total > MAX_CAPACITY_BYTES:
            raise KVGroupsValueError(
                f"{WHERE}['capacity_chunks']: expected at most {MAX_CAPACITY_BYTES} bytes of "
                f"host cache ({MAX_CAPACITY_BYTES // max(bytes_per_chunk, 1)} chunks of "
                f"{bytes_per_chunk} bytes for this model at chunk_size {config.chunk_size}), "
                f"got {config.capacity_chunks} chunks ({total} bytes)"
            )
        return config.capacity_chunks
    chunks = config.capacity_bytes // max(bytes_per_chunk, 1)
    if "capacity_bytes" in config.given and not 1 <= chunks <= MAX_CHUNKS:
        raise KVGroupsValueError(
            f"{WHERE}['capacity_bytes']: expected between one chunk and {MAX_CHUNKS} chunks "
            f"({bytes_per_chunk} bytes each for this model at chunk_size {config.chunk_size}), "
            f"got {config.capacity_bytes} ({chunks} chunks)"
        )
    return min(max(1, chunks), MAX_CHUNKS)


def _unknown(name: Any, by_name: dict[str, ConfigKey]) -> str:
    known = sorted(by_name)
    hint = ""
    if isinstance(name, str):
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        if close:
            hint = f" (did you mean {close[0]!r}?)"
    return f"{WHERE}: unknown key {name!r}{hint}; expected keys among {known}"


def keys_table(keys: tuple[ConfigKey, ...] = KEYS) -> str:
    """The table as Markdown (key, type, default, meaning), for the docs."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for k in keys:
        kind = k.kind.__name__ + k._bounds() + k._choices()
        default = "-" if k.default is None else repr(k.default)
        rows.append(f"| `{k.name}` | {kind} | {default} | {k.meaning} |")
    return "\n".join(rows)
