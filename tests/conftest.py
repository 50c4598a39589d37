"""Session-wide test set-up, loaded before any test module is imported.

Eight CPU devices for the JAX mesh tests (tests/jax/test_sharded.py, tests/tp/test_tp_jax.py).
XLA reads the flag once, when JAX first starts its CPU client; the folder conftests set it too,
but in a whole-suite run an earlier folder (conformance, core) starts JAX first, and the mesh
tests then found one device and skipped. Only the CPU platform is affected.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
