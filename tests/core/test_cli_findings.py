"""The command line as a new user meets it (issue 35, point 8): every finding, as a process.

Each case runs ``kvgroups`` (``python -m kvgroups_tools.cli``) or ``python -m
kvgroups_conformance`` in a subprocess and checks what the user sees: the exit status (2 for a
bad option, refused before anything ran; 1 for a failed check; 0 done), one line on stderr
naming the option as typed, and never a traceback. Refusals must come before any framework is
imported: those cases run with ``torch`` and ``jax`` packages on the path that kill the process
(status 99) if imported. "Without torch" and "without pytest" are packages on the path whose
import fails. Nothing may be created outside the paths given (``--out`` in a missing
directory creates no directory).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KVG = [sys.executable, "-m", "kvgroups_tools.cli"]
KIT = [sys.executable, "-m", "kvgroups_conformance"]
SPEC = "(2,1024,16,8,128):bfloat16:32;(1,1024,64,1,576):bfloat16:2"
README_SPEC = "(2,4096,16,8,128):bfloat16:32"
NUMPY = ["--store-backend", "numpy", "--load-backend", "numpy"]
# A directory that does not exist, named afresh per run (a run of the old code created it).
MISSING = f"/nonexistent-kvgroups-{uuid.uuid4().hex[:12]}/dir/x.jsonl"


@pytest.fixture(scope="module")
def fakes(tmp_path_factory) -> dict[str, Path]:
    """Directories to put first on PYTHONPATH: ``tripwire`` (importing torch or jax kills the
    process with status 99), ``no-torch`` and ``no-pytest`` (their import fails)."""
    base = tmp_path_factory.mktemp("fakes")
    out = {}
    for name, packages, body in (
        ("tripwire", ("torch", "jax"), "import os\nos._exit(99)\n"),
        ("no-torch", ("torch",), "raise ImportError('torch is not installed here')\n"),
        ("no-pytest", ("pytest",), "raise ImportError('pytest is not installed here')\n"),
    ):
        for package in packages:
            (base / name / package).mkdir(parents=True)
            (base / name / package / "__init__.py").write_text(body)
        out[name] = base / name
    return out


def _run(
    argv: list[str],
    fakes: dict,
    fake: str | None,
    tmp_path: Path,
    stdin_close_after: int | None = None,
) -> subprocess.CompletedProcess:
    paths = ([str(fakes[fake])] if fake else []) + [str(ROOT), str(ROOT / "backends")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)


# (id, argv, tripwire/fake, exit status, a regex the one stderr line must match)
CASES = [
    # kvgroups (top level)
    ("version", KVG + ["--version"], "tripwire", 0, None),
    ("no-command", KVG, "tripwire", 2, r"^kvgroups: error: .*COMMAND"),
    ("unknown-command", KVG + ["bogus"], "tripwire", 2, r"^kvgroups: error: argument COMMAND"),
    # plan
    ("plan-no-spec", KVG + ["plan"], "tripwire", 2, r"--spec"),
    (
        "plan-huge-layer-count",
        KVG + ["plan", "--spec", "(2,4,16,8,128):bf16:1000000000000"],
        "tripwire",
        2,
        r"argument --spec: Layer count too large",
    ),
    (
        "plan-5000-digit-size",
        KVG + ["plan", "--spec", "(2," + "9" * 5000 + ",16,8,128):bf16:2"],
        "tripwire",
        2,
        r"argument --spec: Invalid number",
    ),
    (
        "plan-chunk-1e21",
        KVG + ["plan", "--spec", SPEC, "--chunk", "1" + "0" * 21],
        "tripwire",
        2,
        r"argument --chunk: expected an integer in",
    ),
    (
        "plan-chunk-0",
        KVG + ["plan", "--spec", SPEC, "--chunk", "0"],
        "tripwire",
        2,
        r"argument --chunk: ",
    ),
    (
        "plan-chunk-not-multiple",
        KVG + ["plan", "--spec", SPEC, "--chunk", "100"],
        "tripwire",
        2,
        r"error: --chunk: .*100 must be a multiple",
    ),
    (
        "plan-tpb-not-multiple",
        KVG + ["plan", "--spec", SPEC, "--tpb", "3"],
        "tripwire",
        2,
        r"error: --tpb: ",
    ),
    (
        "plan-sw-not-multiple",
        KVG + ["plan", "--spec", SPEC, "--sw", "8"],
        "tripwire",
        2,
        r"error: --sw: .*sliding window",
    ),
    (
        "plan-sw-count",
        KVG + ["plan", "--spec", "(2,8,16,8,128):float16:1", "--sw", "1,2"],
        "tripwire",
        2,
        r"error: --sw: expected one value, got 2",
    ),
    (
        "plan-sw-not-ints",
        KVG + ["plan", "--spec", SPEC, "--sw", "a,b"],
        "tripwire",
        2,
        r"argument --sw: expected comma-separated integers",
    ),
    (
        "plan-bf16-fp8-and-spaces",
        KVG + ["plan", "--spec", "( 2, 8, 16, 8, 128 ) : BF16 : 2 ; (1,8,16,1,64) : fp8 : 1"],
        "tripwire",
        0,
        None,
    ),
    (
        "plan-unknown-dtype",
        KVG + ["plan", "--spec", "(2,8,16,8,128):float64:1"],
        "tripwire",
        2,
        r"argument --spec: Unrecognized dtype",
    ),
    # demo
    (
        "demo-chunks-0",
        KVG + ["demo", *NUMPY, "--chunks", "0"],
        "tripwire",
        2,
        r"argument --chunks: ",
    ),
    (
        "demo-huge-chunks",
        KVG + ["demo", *NUMPY, "--chunks", "1000000000"],
        "tripwire",
        2,
        r"argument --chunks: ",
    ),
    (
        "demo-huge-blocks",
        KVG + ["demo", "--num-blocks", "10000000000"],
        "tripwire",
        2,
        r"error: --chunks, --num-blocks, --layers: expected a demo that fits in memory, got one "
        r"that needs about [\d.,]+ PiB",
    ),
    (
        "demo-many-chunks",
        KVG + ["demo", "--model", "llama3-8b", "--chunks", "100000"],
        "tripwire",
        2,
        r"fits in memory, got one that needs about [\d.,]+ TiB",
    ),
    (
        "demo-readme-spec",
        KVG + ["demo", "--spec", README_SPEC, "--max-memory", "16"],
        "tripwire",
        2,
        r"error: --chunks, --spec: .*needs about [\d.,]+ GiB .*16.0 GiB allowed",
    ),
    (
        "demo-spec-and-model",
        KVG + ["demo", "--spec", "(2,64,16,2,64):bf16:2", "--model", "llama3-8b"],
        "tripwire",
        2,
        r"error: --model: expected --model or --spec, got both",
    ),
    (
        "demo-spec-and-layers",
        KVG + ["demo", "--spec", "(2,64,16,2,64):bf16:2", "--layers", "3"],
        "tripwire",
        2,
        r"error: --spec: expected --layers and --num-blocks to be left out",
    ),
    ("demo-layers-0", KVG + ["demo", "--layers", "0"], "tripwire", 2, r"argument --layers: "),
    (
        "demo-batch-0",
        KVG + ["demo", "--batch-chunks", "0"],
        "tripwire",
        2,
        r"argument --batch-chunks: ",
    ),
    ("demo-seed-negative", KVG + ["demo", "--seed", "-1"], "tripwire", 2, r"argument --seed: "),
    (
        "demo-unknown-model",
        KVG + ["demo", "--model", "gpt-7"],
        "tripwire",
        2,
        r"argument --model: invalid choice",
    ),
    (
        "demo-unknown-backend",
        KVG + ["demo", "--store-backend", "bogus"],
        "tripwire",
        2,
        r"error: --store-backend: expected one of",
    ),
    (
        "demo-without-torch",
        KVG + ["demo", "--store-backend", "torch", "--load-backend", "numpy"],
        "no-torch",
        2,
        r"error: --store-backend: backend 'torch': expected kvgroups_torch .*"
        r"installed",
    ),
    (
        "demo-bad-device",
        KVG + ["demo", *NUMPY, "--layers", "2", "--device", "cuda:7"],
        None,
        2,
        r"error: --device: ",
    ),
    ("demo-corrupted-byte", KVG + ["demo", *NUMPY, "--layers", "2", "--corrupt"], None, 1, None),
    # bench
    (
        "bench-paths-bogus",
        KVG + ["bench", "--paths", "bogus"],
        "tripwire",
        2,
        r"argument --paths: expected paths from .*got 'bogus'",
    ),
    (
        "bench-gpu-path-without-gpu",
        KVG + ["bench", "--backends", "numpy,torch-cpu", "--paths", "cuda"],
        "tripwire",
        2,
        r"error: --paths: expected ",
    ),
    (
        "bench-pinned-on-cpu",
        KVG + ["bench", "--backends", "numpy,torch-cpu", "--placements", "pinned"],
        "tripwire",
        2,
        r"error: --placements: ",
    ),
    (
        "bench-pinned-numpy",
        KVG + ["bench", "--backends", "numpy", "--placements", "pinned"],
        "tripwire",
        2,
        r"error: --placements: expected 'device' for host runtimes",
    ),
    (
        "bench-placements-bogus",
        KVG + ["bench", "--placements", "disk"],
        "tripwire",
        2,
        r"argument --placements: ",
    ),
    (
        "bench-directions-sideways",
        KVG + ["bench", "--directions", "sideways"],
        "tripwire",
        2,
        r"argument --directions: expected directions from \['store', 'load'\]",
    ),
    ("bench-repeats-0", KVG + ["bench", "--repeats", "0"], "tripwire", 2, r"argument --repeats"),
    (
        "bench-warmup-negative",
        KVG + ["bench", "--warmup", "-1"],
        "tripwire",
        2,
        r"argument --warmup",
    ),
    (
        "bench-max-calls-0",
        KVG + ["bench", "--max-calls", "0"],
        "tripwire",
        2,
        r"argument --max-calls",
    ),
    (
        "bench-target-negative",
        KVG + ["bench", "--target-ms", "-1"],
        "tripwire",
        2,
        r"argument --target-ms",
    ),
    (
        "bench-budget-negative",
        KVG + ["bench", "--budget-s", "-1"],
        "tripwire",
        2,
        r"argument --budget-s",
    ),
    (
        "bench-budget-nan",
        KVG + ["bench", "--budget-s", "nan"],
        "tripwire",
        2,
        r"argument --budget-s",
    ),
    (
        "bench-markdown-alone",
        KVG + ["bench", "--markdown"],
        "tripwire",
        2,
        r"error: --markdown: expected it with --summarize",
    ),
    (
        "bench-out-missing-directory",
        KVG + ["bench", "--out", MISSING],
        "tripwire",
        2,
        r"argument --out: expected a file in an existing directory",
    ),
    ("bench-chunks-0", KVG + ["bench", "--chunks", "0"], "tripwire", 2, r"argument --chunks"),
    (
        "bench-huge-chunks",
        KVG + ["bench", "--backends", "numpy", "--chunks", "1000000"],
        "tripwire",
        2,
        r"error: --chunks, --models, --spec, --layers: expected sizes that fit in "
        r"memory, got a run that needs about [\d.,]+ TiB",
    ),
    (
        "bench-layers-0",
        KVG + ["bench", "--models", "llama3-8b", "--layers", "0"],
        "tripwire",
        2,
        r"argument --layers",
    ),
    (
        "bench-chunk-tokens-0",
        KVG + ["bench", "--chunk-tokens", "0"],
        "tripwire",
        2,
        r"argument --chunk-tokens",
    ),
    (
        "bench-models-bogus",
        KVG + ["bench", "--models", "gpt-7"],
        "tripwire",
        2,
        r"argument --models: expected models from",
    ),
    (
        "bench-spec-bad",
        KVG + ["bench", "--spec", "(2,8,16):bf16:1"],
        "tripwire",
        2,
        r"argument --spec: Shape must be a 5-tuple",
    ),
    (
        "bench-sweeps-bogus",
        KVG + ["bench", "--sweeps", "bogus"],
        "tripwire",
        2,
        r"argument --sweeps",
    ),
    (
        "bench-sweeps-empty",
        KVG + ["bench", "--matrix", "tiny", "--sweeps", "models"],
        "tripwire",
        2,
        r"error: --sweeps: expected sweeps with points",
    ),
    ("bench-seed-negative", KVG + ["bench", "--seed", "-3"], "tripwire", 2, r"argument --seed"),
    (
        "bench-backends-typo",
        KVG + ["bench", "--backends", "torchh"],
        "tripwire",
        2,
        r"argument --backends: ",
    ),
    (
        "bench-nothing-measured",
        KVG
        + [
            "bench",
            "--matrix",
            "tiny",
            "--sweeps",
            "headline",
            "--backends",
            "numpy",
            "--budget-s",
            "0.000001",
        ],
        None,
        1,
        r"^kvgroups bench: error: nothing was measured \(skipped: time budget\)",
    ),
    # python -m kvgroups_conformance
    ("kit-version", KIT + ["--version"], "tripwire", 0, None),
    ("kit-no-backend", KIT, "tripwire", 2, r"error: --backend: expected at least one"),
    (
        "kit-unknown-backend",
        KIT + ["--backend", "bogus"],
        "tripwire",
        2,
        r"error: --backend: expected one of .*'bogus'",
    ),
    (
        "kit-without-pytest",
        KIT + ["--backend", "numpy"],
        "no-pytest",
        2,
        r"error: expected pytest to run the suite",
    ),
    (
        "kit-without-torch",
        KIT + ["--backend", "torch"],
        "no-torch",
        2,
        r"error: --backend: expected a backend that loads here, got 'torch'",
    ),
    (
        "kit-report-missing-directory",
        KIT + ["--backend", "numpy", "--report", MISSING],
        "tripwire",
        2,
        r"error: --report: expected a file in an existing directory",
    ),
    (
        "kit-harness-format",
        KIT + ["--backend", "numpy", "--harness", "nocolon"],
        "tripwire",
        2,
        r"error: --harness: expected MODULE:ATTR",
    ),
    # the library
    (
        "get-backend-without-torch",
        [
            sys.executable,
            "-c",
            "import kvgroups_core as kc\ntry:\n kc.get_backend('torch')\n"
            "except kc.BackendNotFoundError as e:\n"
            " import sys; print(e, file=sys.stderr); sys.exit(2)",
        ],
        "no-torch",
        2,
        r"^backend 'torch': expected kvgroups_torch",
    ),
]


@pytest.fixture(scope="module")
def results(fakes, tmp_path_factory) -> dict:
    """Every case run once, a few at a time (they are short processes; CI has two cores):
    ``{id: (result, the directory it ran in)}``."""

    def one(case):
        cwd = tmp_path_factory.mktemp(case[0])
        return case[0], (_run(case[1], fakes, case[2], cwd), cwd)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(one, CASES))


@pytest.mark.parametrize(
    "name, status, pattern", [(c[0], c[3], c[4]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_each_finding(name, status, pattern, results):
    result, cwd = results[name]
    err = result.stderr
    assert result.returncode != 99, f"a framework was imported before the refusal:\n{err}"
    assert "Traceback" not in err, err
    assert result.returncode == status, (result.returncode, err[-2000:], result.stdout[-500:])
    if pattern is not None:
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1, lines
        assert re.search(pattern, lines[0]), lines[0]
    if status == 2:
        assert result.stdout == "", result.stdout[-500:]  # refused before anything ran
    assert not Path(MISSING).parents[1].exists()  # nothing created outside the paths given
    assert list(cwd.iterdir()) == []


def test_pinned_objects_on_a_machine_without_a_gpu_end_the_run_with_status_1(fakes, tmp_path):
    """A runtime that might run on a GPU (``jax``, not ``jax-cpu``) is only known to have none
    once loaded: the run then measures nothing, says so in one line and exits 1 (it used to
    exit 0). The host-only runtimes are refused while parsing (the cases above)."""
    if Path("/dev/nvidia0").exists():
        pytest.skip("a GPU is present: pinned objects are measured there")
    result = _run(
        KVG
        + [
            "bench",
            "--backends",
            "jax",
            "--matrix",
            "tiny",
            "--sweeps",
            "headline",
            "--placements",
            "pinned",
            "--quiet",
        ],
        fakes,
        None,
        tmp_path,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [
        "kvgroups bench: error: nothing was measured (skipped: no point of the "
        "'tiny' matrix applies to jax here with --placements pinned)"
    ], lines


def test_version_names_the_package(fakes, tmp_path):
    import kvgroups_core

    result = _run(KVG + ["--version"], fakes, "tripwire", tmp_path)
    assert result.stdout.strip() == f"kvgroups {kvgroups_core.__version__}"


def test_list_backends_marks_what_cannot_load(fakes, tmp_path):
    result = _run(KIT + ["--list-backends"], fakes, "no-torch", tmp_path)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    lines = dict(
        line.split(None, 1) if " " in line else (line, "") for line in result.stdout.splitlines()
    )
    assert lines["numpy"] == "" and "not loadable" in lines["torch"], result.stdout


def test_a_reader_that_goes_away_ends_the_output_quietly(fakes, tmp_path):
    """``kvgroups plan --json | head``: more JSON than a pipe holds, the reader closes it."""
    spec = ";".join(f"(2,8,16,{h},64):float16:1" for h in range(1, 400))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "backends")])}
    proc = subprocess.Popen(
        KVG + ["plan", "--json", "--spec", spec],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=tmp_path,
    )
    assert proc.stdout.read(10)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=300)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert proc.returncode == 0, (proc.returncode, err)
