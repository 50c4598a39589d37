from pathlib import Path

import pytest

# The eight CPU devices of the sharded-cache tests come from tests/conftest.py (XLA_FLAGS).
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
        if (
            "gpu" in item.keywords
            and not HAS_GPU
            and str(item.fspath).startswith(str(Path(__file__).parent))
        ):
            item.add_marker(skip)
