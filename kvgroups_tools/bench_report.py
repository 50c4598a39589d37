"""Summaries of ``kvgroups bench`` records: the headline case per placement and direction,
and Markdown tables of the sweeps.

:func:`summarize` works on records of one run or of several (separate torch and JAX processes
writing one file), so the torch-versus-JAX ratio can be taken across processes.
"""

from __future__ import annotations

from typing import Sequence


def _kernels(rows: list[dict], backend: str) -> list[dict]:
    """A runtime's kernel paths, or its default path where it has no kernel (CPU)."""
    own = [r for r in rows if r["backend"] == backend]
    return [r for r in own if r["path_kind"] == "kernel"] or [
        r for r in own if r.get("default_path")
    ]


def is_internal(record: dict) -> bool:
    """Records of the engine's own entry points (older records have no ``call``)."""
    return record.get("call", "internal") == "internal"


def _size(nbytes: int) -> str:
    return f"{nbytes >> 10} KiB" if nbytes >= 1024 and nbytes % 1024 == 0 else f"{nbytes} B"


#: Row order of the public-call table.
CALL_ORDER = ("store", "load", "prepared", "jit", "graph", "layerwise", "internal")


def public_table(records: Sequence[dict]) -> str:
    """A Markdown table of the public-call records, one row per (runtime, device, call, ids,
    path, placement, direction, page, chunks), the last record of each winning: GB/s, the
    fraction of the same run's copy of the same bytes, and whether the host was the bound
    (dispatch took at least 0.9 of the call: the device waited on the host)."""
    latest: dict[tuple, dict] = {}
    for r in records:
        if r.get("record") in ("transfer", "skipped") and not is_internal(r) and "call" in r:
            key = (
                r.get("backend"),
                r.get("device"),
                CALL_ORDER.index(r["call"]) if r["call"] in CALL_ORDER else 99,
                r["call"],
                r.get("ids"),
                r.get("path"),
                r.get("placement"),
                r.get("direction"),
                r.get("page_bytes") or 0,
                r.get("chunks") or 0,
            )
            latest[key] = r
    if not latest:
        return ""
    lines = [
        "| runtime | call | ids | path | objects | direction | page | chunks | GB/s "
        "| of copy | host-bound |",
        "|" + "---|" * 11,
    ]
    for key in sorted(latest, key=lambda k: tuple("" if v is None else v for v in k)):
        r = latest[key]
        where = f"{r.get('backend')}-{r.get('device')}"
        head = [
            where,
            r["call"],
            str(r.get("ids")),
            str(r.get("path")),
            str(r.get("placement")),
            str(r.get("direction")),
            _size(r.get("page_bytes") or 0),
            str(r.get("chunks")),
        ]
        if r["record"] == "skipped":
            lines.append("| " + " | ".join(head + ["-", "-", f"skipped: {r.get('reason')}"]) + " |")
            continue
        frac = r.get("frac_of_ceiling")
        bound = "yes" if r.get("host_bound") else "no"
        if r.get("verified") is False:
            bound += " (bytes WRONG)"
        lines.append(
            "| "
            + " | ".join(head + [f"{r['gbps']:.1f}", "-" if frac is None else f"{frac:.2f}", bound])
            + " |"
        )
    return "\n".join(lines)


def summarize(records: Sequence[dict]) -> list[dict]:
    """Summary records for the headline points: every path's bandwidth and fraction of its
    ceiling, and JAX's kernels as a ratio of torch's (``ratio`` = JAX GB/s / torch GB/s; on CPU
    the default paths stand in for kernels). The last record of each path wins."""
    latest: dict[tuple, dict] = {}
    for r in records:
        if r.get("record") == "transfer" and r.get("headline") and is_internal(r):
            dev = "cuda" if r["device"] in ("cuda", "gpu") else r["device"]
            latest[
                (
                    r["shape"],
                    r["layers"],
                    r["chunks"],
                    r["placement"],
                    r["direction"],
                    dev,
                    r["backend"],
                    r["path"],
                )
            ] = r
    out = []
    for key in sorted({k[:6] for k in latest}, key=str):
        rows = [r for k, r in latest.items() if k[:6] == key]
        shape, layers, chunks, placement, direction, device = key
        torch_k, jax_k = _kernels(rows, "torch"), _kernels(rows, "jax")
        pairs = [
            {
                "torch": t["path"],
                "jax": j["path"],
                "ratio": j["gbps"] / t["gbps"],
                "within_10pct": abs(j["gbps"] / t["gbps"] - 1) <= 0.10,
            }
            for t in torch_k
            for j in jax_k
        ]
        best = None
        if pairs:
            bt, bj = max(r["gbps"] for r in torch_k), max(r["gbps"] for r in jax_k)
            best = {"ratio": bj / bt, "within_10pct": abs(bj / bt - 1) <= 0.10}
        # Each runtime measures its own copy; the hardware bound is the fastest of them.
        hw = max((r["ceiling_gbps"] for r in rows if r.get("ceiling_gbps")), default=None)
        paths = []
        for r in sorted(rows, key=lambda r: (r["backend"], r["path"])):
            p = {
                k: r.get(k)
                for k in (
                    "backend",
                    "path",
                    "path_kind",
                    "gbps",
                    "link_gbps",
                    "ceiling",
                    "ceiling_gbps",
                    "frac_of_ceiling",
                    "speedup_vs_baseline",
                    "verified",
                )
            }
            p["frac_of_best_ceiling"] = r["gbps"] / hw if hw else None
            paths.append(p)
        out.append(
            {
                "record": "summary",
                "shape": shape,
                "layers": layers,
                "chunks": chunks,
                "placement": placement,
                "direction": direction,
                "device": device,
                "best_ceiling_gbps": hw,
                "paths": paths,
                "torch_vs_jax": pairs,
                "torch_vs_jax_best": best,
            }
        )
    return out


def format_summary(record: dict) -> str:
    """One summary record as a few readable lines."""
    lines = [
        f"{record['shape']} L{record['layers']} x{record['chunks']} chunks, "
        f"{record['placement']} objects, {record['direction']} ({record['device']}):"
    ]
    for p in record["paths"]:
        frac, best = p["frac_of_ceiling"], p["frac_of_best_ceiling"]
        speed = p["speedup_vs_baseline"]
        lines.append(
            f"  {p['backend']:>5} {p['path']:<14} {p['gbps']:9.1f} GB/s"
            + (f"  {frac:5.2f} of own {p['ceiling']}" if frac else "")
            + (f"  {best:5.2f} of best ({record['best_ceiling_gbps']:.0f})" if best else "")
            + (f"  {speed:5.2f}x baseline" if speed else "")
            + ("" if p["verified"] is None else f"  verified={p['verified']}")
        )
    for pair in record["torch_vs_jax"]:
        lines.append(
            f"  jax {pair['jax']} / torch {pair['torch']} = {pair['ratio']:.3f}"
            f" (within 10%: {pair['within_10pct']})"
        )
    return "\n".join(lines)


def markdown_table(summaries: Sequence[dict]) -> str:
    """The summary records as Markdown tables, one per headline case (the README's table)."""
    groups: dict[tuple, list[dict]] = {}
    for s in summaries:
        groups.setdefault((s["shape"], s["layers"], s["chunks"], s["device"]), []).append(s)
    parts = []
    for (shape, layers, chunks, device), group in groups.items():
        lines = [
            f"{shape}, {layers} layers, {chunks} chunks of 256 tokens ({device}); GB/s = "
            "bytes read + written per second",
            "",
            "| objects | direction | runtime | path | GB/s | of own ceiling "
            "| of best ceiling | vs baseline |",
            "|---|---|---|---|---:|---:|---:|---:|",
        ]
        ratios = []
        for s in group:
            for p in s["paths"]:
                cells = [
                    s["placement"],
                    s["direction"],
                    p["backend"],
                    p["path"],
                    f"{p['gbps']:,.0f}" if p["gbps"] >= 100 else f"{p['gbps']:.2f}",
                ]
                for key, fmt in (
                    ("frac_of_ceiling", "{:.2f}"),
                    ("frac_of_best_ceiling", "{:.2f}"),
                    ("speedup_vs_baseline", "{:.2f}x"),
                ):
                    cells.append(fmt.format(p[key]) if p.get(key) is not None else "-")
                lines.append("| " + " | ".join(cells) + " |")
            ratios += [
                f"- {s['direction']} ({s['placement']}): JAX {q['jax']} / torch "
                f"{q['torch']} = {q['ratio']:.2f}"
                for q in s["torch_vs_jax"]
            ]
        parts.append("\n".join(lines + ([""] + ratios if ratios else [])))
    return "\n\n".join(parts)


#: Sweep tables: (title, the record field that varies, how a row is labelled).
SWEEP_TABLES = {
    "chunks": ("chunks moved (Llama-3-8B-like, 32 layers)", "chunks"),
    "page": ("page size (bytes per block per plane; 32 layers, 64 chunks)", "page_bytes"),
    "layers": ("layers (Llama-3-8B-like, 64 chunks)", "layers"),
    "models": ("catalogue models (16 chunks)", "shape"),
}
#: Columns of a sweep table, in order: (backend, path); absent ones are left out.
SWEEP_COLUMNS = (
    ("torch", "cuda"),
    ("jax", "pallas-mosaic"),
    ("jax", "pallas-triton"),
    ("torch", "index"),
    ("jax", "xla"),
)


def _row_label(sweep: str, r: dict) -> str:
    if sweep == "page":
        kib = r["page_bytes"] / 1024
        return f"{kib:g} KiB"
    if sweep == "models":
        return f"{r['shape']} ({r['layers']} layers, {r['kernel_groups']} kernel groups)"
    return f"{r[SWEEP_TABLES[sweep][1]]:,}"


def _on(record: dict, device: str) -> bool:
    return ("cuda" if record.get("device") == "gpu" else record.get("device")) == device


def sweep_tables(records: Sequence[dict], sweeps: Sequence[str], device: str = "cuda") -> str:
    """Markdown tables of the device-object sweeps on ``device``: a row per sweep value, a
    column per (runtime, path) and direction, each cell ``GB/s (fraction of the best
    ceiling)``, the best ceiling being the fastest device copy of the same byte count that any
    runtime measured."""
    ceilings: dict[int, float] = {}
    for r in records:
        if r.get("record") == "ceiling" and r.get("ceiling") == "device_copy" and _on(r, device):
            ceilings[r["bytes"]] = max(ceilings.get(r["bytes"], 0.0), r["gbps"])
    parts = []
    for sweep in sweeps:
        title, field = SWEEP_TABLES[sweep]
        latest: dict[tuple, dict] = {}
        for r in records:
            if (
                r.get("record") == "transfer"
                and sweep in (r.get("sweeps") or ())
                and is_internal(r)
                and r.get("placement") == "device"
                and _on(r, device)
            ):
                latest[(r[field], r["shape"], r["backend"], r["path"], r["direction"])] = r
        if not latest:
            continue
        present = {k[2:4] for k in latest}
        order = [c for c in SWEEP_COLUMNS if c in present] + sorted(present - set(SWEEP_COLUMNS))
        columns = [
            (b, p, d)
            for b, p in order
            for d in ("store", "load")
            if any(k[2:] == (b, p, d) for k in latest)
        ]
        header = [
            "| "
            + sweep
            + " | "
            + " | ".join(f"{b} {p} {d}" for b, p, d in columns)
            + " | device copy |",
            "|---|" + "---:|" * (len(columns) + 1),
        ]
        rows = []
        for value, shape in sorted({k[:2] for k in latest}, key=lambda k: (str(type(k[0])), k)):
            cells, found = [], []
            for b, p, d in columns:
                r = latest.get((value, shape, b, p, d))
                if r is None:
                    cells.append("-")
                    continue
                found.append(r)
                best = ceilings.get(r["bytes"])
                cells.append(f"{r['gbps']:,.0f}" + (f" ({r['gbps'] / best:.2f})" if best else ""))
            stores = [r for r in found if r["direction"] == "store"] or found
            copy = ceilings.get(stores[0]["bytes"])
            rows.append(
                f"| {_row_label(sweep, found[0])} | "
                + " | ".join(cells)
                + (f" | {copy:,.0f} |" if copy else " | - |")
            )
        parts.append(
            "\n".join(
                [
                    f"Device objects vs {title}; GB/s (bytes read + written), in "
                    "brackets the fraction of the best device copy of the same "
                    "bytes (the last column, for the store's bytes; a load "
                    "behind a sliding window moves fewer)",
                    "",
                ]
                + header
                + rows
            )
        )
    return "\n\n".join(parts)
