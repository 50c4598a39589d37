"""The kit's pytest plugin: runs ``kvgroups_conformance.suite`` against registered backends.

Load it explicitly (it is not a ``pytest11`` entry point, so installing kvgroups changes no
other test run)::

    pytest -p kvgroups_conformance.plugin --pyargs kvgroups_conformance.suite \\
        --kvgroups-backend NAME [--kvgroups-harness module:attr] [--kvgroups-report out.json]

``python -m kvgroups_conformance --backend NAME`` does the same. Each case runs once per
backend (test id = the harness id) and each cross-backend case twice more, paired with the
NumPy reference in both directions (``numpy-ref->ID`` and ``ID->numpy-ref``). At the end the
terminal shows the conformance report (every failing case with the place of its first wrong
byte) and the verdict; ``--kvgroups-report`` writes the same as JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvgroups_conformance.cases import check_case_set, keeps
from kvgroups_conformance.harness import Harness, harness_for, reference_harness
from kvgroups_conformance.report import case_record, format_case


@dataclass
class _State:
    harnesses: list[Harness]
    cases: str = "full"
    rows: list[dict[str, Any]] = field(default_factory=list)


_STATE = pytest.StashKey[_State]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvgroups-conformance", "kvgroups conformance kit")
    group.addoption(
        "--kvgroups-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="registered kvgroups backend to certify (repeatable)",
    )
    group.addoption(
        "--kvgroups-harness",
        default=None,
        metavar="MODULE:ATTR",
        help="harness (class, instance or factory) for the backend; default: the "
        "backend's 'kvgroups.conformance' entry point, else the generic one",
    )
    group.addoption(
        "--kvgroups-report",
        default=None,
        metavar="PATH",
        help="also write the conformance report as JSON to PATH",
    )
    group.addoption(
        "--kvgroups-cases",
        default=None,
        choices=("full", "small"),
        help="the case set: 'full' (certifies) or 'small' (every format, dtype and "
        "feature once); default: what the harness / backend declares",
    )


def pytest_configure(config: pytest.Config) -> None:
    names = config.getoption("kvgroups_backend")
    if not names:
        return
    try:
        import ml_dtypes  # noqa: F401  (bfloat16 and float8 cases need it)
    except ImportError as exc:
        raise pytest.UsageError(
            "kvgroups conformance: expected ml_dtypes to be installed "
            "(kvgroups' conformance extra, or pip install ml_dtypes), "
            "got none"
        ) from exc
    spec = config.getoption("kvgroups_harness")
    if spec and len(names) > 1:
        raise pytest.UsageError(
            f"--kvgroups-harness: expected one --kvgroups-backend, got {len(names)}"
        )
    try:
        harnesses = [harness_for(name, spec) for name in names]
    except Exception as exc:  # a usage error names the backend or harness that is missing
        raise pytest.UsageError(f"kvgroups conformance: {type(exc).__name__}: {exc}") from exc
    cases = config.getoption("kvgroups_cases")
    try:
        sets = {check_case_set(h.case_set()) for h in harnesses}
    except Exception as exc:
        raise pytest.UsageError(f"kvgroups conformance: {type(exc).__name__}: {exc}") from exc
    if cases is None:  # the largest set any harness asks for
        cases = "full" if "full" in sets else "small"
    config.stash[_STATE] = _State(harnesses, cases)


def _pairs(harnesses: list[Harness]) -> list:
    out = []
    for h in harnesses:
        ref = reference_harness()
        out.append(pytest.param((ref, h), id=f"{ref.id}->{h.id}"))
        out.append(pytest.param((h, ref), id=f"{h.id}->{ref.id}"))
    return out


@pytest.hookimpl(trylast=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    state = metafunc.config.stash.get(_STATE, None)
    if state is None:
        return
    if "harness" in metafunc.fixturenames:
        metafunc.parametrize("harness", state.harnesses, ids=[h.id for h in state.harnesses])
    if "harness_pair" in metafunc.fixturenames:
        metafunc.parametrize("harness_pair", _pairs(state.harnesses))


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    state = config.stash.get(_STATE, None)
    if state is None or state.cases == "full":
        return
    kept, dropped = [], []
    for item in items:
        params = dict(getattr(getattr(item, "callspec", None), "params", {}))
        module = getattr(item, "module", None)
        name = getattr(item, "originalname", item.name)
        (kept if keeps(module, name, params) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    state = item.config.stash.get(_STATE, None)
    if state is None:
        return
    # One row per case: the call phase, or the phase that failed or skipped before it.
    if report.when == "call" or (report.when == "setup" and not report.passed):
        error = call.excinfo.value if (call.excinfo is not None and report.failed) else None
        params = dict(getattr(getattr(item, "callspec", None), "params", {}))
        state.rows.append(case_record(item.nodeid, params, report.outcome, error))


def summary(
    rows: list[dict[str, Any]], harnesses: list[Harness], cases: str = "full"
) -> dict[str, Any]:
    """Counts and verdict of a run (what the terminal report and the JSON file say)."""
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "skipped")}
    names = ", ".join(f"{h.id} (backend {h.backend!r})" for h in harnesses)
    conformant = counts["failed"] == 0 and counts["skipped"] == 0 and counts["passed"] > 0
    which = "" if cases == "full" else f" ({cases} case set)"
    return {
        "harnesses": [h.id for h in harnesses],
        "backends": [h.backend for h in harnesses],
        **counts,
        "cases_run": cases,
        "conformant": conformant,
        "verdict": (
            f"CONFORMANT{which}: {names} passed all {counts['passed']} cases"
            if conformant
            else f"NOT CONFORMANT{which}: {names}: {counts['failed']} failed, "
            f"{counts['skipped']} skipped, {counts['passed']} passed"
        ),
    }


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state is None:
        return
    result = summary(state.rows, state.harnesses, state.cases)
    tr = terminalreporter
    tr.section("kvgroups conformance report")
    for row in state.rows:
        if row["outcome"] == "failed":
            for line in format_case(row):
                tr.write_line(line)
    for row in state.rows:
        if row["outcome"] == "skipped":
            tr.write_line(f"SKIPPED {row['case']} (a certified run skips nothing)")
    tr.write_line(result["verdict"])
    report_file = config.getoption("kvgroups_report")
    if report_file:
        with open(report_file, "w", encoding="utf-8") as f:
            json.dump({**result, "cases": state.rows}, f, indent=1)
        tr.write_line(f"report written to {report_file}")
