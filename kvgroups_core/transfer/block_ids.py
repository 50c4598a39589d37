"""Block ids of one call, per engine group: host ids checked and made int64, device ids kept.

An engine passes ids flat (one engine group only), as a list indexed by engine group id, or as
a mapping engine group id -> ids (SEMANTICS.md section 7). Host ids (lists, NumPy arrays, CPU
tensors, concrete JAX arrays) become int64 NumPy arrays here, with a typed error for anything
that is not an exact integer id. Device-resident or traced ids (``Backend.device_ids_spec``
not None) are checked only for static facts and passed on untouched, so no call synchronises.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import numpy as np

from kvgroups_core.errors import (
    KVGroupsError,
    KVGroupsIndexError,
    KVGroupsTypeError,
    KVGroupsValueError,
)

DEVICE_ID_DTYPES = ("int32", "int64")
_INT64_MIN, _INT64_LIMIT = -(2**63), 2**63

IdsSpec = Callable[[Any], "tuple[str, tuple[int, ...]] | None"]


class BlockIds:
    """The normalized ids of one call: ``ids[engine_group]`` (int64 NumPy, or the caller's
    device array when ``device`` is True) and ``lengths[engine_group]``."""

    __slots__ = ("ids", "lengths", "device")

    def __init__(self, ids: dict[int, Any], lengths: dict[int, int], device: bool) -> None:
        self.ids = ids
        self.lengths = lengths
        self.device = device


def _bad_element(values: Any, what: str) -> Exception:
    """The typed error for the first element of a host sequence that is not an int64 id."""
    for i, v in enumerate(values):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            return KVGroupsTypeError(
                f"{what}: expected integer block ids, got {type(v).__name__} {v!r} at position {i}"
            )
        if not _INT64_MIN <= int(v) < _INT64_LIMIT:
            return KVGroupsIndexError(
                f"{what}: expected block ids that fit int64, got {int(v)} at position {i}"
            )
    return KVGroupsTypeError(f"{what}: expected a 1-D sequence of ints, got {values!r}")


def host_id_array(ids: Any, what: str) -> np.ndarray:
    """``ids`` (a host sequence or array) as a 1-D int64 array, refusing bools, floats,
    values outside int64, uint64 values that would wrap (reported as given) and masked
    arrays (whose mask ``np.asarray`` would drop)."""
    if isinstance(ids, (list, tuple, range)):
        if not isinstance(ids, range):
            kinds = set(map(type, ids))
            if bool in kinds or np.bool_ in kinds:
                raise _bad_element(ids, what)
        try:
            arr = np.asarray(ids)
        except (TypeError, ValueError, OverflowError) as exc:
            raise KVGroupsTypeError(
                f"{what}: expected a 1-D sequence of ints, got {ids!r}"
            ) from exc
        if arr.size and arr.dtype.kind not in "iu" and arr.ndim == 1:
            raise _bad_element(ids, what)  # floats, or ints beyond int64 (object / float64)
    else:
        if type(ids) is not np.ndarray and isinstance(ids, np.ma.MaskedArray):
            # np.asarray drops the mask, so masked-out entries would become real block ids.
            raise KVGroupsTypeError(
                f"{what}: expected a plain array of block ids, got a masked array "
                f"{describe_value(ids)} (pass ids.compressed() to drop the masked entries)"
            )
        try:
            arr = np.asarray(ids)
        except Exception as exc:  # noqa: BLE001 - a framework's own refusal, typed here
            raise KVGroupsTypeError(
                f"{what}: expected a 1-D array of ints, got {describe_value(ids)} ({exc})"
            ) from exc
    if arr.size == 0 and arr.ndim == 1:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise KVGroupsTypeError(
            f"{what}: expected a 1-D sequence of ints, got {arr.dtype} array of shape {arr.shape}"
        )
    if arr.dtype == np.uint64:
        top = int(arr.max())
        if top >= _INT64_LIMIT:
            raise KVGroupsIndexError(
                f"{what}: expected block ids that fit int64, got uint64 value {top}"
            )
    return arr.astype(np.int64, copy=False)


def describe_value(x: Any) -> str:
    """A short description of an argument for a message: its type, and the dtype, shape,
    layout and device an array reports (each only when it can be read)."""
    parts = [type(x).__name__]
    for name in ("dtype", "shape", "layout", "device"):
        try:
            value = getattr(x, name, None)
        except Exception:  # noqa: BLE001 - e.g. a nested tensor has no shape
            continue
        if value is None or (name == "layout" and str(value) == "torch.strided"):
            continue
        if name == "shape":
            try:
                value = tuple(value)
            except TypeError:
                continue
        parts.append(f"{name} {value}")
    return " ".join(parts[:1]) + (f" ({', '.join(parts[1:])})" if len(parts) > 1 else "")


def _device_ids(x: Any, spec: tuple[str, tuple[int, ...]], what: str) -> tuple[Any, int]:
    dtype, shape = spec
    if dtype not in DEVICE_ID_DTYPES:
        raise KVGroupsTypeError(
            f"{what}: expected device block ids of dtype int32 or int64, got {dtype}"
        )
    if len(shape) != 1:
        raise KVGroupsTypeError(
            f"{what}: expected a 1-D array of device block ids, got shape {tuple(shape)}"
        )
    return x, int(shape[0])


def _is_host_container(x: Any) -> bool:
    return isinstance(x, (list, tuple, range, np.ndarray))


def _one(
    x: Any,
    what: str,
    to_host: Any,
    ids_spec: IdsSpec | None,
    out: dict[int, Any],
    lengths: dict[int, int],
    kinds: set,
    key: int,
) -> None:
    if ids_spec is not None and not _is_host_container(x):
        spec = ids_spec(x)
        if spec is not None:
            out[key], lengths[key] = _device_ids(x, spec, what)
            kinds.add("device")
            return
    if to_host is not None and not _is_host_container(x):
        try:
            x = to_host(x)
        except KVGroupsError as exc:  # the backend's words, named as this argument
            raise type(exc)(f"{what}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - a framework's own refusal, typed here
            raise KVGroupsTypeError(
                f"{what}: expected a 1-D array of ints on the host, got {describe_value(x)} ({exc})"
            ) from exc
    arr = host_id_array(x, what)
    out[key], lengths[key] = arr, len(arr)
    kinds.add("host")


def _is_flat(block_ids: Any) -> bool:
    """Flat ids: an array or a sequence of scalars (not a sequence of id lists)."""
    if isinstance(block_ids, np.ndarray):
        return True
    if isinstance(block_ids, (list, tuple)):
        if not block_ids:
            return True
        first = block_ids[0]
        return np.isscalar(first) or isinstance(first, np.integer)
    return not isinstance(block_ids, Mapping)


def _engine_group_key(key: Any) -> int:
    if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer)):
        raise KVGroupsTypeError(
            f"block_ids: expected int engine group ids as keys, got {type(key).__name__} {key!r}"
        )
    return int(key)


def normalize_block_ids(
    engine_ids: tuple[int, ...],
    block_ids: Any,
    to_host: Any = None,
    ids_spec: IdsSpec | None = None,
) -> BlockIds:
    """Validate ``block_ids`` against the engine groups ``engine_ids`` (sorted, distinct) of
    the manager's kernel groups and return them per engine group.

    Flat ids need exactly one engine group. A list has at most one entry per engine group id
    (an entry at an id with no kernel group must be empty); a mapping's keys must be ints
    naming engine groups. Host and device id lists cannot be mixed in one call.
    """
    out: dict[int, Any] = {}
    lengths: dict[int, int] = {}
    kinds: set = set()
    known = set(engine_ids)
    if _is_flat(block_ids):
        if len(engine_ids) > 1:
            raise KVGroupsValueError(
                f"block_ids: expected one id list per engine group (the manager has engine "
                f"groups {list(engine_ids)}), got a flat list"
            )
        _one(
            block_ids,
            "block_ids",
            to_host,
            ids_spec,
            out,
            lengths,
            kinds,
            engine_ids[0] if engine_ids else 0,
        )
    elif isinstance(block_ids, Mapping):
        items = [(_engine_group_key(g), v) for g, v in block_ids.items()]
        missing = [g for g in engine_ids if g not in {k for k, _ in items}]
        if missing:
            raise KVGroupsValueError(
                f"block_ids: expected ids for engine groups {list(engine_ids)}, missing {missing}"
            )
        unknown = sorted(k for k, _ in items if k not in known)
        if unknown:
            raise KVGroupsValueError(
                f"block_ids: expected keys among the engine groups {list(engine_ids)}, got "
                f"unknown engine groups {unknown}"
            )
        for g, v in items:
            _one(v, f"block_ids[{g}]", to_host, ids_spec, out, lengths, kinds, g)
    else:
        limit = max(engine_ids) + 1 if engine_ids else 0
        if len(block_ids) > limit:
            raise KVGroupsValueError(
                f"block_ids: expected at most {limit} id lists (one per engine group id, the "
                f"manager has engine groups {list(engine_ids)}), got {len(block_ids)}"
            )
        if len(block_ids) < limit:
            missing = [g for g in engine_ids if g >= len(block_ids)]
            raise KVGroupsValueError(
                f"block_ids: expected ids for engine groups {list(engine_ids)}, missing {missing}"
            )
        for g, v in enumerate(block_ids):
            if g in known:
                _one(v, f"block_ids[{g}]", to_host, ids_spec, out, lengths, kinds, g)
            elif not (hasattr(v, "__len__") and len(v) == 0):  # only an empty entry is allowed
                raise KVGroupsValueError(
                    f"block_ids[{g}]: expected no ids for engine group {g} (no kernel group "
                    f"has it; the manager has engine groups {list(engine_ids)}), got "
                    f"{type(v).__name__}"
                )
    if len(kinds) > 1:
        raise KVGroupsTypeError(
            "block_ids: expected every id list on the host or every one on the device, got "
            "both host and device id lists"
        )
    return BlockIds(out, lengths, kinds == {"device"})
