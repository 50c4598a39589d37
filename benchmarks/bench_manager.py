"""Benchmark: KVLayerGroupsManager construction time versus layer count (CPU only).

The manager is built once per engine registration, but engines with many layers (and tests
that build many managers) should not wait on it: the goal is well under 50 ms for a
1,024-layer model with mixed groups. The model is Gemma-3-like (5 sliding-window layers : 1
full-attention layer, window 1,024) with an MLA-like latent cache every 8th layer, each kind
in its own engine group, so construction exercises three kernel groups, two object groups and
engine group infos.

Baseline: ``kvgroups_core.describe`` over every layer (reading each layer's descriptor, the
least any manager does), timed on the same inputs.

Usage::

    python benchmarks/bench_manager.py --out manager_h200.jsonl

Prints one JSON object per (input kind, layer count) and appends the same lines to ``--out``.
Exits 1 when the largest model's median exceeds ``--budget-ms``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from kvgroups_core import (
    EngineGroupInfo,
    EngineKVFormat,
    KVLayerGroupsManager,
    TensorSpec,
    describe,
)

NHD = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
MLA = EngineKVFormat.NL_X_NB_BS_HS
FULL, SLIDING, LATENT = 0, 1, 2


def layer_kinds(num_layers: int) -> list[int]:
    """Gemma-3-like 5 sliding : 1 full, with an MLA-like latent layer every 8th layer."""
    return [LATENT if i % 8 == 7 else FULL if i % 6 == 5 else SLIDING for i in range(num_layers)]


def build_inputs(num_layers: int, kind: str) -> tuple[list, list, list[EngineGroupInfo]]:
    """``(kv_caches, formats, infos)``; every layer gets its own tensor object, as engines
    register them. ``specs``: TensorSpecs of real sizes; ``numpy``: small real arrays."""
    kinds = layer_kinds(num_layers)
    caches: list = []
    for k in kinds:
        if kind == "specs":
            shape = (4096, 64, 576) if k == LATENT else (2, 4096, 16, 16, 128)
            caches.append(TensorSpec(shape, "bfloat16"))
        else:
            shape = (2, 64, 64) if k == LATENT else (2, 2, 16, 2, 64)
            caches.append(np.zeros(shape, np.float16))
    formats = [MLA if k == LATENT else NHD for k in kinds]
    order = sorted(set(kinds), key=kinds.index)  # kernel groups come in first-layer order
    infos = [
        EngineGroupInfo(
            engine_group_id=k,
            layer_indices=tuple(i for i, kk in enumerate(kinds) if kk == k),
            sw_size_tokens=1024 if k == SLIDING else -1,
        )
        for k in order
    ]
    return caches, formats, infos


def time_ms(fn, repeats: int) -> list[float]:
    fn()  # warm caches (backend lookup, imports)
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def measure(num_layers: int, kind: str, repeats: int, budget_ms: float) -> dict:
    caches, formats, infos = build_inputs(num_layers, kind)
    manager = KVLayerGroupsManager(caches, formats, infos)
    times = time_ms(lambda: KVLayerGroupsManager(caches, formats, infos), repeats)
    base = time_ms(lambda: [describe(c) for c in caches], repeats)
    q = statistics.quantiles(times, n=10)
    median = statistics.median(times)
    return {
        "bench": "manager_construction",
        "call": "KVLayerGroupsManager",
        "model": "gemma3-like-5:1+mla",
        "input": kind,
        "layers": num_layers,
        "kernel_groups": manager.num_kernel_groups,
        "object_groups": manager.num_object_groups,
        "repeats": repeats,
        "median_ms": round(median, 3),
        "p10_ms": round(q[0], 3),
        "p90_ms": round(q[-1], 3),
        "min_ms": round(min(times), 3),
        "us_per_layer": round(median * 1e3 / num_layers, 2),
        "baseline_describe_median_ms": round(statistics.median(base), 3),
        "budget_ms": budget_ms,
        "within_budget": median < budget_ms,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cpu": platform.processor() or platform.machine(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--layers",
        type=lambda s: [int(v) for v in s.split(",")],
        default=[32, 64, 128, 256, 512, 1024],
        help="comma-separated layer counts (default 32,...,1024)",
    )
    parser.add_argument(
        "--inputs",
        default="specs,numpy",
        help="comma-separated input kinds: specs, numpy (default both)",
    )
    parser.add_argument("--repeats", type=int, default=21, help="timed runs per point")
    parser.add_argument(
        "--budget-ms",
        type=float,
        default=50.0,
        help="construction budget for the largest model (default 50 ms)",
    )
    parser.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a seconds-long smoke run (32 and 64 layers, 3 repeats; CI)",
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.layers, args.repeats = [32, 64], 3

    rows = []
    for kind in args.inputs.split(","):
        for n in args.layers:
            row = measure(n, kind, args.repeats, args.budget_ms)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out is not None:
        with open(args.out, "a") as out:
            out.write("".join(json.dumps(r) + "\n" for r in rows))
    largest = max(args.layers)
    over = [r for r in rows if r["layers"] == largest and not r["within_budget"]]
    for r in over:
        print(
            f"over budget: {r['input']} {r['layers']} layers: {r['median_ms']} ms "
            f"> {r['budget_ms']} ms",
            file=sys.stderr,
        )
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
