"""KV cache shape specs: ``"(kv,NB,BS,NH,HS):dtype:layers;..."`` (docs/SEMANTICS.md section 5).

A shape spec writes a model's kernel groups on one line, for CLIs and benchmarks::

    (2,1024,16,8,128):bfloat16:30;(1,1024,64,1,576):bfloat16:2

Each ``;``-separated group is a 5-tuple ``(kv_size, num_blocks, block_size, num_heads,
head_size)``, a dtype and a layer count; layer indices are assigned consecutively from 0.
:func:`manager_from_shape_spec` turns a spec into a real
:class:`~kvgroups_core.grouping.manager.KVLayerGroupsManager` over data-less TensorSpecs, so
anything
the manager plans (slots, object sizes) can be computed for a spec.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgroups_core.errors import KVGroupsTypeError, KVGroupsValueError
from kvgroups_core.formats.catalogue import EngineKVFormat
from kvgroups_core.tensors.descriptors import TensorSpec
from kvgroups_core.tensors.dtypes import DTYPE_MAP, DType

from .engine_groups import EngineGroupInfo
from .identity import KernelGroupInfo, PageBufferShapeDesc
from .manager import KVLayerGroupsManager

#: The most layers one shape spec may describe (all groups together): far beyond any model,
#: and small enough that the layer lists a spec expands to stay cheap.
MAX_SPEC_LAYERS = 1 << 16
#: Every number of a spec fits int64, so what is derived from it (byte counts) stays a
#: machine-sized integer.
MAX_SPEC_NUMBER = (1 << 63) - 1

#: The dtypes a shape spec may name (lower case); the parser accepts no others.
SPEC_DTYPES: tuple[str, ...] = (
    "float16",
    "bfloat16",
    "float32",
    "uint8",
    "float8_e4m3fn",
    "float8_e5m2",
)


def parse_kvcache_shape_spec(spec_str: str) -> list[KernelGroupInfo]:
    """Parse a shape spec into one :class:`KernelGroupInfo` per ``;``-separated group.

    Parameters
    ----------
    spec_str : str
        ``"(kv,NB,BS,NH,HS):dtype:layers;..."``; blank groups are skipped, whitespace around
        fields is ignored and the dtype is case-insensitive.

    Returns
    -------
    list of KernelGroupInfo
        With consecutive layer indices from 0, ``engine_kv_format=None`` and
        ``tokens_per_block=0``.

    Raises
    ------
    KVGroupsValueError
        Checked in this order: the spec is empty ("cannot be empty"); a group does not start
        with ``(`` or lacks ``):`` ("Invalid group spec"); it has not exactly two ``:`` fields
        after the shape ("Invalid group spec"); the dtype is unknown ("Unrecognized dtype");
        a number is not an integer ("Invalid number"); the shape has not five numbers
        ("Shape must be a 5-tuple"); the layer count is not positive; a size is 2**63 or
        more ("Invalid number"); the spec's layers exceed :data:`MAX_SPEC_LAYERS` ("Layer count
        too large"); no group at all ("No valid layer groups").
    """
    if not isinstance(spec_str, str):
        raise KVGroupsTypeError(f"spec_str: expected a str, got {type(spec_str).__name__}")
    if not spec_str:
        raise KVGroupsValueError("KV shape specification cannot be empty")
    groups: list[KernelGroupInfo] = []
    next_layer = 0
    for raw in spec_str.split(";"):
        part = raw.strip()
        if not part:
            continue
        if not (part.startswith("(") and "):" in part):
            raise KVGroupsValueError(
                f"Invalid group spec {_quote(part)}: expected '(kv,NB,BS,NH,HS):dtype:layers'"
            )
        shape_end = part.index("):")
        fields = part[shape_end + 2 :].split(":")
        if len(fields) != 2:
            raise KVGroupsValueError(
                f"Invalid group spec {_quote(part)}: expected exactly two ':' fields (dtype and "
                f"layer count) after the shape, got {len(fields)}"
            )
        dtype_name = fields[0].strip().lower()
        if dtype_name not in SPEC_DTYPES:
            raise KVGroupsValueError(
                f"Unrecognized dtype {fields[0].strip()!r} in group spec {_quote(part)}: expected "
                f"one of {list(SPEC_DTYPES)}"
            )
        try:
            shape = tuple(int(p.strip()) for p in part[1:shape_end].split(","))
            num_layers = int(fields[1].strip())
        except ValueError:
            raise KVGroupsValueError(
                f"Invalid number in group spec {_quote(part)}: expected integers"
            ) from None
        if len(shape) != 5:
            raise KVGroupsValueError(
                f"Shape must be a 5-tuple (kv_size,nb,bs,nh,hs) in group spec {_quote(part)}, got "
                f"{len(shape)} numbers"
            )
        if any(n < 0 for n in shape):
            raise KVGroupsValueError(
                f"Invalid number in group spec {_quote(part)}: expected non-negative sizes, got "
                f"{shape}"
            )
        if num_layers <= 0:
            raise KVGroupsValueError(
                f"Layer count must be positive in group spec {_quote(part)}, got {num_layers}"
            )
        if any(n > MAX_SPEC_NUMBER for n in shape):
            raise KVGroupsValueError(
                f"Invalid number in group spec {_quote(part)}: expected sizes below 2**63, got "
                f"{_short(max(shape))}"
            )
        if next_layer + num_layers > MAX_SPEC_LAYERS:
            raise KVGroupsValueError(
                f"Layer count too large in group spec {_quote(part)}: expected at most "
                f"{MAX_SPEC_LAYERS} layers in a spec, got {_short(next_layer + num_layers)}"
            )
        dtype = DTYPE_MAP[dtype_name]
        kv_size, nb, bs, nh, hs = shape
        shape_desc = PageBufferShapeDesc(
            kv_size=kv_size,
            nl=num_layers,
            nb=nb,
            bs=bs,
            nh=nh,
            hs=hs,
            element_size=dtype.itemsize,
            dtype=dtype,
        )
        groups.append(
            KernelGroupInfo(
                layer_indices=list(range(next_layer, next_layer + num_layers)),
                shape_desc=shape_desc,
                dtype=dtype,
            )
        )
        next_layer += num_layers
    if not groups:
        raise KVGroupsValueError(f"No valid layer groups found in spec {_quote(spec_str)}")
    return groups


def _quote(text: str) -> str:
    """A spec (part) for a message, shortened past 80 characters."""
    return repr(text) if len(text) <= 80 else repr(text[:60] + "...") + f" ({len(text)} chars)"


def _short(n: int) -> str:
    """An integer for a message: in full up to 30 digits, else its digit count (a number of
    thousands of digits cannot even be printed by default)."""
    if n.bit_length() <= 96:
        return str(n)
    return f"a {int(n.bit_length() * 0.30103) + 1}-digit number"


def format_kvcache_shape_spec(groups: Sequence[KernelGroupInfo]) -> str:
    """The shape spec of ``groups``, without whitespace: the exact inverse of
    :func:`parse_kvcache_shape_spec` (``format(parse(s)) == s`` for canonical ``s``).

    Raises
    ------
    KVGroupsTypeError
        ``groups`` is not a list (or tuple) of KernelGroupInfo.
    KVGroupsValueError
        ``groups`` is empty, or a group's dtype is not one a spec may name.
    """
    if not isinstance(groups, (list, tuple)):
        raise KVGroupsTypeError(
            f"groups: expected a list of KernelGroupInfo, got {type(groups).__name__}"
        )
    if not groups:
        raise KVGroupsValueError("groups: cannot format an empty kernel group list")
    for i, group in enumerate(groups):
        if not isinstance(group, KernelGroupInfo):
            raise KVGroupsTypeError(
                f"groups[{i}]: expected a KernelGroupInfo, got {type(group).__name__}"
            )
    parts = []
    for i, group in enumerate(groups):
        sd = group.shape_desc
        name = group.dtype.name if isinstance(group.dtype, DType) else str(group.dtype)
        if name not in SPEC_DTYPES:
            raise KVGroupsValueError(
                f"groups[{i}].dtype: expected one of {list(SPEC_DTYPES)}, got {group.dtype}"
            )
        parts.append(f"({sd.kv_size},{sd.nb},{sd.bs},{sd.nh},{sd.hs}):{name}:{sd.nl}")
    return ";".join(parts)


def group_tensor(group: KernelGroupInfo, i: int) -> tuple[EngineKVFormat, TensorSpec]:
    """The format and the data-less tensor of spec group ``i`` (``group``): the layout
    :func:`manager_from_shape_spec` builds each group's layers in."""
    sd = group.shape_desc
    for field in ("nb", "bs", "nh", "hs"):
        if getattr(sd, field) <= 0:
            raise KVGroupsValueError(
                f"spec group {i}: expected a positive {field}, got {getattr(sd, field)}"
            )
    if sd.kv_size == 2:
        return EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, TensorSpec(
            (2, sd.nb, sd.bs, sd.nh, sd.hs), group.dtype
        )
    if sd.kv_size == 1:
        if sd.nh == 1:
            return EngineKVFormat.NL_X_NB_BS_HS, TensorSpec((sd.nb, sd.bs, sd.hs), group.dtype)
        # Several heads in one plane: the packed per-head layout, with CS playing HS.
        return EngineKVFormat.NL_X_NB_BS_NH_CS, TensorSpec(
            (sd.nb, sd.bs, sd.nh, sd.hs), group.dtype
        )
    raise KVGroupsValueError(f"spec group {i}: expected kv_size 1 or 2, got {sd.kv_size}")


def _per_group(values: Sequence[int] | None, n: int, what: str, default: int) -> list[int]:
    if values is None:
        return [default] * n
    values = list(values)
    if len(values) == 1:
        return values * n
    if len(values) != n:
        expected = "one value" if n == 1 else f"one value or {n} (one per spec group)"
        raise KVGroupsValueError(f"{what}: expected {expected}, got {len(values)}")
    return values


def caches_from_shape_spec(
    spec: str | Sequence[KernelGroupInfo],
    *,
    sw_size_tokens: Sequence[int] | None = None,
    tokens_per_block: Sequence[int] | None = None,
) -> tuple[list[TensorSpec], list[EngineKVFormat], list[EngineGroupInfo]]:
    """The TensorSpecs, per-layer formats and engine group infos :func:`manager_from_shape_spec`
    builds its manager from (see there for the layouts and parameters)."""
    groups = parse_kvcache_shape_spec(spec) if isinstance(spec, str) else list(spec)
    if not groups:
        raise KVGroupsValueError("spec: expected at least one group, got none")
    caches: list[TensorSpec] = []
    formats: list[EngineKVFormat] = []
    for i, group in enumerate(groups):
        fmt, tensor = group_tensor(group, i)
        caches += [tensor] * group.shape_desc.nl
        formats += [fmt] * group.shape_desc.nl
    infos: list[EngineGroupInfo] = []
    if sw_size_tokens is not None or tokens_per_block is not None:
        windows = _per_group(sw_size_tokens, len(groups), "sw_size_tokens", -1)
        tpbs = _per_group(tokens_per_block, len(groups), "tokens_per_block", 0)
        start = 0
        for i, group in enumerate(groups):
            nl = group.shape_desc.nl
            infos.append(
                EngineGroupInfo(
                    engine_group_id=i,
                    layer_indices=tuple(range(start, start + nl)),
                    tokens_per_block=tpbs[i],
                    sw_size_tokens=windows[i],
                )
            )
            start += nl
    return caches, formats, infos


def manager_from_shape_spec(
    spec: str | Sequence[KernelGroupInfo],
    *,
    lmcache_tokens_per_chunk: int = 256,
    separate_object_groups: bool = True,
    sw_size_tokens: Sequence[int] | None = None,
    tokens_per_block: Sequence[int] | None = None,
) -> KVLayerGroupsManager:
    """A :class:`KVLayerGroupsManager` over TensorSpecs shaped as ``spec`` says.

    kv_size 2 groups become ``NL_X_TWO_NB_BS_NH_HS`` tensors ``[2, NB, BS, NH, HS]``; kv_size 1
    groups ``NL_X_NB_BS_HS`` ``[NB, BS, HS]`` when NH is 1, else ``NL_X_NB_BS_NH_CS``
    ``[NB, BS, NH, HS]``.

    Parameters
    ----------
    spec : str or sequence of KernelGroupInfo
        A shape spec, or groups parsed from one.
    lmcache_tokens_per_chunk, separate_object_groups
        Passed to the manager.
    sw_size_tokens, tokens_per_block : sequence of int, optional
        Per spec group (or one value for all): sliding window in tokens (-1 = full) and
        logical tokens per block (0 = block size). When either is given, each spec group
        becomes its own engine group, so groups of equal geometry stay apart; otherwise every
        layer is in engine group 0 and groups of equal geometry merge.
    """
    caches, formats, infos = caches_from_shape_spec(
        spec, sw_size_tokens=sw_size_tokens, tokens_per_block=tokens_per_block
    )
    return KVLayerGroupsManager(
        caches,
        formats,
        engine_group_infos=infos,
        lmcache_tokens_per_chunk=lmcache_tokens_per_chunk,
        separate_object_groups=separate_object_groups,
    )
