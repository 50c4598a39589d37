"""Runs the examples of docs/PD.md (blocks after an ``<!-- example NAME requires=... -->``
marker), so the P/D guide cannot rot."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "PD.md"
MARKER = re.compile(r"<!-- example (\S+)((?: requires=\S+)*) -->\n```python\n(.*?)```", re.S)


def examples() -> list:
    return [
        pytest.param(code, [r.split("=", 1)[1] for r in reqs.split()], id=name)
        for name, reqs, code in MARKER.findall(DOC.read_text())
    ]


def test_the_guide_has_its_loopback_example():
    assert [p.id for p in examples()] == ["pd-loopback"]


@pytest.mark.parametrize("code,needs", examples())
def test_example_runs(code, needs):
    if not any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12", "nixl_cu13")):
        pytest.skip("no NIXL wheel installed")
    exec(compile(code, str(DOC), "exec"), {"__name__": "pd_example"})
