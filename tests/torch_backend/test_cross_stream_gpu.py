"""Launches on several streams share the CUDA path's tables safely: a launch state built on a
busy stream and first used on another, one dropped while a queued launch on another stream
still reads it, a graph captured before the upload is known done, and a bad id met on a
side stream raised by the check on the main stream.
Each case runs in its own process (tests/torch_backend/cross_stream_cases.py): a table read before
its upload faults the whole CUDA context."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cuda_marks import needs_cuda

pytestmark = needs_cuda

CASES = Path(__file__).resolve().parent / "cross_stream_cases.py"


@pytest.mark.parametrize("case", ["upload", "lifetime", "capture", "check"])
def test_cross_stream_case(case):
    done = subprocess.run(
        [sys.executable, str(CASES), case],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
        f"{case}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )
