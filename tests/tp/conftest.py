import importlib.util
import os
import sys
from pathlib import Path

# backends/ is on the path through the editable install; a fresh checkout without it still
# finds kvgroups_torch.
if importlib.util.find_spec("kvgroups_torch") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends"))

# Eight CPU devices for the mesh-sharded merge tests (as tests/jax sets them on the JAX
# branch); read when JAX first starts its CPU client, so set before any test imports jax.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
