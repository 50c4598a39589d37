import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Eight CPU devices for the sharded-cache tests (a mesh like a TP engine's); read when JAX
# first starts its CPU client, so set before any test asks for a device. Only the CPU
# platform is affected (GPU tests keep the real devices).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

jax = pytest.importorskip("jax")


def _gpu_available() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


HAS_GPU = _gpu_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="no CUDA GPU visible to JAX")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU and str(item.fspath).startswith(
                str(Path(__file__).parent)):
            item.add_marker(skip)
