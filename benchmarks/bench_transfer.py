"""Transfer bandwidth of every path (torch CUDA kernels and index ops, Pallas Triton / Mosaic
GPU, plain XLA, the NumPy reference) against the measured ceilings: ``kvgroups bench`` as a
script, runnable from a checkout without installing (``backends/`` is put on the path).

    python benchmarks/bench_transfer.py --matrix full --out benchmarks/results/transfer.jsonl \
        --plot benchmarks/results/transfer.png

Options are those of ``kvgroups bench`` (see ``--help``) plus ``--plot PNG``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "backends")]

from kvgroups_tools import cli_bench  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cli_bench.add_arguments(parser)
    parser.add_argument("--plot", type=Path, default=None,
                        help="also draw the records of --out into this PNG (needs matplotlib)")
    args = parser.parse_args(argv)
    status = cli_bench.run(args)
    if args.plot is not None and args.out is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import plot_transfer

        status = max(status, plot_transfer.main([str(args.out), "--out", str(args.plot)]))
    return status


if __name__ == "__main__":
    sys.exit(main())
