"""Plot ``kvgroups bench`` records: bandwidth against chunks moved, page size and layer count,
with the measured ceilings drawn, plus pinned-host transfers and manager construction time.

    python benchmarks/plot_transfer.py benchmarks/results/transfer_h200.jsonl \
        --out benchmarks/results/transfer_h200.png

Reads one or more JSON-lines files (the last record of a case wins) and writes one PNG.
matplotlib is imported only here, when plotting (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

DIRECTION_STYLE = {"store": "-", "load": ":"}


def read(paths: list[Path]) -> list[dict]:
    latest: dict[tuple, dict] = {}
    order = 0
    for path in paths:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            if r.get("record") == "transfer":
                key = ("t", r["backend"], r["device"], r["path"], r["direction"], r["placement"],
                       r["shape"], r["layers"], r["chunks"])
            elif r.get("record") == "ceiling":
                key = ("c", r["backend"], r["device"], r["ceiling"], r["bytes"])
            elif r.get("record") == "manager":
                key = ("m", r["backend"], r.get("device"), r["model"], r["layers"])
            else:
                key = ("x", order)
            order += 1
            latest[key] = r
    return list(latest.values())


def _series(records: list[dict], x: str, y: str, keyf) -> dict[tuple, list[tuple]]:
    out: dict[tuple, list[tuple]] = defaultdict(list)
    for r in records:
        if r.get(y) is not None:
            out[keyf(r)].append((r[x], r[y]))
    return {k: sorted(v) for k, v in out.items()}


def _label(r: dict) -> str:
    dev = "" if r["device"] == "cuda" else f" ({r['device']})"
    return f"{r['backend']} {r['path']}{dev}"


def _tick(x: str, v: float) -> str:
    if x == "page_bytes":
        return f"{v / 1024:g}K"
    return f"{v:g}"


def _panel(ax, transfers: list[dict], x: str, colors: dict, *, y: str = "gbps",
           ceiling_scale: float = 1.0, title: str, xlabel: str) -> None:
    """Lines per (path, direction) and the ceilings (dashed, one per runtime and kind)."""
    lines = _series(transfers, x, y, lambda r: (_label(r), r["direction"]))
    for (label, direction), pts in sorted(lines.items()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], DIRECTION_STYLE[direction],
                marker="o", ms=3, color=colors.setdefault(label, f"C{len(colors) % 10}"),
                label=f"{label} {direction}")
    ceilings = _series(transfers, x, "ceiling_gbps",
                       lambda r: (f"{r['backend']} {r['ceiling']}", r["device"]))
    for (label, _), pts in sorted(ceilings.items()):
        pts = [(px, py * ceiling_scale) for px, py in pts]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "--", color="0.35", lw=1)
        ax.annotate(label, (pts[-1][0], pts[-1][1]), fontsize=6, color="0.35",
                    textcoords="offset points", xytext=(-4, 3), ha="right")
    ax.set_xscale("log", base=2)
    xs = sorted({r[x] for r in transfers})
    ax.set_xticks(xs, [_tick(x, v) for v in xs])
    ax.minorticks_off()
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel("GB/s (bytes read + written)" if y == "gbps" else "GB/s (payload)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, alpha=0.3)


def plot(records: list[dict], out: Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    transfers = [r for r in records if r.get("record") == "transfer"]
    dev = [r for r in transfers if r["placement"] == "device"]
    head = next((r for r in transfers if r.get("headline")), None)
    head_shape = head["shape"] if head else "llama3-8b"
    colors: dict[str, str] = {}
    fig, axes = plt.subplots(2, 3, figsize=(17, 10))
    chunks = [r for r in dev if "chunks" in r.get("sweeps", ()) and r["shape"] == head_shape]
    for ax, direction in zip(axes[0][:2], ("store", "load")):
        _panel(ax, [r for r in chunks if r["direction"] == direction], "chunks", colors,
               title=f"{direction}: {head_shape}, device objects, vs chunks moved",
               xlabel="chunks of 256 tokens")
    pinned = [r for r in transfers if r["placement"] == "pinned"]
    # Host links are quoted per direction: payload per second (ceilings likewise halved).
    _panel(axes[0][2], pinned, "chunks", colors, y="link_gbps", ceiling_scale=0.5,
           title="pinned host objects", xlabel="chunks of 256 tokens")
    page = [r for r in dev if "page" in r.get("sweeps", ())]
    _panel(axes[1][0], page, "page_bytes", colors, title="vs page size (bytes per block "
           "per plane), 64 chunks", xlabel="page bytes")
    layers = [r for r in dev if "layers" in r.get("sweeps", ())]
    _panel(axes[1][1], layers, "layers", colors, title="vs layers, 64 chunks", xlabel="layers")
    ax = axes[1][2]
    managers = [r for r in records if r.get("record") == "manager"]
    for (backend, model), pts in sorted(_series(
            managers, "layers", "median_s", lambda r: (r["backend"], r["model"])).items()):
        ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o", ms=3,
                label=f"{model} from {backend}")
    ax.set(xscale="log", yscale="log", xlabel="layers", ylabel="ms")
    ax.set_title("manager construction", fontsize=9)
    ax.grid(True, alpha=0.3)
    for a in axes.flat:
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=6, loc="best")
    meta = [r for r in records if r.get("record") == "meta" and r.get("device") == "cuda"]
    name = meta[0].get("device_name", "") if meta else ""
    fig.suptitle(title or f"kvgroups page transfers {name}".strip(), fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", type=Path, nargs="+", help="JSON-lines files from kvgroups bench")
    p.add_argument("--out", type=Path, default=None, help="PNG path (default: first input, .png)")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    out = args.out or args.inputs[0].with_suffix(".png")
    try:
        plot(read(args.inputs), out, args.title)
    except ImportError as exc:
        print(f"plot_transfer: matplotlib is needed ({exc}); pip install matplotlib",
              file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
