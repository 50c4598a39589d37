"""``python -m kvgroups_conformance --backend NAME``: certify a registered backend.

Runs the installed suite under pytest with the kit's plugin, isolated from any project
configuration in the current directory (no ini file, no cache directory), and exits with
pytest's status: 0 when every case passed. Arguments after ``--`` go to pytest unchanged
(``-- -k round_trip -x``).
"""

from __future__ import annotations

import argparse
import os
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvgroups_conformance",
        description="Run the kvgroups conformance suite against a registered backend.")
    p.add_argument("--backend", action="append", default=[], metavar="NAME",
                   help="registered backend name (entry point group 'kvgroups.backends'); "
                        "repeatable")
    p.add_argument("--harness", default=None, metavar="MODULE:ATTR",
                   help="harness for the backend (default: its 'kvgroups.conformance' entry "
                        "point, else the generic harness over Backend.from_numpy/to_numpy)")
    p.add_argument("--report", default=None, metavar="PATH", help="write the report as JSON")
    p.add_argument("--quiet", action="store_true",
                   help="only the result lines (pytest -qq); per-test progress is pytest's own")
    p.add_argument("--cases", default=None, choices=("full", "small"),
                   help="the case set: 'full' certifies; 'small' runs every format, dtype and "
                        "feature once (default: what the backend declares, else full)")
    p.add_argument("--list-backends", action="store_true",
                   help="print the registered backends and exit")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    return p


def pytest_args(args: argparse.Namespace) -> list[str]:
    """The pytest command line the kit runs (exposed for tests and for copying by hand)."""
    out = ["-c", os.devnull, "--rootdir", os.getcwd(), "-p", "no:cacheprovider",
           "-p", "kvgroups_conformance.plugin", "--pyargs", "kvgroups_conformance.suite"]
    for name in args.backend:
        out += ["--kvgroups-backend", name]
    if args.harness:
        out += ["--kvgroups-harness", args.harness]
    if args.report:
        out += ["--kvgroups-report", args.report]
    if args.quiet:
        out += ["-qq", "--no-header"]
    if args.cases:
        out += ["--kvgroups-cases", args.cases]
    return out + list(args.pytest_args)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list_backends:
        from kvgroups_core.tensors.arrays import registered_backends

        print("\n".join(registered_backends()))
        return 0
    if not args.backend:
        _parser().error("--backend: expected at least one registered backend name")
    import pytest

    return int(pytest.main(pytest_args(args)))


if __name__ == "__main__":
    sys.exit(main())
