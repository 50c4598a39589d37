"""kvgroups conformance kit: the cross-backend suite, installable, for any registered backend.

Run it against a backend found through the registry (``kvgroups.backends`` entry points)::

    python -m kvgroups_conformance --backend NAME

The cases (``kvgroups_conformance.suite``) take a ``harness`` fixture: a :class:`Harness` that
makes the backend's arrays from NumPy arrays, reads them back and names the backend. See
``docs/CONFORMANCE.md`` for how to write a harness and certify a backend.
"""

from .harness import HARNESS_ENTRY_POINTS, Harness, harness_for, reference_harness
from .report import ConformanceFailure, Mismatch

__all__ = [
    "HARNESS_ENTRY_POINTS",
    "ConformanceFailure",
    "Harness",
    "Mismatch",
    "harness_for",
    "reference_harness",
]
