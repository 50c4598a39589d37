"""Every package the project installs ships its annotations (PEP 561): a ``py.typed`` marker in
the package, and the package data that puts it into the wheel.

The packages are the ones ``pyproject.toml`` tells setuptools to find, found the way setuptools
finds them, so a new package without the marker fails here.
"""

import fnmatch
import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def _top_level_packages() -> dict[str, Path]:
    """``{package: its folder}`` for every top-level package setuptools installs."""
    find = SETUPTOOLS["packages"]["find"]
    found = {}
    for where in find["where"]:
        for name in find_packages(str(ROOT / where), include=find["include"]):
            if "." not in name:
                found[name] = ROOT / where / name
    return found


def _ships(package: str, filename: str) -> bool:
    """Whether ``[tool.setuptools.package-data]`` puts ``filename`` of ``package`` in the wheel."""
    data = SETUPTOOLS.get("package-data", {})
    patterns = [*data.get("*", []), *data.get(package, [])]
    return any(fnmatch.fnmatch(filename, pattern) for pattern in patterns)


def test_the_installed_packages_are_the_seven_of_the_project():
    # Guards the tests below against a lookup that silently finds fewer packages.
    assert sorted(_top_level_packages()) == [
        "kvgroups_conformance",
        "kvgroups_core",
        "kvgroups_cuda",
        "kvgroups_jax",
        "kvgroups_tools",
        "kvgroups_torch",
        "kvgroups_transport",
    ]


def test_every_package_has_a_py_typed_marker():
    missing = sorted(
        name
        for name, folder in _top_level_packages().items()
        if not (folder / "py.typed").is_file()
    )
    assert missing == []


def test_the_markers_are_package_data():
    left_out = sorted(name for name in _top_level_packages() if not _ships(name, "py.typed"))
    assert left_out == []
    # The check reads the patterns, not just any entry: a file no pattern names is left out.
    assert not _ships("kvgroups_core", "notes.txt")
