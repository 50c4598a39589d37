"""benchmarks/sweep_small_pages.py on the CPU (--tiny): its references verify every
configuration (a broken reference or restore would fail here before it costs a GPU run) and
it writes transfer records and the winner table."""

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sweep_small_pages.py"


def test_tiny_sweep_verifies_every_configuration_and_reports_winners(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("sweep_small_pages", SCRIPT)
    sweep = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = sweep  # its dataclasses look their module up
    spec.loader.exec_module(sweep)
    out = tmp_path / "sweep.jsonl"
    try:
        assert sweep.main(["--tiny", "--runtimes", "torch", "--pages", "512",
                           "--out", str(out)]) == 0
    finally:
        sweep.set_torch_variant("classic", None)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    transfers = [r for r in records if r["record"] == "transfer"]
    assert transfers and all(r["verified"] for r in transfers)
    assert {r["variant"] for r in transfers} == {"classic", "small"}
    assert {(r["call"], r["ids"], r["direction"]) for r in transfers} >= {
        ("prepared", "device", "store"), ("prepared", "device", "load"),
        ("prepared", "host", "store"), ("prepared", "host", "load")}
    assert all(r["frac_of_ceiling"] > 0 and r["bytes"] > 0 for r in transfers)
    table = records[-1]
    assert table["record"] == "winners" and len(table["lines"]) > 1
    assert "torch suggestion" in capsys.readouterr().out
    from kvgroups_cuda import geometry, nvrtc

    assert geometry.SMALL_PAGE_BYTES == 0 and "KVG_SMALL_UNROLL" not in nvrtc.TUNING
    assert (geometry.SMALL_PLANES_PER_CTA, geometry.SMALL_CTA_BYTES) == (8, 65536)
