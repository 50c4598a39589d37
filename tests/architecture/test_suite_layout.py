"""The suite's own layout: a package (``tests``) whose folders cannot shadow a framework, whose
helpers are imported as package modules (``tests.support``), with no ``sys.path`` edits in a
conftest and one place that sets ``XLA_FLAGS``."""

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# A separately installed project the kit tests install; not part of the suite's package.
OUTSIDE = TESTS / "kit" / "third_party_backend"
FRAMEWORKS = {"torch", "jax", "jaxlib", "numpy"}


def _suite_files(pattern: str) -> list[Path]:
    return sorted(p for p in TESTS.rglob(pattern) if OUTSIDE not in p.parents)


def test_every_test_folder_is_a_package():
    folders = {p.parent for p in _suite_files("*.py")}
    missing = sorted(str(f.relative_to(TESTS)) for f in folders if not (f / "__init__.py").exists())
    assert (TESTS / "__init__.py").exists() and missing == []


def test_no_test_folder_is_named_like_a_framework():
    names = {p.name for p in TESTS.rglob("*") if p.is_dir() and OUTSIDE not in p.parents}
    assert names & FRAMEWORKS == set()


def test_no_conftest_edits_sys_path():
    edits = []
    for conftest in _suite_files("conftest.py"):
        for node in ast.walk(ast.parse(conftest.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "path"
                and isinstance(node.value, ast.Name)
                and node.value.id == "sys"
            ):
                edits.append(str(conftest.relative_to(TESTS)))
    assert edits == []


def test_xla_flags_are_set_in_one_place():
    setting = re.compile(r"""environ\[["']XLA_FLAGS["']\]\s*=|setenv\(\s*["']XLA_FLAGS""")
    places = sorted(
        str(p.relative_to(TESTS)) for p in _suite_files("*.py") if setting.search(p.read_text())
    )
    assert places == ["conftest.py"]
