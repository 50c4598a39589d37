"""The ``kvgroups`` command line: a registry of subcommands.

Each subcommand lives in its own module ``kvgroups_tools/cli_<name>.py`` exposing
``add_parser(subparsers)``, which adds its parser and sets ``func`` (called with the parsed
arguments, returning an exit status). Modules that are not installed are simply not offered;
a module that exists but fails to import raises, so breakage is never hidden.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

from kvgroups_core.errors import KVGroupsError

#: Subcommands in help order; each is ``kvgroups_tools.cli_<name>``.
SUBCOMMANDS: tuple[str, ...] = ("plan", "demo", "bench")


def available_subcommands() -> list[str]:
    """The subcommands whose module is present."""
    return [
        name for name in SUBCOMMANDS if importlib.util.find_spec(f"{__package__}.cli_{name}")
    ]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every available subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="kvgroups",
        description="Plan and move paged KV-cache pages in LMCache-compatible chunks.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in available_subcommands():
        module = importlib.import_module(f"{__package__}.cli_{name}")
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvgroups`` command; returns the exit status (2 for a rejected input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KVGroupsError as exc:
        # Bad user input (a malformed spec, an invalid window): say so, without a traceback.
        print(f"kvgroups {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
