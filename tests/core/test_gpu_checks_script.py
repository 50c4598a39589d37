"""scripts/gpu_checks.sh (the GPU checks in one command) cannot rot unseen on a machine without
a GPU: it parses, every test file it names exists, and every benchmark command it runs is one
benchmarks/results/README.md lists."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_checks.sh"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_test_file_it_names_exists():
    names = re.findall(r"\b(test_\w+\.py|mosaic_smoke\.py)\b", SCRIPT.read_text())
    assert names
    for name in set(names):
        assert list((ROOT / "tests").rglob(name)), name


def test_its_benchmarks_are_the_records_commands():
    records = (ROOT / "benchmarks" / "results" / "README.md").read_text()
    pattern = r"(benchmarks/" + r"bench_\w+\.py).*?--out \"\$OUT/(\w+\.jsonl)\""
    found = re.findall(pattern, SCRIPT.read_text())
    assert len(found) >= 3, found
    for script, out in found:
        assert (ROOT / script).is_file(), script
        if out != "host_cost_h200.jsonl":  # measured first by this script
            assert out in records, out
