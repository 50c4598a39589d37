import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvgroups_conformance import Harness, harness_for, reference_harness
from kvgroups_conformance.__main__ import _parser, pytest_args
from kvgroups_conformance.caches import all_blocks, copy_keeping_strides
from kvgroups_conformance.caches import make_caches as build
from kvgroups_conformance.compare import block_mismatches, moved_blocks, object_mismatches
from kvgroups_conformance.report import ConformanceFailure, Mismatch, case_record, format_case
from kvgroups_core.errors import BackendNotFoundError
from kvgroups_core.formats.catalogue import EngineKVFormat as F
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_core.transfer.api import store

REPO = Path(__file__).resolve().parents[2]
FMT = F.NL_X_TWO_NB_BS_NH_HS
GEOMETRY = dict(nl=2, nb=10, bs=4, nh=2, hs=8)


def _caches(zero=False, seed=0):
    return build(FMT, dtype="float16", rng=np.random.default_rng(seed), zero=zero, **GEOMETRY)


def test_a_block_written_to_the_wrong_place_is_named_with_its_first_wrong_byte():
    src, formats = _caches()
    dst, _ = _caches(zero=True)
    moved = {3: 7}  # destination block 3 should hold source block 7 ...
    want = moved_blocks(all_blocks(src, formats), all_blocks(dst, formats), moved)
    dst[1][1, 4] = src[1][1, 7]  # ... but layer 1's V plane got it in block 4
    dst[0][:, 3] = src[0][:, 7]
    dst[1][0, 3] = src[1][0, 7]
    [m] = block_mismatches(
        dst, formats, want, what="load", source=all_blocks(src, formats), expected_source=moved
    )
    assert (m.format, m.dtype, m.layer, m.plane, m.plane_name) == (FMT.name, "float16", 1, 1, "V")
    assert (m.block, m.byte, m.token, m.actual) == (3, 0, 0, 0)
    assert m.expected == src[1][1, 7].view(np.uint8).reshape(-1)[0]
    assert m.differing_blocks == 2  # block 3 missing, block 4 written though untouched
    assert "written to block 4 instead" in m.hint
    assert "layer 1, plane 1 (V), block 3, byte 0 (token 0)" in m.describe()


def test_the_first_wrong_byte_inside_a_block_gives_its_token():
    src, formats = _caches()
    got = [a.copy() for a in src]
    got[0].view(np.uint16)[0, 5, 2, 1, 3] ^= 0x00FF  # low byte of K, block 5, token 2, h1 e3
    [m] = block_mismatches(got, formats, all_blocks(src, formats), what="store")
    row_bytes = 2 * 8 * 2
    assert (m.layer, m.plane, m.block, m.token) == (0, 0, 5, 2)
    assert m.byte == 2 * row_bytes + (8 + 3) * 2 and m.differing_blocks == 1


def test_an_object_holding_the_next_block_is_traced_back_to_layer_plane_and_block():
    src, formats = _caches()
    manager = KVLayerGroupsManager(src, formats, lmcache_tokens_per_chunk=8)
    ids = np.array([2, 5, 8, 1])
    want = store(manager, src, ids, backend="numpy")[0]
    off_by_one = store(manager, src, np.array([3, 6, 9, 2]), backend="numpy")[0]
    [m] = object_mismatches(
        off_by_one, want, manager, 0, what="store", ids={0: ids}, source_caches=src, formats=formats
    )
    assert (m.layer, m.plane, m.block, m.chunk, m.object_group) == (0, 0, 2, 0, 0)
    assert "source block 3 instead of block 2" in m.hint
    assert m.differing_blocks == 2 * 2 * 4  # every (plane, layer, block) of both chunks
    # A wrong byte deep inside: chunk 1, layer 1, V plane, second block of the chunk.
    got = want.copy()
    nl, slots, row = 2, 8, 2 * 8 * 2
    offset = ((1 * nl + 1) * slots + 4 + 3) * row + 5  # plane V of layer 1, token 3 of pos 1
    got[1, offset] ^= 0xFF
    [m] = object_mismatches(got, want, manager, 0, what="store", ids={0: ids})
    assert (m.chunk, m.layer, m.plane, m.block, m.token, m.byte) == (1, 1, 1, 1, 3, 3 * row + 5)
    assert m.object_byte == offset and m.differing_blocks == 1
    assert object_mismatches(want, want, manager, 0, what="store") == []


def test_report_rows_and_lines_carry_the_mismatch():
    m = Mismatch(
        what="load",
        format="F",
        dtype="bfloat16",
        layer=2,
        plane=1,
        plane_name="V",
        block=9,
        byte=17,
        token=0,
        expected=1,
        actual=2,
        hint="a hint",
    )
    row = case_record(
        "suite/test_x.py::t[a]",
        {"fmt": FMT, "dtype": "bfloat16"},
        "failed",
        ConformanceFailure([m]),
    )
    assert json.loads(json.dumps(row))["mismatches"][0]["block"] == 9
    assert row["params"] == {"fmt": FMT.name, "dtype": "bfloat16"}
    lines = format_case(row)
    assert lines[0] == "FAILED suite/test_x.py::t[a]"
    assert "layer 2, plane 1 (V), block 9, byte 17" in lines[1] and "a hint" in lines[1]
    error = case_record("t", {}, "failed", IndexError("index 12 is out of bounds"))
    assert format_case(error)[1] == "    raised IndexError: index 12 is out of bounds"


def test_copy_keeping_strides_keeps_the_padding_between_blocks():
    src, _ = build(FMT, dtype="float16", rng=np.random.default_rng(1), pad=40, **GEOMETRY)
    a = src[0]
    b = copy_keeping_strides(a)
    assert b.strides == a.strides and not np.shares_memory(a, b)
    np.testing.assert_array_equal(b.view(np.uint16), a.view(np.uint16))
    raw = np.lib.stride_tricks.as_strided(
        b, shape=(a.shape[0] - 1, a.strides[0] // 2), strides=(a.strides[0], 2)
    )
    assert (raw[:, int(np.prod(a.shape[1:])) :].view(np.uint8) == 0xA5).all()


def test_harness_resolution_order():
    assert type(harness_for("numpy")) is Harness and harness_for("numpy").id == "numpy"
    spec = "kvgroups_conformance.harness:reference_harness"
    assert harness_for("numpy", spec).id == "numpy-ref"
    with pytest.raises(BackendNotFoundError, match="numpy"):
        harness_for("no-such-backend")
    with pytest.raises(ValueError, match="module:attribute"):
        harness_for("numpy", "no_colon")
    with pytest.raises(TypeError, match="expected a Harness"):
        harness_for("numpy", "kvgroups_conformance.caches:DTYPES")


def test_the_generic_harness_round_trips_every_dtype_through_the_backend():
    h = Harness("numpy", "numpy")
    for name in ("bfloat16", "float8_e4m3fn", "float32", "uint8"):
        a, _ = build(FMT, dtype=name, rng=np.random.default_rng(3), **GEOMETRY)
        back = h.to_numpy(h.from_numpy(a[0]), a[0])
        assert back.dtype == a[0].dtype
        np.testing.assert_array_equal(back.view(np.uint8), a[0].view(np.uint8))


def test_the_command_line_runs_the_installed_suite_with_the_plugin():
    args = pytest_args(
        _parser().parse_args(["--backend", "x", "--report", "r.json", "--", "-k", "skips"])
    )
    assert args[args.index("--pyargs") + 1] == "kvgroups_conformance.suite"
    assert (
        args[args.index("-p", args.index("no:cacheprovider")) + 1] == "kvgroups_conformance.plugin"
    )
    assert args[-2:] == ["-k", "skips"] and "--kvgroups-report" in args


def _kit(*argv, cwd):
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'backends'}", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "kvgroups_conformance", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_an_unknown_backend_is_a_usage_error_listing_the_registered_ones(tmp_path):
    proc = _kit("--backend", "nope", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr  # a bad option, refused first
    assert "expected one of" in proc.stderr and "'numpy'" in proc.stderr


def test_a_declared_unsupported_config_must_raise_not_implemented(tmp_path):
    (tmp_path / "claims.py").write_text(
        "from kvgroups_conformance import Harness\n"
        "class Claims(Harness):\n"
        "    def __init__(self):\n"
        "        super().__init__('numpy', 'numpy')\n"
        "    def supports(self, fmt, dtype):\n"
        "        return dtype != 'float16'\n"
    )
    report = tmp_path / "r.json"
    env_path = f"{tmp_path}:{REPO}:{REPO / 'backends'}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgroups_conformance",
            "--backend",
            "numpy",
            "--harness",
            "claims:Claims",
            "--report",
            str(report),
            "--",
            "-q",
            "-k",
            "round_trip_moves and NL_X_TWO_NB_BS_NH_HS",
        ],
        cwd=tmp_path,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    rows = json.loads(report.read_text())["cases"]
    failed = [r for r in rows if r["outcome"] == "failed"]
    assert proc.returncode == 1 and len(rows) == 4 and len(failed) == 1, proc.stdout[-3000:]
    assert failed[0]["params"]["dtype"] == "float16"
    assert "UnsupportedConfigError" in failed[0]["error"] or "DID NOT RAISE" in failed[0]["error"]
    assert reference_harness().supports(FMT, "float16")


def test_the_reference_harness_checks_real_padding():
    src, _ = build(FMT, dtype="float16", rng=np.random.default_rng(1), pad=40, **GEOMETRY)
    h = reference_harness()
    assert h.keeps_padding and h.from_numpy(src[0]).strides == src[0].strides


def test_the_small_case_set_keeps_every_format_and_dtype_and_says_so(tmp_path):
    (tmp_path / "slow.py").write_text(
        "from kvgroups_conformance import Harness\n"
        "class Slow(Harness):\n"
        "    def __init__(self):\n"
        "        super().__init__('numpy', 'numpy', cases='small')\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}:{REPO / 'backends'}", "PATH": "/usr/bin:/bin"}
    runs = {}
    for name, extra in (("declared", []), ("forced", ["--cases", "full"])):
        report = tmp_path / f"{name}.json"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvgroups_conformance",
                "--backend",
                "numpy",
                "--harness",
                "slow:Slow",
                "--report",
                str(report),
                *extra,
                "--",
                "-q",
                "-k",
                "round_trip_moves",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        runs[name] = (proc.stdout, json.loads(report.read_text()))
    out, small = runs["declared"]
    assert small["cases_run"] == "small" and "CONFORMANT (small case set)" in out
    pairs = {(r["params"]["fmt"], r["params"]["dtype"]) for r in small["cases"]}
    assert len({f for f, _ in pairs}) == 15  # every format ...
    assert {d for _, d in pairs} == {"float16", "bfloat16", "float32", "float8_e4m3fn"}
    assert len(pairs) == 18  # ... and every dtype, not every combination
    out, full = runs["forced"]
    assert full["cases_run"] == "full" and len(full["cases"]) == 60
    assert "CONFORMANT: numpy" in out
