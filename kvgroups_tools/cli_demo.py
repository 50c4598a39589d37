"""``kvgroups demo``: store a request with one backend, load it with another, verify every byte."""

from __future__ import annotations

import argparse
from typing import Any

from .catalog import MODELS


def run(args: argparse.Namespace) -> int:
    from .demo import run_demo
    from .progress import show_library_logs

    show_library_logs()  # on a terminal: a kernel's first compile, which takes seconds

    return run_demo(model=args.model, spec=args.spec, layers=args.layers,
                    num_chunks=args.chunks, num_blocks=args.num_blocks,
                    store_backend=args.store_backend, load_backend=args.load_backend,
                    device=args.device, batch_chunks=args.batch_chunks, corrupt=args.corrupt,
                    seed=args.seed)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``kvgroups demo``."""
    parser = subparsers.add_parser(
        "demo", help="move a request's KV pages across runtimes and verify every byte",
        description=__doc__)
    parser.add_argument("--model", default="hybrid-demo", choices=sorted(MODELS),
                        help="catalogue model shape (default: hybrid-demo)")
    parser.add_argument("--spec", default=None,
                        help='a shape spec "(kv,NB,BS,NH,HS):dtype:layers;..." instead of --model')
    parser.add_argument("--layers", type=int, default=None, help="override the layer count")
    parser.add_argument("--chunks", type=int, default=4, help="chunks in the request (default 4)")
    parser.add_argument("--num-blocks", type=int, default=None, help="blocks per cache tensor")
    parser.add_argument("--store-backend", default=None,
                        help="backend that stores (default: torch if installed, else numpy)")
    parser.add_argument("--load-backend", default=None,
                        help="backend that loads (default: jax if installed, else numpy)")
    parser.add_argument("--device", default=None, help="device for both runtimes (default: GPU "
                        "when available, else cpu)")
    parser.add_argument("--batch-chunks", type=int, default=8,
                        help="chunks per store/load call (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corrupt", action="store_true", help=argparse.SUPPRESS)
    parser.set_defaults(func=run)
    return parser
