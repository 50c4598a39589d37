"""The small case set: every format, dtype and feature at least once, not every combination.

A certified run takes the full matrix (``--cases full``, the default). Backends whose every
new program is expensive to build (an interpreter: a Pallas TPU kernel in TPU interpret mode
compiles for seconds on a CPU, and every case is a new plan shape) may declare
``conformance_cases = "small"`` on the backend, or be run with ``--cases small``: each suite
module then names the cases it keeps with a module-level ``small_case(test_name, params)``
(modules without one keep everything), and the plugin deselects the rest. The verdict says
which set ran.
"""

from __future__ import annotations

from typing import Any, Sequence

CASE_SETS = ("full", "small")


def check_case_set(value: Any) -> str:
    if value not in CASE_SETS:
        raise ValueError(f"cases: expected one of {CASE_SETS}, got {value!r}")
    return value


def every_nth(value: Any, values: Sequence[Any], n: int, offset: int = 0) -> bool:
    """Whether ``value`` is one of every ``n`` th of ``values`` (from ``offset``)."""
    return (list(values).index(value) - offset) % n == 0


def keeps(module: Any, name: str, params: dict) -> bool:
    """Whether the small set keeps test ``name`` of ``module`` with ``params``."""
    pick = getattr(module, "small_case", None)
    return True if pick is None else bool(pick(name, params))


__all__ = ["CASE_SETS", "check_case_set", "every_nth", "keeps"]
