"""The errors a transport raises, in kvgroups' one hierarchy (``KVGroupsError``).

Each leaf also subclasses the builtin a caller would catch: a missing optional package is an
``ImportError``, a peer that is gone a ``ConnectionError``, a pull past its deadline a
``TimeoutError``, a grouping mismatch a ``ValueError``.
"""

from __future__ import annotations

from typing import Any

from kvgroups_core.errors import KVGroupsError, KVGroupsValueError, deprecated_alias


class TransportUnavailableError(KVGroupsError, ImportError):
    """The package a transport needs is not installed (the message names it)."""


class TransportError(KVGroupsError, RuntimeError):
    """A transfer failed; nothing it was to fill may be used."""


class PeerUnavailableError(TransportError, ConnectionError):
    """The other side cannot be reached (gone, never started, or refusing)."""


class TransferTimeoutError(TransportError, TimeoutError):
    """A transfer or a side-channel request did not finish before its deadline."""


class PublicationReleasedError(TransportError, LookupError):
    """The publisher no longer holds the request's objects (released, expired or unknown), so
    their entries may hold other bytes."""


class FingerprintMismatchError(KVGroupsValueError):
    """The two sides group the model differently; raised before any byte moves."""


#: Old names of the error classes (before they all ended in ``Error``), deprecated.
DEPRECATED_ALIASES = {
    "TransportUnavailable": "TransportUnavailableError",
    "PeerUnavailable": "PeerUnavailableError",
    "TransferTimeout": "TransferTimeoutError",
    "PublicationReleased": "PublicationReleasedError",
    "FingerprintMismatch": "FingerprintMismatchError",
}


def __getattr__(name: str) -> Any:
    return deprecated_alias(__name__, name, DEPRECATED_ALIASES, globals())
