"""Runs prefill and decode groups of pd_worker.py processes (test_pd_processes.py, and the
GPU variant test_pd_gpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "pd" / "pd_worker.py"


def skip_without_nixl() -> None:
    """Skip the calling test module when no NIXL wheel can be imported."""
    import pytest
    from kvgroups_transport import TransportUnavailableError
    from kvgroups_transport.nixl import import_nixl

    try:
        import_nixl()
    except TransportUnavailableError as exc:
        pytest.skip(str(exc), allow_module_level=True)


def run_pair(
    out: Path, writers: int, readers: int, timeout: float = 240, device: str = "cpu"
) -> dict:
    """Start ``writers`` prefill ranks and ``readers`` decode ranks; their JSON results."""
    out.mkdir()
    path = [str(ROOT), str(ROOT / "backends"), os.environ.get("PYTHONPATH", "")]
    env = dict(
        os.environ, OMP_NUM_THREADS="1", KVG_PD_DEVICE=device, PYTHONPATH=os.pathsep.join(path)
    )
    procs = []
    for role, world, other in (("prefill", writers, readers), ("decode", readers, writers)):
        for r in range(world):
            cmd = [
                sys.executable,
                str(WORKER),
                role,
                str(r),
                str(world),
                str(out),
                "nixl",
                str(other),
            ]
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
            )
    logs = []
    try:
        for p in procs[writers:]:  # the writers wait for the readers to release
            logs.append(p.communicate(timeout=timeout)[0])
        if (writers, readers) == (1, 1):
            procs[0].wait(timeout=30)  # the reader killed it (the "peer gone" case)
        for p in procs[:writers]:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs[writers:], logs):
        assert p.returncode == 0, f"decode rank failed:\n{log[-4000:]}"
    read = [json.loads((out / f"decode-{r}.json").read_text()) for r in range(readers)]
    wrote = [json.loads((out / f"prefill-{r}.json").read_text()) for r in range(writers)]
    return {"decode": read, "prefill": wrote}
