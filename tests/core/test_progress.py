"""Progress where someone watches, silence elsewhere; the library logs, never prints."""

import ast
import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvgroups_tools.progress import Progress, show_library_logs, wanted

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = [ROOT / "kvgroups_core", *sorted((ROOT / "backends").glob("kvgroups_*"))]


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_lines_on_a_terminal_count_the_steps(monkeypatch):
    monkeypatch.delenv("KVGROUPS_PROGRESS", raising=False)
    out = Terminal()
    with Progress("run", total=12, stream=out) as progress:
        progress.step("first")
        progress.step("second")
    lines = out.getvalue().splitlines()
    assert lines[0] == "run: started, 12 steps"
    assert lines[1].startswith("[ 1/12 ") and lines[1].endswith("] first")
    assert lines[2].startswith("[ 2/12 ") and lines[2].endswith("] second")
    assert lines[3].startswith("run: 2 steps in ")


@pytest.mark.parametrize(
    "stream,quiet,env,shown",
    [
        (Terminal(), True, None, False),  # --quiet wins
        (io.StringIO(), False, None, False),  # not a terminal (CI, a pipe)
        (io.StringIO(), False, "1", True),  # asked for, e.g. a log file of a long run
        (Terminal(), False, "0", False),  # turned off
    ],
)
def test_progress_is_quiet_unless_watched(monkeypatch, stream, quiet, env, shown):
    if env is None:
        monkeypatch.delenv("KVGROUPS_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("KVGROUPS_PROGRESS", env)
    assert wanted(stream, quiet) is shown
    Progress("run", stream=stream, quiet=quiet).step("x")
    assert bool(stream.getvalue()) is shown


def test_library_log_lines_are_shown_only_where_progress_is(monkeypatch):
    monkeypatch.setenv("KVGROUPS_PROGRESS", "1")
    logger = logging.getLogger("kvgroups")
    before = list(logger.handlers), logger.level
    out = io.StringIO()
    try:
        show_library_logs(stream=out)
        show_library_logs(stream=out)  # idempotent: one handler
        logging.getLogger("kvgroups.cuda").info("compiling x")
        assert out.getvalue() == "kvgroups.cuda: compiling x\n"
    finally:
        logger.handlers[:], logger.level = before[0], before[1]


def test_kvgroups_bench_prints_progress_only_when_asked(tmp_path):
    args = [
        sys.executable,
        "-m",
        "kvgroups_tools.cli",
        "bench",
        "--matrix",
        "tiny",
        "--backends",
        "numpy",
        "--sweeps",
        "headline",
        "--directions",
        "store",
        "--repeats",
        "1",
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "backends")]))
    env.pop("KVGROUPS_PROGRESS", None)
    silent = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert silent.returncode == 0, silent.stderr
    assert "kvgroups bench: started" not in silent.stderr  # stderr is a pipe here
    shown = subprocess.run(
        args, capture_output=True, text=True, timeout=300, env=dict(env, KVGROUPS_PROGRESS="1")
    )
    assert shown.returncode == 0, shown.stderr
    assert "kvgroups bench: started" in shown.stderr and "[1 " in shown.stderr
    quiet = subprocess.run(
        args + ["--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(env, KVGROUPS_PROGRESS="1"),
    )
    assert "kvgroups bench: started" not in quiet.stderr


def test_the_library_never_prints_and_logs_under_kvgroups():
    found = []
    for package in LIBRARY:
        for path in package.rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                name = ast.unparse(node.func)
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                if name == "print" or name in ("sys.stdout.write", "sys.stderr.write"):
                    found.append(f"{where}: {name}")
                if path.name == "logs.py" and path.parent.name == "kvgroups_core":
                    continue  # builds the kvgroups.<name> loggers for every other module
                if name in ("logging.getLogger", "getLogger") and node.args:
                    arg = node.args[0]
                    if not (
                        isinstance(arg, ast.Constant) and str(arg.value).split(".")[0] == "kvgroups"
                    ):
                        found.append(f"{where}: logger {ast.unparse(arg)}")
    assert found == []
