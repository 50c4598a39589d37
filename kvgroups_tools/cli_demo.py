"""``kvgroups demo``: store a request with one backend, load it with another, verify every byte."""

from __future__ import annotations

import argparse
from typing import Any

from kvgroups_core.errors import KVGroupsError

from .catalog import MODELS
from .cli_options import (
    MAX_CHUNKS,
    MAX_LAYERS,
    float_in,
    in_option_terms,
    int_in,
    refuse,
    shape_spec,
)

#: run_demo's argument names -> the options typed.
OPTIONS = {
    "num_chunks": "--chunks",
    "num_blocks": "--num-blocks",
    "batch_chunks": "--batch-chunks",
    "store_backend": "--store-backend",
    "load_backend": "--load-backend",
    "layers": "--layers",
    "device": "--device",
    "spec": "--spec",
    "seed": "--seed",
    "model": "--model",
}


def run(args: argparse.Namespace) -> int:
    from .demo import run_demo
    from .progress import show_library_logs

    show_library_logs()  # on a terminal: a kernel's first compile, which takes seconds

    if args.spec is not None and args.model is not None:
        refuse("--model", f"expected --model or --spec, got both (--model {args.model})")
    max_memory = None if args.max_memory is None else int(args.max_memory * (1 << 30))
    try:
        return run_demo(
            model=args.model or "hybrid-demo",
            spec=args.spec,
            layers=args.layers,
            num_chunks=args.chunks,
            num_blocks=args.num_blocks,
            store_backend=args.store_backend,
            load_backend=args.load_backend,
            device=args.device,
            batch_chunks=args.batch_chunks,
            corrupt=args.corrupt,
            seed=args.seed,
            max_memory=max_memory,
        )
    except KVGroupsError as exc:
        raise in_option_terms(exc, {}, OPTIONS, "--spec" if args.spec else "--model") from None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``kvgroups demo``."""
    parser = subparsers.add_parser(
        "demo",
        help="move a request's KV pages across runtimes and verify every byte",
        description=__doc__,
    )
    parser.add_argument(
        "--model",
        default=None,
        choices=sorted(MODELS),
        help="catalogue model shape (default: hybrid-demo)",
    )
    parser.add_argument(
        "--spec",
        default=None,
        type=shape_spec,
        help='a shape spec "(kv,NB,BS,NH,HS):dtype:layers;..." instead of --model',
    )
    parser.add_argument(
        "--layers", type=int_in(1, MAX_LAYERS), default=None, help="override the layer count"
    )
    parser.add_argument(
        "--chunks", type=int_in(1, MAX_CHUNKS), default=4, help="chunks in the request (default 4)"
    )
    parser.add_argument(
        "--num-blocks", type=int_in(1, 1 << 40), default=None, help="blocks per cache tensor"
    )
    parser.add_argument(
        "--store-backend",
        default=None,
        help="backend that stores (default: torch if installed, else numpy)",
    )
    parser.add_argument(
        "--load-backend",
        default=None,
        help="backend that loads (default: jax if installed, else numpy)",
    )
    parser.add_argument(
        "--device",
        default=None,
        help="device for both runtimes (default: GPU when available, else cpu)",
    )
    parser.add_argument(
        "--batch-chunks",
        type=int_in(1, MAX_CHUNKS),
        default=8,
        help="chunks per store/load call (default 8)",
    )
    parser.add_argument("--seed", type=int_in(0, (1 << 32) - 1), default=0)
    parser.add_argument(
        "--max-memory",
        type=float_in(0, open_low=True),
        default=None,
        metavar="GIB",
        help="refuse a run that needs more memory than this (default: the host memory available)",
    )
    parser.add_argument("--corrupt", action="store_true", help=argparse.SUPPRESS)
    parser.set_defaults(func=run)
    return parser
