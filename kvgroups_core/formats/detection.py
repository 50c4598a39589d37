"""Which :class:`~kvgroups_core.formats.catalogue.EngineKVFormat` an engine's KV caches are in.

:func:`detect_format` reads an engine's registered structure (a tensor, a list of per-layer
tensors, a list of ``(K, V)`` pairs, or ``[K list, V list]``) and returns its format plus a
*normalized* structure of :class:`~kvgroups_core.tensors.descriptors.TensorDesc` s in that format.
Normalizing never copies: where the engine's shape is not the format's (SGLang's folded
pages, the JAX engines' packed heads, a permuted view) the result is a view of the same memory.
How single tensors are read lives in :mod:`kvgroups_core.formats.engine_readers`.

Layers are detected per bucket of identical (shape, strides, dtype) inside each engine group:
a model may mix formats (a K/V cache beside a key-only indexer cache, layers of two head
sizes), and one layer's reshape is never applied to a tensor of another shape.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError, mismatch
from kvgroups_core.tensors.descriptors import TensorDesc

from .catalogue import CROSS_LAYER, KV_LIST, LAYER_LIST, LAYER_PAIR_LIST, EngineKVFormat
from .engine_readers import (
    ENGINES,
    HINT_KEYS,
    Hints,
    Reader,
    engine_name,
    parse_hints,
    read_jax_tensor,
    read_maxtext_kv,
    read_pair_tensor,
    read_sglang_kv,
    read_sglang_tensor,
    read_trtllm_cross,
    read_vllm_cross,
    read_vllm_tensor,
    tensor_desc,
)

__all__ = [
    "ENGINES",
    "HINT_KEYS",
    "FormatRow",
    "describe_formats_table",
    "detect_format",
    "formats_table_markdown",
    "normalize_and_discover_per_layer_formats",
]

# --- structures --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layer:
    """One layer of a parsed structure: its tensor(s) (one, or K and V), their names in
    error messages, and how the engine's tensors are read."""

    tensors: tuple[TensorDesc, ...]
    whats: tuple[str, ...]
    reader: Reader
    pair: bool = False  # a (K, V) tuple entry of a per-layer list

    def key(self) -> tuple:
        return (self.reader, self.pair) + tuple(t.spec for t in self.tensors)

    def read(self, h: Hints) -> tuple[EngineKVFormat, tuple[TensorDesc, ...]]:
        if len(self.tensors) == 2:
            k, v = self.tensors
            if k.spec != v.spec:
                raise KVGroupsValueError(
                    f"{self.whats[0]} and {self.whats[1]}: expected K and V of one shape, "
                    f"strides and dtype, got {k.shape}/{k.strides}/{k.dtype} and "
                    f"{v.shape}/{v.strides}/{v.dtype}"
                )
        read = [self.reader(t, w, h) for t, w in zip(self.tensors, self.whats)]
        return read[0][0], tuple(view for _, view in read)


@dataclass
class _Parsed:
    kind: str  # "cross", "layers" (one entry per layer) or "kv" ([K list, V list])
    layers: list[_Layer] = field(default_factory=list)
    cross: tuple[TensorDesc, str, Reader] | None = None


def _kv_layers(ks: Sequence, vs: Sequence, reader: Reader, names: Callable) -> list[_Layer]:
    if len(ks) != len(vs):
        raise KVGroupsValueError(
            mismatch("kv_caches", "K and V lists of one length", f"{len(ks)} and {len(vs)}")
        )
    out = []
    for layer, (k, v) in enumerate(zip(ks, vs)):
        whats = names(layer)
        out.append(_Layer((tensor_desc(k, whats[0]), tensor_desc(v, whats[1])), whats, reader))
    return out


def _parse(kv: Any, engine: str, h: Hints) -> _Parsed:
    if isinstance(kv, Mapping):
        raise KVGroupsTypeError(
            mismatch(
                "kv_caches",
                "a tensor, a list or a list of lists (pass list(kv_caches.values()) for a dict)",
                type(kv).__name__,
            )
        )
    if not isinstance(kv, (list, tuple)):
        if engine in ("vllm", "trtllm"):
            reader = read_vllm_cross if engine == "vllm" else read_trtllm_cross
            return _Parsed("cross", cross=(tensor_desc(kv, "kv_caches"), "kv_caches", reader))
        raise KVGroupsTypeError(
            mismatch("kv_caches", f"a list for engine {engine!r}", type(kv).__name__)
        )
    if engine == "trtllm":
        if len(kv) != 1 or isinstance(kv[0], (list, tuple)):
            raise KVGroupsValueError(
                mismatch(
                    "kv_caches",
                    "the TRT-LLM pool tensor or a 1-element list of it",
                    f"a list of {len(kv)}",
                )
            )
        return _Parsed(
            "cross", cross=(tensor_desc(kv[0], "kv_caches[0]"), "kv_caches[0]", read_trtllm_cross)
        )
    nested = [isinstance(x, (list, tuple)) for x in kv]
    if engine in ("maxtext", "sglang") and kv and all(nested):
        if len(kv) != 2:
            raise KVGroupsValueError(mismatch("kv_caches", "[K list, V list]", f"{len(kv)} lists"))
        reader = read_maxtext_kv if engine == "maxtext" else read_sglang_kv
        return _Parsed(
            "kv",
            _kv_layers(
                kv[0], kv[1], reader, lambda i: (f"kv_caches[0][{i}]", f"kv_caches[1][{i}]")
            ),
        )
    if engine == "maxtext":
        raise KVGroupsValueError(
            mismatch(
                "kv_caches", "[K list, V list] of [NH, NP, PS, HD] arrays", "another structure"
            )
        )
    if engine == "vllm":
        layers = []
        for i, x in enumerate(kv):
            if not nested[i]:
                what = f"kv_caches[{i}]"
                layers.append(_Layer((tensor_desc(x, what),), (what,), read_vllm_tensor))
                continue
            if len(x) != 2:
                raise KVGroupsValueError(
                    mismatch(
                        f"kv_caches[{i}]", "a tensor or a (K, V) pair", f"a sequence of {len(x)}"
                    )
                )
            whats = (f"kv_caches[{i}][0]", f"kv_caches[{i}][1]")
            pair_descs = (tensor_desc(x[0], whats[0]), tensor_desc(x[1], whats[1]))
            layers.append(_Layer(pair_descs, whats, read_pair_tensor, pair=True))
        return _Parsed("layers", layers)
    if any(nested):
        raise KVGroupsValueError(
            mismatch(
                "kv_caches",
                f"a flat list of per-layer tensors for engine {engine!r}",
                "nested lists",
            )
        )
    descs = [tensor_desc(x, f"kv_caches[{i}]") for i, x in enumerate(kv)]
    if engine == "sglang" and descs and descs[0].spec.ndim == 3 and descs[0].shape[1] > 1:
        # SGLang's multi-process path: K of every layer, then V of every layer.
        if len(descs) % 2:
            raise KVGroupsValueError(
                mismatch(
                    "kv_caches", "2*NL page-folded tensors (K layers, then V layers)", len(descs)
                )
            )
        if h.tokens_per_block is None:
            raise KVGroupsValueError(
                "kv_caches: a flat SGLang list of [PBS, NH, HS] tensors is "
                "TWO_X_NL_X_NBBS_NH_HS, which folds blocks and slots into one axis (no NB/BS), "
                "so it cannot be grouped; pass hints={'tokens_per_block': <page size>} to view "
                "each as [PBS/BS, BS, NH, HS]"
            )
        nl = len(descs) // 2
        return _Parsed(
            "kv",
            _kv_layers(
                descs[:nl],
                descs[nl:],
                read_sglang_kv,
                lambda i: (f"kv_caches[{i}]", f"kv_caches[{nl + i}]"),
            ),
        )
    reader = read_sglang_tensor if engine == "sglang" else read_jax_tensor
    return _Parsed(
        "layers", [_Layer((d,), (f"kv_caches[{i}]",), reader) for i, d in enumerate(descs)]
    )


def _engine_groups(layer_index_groups: Any, num_layers: int) -> list[list[int]]:
    """The engine groups as lists of layers; layers of no group form one more group (they
    still get a format, though grouping will leave them out)."""
    if not layer_index_groups:
        return [list(range(num_layers))]
    seen: dict[int, int] = {}
    groups = []
    for g, indices in enumerate(layer_index_groups):
        group = []
        for i in indices:
            if isinstance(i, bool) or not isinstance(i, numbers.Integral):
                raise KVGroupsTypeError(mismatch(f"layer_index_groups[{g}]", "ints", repr(i)))
            if not 0 <= int(i) < num_layers:
                raise KVGroupsValueError(
                    f"layer_index_groups[{g}]: layer {i} is outside registered layer range "
                    f"[0, {num_layers})"
                )
            if int(i) in seen:
                raise KVGroupsValueError(
                    f"layer_index_groups: expected each layer in one engine group, got layer {i} "
                    f"in groups {seen[int(i)]} and {g}"
                )
            seen[int(i)] = g
            group.append(int(i))
        groups.append(group)
    rest = [i for i in range(num_layers) if i not in seen]
    return groups + [rest] if rest else groups


def _per_layer(parsed: _Parsed, groups: list[list[int]], h: Hints) -> tuple[Any, list]:
    """Detect per (engine group, bucket of identical specs); assemble the normalized
    structure and one format per layer."""
    n = len(parsed.layers)
    formats: list[EngineKVFormat | None] = [None] * n
    views: list[tuple[TensorDesc, ...]] = [()] * n
    for group in groups:
        buckets: dict[tuple, list[int]] = {}
        for i in group:
            buckets.setdefault(parsed.layers[i].key(), []).append(i)
        for members in buckets.values():
            first = parsed.layers[members[0]]
            fmt, first_views = first.read(h)
            for i in members:
                # Identical specs: this layer's own tensors get the same view spec.
                own = parsed.layers[i].tensors
                formats[i] = fmt
                views[i] = tuple(
                    t if v is f else t.view(v.spec)
                    for t, f, v in zip(own, first.tensors, first_views)
                )
    if parsed.kind == "kv":
        normalized: Any = [[v[0] for v in views], [v[1] for v in views]]
    else:
        normalized = [v if layer.pair else v[0] for v, layer in zip(views, parsed.layers)]
    return normalized, formats


def _refuse_state(h: Any) -> None:
    # A recurrent state's shape can be any attention layout's (LMCache read a GDN state
    # (711, 2, 544, 1, 512) as FlashInfer NHD): its format comes from the engine's spec.
    if h.recurrent_state:
        raise KVGroupsValueError(
            "kv_caches: expected attention KV for detection, got hints recurrent_state=True; "
            "recurrent state layouts are never detected from a shape: declare the state "
            "format from the engine's spec (NL_X_NB_CD_CW / NL_X_NB_CW_CD / NL_X_NB_SH_SS, "
            "docs/SEMANTICS.md section 9)"
        )


def detect_format(
    kv_caches: Any, engine: str = "vllm", hints: Mapping[str, Any] | None = None
) -> tuple[EngineKVFormat, Any]:
    """Detect the format of an engine's KV caches and normalize them to it, zero-copy.

    Parameters
    ----------
    kv_caches : tensor, list, or list of lists
        The engine's registered structure, of framework tensors, NumPy arrays,
        :class:`~kvgroups_core.tensors.descriptors.TensorSpec` s or
        :class:`~kvgroups_core.tensors.descriptors.TensorDesc` s, mixed freely. vLLM: a per-layer
        list
        (rank-5 ``[2, NB, BS, NH, HS]`` / ``[NB, 2, BS, NH, HS]``, rank-4 CS-packed, rank-3
        MLA or indexer, or ``(K, V)`` pairs) or a bare rank-6 cross-layer tensor. SGLang:
        ``[K list, V list]``, a flat list of 2*NL ``[PBS, NH, HS]`` (needs
        ``tokens_per_block``), or per-layer MLA / indexer tensors. TRT-LLM: the rank-6 pool
        (or rank 4 with ``num_kv_heads``, ``tokens_per_block`` and ``head_dim``).
        tpu_inference / sglang_jax: per-layer ``[NP, PS, 2*NH // packing, packing, HD]``.
        maxtext: ``[K list, V list]`` of ``[NH, NP, PS, HD]``.
    engine : str
        One of :data:`ENGINES` (``"vllm_tpu"`` = ``"tpu_inference"``).
    hints : mapping, optional
        ``kv_layout`` ("NHD" or "HND": the token/head order in memory, default NHD),
        ``tokens_per_block``, ``num_kv_heads``, ``head_dim``; ``recurrent_state=True`` says
        the tensors are recurrent state, which is refused (their format is never detected).

    Returns
    -------
    (EngineKVFormat, normalized)
        ``normalized`` has the structure of the format (a tensor, a per-layer list, a list of
        ``(K, V)`` tuples, or ``[K list, V list]``) of TensorDescs over the same memory.

    Raises
    ------
    KVGroupsValueError
        For a structure, rank or stride layout no format describes, or layers of several
        formats (use :func:`normalize_and_discover_per_layer_formats`).
    """
    h = parse_hints(hints)
    _refuse_state(h)
    parsed = _parse(kv_caches, engine_name(engine), h)
    if parsed.kind == "cross":
        desc, what, reader = parsed.cross  # type: ignore[misc]
        return reader(desc, what, h)
    if not parsed.layers:
        raise KVGroupsValueError(mismatch("kv_caches", "at least one layer", "an empty list"))
    normalized, formats = _per_layer(parsed, [list(range(len(parsed.layers)))], h)
    found = {f: [i for i, g in enumerate(formats) if g is f] for f in dict.fromkeys(formats)}
    if len(found) > 1:
        listed = "; ".join(f"{f.name}: layers {ids}" for f, ids in found.items())
        raise KVGroupsValueError(
            f"kv_caches: expected one format for every layer, got {listed}; use "
            "normalize_and_discover_per_layer_formats for models that mix formats"
        )
    return formats[0], normalized


def normalize_and_discover_per_layer_formats(
    kv_caches: Any,
    layer_index_groups: Sequence[Sequence[int]] | None = None,
    engine: str = "vllm",
    hints: Mapping[str, Any] | None = None,
) -> tuple[Any, list[EngineKVFormat]]:
    """Normalize ``kv_caches`` and detect one format per layer.

    Detection runs per engine group (``layer_index_groups``: one list of layer indices per
    group; None or empty = one group) and, inside it, per bucket of layers whose tensors have
    identical shape, strides and dtype. Layers in no group are detected as one more bucket
    set, so every layer gets a format.

    Returns
    -------
    (normalized, formats)
        ``normalized`` keeps the engine's structure kind (see :func:`detect_format`) so that
        ``layout.layer_layouts(normalized, formats)`` reads every layer; ``formats`` has one
        entry per layer. An empty list gives ``([], [])``.
    """
    h = parse_hints(hints)
    _refuse_state(h)
    parsed = _parse(kv_caches, engine_name(engine), h)
    if parsed.kind == "cross":
        desc, what, reader = parsed.cross  # type: ignore[misc]
        fmt, view = reader(desc, what, h)
        num_layers = view.shape[fmt.facts.axes.index("NL")]
        _engine_groups(layer_index_groups, num_layers)
        return view, [fmt] * num_layers
    groups = _engine_groups(layer_index_groups, len(parsed.layers))
    return _per_layer(parsed, groups, h)


# --- the catalogue as rows, for docs -------------------------------------------------------

_SHOWN = {"TWO": "2", "ONE": "1", "BSV_BSS": "132", "SS": "SS..."}


class FormatRow(NamedTuple):
    """One row of the format catalogue (``docs/FORMATS.md`` is generated from these)."""

    name: str
    structure: str  # e.g. "list[NL] of [2, NB, BS, NH, HS]"
    producers: str
    kv_size: int
    facts: dict[str, bool]
    dims: str  # where NB, BS, NH, HS are read, e.g. "s1, s2, s3, s4"
    block: str  # block b of layer l, plane kv, e.g. "t[l][kv, b]"
    runs: str  # the page-model segment runs of one token row


def _row(fmt: EngineKVFormat) -> FormatRow:
    f = fmt.facts
    shape = ", ".join(_SHOWN.get(a, a) for a in f.axes)
    structure = {
        CROSS_LAYER: f"one tensor [{shape}]",
        LAYER_LIST: f"list[NL] of [{shape}]",
        LAYER_PAIR_LIST: f"list[NL] of (K, V) pairs of [{shape}]",
        KV_LIST: f"[K list[NL], V list[NL]] of [{shape}]",
    }[f.structure]
    pos = {a: f"s{i}" for i, a in enumerate(f.axes)}
    if not f.groupable:
        dims = f"PBS = NB*BS = {pos['PBS']} (no NB/BS)"
    elif f.recurrent_state:
        dims = {
            "CD": "s0, BS=1, NH=CD (s1), HS=CW (s2)",
            "CW": "s0, BS=1, NH=1, HS=CW*CD",
            "SH": "s0, BS=1, NH=SH (s1), HS=prod(s2...)",
        }[f.axes[1]]
    else:
        head = "132" if f.is_indexer else f"CS={pos['CS']}" if "CS" in pos else pos["HS"]
        dims = ", ".join((pos["NB"], pos["BS"], pos.get("NH", "NH=1"), head))
    if f.structure == KV_LIST:
        dims = "[0][0]: " + dims
    prefix = {
        CROSS_LAYER: "t[",
        LAYER_LIST: "t[l][",
        LAYER_PAIR_LIST: "t[l][kv][",
        KV_LIST: "t[kv][l][",
    }[f.structure]
    index = [{"NB": "b", "NL": "l", "TWO": "kv"}.get(a, ":") for a in f.axes]
    while index and index[-1] == ":":
        index.pop()
    block = prefix + ", ".join(index) + "]" if index else prefix[:-1]
    if not f.groupable:
        runs = "none: cannot be grouped"
    elif f.recurrent_state:
        runs = f"(1, {'*'.join(f.axes[1:])}*e): one slot's whole state, block step stride(0)"
    elif f.is_indexer:
        runs = "values (1, 128) at 0, scales (1, 4) at BS*128; token step 128 / 4"
    elif "NH" in f.axes and "TWO" in f.axes and f.axes.index("TWO") > f.axes.index("NH"):
        runs = "(NH, HS*e), head step 2*HS*e, token step 2*NH*HS*e; V plane at +HS*e"
    elif f.axes[0] == "NH":
        runs = "(NH, HS*e), head step NB*BS*HS*e, token step HS*e"
    elif f.is_hnd:
        head = "CS" if f.is_fused_packed else "HS"
        runs = f"(NH, {head}*e), head step BS*{head}*e, token step {head}*e"
    else:
        row = "NH*CS" if f.is_fused_packed else "HS" if "NH" not in f.axes else "NH*HS"
        runs = f"(1, {row}*e), token step {row}*e"
    facts = {
        name: getattr(fmt, name)
        for name in (
            "is_mla",
            "is_hnd",
            "is_cross_layer",
            "is_kv_list",
            "is_layer_list",
            "is_fused_packed",
            "is_indexer",
            "block_axis_first",
            "groupable",
            "must_have",
        )
    }
    return FormatRow(fmt.name, structure, f.producers, f.kv_size, facts, dims, block, runs)


def describe_formats_table() -> list[FormatRow]:
    """One :class:`FormatRow` per :class:`EngineKVFormat`, in catalogue order."""
    return [_row(fmt) for fmt in EngineKVFormat]


def formats_table_markdown() -> str:
    """The catalogue as the Markdown table of ``docs/FORMATS.md``."""
    lines = [
        "| format | structure | produced by | kv_size | NB, BS, NH, HS from | "
        "block b of layer l, plane kv | token row runs (count, bytes) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in describe_formats_table():
        lines.append(
            f"| {r.name} | {r.structure} | {r.producers} | {r.kv_size} | {r.dims} | "
            f"{r.block} | {r.runs} |"
        )
    return "\n".join(lines)
