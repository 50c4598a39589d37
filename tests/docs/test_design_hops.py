"""docs/DESIGN.md "One store, hop by hop" stays true: every function it names exists, each hop
starts with a fully qualified ``module.function`` (a method as ``module.Class.method``), and
the road from the public call to the kernel launch takes at most 12 hops."""

import importlib
import re
from pathlib import Path

import pytest

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "DESIGN.md"
MAX_HOPS = 12
_NAME = re.compile(r"`([A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)+)`")


def _section() -> str:
    text = DESIGN.read_text()
    start = text.index("## One store, hop by hop")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def _hops(section: str) -> list[tuple[int, str]]:
    block = section[section.index("<!-- hops") : section.index("<!-- /hops -->")]
    return [(int(n), name) for n, name in re.findall(r"^(\d+)\. `([\w.]+)`", block, re.M)]


def resolve(name: str, modules: list[str]):
    """The object ``name`` names: a dotted path from a module, or ``Head.rest`` where Head is
    a module named elsewhere in the section (by its last component) or a class of one."""
    parts = name.split(".")
    if parts[0].startswith("kvgroups"):
        for cut in range(len(parts), 0, -1):
            try:
                found = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attr in parts[cut:]:
                found = getattr(found, attr)
            return found
        raise LookupError(name)
    for module_name in modules:
        module = importlib.import_module(module_name)
        if module_name.rsplit(".", 1)[-1] == parts[0]:
            found = module
        elif hasattr(module, parts[0]):
            found = getattr(module, parts[0])
        else:
            continue
        try:
            for attr in parts[1:]:
                found = getattr(found, attr)
        except AttributeError:
            continue
        return found
    raise LookupError(name)


def test_the_road_has_at_most_twelve_hops_numbered_in_order():
    hops = _hops(_section())
    assert [n for n, _ in hops] == list(range(1, len(hops) + 1))
    assert 0 < len(hops) <= MAX_HOPS
    assert hops[0][1] == "kvgroups_core.transfer.api.store"
    assert any(name.endswith("Launcher.launch") for _, name in hops)  # the kernel launch


def test_every_function_the_section_names_exists():
    pytest.importorskip("torch")
    section = _section()
    names = sorted(set(_NAME.findall(section)))
    names = [n for n in names if not n.endswith((".cu", ".py", ".md"))]
    full = [n for n in names if n.startswith("kvgroups")]
    modules = []
    for name in full:  # the modules the section names, for the short forms
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            modules.append(".".join(parts[:cut]))
            break
    missing = []
    for name in names:
        try:
            found = resolve(name, modules)
        except (LookupError, AttributeError):
            missing.append(name)
            continue
        if name in dict(_hops(section)).values():
            assert callable(found), name
    assert missing == []
    assert len(names) >= 20  # the walker read the section


def test_the_resolver_refuses_a_name_that_is_gone():
    with pytest.raises((LookupError, AttributeError)):
        resolve("kvgroups_core.transfer.api.no_such_function", [])
    with pytest.raises(LookupError):
        resolve("planner.no_such_function", ["kvgroups_core.transfer.planner"])
