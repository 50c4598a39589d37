"""Summaries of ``kvgroups bench`` records: the headline case per placement and direction.

:func:`summarize` works on records of one run or of several (separate torch and JAX processes
writing one file), so the torch-versus-JAX ratio can be taken across processes.
"""

from __future__ import annotations

from typing import Sequence


def _kernels(rows: list[dict], backend: str) -> list[dict]:
    """A runtime's kernel paths, or its default path where it has no kernel (CPU)."""
    own = [r for r in rows if r["backend"] == backend]
    return [r for r in own if r["path_kind"] == "kernel"] or \
        [r for r in own if r.get("default_path")]


def summarize(records: Sequence[dict]) -> list[dict]:
    """Summary records for the headline points: every path's bandwidth and fraction of its
    ceiling, and JAX's kernels as a ratio of torch's (``ratio`` = JAX GB/s / torch GB/s; on CPU
    the default paths stand in for kernels). The last record of each path wins."""
    latest: dict[tuple, dict] = {}
    for r in records:
        if r.get("record") == "transfer" and r.get("headline"):
            dev = "cuda" if r["device"] in ("cuda", "gpu") else r["device"]
            latest[(r["shape"], r["layers"], r["chunks"], r["placement"], r["direction"], dev,
                    r["backend"], r["path"])] = r
    out = []
    for key in sorted({k[:6] for k in latest}, key=str):
        rows = [r for k, r in latest.items() if k[:6] == key]
        shape, layers, chunks, placement, direction, device = key
        torch_k, jax_k = _kernels(rows, "torch"), _kernels(rows, "jax")
        pairs = [{"torch": t["path"], "jax": j["path"], "ratio": j["gbps"] / t["gbps"],
                  "within_10pct": abs(j["gbps"] / t["gbps"] - 1) <= 0.10}
                 for t in torch_k for j in jax_k]
        best = None
        if pairs:
            bt, bj = max(r["gbps"] for r in torch_k), max(r["gbps"] for r in jax_k)
            best = {"ratio": bj / bt, "within_10pct": abs(bj / bt - 1) <= 0.10}
        # Each runtime measures its own copy; the hardware bound is the fastest of them.
        hw = max((r["ceiling_gbps"] for r in rows if r.get("ceiling_gbps")), default=None)
        paths = []
        for r in sorted(rows, key=lambda r: (r["backend"], r["path"])):
            p = {k: r.get(k) for k in ("backend", "path", "path_kind", "gbps", "link_gbps",
                                       "ceiling", "ceiling_gbps", "frac_of_ceiling",
                                       "speedup_vs_baseline", "verified")}
            p["frac_of_best_ceiling"] = r["gbps"] / hw if hw else None
            paths.append(p)
        out.append({
            "record": "summary", "shape": shape, "layers": layers, "chunks": chunks,
            "placement": placement, "direction": direction, "device": device,
            "best_ceiling_gbps": hw, "paths": paths, "torch_vs_jax": pairs,
            "torch_vs_jax_best": best,
        })
    return out


def format_summary(record: dict) -> str:
    """One summary record as a few readable lines."""
    lines = [f"{record['shape']} L{record['layers']} x{record['chunks']} chunks, "
             f"{record['placement']} objects, {record['direction']} ({record['device']}):"]
    for p in record["paths"]:
        frac, best = p["frac_of_ceiling"], p["frac_of_best_ceiling"]
        speed = p["speedup_vs_baseline"]
        lines.append(f"  {p['backend']:>5} {p['path']:<14} {p['gbps']:9.1f} GB/s"
                     + (f"  {frac:5.2f} of own {p['ceiling']}" if frac else "")
                     + (f"  {best:5.2f} of best ({record['best_ceiling_gbps']:.0f})"
                        if best else "")
                     + (f"  {speed:5.2f}x baseline" if speed else "")
                     + ("" if p["verified"] is None else f"  verified={p['verified']}"))
    for pair in record["torch_vs_jax"]:
        lines.append(f"  jax {pair['jax']} / torch {pair['torch']} = {pair['ratio']:.3f}"
                     f" (within 10%: {pair['within_10pct']})")
    return "\n".join(lines)


def markdown_table(summaries: Sequence[dict]) -> str:
    """The summary records as Markdown tables, one per headline case (the README's table)."""
    groups: dict[tuple, list[dict]] = {}
    for s in summaries:
        groups.setdefault((s["shape"], s["layers"], s["chunks"], s["device"]), []).append(s)
    parts = []
    for (shape, layers, chunks, device), group in groups.items():
        lines = [f"{shape}, {layers} layers, {chunks} chunks of 256 tokens ({device}); GB/s = "
                 "bytes read + written per second", "",
                 "| objects | direction | runtime | path | GB/s | of own ceiling "
                 "| of best ceiling | vs baseline |", "|---|---|---|---|---:|---:|---:|---:|"]
        ratios = []
        for s in group:
            for p in s["paths"]:
                cells = [s["placement"], s["direction"], p["backend"], p["path"],
                         f"{p['gbps']:,.0f}" if p["gbps"] >= 100 else f"{p['gbps']:.2f}"]
                for key, fmt in (("frac_of_ceiling", "{:.2f}"), ("frac_of_best_ceiling",
                                                                 "{:.2f}"),
                                 ("speedup_vs_baseline", "{:.2f}x")):
                    cells.append(fmt.format(p[key]) if p.get(key) is not None else "-")
                lines.append("| " + " | ".join(cells) + " |")
            ratios += [f"- {s['direction']} ({s['placement']}): JAX {q['jax']} / torch "
                       f"{q['torch']} = {q['ratio']:.2f}" for q in s["torch_vs_jax"]]
        parts.append("\n".join(lines + ([""] + ratios if ratios else [])))
    return "\n\n".join(parts)
