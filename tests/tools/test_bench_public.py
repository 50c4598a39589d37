"""`kvgroups bench` measures the public calls: every record says what a user called."""

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

from kvgroups_tools import bench, bench_matrix, bench_public, bench_report

ROOT = Path(__file__).resolve().parents[2]
FIELDS = (
    "call",
    "ids",
    "runtime",
    "path",
    "direction",
    "placement",
    "chunks",
    "page_bytes",
    "frac_of_ceiling",
    "gbps",
    "median_s",
    "median_ms",
    "host_bound",
    "verified",
)


def installed(name):
    return (
        importlib.util.find_spec(name) is not None
        and importlib.util.find_spec(f"kvgroups_{name}") is not None
    )


RUNTIMES = ["numpy"] + [f"{n}-cpu" for n in ("torch", "jax") if installed(n)]


@pytest.fixture(scope="module")
def records():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    matrix = bench_matrix.select(bench_matrix.tiny(), ["headline"])
    return bench.BenchRun(matrix, lambda r: None).run(RUNTIMES)


def test_every_record_says_what_was_called_with_valid_values(records):
    transfers = [r for r in records if r["record"] == "transfer"]
    assert transfers and not [r for r in records if r["record"] == "error"]
    for r in transfers:
        missing = [f for f in FIELDS if f not in r]
        assert not missing, (missing, r)
        assert r["call"] in bench_public.CALLS + ("internal",)
        assert r["ids"] in bench_public.IDS
        assert r["runtime"] == r["backend"] and r["direction"] in ("store", "load")
        assert r["placement"] in ("device", "pinned")
        assert r["chunks"] == 2 and r["page_bytes"] == 2048  # small-pages: 16 x 1 x 64 fp16
        assert r["frac_of_ceiling"] > 0 and r["gbps"] > 0
        assert r["median_ms"] == pytest.approx(r["median_s"] * 1e3)
        assert r["gbps"] == pytest.approx(2 * r["bytes"] / r["median_s"] / 1e9)
        if r["call"] in ("store", "load"):
            assert r["call"] == r["direction"]  # one-shot calls are named by direction
        if r["call"] != "internal":
            assert r["verified"] is True, r  # public calls move the baseline's bytes
    got = {
        (r["backend"], r["call"], r["ids"], r["direction"])
        for r in transfers
        if r["call"] != "internal"
    }
    for rt in (n.split("-")[0] for n in RUNTIMES):
        for call in ("prepared", "layerwise"):
            for d in ("store", "load"):
                assert (rt, call, "host", d) in got
        assert (rt, "store", "host", "store") in got and (rt, "load", "host", "load") in got
    if installed("jax"):  # traced ids inside jax.jit are device ids, on any platform
        assert {("jax", "jit", k, d) for k in ("host", "device") for d in ("store", "load")} <= got
    layerwise = [r for r in transfers if r["call"] == "layerwise"]
    assert all(r["calls_per_transfer"] == r["layers"] for r in layerwise)


def test_cpu_ids_are_never_labelled_device_ids(records):
    """CPU tensors and concrete arrays are read to the host: a device-ids case is refused
    (a skipped record saying so), except inside jax.jit where the ids are traced."""
    for r in records:
        if r["record"] == "transfer" and r["ids"] == "device":
            assert (r["backend"], r["call"]) == ("jax", "jit"), r
    refused = {
        (r["backend"], r["call"])
        for r in records
        if r["record"] == "skipped" and r.get("ids") == "device"
    }
    if installed("torch"):
        assert {("torch", c) for c in ("store", "load", "prepared", "layerwise")} <= refused
        assert all(
            "host" in r["reason"]
            for r in records
            if r["record"] == "skipped" and r.get("backend") == "torch"
        )


@pytest.mark.skipif(not installed("torch"), reason="needs torch")
def test_a_cpu_tensor_is_refused_as_device_ids():
    import torch

    small = bench_matrix.Shape("small-pages", model="small-pages", layers=2).build(8)
    kit = bench.load_kit("torch-cpu")
    caches = kit.make_caches(small.kv_caches, 0)
    wl = bench.Workload(tensors=list(caches), caches=list(caches))
    case = bench_public.Case(None, wl, [np.arange(16)], None, "store", 2, 1)
    with pytest.raises(bench_public.Refused, match="host ids"):
        bench_public.check_device_ids(case, torch.arange(16))
    with pytest.raises(bench_public.Refused, match="CUDA"):
        kit.graph_call(case, "device")


def test_the_engine_matrix_covers_the_acceptance_grid():
    m = bench_matrix.preset("engine")
    assert not m.internal and set(m.calls) == set(bench_public.CALLS)
    assert set(m.ids) == {"host", "device"}
    llama = [p for p in m.points if p.shape.model == "llama3-8b"]
    assert {p.chunks for p in llama} == {1, 4, 16, 64, 256}
    assert {p.placement for p in llama} == {"device", "pinned"}
    pages = set()
    for shape, _points in m.shapes():
        g = bench_matrix.parse_kvcache_shape_spec(shape.spec)[0].shape_desc if shape.spec else None
        if g is not None:
            pages.add(g.bs * g.nh * g.hs * 2)
    assert pages | {32 << 10} == {512} | {k << 10 for k in (1, 2, 4, 8, 16, 32, 64, 128)}
    assert any(p.all_paths for p in m.points)  # every public path at the 64-chunk points
    calls = set()
    for p in m.points:
        calls |= set(m.calls if p.calls is None else p.calls)
    assert calls == set(bench_public.CALLS)


def test_public_table_groups_calls_and_flags_host_bound_and_refused(records):
    table = bench_report.public_table(records)
    lines = table.splitlines()
    assert lines[0].startswith("| runtime | call | ids |") and "host-bound" in lines[0]
    body = lines[2:]
    assert len(body) == len({line for line in body})  # one row per case
    assert any("| prepared | host |" in line for line in body)
    if installed("torch"):
        assert any("torch-cpu | store | device" in line and "skipped" in line for line in body)
    assert not bench_report.public_table([r for r in records if r.get("call") == "internal"])


def test_summarize_markdown_prints_the_public_table(records, tmp_path, capsys):
    from kvgroups_tools import cli

    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert cli.main(["bench", "--summarize", str(path), "--markdown", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "| runtime | call | ids |" in out and "| layerwise |" in out
