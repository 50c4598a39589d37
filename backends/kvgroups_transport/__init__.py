"""kvgroups_transport: memory objects moved between engines (disaggregated prefill/decode).

``base`` is the interface (framework- and transport-free); ``plan`` says what to move;
``exchange`` is the writer's and reader's side of a request built on ``kvgroups_core``'s
store and load. Transports are optional and imported only when asked for:

- ``get_transport("nixl", ...)``: :class:`kvgroups_transport.nixl.NixlTransport` (NIXL's
  wheel, ``nixl-cu12`` / ``nixl-cu13``);
- ``get_transport("jax_transfer", ...)``:
  :class:`kvgroups_transport.jax_transfer.JaxTransferTransport` (``jax.experimental.transfer``).

A missing package raises :class:`TransportUnavailableError` (an ``ImportError``) naming it.
See docs/PD.md.
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import (
    Copy,
    MemoryRegion,
    PoolInfo,
    Publication,
    TransferHandle,
    TransferStats,
    Transport,
)
from .errors import (
    FingerprintMismatchError,
    PeerUnavailableError,
    PublicationReleasedError,
    TransferTimeoutError,
    TransportError,
    TransportUnavailableError,
)
from .exchange import ObjectPool, PullJob, Receiver, check_publication, object_sizes, publish
from .plan import chunks_to_read, layer_byte_ranges, nixl_connector_descriptors, pull_copies

TRANSPORTS = {
    "nixl": ("kvgroups_transport.nixl", "NixlTransport"),
    "jax_transfer": ("kvgroups_transport.jax_transfer", "JaxTransferTransport"),
}

__all__ = [
    "TRANSPORTS",
    "Copy",
    "FingerprintMismatchError",
    "MemoryRegion",
    "ObjectPool",
    "PeerUnavailableError",
    "PoolInfo",
    "Publication",
    "PublicationReleasedError",
    "PullJob",
    "Receiver",
    "TransferHandle",
    "TransferStats",
    "TransferTimeoutError",
    "Transport",
    "TransportError",
    "TransportUnavailableError",
    "check_publication",
    "chunks_to_read",
    "get_transport",
    "layer_byte_ranges",
    "nixl_connector_descriptors",
    "object_sizes",
    "publish",
    "pull_copies",
]


def get_transport(transport: str, /, **kwargs: Any) -> Transport:
    """A transport by name (``"nixl"``, ``"jax_transfer"``), its module imported now."""
    if transport not in TRANSPORTS:
        from kvgroups_core.errors import KVGroupsValueError

        raise KVGroupsValueError(
            f"transport: expected one of {sorted(TRANSPORTS)}, got {transport!r}"
        )
    module, cls = TRANSPORTS[transport]
    return getattr(importlib.import_module(module), cls)(**kwargs)


def __getattr__(name: str) -> Any:
    # The error classes' old names (TransportUnavailable, PeerUnavailable ...): deprecated.
    from kvgroups_core.errors import deprecated_alias

    from . import errors

    return deprecated_alias(__name__, name, errors.DEPRECATED_ALIASES, vars(errors))
