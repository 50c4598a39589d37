"""The library's packages import each other without a circle, the core reads as a ladder, and
neither the core nor a backend imports the tooling.

The graph is read from the source (``ast``) over every library package at once (the core, the
tooling, the conformance kit and the three backends), so a circle between two packages shows
as well as one inside a package. An import deferred into a function body counts the same as
one at the top, and so does one under ``if TYPE_CHECKING:``: a deferred import hides a circle,
it does not remove it, and a reader meets it all the same.

The core's ladder: each rung imports only rungs below it (or its own).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLING = "kvgroups_tools"
PACKAGE_DIRS = [
    ROOT / "kvgroups_core",
    ROOT / "kvgroups_tools",
    ROOT / "kvgroups_conformance",
    ROOT / "backends" / "kvgroups_torch",
    ROOT / "backends" / "kvgroups_jax",
    ROOT / "backends" / "kvgroups_cuda",
]
# Lowest rung first. The public calls (transfer.api) compose the semantic transfer layer with
# its fast path (memo, reuse), so they are the top rung; nothing below imports them.
CORE_LADDER = [
    "kvgroups_core.errors",
    "kvgroups_core.logs",
    "kvgroups_core.tensors",
    "kvgroups_core.formats",
    "kvgroups_core.grouping",
    "kvgroups_core.transfer",
    "kvgroups_core.transfer.fast",
    "kvgroups_core.transfer.api",
]


def _module_name(package_dir: Path, path: Path) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, wherever it sits (functions, TYPE_CHECKING blocks)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def import_graph(package_dirs: list[Path]) -> dict[str, set[str]]:
    """``{module: library modules it imports}`` for every module under ``package_dirs``."""
    files: dict[str, Path] = {}
    for package_dir in package_dirs:
        files.update({_module_name(package_dir, p): p for p in sorted(package_dir.rglob("*.py"))})
    packages = {name for name, p in files.items() if p.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges = graph.setdefault(name, set())
        here = name if name in packages else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
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
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                    for alias in node.names
                ]
            for target in targets:
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
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def rung(module: str, ladder: list[str]) -> int | None:
    """Index of the highest rung holding ``module`` (the longest matching prefix), or None."""
    found = None
    for i, prefix in enumerate(ladder):
        if module == prefix or module.startswith(prefix + "."):
            found = i
    return found


def ladder_violations(graph: dict[str, set[str]], ladder: list[str]) -> list[str]:
    """``"a -> b"`` for every import of a higher rung by a lower one."""
    out = []
    for module, targets in sorted(graph.items()):
        here = rung(module, ladder)
        if here is None:
            continue
        for target in sorted(targets):
            there = rung(target, ladder)
            if there is not None and there > here:
                out.append(f"{module} ({ladder[here]}) -> {target} ({ladder[there]})")
    return out


def _write(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        target = tmp_path / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return tmp_path / "pkg"


def test_the_library_has_no_import_cycle():
    cycle = find_cycle(import_graph(PACKAGE_DIRS))
    assert cycle is None, "import circle in the library: " + " -> ".join(cycle)


def test_no_subpackage_of_the_core_imports_one_above_it():
    assert ladder_violations(import_graph(PACKAGE_DIRS), CORE_LADDER) == []


def test_every_core_module_sits_on_a_rung():
    graph = import_graph([ROOT / "kvgroups_core"])
    loose = sorted(m for m in graph if m != "kvgroups_core" and rung(m, CORE_LADDER) is None)
    assert loose == []


def test_the_core_subpackages_export_nothing():
    # A subpackage __init__ that imported its modules would import upward whenever a module of
    # a lower rung is loaded through it; they hold a docstring only.
    for init in sorted((ROOT / "kvgroups_core").rglob("__init__.py")):
        if init.parent == ROOT / "kvgroups_core":
            continue
        tree = ast.parse(init.read_text())
        assert [type(n).__name__ for n in tree.body] == ["Expr"], init


def test_the_core_imports_no_other_library_package():
    graph = import_graph(PACKAGE_DIRS)
    leaks = sorted(
        f"{m} -> {t}"
        for m, ts in graph.items()
        if m.split(".")[0] == "kvgroups_core"
        for t in ts
        if t.split(".")[0] != "kvgroups_core"
    )
    assert leaks == []


def test_the_core_and_the_backends_never_import_the_tooling():
    # The conformance kit may (it draws its models from the tooling's catalogue).
    graph = import_graph(PACKAGE_DIRS)
    leaks = sorted(
        f"{m} -> {t}"
        for m, ts in graph.items()
        if m.split(".")[0] not in (TOOLING, "kvgroups_conformance")
        for t in ts
        if t.split(".")[0] == TOOLING
    )
    assert leaks == []


def test_the_library_graph_is_read_at_all():
    # Guards the tests above against a walker that silently finds nothing.
    graph = import_graph(PACKAGE_DIRS)
    assert {
        "kvgroups_core.grouping.manager",
        "kvgroups_core.transfer.api",
        "kvgroups_torch.cuda.execute",
        "kvgroups_jax.lowerings.choice",
        "kvgroups_cuda.nvrtc",
        "kvgroups_conformance.harness",
        "kvgroups_tools.cli",
    } <= set(graph)
    assert "kvgroups_core.errors" in graph["kvgroups_core.grouping.manager"]
    assert "kvgroups_core.transfer.api" in graph["kvgroups_core"]
    assert "kvgroups_core.transfer.fast.call_memo" in graph["kvgroups_core.transfer.api"]
    assert "kvgroups_torch.copy_engine.batch" in graph["kvgroups_torch.cuda.execute"]
    assert "kvgroups_cuda.nvrtc" in graph["kvgroups_torch.cuda.device"]


def test_the_walker_finds_a_circle_hidden_in_a_function(tmp_path):
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from .b import thing\n",
            "pkg/b.py": "thing = 1\ndef late():\n    from .c import other\n",
            "pkg/c.py": "from pkg import a\nother = 2\n",
        },
    )
    assert find_cycle(import_graph([pkg])) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]


def test_the_walker_finds_a_circle_between_packages(tmp_path):
    one = _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from other.b import x\n"})
    two = _write(tmp_path / "second", {"pkg/__init__.py": ""}).parent / "other"
    (two).mkdir()
    (two / "__init__.py").write_text("")
    (two / "b.py").write_text("x = 1\ndef f():\n    import pkg.a\n")
    assert find_cycle(import_graph([one, two])) == ["other.b", "pkg.a", "other.b"]


def test_the_walker_resolves_subpackages_and_counts_type_checking(tmp_path):
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from .sub import x\n",
            "pkg/sub/__init__.py": "from .leaf import x\n",
            "pkg/sub/leaf.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from ..util import helper\nx = 1\n"
            ),
            "pkg/util.py": "import pkg.sub.leaf.x\nhelper = 1\n",
        },
    )
    graph = import_graph([pkg])
    assert graph["pkg.sub.leaf"] == {"pkg.util"}
    assert graph["pkg.util"] == {"pkg.sub.leaf"}
    assert find_cycle(graph) == ["pkg.sub.leaf", "pkg.util", "pkg.sub.leaf"]


def test_the_ladder_check_sees_an_upward_import(tmp_path):
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low/__init__.py": "",
            "pkg/low/a.py": "def f():\n    from pkg.high.b import y\n",
            "pkg/high/__init__.py": "",
            "pkg/high/b.py": "from pkg.low.a import f\ny = 1\n",
        },
    )
    ladder = ["pkg.low", "pkg.high"]
    assert ladder_violations(import_graph([pkg]), ladder) == [
        "pkg.low.a (pkg.low) -> pkg.high.b (pkg.high)"
    ]
    assert rung("pkg.high.b", ladder) == 1 and rung("pkg", ladder) is None
