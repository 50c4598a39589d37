"""No module of the library reads or writes another module's private members, and nothing
writes into an instance's ``__dict__``.

A private member is a name with a leading underscore (dunders aside). Read from the source
(``ast``) over every library package:

- ``x._name`` (also ``getattr`` / ``setattr`` / ``hasattr`` / ``delattr`` with that name as a
  constant), where ``x`` is not ``self`` / ``cls``, is a reach-in unless this very module
  defines ``_name`` (a method or class attribute of its classes, an attribute its methods set
  on ``self``, a ``__slots__`` entry, a module-level name): a module-private helper used
  inside its own module is fine, another module's is not. ``super()._name`` is not ``self``:
  a subclass in another module uses the public surface of its base;
- ``from module import _name`` and importing a module whose path has a private component
  (``torch._C``, ``jax._src``) read another module's private members the same way;
- ``x.__dict__[k] = v``, ``x.__dict__.update(...)`` and ``vars(x)[k] = v`` write around a
  class's own constructor (a frozen dataclass's fields must be made by the class itself:
  ``kvgroups_core.transfer.plan`` has the per-call constructors).

What a framework only offers privately is allowed below, each with its reason; an entry that
no longer matches anything fails too, so the list stays as short as the code needs.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = [
    ROOT / "kvgroups_core",
    ROOT / "kvgroups_tools",
    ROOT / "kvgroups_conformance",
] + sorted(p for p in (ROOT / "backends").iterdir() if (p / "__init__.py").is_file())

#: Underscored names that are a library's public API: ``NamedTuple._fields`` (and its
#: siblings), ctypes' ``Structure._fields_``.
PUBLIC_BY_CONVENTION = {"_fields", "_replace", "_asdict", "_make", "_fields_"}

#: ``(module, private name) -> why``: a framework's private API used on purpose.
ALLOWED = {
    (
        "kvgroups_torch.fingerprints",
        "_C",
    ): "torch._C._dynamo.guards.TensorGuards: the C++ guard torch.compile checks tensors "
    "with, the only per-call fingerprint cheap enough for the hot path (import guarded)",
    ("kvgroups_torch.fingerprints", "_dynamo"): "the same import (torch._C._dynamo.guards)",
    (
        "kvgroups_torch.cuda.device",
        "_C",
    ): "torch._C._cuda_getCurrentRawStream: the current stream as a plain int, without "
    "building a torch.cuda.Stream per launch (falls back to the public call)",
    ("kvgroups_torch.cuda.device", "_cuda_getCurrentRawStream"): "the same call",
    (
        "kvgroups_torch.backend",
        "_subclasses",
    ): "torch._subclasses.fake_tensor.is_fake: torch has no public test for a "
    "torch.compile fake tensor",
    ("kvgroups_torch.describe", "_subclasses"): "the same fake-tensor test",
    ("kvgroups_torch.compile.dynamo", "_subclasses"): "the same fake-tensor test",
    (
        "kvgroups_torch.backend",
        "_is_functional_tensor",
    ): "torch._is_functional_tensor: how a functionalized tensor of a trace is told apart "
    "(no public spelling)",
    ("kvgroups_torch.compile.dynamo", "_is_functional_tensor"): "the same test",
    (
        "kvgroups_torch.compile.dynamo",
        "_dynamo",
    ): "torch._dynamo.nonstrict_trace: how the public calls become opaque to Dynamo",
    (
        "kvgroups_torch.compile.dynamo",
        "_pytree",
    ): "torch.utils._pytree.register_constant: the manager as a compile-time constant",
    (
        "kvgroups_jax.executor",
        "_committed",
    ): "jax.Array._committed: whether an eager array is pinned to its device (the per-call "
    "arrays must follow it); read with a default",
    (
        "kvgroups_jax.id_checks",
        "_src",
    ): "jax._src.checkify's rule table: how out-of-range traced ids are reported under "
    "checkify without an effect on plain jit (guarded; falls back to debug_check)",
    (
        "kvgroups_jax.lowerings.cuda",
        "_src",
    ): "jax._src.lib.gpu_triton: jaxlib's kernel-call target that launches PTX from XLA",
    (
        "kvgroups_jax.lowerings.mosaic",
        "_src",
    ): "InterpretGPUParams on jax 0.10, where it is not yet public (tried after the public import)",
}

_ATTRIBUTE_CALLS = {"getattr", "setattr", "hasattr", "delattr"}


def _private(name: str) -> bool:
    return (
        name.startswith("_")
        and not (name.startswith("__") and name.endswith("__"))
        and name not in PUBLIC_BY_CONVENTION
    )


def _module_name(package_dir: Path, path: Path) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"`` assignments (attribute names kept in a constant)."""
    out = {}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def _defined(tree: ast.Module) -> set[str]:
    """Private names this module defines (see the module docstring)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, (ast.Store, ast.Del))
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            out.add(node.attr)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            out.update(
                c.value
                for c in ast.walk(node.value)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            )
    return {name for name in out if _private(name)}


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def violations(module: str, source: str) -> list[tuple[str, str, int, str]]:
    """``(module, private name, line, what)`` of every reach-in and ``__dict__`` write."""
    tree = ast.parse(source)
    own = _defined(tree)
    constants = _string_constants(tree)
    out = []

    def reach(name: str, node: ast.AST, what: str) -> None:
        if _private(name) and name not in own:
            out.append((module, name, node.lineno, what))

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not _is_self(node.value):
            reach(node.attr, node, f"{ast.unparse(node.value)}.{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _ATTRIBUTE_CALLS
            and len(node.args) >= 2
            and not _is_self(node.args[0])
        ):
            arg = node.args[1]
            name = (
                arg.value
                if isinstance(arg, ast.Constant)
                else constants.get(arg.id)
                if isinstance(arg, ast.Name)
                else None
            )
            if isinstance(name, str):
                reach(name, node, f"{node.func.id}({ast.unparse(node.args[0])}, {name!r})")
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                for part in node.module.split("."):
                    if _private(part):
                        out.append((module, part, node.lineno, f"from {node.module} import"))
            for alias in node.names:
                if _private(alias.name):
                    out.append(
                        (
                            module,
                            alias.name,
                            node.lineno,
                            f"from {'.' * node.level}{node.module or ''} import {alias.name}",
                        )
                    )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                for part in alias.name.split("."):
                    if _private(part):
                        out.append((module, part, node.lineno, f"import {alias.name}"))
        # Writes into an instance dict.
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, (ast.Store, ast.Del))
            and (
                (isinstance(node.value, ast.Attribute) and node.value.attr == "__dict__")
                or (
                    isinstance(node.value, ast.Call)
                    and isinstance(node.value.func, ast.Name)
                    and node.value.func.id == "vars"
                )
            )
        ):
            out.append((module, "__dict__", node.lineno, f"{ast.unparse(node)} = ..."))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("update", "setdefault", "pop", "clear")
            and (
                (isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "__dict__")
                or (
                    isinstance(node.func.value, ast.Call)
                    and isinstance(node.func.value.func, ast.Name)
                    and node.func.value.func.id == "vars"
                )
            )
        ):
            out.append((module, "__dict__", node.lineno, ast.unparse(node)[:60]))
    return out


def library_violations() -> list[tuple[str, str, int, str]]:
    found = []
    for package_dir in PACKAGE_DIRS:
        for path in sorted(package_dir.rglob("*.py")):
            found += violations(_module_name(package_dir, path), path.read_text())
    return found


def test_no_module_reaches_into_another_modules_private_members():
    found = library_violations()
    bad = [f"{m}:{line}: {what}" for m, name, line, what in found if (m, name) not in ALLOWED]
    assert bad == []


def test_every_allowance_is_still_needed():
    used = {(m, name) for m, name, _, _ in library_violations()}
    assert sorted(set(ALLOWED) - used) == []


def test_the_walker_reads_every_library_package():
    modules = {_module_name(d, p) for d in PACKAGE_DIRS for p in d.rglob("*.py")}
    assert {
        "kvgroups_core.transfer.fast.reuse",
        "kvgroups_core.transfer.fast.call_memo",
        "kvgroups_torch.cuda.repeat",
        "kvgroups_jax.sharded",
        "kvgroups_transport.base",
        "kvgroups_cuda.nvrtc",
        "kvgroups_conformance.harness",
        "kvgroups_tools.cli",
    } <= modules


def test_a_reach_into_another_modules_private_member_is_found():
    source = (
        "from .planner import _out_of_range\n"
        "import torch._C\n"
        "class Memo:\n"
        "    def __init__(self):\n"
        "        self._own = 1\n"
        "    def call(self, prepared, other):\n"
        "        prepared._release()\n"  # another module's method
        "        other._own = 2\n"  # this module's attribute: fine
        "        getattr(prepared, '_guard')\n"
        "        setattr(prepared, _ATTR, None)\n"
        "        super()._helper()\n"
        "        return self._own\n"
        "_ATTR = '_park'\n"
    )
    found = sorted((name, line) for _, name, line, _ in violations("pkg.memo", source))
    assert found == [
        ("_C", 2),
        ("_guard", 9),
        ("_helper", 11),
        ("_out_of_range", 1),
        ("_park", 10),
        ("_release", 7),
    ]


def test_a_module_private_helper_used_in_its_own_module_is_fine():
    source = (
        "_CACHE = {}\n"
        "class _Entry:\n"
        "    __slots__ = ('_value',)\n"
        "def _helper(entry):\n"
        "    return entry._value, _CACHE\n"
        "class Thing:\n"
        "    def _step(self):\n"
        "        return 1\n"
        "def use(thing, row):\n"
        "    return thing._step(), row._fields, row._replace(x=1)\n"
    )
    assert violations("pkg.mod", source) == []


def test_writes_into_an_instance_dict_are_found():
    source = (
        "def fill(new, fields, d):\n"
        "    new.__dict__.update(fields)\n"
        "    new.__dict__['obj'] = None\n"
        "    vars(d)['x'] = 1\n"
        "    return dict(new.__dict__)\n"  # a read: fine
    )
    assert [line for _, _, line, _ in violations("pkg.mod", source)] == [2, 3, 4]
