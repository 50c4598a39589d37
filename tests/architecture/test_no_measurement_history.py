"""The library's source carries no measurement history: comments and docstrings say why,
figures live in docs/PERFORMANCE.md and the benchmark records (benchmarks/results/).

A conservative scan of every library module (Python and the CUDA source): a GPU model
next to a figure on one line ("on the H200 ... 0.93"), a result record's file name
(``..._h200.jsonl``), "A/B", a commit hash named as one ("commit 5c996ff"), and "in run 5".
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = [
    ROOT / "kvgroups_core",
    ROOT / "kvgroups_tools",
    ROOT / "kvgroups_conformance",
    ROOT / "backends",
]
SUFFIXES = {".py", ".cu", ".cuh", ".h"}

_GPU = r"\b(?:[HAB]100|H200|GH200|GB200|B200|A10G|L4|L40S?)\b"
_FIGURE = r"\d+(?:\.\d+)?\s*(?:%|x\b|us\b|µs\b|ms\b|s\b|GB/s|TB/s|MiB|GiB)|\b0\.\d{2,}"
PATTERNS = {
    "a GPU model next to a figure": re.compile(rf"{_GPU}.*(?:{_FIGURE})|(?:{_FIGURE}).*{_GPU}"),
    "a result record's file name": re.compile(
        r"\w+_(?:[hab]\d00|gh200|b200)\w*\.jsonl", re.IGNORECASE
    ),
    "an A/B narrative": re.compile(r"\bA/B\b"),
    "a commit hash": re.compile(
        r"\bcommit\s+[0-9a-f]{7,40}\b|\b[0-9a-f]{7,40}\s+commit\b|"
        r"\bgit show [0-9a-f]{7,40}\b"
    ),
    "a numbered run": re.compile(r"\b(?:in|from|of) run \d+\b"),
}


def findings(text: str) -> list[tuple[int, str, str]]:
    """``(line, what, text)`` of every line that matches a pattern."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in PATTERNS.items():
            if pattern.search(line):
                out.append((n, what, line.strip()))
    return out


def _library_files() -> list[Path]:
    return sorted(
        p
        for d in LIBRARY
        for p in d.rglob("*")
        if p.suffix in SUFFIXES and "__pycache__" not in p.parts
    )


def test_library_code_carries_no_measurement_history():
    found = [
        f"{p.relative_to(ROOT)}:{n}: {what}: {line}"
        for p in _library_files()
        for n, what, line in findings(p.read_text())
    ]
    assert found == []


def test_the_scan_reads_the_library():
    names = {p.name for p in _library_files()}
    assert {"page_copy.cu", "api.py", "executor.py", "cli.py", "harness.py"} <= names


def test_the_scan_finds_each_kind_and_spares_plain_comments():
    bad = [
        "# On the H200 this took one-chunk calls from 0.89 to 0.97 of the copy.",
        "    the H200 (jax 0.11.2), against ~1 s for the load",
        "# 16 chunks 1.8-5.9 % faster (`jax_chunk_order_ab_h200.jsonl`).",
        "// in an A/B it took 32 graphed one-layer stores from 0.734 to 0.762",
        "# measured at commit 5c996ff",
        "# (slower in run 5)",
    ]
    fine = [
        "# Hopper and newer: Mosaic GPU for spans of >= 16 KiB (docs/PERFORMANCE.md).",
        "// units of plane 0, run 0 count ids, so every bad item counts once.",
        '    return f"expected ids in [0, {n}), got {value}"',
        "# compiled for an abstract compute-capability 9.0 GPU",
    ]
    assert [n for n, _, _ in findings("\n".join(bad))] == list(range(1, len(bad) + 1))
    assert findings("\n".join(fine)) == []
