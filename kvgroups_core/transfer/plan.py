"""Transfer plans: plain data that every backend executes (docs/SEMANTICS.md sections 6-7).

A plan is built from a manager, block ids and the caches' descriptors alone, with no framework
and no data pointers, so it can be made under ``jax.jit`` as well as eagerly. Backends receive
the plan plus the backing tensors in ``plan.tensor_specs`` order and move the bytes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal

import numpy as np

from kvgroups_core.formats.segments import SegmentRun

Direction = Literal["store", "load"]


@dataclass(frozen=True, kw_only=True)
class PlaneRef:
    """Where one plane of a kernel group starts in the caches and in the objects.

    ``tensor_index`` indexes the plan's backing tensors; ``byte_offset`` is counted from that
    tensor's first element (``data_ptr + byte_offset`` of its descriptor) to block 0 of the
    plane. ``object_plane`` is the plane's index ``p = kv * nl + l`` inside its kernel group's
    object region: the object side of a plane is always computed from it (a layer-subset plan
    keeps only some planes, so a plane's position in ``GroupTransfer.planes`` is not ``p``).
    Left at -1 (hand-made plans), :class:`GroupTransfer` sets it to the plane's position.
    """

    tensor_index: int
    byte_offset: int
    object_plane: int = -1

    @property
    def tensor_slot(self) -> int:
        """Deprecated: the old name of :attr:`tensor_index` (a slot is a token position)."""
        warnings.warn(
            "PlaneRef.tensor_slot is deprecated: use PlaneRef.tensor_index",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.tensor_index


@dataclass(frozen=True, kw_only=True)
class GroupTransfer:
    """The work of one kernel group: one kernel launch.

    Items ``i`` in ``[first_item, num_chunks * kept_per_chunk)`` are moved; item ``i`` is chunk
    ``c = i // kept_per_chunk``, kept position ``j = i % kept_per_chunk``, engine block id
    ``block_ids[c * blocks_per_chunk + blocks_per_chunk - kept_per_chunk + j]``. For each item
    and each plane (object plane ``p = plane.object_plane``), token ``t < block_size`` of the
    block is object row ``p * slots + j * block_size + t`` of chunk ``c``'s object, starting
    ``region_offset`` bytes into the object.

    ``block_ids`` is an int64 NumPy array, or, when the plan's ``device_ids`` is True, the
    caller's framework array itself (int32 or int64, never read on the host: the backend
    drops and reports out-of-range ids). ``first_item`` is exact for host skips; when the
    plan's ``skip_tokens`` is set it is the static lower bound (the window skip) and the real
    first item is :func:`first_item_for_skip` of the skip. ``tokens_per_block`` (logical tokens
    one block id covers) turns a token skip into blocks.
    """

    kernel_group_idx: int
    object_group_idx: int
    region_offset: int
    row_bytes: int
    block_size: int
    slots: int
    planes: tuple[PlaneRef, ...]
    block_stride_bytes: int
    num_blocks: int
    runs: tuple[SegmentRun, ...]
    unit_bytes: int
    itemsize: int
    block_ids: np.ndarray
    blocks_per_chunk: int
    kept_per_chunk: int
    first_item: int
    num_chunks: int
    tokens_per_block: int = 0
    # The engine group whose ids this transfer reads (what an error about them names).
    engine_group_idx: int = 0

    def __post_init__(self) -> None:
        # Hand-made plans (tests, benchmarks): planes without an object plane are numbered by
        # position and the token granularity defaults to the block. The planner fills both.
        if any(p.object_plane < 0 for p in self.planes):
            object.__setattr__(
                self,
                "planes",
                tuple(
                    p if p.object_plane >= 0 else replace(p, object_plane=i)
                    for i, p in enumerate(self.planes)
                ),
            )
        if self.tokens_per_block <= 0:
            object.__setattr__(self, "tokens_per_block", self.block_size)

    @property
    def num_planes(self) -> int:
        return len(self.planes)

    @property
    def num_items(self) -> int:
        return self.num_chunks * self.kept_per_chunk - self.first_item

    @property
    def num_items_total(self) -> int:
        """Items of the whole call before any load skip (``num_chunks * kept_per_chunk``)."""
        return self.num_chunks * self.kept_per_chunk

    @property
    def region_nbytes(self) -> int:
        """Bytes of the object region this transfer's planes address (up to its highest
        object plane; the whole region for a whole-model plan)."""
        top = max((p.object_plane for p in self.planes), default=-1) + 1
        return top * self.slots * self.row_bytes

    def items(self, first_item: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(chunk, position, block_id)`` int64 arrays of the moved items, in item order
        (from ``first_item``, default the group's own)."""
        start = self.first_item if first_item is None else first_item
        i = np.arange(start, self.num_chunks * self.kept_per_chunk, dtype=np.int64)
        chunk = i // self.kept_per_chunk
        pos = i % self.kept_per_chunk
        where = chunk * self.blocks_per_chunk + (self.blocks_per_chunk - self.kept_per_chunk) + pos
        return chunk, pos, np.asarray(self.block_ids, dtype=np.int64)[where]

    def block_runs(self, first_item: int | None = None, *, num_blocks: int | None = None):
        """The moved items as runs of consecutive block ids (host ids): see
        :func:`kvgroups_core.block_runs.block_runs`."""
        from .block_runs import block_runs

        return block_runs(self, first_item, num_blocks=num_blocks)

    # --- the per-call constructors (the planner's and a repeater's hot path) ----------------

    def shape_fields(self, **changes: Any) -> dict:
        """Every field but ``block_ids``, with ``changes``: the id-independent part of a
        transfer, which :meth:`from_shape` completes with a call's ids. ``changes`` must be
        values as ``__init__`` leaves them (planes with their object planes set)."""
        fields = dict(vars(self), **changes)
        del fields["block_ids"]
        return fields

    @classmethod
    def from_shape(cls, fields: dict, block_ids: Any) -> "GroupTransfer":
        """The transfer of :meth:`shape_fields` ``fields`` and ``block_ids``, built without
        ``__init__`` (nothing to normalise: the fields come from a built transfer)."""
        values = fields.copy()
        values["block_ids"] = block_ids
        return _filled(cls, values)

    def with_block_ids(self, block_ids: Any) -> "GroupTransfer":
        """This transfer with other ids (of the signature it was validated for)."""
        return GroupTransfer.from_shape(vars(self), block_ids)


@dataclass(frozen=True, kw_only=True)
class TransferPlan:
    """Everything a backend needs to run one ``store`` or ``load`` call."""

    direction: Direction
    num_chunks: int
    object_nbytes: tuple[int, ...]
    groups: tuple[GroupTransfer, ...]
    tensor_specs: tuple  # tuple[TensorSpec, ...]: the backing tensors, in tensor_index order
    # True when every group's ``block_ids`` is the caller's device (or traced) array: only
    # static facts were checked; the backend drops and reports out-of-range ids.
    device_ids: bool = False
    # The load's ``skip_first_n_tokens`` when it is a device / traced scalar (None for a host
    # skip, already applied to every ``first_item``): see :func:`first_item_for_skip`.
    skip_tokens: Any = None
    # The layer indices the call moves (None: every grouped layer).
    layers: tuple[int, ...] | None = None
    # A launch-shape hint: at most this many concurrent work units (CTAs) per kernel launch,
    # so a transfer leaves the rest of the GPU to concurrent work (None: no cap). Backends
    # without such a knob ignore it; it never changes which bytes move.
    max_ctas: int | None = None
    # How a backend with several copy mechanisms moves the bytes ("auto": its own choice;
    # torch adds "kernel" and "copy_engine"); checked against ``Backend.transfer_paths``.
    path: str = "auto"

    @classmethod
    def from_fields(cls, fields: dict) -> "TransferPlan":
        """The plan holding ``fields`` (every field, values as ``__init__`` leaves them; the
        dict is taken over), built without ``__init__``: how the planner assembles a call's
        plan from its remembered shape."""
        return _filled(cls, fields)

    def with_block_ids(self, block_ids: Any) -> "TransferPlan":
        """This plan with ``block_ids`` as every group's ids (a plan of one engine group's
        flat ids, already validated for these ids' signature)."""
        fields = vars(self).copy()
        fields["groups"] = tuple([g.with_block_ids(block_ids) for g in self.groups])
        return _filled(TransferPlan, fields)


_new_instance = object.__new__
_set_attribute = object.__setattr__


def _filled(cls: type, fields: dict) -> Any:
    """An instance of the frozen plan class ``cls`` whose fields are ``fields`` (complete and
    already normalised), made in one step. This module's per-call constructors use it:
    ``__init__`` sets a frozen dataclass's fields one ``object.__setattr__`` at a time and runs
    ``__post_init__``, a sizeable share of a one-chunk call's host time."""
    new: Any = _new_instance(cls)
    _set_attribute(new, "__dict__", fields)
    return new


def _identity_max(a: Any, b: int) -> Any:
    return a if a >= b else b


def _identity_min(a: Any, b: int) -> Any:
    return a if a <= b else b


def skip_first_item(
    *,
    skip: Any,
    lower_bound: int,
    tokens_per_block: int,
    blocks_per_chunk: int,
    kept_per_chunk: int,
    total_items: int,
    covered_tokens: int,
    maximum: Callable[[Any, int], Any] = _identity_max,
    minimum: Callable[[Any, int], Any] = _identity_min,
) -> Any:
    """The first moved item of a load with a prefix skip of ``skip`` tokens (SEMANTICS.md
    section 7): ``max(lower_bound, prefix items)`` clamped to ``total_items``.

    Only ``+ - * //`` and ``maximum(value, int)`` / ``minimum(value, int)`` touch ``skip``
    (always as their first argument), so the same code runs on Python ints and on device
    scalars (``jnp.maximum``; ``lambda a, b: a.clamp(min=b)`` for torch). A skip outside
    ``[0, covered_tokens]`` is clamped (host skips are refused before this runs).
    """
    skip = minimum(maximum(skip, 0), covered_tokens)
    blocks = skip // tokens_per_block  # whole blocks, rounded down
    whole = blocks // blocks_per_chunk
    rest = blocks - whole * blocks_per_chunk  # blocks into the last, partly skipped chunk
    # Of a chunk's last ``kept`` blocks, those among the first ``rest`` blocks are skipped.
    items = whole * kept_per_chunk + maximum(rest - (blocks_per_chunk - kept_per_chunk), 0)
    return minimum(maximum(items, lower_bound), total_items)


def first_item_for_skip(
    group: GroupTransfer,
    skip: Any,
    maximum: Callable[[Any, int], Any] = _identity_max,
    minimum: Callable[[Any, int], Any] = _identity_min,
) -> Any:
    """The real first item of ``group`` for a load skipping ``skip`` tokens, where
    ``group.first_item`` is the window skip alone (a plan whose ``skip_tokens`` is set).

    ``maximum(a, b)`` / ``minimum(a, b)`` get the (possibly device) value first and a Python
    int second. The planner uses the same function for host skips.
    """
    return skip_first_item(
        skip=skip,
        lower_bound=group.first_item,
        tokens_per_block=group.tokens_per_block,
        blocks_per_chunk=group.blocks_per_chunk,
        kept_per_chunk=group.kept_per_chunk,
        total_items=group.num_chunks * group.kept_per_chunk,
        covered_tokens=group.num_chunks * group.blocks_per_chunk * group.tokens_per_block,
        maximum=maximum,
        minimum=minimum,
    )
