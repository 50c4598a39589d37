"""The benchmarks measure the library as a user calls it: they import only its public modules
and names, reach into no private attribute and set no module state (a static walk of each
script's syntax tree, so a script that only runs on a GPU is checked too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py"))

LIBRARY = (
    "kvgroups_core",
    "kvgroups_torch",
    "kvgroups_jax",
    "kvgroups_cuda",
    "kvgroups_conformance",
    "kvgroups_tools",
)
#: The modules docs/API.md names; kvgroups_tools (the command and its bench kits) is the
#: benchmarks' own engine, so its public modules may be imported too.
PUBLIC_MODULES = {
    "kvgroups_core",
    "kvgroups_torch",
    "kvgroups_jax",
    "kvgroups_cuda",
    "kvgroups_conformance",
    "kvgroups_torch.vllm",
    "kvgroups_torch.sglang",
    "kvgroups_jax.engines",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _library(module: str) -> bool:
    return module.split(".")[0] in LIBRARY


def _public_module(module: str) -> bool:
    if any(_private(part) for part in module.split(".")):
        return False
    return module in PUBLIC_MODULES or module.split(".")[0] == "kvgroups_tools"


def _is_submodule(module: str, name: str) -> bool:
    """Whether ``from module import name`` imports a module of the package (not a name its
    ``__init__`` exports)."""
    rel = Path(*module.split("."), name)
    return any(
        (base / rel).with_suffix(".py").is_file() or (base / rel / "__init__.py").is_file()
        for base in (ROOT, ROOT / "backends")
    )


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def violations(source: str) -> list[str]:
    """What in ``source`` reaches past the library's public surface, one line each."""
    tree = ast.parse(source)
    library_names: set[str] = set()  # local names bound to the library's modules or objects
    other_imports: set[str] = set()  # local names bound to anything else imported
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                if _library(alias.name):
                    library_names.add(local)
                    if not _public_module(alias.name):
                        found.append(f"line {node.lineno}: import {alias.name}")
                else:
                    other_imports.add(local)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                local = alias.asname or alias.name
                if not _library(node.module):
                    other_imports.add(local)
                    continue
                library_names.add(local)
                if not _public_module(node.module):
                    found.append(f"line {node.lineno}: from {node.module} import ...")
                elif _is_submodule(node.module, alias.name):
                    full = f"{node.module}.{alias.name}"
                    if not _public_module(full):
                        found.append(
                            f"line {node.lineno}: from {node.module} import "
                            f"{alias.name} (the module {full})"
                        )
                elif _private(alias.name):
                    found.append(f"line {node.lineno}: {node.module}.{alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = _root(node)
            name = root.id if isinstance(root, ast.Name) else None
            if name not in ("self", "cls") and name not in other_imports:
                found.append(f"line {node.lineno}: .{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "delattr")
            and len(node.args) > 1
        ):
            attr = node.args[1]
            if (
                isinstance(attr, ast.Constant)
                and isinstance(attr.value, str)
                and _private(attr.value)
            ):
                found.append(f"line {node.lineno}: {node.func.id}(..., {attr.value!r})")
            if node.func.id != "getattr":
                root = _root(node.args[0])
                if isinstance(root, ast.Name) and root.id in library_names:
                    found.append(f"line {node.lineno}: {node.func.id} on {root.id}")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                root = _root(target)
                if (
                    isinstance(target, (ast.Attribute, ast.Subscript))
                    and isinstance(root, ast.Name)
                    and root.id in library_names
                ):
                    found.append(f"line {node.lineno}: sets {ast.unparse(target)}")
    return found


def test_the_checker_finds_each_kind_of_reach_in():
    source = (
        "import torch\n"
        "from kvgroups_jax import executor, lowerings\n"
        "from kvgroups_core.planner import bind\n"
        "from kvgroups_core import _internal\n"
        "import kvgroups_torch.cuda_path as cuda_path\n"
        "from kvgroups_core import prepare\n"
        "prepared = prepare(None, [])\n"
        "executor._store_jit = None\n"
        "lowerings.TUNING['x'] = 1\n"
        "prepared._bound.caches\n"
        "getattr(prepared, '_bound')\n"
        "torch.cuda._sleep(1)\n"
        "self._mine = 1\n"
    )
    found = violations(source)
    for needle in (
        "kvgroups_jax.executor",
        "kvgroups_jax.lowerings",
        "kvgroups_core.planner",
        "kvgroups_core._internal",
        "import kvgroups_torch.cuda_path",
        "._store_jit",
        "sets lowerings.TUNING",
        "._bound",
        "getattr(..., '_bound')",
    ):
        assert any(needle in line for line in found), (needle, found)
    assert not any("_sleep" in line or "_mine" in line for line in found)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_uses_only_the_public_api(script):
    assert violations(script.read_text()) == []
