"""The suite's own layout: test folders are not packages, so two test files with one basename
stop pytest's collection of the whole suite ("import file mismatch")."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_files_have_unique_basenames():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, k in names.items() if k > 1] == []
