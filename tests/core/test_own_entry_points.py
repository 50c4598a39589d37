"""kvgroups' own backend variants (pyproject's ``kvgroups.backends`` entry points) are known
by name after installation, and naming them imports nothing: the registry loads them lazily."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
from kvgroups_core.tensors.arrays import get_backend, registered_backends
names = registered_backends()
assert {"jax-tpu", "jax-tpu-interpret"} <= set(names), names
get_backend("numpy")
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "kvgroups_jax"))
assert not leaked, leaked
backend = get_backend("jax-tpu-interpret")
assert backend.lowering == "tpu-interpret" and get_backend("jax-tpu").lowering == "tpu"
print("ok")
"""


def test_the_tpu_variants_are_registered_lazily():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (
        "reinstall kvgroups (pip install -e .) if its entry points are missing:\n"
        + proc.stdout
        + proc.stderr
    )
