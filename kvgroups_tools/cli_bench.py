"""``kvgroups bench``: transfer bandwidth of every path against measured ceilings and baselines.

Every ``transfer`` record says what a user called: ``call`` (``store`` / ``load``: the
one-shot calls; ``prepared``; ``jit``: inside ``jax.jit`` with traced ids; ``graph``: a CUDA-graph
replay of a prepared call; ``layerwise``: ``layers=[l]`` per layer, summed; ``internal``: the
engine's own entry points), ``ids`` (``host`` / ``device``), ``runtime``, ``path``,
``direction``, ``placement``, ``chunks``, ``page_bytes``, ``gbps``, ``median_ms`` and
``frac_of_ceiling`` (the same run's copy of the same bytes over the call's time). Device ids a
runtime reads to the host (CPU tensors, concrete JAX arrays) are refused as ``skipped``.
``--matrix engine`` is the public-call grid for one GPU (benchmarks/results/README.md).

Runs a case matrix (``--matrix tiny | headline | full | engine``, or shapes given with ``--models``
/
``--spec``) on the selected runtimes and prints one JSON record per line (also appended to
``--out``): ``ceiling`` records (device copy, pinned host copies), one ``transfer`` record per
(backend, path, direction, placement, shape, chunks) with the median time, GB/s (bytes read +
written), the fraction of the ceiling and the speedup over the runtime's plain baseline, then
``manager`` records and ``summary`` records for the headline case (torch vs JAX kernels). A path
that fails is an ``error`` record; the run goes on.

Backends: ``numpy``, ``torch``, ``jax`` (GPU when present), ``torch-cpu``, ``jax-cpu``,
``torch-cuda``, ``jax-cuda``; ``auto`` = every installed runtime (plus numpy for ``tiny``).
Paths: torch ``cuda``, ``cuda-staged``, ``index`` (index_select / index_copy_); JAX
``pallas-triton``, ``pallas-mosaic``, ``xla``, ``interpret``; NumPy ``reference``, ``take``.

``--summarize FILE...`` only reads records (e.g. of separate torch and JAX runs) and prints
the summary records; with ``--markdown`` the headline tables and the public-call table (call /
ids / path / page / chunks: GB/s, fraction of the copy, host-bound), with ``--markdown --sweeps
chunks,page,layers,models`` a table per sweep (device objects).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from kvgroups_core.errors import KVGroupsValueError

from . import bench_matrix
from .bench import GPU_PATHS, KIT_MODULES, KIT_PATHS, BenchRun
from .bench_matrix import memory_needed
from .bench_report import (
    SWEEP_TABLES,
    format_summary,
    markdown_table,
    public_table,
    summarize,
    sweep_tables,
)
from .catalog import MODELS
from .cli_options import (
    MAX_CHUNKS,
    MAX_LAYERS,
    MAX_TOKENS,
    float_in,
    int_in,
    int_list_in,
    memory_limit,
    names_in,
    out_file,
    refuse,
    refuse_over_memory,
    shape_spec,
)
from .progress import Progress, show_library_logs


def _list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def auto_backends(matrix: str) -> list[str]:
    """Each runtime whose framework and backend package are importable, plus NumPy for the
    tiny matrix (its oracle addresses every byte on its own: seconds per GB)."""
    out = ["numpy"] if matrix == "tiny" else []
    for name in ("torch", "jax"):
        if importlib.util.find_spec(name) and importlib.util.find_spec(f"kvgroups_{name}"):
            out.append(name)
    return out


def build_matrix(args: argparse.Namespace) -> bench_matrix.Matrix:
    matrix = bench_matrix.preset(args.matrix)
    if args.models or args.spec or args.layers or args.chunks:
        matrix = bench_matrix.custom(
            matrix,
            models=args.models,
            specs=args.spec,
            layers=args.layers,
            chunks=args.chunks,
            placements=args.placements,
        )
    if args.sweeps is not None:
        matrix = bench_matrix.select(matrix, args.sweeps)
    changes: dict[str, Any] = {}
    for name in ("repeats", "warmup", "max_calls", "chunk_tokens"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.target_ms is not None:
        changes["target_s"] = args.target_ms / 1e3
    if args.verify_mb is not None:
        changes["verify_bytes"] = int(args.verify_mb * (1 << 20))
    if args.manager_layers is not None:
        changes["manager_layers"] = tuple(args.manager_layers)
        changes["manager_models"] = matrix.manager_models or ("llama3-8b",)
    return replace(matrix, **changes)


def read_records(files: list[Path], option: str = "summarize") -> list[dict]:
    """The JSON records of ``files``; a file that is missing or not JSON lines is a typed
    error naming the option and the file."""
    records = []
    for file in files:
        try:
            text = file.read_text()
        except OSError as exc:
            raise KVGroupsValueError(
                f"{option}: expected a readable JSON-lines file, got {str(file)!r} "
                f"({exc.strerror or type(exc).__name__})"
            ) from None
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise KVGroupsValueError(
                    f"{option}: expected one JSON object per line, got {str(file)!r} line "
                    f"{number}: {exc.msg}"
                ) from None
            if not isinstance(record, dict) or "record" not in record:
                raise KVGroupsValueError(
                    f"{option}: expected bench records (objects with a 'record' field), got "
                    f"{str(file)!r} line {number}: {line[:60]!r}"
                )
            records.append(record)
    return records


def check_backends(items: list[str]) -> None:
    """Refuse names no kit exists for (``torch``, ``jax-cpu``, ... ): a typo is not a missing
    runtime."""
    if not items:
        raise KVGroupsValueError("backends: expected at least one name, got none")
    for item in items:
        name, _, device = item.partition("-")
        if (
            name not in KIT_MODULES
            or device not in ("", "cpu", "cuda", "gpu")
            and not device.startswith("cuda:")
        ):
            raise KVGroupsValueError(
                f"backends: expected names from {sorted(KIT_MODULES)} (optionally -cpu / "
                f"-cuda[:N]) or 'auto', got {item!r}"
            )


def _backends_arg(text: str) -> list[str]:
    items = _list(text)
    if items == ["auto"]:
        return items
    try:
        check_backends(items)
    except KVGroupsValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("backends: ")) from None
    return items


def _on_gpu(item: str) -> bool:
    """Whether a runtime named on the command line may run on a GPU, decided without importing
    it: NumPy and ``-cpu`` never do. The others are given the benefit of the doubt (only
    their kit knows); if nothing of the run applies there, the run ends with status 1,
    "nothing was measured"."""
    name, _, device = item.partition("-")
    return name != "numpy" and device != "cpu"


def check_run(args: argparse.Namespace, backends: list[str]) -> None:
    """What the options ask for must be measurable with these runtimes, and fit in memory:
    refused naming the option before any runtime is imported."""
    if args.markdown:
        refuse(
            "--markdown",
            "expected it with --summarize FILE... (it formats records; it "
            "measures nothing), got it alone",
        )
    gpu = any(_on_gpu(b) for b in backends)
    if args.placements and not gpu and "device" not in args.placements:
        refuse(
            "--placements",
            f"expected 'device' for host runtimes (pinned host objects "
            f"need CUDA), got {','.join(args.placements)} for {','.join(backends)}",
        )
    if args.paths:
        offered = {
            p
            for b in backends
            for p in KIT_PATHS[b.partition("-")[0]]
            if _on_gpu(b) or p not in GPU_PATHS
        }
        missing = [p for p in args.paths if p not in offered]
        if missing:
            refuse(
                "--paths",
                f"expected paths the runtimes {','.join(backends)} offer here "
                f"({', '.join(sorted(offered))}), got {', '.join(missing)}",
            )
    matrix = build_matrix(args)
    if not matrix.points and not matrix.manager_layers:
        refuse(
            "--sweeps",
            f"expected sweeps with points in the {args.matrix!r} matrix, got "
            f"{','.join(args.sweeps or [])}",
        )
    need, where = memory_needed(matrix)
    limit, what = memory_limit(args.max_memory, available=False)
    refuse_over_memory("--chunks, --models, --spec, --layers", need, where, limit, what)


def run(args: argparse.Namespace) -> int:
    # Inputs first: a bad name or an unreadable file is refused before anything is written.
    raw = read_records(args.summarize) if args.summarize else None
    backends = auto_backends(args.matrix) if args.backends == ["auto"] else args.backends
    if not args.summarize and args.backends == ["auto"] and not backends:
        raise KVGroupsValueError(
            f"backends: expected an installed runtime for 'auto' on the {args.matrix!r} "
            "matrix (torch or jax with its kvgroups backend), got none; name one, e.g. "
            "--backends numpy"
        )
    if args.backends != ["auto"]:
        check_backends(backends)
    if raw is None:
        check_run(args, backends)
    elif args.sweeps and not args.markdown:
        refuse("--sweeps", "expected it with --markdown when summarizing, got it alone")
    done = read_records(args.resume, "resume") if args.resume else ()
    out: TextIO | None = None
    if args.out is not None:
        out = open(args.out, "a")  # its directory exists (checked while parsing)

    def emit(record: dict) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        if out is not None:
            out.write(line + "\n")
            out.flush()

    def log(text: str) -> None:
        if not args.quiet:
            print(text, file=sys.stderr, flush=True)

    try:
        if raw is not None:
            records = summarize(raw)
            if args.markdown and args.sweeps:
                print(sweep_tables(raw, [s for s in args.sweeps if s in SWEEP_TABLES]))
            elif args.markdown:
                tables = [t for t in (markdown_table(records), public_table(raw)) if t]
                print("\n\n".join(tables))
            else:
                for record in records:
                    emit(record)
        else:
            show_library_logs(args.quiet)  # e.g. a kernel's first compile
            with Progress("kvgroups bench", quiet=args.quiet) as progress:
                runner = BenchRun(
                    build_matrix(args),
                    emit,
                    paths=args.paths,
                    directions=args.directions,
                    placements=args.placements,
                    budget_s=args.budget_s,
                    seed=args.seed,
                    log=progress.step,
                    done=done,
                )
                records = runner.run(backends)
    finally:
        if out is not None:
            out.close()
    for r in records:
        if r["record"] == "summary":
            log(format_summary(r))
    errors = [r for r in records if r["record"] == "error"]
    if errors:
        log(
            f"{len(errors)} error record(s): "
            + "; ".join(
                f"{r.get('backend')} {r.get('path', r.get('stage'))}: {r['error_type']}"
                for r in errors[:8]
            )
        )
    bad = [r for r in records if r.get("verified") is False]
    # A runtime that was asked for by name but could not be loaded fails the run (the
    # others still ran and are recorded).
    missing = [
        r["backend"] for r in records if r["record"] == "error" and r.get("stage") == "load kit"
    ]
    if missing:  # an error, so said even with --quiet
        print(
            f"kvgroups bench: requested backend(s) not available: {', '.join(missing)}",
            file=sys.stderr,
        )
    measured = (
        raw is not None
        or args.resume
        or any(r["record"] in ("transfer", "manager") for r in records)
    )
    if not measured:  # everything skipped: a run that proves nothing is not a pass
        skipped = sorted({str(r.get("reason")) for r in records if r["record"] == "skipped"})
        limits = " ".join(
            f"--{name} {','.join(getattr(args, name))}"
            for name in ("placements", "paths")
            if getattr(args, name)
        )
        why = "; ".join(skipped) or (
            f"no point of the {args.matrix!r} matrix applies to "
            f"{','.join(backends)} here" + (f" with {limits}" if limits else "")
        )
        print(f"kvgroups bench: error: nothing was measured (skipped: {why})", file=sys.stderr)
    return 1 if bad or missing or not measured else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``kvgroups bench`` (shared with ``benchmarks/bench_transfer.py``)."""
    a = parser.add_argument
    a(
        "--matrix",
        default="headline",
        choices=sorted(bench_matrix.PRESETS),
        help="case preset (default headline)",
    )
    a(
        "--backends",
        type=_backends_arg,
        default=["auto"],
        help="comma-separated: numpy, torch, jax, torch-cpu, jax-cpu, ... (default auto: the "
        "installed runtimes, plus numpy for the tiny matrix)",
    )
    paths = sorted({p for names in KIT_PATHS.values() for p in names})
    a(
        "--paths",
        type=names_in(paths, "paths"),
        default=None,
        help="paths to run (default: each runtime's own)",
    )
    a("--directions", type=names_in(("store", "load"), "directions"), default=["store", "load"])
    a(
        "--placements",
        type=names_in(("device", "pinned"), "placements"),
        default=None,
        help="device, pinned (default: the matrix's)",
    )
    a(
        "--sweeps",
        type=names_in(bench_matrix.SWEEPS, "sweeps"),
        default=None,
        help=f"only these parts of the matrix: {', '.join(bench_matrix.SWEEPS)}",
    )
    a(
        "--models",
        type=names_in(sorted(MODELS), "models"),
        default=None,
        help="catalogue models (replaces the matrix shapes)",
    )
    a(
        "--spec",
        action="append",
        type=shape_spec,
        default=None,
        help='shape spec "(kv,NB,BS,NH,HS):dtype:layers;..." (repeatable; NB is a minimum)',
    )
    a("--layers", type=int_list_in(1, MAX_LAYERS), default=None, help="layer counts for --models")
    a("--chunks", type=int_list_in(1, MAX_CHUNKS), default=None, help="chunk counts (default 64)")
    a(
        "--chunk-tokens",
        type=int_in(1, MAX_TOKENS),
        default=None,
        help="tokens per chunk (default 256)",
    )
    a(
        "--repeats",
        type=int_in(1, 1 << 20),
        default=None,
        help="timed repeats per case (median taken)",
    )
    a("--warmup", type=int_in(0, 1 << 20), default=None, help="untimed calls first")
    a("--target-ms", type=float_in(0), default=None, help="batch calls so a repeat lasts this long")
    a(
        "--max-calls",
        type=int_in(1, 1 << 20),
        default=None,
        help="most back-to-back calls per repeat",
    )
    a(
        "--verify-mb",
        type=float_in(0),
        default=None,
        help="check bytes against the baseline up to this payload size",
    )
    a(
        "--manager-layers",
        type=int_list_in(1, MAX_LAYERS),
        default=None,
        help="manager construction sweep",
    )
    a(
        "--budget-s",
        type=float_in(0, open_low=True),
        default=None,
        help="skip what is left after this many seconds",
    )
    a("--seed", type=int_in(0, (1 << 32) - 1), default=0)
    a(
        "--max-memory",
        type=float_in(0, open_low=True),
        default=None,
        metavar="GIB",
        help="refuse a matrix whose largest shape needs more memory than this (default: the "
        "host's memory)",
    )
    a(
        "--resume",
        type=Path,
        nargs="+",
        default=None,
        metavar="FILE",
        help="skip every path and direction of a point that these JSON-lines files already "
        "hold a transfer record for (finish a run a time limit cut)",
    )
    a(
        "--out",
        type=out_file,
        default=None,
        help="also append the JSON lines to this file (in an existing directory)",
    )
    a(
        "--summarize",
        type=Path,
        nargs="+",
        default=None,
        metavar="FILE",
        help="only summarize the records of these JSON-lines files",
    )
    a("--markdown", action="store_true", help="with --summarize: print a Markdown table")
    a("--quiet", action="store_true", help="no progress lines on stderr")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``kvgroups bench``."""
    parser = subparsers.add_parser(
        "bench",
        help="transfer bandwidth against the hardware ceiling and plain baselines",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser
