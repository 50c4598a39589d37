"""benchmarks/bench_pd.py runs tiny on CPU (two processes over NIXL) and reports the
descriptor counts as a measured property: one per object group for a run of consecutive
chunks, one per (chunk, object group) for scattered entries, a partial pull moving only the
chunks the reader lacks, and vLLM NixlConnector's count for the same request beside them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.support.pd_runs import skip_without_nixl

pytest.importorskip("torch")
skip_without_nixl()

ROOT = Path(__file__).resolve().parents[2]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_pd", ROOT / "benchmarks" / "bench_pd.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "pd.jsonl"
    assert load_bench().main(["--tiny", "--out", str(out)]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def pick(records, model, case, chunks):
    (rec,) = [r for r in records if (r["model"], r["case"], r["chunks"]) == (model, case, chunks)]
    return rec


def test_every_record_carries_the_fields_the_lead_reads(records):
    keys = {
        "call",
        "model",
        "transport",
        "memory",
        "chunks",
        "descriptors",
        "posted_descriptors",
        "nixl_connector_descriptors",
        "bytes",
        "time_us",
        "transfer_us",
        "gbps",
        "ceiling_gbps",
        "frac_of_ceiling",
    }
    assert all(keys <= set(r) for r in records)
    assert {r["case"] for r in records} == {
        "pull",
        "pull_scattered",
        "pull_partial",
        "pull_load",
        "first_layer",
    }
    assert all(r["memory"] == "DRAM" and r["gbps"] > 0 for r in records)


@pytest.mark.parametrize("model", ["llama", "hybrid"])
def test_descriptors_per_request(records, model):
    groups = 1 if model == "llama" else 2
    for n in (1, 2):
        assert pick(records, model, "pull", n)["descriptors"] == groups
        assert pick(records, model, "pull_scattered", n)["descriptors"] == n * groups
        partial, whole = pick(records, model, "pull_partial", n), pick(records, model, "pull", n)
        assert partial["descriptors"] == groups
        assert partial["bytes"] * n == whole["bytes"]
        # vLLM's NixlConnector: one per (block of 16 tokens, layer, K/V) before merging.
        assert whole["nixl_connector_descriptors"] == n * 256 // 16 * 4 * 2
        assert 0 < whole["posted_descriptors"] <= whole["descriptors"]


def test_the_first_layer_moves_a_quarter_of_a_four_layer_model(records):
    for n in (1, 2):
        first = pick(records, "llama", "first_layer", n)
        assert first["bytes"] * 4 == pick(records, "llama", "pull", n)["bytes"]
        assert "whole_request_us" in first
