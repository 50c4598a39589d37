"""Every benchmark script runs as a program with ``--tiny`` (seconds, on the CPU), writes JSON
lines that name the public call they measured, and reports no failed check. No timing is
asserted: the figures of a tiny CPU run mean nothing; that the GPU run cannot rot unseen does.

Scripts are run, never imported: a benchmark is a program, and nothing here depends on its
insides. A script that imports torch or JAX at its top level is skipped where that runtime is
not installed."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("bench_*.py"))

#: Arguments beyond ``--tiny`` that keep a script's CI run short (CI has two cores).
QUICKER = {
    "bench_jax_engine.py": ["--repeats", "2", "--target-ms", "2"],
    "bench_parity.py": ["--repeats", "1"],
    "bench_transfer.py": ["--sweeps", "headline", "--repeats", "1", "--quiet"],
}
#: Fields of records that carry a figure: what was called, and with what.
FIGURES = ("gbps", "frac_of_ceiling", "us_median", "median_ms", "median_s", "median")
#: Records that measure no call of the library: the ceilings beside the figures, summaries.
NOT_CALLS = ("ceiling", "summary", "meta")


def frameworks(script: Path) -> list[str]:
    """The runtimes ``script`` imports at its top level."""
    needed = []
    for node in ast.parse(script.read_text()).body:
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        needed += [n.split(".")[0] for n in names if n.split(".")[0] in ("torch", "jax")]
    return sorted(set(needed))


def env() -> dict:
    paths = [str(ROOT), str(ROOT / "backends"), os.environ.get("PYTHONPATH", "")]
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in paths if p),
        JAX_PLATFORMS="cpu",
        CUDA_VISIBLE_DEVICES="",
    )


def test_the_scripts_are_the_ones_benchmarks_readme_describes():
    readme = (BENCHMARKS / "README.md").read_text()
    assert SCRIPTS
    for script in SCRIPTS:
        assert f"`{script.name}`" in readme, script.name


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_tiny_run_writes_records_naming_the_call(script, tmp_path):
    for module in frameworks(script):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    out = tmp_path / "records.jsonl"
    out.write_text("")
    done = subprocess.run(
        [sys.executable, str(script), "--tiny", *QUICKER.get(script.name, []), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env(),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records and records == printed  # --out appends exactly what the run printed
    measured = [
        r for r in records if any(k in r for k in FIGURES) and r.get("record") not in NOT_CALLS
    ]
    assert measured, "no record carries a figure"
    for record in measured:
        assert isinstance(record.get("call"), str) and record["call"], record
    assert not [r for r in records if r.get("verified") is False or r.get("record") == "error"]


def test_the_docs_tables_are_the_ones_the_records_give():
    for args in (["headline", "--check", "README.md"], ["--check", "docs/PERFORMANCE.md"]):
        done = subprocess.run(
            [sys.executable, str(BENCHMARKS / "tables.py"), *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env(),
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
