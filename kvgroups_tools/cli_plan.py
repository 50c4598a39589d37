"""``kvgroups plan``: show how a model described by a shape spec is grouped and stored.

For each kernel group: its layers and geometry and the bytes its region takes in one chunk
object (``kv_size * nl * slots * nh * hs * itemsize``, docs/SEMANTICS.md section 6); for each object
group: its kernel groups, its window and the bytes of one chunk object.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
from typing import Any

from kvgroups_core.errors import KVGroupsError
from kvgroups_core.grouping.manager import KVLayerGroupsManager
from kvgroups_core.grouping.shape_spec import (
    format_kvcache_shape_spec,
    manager_from_shape_spec,
    parse_kvcache_shape_spec,
)

from .cli_options import MAX_TOKENS, in_option_terms, int_in, int_list_in, refuse, shape_spec


def layer_ranges(layers: list[int]) -> str:
    """Compact ascending layer indices: ``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    parts: list[str] = []
    start = prev = None
    for layer in layers:
        if prev is not None and layer == prev + 1:
            prev = layer
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = layer
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def region_nbytes(manager: KVLayerGroupsManager, kernel_group_idx: int) -> int:
    """Bytes of one kernel group's region in one chunk object."""
    group = manager.kernel_groups[kernel_group_idx]
    sd = group.shape_desc
    slots = manager.get_slots_per_chunk_in_sw(kernel_group_idx)
    return sd.kv_size * sd.nl * slots * sd.nh * sd.hs * group.dtype.itemsize


def object_nbytes(manager: KVLayerGroupsManager, object_group_idx: int) -> int:
    """Bytes of one chunk object of an object group: ``kvgroups_core.transfer.objects`` when present
    (the layout every transfer uses), else the sum of its regions."""
    if importlib.util.find_spec("kvgroups_core.transfer.objects") is not None:
        objects = importlib.import_module("kvgroups_core.transfer.objects")
        return int(objects.object_nbytes(manager, object_group_idx))
    group = manager.object_groups[object_group_idx]
    return sum(region_nbytes(manager, k) for k in group.kernel_group_indices)


def plan_summary(manager: KVLayerGroupsManager) -> dict[str, Any]:
    """The plan of ``manager`` as plain JSON-ready data."""
    kernel_groups = []
    for k, group in enumerate(manager.kernel_groups):
        sd = group.shape_desc
        kernel_groups.append(
            {
                "index": k,
                "layers": layer_ranges(group.layer_indices),
                "num_layers": group.num_layers,
                "format": group.engine_kv_format.name if group.engine_kv_format else None,
                "kv_size": sd.kv_size,
                "nb": sd.nb,
                "bs": sd.bs,
                "nh": sd.nh,
                "hs": sd.hs,
                "dtype": group.dtype.name,
                "engine_group": group.engine_group_idx,
                "tokens_per_block": group.tokens_per_block,
                "sw_size_tokens": group.sw_size_tokens,
                "recurrent_state": group.recurrent_state,
                "slots_per_chunk": manager.get_slots_per_chunk_in_sw(k),
                "region_bytes": region_nbytes(manager, k),
            }
        )
    object_groups = []
    for o, group in enumerate(manager.object_groups):
        object_groups.append(
            {
                "index": o,
                "kernel_groups": list(group.kernel_group_indices),
                "sw_size_chunks": group.sw_size_chunks,
                "recurrent_state": group.recurrent_state,
                "object_bytes": object_nbytes(manager, o),
            }
        )
    return {
        "chunk_tokens": manager.lmcache_tokens_per_chunk,
        "num_layers": len(manager.engine_kv_formats),
        "kernel_groups": kernel_groups,
        "object_groups": object_groups,
        "bytes_per_chunk": sum(g["object_bytes"] for g in object_groups),
    }


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


def _window(group: dict[str, Any], window: int) -> str:
    if group.get("recurrent_state"):
        return "state"  # one snapshot per chunk (docs/SEMANTICS.md section 9)
    return "full" if window == -1 else str(window)


def format_plan(summary: dict[str, Any]) -> str:
    """A readable table of :func:`plan_summary`'s data."""
    lines = [
        f"{summary['num_layers']} layers, {len(summary['kernel_groups'])} kernel groups, "
        f"{len(summary['object_groups'])} object groups, chunk {summary['chunk_tokens']} "
        "tokens",
        "",
        "kernel groups",
    ]
    lines += _table(
        [
            "#",
            "layers",
            "kv",
            "nb",
            "bs",
            "nh",
            "hs",
            "dtype",
            "tpb",
            "sw tokens",
            "slots",
            "bytes/chunk",
        ],
        [
            [
                g["index"],
                g["layers"],
                g["kv_size"],
                g["nb"],
                g["bs"],
                g["nh"],
                g["hs"],
                g["dtype"],
                g["tokens_per_block"],
                _window(g, g["sw_size_tokens"]),
                g["slots_per_chunk"],
                f"{g['region_bytes']:,}",
            ]
            for g in summary["kernel_groups"]
        ],
    )
    lines += ["", "object groups"]
    lines += _table(
        ["#", "kernel groups", "window (chunks)", "bytes/chunk object"],
        [
            [
                g["index"],
                ",".join(map(str, g["kernel_groups"])),
                _window(g, g["sw_size_chunks"]),
                f"{g['object_bytes']:,}",
            ]
            for g in summary["object_groups"]
        ],
    )
    lines += ["", f"bytes per chunk (all object groups): {summary['bytes_per_chunk']:,}"]
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    """Comma-separated integers (the bench's ``--layers`` / ``--chunks`` bound theirs)."""
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


#: Where the library's words for the plan's settings come from on the command line.
PICK = {
    "lmcache_tokens_per_chunk": "--chunk",
    "sw_size_tokens": "--sw",
    "sliding window": "--sw",
    "tokens_per_block": "--tpb",
}
RENAME = {
    "lmcache_tokens_per_chunk": "--chunk",
    "sw_size_tokens": "--sw",
    "tokens_per_block": "tokens per block",
    "slots_per_block": "block size",
}


def _per_group(option: str, values: list[int] | None, groups: int) -> None:
    if values is not None and len(values) not in (1, groups):
        expected = "one value" if groups == 1 else f"one value or one per spec group ({groups})"
        refuse(option, f"expected {expected}, got {len(values)}: {values}")


def run(args: argparse.Namespace) -> int:
    groups = parse_kvcache_shape_spec(args.spec)
    _per_group("--sw", args.sw, len(groups))
    _per_group("--tpb", args.tpb, len(groups))
    try:
        manager = manager_from_shape_spec(
            groups,
            lmcache_tokens_per_chunk=args.chunk,
            separate_object_groups=not args.single_object_group,
            sw_size_tokens=args.sw,
            tokens_per_block=args.tpb,
        )
    except KVGroupsError as exc:
        raise in_option_terms(exc, PICK, RENAME, "--spec") from None
    # Echo the spec as understood (canonical form) ahead of the plan.
    summary = {"spec": format_kvcache_shape_spec(groups), **plan_summary(manager)}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"spec: {summary['spec']}")
        print(format_plan(summary))
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``kvgroups plan``."""
    parser = subparsers.add_parser(
        "plan",
        help="show the kernel groups, object groups and bytes per chunk of a shape spec",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--spec",
        required=True,
        type=shape_spec,
        help='shape spec "(kv,NB,BS,NH,HS):dtype:layers;...", e.g. "(2,1024,16,8,128):bf16:32" '
        "(spaces and dtype aliases such as bf16, fp16, fp8 allowed)",
    )
    parser.add_argument(
        "--chunk", type=int_in(1, MAX_TOKENS), default=256, help="tokens per chunk (default 256)"
    )
    parser.add_argument(
        "--sw",
        type=int_list_in(1, MAX_TOKENS, allowed=(-1,)),
        default=None,
        help="sliding window in tokens per spec group (-1 = full), comma-separated",
    )
    parser.add_argument(
        "--tpb",
        type=int_list_in(0, MAX_TOKENS),
        default=None,
        help="logical tokens per block per spec group (0 = block size), comma-separated",
    )
    parser.add_argument(
        "--single-object-group",
        action="store_true",
        help="store every kernel group in one object (no separation by window)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run)
    return parser
