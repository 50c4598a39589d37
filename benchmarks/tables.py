"""The performance tables of README.md and docs/PERFORMANCE.md, made from the records in
``benchmarks/results/`` (not a benchmark itself: it reads what the benchmarks wrote).

    python benchmarks/tables.py                 # every table, Markdown
    python benchmarks/tables.py headline        # one of them
    python benchmarks/tables.py --check README.md docs/PERFORMANCE.md

``--check`` exits 1 unless each table appears, as printed here, in one of the files named:
after new records land, run it, paste what changed, and the docs cannot drift from the records.
Every cell is a fraction of the measured bound named in its row (the same run's device copy
or pinned host copy of the same bytes), store / load where both were measured; "-" where no
record exists.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Iterable

RESULTS = Path(__file__).resolve().parent / "results"
CHUNKS = (1, 4, 16, 64)


def records(name: str) -> list[dict]:
    with open(RESULTS / name) as f:
        return [json.loads(line) for line in f if line.strip()]


def find(rows: Iterable[dict], **want) -> dict | None:
    """The first record whose fields equal ``want`` (a callable value is a predicate)."""
    for r in rows:
        if all(v(r.get(k)) if callable(v) else r.get(k) == v for k, v in want.items()):
            return r
    return None


def frac(r: dict | None, key: str = "frac_of_ceiling") -> str:
    return "-" if r is None or r.get(key) is None else f"{r[key]:.2f}"


def pair(get: Callable[[str], dict | None], key: str = "frac_of_ceiling") -> str:
    store, load = get("store"), get("load")
    if store is None and load is None:
        return "-"
    if load is None:
        return frac(store, key)
    return f"{frac(store, key)} / {frac(load, key)}"


def baseline(r: dict | None) -> dict | None:
    """The plain path's fraction of the same ceiling, from a record that carries both."""
    if r is None or not r.get("baseline_gbps"):
        return None
    return {"frac_of_ceiling": r["baseline_gbps"] / r["ceiling_gbps"]}


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def headline() -> str:
    """README: store / load at 1-64 chunks, both runtimes, device and pinned host objects."""
    torch = records("torch_engine_h200.jsonl")
    parity = records("parity_h200.jsonl")
    engine = [
        r
        for r in records("engine_h200.jsonl")
        if r.get("record") == "transfer" and r.get("page_bytes") == 32768 and r.get("layers") == 32
    ]

    def row(label, bound, get):
        return [label, bound] + [pair(lambda d, c=c: get(c, d)) for c in CHUNKS]

    rows = [
        row(
            "torch `prepare(...).store` / `.load`, CUDA ids",
            "device copy",
            lambda c, d: find(torch, call="prepared", ids="device", chunks=c, direction=d),
        ),
        row(
            "JAX, public calls inside `jax.jit`, traced ids",
            "device copy",
            lambda c, d: find(parity, run=1, runtime="jax", path="auto", chunks=c, direction=d),
        ),
        row(
            "torch prepared, objects in pinned host memory",
            "host link",
            lambda c, d: find(
                engine,
                backend="torch",
                path="cuda-staged",
                call="prepared",
                ids="device",
                placement="pinned",
                chunks=c,
                direction=d,
            ),
        ),
        row(
            "JAX prepared, objects in pinned host memory",
            "host link",
            lambda c, d: find(
                engine,
                backend="jax",
                default_path=True,
                call="prepared",
                placement="pinned",
                chunks=c,
                direction=d,
            ),
        ),
        row(
            "plain torch: `index_select` / `index_copy_`",
            "device copy",
            lambda c, d: baseline(
                find(
                    engine,
                    backend="torch",
                    path="cuda",
                    call="prepared",
                    ids="device",
                    placement="device",
                    chunks=c,
                    direction=d,
                )
            ),
        ),
        row(
            "plain XLA: `take` / `.at[].set`",
            "device copy",
            lambda c, d: baseline(
                find(
                    engine,
                    backend="jax",
                    default_path=True,
                    call="prepared",
                    placement="device",
                    chunks=c,
                    direction=d,
                )
            ),
        ),
    ]
    return table(["call", "of the", "1 chunk", "4 chunks", "16 chunks", "64 chunks"], rows)


def torch_calls() -> str:
    """PERFORMANCE: every torch call an engine makes, against the device copy."""
    rs = records("torch_engine_h200.jsonl")

    def row(label, **want):
        return [label] + [
            pair(lambda d, c=c: find(rs, chunks=c, direction=d, **want)) for c in CHUNKS
        ]

    return table(
        ["call (device objects)", "1 chunk", "4 chunks", "16 chunks", "64 chunks"],
        [
            row("`prepare(...).store` / `.load`, CUDA ids", call="prepared", ids="device"),
            row("`prepare(...).store` / `.load`, NumPy ids", call="prepared", ids="host"),
            row(
                "one-shot `store(...)` / `load(...)`, CUDA ids",
                call=lambda v: v in ("store", "load"),
            ),
            row(
                "prepared store replayed from a CUDA graph", call="graph", new_ids_each_replay=None
            ),
            row(
                "the same, new ids copied in before each replay",
                call="graph",
                new_ids_each_replay=True,
            ),
            row("`torch.compile(fullgraph=True)` step calling the prepared store", call="compile"),
        ],
    )


def torch_layerwise() -> str:
    """PERFORMANCE: 32 one-layer calls of a 16-chunk transfer against the whole-model call."""
    rs = records("torch_engine_h200.jsonl")
    rows = []
    for label, want in (
        ("eager, CUDA ids", dict(ids="device", graph=None)),
        ("eager, NumPy ids", dict(ids="host", graph=None)),
        ("captured in one CUDA graph", dict(ids="device", graph=True)),
    ):
        get = lambda d, w=want: find(rs, call="layerwise", direction=d, **w)  # noqa: E731
        rows.append([label, pair(get, "frac_of_whole"), pair(get)])
    return table(
        ["32 `layers=[l]` calls, store / load", "of the whole-model call", "of the device copy"],
        rows,
    )


def jax_step() -> str:
    """PERFORMANCE: the jitted engine step (load, compute, store), device time."""
    rs = records("jax_engine_h200.jsonl")
    one = [r for r in rs if r.get("run") == 1]
    weights = [r for r in rs if r.get("run") == 2]

    def row(label, group, key, **want):
        return [label] + [frac(find(group, chunks=c, **want), key) for c in CHUNKS]

    return table(
        ["JAX (tpu-inference pages, 64 KiB)", "1 chunk", "4 chunks", "16 chunks", "64 chunks"],
        [
            row(
                "step's device-time growth, traced ids",
                one,
                "frac_of_ceiling_step_device",
                call="jit",
                ids="device",
            ),
            row("the same, NumPy ids", one, "frac_of_ceiling_step_device", call="jit", ids="host"),
            row(
                "the same step streaming 1 GiB of weights",
                weights,
                "frac_of_ceiling_step_device",
                call="jit",
                ids="device",
            ),
            row(
                "the transfer's two kernels alone",
                one,
                "frac_of_ceiling_device",
                call="jit",
                ids="device",
            ),
            row(
                "eager `store(manager, caches, ids)` (creates its objects)",
                one,
                "frac_of_ceiling",
                call="store",
                path="default",
            ),
        ],
    )


def small_pages() -> str:
    """PERFORMANCE: JAX pages of 512 B - 4 KiB, 256 chunks."""
    rs = [r for r in records("jax_small_pages_h200.jsonl") if r.get("record") == "transfer"]
    rows = []
    for page in (512, 1024, 2048, 4096):
        rows.append(
            [f"{page} B" if page < 1024 else f"{page // 1024} KiB"]
            + [
                pair(lambda d, pg=page, call=call: find(rs, page_bytes=pg, call=call, direction=d))
                for call in ("jit", "prepared")
            ]
        )
    return table(["page", "inside `jax.jit`, traced ids", "prepared, NumPy ids"], rows)


def paths() -> str:
    """PERFORMANCE: ``path="kernel"`` against ``path="copy_engine"`` by page size."""
    rs = [
        r
        for r in records("torch_copy_paths_h200.jsonl")
        if r.get("chunks") == 64 and not r.get("skipped")
    ]
    rows = []
    for page in sorted({r["page_bytes"] for r in rs}):
        rows.append(
            [f"{page // 1024} KiB"]
            + [
                pair(
                    lambda d, pg=page, p=path, pl=placement: find(
                        rs, page_bytes=pg, path=p, placement=pl, direction=d
                    )
                )
                for placement in ("device", "pinned")
                for path in ("kernel", "copy_engine")
            ]
        )
    return table(
        ["page", "device: kernel", "device: copy engine", "pinned: kernel", "pinned: copy engine"],
        rows,
    )


def connector() -> str:
    """PERFORMANCE: KVGroupsConnector's save and load into pinned host entries."""
    rs = records("vllm_connector_h200.jsonl")
    chunks = sorted({r["chunks"] for r in rs})
    return table(
        ["HostChunkStore call"] + [f"{c} chunk{'s' * (c > 1)}" for c in chunks],
        [
            [label] + [frac(find(rs, call=call, chunks=c)) for c in chunks]
            for label, call in (
                ("whole-model save", "store"),
                ("whole-model load", "load"),
                ("32 per-layer saves", "layerwise"),
            )
        ],
    )


def manager() -> str:
    """PERFORMANCE: manager construction (host CPU), milliseconds."""
    rs = records("manager_h200.jsonl")
    layers = sorted({r["layers"] for r in rs})
    return table(
        ["input"] + [f"{n} layers" for n in layers],
        [
            [kind] + [f"{find(rs, input=kind, layers=n)['median_ms']:.1f} ms" for n in layers]
            for kind in ("specs", "numpy")
        ],
    )


TABLES = {
    "headline": headline,
    "torch_calls": torch_calls,
    "torch_layerwise": torch_layerwise,
    "jax_step": jax_step,
    "small_pages": small_pages,
    "paths": paths,
    "connector": connector,
    "manager": manager,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "names", nargs="*", choices=[[], *TABLES], default=[], help="tables to print (default all)"
    )
    p.add_argument(
        "--check",
        nargs="+",
        type=Path,
        metavar="DOC",
        help="exit 1 unless every table appears verbatim in one of these files",
    )
    args = p.parse_args(argv)
    names = args.names or list(TABLES)
    if args.check:
        text = "\n".join(file.read_text() for file in args.check)
        stale = [name for name in names if TABLES[name]() not in text]
        for name in stale:
            print(
                f"tables.py: table {name!r} is not in {', '.join(map(str, args.check))} "
                f"as the records give it:\n{TABLES[name]()}\n",
                file=sys.stderr,
            )
        return 1 if stale else 0
    for name in names:
        print(f"<!-- {name} -->\n{TABLES[name]()}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
