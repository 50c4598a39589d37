"""The suite collects with torch or JAX absent: that framework's tests are skipped, never
errors (and no test folder shadows the framework). The framework is hidden from a fresh
interpreter by an import hook installed through ``sitecustomize``."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

HOOK = textwrap.dedent("""
    import sys

    BLOCKED = {blocked!r}


    class _Hidden:
        # Every finder answers "not here" for the framework, so it looks uninstalled both to
        # imports and to importlib.util.find_spec.
        def __init__(self, finder):
            self._finder = finder

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                return None
            find = getattr(self._finder, "find_spec", None)
            return None if find is None else find(name, path, target)

        def __getattr__(self, attr):
            return getattr(self._finder, attr)


    sys.meta_path[:] = [_Hidden(finder) for finder in sys.meta_path]
""")


def _collect(tmp_path: Path, blocked: tuple[str, ...]) -> subprocess.CompletedProcess:
    (tmp_path / "sitecustomize.py").write_text(HOOK.format(blocked=set(blocked)))
    path = [str(tmp_path), str(ROOT), str(ROOT / "backends"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "tests",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize(
    "framework, folder", [("torch", "tests/torch_backend"), ("jax", "tests/jax_backend")]
)
def test_the_suite_collects_without_a_framework(tmp_path, framework, folder):
    done = _collect(tmp_path, (framework,))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert " error" not in out.lower().splitlines()[-1], out[-4000:]
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    # The hook worked, the framework's own tests were skipped, and the rest was collected.
    assert not any(line.startswith(folder + "/") for line in collected), out[-4000:]
    assert any(line.startswith("SKIPPED") and folder in line for line in out.splitlines()), out[
        -4000:
    ]
    assert any(line.startswith("tests/core/") for line in collected)
