"""The module map of docs/DESIGN.md ("Packages"), made from the tree.

One line per package and module of the library: its path and its role, the first sentence of
its docstring. ``python -m tests.support.module_map`` prints the map, ``--write`` puts it into
docs/DESIGN.md between the markers; tests/docs/test_design_map.py fails when they differ.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "DESIGN.md"
# The library's packages, in the order the map lists them.
PACKAGES = [
    "kvgroups_core",
    "kvgroups_tools",
    "kvgroups_conformance",
    "backends/kvgroups_cuda",
    "backends/kvgroups_torch",
    "backends/kvgroups_jax",
]
BEGIN = (
    "<!-- module-map: made by `python -m tests.support.module_map --write` from the "
    "modules' docstrings; tests/docs/test_design_map.py keeps it current -->"
)
END = "<!-- /module-map -->"

_ROLE = re.compile(r":[a-z]+:`~?([^`]*)`( s\b)?")


def role(path: Path) -> str:
    """The first sentence of the module docstring's first paragraph, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    text = _ROLE.sub(
        lambda m: (
            (m.group(1).rpartition(".")[2] if "~" in m.group(0) else m.group(1))
            + ("s" if m.group(2) else "")
        ),
        text,
    )
    text = text.replace("``", "`")
    end = re.search(r"\.(\s|$)", text)
    return text[: end.start() + 1] if end else text


def _entries(package: Path, depth: int) -> list[tuple[str, str]]:
    """(indented name, role) for ``package`` and everything below it."""
    out = []
    for path in sorted(p for p in package.iterdir() if p.suffix == ".py" and p.stem != "__init__"):
        out.append(("  " * depth + path.name, role(path)))
    for sub in sorted(p for p in package.iterdir() if (p / "__init__.py").exists()):
        out.append(("  " * depth + sub.name + "/", role(sub / "__init__.py")))
        out.extend(_entries(sub, depth + 1))
    return out


def module_map(root: Path = ROOT) -> str:
    """The map as the lines of a text block."""
    rows: list[tuple[str, str]] = []
    backends_listed = False
    for name in PACKAGES:
        package = root / name
        depth = name.count("/")
        if depth and not backends_listed:
            rows.append(("backends/", ""))
            backends_listed = True
        rows.append(("  " * depth + package.name + "/", role(package / "__init__.py")))
        rows.extend(_entries(package, depth + 1))
    width = max(len(n) for n, _ in rows) + 2
    return "\n".join(f"{n:<{width}}{r}".rstrip() for n, r in rows) + "\n"


def design_block(text: str) -> str:
    """What docs/DESIGN.md holds between the markers (without the code fence)."""
    start = text.index(BEGIN) + len(BEGIN)
    block = text[start : text.index(END)]
    return block.strip("\n").removeprefix("```text\n").removesuffix("```").rstrip("\n") + "\n"


def write(path: Path = DESIGN) -> None:
    text = path.read_text()
    start = text.index(BEGIN) + len(BEGIN)
    new = text[:start] + "\n```text\n" + module_map() + "```\n" + text[text.index(END) :]
    path.write_text(new)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update docs/DESIGN.md in place")
    args = parser.parse_args()
    if args.write:
        write()
    else:
        print(module_map(), end="")


if __name__ == "__main__":
    main()
