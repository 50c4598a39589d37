import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = Path(__file__).parent / "third_party_backend"
# The one off-by-one the broken copy carries: every block address is one block too far.
GOOD_LINE = "block_base = plane.byte_offset + block * t.block_stride_bytes"
BROKEN_LINE = "block_base = plane.byte_offset + (block + 1) * t.block_stride_bytes"


# What a wheel of kvgroups is built from (the kit must work from an installed kvgroups).
PROJECT_FILES = (
    "pyproject.toml",
    "README.md",
    "kvgroups_core",
    "kvgroups_tools",
    "kvgroups_conformance",
    "backends",
)


def _env(*sites: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(map(str, sites))  # installed packages, not the checkout
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_INPUT"] = "1"
    return env


def _pip_install(target: Path, *sources: Path) -> None:
    # Offline: no index, no build isolation, no dependencies (numpy, pytest, ml_dtypes come
    # from the running environment).
    # Without build isolation the running environment builds the wheels: setuptools >= 70.1
    # does that on its own (older ones need the `wheel` package); the test extra pins it.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--no-build-isolation",
            "--no-deps",
            "--target",
            str(target),
            *map(str, sources),
        ],
        env=_env(target),
        cwd=target.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"


@pytest.fixture(scope="module")
def kvgroups_site(tmp_path_factory):
    """kvgroups itself, built from a copy of the checkout and installed in a target dir."""
    tmp = tmp_path_factory.mktemp("kvgroups")
    project = tmp / "kvgroups-src"
    project.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in PROJECT_FILES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, project / name, ignore=ignore)
        else:
            shutil.copy2(source, project / name)
    site = tmp / "site"
    _pip_install(site, project)
    assert (site / "kvgroups_conformance" / "suite" / "test_roundtrip.py").exists()
    return site


def _install_backend(tmp: Path, broken: bool) -> Path:
    """Build the example backend outside the tree and pip-install it into its own target."""
    src = tmp / "boxnp-src"
    shutil.copytree(TEMPLATE, src)
    module = src / "boxnp_kvgroups" / "__init__.py"
    text = module.read_text()
    assert text.count(GOOD_LINE) == 1
    if broken:
        module.write_text(text.replace(GOOD_LINE, BROKEN_LINE))
    site = tmp / "backend-site"
    _pip_install(site, src)
    assert (site / "boxnp_kvgroups" / "__init__.py").exists()
    return site


def _run_kit(tmp: Path, sites: tuple, *pytest_args: str):
    report = tmp / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgroups_conformance",
            "--backend",
            "boxnp",
            "--report",
            str(report),
            "--",
            "-q",
            *pytest_args,
        ],
        env=_env(*sites),
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc, json.loads(report.read_text())


@pytest.fixture(scope="module")
def good_site(tmp_path_factory, kvgroups_site):
    tmp = tmp_path_factory.mktemp("boxnp_good")
    return tmp, (_install_backend(tmp, broken=False), kvgroups_site)


def test_the_installed_backend_is_found_through_its_entry_points(good_site):
    tmp, sites = good_site
    probe = (
        "import boxnp_kvgroups, kvgroups_core as kc, kvgroups_conformance as k; "
        "be = kc.get_backend('boxnp'); h = k.harness_for('boxnp'); "
        "print(type(be).__module__, type(h).__name__, boxnp_kvgroups.__file__, "
        "k.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env=_env(*sites),
        cwd=tmp,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out[0] == "boxnp_kvgroups" and out[1] == "BoxHarness"
    for path, site in zip(out[2:], sites):  # the installed copies, not the checkout's
        assert Path(path).resolve().is_relative_to(site.resolve()), path


def test_a_third_party_backend_passes_the_kit(good_site):
    tmp, sites = good_site
    proc, report = _run_kit(tmp, sites)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert report["conformant"] and report["backends"] == ["boxnp"]
    assert report["failed"] == 0 and report["skipped"] == 0 and report["passed"] >= 150
    cases = [row["case"] for row in report["cases"]]
    for part in (
        "test_roundtrip.py",
        "test_skips.py",
        "test_bad_input.py",
        "test_models.py",
        "test_cross_backend.py",
        "test_object_placement.py",
    ):
        assert any(part in c for c in cases), part
    assert any("numpy-ref->boxnp" in c for c in cases)
    assert any("boxnp->numpy-ref" in c for c in cases)
    assert "CONFORMANT: boxnp (backend 'boxnp') passed all" in proc.stdout


def test_an_off_by_one_in_block_addressing_fails_with_an_actionable_report(tmp_path, kvgroups_site):
    sites = (_install_backend(tmp_path, broken=True), kvgroups_site)
    proc, report = _run_kit(tmp_path, sites, "-k", "canonical or round_trip_moves")
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert not report["conformant"] and report["failed"] > 0
    assert "NOT CONFORMANT: boxnp" in proc.stdout
    failed = [row for row in report["cases"] if row["outcome"] == "failed"]
    mismatches = [m for row in failed for m in row.get("mismatches", ())]
    assert mismatches, failed[:3]
    for m in mismatches:  # every report names the place of the first wrong byte
        assert m["format"] and m["dtype"] and m["layer"] >= 0 and m["plane"] in (0, 1)
        assert m["block"] is not None and m["byte"] >= 0 and m["expected"] != m["actual"]
    # Canonical object bytes: each chunk holds the block after the one it should hold.
    canonical = [
        m for row in failed if "canonical" in row["case"] for m in row.get("mismatches", ())
    ]
    assert canonical
    for m in canonical:
        found = re.search(r"source block (\d+)\b.* instead of block (\d+)", m["hint"])
        assert found and int(found[1]) == int(found[2]) + 1 == m["block"] + 1, m["hint"]
    # Every canonical case of every format failed, and the terminal report says where.
    formats = {row["params"]["fmt"] for row in failed if "canonical" in row["case"]}
    assert len(formats) == sum("canonical" in row["case"] for row in report["cases"])
    assert re.search(
        r"store: object bytes: first difference at format \w+, dtype bfloat16, "
        r"layer \d+, plane \d \(\w[^)]*\), block \d+, byte \d+",
        proc.stdout,
    )


def test_the_tpu_kernels_pass_the_kit_in_tpu_interpret_mode(kvgroups_site, tmp_path):
    # The Pallas TPU kernels (kvgroups_jax, lowering "tpu") in TPU interpret mode on the CPU,
    # found through kvgroups' own entry point as installed: the command CI certifies them
    # with. The backend declares the small case set (each case compiles interpreted programs).
    pytest.importorskip("jax")
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgroups_conformance",
            "--backend",
            "jax-tpu-interpret",
            "--report",
            str(report),
            "--",
            "-q",
        ],
        env=_env(kvgroups_site),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    result = json.loads(report.read_text())
    assert result["conformant"] and result["backends"] == ["jax-tpu-interpret"]
    assert result["cases_run"] == "small" and result["skipped"] == 0
    assert "CONFORMANT (small case set): jax-tpu-interpret" in proc.stdout
    formats = {row["params"].get("fmt") for row in result["cases"]} - {None}
    dtypes = {row["params"].get("dtype") for row in result["cases"]}
    assert len(formats) == 15  # every transfer format and every dtype ran at least once
    assert {"float16", "bfloat16", "float32", "float8_e4m3fn"} <= dtypes
