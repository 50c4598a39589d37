"""Progress of a long run, for the person watching it.

A run of many steps (a ``kvgroups bench`` matrix, the conformance kit, the first compile of a
kernel) reports each finished step as one line on stderr, prefixed with the count and the time
so far: ``[ 12/40  1:02] torch-cuda prepared ...``. It does so only where someone watches:
when stderr is a terminal, never with ``--quiet``. ``KVGROUPS_PROGRESS=1`` turns it on where
stderr is not a terminal (a log file of a long run), ``KVGROUPS_PROGRESS=0`` off everywhere.
Results never go through here: they are the command's output.

The library itself never writes to the terminal: it logs through :mod:`logging` under the
``kvgroups`` logger (:func:`show_library_logs` makes those lines visible for a command).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TextIO

ENV = "KVGROUPS_PROGRESS"


def wanted(stream: TextIO, quiet: bool = False) -> bool:
    """Whether progress lines go to ``stream``: not with ``quiet``; else ``KVGROUPS_PROGRESS``
    when set (``1`` / ``0``), else whether ``stream`` is a terminal."""
    if quiet:
        return False
    setting = os.environ.get(ENV, "").strip().lower()
    if setting in ("1", "true", "yes", "on"):
        return True
    if setting in ("0", "false", "no", "off"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    """Per-step lines of one run on ``stream`` (default stderr), when :func:`wanted`.

    Parameters
    ----------
    label : str
        What runs (``"kvgroups bench"``); it opens the first line and the last.
    total : int, optional
        Steps expected, when known: lines then read ``[ 3/40 ...]``.
    quiet : bool
        Print nothing (the command's ``--quiet``).
    """

    def __init__(
        self,
        label: str,
        total: int | None = None,
        *,
        quiet: bool = False,
        stream: TextIO | None = None,
    ) -> None:
        self.label, self.total = label, total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = wanted(self.stream, quiet)
        self.done = 0
        self.start = time.monotonic()

    def elapsed(self) -> str:
        seconds = int(time.monotonic() - self.start)
        return f"{seconds // 60}:{seconds % 60:02d}"

    def _write(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)

    def step(self, text: str) -> None:
        """One step finished; ``text`` says which."""
        self.done += 1
        count = (
            f"{self.done:>{len(str(self.total))}}/{self.total}" if self.total else str(self.done)
        )
        self._write(f"[{count} {self.elapsed():>5}] {text}")

    def note(self, text: str) -> None:
        """A line that is not a step (what starts, what was skipped)."""
        self._write(f"{self.label}: {text}")

    def __enter__(self) -> Progress:
        self.note("started" + (f", {self.total} steps" if self.total else ""))
        return self

    def __exit__(self, *exc: object) -> None:
        self.note(f"{self.done} steps in {self.elapsed()}")


class _CommandHandler(logging.StreamHandler):
    """The handler :func:`show_library_logs` adds (one per logger, however often called)."""


def show_library_logs(quiet: bool = False, stream: TextIO | None = None) -> None:
    """Show the library's ``kvgroups`` log lines at INFO (a kernel's first compile, ...) on
    ``stream`` for the rest of a command, where progress is :func:`wanted`. Idempotent."""
    stream = stream if stream is not None else sys.stderr
    logger = logging.getLogger("kvgroups")
    if not wanted(stream, quiet) or any(isinstance(h, _CommandHandler) for h in logger.handlers):
        return
    handler = _CommandHandler(stream)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
