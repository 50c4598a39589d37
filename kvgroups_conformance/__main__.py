"""``python -m kvgroups_conformance --backend NAME``: certify a registered backend.

Runs the installed suite under pytest with the kit's plugin, isolated from any project
configuration in the current directory (no ini file, no cache directory), and exits with
pytest's status: 0 when every case passed. Arguments after ``--`` go to pytest unchanged
(``-- -k round_trip -x``). A bad option (an unknown or unloadable backend, a report path in a
directory that does not exist, no pytest installed) is refused in one line with status 2
before anything runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

PROG = "python -m kvgroups_conformance"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, status 2 (no usage block)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    from kvgroups_core import __version__

    p = _Parser(
        prog=PROG, description="Run the kvgroups conformance suite against a registered backend."
    )
    p.add_argument("--version", action="version", version=f"kvgroups {__version__}")
    p.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="NAME",
        help="registered backend name (entry point group 'kvgroups.backends'); repeatable",
    )
    p.add_argument(
        "--harness",
        default=None,
        metavar="MODULE:ATTR",
        help="harness for the backend (default: its 'kvgroups.conformance' entry "
        "point, else the generic harness over Backend.from_numpy/to_numpy)",
    )
    p.add_argument("--report", default=None, metavar="PATH", help="write the report as JSON")
    p.add_argument(
        "--quiet",
        action="store_true",
        help="only the result lines (pytest -qq); per-test progress is pytest's own",
    )
    p.add_argument(
        "--cases",
        default=None,
        choices=("full", "small"),
        help="the case set: 'full' certifies; 'small' runs every format, dtype and "
        "feature once (default: what the backend declares, else full)",
    )
    p.add_argument(
        "--list-backends",
        action="store_true",
        help="print the registered backends (those that cannot load marked) and exit",
    )
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    return p


def pytest_args(args: argparse.Namespace) -> list[str]:
    """The pytest command line the kit runs (exposed for tests and for copying by hand)."""
    out = [
        "-c",
        os.devnull,
        "--rootdir",
        os.getcwd(),
        "-p",
        "no:cacheprovider",
        "-p",
        "kvgroups_conformance.plugin",
        "--pyargs",
        "kvgroups_conformance.suite",
    ]
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


def _why_not_loadable(name: str) -> str | None:
    """Why the backend ``name`` cannot be used here (None: it loads)."""
    from kvgroups_core.errors import KVGroupsError
    from kvgroups_core.tensors.arrays import get_backend, unavailable_reason

    reason = unavailable_reason(name)
    if reason is not None:
        return reason
    try:
        get_backend(name)
    except KVGroupsError as exc:
        return str(exc)
    return None


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every option, before pytest (or any backend's framework) is imported."""
    from kvgroups_core.tensors.arrays import registered_backends

    if not args.backend:
        parser.error("--backend: expected at least one registered backend name")
    known = registered_backends()
    for name in args.backend:
        if name not in known:
            parser.error(f"--backend: expected one of {sorted(known)}, got {name!r}")
    if args.harness is not None:
        module, _, attr = args.harness.partition(":")
        if not module or not attr:
            parser.error(f"--harness: expected MODULE:ATTR, got {args.harness!r}")
    if args.report is not None:
        parent = os.path.dirname(os.path.abspath(args.report))
        if not os.path.isdir(parent) or os.path.isdir(args.report):
            parser.error(f"--report: expected a file in an existing directory, got {args.report!r}")
    try:
        import pytest  # noqa: F401 - the suite's runner
    except ImportError as exc:
        parser.error(
            f"expected pytest to run the suite (pip install 'kvgroups[conformance]'), "
            f"got {type(exc).__name__}: {exc}"
        )
    for name in args.backend:
        why = _why_not_loadable(name)
        if why is not None:
            parser.error(f"--backend: expected a backend that loads here, got {name!r} ({why})")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if args.list_backends:
            from kvgroups_core.tensors.arrays import registered_backends

            for name in registered_backends():
                why = _why_not_loadable(name)
                print(name if why is None else f"{name}  (not loadable: {why})")
            sys.stdout.flush()
            return 0
        _check(parser, args)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    import pytest

    return int(pytest.main(pytest_args(args)))


if __name__ == "__main__":
    sys.exit(main())
