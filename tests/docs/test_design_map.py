from pathlib import Path

from tests.support.module_map import DESIGN, PACKAGES, ROOT, design_block, module_map, role


def test_design_md_module_map_matches_the_tree():
    assert design_block(DESIGN.read_text()) == module_map(), (
        "docs/DESIGN.md's module map is stale: run `python -m tests.support.module_map --write`"
    )


def test_the_map_has_one_line_per_module_and_package():
    files = [p for name in PACKAGES for p in (ROOT / name).rglob("*.py")]
    lines = module_map().splitlines()
    assert len(lines) == len(files) + 1  # and the backends/ heading
    assert all(line.split()[0].endswith((".py", "/")) for line in lines)


def test_every_module_states_its_role():
    missing = [
        str(p.relative_to(ROOT))
        for name in PACKAGES
        for p in (ROOT / name).rglob("*.py")
        if not role(p)
    ]
    assert missing == []


def test_the_map_follows_a_new_module(tmp_path):
    for name in PACKAGES:
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "__init__.py").write_text('"""A package. More."""\n')
    (tmp_path / "kvgroups_core" / "fresh.py").write_text('"""Something new.\n\nDetails."""\n')
    made = module_map(Path(tmp_path))
    assert "  fresh.py" in made and made.rstrip().endswith("A package.")
    assert [line.split()[-2:] for line in made.splitlines() if "fresh.py" in line] == [
        ["Something", "new."]
    ]
