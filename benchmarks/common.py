"""Helpers shared by the benchmark scripts (not a benchmark itself).

The scripts run as programs (``python benchmarks/<script>``), so this folder is on
``sys.path`` and ``from common import ...`` finds this file.
"""

from __future__ import annotations

import collections
import glob
import json
import sys
import tempfile
from pathlib import Path
from typing import IO, Any, Callable


class JsonLines:
    """One JSON object per line on stdout, and appended to ``out_file`` when one is given."""

    def __init__(self, out_file: Path | str | None = None) -> None:
        self.out: IO[str] | None = open(out_file, "a") if out_file else None

    def __call__(self, record: dict[str, Any]) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        if self.out is not None:
            self.out.write(line + "\n")
            self.out.flush()

    def close(self) -> None:
        if self.out is not None:
            self.out.close()
            self.out = None


def device_kernels(
    fn: Callable[[int], Any], sync: Callable[[], Any], calls: int = 20
) -> dict[str, float]:
    """Device seconds per call of ``fn(i)`` by kernel name, from a JAX profiler trace of
    ``calls`` warmed calls (the accelerator's stream lines; empty where the backend records
    none, as on the CPU). Kernel durations carry no host time: where a step's wall-time
    subtraction mixes in the host's dispatch, these say what its kernels cost."""
    import jax

    fn(0)
    sync()
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for i in range(calls):
                fn(i)
            sync()
        files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(files[0])
    out: collections.Counter[str] = collections.Counter()
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            # Module and op summary lines repeat the stream's kernels: count each once.
            if "XLA" in line.name or "Step" in line.name:
                continue
            for ev in line.events:
                out[ev.name] += ev.duration_ns / 1e9 / calls
    return dict(out)


def fail(message: str) -> None:
    """A benchmark's own refusal: one line on stderr, exit status 2 (as argparse)."""
    print(f"{Path(sys.argv[0]).name}: {message}", file=sys.stderr)
    raise SystemExit(2)
