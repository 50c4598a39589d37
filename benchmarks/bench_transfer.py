"""Transfer bandwidth of every path (torch CUDA kernels and index ops, Pallas Triton / Mosaic
GPU, plain XLA, the NumPy reference) and of the public calls, against the measured ceilings:
``kvgroups bench`` as a script.

    python benchmarks/bench_transfer.py --matrix engine --backends torch --out engine_h200.jsonl
    python benchmarks/bench_transfer.py --tiny          # CPU, seconds (CI)

Options are those of ``kvgroups bench`` (see ``--help``); ``--tiny`` is ``--matrix tiny
--backends numpy,torch-cpu,jax-cpu`` limited to the runtimes installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from kvgroups_tools import cli_bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cli_bench.add_arguments(parser)
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="the tiny matrix on the CPU runtimes installed (seconds; CI)",
    )
    args = parser.parse_args(argv)
    if args.tiny:
        runtimes = ["numpy"] + [
            f"{name}-cpu" for name in ("torch", "jax") if importlib.util.find_spec(name) is not None
        ]
        args = parser.parse_args(
            [
                *(argv if argv is not None else sys.argv[1:]),
                "--matrix",
                "tiny",
                "--backends",
                ",".join(runtimes),
            ]
        )
    return cli_bench.run(args)


if __name__ == "__main__":
    sys.exit(main())
