"""The docs stand alone: every Markdown file the code or docs cite exists in the repository, every
cited SEMANTICS.md section exists, and the licence pyproject names is there in full."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tracked_text_files():
    names = subprocess.run(
        ["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout.split()
    for name in names:
        path = ROOT / name
        if (
            path.suffix in (".py", ".md", ".sh", ".toml", ".cu")
            and not name.startswith("benchmarks/results/")
            and path.is_file()
        ):
            yield path


def test_every_cited_markdown_file_exists():
    missing = []
    for path in tracked_text_files():
        for match in re.finditer(r"[\w./-]*\b([A-Z][A-Z_]*\.md)\b", path.read_text()):
            cited = match.group(0)
            candidates = [path.parent / cited, ROOT / cited, ROOT / "docs" / match.group(1)]
            if not any(c.is_file() for c in candidates):
                missing.append(f"{path.relative_to(ROOT)}: {cited}")
    assert missing == []


def test_every_cited_benchmark_file_exists():
    # Scripts and records that left the repository stay in git history, not in citations.
    missing = []
    for path in tracked_text_files():
        for match in re.finditer(r"benchmarks/[\w./-]*\w", path.read_text()):
            if not (ROOT / match.group(0)).exists():
                missing.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
    assert missing == []


#: A block that is not run says so on the line before it, with the reason.
FRAGMENT = re.compile(r"<!-- fragment: \S.* -->")
#: Blocks run by a test of their own: the examples of docs/INTEGRATION.md (tests/engines) and
#: docs/PD.md (tests/pd), the README's commands and code (test_readme.py).
EXAMPLE_DOCS = (Path("docs/INTEGRATION.md"), Path("docs/PD.md"))
RUN_ELSEWHERE = re.compile(r"<!-- (example \S+.*|demo-command|test-command) -->")


def test_every_doc_code_block_runs_in_ci_or_is_marked_a_fragment():
    unmarked = []
    for path in tracked_text_files():
        if path.suffix != ".md":
            continue
        lines = path.read_text().splitlines()
        inside = False
        for i, line in enumerate(lines):
            if not line.startswith("```"):
                continue
            inside = not inside
            if not inside:
                continue
            lang = line[3:].strip()
            before = lines[i - 1] if i else ""
            name = path.relative_to(ROOT)
            if lang == "text":  # output, diagrams, formulas: not code
                continue
            if not lang:
                unmarked.append(f"{name}:{i + 1}: a block without a language (text?)")
            elif RUN_ELSEWHERE.fullmatch(before):
                if before.startswith("<!-- example") and name not in EXAMPLE_DOCS:
                    unmarked.append(f"{name}:{i + 1}: examples run only in {EXAMPLE_DOCS}")
            elif not (FRAGMENT.fullmatch(before) or name == Path("README.md")):
                unmarked.append(f"{name}:{i + 1}: neither run by a test nor marked a fragment")
    assert unmarked == []


def test_no_file_points_outside_the_repository():
    pattern = re.compile("(\\.\\./)+" + "shared" + r"\S*|" + "shared" + "/spec" + r"\S*")
    outside = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in tracked_text_files()
        for m in pattern.finditer(p.read_text())
    ]
    assert outside == []


def test_every_cited_semantics_section_exists():
    semantics = (ROOT / "docs" / "SEMANTICS.md").read_text()
    headings = set(re.findall(r"^## (\d+)\. ", semantics, flags=re.M))
    cited = set()
    for path in tracked_text_files():
        for m in re.finditer(r"SEMANTICS\.md,? sections? (\d+)(?:-(\d+))?", path.read_text()):
            first, last = int(m.group(1)), int(m.group(2) or m.group(1))
            cited |= {str(n) for n in range(first, last + 1)}
    assert cited and cited <= headings, sorted(cited - headings)


def test_the_licence_is_the_apache_2_text_pyproject_names():
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 150
