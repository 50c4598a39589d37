"""Runs every example of docs/INTEGRATION.md (blocks after an ``<!-- example NAME ... -->``
marker), so the integration guide cannot rot."""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "INTEGRATION.md")
MARKER = re.compile(r"<!-- example (\S+)((?: requires=\S+)*) -->\n```python\n(.*?)```", re.S)


def examples() -> list:
    with open(DOC) as f:
        text = f.read()
    found = []
    for name, reqs, code in MARKER.findall(text):
        needs = [r.split("=", 1)[1] for r in reqs.split()]
        found.append(pytest.param(code, needs, id=name))
    return found


def test_the_guide_has_an_example_for_every_engine():
    assert {p.id for p in examples()} >= {"vllm-config", "vllm-adapter", "sglang", "jax-engines"}


@pytest.mark.parametrize("code,needs", examples())
def test_example_runs(code, needs):
    needs = needs + (["jax"] if "jax" in code else [])
    for module in needs:
        spec = importlib.util.find_spec(module)
        # A bare folder named like the module (tests/vllm) is a namespace package, not it.
        if spec is None or spec.origin in (None, "namespace"):
            pytest.skip(f"{module} is not installed")
    exec(compile(code, DOC, "exec"), {"__name__": "integration_example"})
