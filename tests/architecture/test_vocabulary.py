"""Names have one meaning each (docs/DESIGN.md "Vocabulary"): the names retired when a word
lost its other meanings do not come back in library code.

A scan of every library module's syntax tree (names, arguments, attributes, definitions,
imports, keywords and string constants), so prose and the engines' own words in comments are
left alone: a slot is a token position, a path is how the bytes move, an engine is the serving
engine, a cache is the engine's KV tensors and bind attaches those caches to a transfer.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = [
    ROOT / "kvgroups_core",
    ROOT / "kvgroups_tools",
    ROOT / "kvgroups_conformance",
    ROOT / "backends",
]

#: Retired name -> what replaced it.
RETIRED = {
    # slot: a binding's tensor position and a pool's chunk had other names to take
    "tensor_slot": "tensor_index",
    "operand_slots": "operand_indices",
    "id_slots": "id_indices",
    "remote_slot": "remote_entry",
    "local_slot": "local_entry",
    "remote_slots": "remote_entries",
    "local_slots": "local_entries",
    "slot_rows": "entry_rows",
    "pinned_slots": "pinned_entries",
    "MAX_STAGING_SLOTS": "MAX_STAGING_ENTRIES",
    # path: how the bytes move
    "cpu_path": "cpu_copy",
    "table_path": "table_file",
    # cache: the engine's KV tensors
    "_MAPS_CACHE": "_MAPS_MEMO",
    "_TYPE_CACHE": "_TYPE_MEMO",
    "_CACHE_SIZE": "_MEMO_SIZE",
    "_cache_lock": "_memo_lock",
    "_hash_cache": "_hash_memo",
    # bind: attaching the engine's caches to a transfer
    "ObjectBinding": "ObjectAddresses",
    "bind_objects": "object_addresses",
    "bind_device_objects": "device_object_addresses",
    "device_bindings": "known_object_addresses",
    "bind_ids": "write_ids",
}

#: Where a pool holds entries: ``slot`` / ``slots`` there would be a pool's chunk again.
POOL_MODULES = [
    ROOT / "backends" / "kvgroups_transport",
    ROOT / "backends" / "kvgroups_torch" / "vllm" / "connector.py",
    ROOT / "backends" / "kvgroups_torch" / "vllm" / "host_store.py",
    ROOT / "backends" / "kvgroups_torch" / "vllm" / "pd.py",
    ROOT / "backends" / "kvgroups_torch" / "vllm" / "pipeline.py",
    ROOT / "backends" / "kvgroups_torch" / "vllm" / "prefix_index.py",
]
POOL_WORDS = {"slot", "slots"}
#: A kernel group's region rows in the transport's read plan: the token rows, a true slot.
TOKEN_ROWS = {("backends/kvgroups_transport/plan.py", "slots")}

#: The one place the old plane field name lives on: its deprecated property.
DEPRECATED_PROPERTY = ("kvgroups_core/transfer/plan.py", "PlaneRef", "tensor_slot")


def names_in(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, name)`` of every identifier and string constant of a module."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.append((node.lineno, node.id))
        elif isinstance(node, ast.arg):
            out.append((node.lineno, node.arg))
        elif isinstance(node, ast.Attribute):
            out.append((node.lineno, node.attr))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((node.lineno, node.name))
        elif isinstance(node, ast.alias):
            out += [(node.lineno, part) for part in node.name.split(".")]
            if node.asname:
                out.append((node.lineno, node.asname))
        elif isinstance(node, ast.keyword) and node.arg:
            out.append((node.lineno, node.arg))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.isidentifier():
                out.append((node.lineno, node.value))
    return out


def _deprecated_lines(tree: ast.AST) -> set[int]:
    """The lines of ``PlaneRef.tensor_slot``, the deprecated property."""
    _, cls, prop = DEPRECATED_PROPERTY
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == prop:
                    return set(range(item.lineno, (item.end_lineno or item.lineno) + 1))
    return set()


def _in_pool_module(path: Path) -> bool:
    return any(path == p or p in path.parents for p in POOL_MODULES)


def findings(source: str, rel: str, pool_module: bool = False) -> list[str]:
    """What in ``source`` (library module ``rel``) uses a retired name."""
    tree = ast.parse(source)
    allowed = _deprecated_lines(tree) if rel == DEPRECATED_PROPERTY[0] else set()
    out = []
    for line, name in names_in(tree):
        if name in RETIRED and not (name == "tensor_slot" and line in allowed):
            out.append(f"{rel}:{line}: {name} (use {RETIRED[name]})")
        elif pool_module and name in POOL_WORDS and (rel, name) not in TOKEN_ROWS:
            out.append(f"{rel}:{line}: {name} (a pool holds entries; a slot is a token position)")
    return out


def _library_modules() -> list[Path]:
    return sorted(p for d in LIBRARY for p in d.rglob("*.py") if "__pycache__" not in p.parts)


def test_library_code_uses_none_of_the_retired_names():
    found = []
    for p in _library_modules():
        rel = p.relative_to(ROOT).as_posix()
        found += findings(p.read_text(), rel, _in_pool_module(p))
    assert found == [], "retired names in library code:\n" + "\n".join(found)


def test_the_scan_finds_each_kind_of_use():
    sample = (
        "from kvgroups_torch import cpu as cpu_path\n"
        "from .objects import ObjectBinding\n"
        "def f(tensor_slot, **kw):\n"
        "    x = plane.tensor_slot\n"
        "    g(remote_slot=1)\n"
        "    return bind_objects(x)\n"
    )
    got = findings(sample, "backends/kvgroups_torch/x.py")
    assert sorted(f.split(": ")[1].split(" ")[0] for f in got) == sorted(
        ["cpu_path", "ObjectBinding", "tensor_slot", "tensor_slot", "remote_slot", "bind_objects"]
    )
    pool = "def publish(slots):\n    return {'slots': list(slots)}\n"
    assert len(findings(pool, "backends/kvgroups_transport/base.py", pool_module=True)) == 3
    assert findings(pool, "backends/kvgroups_torch/sglang.py") == []  # SGLang's token slots


def test_the_deprecated_plane_property_is_the_only_tensor_slot_left():
    rel = DEPRECATED_PROPERTY[0]
    source = (ROOT / rel).read_text()
    assert _deprecated_lines(ast.parse(source)), "PlaneRef.tensor_slot (deprecated) is missing"
    assert findings(source, rel) == []
    moved = source.replace("tensor_index: int\n", "tensor_slot: int\n", 1)
    assert any("tensor_slot" in f for f in findings(moved, rel))
