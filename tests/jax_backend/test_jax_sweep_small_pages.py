"""The JAX part of benchmarks/sweep_small_pages.py on the CPU (--tiny): every configuration
(the one-item kernel and the small-page one) verified against the NumPy reference."""

import importlib.util
import json
import sys
from pathlib import Path

from kvgroups_jax.lowerings import triton as pallas_copy

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sweep_small_pages.py"


def test_tiny_jax_sweep_verifies_and_restores_the_tuning(tmp_path):
    spec = importlib.util.spec_from_file_location("sweep_small_pages_jax", SCRIPT)
    sweep = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = sweep
    spec.loader.exec_module(sweep)
    before = dict(pallas_copy.TUNING)
    out = tmp_path / "sweep.jsonl"
    assert sweep.main(["--tiny", "--runtimes", "jax", "--pages", "512", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    transfers = [r for r in records if r["record"] == "transfer"]
    assert {(r["items_per_program"], r["direction"]) for r in transfers} == {
        (1, "store"), (1, "load"), (4, "store"), (4, "load")}
    assert all(r["verified"] and r["runtime"] == "jax" for r in transfers)
    assert records[-1]["record"] == "winners"
    assert pallas_copy.TUNING == before
