"""The library's modules import each other without a circle, and never import the tooling.

The graph is read from the source (``ast``), so an import deferred into a function body counts
the same as one at the top: a deferred import hides a circle, it does not remove it. Imports
under ``if TYPE_CHECKING:`` never run and are left out.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLING = "kvgroups_tools"


def _module_name(package_dir: Path, path: Path) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST):
    """Every Import / ImportFrom node that can run (skips ``if TYPE_CHECKING:`` bodies)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """``{module: modules of the same package it imports}`` for every module under
    ``package_dir``; names outside the package are kept only when they are the tooling."""
    root = package_dir.name
    files = {_module_name(package_dir, p): p for p in sorted(package_dir.rglob("*.py"))}
    packages = {name for name, p in files.items() if p.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges = graph.setdefault(name, set())
        here = name if name in packages else name.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # ``from pkg import sub`` imports the submodule when there is one.
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                           for alias in node.names]
            for target in targets:
                top = target.split(".")[0]
                if top == TOOLING:
                    edges.add(target)
                elif top == root:
                    # ``import a.b.c`` where only ``a.b`` is a module of ours: keep ``a.b``.
                    while target not in files and "." in target:
                        target = target.rpartition(".")[0]
                    if target in files and target != name:
                        edges.add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def _write(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        target = tmp_path / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return tmp_path / "pkg"


def test_the_core_has_no_import_cycle():
    cycle = find_cycle(import_graph(ROOT / "kvgroups_core"))
    assert cycle is None, "import circle in kvgroups_core: " + " -> ".join(cycle)


def test_the_core_never_imports_the_tooling():
    graph = import_graph(ROOT / "kvgroups_core")
    leaks = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                   if t.split(".")[0] == TOOLING)
    assert leaks == []


def test_the_core_graph_is_read_at_all():
    # Guards the two tests above against a walker that silently finds nothing.
    graph = import_graph(ROOT / "kvgroups_core")
    assert {"kvgroups_core.grouping.manager", "kvgroups_core.transfer.api"} <= set(graph)
    assert "kvgroups_core.errors" in graph["kvgroups_core.grouping.manager"]
    assert "kvgroups_core.transfer.api" in graph["kvgroups_core"]


def test_the_walker_finds_a_circle_hidden_in_a_function(tmp_path):
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from .b import thing\n",
        "pkg/b.py": "thing = 1\ndef late():\n    from .c import other\n",
        "pkg/c.py": "from pkg import a\nother = 2\n",
    })
    assert find_cycle(import_graph(pkg)) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]


def test_the_walker_resolves_subpackages_and_skips_type_checking(tmp_path):
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "from .sub import x\n",
        "pkg/sub/__init__.py": "from .leaf import x\n",
        "pkg/sub/leaf.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                            "    from .. import sub\nfrom ..util import helper\nx = 1\n"),
        "pkg/util.py": "import pkg.sub.leaf.x\nhelper = 1\n",
    })
    graph = import_graph(pkg)
    assert graph["pkg.sub.leaf"] == {"pkg.util"}
    assert graph["pkg.util"] == {"pkg.sub.leaf"}
    assert find_cycle(graph) == ["pkg.sub.leaf", "pkg.util", "pkg.sub.leaf"]


def test_the_walker_sees_a_tooling_import(tmp_path):
    pkg = _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "def f():\n"
                            "    from kvgroups_tools.cli import main\n"})
    assert import_graph(pkg)["pkg.a"] == {"kvgroups_tools.cli"}
