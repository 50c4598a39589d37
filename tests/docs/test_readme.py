"""Every code block of the README runs as written, on the CPU.

``python`` blocks run whole, each in its own interpreter. ``bash`` blocks run line by line:
each ``kvgroups`` command that a CPU finishes in seconds runs; every other line must be listed
in ``NOT_RUN`` with the reason, so a command added to the README is either tested here or
explicitly set aside.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()

#: Lines of bash blocks that do not run here, by their first words, and why.
NOT_RUN = {
    "pip install": "installs into the environment: .ci/run runs the README's two install lines",
    "python -m pytest": "the test suite itself (.ci/run)",
}
#: The README's sections, in order: what a user looks for, and where.
SECTIONS = [
    "Install",
    "Quick start",
    "Inside an engine",
    "Performance",
    "Support",
    "Documentation",
    "License",
]


def code_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block."""
    return [
        (m.group(1), m.group(2))
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)
    ]


def bash_commands(body: str) -> list[str]:
    """The commands of a bash block: comments dropped, ``a && b`` split, ``\\`` joined."""
    commands = []
    for line in body.replace("\\\n", " ").splitlines():
        part: list[str] = []
        for word in shlex.split(line, comments=True) + ["&&"]:
            if word != "&&":
                part.append(word)
            elif part:
                commands.append(shlex.join(part))
                part = []
    return commands


def _set_aside(command: str) -> bool:
    return any(command.startswith(prefix) for prefix in NOT_RUN)


def _env() -> dict:
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [str(ROOT), str(ROOT / "backends"), os.environ.get("PYTHONPATH", "")]
        ),
        JAX_PLATFORMS="cpu",
        CUDA_VISIBLE_DEVICES="",
    )


def _as_run_here(command: str) -> str:
    """``kvgroups ...`` through the module when the console script is not installed."""
    if command.startswith("kvgroups ") and shutil.which("kvgroups") is None:
        return f"{shlex.quote(sys.executable)} -m kvgroups_tools.cli" + command[len("kvgroups") :]
    if command.startswith("python "):
        return shlex.quote(sys.executable) + command[len("python") :]
    return command


PYTHON_BLOCKS = [body for lang, body in code_blocks(README) if lang == "python"]
BASH_COMMANDS = [
    c for lang, body in code_blocks(README) if lang == "bash" for c in bash_commands(body)
]
RUN_HERE = [c for c in BASH_COMMANDS if not _set_aside(c)]


def test_the_readme_has_the_blocks_this_file_tests():
    assert PYTHON_BLOCKS
    for needed in ("kvgroups demo", "kvgroups plan --spec"):
        assert any(c.startswith(needed) for c in RUN_HERE), needed
    # Every set-aside entry still names a README line (no stale exemptions).
    for prefix in NOT_RUN:
        assert any(c.startswith(prefix) for c in BASH_COMMANDS), prefix


def test_the_readme_is_short_and_has_a_users_sections_in_order():
    lines = README.splitlines()
    assert len(lines) <= 160, len(lines)
    headings = [line[3:] for line in lines if line.startswith("## ")]
    assert headings == SECTIONS


def test_the_ci_commands_come_first_and_pin_no_torch_build():
    # .ci/run reads the line after each marker's fence; it installs the CPU torch itself.
    blocks = code_blocks(README)
    for marker, block in (("demo-command", 0), ("test-command", 1)):
        assert f"<!-- {marker} -->\n```bash\n" in README
        lang, body = blocks[block]
        assert lang == "bash" and README.index(body) > README.index(f"<!-- {marker} -->")
        assert "torch==" not in body
    assert "download.pytorch.org/whl/cpu" in README  # how a CPU user gets a CPU torch


@pytest.mark.parametrize("body", PYTHON_BLOCKS, ids=lambda b: b.splitlines()[0][:40])
def test_python_block_runs_as_written(body):
    result = subprocess.run(
        [sys.executable, "-c", body],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("command", RUN_HERE)
def test_bash_command_runs_as_written(command):
    result = subprocess.run(
        ["bash", "-c", f"set -euo pipefail; {_as_run_here(command)}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=600,
    )
    assert result.returncode == 0, (command, result.stdout[-2000:], result.stderr[-3000:])
    assert result.stdout.strip(), command
    if command.startswith("kvgroups demo"):
        assert "verified:" in result.stdout
