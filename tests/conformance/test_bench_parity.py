"""``benchmarks/bench_parity.py --tiny`` (JAX against torch on the same work) runs on the CPU,
verifies the JAX programs' bytes against torch's, and writes the fields its H200 records are
read by. No timing is asserted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"call", "ids", "runtime", "path", "direction", "placement", "chunks", "page_bytes",
          "gbps", "frac_of_ceiling", "median", "wall_ms", "copy_ms", "bytes", "steady_state"}


def test_tiny_run_verifies_both_directions_and_writes_every_record(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    out = tmp_path / "parity.jsonl"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_parity.py"), "--tiny", "--repeats",
         "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["runtime"], r["call"], r["direction"], r["chunks"]) for r in rows} == {
        (runtime, call, direction, chunks)
        for runtime, call in (("torch", "prepared"), ("jax", "jit"))
        for direction in ("store", "load") for chunks in (1, 2)}
    for row in rows:
        assert FIELDS <= set(row), row
        assert row["ids"] == "device" and row["placement"] == "device"
        assert row["gbps"] > 0 and row["frac_of_ceiling"] > 0 and row["wall_ms"] > 0
        assert isinstance(row["steady_state"], bool)
    jax_rows = [r for r in rows if r["runtime"] == "jax"]
    assert all(r["verified"] is True and r["frac_of_torch"] > 0 for r in jax_rows)
    assert all(r["calls_per_program"] == 2 and r["programs_in_flight"] == 2 for r in jax_rows)


def test_the_byte_check_notices_one_changed_byte():
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_parity import same_bytes
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    bits = torch.arange(64, dtype=torch.int16).view(torch.bfloat16).reshape(4, 16)
    mine = [jnp.asarray(bits.view(torch.int16).numpy()).view(jnp.bfloat16)]
    assert same_bytes(mine, [bits])
    other = bits.clone()
    other.view(torch.uint8).reshape(-1)[77] ^= 1
    assert not same_bytes(mine, [other])
