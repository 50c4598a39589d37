"""benchmarks/bench_jax_small_pages.py on the CPU (--tiny): the jitted public calls and the
prepared ones are verified against the NumPy reference, and every record says what was called."""

import importlib.util
import json
import sys
from pathlib import Path

from kvgroups_jax.lowerings import triton as pallas_copy

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_jax_small_pages.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_jax_small_pages", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_tiny_run_verifies_every_call_and_names_it(tmp_path):
    out = tmp_path / "small.jsonl"
    assert _module().main(["--tiny", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    transfers = [r for r in records if r["record"] == "transfer"]
    assert {(r["call"], r["ids"], r["direction"], r["chunks"]) for r in transfers} == {
        (call, ids, d, c) for call, ids in (("jit", "device"), ("prepared", "host"))
        for d in ("store", "load") for c in (1, 2)}
    for r in transfers:
        assert r["verified"] is True and r["runtime"] == "jax" and r["page_bytes"] == 512
        assert r["frac_of_ceiling"] == r["ceiling_s"] / r["median_s"]
        assert isinstance(r["host_bound"], bool)
    assert sum(r["record"] == "ceiling" for r in records) == 2


def test_tuning_option_is_checked_and_recorded(tmp_path, monkeypatch):
    monkeypatch.setitem(pallas_copy.TUNING, "read_first", True)
    out = tmp_path / "small.jsonl"
    module = _module()
    assert module.main(["--tiny", "--chunks", "1", "--tuning", "read_first=0",
                        "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["tuning"] == {"read_first": 0} for r in records)
    try:
        module.main(["--tiny", "--tuning", "no_such_knob=1"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("an unknown --tuning key was accepted")
