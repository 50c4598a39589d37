"""Session-wide test set-up, loaded before any test module is imported.

Eight CPU devices for the JAX mesh tests (tests/jax_backend/test_sharded.py,
tests/tp/test_tp_jax.py): XLA reads the flag once, when JAX first starts its CPU client, which
may be in any folder of a whole-suite run, so this is the one place it is set. Only the CPU
platform is affected (GPU tests keep the real devices).
"""

import os

import pytest

from kvgroups_core.transfer import api as transfer

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()


@pytest.fixture
def planned(monkeypatch):
    """How many calls planned (took the full path) so far."""
    count = [0]
    real = transfer.plan_call

    def counting(*args, **kw):
        count[0] += 1
        return real(*args, **kw)

    monkeypatch.setattr(transfer, "plan_call", counting)
    return count
