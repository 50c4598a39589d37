"""The library's logging: every module logs under the ``kvgroups`` logger and never prints.

Applications configure :mod:`logging` as usual (``logging.getLogger("kvgroups")``). Where that
is not in reach, in a serving engine's worker processes for example,
``KVGROUPS_LOG_LEVEL=INFO`` (or ``DEBUG``, ``WARNING`` ...) attaches one stderr handler to the
``kvgroups`` logger at that level in every process that imports the library's logging.
"""

from __future__ import annotations

import logging
import os
import sys

ENV = "KVGROUPS_LOG_LEVEL"
ROOT = "kvgroups"
_configured = False


def configure_from_env() -> None:
    """Apply ``KVGROUPS_LOG_LEVEL`` once per process (an unknown level name is ignored, with a
    warning: a typo in an environment variable must not stop an engine)."""
    global _configured
    if _configured:
        return
    _configured = True
    name = os.environ.get(ENV, "").strip().upper()
    if not name:
        return
    root = logging.getLogger(ROOT)
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        root.warning("%s: expected a logging level such as INFO or DEBUG, got %r", ENV, name)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level)


def logger(name: str) -> logging.Logger:
    """The logger ``kvgroups.<name>``, with ``KVGROUPS_LOG_LEVEL`` applied."""
    configure_from_env()
    return logging.getLogger(f"{ROOT}.{name}")
